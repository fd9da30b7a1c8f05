"""The bf16 expert weight gradient (`grouped_gemm.ragged_weight_grad`: out[e] = a[rows_e]^T @ b[rows_e] over
ragged row groups, stored or added into an fp32 main gradient) as a warp-specialised Gluon kernel for Hopper
(sm_90a).

Why: the weight gradients are issue 20 item 3's first target (the Mixtral shape's weight-gradient GEMM ran at
about 52-69% of the measured matmul ceiling, its row GEMMs at 80-91%), and Triton 3.6 runs no warp specialisation
on sm_90: one program's warps issue the loads, the MMAs and the epilogue in turn. This kernel is `fp8_gluon`'s
FP8 weight gradient without the scales, over bf16 rows as they come (not padded token groups):
- work items (expert, KA tile of 128 rows, C tile of block_n), `gluon_ragged.wgrad_item`'s order, one
  persistent program per SM; each item sums over its expert's row groups (several with banded offsets:
  `weights` E_W < groups, ascending g) in 64-row chunks, then (`second`) the second row set's group.
- producer partition, 1 warp: per chunk, waits for a free stage of the ring, then TMA-loads two A boxes
  [64 rows, 64 KA] (one per consumer: a [64, 128] box's rows are 256 bytes, wider than a 128-byte swizzle row)
  and the B box [64 rows, block_n] onto the stage's `ready` mbarrier. Boxes past the tensors' ends are
  zero-filled by TMA.
- consumer partitions, two warpgroups (KA rows 0-63 and 64-127 of the item), sharing each stage's B: per
  chunk, wait for the stage, issue the wgmma a_box^T @ b_box (A read transposed from shared memory: bf16 takes
  either major) into the fp32 sum, one left in flight, and release the previous chunk's stage once it has
  completed. A group's last chunk, partial, holds the next group's rows (or, past the last group, whatever
  the tensors hold there: rows a capacity buffer never wrote): before its wgmma each consumer zeroes the rows
  past the group's end in its own A box, the first consumer in the shared B box too (the second waits for that
  on the stage's `zeroed` mbarrier, which the first arrives on at every chunk), each fenced for the async proxy,
  so that neither a finite neighbour's rows nor a NaN left in memory reach the sum (the Triton kernel masks the
  same rows in its loads). Only the [16, 64] pieces holding such rows are rewritten.
- epilogue: `gluon_ragged.store_weight_grad`, the FP8 kernel's: stored or added from registers (relaxed fp32
  reductions, `atomic`; else loaded, added and stored), or through a [64, block_n] shared-memory buffer per
  consumer by a TMA store or (with `atomic`) reduce-add (`tma_epilogue`) drained under the next item's chunks.

Requirements (ValueError naming the fix otherwise; `takes` answers without raising, and
`grouped_gemm.ragged_weight_grad` then runs our Triton kernel): a and b bf16 or fp16 of one dtype with unit
column stride and 16-byte-aligned rows, offsets int32, block_n in (64, 128, 256), the ring (and the TMA
epilogue's buffers) within shared memory. `TileConfig.gluon` runs it where `bench tune-experts` measures it
faster than our Triton tiles. Measured (docs/benchmarks.md): its GPU tests passed at 20f8b93 on an H100 (NaN rows
past the last group included, in a captured training step too), at fb2f8c9 (the `zeroed` barrier) in session 44,
and at 3334496 (the paired form's wgmmas no longer serialised) on an H200 in session 47; there the tuner put it
ahead of Triton on the Qwen3 config's paired w2 gradient (2.270 against 2.306 ms), the H200 table's one weight
gradient that names it; on the H100 (session 43) its best tile was 5-15% behind on the Qwen3 and Mixtral weight
gradients (Mixtral's w2: 3.65 against 3.39 ms), and under ncu at 128 x 256 on Mixtral's w2 it ran 3.10 ms against
Triton's 3.13.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from disagmoe.kernels.gluon_ragged import (
    CONSUMER_REGS,
    CONSUMER_ROWS,
    GROUP_M,
    MAXNREG,
    OUT_DTYPES,
    PRODUCER_REGS,
    SHARED_MEMORY_BYTES,
    store_weight_grad,
    tma_rows,
    wgrad_item,
    wgrad_tiles,
    wgrad_tma_epilogue_takes,
)
from disagmoe.kernels.gluon_rows import OPERAND_DTYPES, runs_here

BLOCK_NS = (64, 128, 256)  # the C tile: a wgmma's N (at most 256), block_n / 2 fp32 registers a consumer thread
ITEM_ROWS = 2 * CONSUMER_ROWS  # KA rows an item: two consumer warpgroups of 64
CHUNK = 64  # rows (the reduction) a ring stage: 128-byte rows of bf16 in the B box, the widest swizzle row
_ROWS = gl.constexpr(CONSUMER_ROWS)
_CHUNK = gl.constexpr(CHUNK)


def stage_bytes(block_n: int, element_bytes: int = 2) -> int:
    """Shared memory of one ring stage: two A boxes [64, 64] and the B box [64, block_n]."""
    return (ITEM_ROWS + block_n) * CHUNK * element_bytes


def epilogue_buffer_bytes(block_n: int, out_bytes: int) -> int:
    """Shared memory of the TMA epilogue: one [64, block_n] buffer of out's elements per consumer."""
    return ITEM_ROWS * block_n * out_bytes


def max_stages(block_n: int, tma_epilogue: bool = False, out_bytes: int = 4) -> int:
    """The deepest ring that fits a Hopper block beside the TMA epilogue's buffers (if any)."""
    epilogue = epilogue_buffer_bytes(block_n, out_bytes) if tma_epilogue else 0
    return (SHARED_MEMORY_BYTES - epilogue) // stage_bytes(block_n)


@gluon.jit
def _load_groups(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, first, E, E_W, pid_k, pid_n,
                 count, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producer's loads of one row set for one item: per group g = first, first + E_W, ... < E and per
    64-row chunk, into the next free stage, the item's two A boxes and its B box on the stage's `ready`
    barrier. Returns the stages used so far."""
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + b_desc.block_type.nbytes
    for group in range(first, E, E_W):
        start = gl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
        end = gl.load(offsets_ptr + group)
        for r0 in range(start, end, _CHUNK):
            stage = count % STAGES
            mbarrier.wait(empty_bars.index(stage), ((count // STAGES) & 1) ^ 1)
            ready = ready_bars.index(stage)
            mbarrier.expect(ready, nbytes)
            k0 = pid_k * (2 * _ROWS)
            tma.async_copy_global_to_shared(a_desc, [r0, k0], ready, a_bufs.index(2 * stage))
            tma.async_copy_global_to_shared(a_desc, [r0, k0 + _ROWS], ready, a_bufs.index(2 * stage + 1))
            tma.async_copy_global_to_shared(b_desc, [r0, pid_n * BLOCK_N], ready, b_bufs.index(stage))
            count += 1
    return count


@gluon.jit
def _producer(a_desc, b_desc, a2_desc, b2_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, offsets2_ptr, E,
              E_W, KA, C, num_programs, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
              PAIRED: gl.constexpr):
    """The TMA warp: per item, the chunks of its expert's groups, then with PAIRED the second set's group."""
    tiles_k, tiles_n, per_expert = wgrad_tiles(KA, C, 2 * _ROWS, BLOCK_N)
    count = 0
    for item in range(gl.program_id(0), E_W * per_expert, num_programs):
        expert, pid_k, pid_n = wgrad_item(item, per_expert, tiles_k, tiles_n, GROUP_M)
        count = _load_groups(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, expert, E, E_W,
                             pid_k, pid_n, count, BLOCK_N, STAGES)
        if PAIRED:
            count = _load_groups(a2_desc, b2_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets2_ptr, expert,
                                 E_W, E_W, pid_k, pid_n, count, BLOCK_N, STAGES)


@gluon.jit
def _zero_rows_past(buf, valid):
    """Rows `valid` and on of a [64, W] shared-memory box set to zero, in [16, 64] pieces (16 rows of a 128-byte
    swizzle row each) of which only those holding such rows are read, cleared past `valid` and written back."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    PIECE_ROWS: gl.constexpr = 16
    rows = gl.arange(0, PIECE_ROWS, layout=gl.SliceLayout(1, layout))
    for r in gl.static_range(buf.shape[0] // PIECE_ROWS):
        if (r + 1) * PIECE_ROWS > valid:
            keep = (r * PIECE_ROWS + rows < valid)[:, None]
            for c in gl.static_range(buf.shape[1] // _CHUNK):
                piece = buf.slice(r * PIECE_ROWS, PIECE_ROWS, dim=0).slice(c * _CHUNK, _CHUNK, dim=1)
                values = piece.load(layout)
                piece.store(gl.where(keep, values, gl.zeros_like(values)))


@gluon.jit
def _sum_groups(a_bufs, b_bufs, ready_bars, empty_bars, zeroed_bars, offsets_ptr, first, E, E_W, acc_MN, count,
                item_first, CONSUMER: gl.constexpr, STAGES: gl.constexpr):
    """One consumer's sums over one row set's chunks of an item (the producer's `_load_groups` order): per chunk
    the wgmma into acc, then the previous chunk's stage released once that wgmma has completed (none before the
    item's first chunk, `item_first`). A group's last chunk, partial: each consumer first zeroes the rows past the
    group's end in its own A box; the first consumer (0) in the shared B box too, fenced for the async proxy, and
    it arrives on the stage's `zeroed` barrier at every chunk (so its phase is the stage's use count); the second
    waits there before its wgmma reads B. Returns (acc, the stages used so far)."""
    for group in range(first, E, E_W):
        start = gl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
        end = gl.load(offsets_ptr + group)
        for r0 in range(start, end, _CHUNK):
            stage = count % STAGES
            phase = (count // STAGES) & 1
            mbarrier.wait(ready_bars.index(stage), phase)
            a_buf = a_bufs.index(2 * stage + CONSUMER)
            b_buf = b_bufs.index(stage)
            partial = end - r0 < _CHUNK  # the rows past the group's end (the next group's) must not count
            if partial:
                _zero_rows_past(a_buf, end - r0)
                if CONSUMER == 0:
                    _zero_rows_past(b_buf, end - r0)
                fence_async_shared()  # the threads' stores before the wgmmas' (async proxy) reads
            if CONSUMER == 0:
                mbarrier.arrive(zeroed_bars.index(stage))
            elif partial:
                mbarrier.wait(zeroed_bars.index(stage), phase)  # B's rows past the end zeroed by consumer 0
            acc_MN = warpgroup_mma(a_buf.permute((1, 0)), b_buf, acc_MN, is_async=True)
            acc_MN = warpgroup_mma_wait(1, deps=(acc_MN, ))  # the previous chunk's wgmma has completed
            if count > item_first:
                mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES))
            count += 1
    return acc_MN, count


@gluon.jit
def _consumer(a_bufs, b_bufs, ready_bars, empty_bars, zeroed_bars, out_ptr, out_desc, c_bufs, offsets_ptr,
              offsets2_ptr, E, E_W, KA, C, num_programs, stride_oe, stride_ok, stride_oc, CONSUMER: gl.constexpr,
              BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr,
              ATOMIC: gl.constexpr, TMA_EPILOGUE: gl.constexpr, PAIRED: gl.constexpr):
    """One warpgroup's KA rows CONSUMER * 64 + [0, 64) of every item: the sums over its chunks (`_sum_groups`;
    with PAIRED the second set's after the first's, into the same sum), the last chunk's stage released, then
    `store_weight_grad` (zeros for an expert without rows)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    tiles_k, tiles_n, per_expert = wgrad_tiles(KA, C, 2 * _ROWS, BLOCK_N)
    count = 0
    for item in range(gl.program_id(0), E_W * per_expert, num_programs):
        expert, pid_k, pid_n = wgrad_item(item, per_expert, tiles_k, tiles_n, GROUP_M)
        item_first = count
        acc_MN = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
        acc_MN, count = _sum_groups(a_bufs, b_bufs, ready_bars, empty_bars, zeroed_bars, offsets_ptr, expert, E,
                                    E_W, acc_MN, count, item_first, CONSUMER, STAGES)
        if PAIRED:
            # the first set's last wgmma landed before its sum enters the second set's loop: carried across the
            # two loops in flight, ptxas copied its accumulator registers under it and serialised every wgmma of
            # the kernel (its C7515 advisory, found in session 45)
            acc_MN = warpgroup_mma_wait(0, deps=(acc_MN, ))
            acc_MN, count = _sum_groups(a_bufs, b_bufs, ready_bars, empty_bars, zeroed_bars, offsets2_ptr, expert,
                                        E_W, E_W, acc_MN, count, item_first, CONSUMER, STAGES)
        acc_MN = warpgroup_mma_wait(0, deps=(acc_MN, ))
        if count > item_first:
            mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES))
        store_weight_grad(acc_MN, expert, pid_k * (2 * _ROWS) + CONSUMER * _ROWS, pid_n * BLOCK_N, KA, C, out_ptr,
                          out_desc, c_bufs, stride_oe, stride_ok, stride_oc, CONSUMER, BLOCK_N, ACCUMULATE, ATOMIC,
                          TMA_EPILOGUE)
    if TMA_EPILOGUE:
        tma.store_wait(0)  # the last item's TMA operation has read its buffer before shared memory goes


@gluon.jit
def _gluon_weight_grad_kernel(a_desc, b_desc, a2_desc, b2_desc, out_desc, out_ptr, offsets_ptr, offsets2_ptr, E, E_W,
                              KA, C, num_programs, stride_oe, stride_ok, stride_oc, BLOCK_N: gl.constexpr,
                              GROUP_M: gl.constexpr, STAGES: gl.constexpr, ACCUMULATE: gl.constexpr,
                              ATOMIC: gl.constexpr, TMA_EPILOGUE: gl.constexpr, PAIRED: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr):
    # Contract: `gluon_weight_grad`'s, checked there. The ring: 2 x STAGES A boxes (stage s's at 2s and 2s + 1,
    # one per consumer) and STAGES B boxes, each stage's `empty` barrier counting both consumers and its `zeroed`
    # barrier the first consumer's arrival (`_sum_groups`). TMA_EPILOGUE:
    # out_desc ([64, BLOCK_N] boxes of out seen as [E_W x KA, C]) and a buffer per consumer; else None. PAIRED:
    # the second row set's descriptors and offsets (one group an expert), else None.
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    ready_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    zeroed_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready_bars.index(s), count=1)
        mbarrier.init(empty_bars.index(s), count=2)
        mbarrier.init(zeroed_bars.index(s), count=1)
    fence_async_shared()  # the initialisations before any TMA completes on them (`fp8_gluon.FENCE_BARRIER_INIT`)
    if TMA_EPILOGUE:
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    else:
        c_bufs: gl.constexpr = None
    gl.warp_specialize([
        (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, zeroed_bars, out_ptr, out_desc, c_bufs, offsets_ptr,
                     offsets2_ptr, E, E_W, KA, C, num_programs, stride_oe, stride_ok, stride_oc, gl.constexpr(0),
                     BLOCK_N, GROUP_M, STAGES, ACCUMULATE, ATOMIC, TMA_EPILOGUE, PAIRED)),
        (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, zeroed_bars, out_ptr, out_desc, c_bufs, offsets_ptr,
                     offsets2_ptr, E, E_W, KA, C, num_programs, stride_oe, stride_ok, stride_oc, gl.constexpr(1),
                     BLOCK_N, GROUP_M, STAGES, ACCUMULATE, ATOMIC, TMA_EPILOGUE, PAIRED)),
        (_producer, (a_desc, b_desc, a2_desc, b2_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr,
                     offsets2_ptr, E, E_W, KA, C, num_programs, BLOCK_N, GROUP_M, STAGES, PAIRED)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _by_tma(tma_epilogue: bool, accumulate: bool, atomic: bool, ka: int, cols: int, out: torch.Tensor | None) -> bool:
    """Whether the TMA epilogue writes `out` (None: the fp32 out the launch makes): asked, and out takes a
    descriptor (`wgrad_tma_epilogue_takes`); an add into a main gradient only where `atomic` allows a reduction
    (TMA's reduce-add, like the fp32 atomics, flushes denormals; without `atomic` the register epilogue loads,
    adds and stores: the Triton kernel's exact sum)."""
    if not tma_epilogue or (accumulate and not atomic):
        return False
    if out is None:
        return ka % CONSUMER_ROWS == 0 and (cols * 4) % 16 == 0
    return wgrad_tma_epilogue_takes(out)


def _problems(a_NK: torch.Tensor, b_NC: torch.Tensor, offsets_E: torch.Tensor, block_n: int, stages: int,
              out: torch.Tensor | None, accumulate: bool, tma_epilogue: bool, weights: int | None,
              second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None, atomic: bool = True,
              group_m: int = GROUP_M) -> list[str]:
    """What keeps this launch from the kernel, each with its fix (empty: it takes it)."""
    problems = []
    row_sets = [("a", a_NK), ("b", b_NC)] + ([] if second is None else [("a2", second[0]), ("b2", second[1])])
    if a_NK.dtype not in OPERAND_DTYPES or any(t.dtype != a_NK.dtype for _, t in row_sets):
        problems.append(f"the row sets must share a dtype among {list(OPERAND_DTYPES)} (got "
                        f"{ {name: t.dtype for name, t in row_sets} }): run grouped_gemm.ragged_weight_grad's Triton "
                        f"kernel")
    for name, t in row_sets:
        if t.dim() != 2 or not tma_rows(t):
            problems.append(f"{name} must be 2-D with unit column stride and 16-byte-aligned rows (TMA): pass "
                            f"{name}.contiguous(); got strides {t.stride()}")
    if a_NK.shape[0] != b_NC.shape[0]:
        problems.append(f"a [N, KA] and b [N, C] must hold the same rows; got {tuple(a_NK.shape)} and "
                        f"{tuple(b_NC.shape)}")
    if block_n not in BLOCK_NS:
        problems.append(f"block_n in {BLOCK_NS} (a wgmma's N); got {block_n}")
    groups = offsets_E.shape[0] if offsets_E.dim() == 1 else 0
    experts = weights or groups
    if offsets_E.dtype != torch.int32 or groups == 0 or groups % experts:
        problems.append(f"offsets_E must be int32 cumulative rows of a multiple of weights={experts} groups; got "
                        f"{offsets_E.dtype} {tuple(offsets_E.shape)}")
    if second is not None:
        a2, b2, offsets2 = second
        if groups != experts or offsets2.shape != (experts, ) or offsets2.dtype != torch.int32:
            problems.append(f"second pairs one group an expert with one group an expert (not banded): offsets and "
                            f"offsets2 int32 of {experts}; got {tuple(offsets_E.shape)} and {tuple(offsets2.shape)}")
        if a2.shape[1:] != a_NK.shape[1:] or b2.shape[1:] != b_NC.shape[1:] or a2.shape[0] != b2.shape[0]:
            problems.append(f"second's rows must have a's and b's widths; got {tuple(a2.shape)}, {tuple(b2.shape)}")
    shape = (experts, a_NK.shape[1], b_NC.shape[1])
    if accumulate and out is None:
        problems.append("accumulate=True adds into `out`: give the fp32 main gradient")
    if out is not None and (out.shape != shape or out.dtype not in OUT_DTYPES
                            or (accumulate and out.dtype != torch.float32)):
        problems.append(f"out must be [E_W, KA, C] = {shape}, fp32 (a main gradient, accumulate) or bf16/fp16 (a "
                        f"fresh gradient); got {out.dtype} {tuple(out.shape)}")
    if group_m < 1:
        problems.append(f"group_m (KA tiles sharing C tiles in the item order) must be at least 1; got {group_m}")
    if block_n in BLOCK_NS:
        by_tma = _by_tma(tma_epilogue, accumulate, atomic, a_NK.shape[1], b_NC.shape[1], out)
        deepest = max_stages(block_n, by_tma, 4 if out is None else out.element_size())
        if not 2 <= stages <= deepest:
            problems.append(f"stages={stages}: the ring needs at least 2 and at most {deepest} at block_n {block_n}"
                            f"{' beside the TMA epilogue' if by_tma else ''} ({stage_bytes(block_n)} bytes a "
                            f"stage in {SHARED_MEMORY_BYTES})")
    return problems


def takes(a_NK: torch.Tensor, b_NC: torch.Tensor, offsets_E: torch.Tensor, *, block_n: int = 128, stages: int = 4,
          out: torch.Tensor | None = None, accumulate: bool = False, tma_epilogue: bool = False,
          weights: int | None = None, second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
          atomic: bool = True, group_m: int = GROUP_M) -> bool:
    """Whether `gluon_weight_grad` can run this launch here: a Hopper GPU (not the interpreter) and
    `_problems`' rules, answered without raising."""
    return runs_here(a_NK) and not _problems(a_NK, b_NC, offsets_E, block_n, stages, out, accumulate, tma_epilogue,
                                             weights, second, atomic, group_m)


def _rows_descriptors(a_NK: torch.Tensor, b_NC: torch.Tensor, block_n: int) -> tuple[TensorDescriptor, ...]:
    """A [N, KA] in [64, 64] boxes (one consumer's KA rows of a chunk), B [N, C] in [64, block_n] boxes."""
    dtype = OPERAND_DTYPES[a_NK.dtype]
    a_box, b_box = [CHUNK, CONSUMER_ROWS], [CHUNK, block_n]
    return (TensorDescriptor(a_NK, list(a_NK.shape), [a_NK.stride(0), 1], a_box,
                             gl.NVMMASharedLayout.get_default_for(a_box, dtype)),
            TensorDescriptor(b_NC, list(b_NC.shape), [b_NC.stride(0), 1], b_box,
                             gl.NVMMASharedLayout.get_default_for(b_box, dtype)))


def gluon_weight_grad(
    a_NK: torch.Tensor,
    b_NC: torch.Tensor,
    offsets_E: torch.Tensor,
    *,
    weights: int | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    atomic: bool = True,
    tma_epilogue: bool = False,
    block_n: int = 128,
    stages: int = 4,
    group_m: int = GROUP_M,
    num_programs: int | None = None,
    second: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """`grouped_gemm.ragged_weight_grad`'s sums, warp-specialised (module docstring): out[e] = sum over groups
    g = e mod E_W of a[rows_g]^T @ b[rows_g], [E_W, KA, C] (zeros for an expert without rows), fp32, or the
    dtype of a given `out`; `accumulate`: added into `out` (an fp32 main gradient; `atomic`: by fp32
    reductions, the same sum bit for bit but for denormals, which the GPU's reductions flush to zero).
    `tma_epilogue`: each consumer's sums written through shared memory and stored, or (accumulate with `atomic`:
    a reduction too) reduce-added, by TMA where `out` takes a descriptor (`gluon_ragged.wgrad_tma_epilogue_takes`);
    else the register epilogue, as without it. `second` = (a2_NK, b2_NC, offsets2_E): a second row
    set over the same experts (one group each, not banded), e.g. the next micro-batch's rows
    (`kernels.wgrad_pairs`): summed after the first's into the same fp32 sum, one write of out for both.
    `num_programs`: persistent programs (default one per SM; give it on a CPU, where it can only be compiled)."""
    problems = _problems(a_NK, b_NC, offsets_E, block_n, stages, out, accumulate, tma_epilogue, weights, second,
                         atomic, group_m)
    if problems:
        raise ValueError("gluon_weight_grad cannot take this launch: " + "; ".join(problems))
    groups = offsets_E.shape[0]
    experts = weights or groups
    ka, cols = a_NK.shape[1], b_NC.shape[1]
    if out is None:
        out = torch.empty((experts, ka, cols), dtype=torch.float32, device=a_NK.device)
    if out.numel() == 0:
        return out
    if a_NK.shape[0] == 0:  # a TMA view needs rows: the second set alone (the same sum), or none
        if second is not None and second[0].shape[0]:
            return gluon_weight_grad(second[0], second[1], second[2], weights=weights, out=out, accumulate=accumulate,
                                     atomic=atomic, tma_epilogue=tma_epilogue, block_n=block_n, stages=stages,
                                     group_m=group_m, num_programs=num_programs)
        if not accumulate:
            out.zero_()
        return out
    descriptors = _rows_descriptors(a_NK, b_NC, block_n)
    second_descriptors, offsets2_E = (None, None), None
    if second is not None:
        a2, b2, offsets2_E = second
        second_descriptors = _rows_descriptors(a2, b2, block_n) if a2.shape[0] else descriptors
    by_tma = _by_tma(tma_epilogue, accumulate, atomic, ka, cols, out)
    out_desc = None
    if by_tma:
        out_box = [CONSUMER_ROWS, block_n]
        out_desc = TensorDescriptor(out.view(experts * ka, cols), [experts * ka, cols], [cols, 1], out_box,
                                    gl.NVMMASharedLayout.get_default_for(out_box, OUT_DTYPES[out.dtype]))
    programs = num_programs or torch.cuda.get_device_properties(a_NK.device).multi_processor_count
    _gluon_weight_grad_kernel[(programs, )](
        *descriptors, *second_descriptors, out_desc, out, offsets_E, offsets2_E, groups, experts, ka, cols, programs,
        *out.stride(), BLOCK_N=block_n, GROUP_M=group_m, STAGES=stages, ACCUMULATE=accumulate, ATOMIC=atomic,
        TMA_EPILOGUE=by_tma, PAIRED=second is not None, PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS,
        num_warps=4, maxnreg=MAXNREG)
    return out
