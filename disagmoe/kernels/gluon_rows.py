"""The bf16 expert FFN's row GEMMs (`grouped_gemm.ragged_rows_gemm` with the plain epilogue: the down
projection, the gate/up projection's data gradient; and with the SwiGLU forward epilogue: the gate/up
projection) as warp-specialised Gluon kernels for Hopper (sm_90a): out[rows_g] = a[rows_g] @ b[g mod E] for
every row group g, fp32 sums over the whole K (`gluon_rows_gemm`); act = silu(gate) * up from two such sums,
the gate and up columns of w13, the pre-activations saved where asked (`gluon_swiglu_gemm`).

Why: Triton 3.6 runs no warp specialisation on sm_90 (its TTGIR keeps one partition), so our Triton
kernel's programs issue their loads, MMAs and epilogue from the same warps: each tile's epilogue (the
masked store of its rows) runs while no MMA of the program is in flight, and on the Qwen3-30B shape's
short K loops (K 768 and 1,536: 12 and 24 slices of 64) that is a large share of each tile; in the
profiled Qwen3 step (one H100) our row GEMMs ran at 1.72x their FLOPs at the measured matmul ceiling
(docs/benchmarks.md, session 41's bounds table). This kernel is `fp8_gluon`'s FP8 row GEMM without the
promotion (its partitions, ring, item order and epilogues: `gluon_ragged`):
- producer partition, 1 warp: per item (group, row tile, column tile) and per 64-deep K slice, waits
  for a free stage of the `stages`-deep ring, then TMA-loads the A box [block_m, 64] (rows past M
  zero-filled; rows past the group's end are the next group's, read and never stored) and the B box
  of the group's weight: [64, block_n] of the [E*K, N] view where b is N-major (the weights as stored:
  the down projection), [block_n, 64] of the [E*N, K] view where b is K-major (a transposed view of
  [E, N, K] storage: the gate/up weight in its data gradient).
- consumer partitions, one warpgroup per 64 rows of the tile (block_m 128: two, sharing each stage's B):
  per slice, wait for the stage, issue its wgmma into the tile's fp32 sum (one wgmma left in flight:
  `warpgroup_mma_wait(1)`), then release the previous slice's stage, whose wgmma has now completed;
  after the last slice, wait for it and release its stage. The sum stays in registers (64 x block_n
  fp32: block_n / 2 registers a thread).
- epilogue: each consumer's 64 rows, in out's dtype, by the masked store from the wgmma layout, or
  (`tma_store`) through a [64, block_n] shared-memory buffer by TMA where the rows lie wholly inside
  their group, not waited for until the buffer's next use an item later, so the store drains under
  the next item's K loop (`gluon_ragged.store_consumer_rows`).
No promotion, so both consumers' MMAs can be queued back to back: the tensor cores idle only while a
consumer stores its rows (the other keeps its MMAs going) or waits on the ring.
The SwiGLU form loads two B boxes a stage (the gate columns of the item's column tile and the up columns F
further, of w13 as stored: [E, H, 2F]), queues a slice's two wgmmas (gate, up) and keeps that pair in flight
(`warpgroup_mma_wait(2)`), then writes act = gate * sigmoid(gate) * up from the fp32 sums (as `grouped_gemm`'s
SwiGLU epilogue) and, asked, the two pre-activations by masked stores, act by the masked store or (`tma_store`)
by TMA as above: block_n in (64, 128) (two sums of block_n / 2 registers a thread), not the FP8 down GEMM's
quantised act (`ragged_rows_gemm(quantized_out=)` keeps our Triton kernel).

Requirements (ValueError naming the fix otherwise; `takes` answers without raising, and
`grouped_gemm.ragged_rows_gemm` then runs our Triton kernel): a and b bf16 or fp16 of one dtype, a
with unit column stride and 16-byte-aligned rows, b one of the two layouts above over contiguous
storage, K a positive multiple of 64 and N of block_n (a box must not reach into the next expert's
weight), block_m in (64, 128), block_n in (64, 128, 256), the ring and the store's buffers within
shared memory. Compiled for sm_90a on a CPU (tests/kernels/test_gluon_rows.py): no spill stores at
any tile either kernel takes. `TileConfig.gluon` runs it where `bench tune-experts` measures it faster than our
Triton tiles and the library's grouped GEMM. Measured (one H100, session 43, docs/benchmarks.md): its GPU tests pass
(eager and inside a captured step); it wins by 1-5% on the Qwen3 shape's down GEMM and down dgrad's plain GEMM
(one micro-batch's 512 rows an expert; on Mixtral's down dgrad too, where the library's GEMM wins) and loses
2-16% elsewhere (Mixtral's gate/up, down and gate/up dgrad 7-16%; Qwen3's gate/up and gate/up dgrad 2-5%). At the
Qwen3 config's m=2 launches (2,048 rows an expert; session 44, one H100) it wins down, down dgrad and gate/up dgrad
by 3-7% over the better of the library and our Triton kernel at 128 x 256 with the TMA store: the H100 table names it
there, and the 3-layer m=2 step went 223.9 -> 217.8 ms.
Under ncu, on the Mixtral down GEMM at 128 x 256 against our Triton kernel at the same tile and the same loads a
stage: 2.60-2.67 against 2.38 ms, its tensor pipe 86-89% active against 97% (the gap is its main loop idling, not
bandwidth; the suspects are in docs/benchmarks.md).
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from disagmoe.kernels.gluon_ragged import (
    CONSUMER_REGS,
    CONSUMER_ROWS,
    MAXNREG,
    OUT_DTYPES,
    PRODUCER_REGS,
    SHARED_MEMORY_BYTES,
    epilogue_bytes,
    masked_store,
    ring,
    store_consumer_rows,
    tile_of,
    work_list,
    tma_rows,
    tma_store_takes,
)

BLOCK_MS = (64, 128)  # one or two consumer warpgroups of CONSUMER_ROWS rows
BLOCK_NS = (64, 128, 256)  # a wgmma's N (at most 256): the sum is block_n / 2 fp32 registers a thread
SWIGLU_BLOCK_NS = (64, 128)  # the SwiGLU GEMM's two sums (gate, up): block_n fp32 registers a thread
BLOCK_K = 64  # a slice's K: 128-byte rows of bf16, the widest swizzle a TMA box row may take
OPERAND_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}
_ROWS = gl.constexpr(CONSUMER_ROWS)
_SLICE = gl.constexpr(BLOCK_K)


def ring_stage_bytes(block_m: int, block_n: int, b_boxes: int = 1, element_bytes: int = 2) -> int:
    """Shared memory of one ring stage: an A box [block_m, 64] and `b_boxes` B boxes of block_n x 64 elements
    (two for the SwiGLU form: gate and up)."""
    return (block_m + b_boxes * block_n) * BLOCK_K * element_bytes


def max_stages(block_m: int, block_n: int, out_bytes: int = 2, tma_store: bool = False, b_boxes: int = 1) -> int:
    """The deepest ring that fits a Hopper block's shared memory beside the store's buffers (`epilogue_bytes`)."""
    epilogue = epilogue_bytes(block_m, block_n, out_bytes) if tma_store else 0
    return (SHARED_MEMORY_BYTES - epilogue) // ring_stage_bytes(block_m, block_n, b_boxes)


def _stages_problems(stages: int, block_m: int, block_n: int, out_bytes: int, by_tma: bool, b_boxes: int) -> list[str]:
    """The ring depth's problem with its fix, if `stages` is shallower than 2 or deeper than `max_stages`."""
    deepest = max_stages(block_m, block_n, out_bytes, by_tma, b_boxes)
    if 2 <= stages <= deepest:
        return []
    return [f"stages={stages}: the ring needs at least 2 (loads under the MMAs) and at most {deepest} at {block_m} x "
            f"{block_n}{' beside the TMA store buffers' if by_tma else ''} "
            f"({ring_stage_bytes(block_m, block_n, b_boxes)} bytes a stage in {SHARED_MEMORY_BYTES})"]


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W, N, K, num_programs,
              E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr, B_KMAJOR: gl.constexpr):
    """The TMA warp: fills the ring's stages in item and slice order, the order the consumers drain them
    (a fresh `empty` mbarrier counts as released, hence the first wait on the opposite phase)."""
    tiles_n, item_ends, total, slices = work_list(offsets_ptr, E, N, K, BLOCK_M, BLOCK_N, _SLICE, E_POW2, 1)
    count = 0
    for item in range(gl.program_id(0), total, num_programs):
        group, row0, row_end, pid_n = tile_of(item, item_ends, offsets_ptr, tiles_n, BLOCK_M, GROUP_M)
        weight = group % E_W
        for j in range(slices):
            stage = count % STAGES
            mbarrier.wait(empty_bars.index(stage), ((count // STAGES) & 1) ^ 1)
            ready = ready_bars.index(stage)
            mbarrier.expect(ready, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, j * _SLICE], ready, a_bufs.index(stage))
            if B_KMAJOR:  # b_desc views [E*N, K]: the weight's rows are its output columns
                tma.async_copy_global_to_shared(b_desc, [weight * N + pid_n * BLOCK_N, j * _SLICE], ready,
                                                b_bufs.index(stage))
            else:  # b_desc views [E*K, N]
                tma.async_copy_global_to_shared(b_desc, [weight * K + j * _SLICE, pid_n * BLOCK_N], ready,
                                                b_bufs.index(stage))
            count += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, offsets_ptr, E, N, K, num_programs, stride_om,
              stride_on, out_desc, c_bufs, CONSUMER: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, B_KMAJOR: gl.constexpr,
              TMA_STORE: gl.constexpr):
    """One warpgroup's rows CONSUMER * 64 + [0, 64) of every item: the slices' wgmmas queued into one
    fp32 sum, each stage released once the wgmma after it is issued and it has completed, then the
    store (masked from registers, or with TMA_STORE through this warpgroup's buffer c_bufs[CONSUMER])."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    tiles_n, item_ends, total, slices = work_list(offsets_ptr, E, N, K, BLOCK_M, BLOCK_N, _SLICE, E_POW2, 4)
    count = 0
    for item in range(gl.program_id(0), total, num_programs):
        group, row0, row_end, pid_n = tile_of(item, item_ends, offsets_ptr, tiles_n, BLOCK_M, GROUP_M)
        acc_MN = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
        for j in range(slices):
            stage = count % STAGES
            mbarrier.wait(ready_bars.index(stage), (count // STAGES) & 1)
            a_view = a_bufs.index(stage).slice(CONSUMER * _ROWS, _ROWS)
            if B_KMAJOR:
                b_view = b_bufs.index(stage).permute((1, 0))  # [64, BLOCK_N], K-major as wgmma reads it
            else:
                b_view = b_bufs.index(stage)
            acc_MN = warpgroup_mma(a_view, b_view, acc_MN, is_async=True)
            acc_MN = warpgroup_mma_wait(1, deps=(acc_MN, ))  # the previous slice's wgmma has completed
            if j > 0:
                mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES))
            count += 1
        acc_MN = warpgroup_mma_wait(0, deps=(acc_MN, ))
        mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES))
        rows = (row0 + CONSUMER * _ROWS) + gl.arange(0, _ROWS, layout=row_layout)
        row_ok = rows < row_end
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        store_consumer_rows(acc_MN, rows, row_ok, cols, row0 + CONSUMER * _ROWS, row_end, pid_n * BLOCK_N, out_desc,
                            c_bufs, out_ptr, stride_om, stride_on, CONSUMER, _ROWS, TMA_STORE)
    if TMA_STORE:
        tma.store_wait(0)  # the last item's store has read its buffer before the block's shared memory goes


@gluon.jit
def _gluon_rows_gemm_kernel(a_desc, b_desc, out_desc, out_ptr, offsets_ptr, E, E_W, N, K, num_programs, stride_om,
                            stride_on, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            GROUP_M: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            CONSUMER_REGS: gl.constexpr, B_KMAJOR: gl.constexpr, TMA_STORE: gl.constexpr):
    # Contract: `gluon_rows_gemm`'s, checked there. The partitions' arguments are written inline (a
    # tuple assigned to a name first turns its constexprs into tensors: Triton 3.6's front end).
    CONSUMERS: gl.constexpr = BLOCK_M // _ROWS
    a_bufs, b_bufs, ready_bars, empty_bars = ring(a_desc, b_desc, STAGES, CONSUMERS, True)
    if TMA_STORE:  # one [64, BLOCK_N] buffer of out's dtype per consumer, in the TMA box's NVMMA layout
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [CONSUMERS] + out_desc.block_type.shape, out_desc.layout)
    else:
        c_bufs: gl.constexpr = None
    if BLOCK_M == 2 * _ROWS:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, offsets_ptr, E, N, K, num_programs,
                         stride_om, stride_on, out_desc, c_bufs, gl.constexpr(0), E_POW2, BLOCK_M, BLOCK_N, GROUP_M,
                         STAGES, B_KMAJOR, TMA_STORE)),
            (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, offsets_ptr, E, N, K, num_programs,
                         stride_om, stride_on, out_desc, c_bufs, gl.constexpr(1), E_POW2, BLOCK_M, BLOCK_N, GROUP_M,
                         STAGES, B_KMAJOR, TMA_STORE)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W, N, K,
                         num_programs, E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES, B_KMAJOR)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, out_ptr, offsets_ptr, E, N, K, num_programs,
                         stride_om, stride_on, out_desc, c_bufs, gl.constexpr(0), E_POW2, BLOCK_M, BLOCK_N, GROUP_M,
                         STAGES, B_KMAJOR, TMA_STORE)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W, N, K,
                         num_programs, E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES, B_KMAJOR)),
        ], [1], [PRODUCER_REGS])


@gluon.jit
def _swiglu_producer(a_desc, b_desc, a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W, F, K,
                     num_programs, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr):
    """`_producer` for the SwiGLU GEMM: per slice the A box and two B boxes of the [E*K, 2F] view of w13,
    the gate columns of the item's column tile and the up columns F further."""
    tiles_n, item_ends, total, slices = work_list(offsets_ptr, E, F, K, BLOCK_M, BLOCK_N, _SLICE, E_POW2, 1)
    count = 0
    for item in range(gl.program_id(0), total, num_programs):
        group, row0, row_end, pid_n = tile_of(item, item_ends, offsets_ptr, tiles_n, BLOCK_M, GROUP_M)
        weight = group % E_W
        for j in range(slices):
            stage = count % STAGES
            mbarrier.wait(empty_bars.index(stage), ((count // STAGES) & 1) ^ 1)
            ready = ready_bars.index(stage)
            mbarrier.expect(ready, a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, j * _SLICE], ready, a_bufs.index(stage))
            k_row = weight * K + j * _SLICE
            tma.async_copy_global_to_shared(b_desc, [k_row, pid_n * BLOCK_N], ready, g_bufs.index(stage))
            tma.async_copy_global_to_shared(b_desc, [k_row, F + pid_n * BLOCK_N], ready, u_bufs.index(stage))
            count += 1


@gluon.jit
def _swiglu_consumer(a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, act_ptr, h13_ptr, offsets_ptr, E, F, K,
                     num_programs, stride_am, stride_ac, stride_hm, stride_hc, act_desc, c_bufs,
                     CONSUMER: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     GROUP_M: gl.constexpr, STAGES: gl.constexpr, SAVE_H13: gl.constexpr, TMA_STORE: gl.constexpr):
    """`_consumer` with two sums, gate and up: each slice's two wgmmas queued, the previous slice's stage
    released once they have completed; then act = silu(gate) * up from the fp32 sums (as
    `grouped_gemm`'s SwiGLU epilogue), with SAVE_H13 the two pre-activations by masked stores, and act by
    the masked store or (TMA_STORE) through this warpgroup's buffer by TMA (`store_consumer_rows`)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    tiles_n, item_ends, total, slices = work_list(offsets_ptr, E, F, K, BLOCK_M, BLOCK_N, _SLICE, E_POW2, 4)
    count = 0
    for item in range(gl.program_id(0), total, num_programs):
        group, row0, row_end, pid_n = tile_of(item, item_ends, offsets_ptr, tiles_n, BLOCK_M, GROUP_M)
        gate_MN = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
        up_MN = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
        for j in range(slices):
            stage = count % STAGES
            mbarrier.wait(ready_bars.index(stage), (count // STAGES) & 1)
            a_view = a_bufs.index(stage).slice(CONSUMER * _ROWS, _ROWS)
            gate_MN = warpgroup_mma(a_view, g_bufs.index(stage), gate_MN, is_async=True)
            up_MN = warpgroup_mma(a_view, u_bufs.index(stage), up_MN, is_async=True)
            gate_MN, up_MN = warpgroup_mma_wait(2, deps=(gate_MN, up_MN))  # the previous slice's two completed
            if j > 0:
                mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES))
            count += 1
        gate_MN, up_MN = warpgroup_mma_wait(0, deps=(gate_MN, up_MN))
        mbarrier.arrive(empty_bars.index((count + STAGES - 1) % STAGES))
        rows = (row0 + CONSUMER * _ROWS) + gl.arange(0, _ROWS, layout=row_layout)
        row_ok = rows < row_end
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        act_MN = gate_MN * (1.0 / (1.0 + gl.exp(-gate_MN))) * up_MN
        if SAVE_H13:  # first: the two sums die before act's store
            masked_store(gate_MN.to(h13_ptr.dtype.element_ty), h13_ptr, rows, row_ok, cols, stride_hm, stride_hc)
            masked_store(up_MN.to(h13_ptr.dtype.element_ty), h13_ptr, rows, row_ok, cols + F, stride_hm, stride_hc)
        store_consumer_rows(act_MN, rows, row_ok, cols, row0 + CONSUMER * _ROWS, row_end, pid_n * BLOCK_N, act_desc,
                            c_bufs, act_ptr, stride_am, stride_ac, CONSUMER, _ROWS, TMA_STORE)
    if TMA_STORE:
        tma.store_wait(0)  # the last item's store has read its buffer before the block's shared memory goes


@gluon.jit
def _gluon_swiglu_gemm_kernel(a_desc, b_desc, act_desc, act_ptr, h13_ptr, offsets_ptr, E, E_W, F, K, num_programs,
                              stride_am, stride_ac, stride_hm, stride_hc, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr,
                              BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                              PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr, SAVE_H13: gl.constexpr,
                              TMA_STORE: gl.constexpr):
    # Contract: `gluon_swiglu_gemm`'s, checked there. A ring of an A box and two B boxes (gate, up) a stage;
    # act_desc: act's TMA view ([64, BLOCK_N] boxes) with TMA_STORE, else None.
    CONSUMERS: gl.constexpr = BLOCK_M // _ROWS
    a_bufs, g_bufs, ready_bars, empty_bars = ring(a_desc, b_desc, STAGES, CONSUMERS, True)
    u_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES] + b_desc.block_type.shape, b_desc.layout)
    if TMA_STORE:  # one [64, BLOCK_N] buffer of act's dtype per consumer
        c_bufs = gl.allocate_shared_memory(act_desc.dtype, [CONSUMERS] + act_desc.block_type.shape, act_desc.layout)
    else:
        c_bufs: gl.constexpr = None
    if BLOCK_M == 2 * _ROWS:
        gl.warp_specialize([
            (_swiglu_consumer, (a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, act_ptr, h13_ptr, offsets_ptr, E, F,
                                K, num_programs, stride_am, stride_ac, stride_hm, stride_hc, act_desc, c_bufs,
                                gl.constexpr(0), E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES, SAVE_H13, TMA_STORE)),
            (_swiglu_consumer, (a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, act_ptr, h13_ptr, offsets_ptr, E, F,
                                K, num_programs, stride_am, stride_ac, stride_hm, stride_hc, act_desc, c_bufs,
                                gl.constexpr(1), E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES, SAVE_H13, TMA_STORE)),
            (_swiglu_producer, (a_desc, b_desc, a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W,
                                F, K, num_programs, E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_swiglu_consumer, (a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, act_ptr, h13_ptr, offsets_ptr, E, F,
                                K, num_programs, stride_am, stride_ac, stride_hm, stride_hc, act_desc, c_bufs,
                                gl.constexpr(0), E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES, SAVE_H13, TMA_STORE)),
            (_swiglu_producer, (a_desc, b_desc, a_bufs, g_bufs, u_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W,
                                F, K, num_programs, E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES)),
        ], [1], [PRODUCER_REGS])


def _b_layout(b_EKN: torch.Tensor) -> str | None:
    """'n-major' (contiguous [E, K, N] storage), 'k-major' (a transposed view of contiguous [E, N, K]
    storage), or None (a layout whose [E*K, N] or [E*N, K] view a TMA descriptor cannot take)."""
    experts, k, n = b_EKN.shape
    if b_EKN.data_ptr() % 16:
        return None
    if b_EKN.stride() == (k * n, n, 1) and (n * b_EKN.element_size()) % 16 == 0:
        return "n-major"
    if b_EKN.stride() == (n * k, 1, k) and (k * b_EKN.element_size()) % 16 == 0:
        return "k-major"
    return None


def runs_here(a: torch.Tensor) -> bool:
    """Whether the Gluon kernels can run on `a`'s device: a Hopper GPU (sm_90), not the interpreter (which
    runs no Gluon)."""
    if not a.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    return torch.cuda.get_device_capability(a.device) == (9, 0)


def _out_descriptor(out: torch.Tensor, block_n: int) -> TensorDescriptor:
    """out's TMA view for the store epilogue: [64, block_n] boxes, a consumer's rows of a tile."""
    box = [CONSUMER_ROWS, block_n]
    return TensorDescriptor(out, list(out.shape), [out.stride(0), 1], box,
                            gl.NVMMASharedLayout.get_default_for(box, OUT_DTYPES[out.dtype]))


def _check_offsets(offsets_E: torch.Tensor, experts: int) -> None:
    """ValueError unless offsets_E holds int32 cumulative rows of a multiple of `experts` groups."""
    if offsets_E.dim() != 1 or offsets_E.dtype != torch.int32 or offsets_E.shape[0] % experts:
        raise ValueError(f"offsets_E must be int32 cumulative rows of a multiple of {experts} groups; got "
                         f"{offsets_E.dtype} {tuple(offsets_E.shape)}")


def _operand_problems(a_NK: torch.Tensor, b_EKN: torch.Tensor, names: tuple[str, str, str], block_m: int,
                      block_n: int, block_ns: tuple[int, ...], why_block_n: str) -> list[str]:
    """Both forms' rules on the operands and the tile, each with its fix: a and b (named `names[:2]`, their
    shared dim `names[2]`) of one operand dtype, a K a whole number of 64-deep slices (a B box must not reach
    into the next expert's weight), a's rows a TMA view; block_m in BLOCK_MS, block_n in `block_ns`."""
    a, b, k_name = names
    problems = []
    if a_NK.dtype not in OPERAND_DTYPES or b_EKN.dtype != a_NK.dtype:
        problems.append(f"{a} and {b} must share a dtype among {list(OPERAND_DTYPES)} (got {a_NK.dtype} and "
                        f"{b_EKN.dtype}): cast them, or run grouped_gemm.ragged_rows_gemm's Triton kernel")
    if block_m not in BLOCK_MS or block_n not in block_ns:
        problems.append(f"tiles: block_m in {BLOCK_MS} (64 rows per consumer warpgroup), block_n in {block_ns} "
                        f"({why_block_n}); got {block_m} x {block_n}")
    k = a_NK.shape[1]
    if b_EKN.shape[1] != k:
        problems.append(f"{a} [M, {k_name}] and {b} [E, {k_name}, N] must share {k_name}; got {a} "
                        f"{tuple(a_NK.shape)}, {b} {tuple(b_EKN.shape)}")
    if k == 0 or k % BLOCK_K:
        problems.append(f"{k_name} must be a positive multiple of {BLOCK_K} (a B box must not reach into the next "
                        f"expert's weight); got {k_name}={k}")
    if not tma_rows(a_NK):
        problems.append(f"{a} must have unit column stride and 16-byte-aligned rows (TMA): pass {a}.contiguous(); "
                        f"got strides {a_NK.stride()}")
    return problems


def _problems(a_NK: torch.Tensor, b_EKN: torch.Tensor, block_m: int, block_n: int, out: torch.Tensor | None = None,
              stages: int = 4, tma_store: bool = False) -> list[str]:
    """What keeps this launch from the kernel, each with its fix (empty: it takes it): the operands, the
    tile, `out` (given, else a new one in a's dtype) and the ring's depth beside the store's buffers."""
    problems = _operand_problems(a_NK, b_EKN, ("a", "b", "K"), block_m, block_n, BLOCK_NS, "a wgmma's N")
    rows, k = a_NK.shape
    n = b_EKN.shape[2]
    if block_n in BLOCK_NS and n % block_n:
        problems.append(f"N must be a multiple of block_n={block_n}; got N={n}: take a block_n that divides it")
    if _b_layout(b_EKN) is None:
        problems.append(f"b must be contiguous [E, K, N] storage or a transposed view of contiguous [E, N, K] "
                        f"storage, its base and rows 16-byte aligned (a TMA view); got strides {b_EKN.stride()}")
    if out is not None and (out.shape != (rows, n) or out.dtype not in OUT_DTYPES):
        problems.append(f"out must be a [M, N] = {(rows, n)} tensor of {list(OUT_DTYPES)}; got {out.dtype} "
                        f"{tuple(out.shape)}")
    elif block_m in BLOCK_MS and block_n in BLOCK_NS:
        problems += _stages_problems(stages, block_m, block_n, (a_NK if out is None else out).element_size(),
                                     tma_store and (out is None or tma_store_takes(out)), b_boxes=1)
    return problems


def takes(a_NK: torch.Tensor, b_EKN: torch.Tensor, block_m: int = 128, block_n: int = 128,
          out: torch.Tensor | None = None, stages: int = 4, tma_store: bool = False) -> bool:
    """Whether `gluon_rows_gemm` can run this launch here: a Hopper GPU (sm_90; not the interpreter,
    which runs no Gluon) and `_problems`' rules, answered without raising."""
    return runs_here(a_NK) and not _problems(a_NK, b_EKN, block_m, block_n, out, stages, tma_store)


def gluon_rows_gemm(
    a_NK: torch.Tensor,
    offsets_E: torch.Tensor,
    b_EKN: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int = 128,
    stages: int = 4,
    group_m: int = 8,
    num_programs: int | None = None,
    tma_store: bool = False,
) -> torch.Tensor:
    """out[rows_g] = a[rows_g] @ b[g mod E] for every row group g of `offsets_E` (int32 cumulative row
    counts, a multiple of E groups, empty groups allowed): `grouped_gemm.ragged_rows_gemm`'s plain
    epilogue (module docstring: the schedule and the requirements). `out` (given: [M, N], bf16, fp16 or
    fp32) or a new one in a's dtype. `stages`: the ring's depth (`ring_stage_bytes` each). `num_programs`:
    persistent programs (default one per SM; give it on a CPU, where the kernel can only be compiled).
    `tma_store`: each 64-row wave wholly inside its group stored by TMA through shared memory, drained
    under the next item's K loop; where `out` cannot take a TMA descriptor (`gluon_ragged.tma_store_takes`)
    the masked store, as without it."""
    problems = _problems(a_NK, b_EKN, block_m, block_n, out, stages, tma_store)
    if problems:
        raise ValueError("gluon_rows_gemm cannot take this launch: " + "; ".join(problems))
    rows, k = a_NK.shape
    experts, _, cols = b_EKN.shape
    _check_offsets(offsets_E, experts)
    if out is None:
        out = torch.empty((rows, cols), dtype=a_NK.dtype, device=a_NK.device)
    by_tma = tma_store and tma_store_takes(out)
    if rows == 0 or cols == 0:
        return out
    dtype = OPERAND_DTYPES[a_NK.dtype]
    a_box = [block_m, BLOCK_K]
    a_desc = TensorDescriptor(a_NK, [rows, k], [a_NK.stride(0), 1], a_box,
                              gl.NVMMASharedLayout.get_default_for(a_box, dtype))
    b_kmajor = _b_layout(b_EKN) == "k-major"
    if b_kmajor:
        b_box = [block_n, BLOCK_K]
        b_view = b_EKN.transpose(1, 2).reshape(experts * cols, k)  # a view: the storage is [E, N, K]
    else:
        b_box = [BLOCK_K, block_n]
        b_view = b_EKN.reshape(experts * k, cols)
    b_desc = TensorDescriptor(b_view, list(b_view.shape), [b_view.stride(0), 1], b_box,
                              gl.NVMMASharedLayout.get_default_for(b_box, dtype))
    out_desc = _out_descriptor(out, block_n) if by_tma else None  # None: the kernel's masked store alone
    programs = num_programs or torch.cuda.get_device_properties(a_NK.device).multi_processor_count
    groups = offsets_E.shape[0]
    _gluon_rows_gemm_kernel[(programs, )](
        a_desc, b_desc, out_desc, out, offsets_E, groups, experts, cols, k, programs, out.stride(0), out.stride(1),
        E_POW2=triton.next_power_of_2(groups), BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=group_m, STAGES=stages,
        PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS, B_KMAJOR=b_kmajor, TMA_STORE=by_tma,
        num_warps=4, maxnreg=MAXNREG if block_m == 2 * CONSUMER_ROWS else None)
    return out


def _swiglu_problems(x_NH: torch.Tensor, w13_EH2F: torch.Tensor, block_m: int, block_n: int,
                     out: torch.Tensor | None = None, h13_N2F: torch.Tensor | None = None,
                     stages: int = 4, tma_store: bool = False) -> list[str]:
    """What keeps this launch from the SwiGLU kernel, each with its fix (empty: it takes it)."""
    problems = _operand_problems(x_NH, w13_EH2F, ("x", "w13", "H"), block_m, block_n, SWIGLU_BLOCK_NS,
                                 "two fp32 sums a thread: gate and up")
    rows, k = x_NH.shape
    two_f = w13_EH2F.shape[2]
    if two_f % 2 or (block_n in SWIGLU_BLOCK_NS and (two_f // 2) % block_n):
        problems.append(f"w13's 2F columns must split into gate and up halves of whole block_n={block_n} tiles; "
                        f"got 2F={two_f}")
    if _b_layout(w13_EH2F) != "n-major":
        problems.append(f"w13 must be contiguous [E, H, 2F] storage (the weight as stored), 16-byte aligned; got "
                        f"strides {w13_EH2F.stride()}")
    for name, t, width in (("out", out, two_f // 2), ("h13_N2F", h13_N2F, two_f)):
        if t is not None and (t.shape != (rows, width) or t.dtype not in OUT_DTYPES):
            problems.append(f"{name} must be a [M, {width}] = {(rows, width)} tensor of {list(OUT_DTYPES)}; got "
                            f"{t.dtype} {tuple(t.shape)}")
    if block_m in BLOCK_MS and block_n in SWIGLU_BLOCK_NS:
        problems += _stages_problems(stages, block_m, block_n, (x_NH if out is None else out).element_size(),
                                     tma_store and (out is None or tma_store_takes(out)), b_boxes=2)
    return problems


def swiglu_takes(x_NH: torch.Tensor, w13_EH2F: torch.Tensor, block_m: int = 128, block_n: int = 128,
                 out: torch.Tensor | None = None, h13_N2F: torch.Tensor | None = None, stages: int = 4,
                 tma_store: bool = False) -> bool:
    """`takes` for `gluon_swiglu_gemm`: a Hopper GPU and `_swiglu_problems`' rules, without raising."""
    return runs_here(x_NH) and not _swiglu_problems(x_NH, w13_EH2F, block_m, block_n, out, h13_N2F, stages,
                                                     tma_store)


def gluon_swiglu_gemm(
    x_NH: torch.Tensor,
    offsets_E: torch.Tensor,
    w13_EH2F: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    h13_N2F: torch.Tensor | None = None,
    block_m: int = 128,
    block_n: int = 128,
    stages: int = 4,
    group_m: int = 8,
    num_programs: int | None = None,
    tma_store: bool = False,
) -> torch.Tensor:
    """act[rows_g] = silu(x @ w13[e][:, :F]) * (x @ w13[e][:, F:]) for every row group g (e = g mod E), the
    gate and up sums in fp32: `grouped_gemm.ragged_rows_gemm`'s SwiGLU epilogue; `h13_N2F` (given) receives the
    two pre-activations (gate at [:F], up at [F:]). `out` (given: [M, F] of `OUT_DTYPES`) or a new one in x's
    dtype. `stages`: the ring's depth (`ring_stage_bytes` with two B boxes each). `tma_store`: act's 64-row waves
    wholly inside their group stored by TMA through shared memory (as `gluon_rows_gemm`'s), where `out` takes a
    descriptor."""
    problems = _swiglu_problems(x_NH, w13_EH2F, block_m, block_n, out, h13_N2F, stages, tma_store)
    if problems:
        raise ValueError("gluon_swiglu_gemm cannot take this launch: " + "; ".join(problems))
    rows, k = x_NH.shape
    experts, _, two_f = w13_EH2F.shape
    ffn = two_f // 2
    _check_offsets(offsets_E, experts)
    if out is None:
        out = torch.empty((rows, ffn), dtype=x_NH.dtype, device=x_NH.device)
    if rows == 0 or ffn == 0:
        return out
    dtype = OPERAND_DTYPES[x_NH.dtype]
    a_box, b_box = [block_m, BLOCK_K], [BLOCK_K, block_n]
    a_desc = TensorDescriptor(x_NH, [rows, k], [x_NH.stride(0), 1], a_box,
                              gl.NVMMASharedLayout.get_default_for(a_box, dtype))
    w_view = w13_EH2F.reshape(experts * k, two_f)
    b_desc = TensorDescriptor(w_view, [experts * k, two_f], [two_f, 1], b_box,
                              gl.NVMMASharedLayout.get_default_for(b_box, dtype))
    h13 = h13_N2F if h13_N2F is not None else out  # the kernel stores into it only with SAVE_H13
    by_tma = tma_store and tma_store_takes(out)
    act_desc = _out_descriptor(out, block_n) if by_tma else None
    programs = num_programs or torch.cuda.get_device_properties(x_NH.device).multi_processor_count
    groups = offsets_E.shape[0]
    _gluon_swiglu_gemm_kernel[(programs, )](
        a_desc, b_desc, act_desc, out, h13, offsets_E, groups, experts, ffn, k, programs, out.stride(0),
        out.stride(1), h13.stride(0), h13.stride(1), E_POW2=triton.next_power_of_2(groups), BLOCK_M=block_m,
        BLOCK_N=block_n, GROUP_M=group_m, STAGES=stages, PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS,
        SAVE_H13=h13_N2F is not None, TMA_STORE=by_tma, num_warps=4,
        maxnreg=MAXNREG if block_m == 2 * CONSUMER_ROWS else None)
    return out
