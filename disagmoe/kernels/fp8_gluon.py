"""The FP8 ragged grouped GEMM of `fp8.fp8_rows_gemm` (plain epilogue) as a warp-specialised Gluon
kernel for Hopper (sm_90a): out[rows_g] = dequant(a[rows_g]) @ dequant(b[g mod E]) for every row
group g, each 128-deep slice of K its own fp32 dot scaled by sa[:, j] x sb[e, j, column block] and
added into the fp32 sum ("promotion"), in slice order, as `fp8.fp8_rows_gemm_reference` does.

Why: Triton's sm_90 code waits for each slice's wgmma (`warp_group_dot_wait {pendings = 0}`) before
its scaled add, so the tensor cores idle through every promotion; `fp8_rows_gemm` measured 630-870
TFLOP/s on an H200 against about 1,400 for torch._scaled_mm and 1,100-1,300 for DeepGEMM's grouped
GEMMs, and Triton 3.6's automatic warp specialisation is ignored on sm_90 (the TTGIR keeps one
partition). Here the partitions and their synchronisation are written out (`gl.warp_specialize`).

Schedule (one persistent program per SM, work items (group, row tile, column tile) of
block_m x block_n found on the device from offsets_E, as `_fp8_rows_gemm_kernel` finds them):
- producer partition, 1 warp, 40 registers: per item and per 128-deep K slice, waits for a free
  stage of a `stages`-deep shared-memory ring (its `empty` mbarrier), then TMA-loads the A tile
  [block_m, 128] (rows past M zero-filled; rows past the group's end are the next group's, read
  and never stored) and the B tile [block_n, 128] of the [E*N, K] view of b, completing the
  stage's `ready` mbarrier with the bytes.
- consumer partitions, one warpgroup (4 warps) per 64 rows of the tile: block_m = 128 gives two,
  the default partition taking rows 0-63 and a worker rows 64-127 of the same item, sharing each
  stage's B (`empty` counts one arrival per consumer). Per slice j a consumer multiplies slice j's
  scales (loaded during slice j-1), loads slice j+1's (plain loads, a slice ahead of their use:
  the weight-block scale's line is new every slice, an L2 round trip), waits for the stage,
  issues slice j's wgmma into a fresh accumulator (use_acc=False), waits for it, releases the
  stage and adds the product times its scales into the fp32 sum (DeepGEMM's order). The promotion
  and the next stage's wait run on the CUDA cores while the other consumer's wgmma runs on the
  tensor cores: the two warpgroups are not synchronised with each other, only through the ring
  (DeepGEMM's two math warpgroups per 128-row tile). block_m = 64 has the one consumer, whose
  promotion is then not overlapped. Registers per consumer thread: the sum and the product, 64
  fp32 each at 64 x 128, plus addresses; 232 each (setmaxnreg), so 12 warps fit the register file
  with maxnreg 168. Until session 33 a consumer carried slice j-1's product to add it under slice
  j's wgmma: in the SASS (Triton 3.6's ptxas, sm_90a) that overlapped only the first of the
  slice's four QGMMA.64xNx32 (the other three waited for the adds, whose weight-block scale was
  loaded in the same iteration), and the carry cost register copies every slice: 222 instructions
  a slice a warp against 154 now (compiled on a CPU: docs/measurements/gluon_slice_count.py, docs/benchmarks.md).
  Session 45 (ncu, one H100: the tensor pipe 47% busy at 128 x 128, the L2 30%: the consumers wait, not the
  traffic) tried a consumer issuing slice j+1's wgmma before waiting for slice j's (wait_group 1) and promoting
  it, two slices a turn so that no product was copied: ptxas (sm_90a) serialises the wgmmas then (C7514, a
  non-wgmma instruction reading a wgmma's accumulator inside its pipeline stage), and at 128 columns the second
  product spills; it was dropped. Session 46 read the same record's crossbar metric (the bytes the L2 delivered
  into the SMs, `docs/measurements/ncu_xbar_demand.py`): 7.0 TB/s at 128 x 128 and 7.2 at 256 x 128, where the bf16
  Triton kernel of the same call moved 9.4 at a 97% busy tensor pipe; at a fully busy pipe the FP8 kernel would
  need 14.7 and 11.2 TB/s (FP8 doubles the FLOP rate, so a tile of the same size needs twice the bytes a second).
  At the bf16 kernel's rate that caps 128 x 128 near 64% and 256 x 128 near 84%: the L2-to-SM bandwidth, not the
  L2's own throughput, is the 128-row tile's bound, and only bytes per FLOP lift it (larger tiles, which the
  registers refuse past 256 x 128, or TMA multicast across a cluster, which Gluon 3.6's
  `tma.async_copy_global_to_shared` does not offer: it takes no CTA mask).
- epilogue: each consumer stores its rows of the group (masked to the group's end) in out's dtype
  straight from the wgmma layout, then goes on to the next item, whose stages the producer has
  been loading meanwhile; or, asked, through shared memory by TMA (`tma_store`, below).
- block_m = 256 (`_consumer_two_waves`, session 33; measured in session 34, `bench experts --backend
  triton-fp8:gluon-256`: Mixtral's forward 1.20x our bf16 against 1.08x at 128 rows, DeepSeek's slower): each consumer takes 128 rows as
  two 64-row waves on the stage's one B tile, wave by wave (wgmma, wait, add), the stage released after
  the second: B read once per 256 rows, half the L2 traffic of B per FLOP (about x2 TMA multicast,
  which Gluon 3.6's copy does not expose); ptxas holds it without spills at 256 x 128 and 256 x 64
  once the second wave's rows and masks are made where used. Ragged groups waste more rows per tile.
Ping-pong on different tiles (one warpgroup per block_m x block_n tile) does not fit at 128 x 128:
the sum and two products would need 384 registers per thread.

TMA-store epilogue (`gluon_fp8_rows_gemm(tma_store=True)`; the kernel's default off, a run's on since session 35,
`config.RUN_FP8_GLUON_STORE`: the block 1.15x / 1.16x our bf16 on Mixtral / DeepSeek shapes against 1.06x / 1.10x
with the masked store, one H100). Why: the masked store writes each thread's 2 rows from the
wgmma layout in 4-byte pieces (bf16: 32 STG a thread per 64 x 128 wave, each warp instruction 16
bytes in each of 8 rows, uncoalesced), issued by the consumer before its next item can start; on
Qwen3-30B's expert GEMMs (K 768 or 1,536: 6-12 K slices a tile) that epilogue is a large share of
each tile, and in the profiled training step (one H100) this kernel ran at about 655 TFLOP/s, the
step's FP8 row GEMMs 60 ms. How: row tiles start at their group's first row (`tile_of`: row_start +
pid_m x block_m, pid_m < cdiv(rows, block_m)), so only a group's last tile can reach past its end.
A consumer's 64-row wave wholly inside its group is converted to out's dtype, written into the
consumer's [64, block_n] shared-memory buffer (stmatrix: 8 STSM a thread at 64 x 128 bf16), fenced
for the async proxy and stored by TMA through out's descriptor ([64, block_n] boxes, which Triton
issues as 128-byte-wide pieces: two bulk copies at bf16 x 128), not waited for: the consumer waits
(cp.async.bulk.wait_group.read 0) only before it writes that buffer again, an item later, and once
at the end, so the store drains under the next item's K loop. A wave reaching past its group's end
(a box would write the next group's rows) keeps the masked store, as does an `out` that cannot take
a descriptor (`tma_store_takes`: unit column stride, 16-byte-aligned base and rows). Shared memory:
one buffer per consumer, 32 KiB at 128 x 128 with a bf16 out (64 KiB fp32) beside the ring, so the 4
stages fit every tile it takes. Compiled for sm_90a on a CPU (tests/kernels/test_fp8_gluon.py): no
spill stores at 64 and 128 rows and at 256 x 64, the K loop as without it (152 SASS instructions a
warp against 154-156 at 128 x 128, no local memory), and off it is the same kernel (the same SASS). At
256 x 128 the two waves' sums leave ptxas no room for it: 184 bytes of spill stores with a bf16 out,
two accumulator registers stored and reloaded in every K slice (4 bytes with fp32); the stmatrix
addresses, which LLVM hoists out of the item loop, and the masked path kept for partial waves
both cost registers there, and a second buffer per wave or 32-bit scale offsets did not save enough.
So it takes 256 rows only at block_n 64 (`TMA_STORE_TILES`, both waves through one buffer in turn)
and the FFN only at 128 (`fp8_ffn._GluonChoices.tma_store`). On an H200 (session 47, Mixtral's GEMMs at even
loads) the TMA store took the 128 x 128 tile from 879 to 1,105 TFLOP/s on the down GEMM and from 810 to 957 on
gate/up, where 256 x 128 (3 or 4 stages) gave 1,111-1,124 and 887-909: about the 128-row tile's crossbar bound.

Requirements (ValueError naming the fix otherwise): K a multiple of 128, N a multiple of block_n,
block_m in (64, 128, 256), block_n in (64, 128) (one weight-block scale per column tile), b K-major with
its [E, N, K] storage contiguous (`fp8_ffn.Fp8ExpertWeights`' operands are), a with unit column
stride, 16-byte-aligned rows, the ring and the TMA store's buffers within shared memory (stages <= 6 at
128 x 128, <= 4 at 256 x 128; with tma_store and an fp32 out <= 5 at 128 x 128), tma_store on
`TMA_STORE_TILES` only.

Measured (H200, 2026-12-04, 128 x 128, 4 stages, against `fp8_rows_gemm` at its tuned tiles, the
same bits): Mixtral's down 785 against 634 TFLOP/s, DeepSeek-V3-EP8's gate/up 832 against 594,
Qwen3-30B's down 373 against 318 (1.17-1.40x over six expert shapes; `torch._scaled_mm`'s dense
row-wise GEMM of the same sizes: 861-1,390). 128 x 64 and 64 x 128 are slower everywhere. The FP8
FFN runs its plain row GEMMs (the down GEMM, the gate/up data gradient) here where `takes` says it
can and the run asks (`TrainConfig.fp8_gluon`, `fp8_ffn.set_gluon`): a run's default since session
34, whose seeded 300-step run with it ended below bf16's loss; off from session 28, when its gate/up
GEMM trained 6.6% above bf16's loss, to session 34 (session 29 put that gap inside the spread between
runs; `fp8_ffn._GluonChoices`). GPU tests:
tests/kernels/test_fp8_gluon.py (the `test_gpu_training_*` ones included: sessions 29 and 34).

The weight gradient (`gluon_fp8_weight_grad`, `fp8.fp8_weight_grad`'s sums) runs the same
partitions over items (expert, 128 KA rows, block_n C columns), its K loop the expert's groups'
128-token chunks (TMA boxes of the token-contiguous operands `fp8.quantize_token_groups` writes),
each chunk's product times sa[row, chunk] x sb[column, chunk] (a column vector, not the rows
kernel's one weight-block scalar). Until session 37 the consumers loaded those scales from global
memory after each chunk's wgmma (64 row scales and block_n column scales, K-strided words): an L2
round trip on every chunk's critical path, and the all-FP8 block with it ran below the one with the Triton
kernel (0.91-0.98x, session 19). Since then (session 37):
- the scales are stored chunk-major (`fp8.token_group_scales`), and the producer copies a chunk's
  runs of sa and sb by TMA into the ring beside its A and B tiles (1-D boxes, `_scale_boxes`, on the
  stage's `ready` barrier); a consumer reads them from shared memory under its wgmma;
- the epilogue (`tma_epilogue`, chosen where out takes it) writes each consumer's 64 x block_n fp32
  sums into its own shared-memory buffer and stores them, or reduce-adds them into the main gradient
  (`_tma_reduce_add`: cp.reduce.async.bulk.tensor .add), by TMA, waiting only before the buffer's next
  use an item later, so the main gradient's read-modify-write runs under the next item's wgmmas (the
  register epilogues stay: relaxed fp32 reductions, or load-add-store; all give the same bits);
- `second`: the next micro-batch's row set summed in the same launch (`kernels.wgrad_pairs`).
- a fresh gradient (no main gradient) written in its weights' bf16, the sums rounded once in the epilogue.
The expert block with it (`bench experts --backend triton-fp8:gluon-tma-store-wgrad`, one H100): 0.92x /
0.98x / 0.59x our bf16 on Mixtral / DeepSeek-V3-EP8 / Qwen3 shapes, against 0.76x / 0.79x / 0.49x with
the Triton FP8 weight gradient in the same run; 1.10x / 1.28x / 0.70x once it wrote bf16 (the default recipe,
bf16 weight gradients, 1.13x / 1.22x / 0.85x in that run; docs/benchmarks.md, session 37). A run's Gluon
paths take it under the all-FP8 backward (`fp8_ffn.set_gluon`).

Not yet done: the SwiGLU epilogues of `fp8_swiglu_gemm` / `fp8_swiglu_grad_gemm`, the TMA store timed
(and at 256 x 128, and for a group's partial last tile, e.g. through the buffer and a coalesced
masked store), skipping a consumer's half-tile that lies wholly past its group's end (its MMAs run
on rows never stored).
"""

from __future__ import annotations

import os

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.fp8 import FP8, SCALE_BLOCK, weight_grad_shapes
from disagmoe.kernels.gluon_ragged import (  # noqa: F401 (CONSUMER_REGS, OUT_DTYPES, ...: this module's contract too)
    CONSUMER_REGS,
    CONSUMER_ROWS,
    GROUP_M,
    MAXNREG,
    OUT_DTYPES,
    PRODUCER_REGS,
    SHARED_MEMORY_BYTES,
    epilogue_bytes,
    masked_store,
    ring,
    store_consumer_rows,
    store_wave,
    store_weight_grad,
    tile_of,
    tma_rows,
    tma_store_takes,
    wgrad_item,
    wgrad_tiles,
    wgrad_tma_epilogue_takes,
    work_list,
)

# one or two consumer warpgroups of CONSUMER_ROWS rows, or (256) two of two 64-row waves each: one B tile
# read by four wgmma groups, half the L2 traffic of B per FLOP (a helper's sm_90a study, session 33)
BLOCK_MS = (64, 128, 256)
BLOCK_NS = (64, 128)  # column tiles inside one 128-column weight block: one sb per tile and slice
# (block_m, block_n) tiles that take the TMA-store epilogue (`gluon_fp8_rows_gemm(tma_store=True)`): those ptxas
# holds without spills (sm_90a, Triton 3.6). At 256 x 128 the two waves' sums leave it no registers: 184 bytes of
# spill stores with a bf16 out, two accumulator registers stored and reloaded in every K slice (module docstring)
TMA_STORE_TILES = ((64, 64), (64, 128), (128, 64), (128, 128), (256, 64))
# Whether the ring's mbarrier initialisations are fenced (`fence_async_shared`, fence.proxy.async) before
# any TMA completes on them: the PTX rule for the async proxy's view of shared memory written by threads,
# as DeepGEMM fences there. Until session 28 the kernels did not; the FFN's Gluon gate/up GEMM then
# cost loss in training that outside it no test could reproduce (`fp8_ffn._GluonChoices`), and a
# barrier the TMA unit saw uninitialised is one cause that would only show under training's timing.
# A launch-time choice so that a GPU test can run the kernel both ways
# (tests/kernels/test_fp8_gluon.py's shadowed training run).
FENCE_BARRIER_INIT = True
_SLICE = gl.constexpr(SCALE_BLOCK)
_ROWS = gl.constexpr(CONSUMER_ROWS)
_ITEM_ROWS = gl.constexpr(2 * CONSUMER_ROWS)  # the weight gradient's KA rows an item: both consumers' halves
# the weight gradient's scale boxes in the ring: 1-D runs of fp32 copied whole (no swizzle)
SCALE_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W, N, K, num_programs,
              E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr,
              STAGES: gl.constexpr):
    """The TMA warp: fills the ring's stages in item and slice order, the order the consumers
    drain them. A stage is refilled once every consumer has released it (`empty`; a fresh
    mbarrier counts as released, hence the first wait on the opposite phase)."""
    tiles_n, item_ends, total, slices = work_list(offsets_ptr, E, N, K, BLOCK_M, BLOCK_N, _SLICE, E_POW2, 1)
    count = 0
    for item in range(gl.program_id(0), total, num_programs):
        group, row0, row_end, pid_n = tile_of(item, item_ends, offsets_ptr, tiles_n, BLOCK_M, GROUP_M)
        b_row = (group % E_W) * N + pid_n * BLOCK_N
        for j in range(slices):
            stage = count % STAGES
            mbarrier.wait(empty_bars.index(stage), ((count // STAGES) & 1) ^ 1)
            ready = ready_bars.index(stage)
            mbarrier.expect(ready, a_desc.block_type.nbytes + b_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(a_desc, [row0, j * _SLICE], ready, a_bufs.index(stage))
            tma.async_copy_global_to_shared(b_desc, [b_row, j * _SLICE], ready, b_bufs.index(stage))
            count += 1


@gluon.jit
def _consumer(a_bufs, b_bufs, ready_bars, empty_bars, sa_ptr, sb_ptr, out_ptr, offsets_ptr, E, E_W, N, K,
              num_programs, stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbb, stride_om, stride_on,
              out_desc, c_bufs, CONSUMER: gl.constexpr, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr, TMA_STORE: gl.constexpr):
    """One warpgroup's rows CONSUMER * 64 + [0, 64) of every item: per slice, the wgmma waited for,
    the stage released, the product added with the scales loaded a slice earlier (module
    docstring), then the store: masked from registers, or with TMA_STORE (`store_wave`) through
    this warpgroup's epilogue buffer c_bufs[CONSUMER] where its 64 rows lie inside the group."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    tiles_n, item_ends, total, slices = work_list(offsets_ptr, E, N, K, BLOCK_M, BLOCK_N, _SLICE, E_POW2, 4)
    zero_MN = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
    count = 0
    for item in range(gl.program_id(0), total, num_programs):
        group, row0, row_end, pid_n = tile_of(item, item_ends, offsets_ptr, tiles_n, BLOCK_M, GROUP_M)
        rows = (row0 + CONSUMER * _ROWS) + gl.arange(0, _ROWS, layout=row_layout)
        row_ok = rows < row_end
        sa_ptrs = sa_ptr + rows.to(gl.int64) * stride_sam
        sb_tile = sb_ptr + (group % E_W).to(gl.int64) * stride_sbe + (pid_n * BLOCK_N // _SLICE) * stride_sbb
        acc_MN = zero_MN
        # slice 0's scales; each slice then loads the next one's, a slice ahead of their use (the
        # last slice loads its own again: an in-bounds, unused load)
        sa_M = gl.load(sa_ptrs, mask=row_ok, other=0.0)
        sb = gl.load(sb_tile)
        for j in range(slices):
            stage = count % STAGES
            scale_M = sa_M * sb
            ahead = gl.minimum(j + 1, slices - 1)
            sa_M = gl.load(sa_ptrs + ahead * stride_sag, mask=row_ok, other=0.0)
            sb = gl.load(sb_tile + ahead * stride_sbg)
            mbarrier.wait(ready_bars.index(stage), (count // STAGES) & 1)
            a_view = a_bufs.index(stage).slice(CONSUMER * _ROWS, _ROWS)
            b_view = b_bufs.index(stage).permute((1, 0))  # [128, BLOCK_N], K-major as wgmma reads it
            part = warpgroup_mma(a_view, b_view, zero_MN, use_acc=False, is_async=True)
            part_MN = warpgroup_mma_wait(0, deps=(part, ))
            mbarrier.arrive(empty_bars.index(stage))  # the stage is free once the wgmma has read it
            acc_MN = acc_MN + part_MN * scale_M[:, None]  # under the other consumer's wgmma
            count += 1
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        store_consumer_rows(acc_MN, rows, row_ok, cols, row0 + CONSUMER * _ROWS, row_end, pid_n * BLOCK_N, out_desc,
                            c_bufs, out_ptr, stride_om, stride_on, CONSUMER, _ROWS, TMA_STORE)
    if TMA_STORE:
        tma.store_wait(0)  # the last item's store has read its buffer before the block's shared memory goes


@gluon.jit
def _consumer_two_waves(a_bufs, b_bufs, ready_bars, empty_bars, sa_ptr, sb_ptr, out_ptr, offsets_ptr, E, E_W, N, K,
                        num_programs, stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbb, stride_om,
                        stride_on, out_desc, c_bufs, CONSUMER: gl.constexpr, E_POW2: gl.constexpr,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                        TMA_STORE: gl.constexpr):
    """`_consumer` at block_m 256: this warpgroup's 128 rows CONSUMER * 128 + [0, 128) as two 64-row
    waves per slice on the stage's one B tile, each wave's wgmma waited for and its product added
    into that wave's sum (the two sums and one product in registers: two products at once would
    spill), the stage released after the second; the same sums in the same order per row. With
    TMA_STORE (block_n 64: `TMA_STORE_TILES`) both waves go through this warpgroup's one buffer
    c_bufs[CONSUMER], in turn."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    tiles_n, item_ends, total, slices = work_list(offsets_ptr, E, N, K, BLOCK_M, BLOCK_N, _SLICE, E_POW2, 4)
    zero_MN = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
    count = 0
    for item in range(gl.program_id(0), total, num_programs):
        group, row0, row_end, pid_n = tile_of(item, item_ends, offsets_ptr, tiles_n, BLOCK_M, GROUP_M)
        # the high wave's rows, masks and scale pointers are the low wave's plus 64 rows, made where used:
        # held across the loop they cost ptxas a spill at 256 x 128
        rows_lo = (row0 + CONSUMER * 2 * _ROWS) + gl.arange(0, _ROWS, layout=row_layout)
        ok_lo = rows_lo < row_end
        sa_lo = sa_ptr + rows_lo.to(gl.int64) * stride_sam
        sb_tile = sb_ptr + (group % E_W).to(gl.int64) * stride_sbe + (pid_n * BLOCK_N // _SLICE) * stride_sbb
        acc_lo = zero_MN
        acc_hi = zero_MN
        s_lo = gl.load(sa_lo, mask=ok_lo, other=0.0)  # slice 0's scales; then each slice loads the next one's
        s_hi = gl.load(sa_lo + _ROWS * stride_sam, mask=rows_lo + _ROWS < row_end, other=0.0)
        sb = gl.load(sb_tile)
        for j in range(slices):
            stage = count % STAGES
            scale_lo = s_lo * sb
            scale_hi = s_hi * sb
            ahead = gl.minimum(j + 1, slices - 1)
            s_lo = gl.load(sa_lo + ahead * stride_sag, mask=ok_lo, other=0.0)
            s_hi = gl.load(sa_lo + (_ROWS * stride_sam + ahead * stride_sag), mask=rows_lo + _ROWS < row_end, other=0.0)
            sb = gl.load(sb_tile + ahead * stride_sbg)
            mbarrier.wait(ready_bars.index(stage), (count // STAGES) & 1)
            b_view = b_bufs.index(stage).permute((1, 0))  # [128, BLOCK_N], K-major as wgmma reads it
            a_lo = a_bufs.index(stage).slice(CONSUMER * 2 * _ROWS, _ROWS)
            part = warpgroup_mma(a_lo, b_view, zero_MN, use_acc=False, is_async=True)
            part_MN = warpgroup_mma_wait(0, deps=(part, ))
            acc_lo = acc_lo + part_MN * scale_lo[:, None]
            a_hi = a_bufs.index(stage).slice(CONSUMER * 2 * _ROWS + _ROWS, _ROWS)
            part = warpgroup_mma(a_hi, b_view, zero_MN, use_acc=False, is_async=True)
            part_MN = warpgroup_mma_wait(0, deps=(part, ))
            mbarrier.arrive(empty_bars.index(stage))  # both waves have read the stage
            acc_hi = acc_hi + part_MN * scale_hi[:, None]
            count += 1
        cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        if TMA_STORE:
            # one buffer for both waves (block_n 64 only: `TMA_STORE_TILES`), the high wave waiting for the low
            # wave's store to have read it (8 KiB, bf16); the high wave's store drains under the next item
            c_buf = c_bufs.index(CONSUMER)
            lo_row = row0 + CONSUMER * 2 * _ROWS
            whole_lo = lo_row + _ROWS <= row_end
            if whole_lo:
                tma.store_wait(0)  # the previous item's high wave's store has read the buffer
            store_wave(acc_lo.to(out_ptr.dtype.element_ty), whole_lo, lo_row, pid_n * BLOCK_N, out_desc, c_buf,
                        out_ptr, rows_lo, ok_lo, cols, stride_om, stride_on)
            rows_hi = rows_lo + _ROWS
            whole_hi = lo_row + 2 * _ROWS <= row_end
            if whole_hi:
                tma.store_wait(0)  # the low wave's store (whole_hi implies whole_lo) has read the buffer
            store_wave(acc_hi.to(out_ptr.dtype.element_ty), whole_hi, lo_row + _ROWS, pid_n * BLOCK_N, out_desc,
                        c_buf, out_ptr, rows_hi, rows_hi < row_end, cols, stride_om, stride_on)
        else:
            masked_store(acc_lo.to(out_ptr.dtype.element_ty), out_ptr, rows_lo, ok_lo, cols, stride_om, stride_on)
            rows_hi = rows_lo + _ROWS
            masked_store(acc_hi.to(out_ptr.dtype.element_ty), out_ptr, rows_hi, rows_hi < row_end, cols, stride_om,
                          stride_on)
    if TMA_STORE:
        tma.store_wait(0)


@gluon.jit
def _gluon_fp8_rows_gemm_kernel(a_desc, b_desc, out_desc, sa_ptr, sb_ptr, out_ptr, offsets_ptr, E, E_W, N, K,
                                num_programs, stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbb, stride_om,
                                stride_on, E_POW2: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                GROUP_M: gl.constexpr, STAGES: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                                CONSUMER_REGS: gl.constexpr, FENCE_INIT: gl.constexpr, TMA_STORE: gl.constexpr):
    # Contract: `gluon_fp8_rows_gemm`'s, checked there. The partitions' arguments are written
    # inline in the warp_specialize call: a tuple assigned to a name first turns its constexprs
    # into tensors (Triton 3.6's front end), which the layouts and shapes cannot take.
    # consumers: 1 at block_m 64, 2 at 128 and at 256 (two waves each), in constexpr arithmetic.
    # out_desc: out's TMA view ([64, BLOCK_N] boxes) with TMA_STORE, else None (the masked store alone).
    CONSUMERS: gl.constexpr = BLOCK_M // _ROWS - 2 * (BLOCK_M // (4 * _ROWS))
    a_bufs, b_bufs, ready_bars, empty_bars = ring(a_desc, b_desc, STAGES, CONSUMERS, FENCE_INIT)
    if TMA_STORE:  # one [64, BLOCK_N] buffer of out's dtype per consumer, in the TMA box's NVMMA layout
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [CONSUMERS] + out_desc.block_type.shape, out_desc.layout)
    else:
        c_bufs: gl.constexpr = None
    if BLOCK_M == 4 * _ROWS:
        gl.warp_specialize([
            (_consumer_two_waves, (a_bufs, b_bufs, ready_bars, empty_bars, sa_ptr, sb_ptr, out_ptr, offsets_ptr, E,
                                   E_W, N, K, num_programs, stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbb,
                                   stride_om, stride_on, out_desc, c_bufs, gl.constexpr(0), E_POW2, BLOCK_M, BLOCK_N,
                                   GROUP_M, STAGES, TMA_STORE)),
            (_consumer_two_waves, (a_bufs, b_bufs, ready_bars, empty_bars, sa_ptr, sb_ptr, out_ptr, offsets_ptr, E,
                                   E_W, N, K, num_programs, stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbb,
                                   stride_om, stride_on, out_desc, c_bufs, gl.constexpr(1), E_POW2, BLOCK_M, BLOCK_N,
                                   GROUP_M, STAGES, TMA_STORE)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W, N, K,
                         num_programs, E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    elif BLOCK_M == 2 * _ROWS:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, sa_ptr, sb_ptr, out_ptr, offsets_ptr, E, E_W, N, K,
                         num_programs, stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbb, stride_om,
                         stride_on, out_desc, c_bufs, gl.constexpr(0), E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES,
                         TMA_STORE)),
            (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, sa_ptr, sb_ptr, out_ptr, offsets_ptr, E, E_W, N, K,
                         num_programs, stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbb, stride_om,
                         stride_on, out_desc, c_bufs, gl.constexpr(1), E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES,
                         TMA_STORE)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W, N, K,
                         num_programs, E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a_bufs, b_bufs, ready_bars, empty_bars, sa_ptr, sb_ptr, out_ptr, offsets_ptr, E, E_W, N, K,
                         num_programs, stride_sam, stride_sag, stride_sbe, stride_sbg, stride_sbb, stride_om,
                         stride_on, out_desc, c_bufs, gl.constexpr(0), E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES,
                         TMA_STORE)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready_bars, empty_bars, offsets_ptr, E, E_W, N, K,
                         num_programs, E_POW2, BLOCK_M, BLOCK_N, GROUP_M, STAGES)),
        ], [1], [PRODUCER_REGS])


@gluon.jit
def _wgrad_load_chunks(a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready_bars, empty_bars,
                       padded_ptr, expert, E, E_W, KA, C, pid_k, pid_n, count, BLOCK_M: gl.constexpr,
                       BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """The producer's loads of one row set for one item: per group g = expert mod E_W, per 128-token
    chunk c, into the next free stage the A tile a[KA tile, chunk], the B tile b[C tile, chunk] and their
    scales sa[KA tile, c] and sb[C tile, c] (boxes of the chunk-major scale storage seen flat,
    `fp8.token_group_scales`), all four on the stage's `ready` barrier. Returns the stages used so far."""
    stage_bytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes + sa_desc.block_type.nbytes
                                 + sb_desc.block_type.nbytes)
    for group in range(expert, E, E_W):
        start = gl.load(padded_ptr + group - 1, mask=group > 0, other=0)
        end = gl.load(padded_ptr + group)
        for p0 in range(start, end, _SLICE):
            stage = count % STAGES
            chunk = p0 // _SLICE
            mbarrier.wait(empty_bars.index(stage), ((count // STAGES) & 1) ^ 1)
            ready = ready_bars.index(stage)
            mbarrier.expect(ready, stage_bytes)
            tma.async_copy_global_to_shared(a_desc, [pid_k * BLOCK_M, p0], ready, a_bufs.index(stage))
            tma.async_copy_global_to_shared(b_desc, [pid_n * BLOCK_N, p0], ready, b_bufs.index(stage))
            tma.async_copy_global_to_shared(sa_desc, [chunk * KA + pid_k * BLOCK_M], ready, sa_bufs.index(stage))
            tma.async_copy_global_to_shared(sb_desc, [chunk * C + pid_n * BLOCK_N], ready, sb_bufs.index(stage))
            count += 1
    return count


@gluon.jit
def _wgrad_producer(a_desc, b_desc, sa_desc, sb_desc, a2_desc, b2_desc, sa2_desc, sb2_desc, a_bufs, b_bufs, sa_bufs,
                    sb_bufs, ready_bars, empty_bars, padded_ptr, padded2_ptr, E, E_W, KA, C, num_programs,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                    PAIRED: gl.constexpr):
    """The TMA warp of the weight gradient: per item, the chunks of its expert's groups
    (`_wgrad_load_chunks`), then with PAIRED those of the second row set (one group an expert)."""
    tiles_k, tiles_n, per_expert = wgrad_tiles(KA, C, BLOCK_M, BLOCK_N)
    count = 0
    for item in range(gl.program_id(0), E_W * per_expert, num_programs):
        expert, pid_k, pid_n = wgrad_item(item, per_expert, tiles_k, tiles_n, GROUP_M)
        count = _wgrad_load_chunks(a_desc, b_desc, sa_desc, sb_desc, a_bufs, b_bufs, sa_bufs, sb_bufs, ready_bars,
                                   empty_bars, padded_ptr, expert, E, E_W, KA, C, pid_k, pid_n, count, BLOCK_M,
                                   BLOCK_N, STAGES)
        if PAIRED:
            count = _wgrad_load_chunks(a2_desc, b2_desc, sa2_desc, sb2_desc, a_bufs, b_bufs, sa_bufs, sb_bufs,
                                       ready_bars, empty_bars, padded2_ptr, expert, E_W, E_W, KA, C, pid_k, pid_n,
                                       count, BLOCK_M, BLOCK_N, STAGES)


@gluon.jit
def _wgrad_sum_chunks(a_bufs, b_bufs, sa_bufs, sb_bufs, ready_bars, empty_bars, padded_ptr, expert, E, E_W, acc_MN,
                      count, CONSUMER: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """One consumer's sums over one row set's chunks of an item (the producer's `_wgrad_load_chunks`
    order): per chunk the wgmma into a fresh accumulator, the chunk's scales read from the stage (shared
    memory, under the wgmma), the wait, the stage released, and the product times sa[row, c] x
    sb[column, c] added into acc (DeepGEMM's order; the other consumer's wgmma runs meanwhile).
    Returns (acc, the stages used so far)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    zero_MN = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
    for group in range(expert, E, E_W):
        start = gl.load(padded_ptr + group - 1, mask=group > 0, other=0)
        end = gl.load(padded_ptr + group)
        for p0 in range(start, end, _SLICE):
            stage = count % STAGES
            mbarrier.wait(ready_bars.index(stage), (count // STAGES) & 1)
            a_view = a_bufs.index(stage).slice(CONSUMER * _ROWS, _ROWS)
            b_view = b_bufs.index(stage).permute((1, 0))  # [128 tokens, BLOCK_N], token-major
            part = warpgroup_mma(a_view, b_view, zero_MN, use_acc=False, is_async=True)
            sa_M = sa_bufs.index(stage).slice(CONSUMER * _ROWS, _ROWS).load(gl.SliceLayout(1, acc_layout))
            sb_N = sb_bufs.index(stage).load(gl.SliceLayout(0, acc_layout))
            part_MN = warpgroup_mma_wait(0, deps=(part, ))
            mbarrier.arrive(empty_bars.index(stage))  # the wgmma and the scale loads have read it
            acc_MN = acc_MN + part_MN * (sa_M[:, None] * sb_N[None, :])
            count += 1
    return acc_MN, count


@gluon.jit
def _wgrad_consumer(a_bufs, b_bufs, sa_bufs, sb_bufs, ready_bars, empty_bars, out_ptr, out_desc, c_bufs, padded_ptr,
                    padded2_ptr, E, E_W, KA, C, num_programs, stride_oe, stride_ok, stride_oc, CONSUMER: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                    ACCUMULATE: gl.constexpr, ATOMIC: gl.constexpr, TMA_EPILOGUE: gl.constexpr,
                    PAIRED: gl.constexpr):
    """One warpgroup's KA rows CONSUMER * 64 + [0, 64) of every item: the sums over the item's chunks
    (`_wgrad_sum_chunks`; with PAIRED the second row set's after the first's, into the same sum). Then
    the sums stored, or added into `out` (ACCUMULATE), zeros for an expert without tokens
    (`gluon_ragged.store_weight_grad`: by TMA through c_bufs[CONSUMER] with TMA_EPILOGUE, else from registers)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 32])
    tiles_k, tiles_n, per_expert = wgrad_tiles(KA, C, BLOCK_M, BLOCK_N)
    count = 0
    for item in range(gl.program_id(0), E_W * per_expert, num_programs):
        expert, pid_k, pid_n = wgrad_item(item, per_expert, tiles_k, tiles_n, GROUP_M)
        acc_MN = gl.zeros([_ROWS, BLOCK_N], gl.float32, acc_layout)
        acc_MN, count = _wgrad_sum_chunks(a_bufs, b_bufs, sa_bufs, sb_bufs, ready_bars, empty_bars, padded_ptr,
                                          expert, E, E_W, acc_MN, count, CONSUMER, BLOCK_N, STAGES)
        if PAIRED:
            acc_MN, count = _wgrad_sum_chunks(a_bufs, b_bufs, sa_bufs, sb_bufs, ready_bars, empty_bars, padded2_ptr,
                                              expert, E_W, E_W, acc_MN, count, CONSUMER, BLOCK_N, STAGES)
        store_weight_grad(acc_MN, expert, pid_k * BLOCK_M + CONSUMER * _ROWS, pid_n * BLOCK_N, KA, C, out_ptr,
                          out_desc, c_bufs, stride_oe, stride_ok, stride_oc, CONSUMER, BLOCK_N, ACCUMULATE, ATOMIC,
                          TMA_EPILOGUE)
    if TMA_EPILOGUE:
        tma.store_wait(0)  # the last item's TMA operation has read its buffer before shared memory goes


@gluon.jit
def _gluon_fp8_weight_grad_kernel(a_desc, b_desc, sa_desc, sb_desc, a2_desc, b2_desc, sa2_desc, sb2_desc, out_desc,
                                  out_ptr, padded_ptr, padded2_ptr, E, E_W, KA, C, num_programs, stride_oe, stride_ok,
                                  stride_oc, BLOCK_N: gl.constexpr, GROUP_M: gl.constexpr, STAGES: gl.constexpr,
                                  ACCUMULATE: gl.constexpr, ATOMIC: gl.constexpr, TMA_EPILOGUE: gl.constexpr,
                                  PAIRED: gl.constexpr, PRODUCER_REGS: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                  FENCE_INIT: gl.constexpr):
    # Contract: `gluon_fp8_weight_grad`'s, checked there; two consumer warpgroups of 64 KA rows each
    # (the item's 128) and the producer warp, as `_gluon_fp8_rows_gemm_kernel`; the ring's stages
    # carry the chunk's scales beside its A and B tiles. TMA_EPILOGUE: out_desc, out's [E_W x KA, C]
    # view in [64, BLOCK_N] boxes, and one such fp32 buffer per consumer; else None. PAIRED: a second
    # row set's descriptors (a2..sb2) and padded offsets (one group an expert), else None.
    a_bufs, b_bufs, ready_bars, empty_bars = ring(a_desc, b_desc, STAGES, 2, FENCE_INIT)
    sa_bufs = gl.allocate_shared_memory(sa_desc.dtype, [STAGES] + sa_desc.block_type.shape, sa_desc.layout)
    sb_bufs = gl.allocate_shared_memory(sb_desc.dtype, [STAGES] + sb_desc.block_type.shape, sb_desc.layout)
    if TMA_EPILOGUE:
        c_bufs = gl.allocate_shared_memory(out_desc.dtype, [2] + out_desc.block_type.shape, out_desc.layout)
    else:
        c_bufs: gl.constexpr = None
    gl.warp_specialize([
        (_wgrad_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready_bars, empty_bars, out_ptr, out_desc, c_bufs,
                           padded_ptr, padded2_ptr, E, E_W, KA, C, num_programs, stride_oe, stride_ok, stride_oc,
                           gl.constexpr(0), _ITEM_ROWS, BLOCK_N, GROUP_M, STAGES, ACCUMULATE, ATOMIC, TMA_EPILOGUE,
                           PAIRED)),
        (_wgrad_consumer, (a_bufs, b_bufs, sa_bufs, sb_bufs, ready_bars, empty_bars, out_ptr, out_desc, c_bufs,
                           padded_ptr, padded2_ptr, E, E_W, KA, C, num_programs, stride_oe, stride_ok, stride_oc,
                           gl.constexpr(1), _ITEM_ROWS, BLOCK_N, GROUP_M, STAGES, ACCUMULATE, ATOMIC, TMA_EPILOGUE,
                           PAIRED)),
        (_wgrad_producer, (a_desc, b_desc, sa_desc, sb_desc, a2_desc, b2_desc, sa2_desc, sb2_desc, a_bufs, b_bufs,
                           sa_bufs, sb_bufs, ready_bars, empty_bars, padded_ptr, padded2_ptr, E, E_W, KA, C,
                           num_programs, _ITEM_ROWS, BLOCK_N, GROUP_M, STAGES, PAIRED)),
    ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


def _check(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, out, block_m, block_n) -> None:
    """ValueError naming the fix for arguments the kernel cannot take."""
    wrong = {name: t.dtype for name, t in (("a", a_MK), ("b", b_EKN)) if t.dtype != FP8}
    if wrong:
        raise ValueError(f"FP8 operands must be torch.float8_e4m3fn (quantise them with kernels.fp8.quantize_rows / "
                         f"quantize_blocks); got {wrong}")
    if block_m not in BLOCK_MS or block_n not in BLOCK_NS:
        raise ValueError(f"gluon_fp8_rows_gemm tiles: block_m in {BLOCK_MS} (64 rows per consumer warpgroup wave), "
                         f"block_n in {BLOCK_NS} (one weight-block scale per column tile); got {block_m} x {block_n}")
    rows, k = a_MK.shape
    experts, k_b, cols = b_EKN.shape
    if k == 0 or k % SCALE_BLOCK:
        raise ValueError(f"gluon_fp8_rows_gemm needs K a positive multiple of {SCALE_BLOCK} (whole scale groups per "
                         f"TMA box); got K={k}: zero-pad K (a, b and their scales) or use kernels.fp8.fp8_rows_gemm")
    if k_b != k or sa_MG.shape != (rows, k // SCALE_BLOCK) or sb_EGB.shape != (
            experts, k // SCALE_BLOCK, triton.cdiv(cols, SCALE_BLOCK)):
        raise ValueError(f"FP8 GEMM operands do not fit: a {tuple(a_MK.shape)} with scales {tuple(sa_MG.shape)}, "
                         f"b {tuple(b_EKN.shape)} with scales {tuple(sb_EGB.shape)} (want a [M, K], sa [M, K / 128], "
                         f"b [E, K, N], sb [E, K / 128, cdiv(N, 128)])")
    if cols % block_n:
        raise ValueError(f"gluon_fp8_rows_gemm needs N a multiple of block_n={block_n}; got N={cols}: use block_n=64 "
                         f"if N is a multiple of 64, else kernels.fp8.fp8_rows_gemm")
    if b_EKN.stride() != (cols * k, 1, k):
        raise ValueError(f"b must be K-major with contiguous [E, N, K] storage (the TMA view [E*N, K]): pass "
                         f"q_ENK.transpose(1, 2) as fp8_ffn.Fp8ExpertWeights holds it (quantize_blocks(..., "
                         f"transposed_out=q_ENK)); got strides {b_EKN.stride()}")
    if not tma_rows(a_MK):
        raise ValueError(f"a must have unit column stride and 16-byte-aligned rows (TMA): pass a.contiguous(); got "
                         f"strides {a_MK.stride()}")
    if offsets_E.dim() != 1 or offsets_E.dtype != torch.int32 or offsets_E.shape[0] % experts:
        raise ValueError(f"offsets_E must be int32 cumulative rows of a multiple of {experts} groups; got "
                         f"{offsets_E.dtype} {tuple(offsets_E.shape)}")
    if out is not None and (out.shape != (rows, cols) or not out.dtype.is_floating_point or out.dtype == FP8):
        raise ValueError(f"out must be a float [M, N] = {(rows, cols)} tensor (bf16, fp16 or fp32); got "
                         f"{out.dtype} {tuple(out.shape)}")


def _check_ring(stages: int, block_m: int, block_n: int, epilogue: int) -> None:
    """ValueError naming the fix where the ring of `stages` and the epilogue buffers (`epilogue` bytes:
    the TMA store's, 0 without) do not fit a Hopper block's shared memory, or the ring is too shallow."""
    stage = (block_m + block_n) * SCALE_BLOCK
    if stages < 2 or stages * stage + epilogue > SHARED_MEMORY_BYTES:
        room = (SHARED_MEMORY_BYTES - epilogue) // stage
        raise ValueError(f"stages={stages}: the ring needs at least 2 stages (loads overlapping the MMAs) and, beside "
                         f"the epilogue buffers ({epilogue} bytes: the TMA store's, 0 without it), must fit the "
                         f"{SHARED_MEMORY_BYTES} bytes of shared memory a Hopper block may use ({stage} bytes per "
                         f"stage at {block_m} x {block_n}: pass stages between 2 and {room})")


def takes(a_MK: torch.Tensor, b_EKN: torch.Tensor, block_n: int = 128) -> bool:
    """Whether `gluon_fp8_rows_gemm` can run these operands here: a Hopper GPU (sm_90; not the
    interpreter, which runs no Gluon), K a multiple of 128, N of block_n, b K-major over contiguous
    [E, N, K] storage, a with unit column stride and 16-byte-aligned rows (`_check`'s layout rules,
    answered without raising: the FFN then takes `fp8.fp8_rows_gemm`)."""
    if not a_MK.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(a_MK.device) != (9, 0):
        return False
    rows, k = a_MK.shape
    experts, _, cols = b_EKN.shape
    return (k > 0 and k % SCALE_BLOCK == 0 and cols % block_n == 0 and b_EKN.stride() == (cols * k, 1, k)
            and tma_rows(a_MK))


def gluon_fp8_rows_gemm(
    a_MK: torch.Tensor,
    sa_MG: torch.Tensor,
    offsets_E: torch.Tensor,
    b_EKN: torch.Tensor,
    sb_EGB: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    block_m: int = 128,
    block_n: int = 128,
    stages: int = 4,
    num_programs: int | None = None,
    tma_store: bool = False,
) -> torch.Tensor:
    """`fp8.fp8_rows_gemm`'s plain epilogue: out[rows_g] = dequant(a[rows_g]) @ dequant(b[g mod E])
    for every row group g of `offsets_E` (int32 cumulative row counts, a multiple of E groups,
    empty groups allowed), a from `quantize_rows`, b K-major from `quantize_blocks` (module
    docstring: the requirements). `out` (given: [M, N], bf16, fp16 or fp32) or a new one of
    `out_dtype`. `stages`: the shared-memory ring's depth ((block_m + block_n) x 128 bytes each).
    `num_programs`: persistent programs (default one per SM; give it on a CPU, where the kernel can
    only be compiled). `tma_store` (off here, a run's default: module docstring): each 64-row wave
    wholly inside its group written through shared memory and stored by TMA, not waited for until
    its buffer's next use, on the tiles of `TMA_STORE_TILES`; where `out` cannot take a TMA
    descriptor (`tma_store_takes`) the masked store, as without it."""
    _check(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, out, block_m, block_n)
    if tma_store and (block_m, block_n) not in TMA_STORE_TILES:
        raise ValueError(f"tma_store=True runs the tiles {TMA_STORE_TILES}: at {block_m} x {block_n} ptxas spills "
                         f"registers of the K loop for its epilogue (sm_90a, module docstring); use one of those tiles "
                         f"(block_m=128, or block_n=64), or tma_store=False")
    rows, k = a_MK.shape
    experts, _, cols = b_EKN.shape
    if out is None:
        out = torch.empty((rows, cols), dtype=out_dtype, device=a_MK.device)
    by_tma = tma_store and tma_store_takes(out)
    _check_ring(stages, block_m, block_n, epilogue_bytes(block_m, block_n, out.element_size()) if by_tma else 0)
    if rows == 0 or cols == 0:
        return out
    a_box, b_box = [block_m, SCALE_BLOCK], [block_n, SCALE_BLOCK]
    a_desc = TensorDescriptor(a_MK, [rows, k], [a_MK.stride(0), 1], a_box,
                              gl.NVMMASharedLayout.get_default_for(a_box, gl.float8e4nv))
    b_NK = b_EKN.transpose(1, 2).reshape(experts * cols, k)  # a view: the storage is [E, N, K]
    b_desc = TensorDescriptor(b_NK, [experts * cols, k], [k, 1], b_box,
                              gl.NVMMASharedLayout.get_default_for(b_box, gl.float8e4nv))
    out_desc = None  # the kernel's masked store alone
    if by_tma:
        out_box = [CONSUMER_ROWS, block_n]
        out_desc = TensorDescriptor(out, [rows, cols], [out.stride(0), 1], out_box,
                                    gl.NVMMASharedLayout.get_default_for(out_box, OUT_DTYPES[out.dtype]))
    programs = num_programs or gg.default_num_programs(a_MK.device)
    groups = offsets_E.shape[0]
    _gluon_fp8_rows_gemm_kernel[(programs, )](
        a_desc, b_desc, out_desc, sa_MG, sb_EGB, out, offsets_E, groups, experts, cols, k, programs,
        sa_MG.stride(0), sa_MG.stride(1), *sb_EGB.stride(), out.stride(0), out.stride(1),
        E_POW2=triton.next_power_of_2(groups), BLOCK_M=block_m, BLOCK_N=block_n, GROUP_M=GROUP_M, STAGES=stages,
        PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS, FENCE_INIT=FENCE_BARRIER_INIT, TMA_STORE=by_tma,
        num_warps=4, maxnreg=MAXNREG if block_m >= 2 * CONSUMER_ROWS else None)
    return out


def _chunk_major(s_KC: torch.Tensor) -> bool:
    """Whether token-group scales lie chunk-major ([K, C] over [C, K] storage, `fp8.token_group_scales`),
    16-byte aligned: the flat view the ring's scale boxes are copied from."""
    return s_KC.stride() == (1, s_KC.shape[0]) and s_KC.data_ptr() % 16 == 0


def wgrad_takes(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """Whether `gluon_fp8_weight_grad` can run these token-group operands ((q, s) pairs) here: a
    Hopper GPU (not the interpreter), both token-contiguous ([KA, P] and [C, P], P a multiple of 128:
    what `fp8.quantize_token_groups` writes) with 16-byte-aligned rows (TMA), their scales chunk-major
    (as it writes them too)."""
    (qa_KP, sa_KC), (qb_CP, sb_CC) = a, b
    if not qa_KP.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if torch.cuda.get_device_capability(qa_KP.device) != (9, 0):
        return False
    return (all(tma_rows(t) and t.shape[1] % SCALE_BLOCK == 0 for t in (qa_KP, qb_CP))
            and _chunk_major(sa_KC) and _chunk_major(sb_CC))


def _scale_boxes(s_KC: torch.Tensor, box: int) -> TensorDescriptor:
    """A TMA descriptor of chunk-major scales seen flat ([C x K]), `box` scales a copy: chunk c's
    scales of K rows [k0, k0 + box) at c x K + k0 (a KA or C tile past K reads the next chunk's,
    multiplied by the zeros TMA fills past the operand's rows)."""
    flat = s_KC.t().reshape(-1)  # a view: the storage is [C, K]
    return TensorDescriptor(flat, [flat.numel()], [1], [box], SCALE_LAYOUT)


def _wgrad_shared_bytes(stages: int, block_n: int, epilogue_bytes: int) -> int:
    """Shared memory of the weight gradient: the ring's stages (A, B and their scales) and, with the TMA
    epilogue, one [64, block_n] buffer per consumer of `epilogue_bytes`-byte values (0: no TMA epilogue)."""
    rows = 2 * CONSUMER_ROWS
    stage = (rows + block_n) * SCALE_BLOCK + (rows + block_n) * 4
    return stages * stage + 2 * CONSUMER_ROWS * block_n * epilogue_bytes


def _token_group_descriptors(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                             block_n: int) -> tuple[TensorDescriptor, ...]:
    """The TMA descriptors of one row set's token-group operands: A [KA, P] in [128, 128] boxes, B [C, P]
    in [block_n, 128] boxes, and their chunk-major scales in runs of 128 and block_n (`_scale_boxes`)."""
    (qa_KP, sa_KC), (qb_CP, sb_CC) = a, b
    for name, t in (("a", qa_KP), ("b", qb_CP)):
        if not tma_rows(t):
            raise ValueError(f"{name} must be token-contiguous with 16-byte-aligned rows (TMA), as "
                             f"quantize_token_groups writes it; got strides {t.stride()}")
    for name, t in (("a", sa_KC), ("b", sb_CC)):
        if not _chunk_major(t):
            raise ValueError(f"{name}'s scales must lie chunk-major ([K, C] over [C, K] storage, 16-byte aligned), "
                             f"as quantize_token_groups writes them (fp8.token_group_scales); got strides {t.stride()}")
    a_box, b_box = [2 * CONSUMER_ROWS, SCALE_BLOCK], [block_n, SCALE_BLOCK]
    return (TensorDescriptor(qa_KP, list(qa_KP.shape), [qa_KP.stride(0), 1], a_box,
                             gl.NVMMASharedLayout.get_default_for(a_box, gl.float8e4nv)),
            TensorDescriptor(qb_CP, list(qb_CP.shape), [qb_CP.stride(0), 1], b_box,
                             gl.NVMMASharedLayout.get_default_for(b_box, gl.float8e4nv)),
            _scale_boxes(sa_KC, 2 * CONSUMER_ROWS), _scale_boxes(sb_CC, block_n))


def gluon_fp8_weight_grad(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    padded_E: torch.Tensor,
    *,
    weights: int | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    atomic: bool = True,
    tma_epilogue: bool | None = None,
    block_n: int = 128,
    stages: int = 4,
    num_programs: int | None = None,
    second: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """`fp8.fp8_weight_grad`'s sums, warp-specialised: out[e] = sum over groups g = e mod E_W and their
    128-token chunks c of (a[:, c] @ b[:, c]^T) x sa[:, c] x sb[:, c], [E_W, KA, C] fp32, or the dtype of a
    given `out` (bf16 or fp16: a fresh gradient written in its weights' dtype, the fp32 sums rounded once)
    (zeros for an expert without tokens; `accumulate`: added into `out`, an fp32 main gradient; `atomic`: by fp32
    reductions, the same sum bit for bit but for denormals, which the GPU's reductions flush to zero),
    128 KA rows an item (module docstring). `tma_epilogue` (None: where `wgrad_tma_epilogue_takes` out and
    the buffers fit shared memory beside the ring): each consumer's sums written through shared memory and
    stored, or reduce-added (accumulate, TMA's own fp32 add: the same sum) by TMA under the next item's
    wgmmas, not from registers (`atomic` then unused). Operands as `fp8.quantize_token_groups` writes them
    ((q_KP, s_KC) pairs, the scales chunk-major; `padded_E` its third result); `wgrad_takes` says where
    it runs. block_n: the C tile (64 or 128). `second` = (a2, b2, padded2_E): a second row set over the
    same experts (one group each, not banded), e.g. the next micro-batch's rows (`kernels.wgrad_pairs`):
    its chunks summed after the first's into the same fp32 sum, one write of out for both."""
    (qa_KP, _), (qb_CP, _) = a, b
    wrong = {name: t.dtype for name, t in (("a", qa_KP), ("b", qb_CP)) if t.dtype != FP8}
    if wrong:
        raise ValueError(f"FP8 operands must be torch.float8_e4m3fn (quantise them with "
                         f"kernels.fp8.quantize_token_groups); got {wrong}")
    if block_n not in BLOCK_NS:
        raise ValueError(f"gluon_fp8_weight_grad's C tile: block_n in {BLOCK_NS}; got {block_n}")
    ka, cols, groups, experts = weight_grad_shapes(a, b, padded_E, weights)
    descriptors = _token_group_descriptors(a, b, block_n)
    second_descriptors, padded2_E = (None, None, None, None), None
    if second is not None:
        a2, b2, padded2_E = second
        if a2[0].dtype != FP8 or b2[0].dtype != FP8:
            raise ValueError("the second row set's operands must be float8_e4m3fn too (quantize_token_groups)")
        if weight_grad_shapes(a2, b2, padded2_E, None)[:2] != (ka, cols) or padded2_E.shape[0] != experts \
                or groups != experts:
            raise ValueError(f"second must hold one row set over the same {experts} experts (one group each) with "
                             f"KA={ka} and C={cols}, and the first set one group an expert too (not banded)")
        second_descriptors = _token_group_descriptors(a2, b2, block_n)
    if accumulate and out is None:
        raise ValueError("accumulate=True adds into `out`: give the fp32 main gradient")
    if out is None:
        out = torch.empty((experts, ka, cols), dtype=torch.float32, device=qa_KP.device)
    if out.shape != (experts, ka, cols) or out.dtype not in OUT_DTYPES or (accumulate and out.dtype != torch.float32):
        raise ValueError(f"out must be [E_W, KA, C] = {(experts, ka, cols)}, fp32 (a main gradient, accumulate) or "
                         f"bf16 or fp16 (a fresh gradient in the weights' dtype); got {out.dtype} {tuple(out.shape)}")
    epilogue = out.element_size()
    if stages < 2 or _wgrad_shared_bytes(stages, block_n, epilogue if tma_epilogue else 0) > SHARED_MEMORY_BYTES:
        raise ValueError(f"stages={stages}: the ring needs at least 2 stages and, with the TMA epilogue's buffers if "
                         f"asked, must fit the {SHARED_MEMORY_BYTES} bytes of shared memory a Hopper block may use")
    if out.numel() == 0:
        return out
    takes = wgrad_tma_epilogue_takes(out)
    if tma_epilogue and not takes:
        raise ValueError(f"tma_epilogue=True writes out by TMA: it must be a contiguous [E_W, KA, C] with KA a "
                         f"multiple of {CONSUMER_ROWS} and 16-byte rows; got strides {out.stride()}, shape "
                         f"{tuple(out.shape)} (pass tma_epilogue=None to let the kernel choose)")
    if tma_epilogue is None:
        tma_epilogue = takes and _wgrad_shared_bytes(stages, block_n, epilogue) <= SHARED_MEMORY_BYTES
    out_desc = None
    if tma_epilogue:
        out_box = [CONSUMER_ROWS, block_n]
        out_desc = TensorDescriptor(out.view(experts * ka, cols), [experts * ka, cols], [cols, 1], out_box,
                                    gl.NVMMASharedLayout.get_default_for(out_box, OUT_DTYPES[out.dtype]))
    programs = num_programs or gg.default_num_programs(qa_KP.device)
    _gluon_fp8_weight_grad_kernel[(programs, )](
        *descriptors, *second_descriptors, out_desc, out, padded_E, padded2_E, groups, experts, ka, cols, programs,
        *out.stride(), BLOCK_N=block_n, GROUP_M=GROUP_M, STAGES=stages, ACCUMULATE=accumulate, ATOMIC=atomic,
        TMA_EPILOGUE=tma_epilogue, PAIRED=second is not None,
        PRODUCER_REGS=PRODUCER_REGS, CONSUMER_REGS=CONSUMER_REGS, FENCE_INIT=FENCE_BARRIER_INIT, num_warps=4,
        maxnreg=MAXNREG)
    return out
