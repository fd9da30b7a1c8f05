"""The pieces the warp-specialised Gluon row GEMMs for Hopper share (`fp8_gluon`'s FP8 kernels,
`gluon_rows`' bf16 one): the persistent work list over ragged row groups (items of (group, row tile,
column tile), found alike by every partition from offsets_E), the TMA ring of A and B boxes with its
`ready` and `empty` mbarriers, the epilogues (the masked store from the wgmma layout, the TMA store
through a shared-memory buffer), the register budgets of two consumer warpgroups beside one producer
warp, the TMA rules an operand must meet, and the weight gradients' item order and epilogue (`fp8_gluon`'s
FP8 one over token groups, `gluon_wgrad`'s bf16 one over ragged rows). Schedules and measurements: the kernels'
modules."""

from __future__ import annotations

import torch
from triton._C.libtriton import ir as triton_ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from disagmoe.kernels.tile_configs import HOPPER_SHARED_MEMORY_BYTES

CONSUMER_ROWS = 64  # a warpgroup's wgmma rows (M = 64 per warpgroup on sm_90)
GROUP_M = 8  # row tiles sharing column tiles in the item order, as TileConfig's default
# setmaxnreg budgets (DeepGEMM's): 12 warps (two consumer warpgroups, the producer's warp rounded up
# to a warpgroup) x 32 threads x MAXNREG fit the 64K-register file; the default partition (the
# first consumer) receives what the others leave: (12 x 168 - 4 x 232 - 4 x 40) / 4 = 232. With 24
# for the producer (Gluon's tutorials), ptxas spilled 8 bytes at 128 x 128.
PRODUCER_REGS, CONSUMER_REGS, MAXNREG = 40, 232, 168
SHARED_MEMORY_BYTES = HOPPER_SHARED_MEMORY_BYTES  # sm_90's per-block limit (the barriers take a few bytes more)
# out's dtypes as the TMA-store epilogue's descriptor names them
OUT_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}


def epilogue_bytes(block_m: int, block_n: int, out_bytes: int) -> int:
    """Shared memory of the TMA-store epilogue: one [64, block_n] buffer of out's elements (`out_bytes`
    each) per consumer warpgroup (one at block_m 64, two at 128 and at 256, whose two waves take turns)."""
    return min(block_m, 2 * CONSUMER_ROWS) * block_n * out_bytes


@gluon.jit
def _add(x, y):
    return x + y


@gluon.jit
def group_item_ends(offsets_ptr, E, tiles_n, BLOCK_M: gl.constexpr, E_POW2: gl.constexpr, WARPS: gl.constexpr):
    """Inclusive prefix sum of work items (row tiles x column tiles) per group, in the calling
    partition's registers (`grouped_gemm._item_table`'s sums; WARPS: the partition's warps)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    idx = gl.arange(0, E_POW2, layout=layout)
    ends = gl.load(offsets_ptr + idx, mask=idx < E, other=0)
    starts = gl.load(offsets_ptr + idx - 1, mask=(idx > 0) & (idx < E), other=0)
    counts = gl.where(idx < E, ends - starts, 0)
    return gl.associative_scan(gl.cdiv(counts, BLOCK_M) * tiles_n, 0, _add)


@gluon.jit
def tile_of(item, item_ends, offsets_ptr, tiles_n, BLOCK_M: gl.constexpr, GROUP_M: gl.constexpr):
    """(group, first row, the group's row end, column tile) of work item `item`: the item order of
    `_fp8_rows_gemm_kernel` (groups in turn, GROUP_M row tiles sharing column tiles:
    `grouped_gemm._swizzle`), computed alike by every partition."""
    done = item_ends <= item
    group = gl.sum(done.to(gl.int32), axis=0)
    item_start = gl.max(gl.where(done, item_ends, 0), axis=0)
    row_start = gl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
    row_end = gl.load(offsets_ptr + group)
    local = item - item_start
    per_group = GROUP_M * tiles_n
    first_m = (local // per_group) * GROUP_M
    group_rows = gl.minimum(gl.cdiv(row_end - row_start, BLOCK_M) - first_m, GROUP_M)
    pid_m = first_m + (local % per_group) % group_rows
    pid_n = (local % per_group) // group_rows
    return group, row_start + pid_m * BLOCK_M, row_end, pid_n


@gluon.jit
def masked_store(values_MN, out_ptr, rows, row_ok, cols, stride_om, stride_on):
    """The plain epilogue: a warpgroup's 64 rows straight from the wgmma layout, rows past the group's
    end masked off (each thread's elements on 2 rows, BLOCK_N / 8 column pairs on each: 4-byte stores
    at bf16, a warp's store instruction writing 16 bytes in each of 8 rows)."""
    out_ptrs = out_ptr + rows.to(gl.int64)[:, None] * stride_om + cols[None, :] * stride_on
    gl.store(out_ptrs, values_MN, mask=row_ok[:, None])


@gluon.jit
def store_wave(values_MN, whole, row, col, out_desc, c_buf, out_ptr, rows, row_ok, cols, stride_om, stride_on):
    """A warpgroup's 64 rows from `row` (TMA_STORE): where they lie wholly inside the group (`whole`),
    written into its epilogue buffer c_buf, fenced for the async proxy and stored by TMA (one
    [64, BLOCK_N] box of out_desc at [row, col]), not waited for: the caller waits (store_wait)
    before it writes the buffer again, an item later, so the store drains under the next item's
    main loop. Otherwise (the group's last tile, partial: a box would write the next group's rows)
    the masked store. The caller has waited for the buffer's last store where `whole`."""
    if whole:
        c_buf.store(values_MN)
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [row, col], c_buf)
    else:
        masked_store(values_MN, out_ptr, rows, row_ok, cols, stride_om, stride_on)


@gluon.jit
def ring(a_desc, b_desc, STAGES: gl.constexpr, CONSUMERS: gl.constexpr, FENCE_INIT: gl.constexpr):
    """The shared-memory ring both kernels share: STAGES stages of an A and a B TMA box, each with a
    `ready` mbarrier (the producer's one arrival with the bytes) and an `empty` one (an arrival per
    consumer warpgroup releasing it); with FENCE_INIT the initialisations fenced for the async proxy
    (`FENCE_BARRIER_INIT`)."""
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=CONSUMERS)
    if FENCE_INIT:
        fence_async_shared()
    return a_bufs, b_bufs, ready_bars, empty_bars


def tma_rows(t: torch.Tensor) -> bool:
    """Whether a 2-D operand has unit column stride and 16-byte-aligned rows (a TMA view's rules): a row
    GEMM's A, a token-group copy as `fp8.quantize_token_groups` writes it."""
    return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0


def tma_store_takes(out: torch.Tensor) -> bool:
    """Whether `out` can take the TMA-store epilogue's descriptor (`gluon_fp8_rows_gemm(tma_store=True)`):
    unit column stride, a 16-byte-aligned base and row stride (TMA's rules). Where it cannot (a column
    slice at an odd offset, a transposed view) the kernel keeps the masked store."""
    return out.stride(1) == 1 and (out.stride(0) * out.element_size()) % 16 == 0 and out.data_ptr() % 16 == 0


def wgrad_tma_epilogue_takes(out: torch.Tensor) -> bool:
    """Whether the weight gradient's TMA epilogue can write `out` ([E_W, KA, C] of `OUT_DTYPES`): contiguous,
    16-byte aligned rows, and KA a multiple of 64, so that each consumer's 64-row box of the [E_W x KA, C] view
    lies inside one expert's rows (a box past KA would write the next expert's)."""
    experts, ka, cols = out.shape
    return (out.dtype in OUT_DTYPES and out.is_contiguous() and out.data_ptr() % 16 == 0
            and (cols * out.element_size()) % 16 == 0 and ka % CONSUMER_ROWS == 0)


@gluon.jit
def store_consumer_rows(values_MN, rows, row_ok, cols, wave_row, row_end, col, out_desc, c_bufs, out_ptr, stride_om,
                        stride_on, CONSUMER: gl.constexpr, ROWS: gl.constexpr, TMA_STORE: gl.constexpr):
    """A consumer warpgroup's ROWS rows from `wave_row` of a tile's sums, in out's dtype: with TMA_STORE by
    `store_wave` through its buffer c_bufs[CONSUMER] (the buffer's last store, an item ago, waited for first
    where the rows lie wholly inside their group, which ends at `row_end`), else by the masked store."""
    values_MN = values_MN.to(out_ptr.dtype.element_ty)
    if TMA_STORE:
        whole = wave_row + ROWS <= row_end
        if whole:
            tma.store_wait(0)  # the previous item's store has read the buffer (long since: a main loop ago)
        store_wave(values_MN, whole, wave_row, col, out_desc, c_bufs.index(CONSUMER), out_ptr, rows, row_ok, cols,
                   stride_om, stride_on)
    else:
        masked_store(values_MN, out_ptr, rows, row_ok, cols, stride_om, stride_on)


@gluon.jit
def work_list(offsets_ptr, E, N, K, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, SLICE: gl.constexpr,
              E_POW2: gl.constexpr, WARPS: gl.constexpr):
    """(column tiles, `group_item_ends`, items in all, K slices of SLICE): the work every partition of a row
    GEMM walks alike (WARPS: the calling partition's warps)."""
    tiles_n = N // BLOCK_N
    item_ends = group_item_ends(offsets_ptr, E, tiles_n, BLOCK_M, E_POW2, WARPS)
    return tiles_n, item_ends, gl.max(item_ends, axis=0), K // SLICE


@builtin
def tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """The box of `tensor_desc` at `coord` += the shared-memory buffer `src`, by the TMA unit
    (cp.reduce.async.bulk.tensor .add, committed as a bulk group: `tma.store_wait` waits for its read
    of `src` as for a TMA store's). Triton 3.6's Gluon builds the op (ttng.async_tma_reduce, what
    `tl.tensor_descriptor.atomic_add` lowers to on Hopper) but exposes no function for it."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(triton_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                              src.handle)


@gluon.jit
def wgrad_tiles(KA, C, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """(KA tiles, C tiles, items an expert) of a weight gradient's work list: [KA, C] in BLOCK_M x BLOCK_N tiles."""
    tiles_k = gl.cdiv(KA, BLOCK_M)
    tiles_n = gl.cdiv(C, BLOCK_N)
    return tiles_k, tiles_n, tiles_k * tiles_n


@gluon.jit
def wgrad_item(item, per_expert, tiles_k, tiles_n, GROUP_M: gl.constexpr):
    """(expert, KA tile, C tile) of weight-gradient work item `item`: experts in turn, GROUP_M KA
    tiles sharing C tiles (`grouped_gemm._swizzle`, as the Triton weight gradients order them)."""
    expert = item // per_expert
    local = item % per_expert
    per_group = GROUP_M * tiles_n
    first_m = (local // per_group) * GROUP_M
    group_rows = gl.minimum(tiles_k - first_m, GROUP_M)
    pid_k = first_m + (local % per_group) % group_rows
    pid_n = (local % per_group) // group_rows
    return expert, pid_k, pid_n


@gluon.jit
def store_weight_grad(acc_MN, expert, row0, col0, KA, C, out_ptr, out_desc, c_bufs, stride_oe, stride_ok, stride_oc,
                      CONSUMER: gl.constexpr, BLOCK_N: gl.constexpr, ACCUMULATE: gl.constexpr, ATOMIC: gl.constexpr,
                      TMA_EPILOGUE: gl.constexpr):
    """A consumer warpgroup's 64 KA rows from `row0` (columns from col0) of expert `expert`'s weight
    gradient, its fp32 sums `acc_MN` (in the wgmma layout) stored into out [E_W, KA, C], or added
    (ACCUMULATE: an fp32 main gradient). With TMA_EPILOGUE written into this warpgroup's buffer
    c_bufs[CONSUMER] and stored or reduce-added by TMA through out_desc ([64, BLOCK_N] boxes of out seen as
    [E_W x KA, C]), not waited for until the buffer's next use an item later, so the main gradient's read
    and write run under the next item's wgmmas; else from registers (ATOMIC: by relaxed fp32 reductions,
    which wait for no read; or loaded, added and stored). Rows past KA (the last KA tile's) are not written."""
    if TMA_EPILOGUE:
        if row0 < KA:  # a wave wholly past KA has nothing to write
            c_buf = c_bufs.index(CONSUMER)
            tma.store_wait(0)  # the buffer's last TMA operation (an item ago) has read it
            c_buf.store(acc_MN.to(c_buf.dtype))  # fp32, or (a fresh gradient) the weights' bf16
            fence_async_shared()
            coord = [expert * KA + row0, col0]
            if ACCUMULATE:
                tma_reduce_add(out_desc, coord, c_buf)
            else:
                tma.async_copy_shared_to_global(out_desc, coord, c_buf)
    else:
        acc_layout: gl.constexpr = acc_MN.type.layout
        rows = row0 + gl.arange(0, acc_MN.shape[0], layout=gl.SliceLayout(1, acc_layout))
        cols = col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
        out_ptrs = (out_ptr + expert.to(gl.int64) * stride_oe + rows.to(gl.int64)[:, None] * stride_ok
                    + cols[None, :] * stride_oc)
        ok = (rows < KA)[:, None] & (cols < C)[None, :]
        if ACCUMULATE and ATOMIC:
            gl.atomic_add(out_ptrs, acc_MN, mask=ok, sem="relaxed")
        else:
            if ACCUMULATE:
                acc_MN = acc_MN + gl.load(out_ptrs, mask=ok, other=0.0)
            gl.store(out_ptrs, acc_MN.to(out_ptr.dtype.element_ty), mask=ok)
