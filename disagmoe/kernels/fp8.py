"""FP8 (e4m3) building blocks of the expert GEMMs with DeepSeek-V3's fine-grained scaling: the
quantisers and the ragged grouped GEMMs, each Triton kernel beside its plain-torch reference.

Legend: M rows (token-expert pairs, grouped by expert), K contraction size, N output columns,
E experts, G = cdiv(K, 128) scale groups along K, B = cdiv(N, 128) scale blocks along N, P padded
rows (weight gradients: each expert's rows padded to a multiple of 128); `offsets_E` int32
cumulative row counts (expert e owns rows offsets[e-1]:offsets[e], as in grouped_gemm.py).
Every scale is fp32 and multiplies: value = fp8 value x scale, scale = max(amax, AMAX_FLOOR) / 448.
Which GEMM takes which scales, and why: docs/architecture.md, "FP8 expert GEMMs".

Forward and data gradient: `fp8_rows_gemm` (rows from `quantize_rows`, weights from
`quantize_blocks` or, for dy @ W^T, `transpose_blocks`). Weight gradient: `fp8_weight_grad` over
token-contiguous copies from `quantize_token_groups` (128 x 1 scales, groups padded to 128 rows).
A tensor both GEMMs read (the backward's dy and dh13) gets both copies from one pass over it:
`quantize_rows_and_token_groups`.

One code path for the GPU and the CPU interpreter but for the rounding: Triton 3.6's interpreter
handles float8 tensors and fp8 `tl.dot` exactly, but its fp32 -> fp8 cast rounds wrongly, so under
the interpreter the quantisers round to the e4m3 grid themselves (`_round_to_e4m3`: integer
arithmetic on the fp32 bits) and cast values that are exactly representable. Compiled, the same
function is the hardware's saturating round-to-nearest-even conversion (one `cvt` per two values):
without the emulation's 20-odd integer operations per element the quantisers ran 1.12-1.42x
faster on an H200 (docs/benchmarks.md, session 17; they stay below HBM bandwidth for other
reasons). Both give the same bits for every fp32 bit pattern (a GPU test compares them). The
token-group quantisers also divide by the scale differently compiled (`_quotient`: a reciprocal and an
FMA correction, the same bits; the interpreter's fma rounds twice, so there it divides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.fp8_rounding import (AMAX_FLOOR, FP8, SCALE_BLOCK, _AMAX_FLOOR, _E4M3_MAX,  # noqa: F401
                                            _E4M3_MAX_RECIPROCAL, _FP32_MAX, _HARDWARE_ROUNDING, _SATURATION_BOUND,
                                            _SCALE_BLOCK, _TINY_SCALE, _TINY_SCALE_UP, _divided_by, _e4m3, _negated,
                                            _quantize_group_store, _quantized_rows, _quotient, _reciprocal_of,
                                            _round_to_e4m3, _round_to_e4m3_emulated, _scale_by_fma, _scale_of)
from disagmoe.kernels.fp8_stats import E4M3_MAX, FIELDS
from disagmoe.kernels.tile_configs import TileConfig


@triton.jit
def _record_stats(stats_ptr, x, scaled, q, ok):
    """Add one tile's counters into stats_ptr's row (`kernels.fp8_stats`: AMAX, SATURATED,
    UNDERFLOW, TOTAL, NONFINITE): x the fp32 inputs, scaled = x / scale, q their e4m3 values (fp32),
    ok the elements that count. Five atomics per call, after the tile's own reductions."""
    tl.static_assert(x.numel < 65536)
    amax_bits, low, high = _tile_stats(x, scaled, q, ok)
    _add_stats(stats_ptr, amax_bits, tl.sum(tl.sum(low, axis=1), axis=0), tl.sum(tl.sum(high, axis=1), axis=0))


@triton.jit
def _tile_stats(x, scaled, q, ok):
    """`_record_stats`' per-element work: (the largest counted |scaled|'s fp32 bits as int64, low,
    high), low and high int32 tiles packing two counts each (16 bits apiece: the caller keeps a
    sum's every count under 2^16), saturated | underflow << 16 and total | nonfinite << 16; two
    reductions of them instead of four (the SwiGLU epilogue's tile spilled with four)."""
    finite = ok & (tl.abs(x) <= 3.4028234663852886e38)  # False for inf and NaN
    mag = tl.where(finite & (tl.abs(scaled) <= 3.4028234663852886e38), tl.abs(scaled), 0.0)  # x / NaN-scale
    amax_bits = tl.max(tl.max(mag, axis=1), axis=0).to(tl.int32, bitcast=True).to(tl.int64)
    # saturated: a finite input past the bound, inf included (x / 0 where a scale underflowed to 0,
    # as `fp8_stats.stats_reference` counts it); NaN (x / NaN-scale) compares false
    low = ((finite & (tl.abs(scaled) > _SATURATION_BOUND)).to(tl.int32)
           | ((finite & (x != 0.0) & (q == 0.0)).to(tl.int32) << 16))  # saturated | underflow
    high = ok.to(tl.int32) | ((ok & ~finite).to(tl.int32) << 16)  # total | nonfinite
    return amax_bits, low, high


@triton.jit
def _tile_counts(x, scaled, q, ok):
    """One tile's counters summed (`_tile_stats`): (amax_bits, saturated, underflow, total,
    nonfinite), int64 scalars a persistent program adds up over its tiles and adds once
    (`_add_counts`): five atomics a program, not a tile (on one row's five addresses, a tile's
    atomics cost more than its quantising: session 20's `bench profile` of the Mixtral FP8 step)."""
    tl.static_assert(x.numel < 65536)  # the packed 16-bit counts of one tile
    amax_bits, low, high = _tile_stats(x, scaled, q, ok)
    low = tl.sum(tl.sum(low, axis=1), axis=0)
    high = tl.sum(tl.sum(high, axis=1), axis=0)
    return (amax_bits, (low & 0xFFFF).to(tl.int64), ((low >> 16) & 0xFFFF).to(tl.int64),
            (high & 0xFFFF).to(tl.int64), ((high >> 16) & 0xFFFF).to(tl.int64))


@triton.jit
def _no_counts():
    """A persistent program's running counters before its first tile: (amax_bits, saturated,
    underflow, total, nonfinite), int64 zeros (`_count_tile` adds to them, `_add_counts` ends them)."""
    zero = tl.zeros((), dtype=tl.int64)
    return zero, zero, zero, zero, zero


@triton.jit
def _add_counts(stats_ptr, amax_bits, saturated, underflow, total, nonfinite):
    """The five atomics of summed counters (`_tile_counts`) into stats_ptr's row."""
    tl.atomic_max(stats_ptr, amax_bits)
    tl.atomic_add(stats_ptr + 1, saturated)
    tl.atomic_add(stats_ptr + 2, underflow)
    tl.atomic_add(stats_ptr + 3, total)
    tl.atomic_add(stats_ptr + 4, nonfinite)


@triton.jit
def _add_stats(stats_ptr, amax_bits, low, high):
    """The five atomics into stats_ptr's row: amax_bits (int64 of a non-negative fp32's bits: their
    integer order is the floats'), low and high summed packed counts (`_tile_stats`)."""
    tl.atomic_max(stats_ptr, amax_bits)
    tl.atomic_add(stats_ptr + 1, (low & 0xFFFF).to(tl.int64))
    tl.atomic_add(stats_ptr + 2, ((low >> 16) & 0xFFFF).to(tl.int64))  # & undoes the sign of >>
    tl.atomic_add(stats_ptr + 3, (high & 0xFFFF).to(tl.int64))
    tl.atomic_add(stats_ptr + 4, ((high >> 16) & 0xFFFF).to(tl.int64))


@triton.jit
def _rows_tile(x_ptr, tile, groups, rows_valid, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, SWIGLU: tl.constexpr):
    """`_quantize_rows_kernel`'s tile `tile`: (x fp32 [BLOCK_M, 128] (zeros outside ok), ok, the rows
    counted and written, their indices (int64), the scale group, its columns ks, each row's amax and
    scale, x / scale, its e4m3 values)."""
    rows = (tile // groups) * BLOCK_M + tl.arange(0, BLOCK_M)
    group = tile % groups
    ks = group * _SCALE_BLOCK + tl.arange(0, _SCALE_BLOCK)
    row_ok = rows < rows_valid
    ok = row_ok[:, None] & (ks < K)[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk, mask=ok, other=0.0)
    x = x.to(tl.float32)
    if SWIGLU:
        up = tl.load(x_ptr + rows64[:, None] * stride_xm + (K + ks)[None, :] * stride_xk, mask=ok, other=0.0)
        x = tl.where(ok, x * tl.sigmoid(x) * up.to(tl.float32), 0.0)
    row_amax, scale, scaled, q = _quantized_rows(x)
    return x, ok, row_ok, rows64, group, ks, row_amax, scale, scaled, q


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, stats_ptr, valid_ptr, M, K,
                          stride_xm, stride_xk, stride_qm, stride_qk, stride_sm, stride_sg,
                          BLOCK_M: tl.constexpr, STATS: tl.constexpr, VALID: tl.constexpr,
                          SWIGLU: tl.constexpr):
    # Persistent: program p quantises tiles p, p + P, p + 2P, ... of the (row block, group) tiles,
    # group-major within a row block (neighbouring programs read neighbouring columns); tile t is
    # q[rows, g-th 128 columns] and s[rows, g]. Columns past K count as zeros in the amax and are
    # not stored. VALID: only the first valid_ptr[0] rows are read, counted and written (a worst-case
    # buffer's padding rows hold whatever was there: they must not reach the counters). SWIGLU: x is
    # h13 [M, 2K] (gate | up) and the values quantised are silu(gate) * up in fp32, as the SwiGLU
    # GEMM's epilogue computes them.
    # STATS, without a reduction across the program's threads per tile: each element position keeps
    # its underflows and non-finite inputs packed in an int32 (16 bits each: the launch keeps a
    # program under 2^16 tiles), each row position its largest |x / scale| (from the row's amax:
    # div_rn is monotonic), TOTAL the tiles' counted sizes; summed once at the end. Where no input
    # was non-finite and no |x / scale| passed the saturation bound, that is every counter
    # (SATURATED and NONFINITE zero); otherwise the program counts its tiles again element by element
    # (`_tile_counts`), exactly, from the inputs (q and s are written, x is not).
    rows_valid = M
    if VALID:
        rows_valid = tl.minimum(tl.load(valid_ptr), M)
    groups = tl.cdiv(K, _SCALE_BLOCK)
    tiles = tl.cdiv(rows_valid, BLOCK_M) * groups
    packed = tl.zeros((BLOCK_M, _SCALE_BLOCK), dtype=tl.int32)  # underflow | nonfinite << 16, by position
    peak = tl.zeros((BLOCK_M,), dtype=tl.float32)  # by row position: the largest |x / scale|
    total = tl.zeros((), dtype=tl.int64)
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        x, ok, row_ok, rows64, group, ks, row_amax, scale, scaled, q = _rows_tile(
            x_ptr, tile, groups, rows_valid, K, stride_xm, stride_xk, BLOCK_M, SWIGLU)
        if STATS:
            packed = _count_positions(packed, x, q)
            peak = tl.maximum(peak, tl.math.div_rn(row_amax, scale))
            total += (tl.minimum(rows_valid - (tile // groups) * BLOCK_M, BLOCK_M)
                      * tl.minimum(K - group * _SCALE_BLOCK, _SCALE_BLOCK)).to(tl.int64)
        tl.store(q_ptr + rows64[:, None] * stride_qm + ks[None, :] * stride_qk,
                 q.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + rows64 * stride_sm + group * stride_sg, scale, mask=row_ok)
    if STATS:
        largest = tl.max(peak, axis=0)
        if _positions_clean(packed, largest):
            _add_position_counts(stats_ptr, packed, largest, total)
        else:
            amax_bits, saturated, underflow, counted, nonfinite = _no_counts()
            for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
                x, ok, row_ok, rows64, group, ks, row_amax, scale, scaled, q = _rows_tile(
                    x_ptr, tile, groups, rows_valid, K, stride_xm, stride_xk, BLOCK_M, SWIGLU)
                amax_bits, saturated, underflow, counted, nonfinite = _count_tile(
                    amax_bits, saturated, underflow, counted, nonfinite, x, scaled, q, ok)
            _add_counts(stats_ptr, amax_bits, saturated, underflow, counted, nonfinite)


@triton.jit
def _swiglu_grad_rows_quantized_kernel(da_ptr, h13_ptr, out_ptr, act_ptr, q_ptr, s_ptr, limit_ptr, N, C,
                                       stride_dm, stride_dc, stride_hm, stride_hc, stride_om, stride_oc,
                                       stride_xm, stride_xc, stride_qm, stride_qk, stride_sm, stride_sg,
                                       BLOCK_R: tl.constexpr):
    # `grouped_gemm._swiglu_grad_rows_kernel` (no row scale, act saved) over BLOCK_R rows, 128 columns
    # a step (C a multiple of 128), each step's d gate and d up also quantised as `_quantize_rows_kernel`
    # quantises d h13 [N, 2C] read back: their values rounded to out's dtype first, d gate's columns
    # [c0, c0 + 128) group c0 / 128 and d up's [C + c0, ...) group (C + c0) / 128. Rows at or past the
    # limit (or N): nothing read or written.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < tl.minimum(tl.load(limit_ptr), N)
    rows64 = rows.to(tl.int64)
    unused = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for c0 in range(0, C, _SCALE_BLOCK):
        cols = c0 + tl.arange(0, _SCALE_BLOCK)
        ok, d_act, gate, up = gg._swiglu_grad_inputs(da_ptr, h13_ptr, rows64, row_ok, cols, C,
                                                     stride_dm, stride_dc, stride_hm, stride_hc)
        d_gate, d_up, sig, _ = gg._swiglu_grad_values(d_act, gate, up, unused, False)
        d_gate = d_gate.to(out_ptr.dtype.element_ty)
        d_up = d_up.to(out_ptr.dtype.element_ty)
        out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_oc
        tl.store(out_ptrs, d_gate, mask=ok)
        tl.store(out_ptrs + C * stride_oc, d_up, mask=ok)
        tl.store(act_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xc,
                 (gate * sig * up).to(act_ptr.dtype.element_ty), mask=ok)
        _quantize_group_store(tl.where(ok, d_gate.to(tl.float32), 0.0), ok, row_ok, rows64, cols, c0 // _SCALE_BLOCK,
                              q_ptr, s_ptr, stride_qm, stride_qk, stride_sm, stride_sg)
        _quantize_group_store(tl.where(ok, d_up.to(tl.float32), 0.0), ok, row_ok, rows64, C + cols,
                              (C + c0) // _SCALE_BLOCK, q_ptr, s_ptr, stride_qm, stride_qk, stride_sm, stride_sg)


@triton.jit
def _count_positions(packed, x, q):
    """`packed` (int32 by element position: underflows | non-finite inputs << 16, a persistent
    quantiser's running counts) with one tile's added; masked elements are zeros: neither."""
    return packed + tl.where((x != 0.0) & (q == 0.0), 1, 0) + tl.where(tl.abs(x) <= 3.4028234663852886e38, 0, 65536)


@triton.jit
def _scaled_counts(x, scaled):
    """`_count_positions(0, x, q)` from scaled = x / scale, not from its e4m3 values q (their conversion back to
    fp32 spared): q is 0 exactly where |scaled| <= 2^-10 (half e4m3's least subnormal, 2^-9: a tie, to even)."""
    return tl.where((x != 0.0) & (tl.abs(scaled) <= 0.0009765625), 1, 0) + tl.where(tl.abs(x) <= _FP32_MAX, 0, 65536)


@triton.jit
def _positions_clean(packed, largest):
    """Whether a program's per-position counts and its largest |x / scale| are all its counters: no
    non-finite input, no scaled value past the saturation bound (then SATURATED and NONFINITE are zero)."""
    return (tl.sum(tl.sum((packed >> 16) & 0xFFFF, axis=1), axis=0) == 0) & (largest <= _SATURATION_BOUND)


@triton.jit
def _add_position_counts(stats_ptr, packed, largest, total):
    """The five atomics of a clean program's counters (`_positions_clean`)."""
    zero = tl.zeros((), dtype=tl.int64)
    _add_counts(stats_ptr, largest.to(tl.int32, bitcast=True).to(tl.int64), zero,
                tl.sum(tl.sum(packed & 0xFFFF, axis=1), axis=0).to(tl.int64), total, zero)


@triton.jit
def _count_tile(amax_bits, saturated, underflow, total, nonfinite, x, scaled, q, ok):
    """The running counters with one tile's `_tile_counts` added, element by element (AMAX a max, the
    rest sums)."""
    tile_amax, tile_sat, tile_under, tile_total, tile_nonfinite = _tile_counts(x, scaled, q, ok)
    return (tl.maximum(amax_bits, tile_amax), saturated + tile_sat, underflow + tile_under, total + tile_total,
            nonfinite + tile_nonfinite)


@triton.jit
def _block_at(block, tiles_k, tiles_n, N):
    """Block `block` of `_quantize_blocks_kernel`'s order: (its expert (int64), its K block, its N block,
    its columns ns, which of them are inside N)."""
    nb = block % tiles_n
    ns = nb * _SCALE_BLOCK + tl.arange(0, _SCALE_BLOCK)
    return (block // (tiles_k * tiles_n)).to(tl.int64), (block // tiles_n) % tiles_k, nb, ns, ns < N


@triton.jit
def _block_scale(w_ptr, e64, kb, ns, n_ok, K, stride_we, stride_wk, stride_wn, ROWS: tl.constexpr):
    """(scale, the largest |w / scale|) of block (e, kb, the columns ns) of w, from its amax read in
    ROWS-row chunks (div_rn is monotonic: the largest scaled value is the amax's)."""
    amax = 0.0
    for r0 in range(0, _SCALE_BLOCK, ROWS):
        ks = kb * _SCALE_BLOCK + r0 + tl.arange(0, ROWS)
        w = tl.load(w_ptr + e64 * stride_we + ks[:, None] * stride_wk + ns[None, :] * stride_wn,
                    mask=(ks < K)[:, None] & n_ok[None, :], other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.max(tl.max(tl.abs(w), axis=1), axis=0))
    scale = _scale_of(amax)
    return scale, tl.math.div_rn(amax, scale)


@triton.jit
def _block_chunk(w_ptr, e64, kb, r0, ns, n_ok, K, scale, stride_we, stride_wk, stride_wn, ROWS: tl.constexpr):
    """Rows r0 .. r0 + ROWS of block (e, kb, ns): (w fp32 (zeros outside ok), ok, their rows ks, w / scale,
    its e4m3 values)."""
    ks = kb * _SCALE_BLOCK + r0 + tl.arange(0, ROWS)
    ok = (ks < K)[:, None] & n_ok[None, :]
    w = tl.load(w_ptr + e64 * stride_we + ks[:, None] * stride_wk + ns[None, :] * stride_wn,
                mask=ok, other=0.0).to(tl.float32)
    scaled = tl.math.div_rn(w, tl.broadcast_to(scale, w.shape))
    return w, ok, ks, scaled, _round_to_e4m3(scaled)


@triton.jit
def _quantize_blocks_kernel(w_ptr, q_ptr, qt_ptr, s_ptr, stats_ptr, K, N, tiles_k, tiles_n, blocks,
                            stride_we, stride_wk, stride_wn, stride_qe, stride_qk, stride_qn,
                            stride_te, stride_tn, stride_tk, stride_se, stride_sk, stride_sn,
                            ROWS: tl.constexpr, STATS: tl.constexpr, TRANSPOSED: tl.constexpr,
                            NATURAL: tl.constexpr):
    # Persistent: program p quantises blocks p, p + P, ... of the `blocks` 128 x 128 blocks
    # (e, kb, nb) of w [E, K, N], each with its scale s[e, kb, nb]. Two passes over ROWS-row chunks
    # (the amax, then the values): a whole 128 x 128 fp32 block with its pointers and the rounding's
    # integers spills at any warp count (ptxas, sm_90a). NATURAL: each block's values are stored
    # into q [E, K, N]; TRANSPOSED: into qt [E, N, K] (the copy a transposing pass would make); one
    # or both (q_ptr is unread without NATURAL).
    # STATS as `_quantize_rows_kernel` counts them: underflows and non-finite inputs packed per element
    # position of a chunk, the blocks' largest |w / scale| a running max, TOTAL the chunks' sizes, all
    # summed once; a program that met a non-finite input or a saturating scale counts its blocks again
    # element by element.
    packed = tl.zeros((ROWS, _SCALE_BLOCK), dtype=tl.int32)  # underflow | nonfinite << 16, by position
    peak = tl.zeros((), dtype=tl.float32)
    total = tl.zeros((), dtype=tl.int64)
    for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
        e64, kb, nb, ns, n_ok = _block_at(block, tiles_k, tiles_n, N)
        scale, scaled_max = _block_scale(w_ptr, e64, kb, ns, n_ok, K, stride_we, stride_wk, stride_wn, ROWS)
        if STATS:
            peak = tl.maximum(peak, scaled_max)
            total += (tl.minimum(K - kb * _SCALE_BLOCK, _SCALE_BLOCK)
                      * tl.minimum(N - nb * _SCALE_BLOCK, _SCALE_BLOCK)).to(tl.int64)
        for r0 in range(0, _SCALE_BLOCK, ROWS):
            w, ok, ks, scaled, q = _block_chunk(w_ptr, e64, kb, r0, ns, n_ok, K, scale,
                                                stride_we, stride_wk, stride_wn, ROWS)
            if STATS:
                packed = _count_positions(packed, w, q)
            if NATURAL:
                tl.store(q_ptr + e64 * stride_qe + ks[:, None] * stride_qk + ns[None, :] * stride_qn,
                         q.to(q_ptr.dtype.element_ty), mask=ok)
            if TRANSPOSED:
                tl.store(qt_ptr + e64 * stride_te + ns[None, :] * stride_tn + ks[:, None] * stride_tk,
                         q.to(qt_ptr.dtype.element_ty), mask=ok)
        tl.store(s_ptr + e64 * stride_se + kb * stride_sk + nb * stride_sn, scale)
    if STATS:
        if _positions_clean(packed, peak):
            _add_position_counts(stats_ptr, packed, peak, total)
        else:
            amax_bits, saturated, underflow, counted, nonfinite = _no_counts()
            for block in range(tl.program_id(0), blocks, tl.num_programs(0)):
                e64, kb, nb, ns, n_ok = _block_at(block, tiles_k, tiles_n, N)
                scale, scaled_max = _block_scale(w_ptr, e64, kb, ns, n_ok, K, stride_we, stride_wk, stride_wn, ROWS)
                for r0 in range(0, _SCALE_BLOCK, ROWS):
                    w, ok, ks, scaled, q = _block_chunk(w_ptr, e64, kb, r0, ns, n_ok, K, scale,
                                                        stride_we, stride_wk, stride_wn, ROWS)
                    amax_bits, saturated, underflow, counted, nonfinite = _count_tile(
                        amax_bits, saturated, underflow, counted, nonfinite, w, scaled, q, ok)
            _add_counts(stats_ptr, amax_bits, saturated, underflow, counted, nonfinite)

# Programs per SM of the persistent quantisers: enough 32 x 128 tiles in flight to keep HBM busy
# (each program's loads wait on the one before: 8 per SM hold about 8 MiB of bf16 in flight on an H200).
QUANTISER_PROGRAMS_PER_SM = 8


# The block quantiser's rows a chunk (`_quantize_blocks_kernel`'s ROWS): a whole 128 x 128 fp32 block spills.
BLOCK_ROWS = 32
BLOCKS_WARPS = 4  # and its warps a program


def counted_programs(device: torch.device, units: int, chunks_per_unit: int) -> int:
    """Programs of a persistent counting quantiser's launch over `units` work units (tiles, blocks, row
    blocks) of `chunks_per_unit` counted chunks each: `_persistent_programs`, or more where a program
    would count more than 2^16 - 1 chunks (the per-position counts are packed 16 bits apiece)."""
    per_program = max(1, 65535 // chunks_per_unit)
    return max(_persistent_programs(device), triton.cdiv(units, per_program))


def _persistent_programs(device: torch.device) -> int:
    """Programs of a persistent quantiser's launch: `QUANTISER_PROGRAMS_PER_SM` per SM on a GPU,
    the interpreter's handful on the CPU (every program then strides over several tiles)."""
    per_sm = QUANTISER_PROGRAMS_PER_SM if device.type == "cuda" else 1
    return per_sm * gg.default_num_programs(device)


def _stats_ptr(stats: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The kernels' stats argument: the row given (checked), else any tensor (STATS=False never reads it)."""
    if stats is None:
        return placeholder
    if stats.dtype != torch.int64 or stats.shape != (FIELDS,) or not stats.is_contiguous():
        raise ValueError(f"stats must be one int64 row of {FIELDS} counters (`fp8_stats.Fp8Stats.row`); got "
                         f"{stats.dtype} {tuple(stats.shape)}")
    return stats


def quantize_rows(x_MK: torch.Tensor, stats: torch.Tensor | None = None,
                  valid_rows: torch.Tensor | None = None, *, m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_MK float8_e4m3fn, s_MG fp32): one scale per row and 128 columns of K (the last group may
    be shorter). x any float dtype and strides; the A operand of `fp8_rows_gemm`. `stats`: an
    int64 row of an `fp8_stats.Fp8Stats` buffer the kernel adds its counters into (None: none).
    `valid_rows`: an int32 device tensor whose first element counts the rows that hold data (a
    worst-case buffer's, e.g. `offsets_E[-1:]`; never read on the host): the rows past it are
    neither read nor counted, and their q and s are left unwritten. `m_major`: s_MG stored with
    the rows contiguous (strides (1, M)), the layout cuBLAS's 1 x 128 scaling reads
    (`fp8_dense`'s blockwise recipe); the same values."""
    return _quantize_rows(x_MK, stats, valid_rows, swiglu=False, m_major=m_major)


def quantize_swiglu_rows(h13_M2F: torch.Tensor, stats: torch.Tensor | None = None,
                         valid_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rows` of act = silu(gate) * up, computed in fp32 from the pre-activations h13
    [M, 2F] (gate | up) as it reads them: the down GEMM's A operand without writing act in bf16
    (`fp8_swiglu_gemm`'s epilogue as a pass of its own, after a plain GEMM wrote h13)."""
    if h13_M2F.shape[1] % 2:
        raise ValueError(f"h13 must hold gate and up columns [M, 2F]; got width {h13_M2F.shape[1]}")
    return _quantize_rows(h13_M2F, stats, valid_rows, swiglu=True)


def swiglu_grad_quantizes(d_act_NC: torch.Tensor) -> bool:
    """Whether `swiglu_grad_rows_quantized` takes d act [N, C]: C a multiple of 128, so that each
    1 x 128 group of d h13 [N, 2C] lies inside d gate's half or d up's."""
    return d_act_NC.shape[1] % SCALE_BLOCK == 0


def swiglu_grad_rows_quantized(d_act_NC: torch.Tensor, h13_N2C: torch.Tensor, offsets_E: torch.Tensor, *,
                               act_N_C: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    """(d h13 [N, 2C], (q [N, 2C] float8_e4m3fn, s [N, 2C / 128] fp32)) from one pass over d act:
    `grouped_gemm.swiglu_grad_rows(d_act_NC, h13_N2C, offsets_E, act_N_C=act_N_C)` and
    `quantize_rows(d h13, valid_rows=offsets_E[-1:])`, the very bytes of the two (d h13's values
    quantised as rounded to its dtype), without reading d h13 back. No counters: a step that counts
    its numerics quantises with `quantize_rows`. Rows at or past the last offset are left unwritten
    in all three outputs. C must be a multiple of 128 (`swiglu_grad_quantizes`)."""
    n_rows, cols = d_act_NC.shape
    if not swiglu_grad_quantizes(d_act_NC):
        raise ValueError(f"swiglu_grad_rows_quantized needs d act's width ({cols}) to be a multiple of "
                         f"{SCALE_BLOCK}, so each 1 x {SCALE_BLOCK} group of d h13 lies in one half; run "
                         "grouped_gemm.swiglu_grad_rows and quantize_rows instead")
    if h13_N2C.shape != (n_rows, 2 * cols) or act_N_C.shape != (n_rows, cols):
        raise ValueError(f"h13 must be {(n_rows, 2 * cols)} and act {(n_rows, cols)} beside d act {(n_rows, cols)}; "
                         f"got {tuple(h13_N2C.shape)} and {tuple(act_N_C.shape)}")
    if offsets_E.dtype != torch.int32 or offsets_E.numel() < 1 or offsets_E.device != d_act_NC.device:
        raise ValueError(f"offsets_E must be an int32 tensor on {d_act_NC.device} of the groups' cumulative row "
                         f"counts; got {offsets_E.dtype} {tuple(offsets_E.shape)} on {offsets_E.device}")
    dh13_N2C = d_act_NC.new_empty((n_rows, 2 * cols))
    q_N2C, s_NG = empty_quantized_rows(n_rows, 2 * cols, d_act_NC.device)
    if n_rows == 0 or cols == 0:
        return dh13_N2C, (q_N2C, s_NG)
    _swiglu_grad_rows_quantized_kernel[(triton.cdiv(n_rows, gg.SPLIT_ROWS),)](
        d_act_NC, h13_N2C, dh13_N2C, act_N_C, q_N2C, s_NG, offsets_E[-1:], n_rows, cols,
        d_act_NC.stride(0), d_act_NC.stride(1), h13_N2C.stride(0), h13_N2C.stride(1),
        dh13_N2C.stride(0), dh13_N2C.stride(1), act_N_C.stride(0), act_N_C.stride(1),
        q_N2C.stride(0), q_N2C.stride(1), s_NG.stride(0), s_NG.stride(1), BLOCK_R=gg.SPLIT_ROWS, num_warps=4)
    return dh13_N2C, (q_N2C, s_NG)


def empty_quantized_rows(rows: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_MK float8_e4m3fn [rows, k], s_MG fp32 [rows, cdiv(k, 128)]), uninitialised: the buffers of a 1 x 128
    quantisation as `quantize_rows` returns it, for a kernel that writes one (`grouped_gemm.ragged_rows_gemm`'s
    `quantized_out`, `swiglu_grad_rows_quantized`)."""
    return (torch.empty((rows, k), dtype=FP8, device=device),
            torch.empty((rows, triton.cdiv(k, SCALE_BLOCK)), dtype=torch.float32, device=device))


def _quantize_rows(x_MK: torch.Tensor, stats: torch.Tensor | None, valid_rows: torch.Tensor | None, *,
                   swiglu: bool, m_major: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    rows, k = x_MK.shape
    k = k // 2 if swiglu else k
    if valid_rows is not None and (valid_rows.dtype != torch.int32 or valid_rows.numel() < 1
                                   or valid_rows.device != x_MK.device):
        raise ValueError(f"valid_rows must be an int32 tensor on {x_MK.device} holding the row count; got "
                         f"{valid_rows.dtype} {tuple(valid_rows.shape)} on {valid_rows.device}")
    groups = triton.cdiv(k, SCALE_BLOCK)
    if m_major:
        q_MK = torch.empty((rows, k), dtype=FP8, device=x_MK.device)
        s_MG = torch.empty((groups, rows), dtype=torch.float32, device=x_MK.device).t()
    else:
        q_MK, s_MG = empty_quantized_rows(rows, k, x_MK.device)
    if rows == 0 or k == 0:
        return q_MK, s_MG
    block_m = 16 if x_MK.device.type == "cpu" else 32
    tiles = triton.cdiv(rows, block_m) * groups
    _quantize_rows_kernel[(min(tiles, counted_programs(x_MK.device, tiles, 1)),)](
        x_MK, q_MK, s_MG, _stats_ptr(stats, s_MG), valid_rows if valid_rows is not None else s_MG, rows, k,
        x_MK.stride(0), x_MK.stride(1), q_MK.stride(0), q_MK.stride(1), s_MG.stride(0), s_MG.stride(1),
        BLOCK_M=block_m, STATS=stats is not None, VALID=valid_rows is not None, SWIGLU=swiglu, num_warps=4)
    return q_MK, s_MG


def quantize_blocks(w_EKN: torch.Tensor, stats: torch.Tensor | None = None, *,
                    transposed_out: torch.Tensor | None = None,
                    natural: bool = True,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(q_EKN float8_e4m3fn, s_EGB fp32): one scale per 128 x 128 block of each expert's [K, N]
    (edge blocks may be smaller). The expert weights' layout (`w13_EH2F`, `w2_EFH`: [E, K, N]);
    made once per optimizer step from the masters. `stats` as `quantize_rows`. `transposed_out`
    (float8_e4m3fn [E, N, K]): also written with q's transpose by the same launch, the values
    `transpose_blocks` would copy (its scales are s_EGB's transpose) without reading q again
    (torch's transposing copy of one-byte values ran at about 350 GB/s: 24 ms of a Mixtral-shaped
    FP8 step). `natural` False (with `transposed_out`): the transposed copy alone, q_EKN neither
    allocated nor written (None returned for it): a recipe that reads only one layout
    (`fp8_ffn.Fp8ExpertWeights`) holds one byte a value, not two. `out`: the (q_EKN, s_EGB) buffers
    to write into, any strides (a captured step's copies keep their addresses; q_EKN None with
    `natural` False: the scales' buffer alone); returned as given."""
    experts, k, n = w_EKN.shape
    tiles_k, tiles_n = triton.cdiv(k, SCALE_BLOCK), triton.cdiv(n, SCALE_BLOCK)
    if not natural and transposed_out is None:
        raise ValueError("quantize_blocks(natural=False) writes only the transposed copy: pass transposed_out "
                         f"(float8_e4m3fn {(experts, n, k)}), or natural=True")
    if transposed_out is not None and (transposed_out.shape != (experts, n, k) or transposed_out.dtype != FP8
                                       or transposed_out.device != w_EKN.device):
        raise ValueError(f"transposed_out must be float8_e4m3fn {(experts, n, k)} on {w_EKN.device}; got "
                         f"{transposed_out.dtype} {tuple(transposed_out.shape)} on {transposed_out.device}")
    if out is not None:
        q_EKN, s_EGB = out
        if (q_EKN is None) == natural:
            raise ValueError("quantize_blocks(out=(q, s)): q is the natural copy's buffer, given with natural=True "
                             "and None with natural=False (the transposed copy alone, into transposed_out)")
        if ((q_EKN is not None and (q_EKN.shape != (experts, k, n) or q_EKN.dtype != FP8))
                or s_EGB.shape != (experts, tiles_k, tiles_n) or s_EGB.dtype != torch.float32):
            raise ValueError(f"out must be (float8_e4m3fn {(experts, k, n)}, float32 {(experts, tiles_k, tiles_n)}); "
                             f"got ({None if q_EKN is None else q_EKN.dtype} "
                             f"{None if q_EKN is None else tuple(q_EKN.shape)}, {s_EGB.dtype} {tuple(s_EGB.shape)})")
    else:
        q_EKN = torch.empty((experts, k, n), dtype=FP8, device=w_EKN.device) if natural else None
        s_EGB = torch.empty((experts, tiles_k, tiles_n), dtype=torch.float32, device=w_EKN.device)
    if experts * k * n == 0:
        return q_EKN, s_EGB
    qt = transposed_out if transposed_out is not None else q_EKN.transpose(1, 2)  # unread without TRANSPOSED
    q = q_EKN if natural else qt.transpose(1, 2)  # unread without NATURAL
    blocks = experts * tiles_k * tiles_n
    _quantize_blocks_kernel[(min(blocks, counted_programs(w_EKN.device, blocks, SCALE_BLOCK // BLOCK_ROWS)),)](
        w_EKN, q, qt, s_EGB, _stats_ptr(stats, s_EGB), k, n, tiles_k, tiles_n, blocks, *w_EKN.stride(),
        *q.stride(), *qt.stride(), *s_EGB.stride(), ROWS=BLOCK_ROWS, STATS=stats is not None,
        TRANSPOSED=transposed_out is not None, NATURAL=natural, num_warps=BLOCKS_WARPS)
    return q_EKN, s_EGB


def transpose_blocks(q_EKN: torch.Tensor, s_EGB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_ENK, s_EBG): the block-quantised transpose, for the data gradient dy @ W^T. A 128 x 128
    block's scale is its transpose's, so nothing is requantised; the copy is contiguous because
    Hopper's FP8 MMA reads its B operand K-major (made once per optimizer step, beside q_EKN)."""
    return q_EKN.transpose(1, 2).contiguous(), s_EGB.transpose(1, 2).contiguous()


# --- the ragged grouped GEMM on FP8 operands

# How a K loop promotes each scale group's dot (a fresh fp32 chain on the tensor cores) into the
# fp32 sum (the scaled add, on the CUDA cores): `TileConfig.promote`, passed as its index here.
# On sm_90 Triton waits for a wgmma at once (`warp_group_dot_wait {pendings = 0}`) when its result
# is used in the same iteration; a dot whose result only goes to the next iteration is waited for
# by the next synchronous dot's wait and runs on meanwhile (Triton's WGMMAPipeline, rule 3b).
#   inline:    dot, wait, the scales loaded, the scaled add: the tensor cores idle through the add
#              and the scale loads' latency (the first form; the default until measured otherwise).
#   hoisted:   the scales loaded before the dot (their latency under the wgmma), one weight-block
#              scale per tile when the column tile lies in one block; the add still waits.
#   pipelined: each slice's dot in two K halves, the first waited for (the second reads it), the
#              second chained on it and carried: the previous slice's add runs under its wgmma.
#   pingpong:  two independent dots per slice, the first waited for and added at once, the second
#              carried and added under the next slice's second wgmma: the column tile's halves (the
#              SwiGLU GEMM: its gate and up dots), each half stored on its own.
# The sums and their order are the same in all four: bit-identical in the interpreter, but for
# "pipelined", whose two half-depth products the interpreter adds in fp32 (on a GPU, with
# imprecise_k >= block_k, the halves are the same wgmma chain as one dot).
PROMOTE_VARIANTS = ("inline", "hoisted", "pipelined", "pingpong")
_INLINE, _HOISTED, _PIPELINED, _PINGPONG = (tl.constexpr(i) for i in range(4))  # the kernels' PROMOTE


def promote_index(config: TileConfig) -> int:
    """The kernels' PROMOTE for config.promote (ValueError naming the choices)."""
    if config.promote not in PROMOTE_VARIANTS:
        raise ValueError(f"unknown FP8 promotion {config.promote!r}; choose one of {', '.join(PROMOTE_VARIANTS)}")
    return PROMOTE_VARIANTS.index(config.promote)


@triton.jit
def _promote(acc, part, sa, sb, SB_SCALAR: tl.constexpr):
    """acc + part x sa[row] x sb[column]: one scale group's dot added into the fp32 sum (SB_SCALAR:
    one sb for the whole column tile; the same products, one per row)."""
    if SB_SCALAR:
        return acc + part * (sa * sb)[:, None]
    else:
        return acc + part * (sa[:, None] * sb[None, :])


@triton.jit
def _block_scales(sb_ptrs, j, stride_sbk, col_ok, SB_SCALAR: tl.constexpr):
    """Scale group j's weight-block scales: the tile's one (SB_SCALAR: sb_ptrs points at its block)
    or one per column."""
    if SB_SCALAR:
        return tl.load(sb_ptrs + j * stride_sbk)
    else:
        return tl.load(sb_ptrs + j * stride_sbk, mask=col_ok, other=0.0)


@triton.jit
def _rows_k_loop(a_ptr, b_ptr, sa_ptrs, sb_ptrs, sb_up_ptrs, rows64, row_ok, cols, col_ok, weight, K, F_UP,
                 stride_am, stride_ak, stride_sag, stride_be, stride_bk, stride_bc, stride_sbk,
                 TWO_B: tl.constexpr, PROMOTE: tl.constexpr, SB_SCALAR: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IMPRECISE_K: tl.constexpr):
    """(acc, acc_up) fp32 [BLOCK_M, BLOCK_N], one tile's sums over K (acc_up: of the up columns
    F_UP + cols when TWO_B, else acc again), promoted as PROMOTE says (pingpong: TWO_B's gate and up
    dots; one B operand's column halves are `_rows_k_loop_halves`)."""
    tl.static_assert(TWO_B or PROMOTE != _PINGPONG)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    DEPTH: tl.constexpr = BLOCK_K // 2 if PROMOTE == _PIPELINED else BLOCK_K  # K of one dot
    ks = tl.arange(0, DEPTH)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak
    b_ptrs = b_ptr + weight * stride_be + ks[:, None] * stride_bk + cols[None, :] * stride_bc
    if PROMOTE == _INLINE:
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            # a fresh chain per slice; the scaled add below is the promotion to fp32 (CUDA cores)
            part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
            j = k0 // _SCALE_BLOCK
            sa = tl.load(sa_ptrs + j * stride_sag, mask=row_ok, other=0.0)
            sb = tl.load(sb_ptrs + j * stride_sbk, mask=col_ok, other=0.0)
            acc += part * (sa[:, None] * sb[None, :])
            if TWO_B:
                b_up = tl.load(b_ptrs + F_UP * stride_bc, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                part_up = tl.dot(a, b_up, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                sb_up = tl.load(sb_up_ptrs + j * stride_sbk, mask=col_ok, other=0.0)
                acc_up += part_up * (sa[:, None] * sb_up[None, :])
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    elif PROMOTE == _HOISTED:
        for k0 in range(0, K, BLOCK_K):
            j = k0 // _SCALE_BLOCK
            sa = tl.load(sa_ptrs + j * stride_sag, mask=row_ok, other=0.0)  # latency under the dot
            sb = _block_scales(sb_ptrs, j, stride_sbk, col_ok, SB_SCALAR)
            k_ok = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if TWO_B:
                sb_up = _block_scales(sb_up_ptrs, j, stride_sbk, col_ok, SB_SCALAR)
                b_up = tl.load(b_ptrs + F_UP * stride_bc, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
            acc = _promote(acc, part, sa, sb, SB_SCALAR)
            if TWO_B:
                part_up = tl.dot(a, b_up, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                acc_up = _promote(acc_up, part_up, sa, sb_up, SB_SCALAR)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    else:
        # carried to the next iteration: the slice's last dot (pipelined: its second half; pingpong:
        # its up dot) and the slice's scales; zeros before the first, whose add is exact
        prev = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        prev_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        sa_prev = tl.zeros((BLOCK_M,), dtype=tl.float32)
        sb_prev = tl.zeros_like(_block_scales(sb_ptrs, 0, stride_sbk, col_ok, SB_SCALAR))
        sb_up_prev = sb_prev
        for k0 in range(0, K, BLOCK_K):
            j = k0 // _SCALE_BLOCK
            sa = tl.load(sa_ptrs + j * stride_sag, mask=row_ok, other=0.0)
            sb = _block_scales(sb_ptrs, j, stride_sbk, col_ok, SB_SCALAR)
            k_ok = (k0 + ks) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if TWO_B:
                sb_up = _block_scales(sb_up_ptrs, j, stride_sbk, col_ok, SB_SCALAR)
                b_up = tl.load(b_ptrs + F_UP * stride_bc, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            if PROMOTE == _PIPELINED:
                k_ok = (k0 + DEPTH + ks) < K
                a2 = tl.load(a_ptrs + DEPTH * stride_ak, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b2 = tl.load(b_ptrs + DEPTH * stride_bk, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                # the first halves are waited for at once (the second halves read them): that wait
                # also completes the previous slice's carried dots
                first = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                if TWO_B:
                    b2_up = tl.load(b_ptrs + DEPTH * stride_bk + F_UP * stride_bc,
                                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                    first_up = tl.dot(a, b_up, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                    part_up = tl.dot(a2, b2_up, first_up, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                part = tl.dot(a2, b2, first, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                acc = _promote(acc, prev, sa_prev, sb_prev, SB_SCALAR)  # under the second halves' wgmma
                prev = part
                if TWO_B:
                    acc_up = _promote(acc_up, prev_up, sa_prev, sb_up_prev, SB_SCALAR)
                    prev_up = part_up
            else:  # pingpong: the gate dot waited for, the up dot carried
                part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                part_up = tl.dot(a, b_up, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                acc = _promote(acc, part, sa, sb, SB_SCALAR)  # both adds under the up dot's wgmma
                acc_up = _promote(acc_up, prev_up, sa_prev, sb_up_prev, SB_SCALAR)
                prev_up = part_up
            sa_prev = sa
            sb_prev = sb
            if TWO_B:
                sb_up_prev = sb_up
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if PROMOTE == _PIPELINED:
            acc = _promote(acc, prev, sa_prev, sb_prev, SB_SCALAR)
        if TWO_B:
            acc_up = _promote(acc_up, prev_up, sa_prev, sb_up_prev, SB_SCALAR)
    if not TWO_B:
        acc_up = acc
    return acc, acc_up


@triton.jit
def _rows_k_loop_halves(a_ptr, b_ptr, sa_ptrs, sb_lo_ptrs, sb_hi_ptrs, rows64, row_ok, lo, hi, lo_ok, hi_ok, weight,
                        K, stride_am, stride_ak, stride_sag, stride_be, stride_bk, stride_bc, stride_sbk,
                        SB_SCALAR: tl.constexpr, BLOCK_M: tl.constexpr, HALF_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, IMPRECISE_K: tl.constexpr):
    """pingpong over one B operand: (acc_lo, acc_hi) fp32 [BLOCK_M, HALF_N], the sums over K of the
    column tile's halves lo and hi. The low half's dot is waited for (which completes the previous
    slice's high half too) and added; the high half's is carried, added while the next slice's
    high-half wgmma runs."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows64[:, None] * stride_am + ks[None, :] * stride_ak
    lo_ptrs = b_ptr + weight * stride_be + ks[:, None] * stride_bk + lo[None, :] * stride_bc
    hi_ptrs = b_ptr + weight * stride_be + ks[:, None] * stride_bk + hi[None, :] * stride_bc
    acc_lo = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
    prev = tl.zeros((BLOCK_M, HALF_N), dtype=tl.float32)
    sa_prev = tl.zeros((BLOCK_M,), dtype=tl.float32)
    sb_prev = tl.zeros_like(_block_scales(sb_hi_ptrs, 0, stride_sbk, hi_ok, SB_SCALAR))
    for k0 in range(0, K, BLOCK_K):
        j = k0 // _SCALE_BLOCK
        sa = tl.load(sa_ptrs + j * stride_sag, mask=row_ok, other=0.0)
        sb_lo = _block_scales(sb_lo_ptrs, j, stride_sbk, lo_ok, SB_SCALAR)
        sb_hi = _block_scales(sb_hi_ptrs, j, stride_sbk, hi_ok, SB_SCALAR)
        k_ok = (k0 + ks) < K
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b_lo = tl.load(lo_ptrs, mask=k_ok[:, None] & lo_ok[None, :], other=0.0)
        b_hi = tl.load(hi_ptrs, mask=k_ok[:, None] & hi_ok[None, :], other=0.0)
        part_lo = tl.dot(a, b_lo, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
        part_hi = tl.dot(a, b_hi, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
        acc_lo = _promote(acc_lo, part_lo, sa, sb_lo, SB_SCALAR)  # both adds under the high half's wgmma
        acc_hi = _promote(acc_hi, prev, sa_prev, sb_prev, SB_SCALAR)
        prev = part_hi
        sa_prev = sa
        sb_prev = sb_hi
        a_ptrs += BLOCK_K * stride_ak
        lo_ptrs += BLOCK_K * stride_bk
        hi_ptrs += BLOCK_K * stride_bk
    return acc_lo, _promote(acc_hi, prev, sa_prev, sb_prev, SB_SCALAR)


@triton.jit
def _swiglu_grad_epilogue(acc, rows64, row_ok, c0, C, out_ptr, h13_ptr, act_ptr, stride_om, stride_oc,
                          stride_hm, stride_hc, stride_xm, stride_xc, SAVE_ACT: tl.constexpr, WIDTH: tl.constexpr,
                          CHUNK: tl.constexpr):
    """The SwiGLU gradient of accumulator columns [c0, c0 + WIDTH), CHUNK columns at a time (as
    `grouped_gemm._swiglu_grad_epilogue`): the accumulator's halves split off in registers (a
    reshape to [M, 2, W/2] and a split: no data moves) take a linear layout in which Triton keeps
    the chunk's arithmetic, converting only the bf16 loads and stores (on the wgmma layout, the
    whole tile at once, ptxas ran to 255 registers at 64 x 128 / 8 warps). The gate and up
    pre-activations are loaded per chunk, after the loop (held across it they spilled at 64 x 128,
    where the FP8 loop holds its partial dot too). The same arithmetic per element whatever CHUNK."""
    if WIDTH == CHUNK:
        cols = c0 + tl.arange(0, WIDTH)
        ok = row_ok[:, None] & (cols < C)[None, :]
        h_ptrs = h13_ptr + rows64[:, None] * stride_hm + cols[None, :] * stride_hc
        gate = tl.load(h_ptrs, mask=ok, other=0.0).to(tl.float32)
        up = tl.load(h_ptrs + C * stride_hc, mask=ok, other=0.0).to(tl.float32)
        sig = tl.sigmoid(gate)
        out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_oc
        tl.store(out_ptrs, (acc * up * sig * (1.0 + gate * (1.0 - sig))).to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(out_ptrs + C * stride_oc, (acc * gate * sig).to(out_ptr.dtype.element_ty), mask=ok)
        if SAVE_ACT:
            act_ptrs = act_ptr + rows64[:, None] * stride_xm + cols[None, :] * stride_xc
            tl.store(act_ptrs, (gate * sig * up).to(act_ptr.dtype.element_ty), mask=ok)
    else:
        lo, hi = tl.split(tl.permute(tl.reshape(acc, (acc.shape[0], 2, WIDTH // 2)), (0, 2, 1)))
        _swiglu_grad_epilogue(lo, rows64, row_ok, c0, C, out_ptr, h13_ptr, act_ptr, stride_om, stride_oc,
                              stride_hm, stride_hc, stride_xm, stride_xc, SAVE_ACT, WIDTH // 2, CHUNK)
        _swiglu_grad_epilogue(hi, rows64, row_ok, c0 + WIDTH // 2, C, out_ptr, h13_ptr, act_ptr, stride_om,
                              stride_oc, stride_hm, stride_hc, stride_xm, stride_xc, SAVE_ACT, WIDTH // 2, CHUNK)


@triton.jit
def _rows_epilogue(acc, acc_up, rows64, row_ok, cols, c0, ok, pid_n, C, out_ptr, s_out_ptr, h13_ptr, act_ptr,
                   stats_ptr, stride_om, stride_oc, stride_som, stride_sog, stride_hm, stride_hc, stride_xm,
                   stride_xc, EPILOGUE: tl.constexpr, SAVE_H13: tl.constexpr, SAVE_ACT: tl.constexpr,
                   STATS: tl.constexpr, EPI_CHUNK: tl.constexpr):
    """Stores one tile's rows from its fp32 sums as EPILOGUE says (`_fp8_rows_gemm_kernel`; ok:
    the tile's elements to store, row_ok x the columns' cols = c0 + arange; EPI_CHUNK: the SwiGLU
    gradient's columns per step, `_swiglu_grad_epilogue`)."""
    out_ptrs = out_ptr + rows64[:, None] * stride_om + cols[None, :] * stride_oc
    if EPILOGUE == 1:
        if SAVE_H13:
            h_ptrs = h13_ptr + rows64[:, None] * stride_hm + cols[None, :] * stride_hc
            tl.store(h_ptrs, acc.to(h13_ptr.dtype.element_ty), mask=ok)
            tl.store(h_ptrs + C * stride_hc, acc_up.to(h13_ptr.dtype.element_ty), mask=ok)
        # the down GEMM's A operand, quantised here: no bf16 round trip through HBM
        act = tl.where(ok, acc * tl.sigmoid(acc) * acc_up, 0.0)
        _, scale, scaled, q = _quantized_rows(act)
        if STATS:
            _record_stats(stats_ptr, act, scaled, q, ok)
        tl.store(out_ptrs, q.to(out_ptr.dtype.element_ty), mask=ok)
        tl.store(s_out_ptr + rows64 * stride_som + pid_n * stride_sog, scale, mask=row_ok)
    elif EPILOGUE == 2:
        _swiglu_grad_epilogue(acc, rows64, row_ok, c0, C, out_ptr, h13_ptr, act_ptr, stride_om, stride_oc,
                              stride_hm, stride_hc, stride_xm, stride_xc, SAVE_ACT, acc.shape[1], EPI_CHUNK)
    else:
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fp8_rows_gemm_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, offsets_ptr, s_out_ptr, h13_ptr, act_ptr, stats_ptr,
    E, E_W, K, C, F_UP, num_programs,
    stride_am, stride_ak, stride_sam, stride_sag,
    stride_be, stride_bk, stride_bc, stride_sbe, stride_sbk, stride_sbc,
    stride_om, stride_oc, stride_som, stride_sog, stride_hm, stride_hc, stride_xm, stride_xc,
    EPILOGUE: tl.constexpr, SAVE_H13: tl.constexpr, SAVE_ACT: tl.constexpr, STATS: tl.constexpr,
    E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, IMPRECISE_K: tl.constexpr, PROMOTE: tl.constexpr, SB_SCALAR: tl.constexpr,
    EPI_CHUNK: tl.constexpr,
):
    # Contract: a [M, K] fp8 rows grouped by expert with sa [M, G] fp32 (1 x 128 groups); b [E_W, K, *]
    # fp8 any strides with sb [E_W, G, *] fp32 (128 x 128 blocks); h[rows_g, cols] =
    # sum over BLOCK_K-deep slices of K (BLOCK_K divides 128; j the slice's scale group) of
    # (a[rows_g, slice] @ b[g mod E_W, slice, cols]) * sa[rows_g, j] * sb[j, cols // 128], each dot
    # from zero, added in slice order (PROMOTE: how, `PROMOTE_VARIANTS`; SB_SCALAR: each column tile,
    # and F_UP + it, lies in one weight block). EPILOGUE 0 (plain): out [M, C] = h. 1 (SwiGLU and
    # quantise, BLOCK_N == 128): gate
    # columns [0, C) and up columns [F_UP, F_UP + C) of b, out [M, C] fp8 = e4m3(silu(gate) * up / s)
    # with s_out [M, cdiv(C, 128)] the 1 x 128 row scales (one column tile = one group; STATS: its
    # counters into stats_ptr's row, `_record_stats`); SAVE_H13:
    # h13 [M, 2C] gets gate | up. 2 (SwiGLU gradient): h = d act, h13 [M, 2C] read, out [M, 2C] =
    # d gate | d up; SAVE_ACT: act [M, C] gets silu(gate) * up recomputed from h13; EPI_CHUNK of its
    # columns at a time (`_swiglu_grad_epilogue`).
    # Work items (group, row tile, column tile), as grouped_gemm's `_ragged_rows_gemm_kernel`.
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(C, BLOCK_N)
    idx, item_ends = gg._item_table(offsets_ptr, E, tiles_n, BLOCK_M, E_POW2)
    total = tl.max(item_ends, axis=0)
    for item in tl.range(pid, total, num_programs):
        group = tl.sum((item_ends <= item).to(tl.int32), axis=0)
        item_start = tl.max(tl.where(item_ends <= item, item_ends, 0), axis=0)
        row_start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
        row_end = tl.load(offsets_ptr + group)
        pid_m, pid_n = gg._swizzle(item - item_start, tl.cdiv(row_end - row_start, BLOCK_M), tiles_n,
                                   GROUP_M)
        rows = row_start + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < row_end
        rows64 = rows.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < C
        weight = (group % E_W).to(tl.int64)
        sb_row = sb_ptr + weight * stride_sbe
        if SB_SCALAR:
            sb_ptrs = sb_row + (pid_n * BLOCK_N // _SCALE_BLOCK) * stride_sbc
            sb_up_ptrs = sb_row + ((F_UP + pid_n * BLOCK_N) // _SCALE_BLOCK) * stride_sbc
        else:
            sb_ptrs = sb_row + (cols // _SCALE_BLOCK) * stride_sbc
            sb_up_ptrs = sb_row + ((F_UP + cols) // _SCALE_BLOCK) * stride_sbc
        if PROMOTE == _PINGPONG and EPILOGUE != 1:  # the column tile's halves, each stored on its own
            HALF_N: tl.constexpr = BLOCK_N // 2
            lo = pid_n * BLOCK_N + tl.arange(0, HALF_N)
            hi = lo + HALF_N
            if SB_SCALAR:
                sb_lo_ptrs = sb_ptrs
                sb_hi_ptrs = sb_ptrs
            else:
                sb_lo_ptrs = sb_row + (lo // _SCALE_BLOCK) * stride_sbc
                sb_hi_ptrs = sb_row + (hi // _SCALE_BLOCK) * stride_sbc
            acc_lo, acc_hi = _rows_k_loop_halves(
                a_ptr, b_ptr, sa_ptr + rows64 * stride_sam, sb_lo_ptrs, sb_hi_ptrs, rows64, row_ok, lo, hi, lo < C,
                hi < C, weight, K, stride_am, stride_ak, stride_sag, stride_be, stride_bk, stride_bc, stride_sbk,
                SB_SCALAR, BLOCK_M, HALF_N, BLOCK_K, IMPRECISE_K)
            _rows_epilogue(acc_lo, acc_lo, rows64, row_ok, lo, pid_n * BLOCK_N, row_ok[:, None] & (lo < C)[None, :],
                           pid_n, C, out_ptr, s_out_ptr, h13_ptr, act_ptr, stats_ptr, stride_om, stride_oc, stride_som,
                           stride_sog, stride_hm, stride_hc, stride_xm, stride_xc, EPILOGUE, SAVE_H13, SAVE_ACT, STATS,
                           EPI_CHUNK)
            _rows_epilogue(acc_hi, acc_hi, rows64, row_ok, hi, pid_n * BLOCK_N + HALF_N,
                           row_ok[:, None] & (hi < C)[None, :], pid_n, C, out_ptr, s_out_ptr, h13_ptr, act_ptr,
                           stats_ptr, stride_om, stride_oc, stride_som, stride_sog, stride_hm, stride_hc, stride_xm,
                           stride_xc, EPILOGUE, SAVE_H13, SAVE_ACT, STATS, EPI_CHUNK)
        else:
            if PROMOTE == _INLINE:  # the first form's order: its code, unchanged
                ok = row_ok[:, None] & col_ok[None, :]
            acc, acc_up = _rows_k_loop(
                a_ptr, b_ptr, sa_ptr + rows64 * stride_sam, sb_ptrs, sb_up_ptrs, rows64, row_ok, cols, col_ok,
                weight, K, F_UP, stride_am, stride_ak, stride_sag, stride_be, stride_bk, stride_bc, stride_sbk,
                EPILOGUE == 1, PROMOTE, SB_SCALAR, BLOCK_M, BLOCK_N, BLOCK_K, IMPRECISE_K)
            if PROMOTE != _INLINE:  # after the loop: a mask held across it costs the others spills
                ok = row_ok[:, None] & col_ok[None, :]
            _rows_epilogue(acc, acc_up, rows64, row_ok, cols, pid_n * BLOCK_N, ok, pid_n, C, out_ptr, s_out_ptr,
                           h13_ptr, act_ptr, stats_ptr, stride_om, stride_oc, stride_som, stride_sog, stride_hm,
                           stride_hc, stride_xm, stride_xc, EPILOGUE, SAVE_H13, SAVE_ACT, STATS, EPI_CHUNK)


def _imprecise(config: TileConfig, depth: int, imprecise_k: int | None) -> int | None:
    """The dots' max_num_imprecise_acc: imprecise_k (default `depth`, one slice's). "pipelined" splits
    a slice in two dots of depth / 2 chained on the tensor cores; when the slice promotes only at its
    end, they take None (Triton's sm_90 default: no promotion inside a dot), the same wgmma chain."""
    imprecise = imprecise_k or depth
    if config.promote == "pipelined" and imprecise >= depth:
        return None
    return imprecise


def _check_tile(config: TileConfig, epilogue: int = 0) -> None:
    if SCALE_BLOCK % config.block_k:
        raise ValueError(f"FP8 GEMM tiles need block_k dividing {SCALE_BLOCK} (one scale per "
                         f"{SCALE_BLOCK} of K); got block_k={config.block_k}: use 128 (or 64, 32)")
    promote_index(config)
    if config.promote == "pipelined" and config.block_k < 64:
        raise ValueError(f"promote='pipelined' splits each K slice in two dots of at least 32 (the FP8 MMA's "
                         f"depth): use block_k >= 64 (got {config.block_k})")
    if config.promote == "pingpong" and epilogue != _SWIGLU and config.block_n < 32:
        raise ValueError(f"promote='pingpong' splits the column tile in two of at least 16: use block_n >= 32 "
                         f"(got {config.block_n})")


def _check_fp8(**tensors: torch.Tensor) -> None:
    wrong = {name: t.dtype for name, t in tensors.items() if t.dtype != FP8}
    if wrong:
        raise ValueError(f"FP8 operands must be torch.float8_e4m3fn (quantise them with "
                         f"kernels.fp8.quantize_rows / quantize_blocks); got {wrong}")


def fp8_rows_gemm(
    a_MK: torch.Tensor,
    sa_MG: torch.Tensor,
    offsets_E: torch.Tensor,
    b_EKN: torch.Tensor,
    sb_EGB: torch.Tensor,
    config: TileConfig,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    num_programs: int | None = None,
    imprecise_k: int | None = None,
) -> torch.Tensor:
    """out[rows_e] = dequant(a[rows_e]) @ dequant(b[e]) for every expert e, one persistent launch:
    a from `quantize_rows`, b from `quantize_blocks` (or `transpose_blocks`: the data gradient;
    any strides). Accumulates in fp32: each block_k slice of K (128, or a divisor) is its own dot,
    scaled by its row group's and weight block's scales, then added (`fp8_rows_gemm_reference`
    does the same sums per 128: equal to fp32 rounding, to the bit in most elements at 128).
    `offsets_E` may hold a multiple of the experts' count (group g uses b[g mod E], as
    `grouped_gemm.ragged_rows_gemm`). K need not be a multiple of 128 (the last group is short).
    `imprecise_k` (default block_k): Triton's `max_num_imprecise_acc`, how deep the tensor cores'
    reduced-precision accumulator may run before fp32 promotion on sm_90 (its default there
    never promotes); a smaller value promotes inside a slice too, at the cost of wgmma chaining.
    `out` (given: any float dtype, [M, N]) or a new one of `out_dtype`."""
    _check_operands(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, config)
    rows, cols = a_MK.shape[0], b_EKN.shape[2]
    if out is None:
        out = torch.empty((rows, cols), dtype=out_dtype, device=a_MK.device)
    assert out.shape == (rows, cols), (tuple(out.shape), (rows, cols))
    _launch_rows_gemm(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, config, out, cols,
                      num_programs=num_programs, imprecise_k=imprecise_k)
    return out


def _check_operands(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, config, epilogue: int = 0) -> None:
    """ValueError naming the fix for operands of `fp8_rows_gemm` / `fp8_swiglu_gemm` that do not fit."""
    _check_tile(config, epilogue)
    _check_fp8(a=a_MK, b=b_EKN)
    rows, k = a_MK.shape
    experts, k_b, cols = b_EKN.shape
    if k_b != k or sa_MG.shape != (rows, triton.cdiv(k, SCALE_BLOCK)) or sb_EGB.shape != (
            experts, triton.cdiv(k, SCALE_BLOCK), triton.cdiv(cols, SCALE_BLOCK)):
        raise ValueError(f"FP8 GEMM operands do not fit: a {tuple(a_MK.shape)} with scales "
                         f"{tuple(sa_MG.shape)}, b {tuple(b_EKN.shape)} with scales {tuple(sb_EGB.shape)} "
                         f"(want a [M, K], sa [M, cdiv(K, 128)], b [E, K, N], sb [E, cdiv(K, 128), cdiv(N, 128)])")
    if offsets_E.dim() != 1 or offsets_E.dtype != torch.int32 or offsets_E.shape[0] % experts:
        raise ValueError(f"offsets_E must be int32 cumulative rows of a multiple of {experts} groups; "
                         f"got {offsets_E.dtype} {tuple(offsets_E.shape)}")


_PLAIN, _SWIGLU, _SWIGLU_GRAD = 0, 1, 2  # the kernel's EPILOGUE


def _launch_rows_gemm(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, config, out, cols, *, num_programs,
                      imprecise_k, epilogue=_PLAIN, s_out=None, h13=None, act=None, f_up=0, stats=None) -> None:
    if a_MK.shape[0] == 0 or cols == 0:
        return
    groups, experts, k = offsets_E.shape[0], b_EKN.shape[0], a_MK.shape[1]
    s_out_ = s_out if s_out is not None else sa_MG
    h13_ = h13 if h13 is not None else out
    act_ = act if act is not None else out
    programs = num_programs or gg.default_num_programs(a_MK.device) * config.programs_per_sm
    # one weight-block scale per column tile: tiles of at most 128 columns start on block edges
    sb_scalar = config.promote != "inline" and config.block_n <= SCALE_BLOCK and f_up % config.block_n == 0
    # the SwiGLU gradient's columns per step, at most the width one epilogue finishes (pingpong: a half)
    width = config.block_n // 2 if config.promote == "pingpong" else config.block_n
    epi_chunk = min(config.epilogue_chunk, width) if epilogue == _SWIGLU_GRAD else width
    if epi_chunk < 1 or epi_chunk & (epi_chunk - 1):
        raise ValueError(f"TileConfig.epilogue_chunk={config.epilogue_chunk}: give a power of two (columns)")
    _fp8_rows_gemm_kernel[(programs,)](
        a_MK, sa_MG, b_EKN, sb_EGB, out, offsets_E, s_out_, h13_, act_, _stats_ptr(stats, sa_MG),
        groups, experts, k, cols, f_up, programs,
        a_MK.stride(0), a_MK.stride(1), sa_MG.stride(0), sa_MG.stride(1),
        *b_EKN.stride(), *sb_EGB.stride(), out.stride(0), out.stride(1),
        s_out_.stride(0), s_out_.stride(1), h13_.stride(0), h13_.stride(1), act_.stride(0), act_.stride(1),
        EPILOGUE=epilogue, SAVE_H13=epilogue == _SWIGLU and h13 is not None, SAVE_ACT=act is not None,
        STATS=stats is not None,
        E_POW2=triton.next_power_of_2(groups), BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, GROUP_M=config.group_m, IMPRECISE_K=_imprecise(config, config.block_k, imprecise_k),
        PROMOTE=promote_index(config), SB_SCALAR=sb_scalar, EPI_CHUNK=epi_chunk, num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def fp8_swiglu_gemm(
    a_MK: torch.Tensor,
    sa_MG: torch.Tensor,
    offsets_E: torch.Tensor,
    b_EK2F: torch.Tensor,
    sb_EGB: torch.Tensor,
    config: TileConfig,
    *,
    h13_M2F: torch.Tensor | None = None,
    num_programs: int | None = None,
    imprecise_k: int | None = None,
    stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_MF float8_e4m3fn, s_MG fp32): the gate/up GEMM (b = w13's block-quantised copy, gate in
    [..., :F], up in [..., F:]) with SwiGLU and the down GEMM's 1 x 128 quantisation in its
    epilogue, so silu(gate) * up goes out as e4m3 rows and scales, ready for `fp8_rows_gemm`
    against w2's blocks; `h13_M2F` (given, any float dtype) receives the fp32 accumulators'
    gate | up (the backward's pre-activations). config.block_n must be 128: one column tile is
    one scale group of the output. Accumulation as `fp8_rows_gemm`. `stats`: the output
    quantisation's counters, as `quantize_rows`."""
    _check_operands(a_MK, sa_MG, offsets_E, b_EK2F, sb_EGB, config, _SWIGLU)
    if config.block_n != SCALE_BLOCK:
        raise ValueError(f"the FP8 SwiGLU epilogue quantises one {SCALE_BLOCK}-column group per tile: "
                         f"use block_n={SCALE_BLOCK} (got {config.block_n})")
    rows, width = a_MK.shape[0], b_EK2F.shape[2]
    if width % 2:
        raise ValueError(f"b must hold gate and up columns [E, K, 2F]; got width {width}")
    ffn = width // 2
    q_MF = torch.empty((rows, ffn), dtype=FP8, device=a_MK.device)
    s_MG = torch.empty((rows, triton.cdiv(ffn, SCALE_BLOCK)), dtype=torch.float32, device=a_MK.device)
    assert h13_M2F is None or h13_M2F.shape == (rows, width)
    _launch_rows_gemm(a_MK, sa_MG, offsets_E, b_EK2F, sb_EGB, config, q_MF, ffn, num_programs=num_programs,
                      imprecise_k=imprecise_k, epilogue=_SWIGLU, s_out=s_MG, h13=h13_M2F, f_up=ffn, stats=stats)
    return q_MF, s_MG


def fp8_swiglu_grad_gemm(
    dy_MH: torch.Tensor,
    sdy_MG: torch.Tensor,
    offsets_E: torch.Tensor,
    w2t_EHF: torch.Tensor,
    sw2t_EBG: torch.Tensor,
    h13_M2F: torch.Tensor,
    config: TileConfig,
    *,
    act_MF: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    num_programs: int | None = None,
    imprecise_k: int | None = None,
) -> torch.Tensor:
    """dh13_M2F (d gate | d up, `out_dtype`): the down GEMM's data gradient d act = dy @ w2^T (dy
    from `quantize_rows`, w2^T from `transpose_blocks`) with the SwiGLU derivative in its epilogue,
    from the forward's pre-activations `h13_M2F`; `act_MF` (given) receives silu(gate) * up
    recomputed from them (the down weight's gradient needs it; the forward kept only e4m3 rows).
    As `grouped_gemm.ragged_rows_gemm`'s EPILOGUE_SWIGLU_GRAD, on FP8 operands."""
    _check_operands(dy_MH, sdy_MG, offsets_E, w2t_EHF, sw2t_EBG, config, _SWIGLU_GRAD)
    rows, ffn = dy_MH.shape[0], w2t_EHF.shape[2]
    if h13_M2F.shape != (rows, 2 * ffn) or (act_MF is not None and act_MF.shape != (rows, ffn)):
        raise ValueError(f"h13 must be [M, 2F] = {(rows, 2 * ffn)} (and act [M, F]); got h13 "
                         f"{tuple(h13_M2F.shape)}" + (f", act {tuple(act_MF.shape)}" if act_MF is not None else ""))
    dh13_M2F = torch.empty((rows, 2 * ffn), dtype=out_dtype, device=dy_MH.device)
    _launch_rows_gemm(dy_MH, sdy_MG, offsets_E, w2t_EHF, sw2t_EBG, config, dh13_M2F, ffn,
                      num_programs=num_programs, imprecise_k=imprecise_k, epilogue=_SWIGLU_GRAD,
                      h13=h13_M2F, act=act_MF)
    return dh13_M2F


# --- the weight gradient: contracted over tokens, so 128 x 1 scales along tokens, padded groups

@triton.jit
def _token_chunk(offsets_ptr, padded_ptr, E, chunk, E_POW2: tl.constexpr):
    """(rows, in_group, row_end, first_row) of padded rows [128 chunk, 128 chunk + 128): they belong
    to the group g whose padded range holds them (padded_ptr: int32 cumulative padded rows) and are
    x's rows first_row + t, first_row = offsets[g-1] + (128 chunk - padded[g-1]), x's rows while
    below row_end = offsets[g] (the group's padding past it). A chunk past the last group (in_group
    False: g = E) continues from the last group's ends: rows offsets[E-1] + (128 chunk -
    padded[E-1]) + t, so the chunks past padded[E-1] cover x's rows past offsets[E-1]
    (`padded_capacity` leaves room for them); row_end is 0 there. first_row (a scalar) gives a
    counting kernel the chunk's counted rows without a reduction over `rows`."""
    first = chunk * _SCALE_BLOCK
    idx = tl.arange(0, E_POW2)
    padded_ends = tl.load(padded_ptr + idx, mask=idx < E, other=2147483647)
    group = tl.sum((padded_ends <= first).to(tl.int32), axis=0)
    in_group = group < E
    padded_start = tl.load(padded_ptr + group - 1, mask=group > 0, other=0)
    row_start = tl.load(offsets_ptr + group - 1, mask=group > 0, other=0)
    row_end = tl.load(offsets_ptr + group, mask=in_group, other=0)
    first_row = row_start + (first - padded_start)
    return first_row + tl.arange(0, _SCALE_BLOCK), in_group, row_end, first_row


@triton.jit
def _token_groups_tile(x_ptr, offsets_ptr, padded_ptr, src_ptr, tile, chunks, E, K, stride_xm, stride_xk,
                       BLOCK_K: tl.constexpr, E_POW2: tl.constexpr, GATHER: tl.constexpr):
    """`_quantize_token_groups_kernel`'s tile `tile` (chunk tile % chunks, K tile tile // chunks): (x
    fp32 [128, BLOCK_K] (zeros outside ok), ok (x's own rows of the chunk's group, columns below K),
    the chunk, its columns ks, k_ok, how many elements ok holds (int64), each column's largest |x / scale|
    (its amax / scale) and scale, x / scale, its e4m3 values (float8e4nv))."""
    chunk = tile % chunks
    rows, in_group, row_end, first_row = _token_chunk(offsets_ptr, padded_ptr, E, chunk, E_POW2)
    row_ok = in_group & (rows < row_end)
    k0 = (tile // chunks) * BLOCK_K
    ks = k0 + tl.arange(0, BLOCK_K)
    k_ok = ks < K
    ok = row_ok[:, None] & k_ok[None, :]
    x_rows = rows.to(tl.int64)
    if GATHER:
        x_rows = tl.load(src_ptr + x_rows, mask=row_ok, other=0)
    x = tl.load(x_ptr + x_rows[:, None] * stride_xm + ks[None, :] * stride_xk, mask=ok, other=0.0).to(tl.float32)
    col_amax = tl.max(tl.abs(x), axis=0)
    scale = _scale_by_fma(col_amax)
    up, s, y = _reciprocal_of(scale)
    scaled = _quotient(x, up[None, :], s[None, :], y[None, :])
    rows_counted = tl.where(in_group, tl.minimum(tl.maximum(row_end - first_row, 0), _SCALE_BLOCK), 0)
    size = (rows_counted * tl.minimum(K - k0, BLOCK_K)).to(tl.int64)
    return x, ok, chunk, ks, k_ok, size, _quotient(col_amax, up, s, y), scale, scaled, _e4m3(scaled)


@triton.jit
def _quantize_token_groups_kernel(x_ptr, q_ptr, s_ptr, offsets_ptr, padded_ptr, stats_ptr, src_ptr, E, K, chunks,
                                  tiles, stride_xm, stride_xk, stride_qk, stride_qp, stride_sk, stride_sc,
                                  BLOCK_K: tl.constexpr, E_POW2: tl.constexpr, STATS: tl.constexpr,
                                  GATHER: tl.constexpr, STAGES: tl.constexpr):
    # Persistent: program p quantises tiles p, p + P, ... of the (chunk, K tile) tiles, chunk-major
    # within a K tile (neighbouring programs read the same columns of neighbouring chunks, the order
    # in which the one-program-a-tile grid it replaced ran). Tile (c, K tile): padded rows
    # [128 c, 128 c + 128), x's rows as `_token_chunk` maps them, zeros past the group's end (and for
    # chunks past the last group). q [K, P] (token-contiguous) = e4m3 of x^T, s[k, c] = scale of
    # column k over the chunk. GATHER: row r is x's row src_ptr[r] (int64), read where it lies
    # (`kernels.recompute.RowSource`). STAGES > 1: the loop's loads (the chunk's offsets, then its rows)
    # software-pipelined through shared memory, issued STAGES - 1 tiles ahead of the tile being quantised
    # (the launch passes 1: `_TOKEN_GROUPS_STAGES`).
    # STATS, counters of x's own rows (not the padding), as `_quantize_rows_kernel` counts them: each
    # element position keeps its underflows and non-finite inputs packed in an int32 (the launch keeps
    # a program under 2^16 tiles), each column position its largest |x / scale| (from the column's
    # amax), TOTAL the tiles' counted sizes, all summed once a program (the clean-tile count this
    # replaced reduced across the program's warps three times a tile and added five atomics a tile);
    # a program that met a non-finite input or a saturating scale counts its tiles again element by
    # element.
    packed = tl.zeros((_SCALE_BLOCK, BLOCK_K), dtype=tl.int32)  # underflow | nonfinite << 16, by position
    peak = tl.zeros((BLOCK_K,), dtype=tl.float32)  # by column position: the largest |x / scale|
    total = tl.zeros((), dtype=tl.int64)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), num_stages=STAGES):
        x, ok, chunk, ks, k_ok, size, col_peak, scale, scaled, q = _token_groups_tile(
            x_ptr, offsets_ptr, padded_ptr, src_ptr, tile, chunks, E, K, stride_xm, stride_xk, BLOCK_K, E_POW2,
            GATHER)
        if STATS:
            packed += _scaled_counts(x, scaled)
            peak = tl.maximum(peak, col_peak)
            total += size
        padded_rows = (chunk * _SCALE_BLOCK + tl.arange(0, _SCALE_BLOCK)).to(tl.int64)
        # 64-bit column offsets: K x P bytes passes 2^31 at large batches (28,672 x 80k rows, say)
        tl.store(q_ptr + ks.to(tl.int64)[None, :] * stride_qk + padded_rows[:, None] * stride_qp, q,
                 mask=k_ok[None, :])
        tl.store(s_ptr + ks * stride_sk + chunk * stride_sc, scale, mask=k_ok)
    if STATS:
        largest = tl.max(peak, axis=0)
        if _positions_clean(packed, largest):
            _add_position_counts(stats_ptr, packed, largest, total)
        else:
            amax_bits, saturated, underflow, counted, nonfinite = _no_counts()
            for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
                x, ok, _, _, _, _, _, _, scaled, q = _token_groups_tile(
                    x_ptr, offsets_ptr, padded_ptr, src_ptr, tile, chunks, E, K, stride_xm, stride_xk, BLOCK_K,
                    E_POW2, GATHER)
                amax_bits, saturated, underflow, counted, nonfinite = _count_tile(
                    amax_bits, saturated, underflow, counted, nonfinite, x, scaled, q.to(tl.float32), ok)
            _add_counts(stats_ptr, amax_bits, saturated, underflow, counted, nonfinite)


# Issue 21 (session 36; the token-group launch shape since superseded, below): the two token-group quantisers ran
# 5-7x below HBM's rate in a Mixtral FP8 step on an H100 (58.9 and 14.4 ms a step). Changed then from their sm_90a
# builds alone (ptxas, SASS; measured in later sessions, docs/benchmarks.md): persistent programs
# with software-pipelined loads (the fused kernel was one program a tile at one program an SM: its loads never
# overlapped its arithmetic); x / scale by a reciprocal and one FMA correction (`_quotient`), the scale too
# (`_scale_by_fma`), one e4m3 conversion (`_e4m3`), where div_rn took ten instructions and a slow-path branch
# an element. The fused loop issues about 1,360 instructions a thread for a tile (about 1,850 before; 2,288
# with its divisions' slow-path calls), the token-group one about 790 for [128, 32] (about 1,030). Issued at a
# full four a cycle an SM they would take about 1.15x the HBM time of the fused kernel's bytes (Mixtral's
# d h13) and 0.9x the token-group one's (act): expect neither at the copy rate. The transposed copies were
# already stored 16 bytes a thread (Triton converts the tile's layout through shared memory before the
# store) and still are.
# The token-group quantiser on a GPU (`quantize_token_groups`): [128 padded rows, BLOCK_K columns] tiles at
# WARPS, and as many persistent programs an SM as ptxas' registers let stay resident (a program waiting for a
# slot would start its tiles after the others had finished theirs). Uncounted: [128, 64] tiles at 2 warps
# loaded straight into registers (STAGES 1), 255 registers a thread without spills (bf16, sm_90a), 4 programs
# an SM. Until session 41 it pipelined [128, 32] tiles at 4 warps through shared memory (cp.async, STAGES 3,
# 5 programs an SM); Triton then read each tile back twice from an unswizzled buffer, once a column a thread
# (the transposed copy's layout: 8-way bank conflicts, which ncu measured at 6.2-way with L1 the kernel's
# limit). On one H100 the unpipelined [128, 64] tile at 4 warps, 2 programs an SM, measured 1.23-1.60x faster
# on every operand of the all-FP8 backward but Qwen3's act (a tie), and at 2 warps, 4 programs an SM, 1.04-1.27x
# faster again, Qwen3's act again a tie (docs/measurements/token-groups-stages-h100-s41.txt,
# token-groups-unpipelined-h100-s41.txt).
# Counting: [128, 32] tiles at 4 warps, unpipelined (the counters' per-position sums would keep a second copy
# of the quantisation in the loads' layout), 195-208 registers a thread, 2 programs an SM (at [128, 64] it
# would take 255 registers at 4 warps, unmeasured).
_TOKEN_GROUPS_BLOCK_K = 64
_TOKEN_GROUPS_WARPS = 2
_TOKEN_GROUPS_STAGES = 1
_TOKEN_GROUPS_PROGRAMS_PER_SM = 4
_COUNTING_TOKEN_GROUPS_BLOCK_K = 32
_COUNTING_TOKEN_GROUPS_WARPS = 4
_COUNTING_TOKEN_GROUPS_PROGRAMS_PER_SM = 2
# The fused quantiser (`quantize_rows_and_token_groups`): 16 warps a [128, 128] tile, one persistent program
# an SM (104-110 registers a thread without counters, 127-128 with), the loads pipelined STAGES deep where the
# tile is bf16 (4 x 16 KiB a stage; fp32 tiles take twice that) and uncounted (as the token-group quantiser did
# until session 41; unmeasured here since: no step runs this one).
_ROWS_AND_TOKEN_GROUPS_WARPS = 16
_ROWS_AND_TOKEN_GROUPS_STAGES = 3
_HALF = tl.constexpr(64)  # the fused tile is quantised in halves: 64 rows, then 64 columns, at a time


@triton.jit
def _rows_and_token_groups_tile(offsets_ptr, padded_ptr, tile, chunks, rows_valid, E, E_POW2: tl.constexpr):
    """`_quantize_rows_and_token_groups_kernel`'s tile `tile` (chunk tile % chunks, column group tile // chunks):
    (the chunk, the group, x's first row, how many of its rows from it are quantised as rows and along tokens:
    the chunk's rows first_row + t below these counts are x's rows below rows_valid and, in a group, below its
    end (row_ok), and the group's rows (tok_ok; none past the last group))."""
    chunk = tile % chunks
    _, in_group, row_end, first_row = _token_chunk(offsets_ptr, padded_ptr, E, chunk, E_POW2)
    row_bound = tl.where(in_group, tl.minimum(rows_valid, row_end), rows_valid)
    rows_counted = tl.minimum(tl.maximum(row_bound - first_row, 0), _SCALE_BLOCK)
    tok_counted = tl.where(in_group, tl.minimum(tl.maximum(row_end - first_row, 0), _SCALE_BLOCK), 0)
    return chunk, tile // chunks, first_row, rows_counted, tok_counted


@triton.jit
def _quantized_groups(x_ptr, rows64, row_ok, ks, K, stride_xm, stride_xk, AXIS: tl.constexpr):
    """x's rows rows64 where row_ok (zeros elsewhere) at columns ks quantised in 1 x 128 groups along each row
    (AXIS 1) or 128 x 1 groups along the tokens (AXIS 0): (x fp32, the mask, each group's scale, x / scale,
    its e4m3 values)."""
    ok = row_ok[:, None] & (ks < K)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + ks[None, :] * stride_xk, mask=ok, other=0.0).to(tl.float32)
    scale = _scale_by_fma(tl.max(tl.abs(x), axis=AXIS))
    scaled = _divided_by(x, scale, AXIS)
    return x, ok, scale, scaled, _e4m3(scaled)


@triton.jit
def _quantize_rows_and_token_groups_kernel(
    x_ptr, qr_ptr, sr_ptr, qt_ptr, st_ptr, offsets_ptr, padded_ptr, stats_ptr, valid_ptr, M, E, K, chunks, tiles,
    stride_xm, stride_xk, stride_rm, stride_rk, stride_srm, stride_srg, stride_tk, stride_tp, stride_stk, stride_stc,
    E_POW2: tl.constexpr, STATS: tl.constexpr, VALID: tl.constexpr, STAGES: tl.constexpr,
):
    # Persistent: program p takes tiles p, p + P, ... of the (chunk c, column group g) tiles, chunk-major
    # within a column group. Tile (c, g): the token-group tile of `_quantize_token_groups_kernel` at a K
    # tile of exactly one row group (128 columns), both quantisations of it stored:
    #   token groups: qt [K, P] = e4m3 of x^T with st[k, c] the column's scale over the chunk (x's
    #     rows of the chunk's group; zeros for its padding and for chunks past the last group);
    #   rows: qr [M, K] and sr[m, g] of each x row of the chunk (a row group is the tile's row),
    #     as `_quantize_rows_kernel` would, for the rows below valid_ptr[0] (VALID; else below M).
    #     The chunks past the last group hold the rows past offsets[E-1] (`_token_chunk`): rows
    #     only. Padding rows map to no x row and write no row output.
    # Each quantisation loads what it quantises, in halves (the rows 64 at a time, then the token groups 64
    # columns at a time: HBM reads x once, the token groups' loads hit L2), so that no more than half the
    # tile is held in registers at once (the tile held across both quantisations spilled at 16 warps' 128
    # registers a thread once persistent, ptxas sm_90a), and the loads are pipelined STAGES deep: the next
    # two tiles' in flight while this one is quantised (the one-program-a-tile grid this replaced, one
    # program an SM, waited on each tile's loads with nothing else to run).
    # STATS: both quantisations' counters (each counts its own elements, as the two kernels would: x's
    # counted rows twice), as `_quantize_rows_kernel` counts them but by row position of a half (rows:
    # underflows and non-finite inputs packed in an int32, at most 2 x 128 a tile, the launch keeping a
    # program under 256 tiles; the largest |x / scale|) or summed a half tile (token groups), TOTAL from the
    # rows' counts; reduced once a program. A program that met a non-finite input or a saturating scale
    # counts its tiles again element by element (`_count_tile`).
    rows_valid = M
    if VALID:
        rows_valid = tl.minimum(tl.load(valid_ptr), M)
    packed_rows = tl.zeros((_HALF,), dtype=tl.int32)  # underflows | non-finite inputs << 16, by row position
    peak_rows = tl.zeros((_HALF,), dtype=tl.float32)  # the largest |x / scale| by row position
    under_cols = tl.zeros((), dtype=tl.int64)  # the token groups': summed a tile
    flags_cols = tl.zeros((), dtype=tl.int32)
    peak_cols = tl.zeros((), dtype=tl.float32)
    total = tl.zeros((), dtype=tl.int64)
    for tile in tl.range(tl.program_id(0), tiles, tl.num_programs(0), num_stages=STAGES):
        chunk, group, first_row, rows_counted, tok_counted = _rows_and_token_groups_tile(
            offsets_ptr, padded_ptr, tile, chunks, rows_valid, E, E_POW2)
        ks = group * _SCALE_BLOCK + tl.arange(0, _SCALE_BLOCK)
        for half in tl.static_range(2):  # the rows 64 at a time
            t = half * _HALF + tl.arange(0, _HALF)
            rows64 = (first_row + t).to(tl.int64)
            row_ok = t < rows_counted
            x, ok, scale, scaled, q = _quantized_groups(x_ptr, rows64, row_ok, ks, K, stride_xm, stride_xk, 1)
            if STATS:
                packed_rows += tl.sum(_scaled_counts(x, scaled), axis=1)
                peak_rows = tl.maximum(peak_rows, tl.max(tl.abs(scaled), axis=1))  # div_rn(amax, scale)
            tl.store(qr_ptr + rows64[:, None] * stride_rm + ks[None, :] * stride_rk, q, mask=ok)
            tl.store(sr_ptr + rows64 * stride_srm + group * stride_srg, scale, mask=row_ok)
        if STATS:
            total += ((rows_counted + tok_counted) * tl.minimum(K - group * _SCALE_BLOCK, _SCALE_BLOCK)).to(tl.int64)
        rows64 = (first_row + tl.arange(0, _SCALE_BLOCK)).to(tl.int64)
        tok_ok = tl.arange(0, _SCALE_BLOCK) < tok_counted
        padded_rows = (chunk * _SCALE_BLOCK + tl.arange(0, _SCALE_BLOCK)).to(tl.int64)
        for half in tl.static_range(2):
            ks = group * _SCALE_BLOCK + half * _HALF + tl.arange(0, _HALF)
            x, ok, scale, scaled, q = _quantized_groups(x_ptr, rows64, tok_ok, ks, K, stride_xm, stride_xk, 0)
            if STATS:  # (16 bits hold a half tile's counts)
                packed = tl.sum(tl.sum(_scaled_counts(x, scaled), axis=0), axis=0)
                under_cols += (packed & 0xFFFF).to(tl.int64)
                flags_cols |= packed >> 16
                peak_cols = tl.maximum(peak_cols, tl.max(tl.max(tl.abs(scaled), axis=0), axis=0))
            tl.store(qt_ptr + ks.to(tl.int64)[None, :] * stride_tk + padded_rows[:, None] * stride_tp, q,
                     mask=(ks < K)[None, :])  # int64: K x P may pass 2^31 bytes
            tl.store(st_ptr + ks * stride_stk + chunk * stride_stc, scale, mask=ks < K)
    if STATS:
        largest = tl.maximum(tl.max(peak_rows, axis=0), peak_cols)
        clean = (tl.max(packed_rows >> 16, axis=0) == 0) & (flags_cols == 0) & (largest <= _SATURATION_BOUND)
        if clean:
            zero = tl.zeros((), dtype=tl.int64)
            underflow = tl.sum(packed_rows.to(tl.int64), axis=0) + under_cols
            _add_counts(stats_ptr, largest.to(tl.int32, bitcast=True).to(tl.int64), zero, underflow, total, zero)
        else:
            amax_bits, saturated, underflow, counted, nonfinite = _no_counts()
            for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
                _, group, first_row, rows_counted, tok_counted = _rows_and_token_groups_tile(
                    offsets_ptr, padded_ptr, tile, chunks, rows_valid, E, E_POW2)
                for half in tl.static_range(2):
                    t = half * _HALF + tl.arange(0, _HALF)
                    ks = group * _SCALE_BLOCK + tl.arange(0, _SCALE_BLOCK)
                    x, ok, _, scaled, q = _quantized_groups(x_ptr, (first_row + t).to(tl.int64), t < rows_counted, ks,
                                                            K, stride_xm, stride_xk, 1)
                    amax_bits, saturated, underflow, counted, nonfinite = _count_tile(
                        amax_bits, saturated, underflow, counted, nonfinite, x, scaled, q.to(tl.float32), ok)
                    t = tl.arange(0, _SCALE_BLOCK)
                    ks = group * _SCALE_BLOCK + half * _HALF + tl.arange(0, _HALF)
                    x, ok, _, scaled, q = _quantized_groups(x_ptr, (first_row + t).to(tl.int64), t < tok_counted, ks,
                                                            K, stride_xm, stride_xk, 0)
                    amax_bits, saturated, underflow, counted, nonfinite = _count_tile(
                        amax_bits, saturated, underflow, counted, nonfinite, x, scaled, q.to(tl.float32), ok)
            _add_counts(stats_ptr, amax_bits, saturated, underflow, counted, nonfinite)


def padded_offsets(offsets_E: torch.Tensor) -> torch.Tensor:
    """int32 cumulative rows with each group's count rounded up to a multiple of 128, on the
    device (no host sync): where `quantize_token_groups` puts group g's first row."""
    counts = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1))
    return (((counts + SCALE_BLOCK - 1) // SCALE_BLOCK) * SCALE_BLOCK).cumsum(0, dtype=torch.int32)


def padded_capacity(rows: int, groups: int) -> int:
    """Rows the padded layout needs at most (a multiple of 128): each group adds at most 127
    padding rows. Sized from shapes on the host, so the buffer's size never waits on the GPU."""
    return triton.cdiv(rows + (SCALE_BLOCK - 1) * groups, SCALE_BLOCK) * SCALE_BLOCK


def _token_groups_block_k(device: torch.device) -> int:
    """`quantize_token_groups`' BLOCK_K uncounted: the GPU's tile (`_TOKEN_GROUPS_BLOCK_K`); 16 in the interpreter
    (its tests' narrow K spans several tiles)."""
    return _TOKEN_GROUPS_BLOCK_K if device.type == "cuda" else 16


def _counting_token_groups_block_k(device: torch.device) -> int:
    """`quantize_token_groups`' BLOCK_K counting: `_COUNTING_TOKEN_GROUPS_BLOCK_K` on the GPU; 16 in the
    interpreter."""
    return _COUNTING_TOKEN_GROUPS_BLOCK_K if device.type == "cuda" else 16


def token_group_scales(k: int, capacity: int, device: torch.device) -> torch.Tensor:
    """A token-group quantiser's scales s_KC [K, C] (C = capacity / 128 chunks) over chunk-major
    storage [C, K] (strides (1, K)): one chunk's K scales are contiguous, so a weight-gradient tile
    reads its chunk's row and column scales as two short vectors (a TMA box each,
    `fp8_gluon.gluon_fp8_weight_grad`), and the quantiser's tile stores its BLOCK_K scales in one
    coalesced piece, not K-strided words."""
    return torch.empty((capacity // SCALE_BLOCK, k), dtype=torch.float32, device=device).t()


def quantize_token_groups(x_MK: torch.Tensor, offsets_E: torch.Tensor, stats: torch.Tensor | None = None,
                          rows_M: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_KP float8_e4m3fn, s_KC fp32, padded_E int32): x's rows transposed into a token-contiguous
    [K, P] copy (the weight gradient's K-major operand), each group's rows starting at a multiple
    of 128 (`padded_offsets`; zero columns pad it), one scale per column and 128 padded rows
    (C = P / 128 chunks, stored chunk-major: `token_group_scales`; no chunk straddles two groups).
    P = `padded_capacity`: columns past the
    last group are zeros too. For `fp8_weight_grad`. `stats` as `quantize_rows` (x's rows only).
    `rows_M` (int64 [M]): row r is x_MK[rows_M[r]] (x then any number of rows), read in place: the
    grouped rows gathered from their tokens inside the quantiser (`expert_input` recomputation,
    `kernels.fp8_ffn`), the same bits as quantising the gathered copy, without writing it."""
    if rows_M is not None and (rows_M.dtype != torch.int64 or rows_M.dim() != 1):
        raise ValueError(f"rows_M must be int64 [M] (each row's source row); got {rows_M.dtype} {tuple(rows_M.shape)}")
    rows, k = (x_MK.shape if rows_M is None else (rows_M.shape[0], x_MK.shape[1]))
    groups = offsets_E.shape[0]
    capacity = padded_capacity(rows, groups)
    padded_E = padded_offsets(offsets_E)
    q_KP = torch.empty((k, capacity), dtype=FP8, device=x_MK.device)
    s_KC = token_group_scales(k, capacity, x_MK.device)
    if k == 0 or capacity == 0:
        return q_KP, s_KC, padded_E
    block_k = (_token_groups_block_k if stats is None else _counting_token_groups_block_k)(x_MK.device)
    chunks = capacity // SCALE_BLOCK
    tiles = chunks * triton.cdiv(k, block_k)
    per_sm = _TOKEN_GROUPS_PROGRAMS_PER_SM if stats is None else _COUNTING_TOKEN_GROUPS_PROGRAMS_PER_SM
    # (and enough programs that none counts more than 2^16 - 1 tiles: the per-position counts are 16 bits)
    programs = max(per_sm * gg.default_num_programs(x_MK.device), triton.cdiv(tiles, 65535))
    _quantize_token_groups_kernel[(min(tiles, programs),)](
        x_MK, q_KP, s_KC, offsets_E, padded_E, _stats_ptr(stats, s_KC), padded_E if rows_M is None else rows_M,
        groups, k, chunks, tiles, x_MK.stride(0), x_MK.stride(1), q_KP.stride(0), q_KP.stride(1), s_KC.stride(0),
        s_KC.stride(1),
        BLOCK_K=block_k, E_POW2=triton.next_power_of_2(groups), STATS=stats is not None, GATHER=rows_M is not None,
        STAGES=_TOKEN_GROUPS_STAGES if stats is None else 1,
        num_warps=_TOKEN_GROUPS_WARPS if stats is None else _COUNTING_TOKEN_GROUPS_WARPS)
    return q_KP, s_KC, padded_E


def quantize_rows_and_token_groups(
    x_MK: torch.Tensor, offsets_E: torch.Tensor, stats: torch.Tensor | None = None,
    valid_rows: torch.Tensor | None = None,
) -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """((q_MK, s_MG), (q_KP, s_KC, padded_E)): `quantize_rows(x_MK, stats, valid_rows)` and
    `quantize_token_groups(x_MK, offsets_E, stats)`, the same bytes, scales and counters, from one
    launch that reads each 128-row x 128-column tile of x once (the two quantisers each read all
    of x: two passes over a bf16 tensor the FP8 backward quantises both ways, dy and d h13).
    Rows past `valid_rows` (or the buffer) are left unwritten and uncounted, as `quantize_rows`
    leaves them; `stats` gets both quantisations' counts (x's rows counted twice, as by the two
    calls). Both results are alive at once: a caller that drops each copy after its last reader
    holds the two together. On an H100 it ran slower than the two quantisers one after the other
    (`bench quantise`, session 37), so the FP8 backward takes those (`kernels.fp8_ffn._quantize_both_ways`);
    `bench quantise` times it beside them."""
    rows, k = x_MK.shape
    if valid_rows is not None and (valid_rows.dtype != torch.int32 or valid_rows.numel() < 1
                                   or valid_rows.device != x_MK.device):
        raise ValueError(f"valid_rows must be an int32 tensor on {x_MK.device} holding the row count; got "
                         f"{valid_rows.dtype} {tuple(valid_rows.shape)} on {valid_rows.device}")
    groups = offsets_E.shape[0]
    if groups < 1:
        raise ValueError("offsets_E must hold at least one group's cumulative row count")
    capacity = padded_capacity(rows, groups)
    padded_E = padded_offsets(offsets_E)
    q_MK, s_MG = empty_quantized_rows(rows, k, x_MK.device)
    q_KP = torch.empty((k, capacity), dtype=FP8, device=x_MK.device)
    s_KC = token_group_scales(k, capacity, x_MK.device)
    if k == 0:
        return (q_MK, s_MG), (q_KP, s_KC, padded_E)
    chunks = capacity // SCALE_BLOCK
    tiles = chunks * triton.cdiv(k, SCALE_BLOCK)
    # (and enough programs that none counts more than 255 tiles: STATS' per-row-position counts are 16 bits)
    programs = max(gg.default_num_programs(x_MK.device), triton.cdiv(tiles, 255))
    _quantize_rows_and_token_groups_kernel[(min(tiles, programs),)](
        x_MK, q_MK, s_MG, q_KP, s_KC, offsets_E, padded_E, _stats_ptr(stats, s_KC),
        valid_rows if valid_rows is not None else padded_E, rows, groups, k, chunks, tiles,
        x_MK.stride(0), x_MK.stride(1), q_MK.stride(0), q_MK.stride(1), s_MG.stride(0), s_MG.stride(1),
        q_KP.stride(0), q_KP.stride(1), s_KC.stride(0), s_KC.stride(1),
        E_POW2=triton.next_power_of_2(groups), STATS=stats is not None, VALID=valid_rows is not None,
        STAGES=_ROWS_AND_TOKEN_GROUPS_STAGES if x_MK.element_size() <= 2 and stats is None else 1,
        num_warps=_ROWS_AND_TOKEN_GROUPS_WARPS)
    return (q_MK, s_MG), (q_KP, s_KC, padded_E)


@triton.jit
def _wgrad_sums(a_ptr, sa_ptr, b_ptr, sb_ptr, padded_ptr, ks, k_ok, cols, col_ok, hi, hi_ok, expert, E, E_W,
                stride_ak, stride_ap, stride_sak, stride_sac, stride_bc, stride_bp, stride_sbc, stride_sbp,
                PROMOTE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, COLS: tl.constexpr,
                IMPRECISE_K: tl.constexpr):
    """(acc, acc_hi) fp32 [BLOCK_K, COLS]: one tile's sums over expert's groups and their tokens for
    the KA rows ks and the C columns cols (acc_hi: of the columns hi for pingpong, cols and hi the
    column tile's halves; else acc again), promoted as PROMOTE says (`PROMOTE_VARIANTS`)."""
    acc = tl.zeros((BLOCK_K, COLS), dtype=tl.float32)
    acc_hi = tl.zeros((BLOCK_K, COLS), dtype=tl.float32)
    STEP: tl.constexpr = BLOCK_M // 2 if PROMOTE == _PIPELINED else BLOCK_M  # tokens of one dot
    toks = tl.arange(0, STEP)
    # carried from one step to the next (pipelined: the step's second half; pingpong: its high
    # column half) with the step's scales; zeros before the first, whose add is exact
    prev = tl.zeros((BLOCK_K, COLS), dtype=tl.float32)
    sa_prev = tl.zeros((BLOCK_K,), dtype=tl.float32)
    sb_prev = tl.zeros((COLS,), dtype=tl.float32)
    for group in range(expert, E, E_W):
        start = tl.load(padded_ptr + group - 1, mask=group > 0, other=0)
        end = tl.load(padded_ptr + group)
        # groups start at multiples of 128 (padded): said so, the loads are 16-byte vectors the
        # pipeline copies asynchronously; unsaid, FP8 tiles go through registers, unpipelined
        start = tl.multiple_of(start, _SCALE_BLOCK)
        for p0 in range(start, end, BLOCK_M):
            p64 = tl.max_contiguous(tl.multiple_of(p0 + toks, STEP), STEP).to(tl.int64)
            if PROMOTE == _INLINE:
                a = tl.load(a_ptr + ks[:, None] * stride_ak + p64[None, :] * stride_ap,
                            mask=k_ok[:, None], other=0.0)
                b = tl.load(b_ptr + p64[:, None] * stride_bp + cols[None, :] * stride_bc,
                            mask=col_ok[None, :], other=0.0)
                part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                c = p0 // _SCALE_BLOCK
                sa = tl.load(sa_ptr + ks * stride_sak + c * stride_sac, mask=k_ok, other=0.0)
                sb = tl.load(sb_ptr + cols * stride_sbc + c * stride_sbp, mask=col_ok, other=0.0)
                acc += part * (sa[:, None] * sb[None, :])
            else:
                c = p0 // _SCALE_BLOCK
                sa = tl.load(sa_ptr + ks * stride_sak + c * stride_sac, mask=k_ok, other=0.0)  # under the dot
                sb = tl.load(sb_ptr + cols * stride_sbc + c * stride_sbp, mask=col_ok, other=0.0)
                a = tl.load(a_ptr + ks[:, None] * stride_ak + p64[None, :] * stride_ap,
                            mask=k_ok[:, None], other=0.0)
                b = tl.load(b_ptr + p64[:, None] * stride_bp + cols[None, :] * stride_bc,
                            mask=col_ok[None, :], other=0.0)
                if PROMOTE == _HOISTED:
                    part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                    acc = _promote(acc, part, sa, sb, False)
                elif PROMOTE == _PIPELINED:
                    a2 = tl.load(a_ptr + ks[:, None] * stride_ak + (p64 + STEP)[None, :] * stride_ap,
                                 mask=k_ok[:, None], other=0.0)
                    b2 = tl.load(b_ptr + (p64 + STEP)[:, None] * stride_bp + cols[None, :] * stride_bc,
                                 mask=col_ok[None, :], other=0.0)
                    # the first half waited for (the second reads it), which completes the last step
                    first = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                    part = tl.dot(a2, b2, first, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                    acc = _promote(acc, prev, sa_prev, sb_prev, False)  # under the second half's wgmma
                    prev = part
                    sa_prev = sa
                    sb_prev = sb
                else:  # pingpong: the low column half waited for and added, the high one carried
                    sb_hi = tl.load(sb_ptr + hi * stride_sbc + c * stride_sbp, mask=hi_ok, other=0.0)
                    b_hi = tl.load(b_ptr + p64[:, None] * stride_bp + hi[None, :] * stride_bc,
                                   mask=hi_ok[None, :], other=0.0)
                    part = tl.dot(a, b, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                    part_hi = tl.dot(a, b_hi, out_dtype=tl.float32, max_num_imprecise_acc=IMPRECISE_K)
                    acc = _promote(acc, part, sa, sb, False)  # both adds under the high half's wgmma
                    acc_hi = _promote(acc_hi, prev, sa_prev, sb_prev, False)
                    prev = part_hi
                    sa_prev = sa
                    sb_prev = sb_hi
    if PROMOTE == _PIPELINED:
        acc = _promote(acc, prev, sa_prev, sb_prev, False)
    if PROMOTE == _PINGPONG:
        acc_hi = _promote(acc_hi, prev, sa_prev, sb_prev, False)
    else:
        acc_hi = acc
    return acc, acc_hi


@triton.jit
def _store_wgrad(acc, out_ptr, expert, ks, k_ok, cols, col_ok, stride_oe, stride_ok, stride_oc,
                 ACCUMULATE: tl.constexpr, ATOMIC: tl.constexpr):
    # ATOMIC (with ACCUMULATE, out fp32): the tile added by relaxed fp32 reductions (REDG), which wait
    # for no read of out: one writer per element, so the same sum but for denormals the GPU flushes
    out_ptrs = out_ptr + expert.to(tl.int64) * stride_oe + ks[:, None] * stride_ok + cols[None, :] * stride_oc
    ok = k_ok[:, None] & col_ok[None, :]
    if ACCUMULATE and ATOMIC:
        tl.atomic_add(out_ptrs, acc, mask=ok, sem="relaxed")
    else:
        if ACCUMULATE:
            acc += tl.load(out_ptrs, mask=ok, other=0.0).to(tl.float32)
        if out_ptr.dtype.element_ty == tl.float32:
            tl.store(out_ptrs, acc, mask=ok)
        else:  # a fresh gradient in its weights' half dtype: rounded to nearest even (as torch casts)
            tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=ok)


@triton.jit
def _fp8_weight_grad_kernel(
    a_ptr, sa_ptr, b_ptr, sb_ptr, out_ptr, padded_ptr,
    E, E_W, KA, C, num_programs,
    stride_ak, stride_ap, stride_sak, stride_sac, stride_bc, stride_bp, stride_sbc, stride_sbp,
    stride_oe, stride_ok, stride_oc,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACCUMULATE: tl.constexpr, ATOMIC: tl.constexpr, IMPRECISE_K: tl.constexpr, PROMOTE: tl.constexpr,
):
    # Contract: a [KA, P], b [C, P] fp8 token-contiguous (`quantize_token_groups`) with scales
    # sa [KA, P/128], sb [C, P/128]; groups g padded to padded[g-1]:padded[g] (multiples of 128);
    # out [E_W, KA, C]: out[e] = sum over groups g = e mod E_W (ascending), over BLOCK_M-token steps
    # (BLOCK_M divides 128; chunk c = step // 128) of (a[:, step] @ b[:, step]^T) * sa[:, c] * sb[:, c]
    # (ACCUMULATE: out += it, an fp32 main gradient; ATOMIC: by fp32 reductions, `_store_wgrad`).
    # BLOCK_K tiles KA, BLOCK_N tiles C. PROMOTE: how each step's dot is added (`PROMOTE_VARIANTS`;
    # pingpong: the column tile's halves).
    pid = tl.program_id(0)
    tiles_k = tl.cdiv(KA, BLOCK_K)
    tiles_n = tl.cdiv(C, BLOCK_N)
    per_expert = tiles_k * tiles_n
    for item in tl.range(pid, E_W * per_expert, num_programs):
        expert = item // per_expert
        pid_k, pid_n = gg._swizzle(item % per_expert, tiles_k, tiles_n, GROUP_M)
        ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < KA
        COLS: tl.constexpr = BLOCK_N // 2 if PROMOTE == _PINGPONG else BLOCK_N
        cols = pid_n * BLOCK_N + tl.arange(0, COLS)
        hi = cols + COLS  # pingpong's high half of the column tile
        acc, acc_hi = _wgrad_sums(a_ptr, sa_ptr, b_ptr, sb_ptr, padded_ptr, ks, k_ok, cols, cols < C, hi, hi < C,
                                  expert, E, E_W, stride_ak, stride_ap, stride_sak, stride_sac, stride_bc, stride_bp,
                                  stride_sbc, stride_sbp, PROMOTE, BLOCK_K, BLOCK_M, COLS, IMPRECISE_K)
        _store_wgrad(acc, out_ptr, expert, ks, k_ok, cols, cols < C, stride_oe, stride_ok, stride_oc, ACCUMULATE,
                     ATOMIC)
        if PROMOTE == _PINGPONG:
            _store_wgrad(acc_hi, out_ptr, expert, ks, k_ok, hi, hi < C, stride_oe, stride_ok, stride_oc, ACCUMULATE,
                         ATOMIC)


def weight_grad_shapes(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                       padded_E: torch.Tensor, weights: int | None) -> tuple[int, int, int, int]:
    """(KA, C, groups, E_W) of a weight gradient's token-group operands ((q_KP, s_KC) pairs and
    `padded_E`, as `quantize_token_groups` writes them), ValueError naming the fix where they do not
    fit each other (`fp8_weight_grad`, `fp8_gluon.gluon_fp8_weight_grad`)."""
    (qa_KP, sa_KC), (qb_CP, sb_CC) = a, b
    ka, capacity = qa_KP.shape
    cols = qb_CP.shape[0]
    if (qb_CP.shape[1] != capacity or capacity % SCALE_BLOCK or sa_KC.shape != (ka, capacity // SCALE_BLOCK)
            or sb_CC.shape != (cols, capacity // SCALE_BLOCK)):
        raise ValueError(f"FP8 weight-gradient operands do not fit: a {tuple(qa_KP.shape)} with scales "
                         f"{tuple(sa_KC.shape)}, b {tuple(qb_CP.shape)} with scales {tuple(sb_CC.shape)} "
                         f"(both from quantize_token_groups of the same rows' offsets)")
    groups = padded_E.shape[0]
    experts = groups if weights is None else weights
    if padded_E.dtype != torch.int32 or experts < 1 or groups % experts:
        raise ValueError(f"padded_E must be int32 cumulative padded rows of a multiple of {experts} "
                         f"groups (quantize_token_groups' third result); got {padded_E.dtype} "
                         f"{tuple(padded_E.shape)}")
    return ka, cols, groups, experts


def fp8_weight_grad(
    a: tuple[torch.Tensor, torch.Tensor],
    b: tuple[torch.Tensor, torch.Tensor],
    padded_E: torch.Tensor,
    config: TileConfig,
    *,
    weights: int | None = None,
    out: torch.Tensor | None = None,
    accumulate: bool = False,
    num_programs: int | None = None,
    imprecise_k: int | None = None,
    second: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """out[e] = dequant(a)[:, rows_e] @ dequant(b)[:, rows_e]^T, [E, KA, C] fp32, or a given `out`'s dtype
    (its fp32 sums rounded once) (zeros for empty experts): the weight gradient x^T dy of rows grouped by
    expert, both operands from
    `quantize_token_groups` of the same offsets ((q_KP, s_KC) pairs; `padded_E` its third
    result). With `accumulate`, out[e] += it (`out` given: an fp32 main gradient).
    `weights` (E_W; default the groups' count): `padded_E` may hold a multiple of E_W groups,
    group g belonging to weight g mod E_W, summed in ascending g (as `grouped_gemm.ragged_weight_grad`).
    config.block_m (the token step) must divide 128; block_k tiles KA, block_n tiles C;
    config.atomic_accumulate: an fp32 `out` accumulated by fp32 reductions (the same sum, bit for bit
    but for denormals, which the GPU's reduction flushes to zero), as the bf16 kernel's tuned tiles do.
    `second` = (a2, b2, padded2_E): a second row set's sums added too (`kernels.wgrad_pairs`), here by a
    second launch into out (`fp8_gluon.gluon_fp8_weight_grad` sums both in one launch)."""
    (qa_KP, sa_KC), (qb_CP, sb_CC) = a, b
    _check_fp8(a=qa_KP, b=qb_CP)
    if SCALE_BLOCK % config.block_m:
        raise ValueError(f"the FP8 weight gradient steps over tokens by block_m, which must divide "
                         f"{SCALE_BLOCK} (one scale per {SCALE_BLOCK} tokens); got block_m={config.block_m}")
    promote_index(config)
    if config.promote == "pipelined" and config.block_m < 64:
        raise ValueError(f"promote='pipelined' splits each token step in two dots of at least 32 tokens (the "
                         f"FP8 MMA's depth): use block_m >= 64 (got {config.block_m})")
    if config.promote == "pingpong" and config.block_n < 32:
        raise ValueError(f"promote='pingpong' splits the column tile in two of at least 16: use block_n >= 32 "
                         f"(got {config.block_n})")
    ka, cols, groups, experts = weight_grad_shapes(a, b, padded_E, weights)
    assert out is not None or not accumulate
    if out is None:
        out = torch.empty((experts, ka, cols), dtype=torch.float32, device=qa_KP.device)
    assert out.shape == (experts, ka, cols), (tuple(out.shape), (experts, ka, cols))
    if out.numel() == 0:
        return out
    programs = num_programs or gg.default_num_programs(qa_KP.device) * config.programs_per_sm
    _fp8_weight_grad_kernel[(programs,)](
        qa_KP, sa_KC, qb_CP, sb_CC, out, padded_E,
        groups, experts, ka, cols, programs,
        qa_KP.stride(0), qa_KP.stride(1), sa_KC.stride(0), sa_KC.stride(1),
        qb_CP.stride(0), qb_CP.stride(1), sb_CC.stride(0), sb_CC.stride(1), *out.stride(),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        GROUP_M=config.group_m, ACCUMULATE=accumulate,
        ATOMIC=accumulate and config.atomic_accumulate and out.dtype == torch.float32,
        IMPRECISE_K=_imprecise(config, config.block_m, imprecise_k),
        PROMOTE=promote_index(config), num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if second is not None:
        a2, b2, padded2_E = second
        fp8_weight_grad(a2, b2, padded2_E, config, weights=weights, out=out, accumulate=True, num_programs=num_programs,
                        imprecise_k=imprecise_k)
    return out


# --- plain-torch references (the same arithmetic, group by group)

def _pad_to(t: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    pad = -t.shape[dim] % multiple
    if pad == 0:
        return t
    shape = list(t.shape)
    shape[dim] = pad
    return torch.cat([t, t.new_zeros(shape)], dim=dim)


def _e4m3_max_like(x: torch.Tensor) -> torch.Tensor:
    """448 as an fp32 tensor on x's device: CUDA torch divides by a host scalar as a multiply by its
    reciprocal (not correctly rounded), by a device tensor exactly, as the kernels' div_rn does."""
    return torch.full((), E4M3_MAX, dtype=torch.float32, device=x.device)


def _quantize_reference(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8 values of x / scale (broadcast), saturated at +-448, rounded to nearest even by torch."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def quantize_rows_reference(x_MK: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch `quantize_rows`."""
    rows, k = x_MK.shape
    x_MGS = _pad_to(x_MK.float(), 1, SCALE_BLOCK).reshape(rows, triton.cdiv(k, SCALE_BLOCK), SCALE_BLOCK)
    s_MG = x_MGS.abs().amax(dim=2).clamp_min(AMAX_FLOOR).div(_e4m3_max_like(x_MGS))
    q_MK = _quantize_reference(x_MGS, s_MG[:, :, None]).reshape(rows, x_MGS.shape[1] * SCALE_BLOCK)[:, :k]
    return q_MK.contiguous(), s_MG


def quantize_blocks_reference(w_EKN: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch `quantize_blocks`."""
    experts, k, n = w_EKN.shape
    padded = _pad_to(_pad_to(w_EKN.float(), 1, SCALE_BLOCK), 2, SCALE_BLOCK)
    w_EGSBS = padded.reshape(experts, triton.cdiv(k, SCALE_BLOCK), SCALE_BLOCK, triton.cdiv(n, SCALE_BLOCK),
                             SCALE_BLOCK)
    s_EGB = w_EGSBS.abs().amax(dim=(2, 4)).clamp_min(AMAX_FLOOR).div(_e4m3_max_like(w_EGSBS))
    q = _quantize_reference(w_EGSBS, s_EGB[:, :, None, :, None]).reshape(padded.shape)
    return q[:, :k, :n].contiguous(), s_EGB


def dequantize_rows(q_MK: torch.Tensor, s_MG: torch.Tensor) -> torch.Tensor:
    """fp32 values of `quantize_rows`'s output."""
    return q_MK.float() * s_MG.repeat_interleave(SCALE_BLOCK, dim=1)[:, : q_MK.shape[1]]


def dequantize_blocks(q_EKN: torch.Tensor, s_EGB: torch.Tensor) -> torch.Tensor:
    """fp32 values of `quantize_blocks`'s output."""
    _, k, n = q_EKN.shape
    s = s_EGB.repeat_interleave(SCALE_BLOCK, dim=1).repeat_interleave(SCALE_BLOCK, dim=2)
    return q_EKN.float() * s[:, :k, :n]


def fp8_rows_gemm_reference(a_MK: torch.Tensor, sa_MG: torch.Tensor, offsets_E: torch.Tensor,
                            b_EKN: torch.Tensor, sb_EGB: torch.Tensor) -> torch.Tensor:
    """Plain torch `fp8_rows_gemm`, fp32 out: per expert, per 128-deep slice j of K, the slice's
    fp32 product of the fp8 values, times sa[:, j] x sb[j, column's block], summed over j in order."""
    experts, k, n = b_EKN.shape
    ends = offsets_E.tolist()
    out = torch.zeros((a_MK.shape[0], n), dtype=torch.float32, device=a_MK.device)
    sb_EGN = sb_EGB.repeat_interleave(SCALE_BLOCK, dim=2)[:, :, :n]
    for group, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        weight = group % experts
        for j in range(triton.cdiv(k, SCALE_BLOCK)):
            ks = slice(j * SCALE_BLOCK, min(k, (j + 1) * SCALE_BLOCK))
            part = a_MK[start:end, ks].float() @ b_EKN[weight, ks].float()
            out[start:end] += part * (sa_MG[start:end, j, None] * sb_EGN[weight, j][None, :])
    return out


def fp8_swiglu_reference(a_MK: torch.Tensor, sa_MG: torch.Tensor, offsets_E: torch.Tensor,
                         b_EK2F: torch.Tensor, sb_EGB: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch `fp8_swiglu_gemm` before its quantisation: (act_MF fp32 = silu(gate) * up,
    h13_M2F fp32) from `fp8_rows_gemm_reference`'s sums over all 2F columns."""
    h13 = fp8_rows_gemm_reference(a_MK, sa_MG, offsets_E, b_EK2F, sb_EGB)
    ffn = b_EK2F.shape[2] // 2
    return torch.nn.functional.silu(h13[:, :ffn]) * h13[:, ffn:], h13


def quantize_tensor_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor scaling (one scale for all of x): the recipe the fine-grained one replaces,
    kept for the tests that show where it fails (outlier rows)."""
    scale = x.float().abs().amax().clamp_min(AMAX_FLOOR).div(_e4m3_max_like(x))
    return _quantize_reference(x.float(), scale), scale


def quantize_token_groups_reference(x_MK: torch.Tensor, offsets_E: torch.Tensor,
                                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Plain torch `quantize_token_groups`: the padded rows built on the host, then 128 x 1 groups."""
    rows, k = x_MK.shape
    capacity = padded_capacity(rows, offsets_E.shape[0])
    padded_E = padded_offsets(offsets_E)
    x_PK = x_MK.new_zeros((capacity, k), dtype=torch.float32)
    ends, padded_ends = offsets_E.tolist(), padded_E.tolist()
    for start, end, padded_start in zip([0, *ends[:-1]], ends, [0, *padded_ends[:-1]]):
        x_PK[padded_start:padded_start + end - start] = x_MK[start:end].float()
    x_CSK = x_PK.reshape(capacity // SCALE_BLOCK, SCALE_BLOCK, k)
    s_CK = x_CSK.abs().amax(dim=1).clamp_min(AMAX_FLOOR).div(_e4m3_max_like(x_CSK))
    q_PK = _quantize_reference(x_CSK, s_CK[:, None, :]).reshape(capacity, k)
    return q_PK.t().contiguous(), s_CK.contiguous().t(), padded_E  # the scales chunk-major, as the kernels write


def fp8_weight_grad_reference(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor],
                              padded_E: torch.Tensor, weights: int | None = None) -> torch.Tensor:
    """Plain torch `fp8_weight_grad`: per group, per 128-row chunk c, the chunk's fp32 product of
    the fp8 values times sa[:, c] x sb[:, c], summed over chunks and groups g = e mod E_W in order."""
    (qa_KP, sa_KC), (qb_CP, sb_CC) = a, b
    groups = padded_E.shape[0]
    experts = groups if weights is None else weights
    out = torch.zeros((experts, qa_KP.shape[0], qb_CP.shape[0]), dtype=torch.float32, device=qa_KP.device)
    ends = padded_E.tolist()
    for group, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        for p0 in range(start, end, SCALE_BLOCK):
            chunk = slice(p0, p0 + SCALE_BLOCK)
            part = qa_KP[:, chunk].float() @ qb_CP[:, chunk].float().t()
            c = p0 // SCALE_BLOCK
            out[group % experts] += part * (sa_KC[:, c, None] * sb_CC[None, :, c])
    return out
