"""The rowwise e4m3 quantiser of the FP8 dense projections (`kernels.fp8_dense`, recipe "rowwise")
as one persistent Triton launch: a program takes blocks of rows in turn, reads each, takes each
row's amax, writes the rows' e4m3 values and fp32 scales and, with a stats row, adds the
`kernels.fp8_stats` counters (per element and row position, summed per program and added once). Bit
for bit `fp8_dense.quantize_rowwise_reference`: scale = amax / 448 (correctly rounded), 1 for a zero row and for a row holding a NaN (torch's amax
propagates the NaN, and NaN > 0 is false); a NaN quantises to NaN (e4m3 0x7F), clamped values
to +-448, the rest rounded to nearest even (`fp8._round_to_e4m3`: Triton 3.6's interpreter casts
fp32 -> fp8 wrongly, so the value is rounded first and the cast is exact). An fp32 row whose amax
is below 448 x 2^-150 (unreachable from bf16) gets scale 0: its x / 0 = inf values saturate at
+-448 and count as saturated, here as in the reference.

Legend: M rows, K the row length (the contraction of the GEMM the rows feed). x is read through
its strides: a transposed view (`w.t()`, `dy.t()`, `x.t()`: rows of x^T are columns of x) is read
column by column in place, never copied. q is row-major [M, K], the scale [M, 1].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagmoe.kernels import fp8
from disagmoe.kernels import grouped_gemm as gg
from disagmoe.kernels.fp8_stats import E4M3_MAX

E4M3 = torch.float8_e4m3fn
# A program's tile (BLOCK_M x BLOCK_K fp32 values, with the rounding's integers): 4096 elements at
# 4 warps, the size of `fp8.quantize_rows`' 32 x 128 tiles. Rows up to ONE_READ_K long are held
# whole (one read of x); longer rows are read twice by their program, the amax then the values,
# the second read mostly from L2. Untuned: the lead measures on the GPU.
TILE = 4096
ONE_READ_K = 4096

_E4M3_MAX = tl.constexpr(E4M3_MAX)
_E4M3_NAN = tl.constexpr(0x7F)  # e4m3fn's NaN (sign bit clear: the sign of a NaN is not kept)


@triton.jit
def _load_chunk(x_ptr, rows64, row_ok, k0, K, stride_xm, stride_xk, BLOCK_K: tl.constexpr):
    """x[rows, k0:k0 + BLOCK_K] as fp32 (zeros past K and past the rows) and its mask."""
    ks = k0 + tl.arange(0, BLOCK_K)
    ok = row_ok[:, None] & (ks < K)[None, :]
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + ks.to(tl.int64)[None, :] * stride_xk, mask=ok, other=0.0)
    return x.to(tl.float32), ks, ok


@triton.jit
def _row_amax(x):
    """(max |x| per row, whether the row holds a NaN): the GPU's max may drop a NaN, so it is looked for."""
    return tl.max(tl.abs(x), axis=1), tl.max((x != x).to(tl.int32), axis=1) > 0


@triton.jit
def _quantize_chunk(x, ks, ok, scale, q_ptr, rows64, stride_qm):
    """Store one chunk's e4m3 bits into q (a uint8 view); (scaled, q) for its counters."""
    scaled, q = _scaled_chunk(x, scale)
    bits = tl.where(scaled == scaled, q.to(tl.float8e4nv).to(tl.uint8, bitcast=True), _E4M3_NAN)
    tl.store(q_ptr + rows64[:, None] * stride_qm + ks[None, :], bits, mask=ok)
    return scaled, q  # q is read where x is finite only


@triton.jit
def _scaled_chunk(x, scale):
    """(x / each row's scale, its e4m3 values as fp32): `_round_to_e4m3` saturates at +-448, as the
    reference's clamp."""
    scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    return scaled, fp8._round_to_e4m3(scaled)


@triton.jit
def _chunked_amax(x_ptr, rows64, row_ok, K, stride_xm, stride_xk, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """(max |x| per row, whether the row holds a NaN) of one row block, read in BLOCK_K chunks."""
    amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
    has_nan = tl.zeros((BLOCK_M,), dtype=tl.int1)
    for k0 in range(0, K, BLOCK_K):
        x, ks, ok = _load_chunk(x_ptr, rows64, row_ok, k0, K, stride_xm, stride_xk, BLOCK_K)
        chunk_amax, chunk_nan = _row_amax(x)
        amax = tl.maximum(amax, chunk_amax)
        has_nan = has_nan | chunk_nan
    return amax, has_nan


@triton.jit
def _rowwise_scale(amax, has_nan):
    """(each row's scale, its largest |x / scale|: div_rn is monotonic) from its amax and NaN flag. An inf
    row: scale inf, its finite values quantise to +-0 and the inf to NaN, as the reference."""
    scale = tl.where((amax > 0.0) & ~has_nan, tl.math.div_rn(amax, _E4M3_MAX), 1.0)
    return scale, tl.math.div_rn(amax, scale)


@triton.jit
def _quantize_rowwise_kernel(x_ptr, q_ptr, s_ptr, stats_ptr, M, K, stride_xm, stride_xk, stride_qm,
                             BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, ONE_READ: tl.constexpr,
                             STATS: tl.constexpr):
    # Persistent: program p quantises row blocks p, p + P, ... ([BLOCK_M rows] of x [M, K], any
    # strides) -> q [M, K] (row-major, uint8 bits of e4m3, row stride stride_qm) and s [M] (fp32).
    # ONE_READ (K <= BLOCK_K): the rows are loaded once and kept; else a loop over BLOCK_K chunks
    # for the amax, then another for the values. STATS as `fp8._quantize_rows_kernel` counts them:
    # per element position of a chunk and per row position, summed once a program (`fp8._count_positions`);
    # a program that met a non-finite input or a saturating scale (an amax whose scale underflowed to 0)
    # counts its chunks again element by element.
    packed = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    peak = tl.zeros((BLOCK_M,), dtype=tl.float32)
    total = tl.zeros((), dtype=tl.int64)
    for block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        rows64 = rows.to(tl.int64)
        if ONE_READ:
            x, ks, ok = _load_chunk(x_ptr, rows64, row_ok, 0, K, stride_xm, stride_xk, BLOCK_K)
            amax, has_nan = _row_amax(x)
        else:
            amax, has_nan = _chunked_amax(x_ptr, rows64, row_ok, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
        scale, row_scaled_max = _rowwise_scale(amax, has_nan)
        tl.store(s_ptr + rows64, scale, mask=row_ok)
        if STATS:
            peak = tl.maximum(peak, row_scaled_max)
            total += (tl.minimum(M - block * BLOCK_M, BLOCK_M) * K).to(tl.int64)
        if ONE_READ:
            scaled, q = _quantize_chunk(x, ks, ok, scale, q_ptr, rows64, stride_qm)
            if STATS:
                packed = fp8._count_positions(packed, x, q)
        else:
            for k0 in range(0, K, BLOCK_K):
                x, ks, ok = _load_chunk(x_ptr, rows64, row_ok, k0, K, stride_xm, stride_xk, BLOCK_K)
                scaled, q = _quantize_chunk(x, ks, ok, scale, q_ptr, rows64, stride_qm)
                if STATS:
                    packed = fp8._count_positions(packed, x, q)
    if STATS:
        largest = tl.max(peak, axis=0)
        if fp8._positions_clean(packed, largest):
            fp8._add_position_counts(stats_ptr, packed, largest, total)
        else:
            amax_bits, saturated, underflow, counted, nonfinite = fp8._no_counts()
            for block in range(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.num_programs(0)):
                rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
                row_ok = rows < M
                rows64 = rows.to(tl.int64)
                amax, has_nan = _chunked_amax(x_ptr, rows64, row_ok, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
                scale, _ = _rowwise_scale(amax, has_nan)
                for k0 in range(0, K, BLOCK_K):
                    x, ks, ok = _load_chunk(x_ptr, rows64, row_ok, k0, K, stride_xm, stride_xk, BLOCK_K)
                    scaled, q = _scaled_chunk(x, scale)
                    amax_bits, saturated, underflow, counted, nonfinite = fp8._count_tile(
                        amax_bits, saturated, underflow, counted, nonfinite, x, scaled, q, ok)
            fp8._add_counts(stats_ptr, amax_bits, saturated, underflow, counted, nonfinite)


@triton.jit
def _split_amax_kernel(x_ptr, amax_ptr, nan_ptr, M, K, stride_xm, stride_xk,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    # Program (row block, K block): the tile's per-row amax and NaN flag, merged into amax_ptr[M]
    # (the non-negative fp32 amax as int32 bits, whose integer order is the float order) and
    # nan_ptr[M] by atomic max: any number of programs per row, so a transposed x's few long rows
    # still spread over the whole GPU.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    x, _, _ = _load_chunk(x_ptr, rows.to(tl.int64), row_ok, tl.program_id(1) * BLOCK_K, K, stride_xm, stride_xk,
                          BLOCK_K)
    amax, has_nan = _row_amax(x)
    tl.atomic_max(amax_ptr + rows, amax.to(tl.int32, bitcast=True), mask=row_ok)
    tl.atomic_max(nan_ptr + rows, has_nan.to(tl.int32), mask=row_ok)


@triton.jit
def _split_tile(x_ptr, amax_ptr, nan_ptr, tile, row_blocks, M, K, stride_xm, stride_xk,
                BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """`_split_quantize_kernel`'s tile `tile` (row block tile % row_blocks, K block tile // row_blocks):
    (its rows (int64), row_ok, the K block, each row's scale and largest |x / scale| (from the merged
    amax and NaN flag, `_rowwise_scale`), x fp32 (zeros outside ok), its columns ks, ok, how many
    elements ok holds (int64))."""
    block = tile % row_blocks
    kb = tile // row_blocks
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    rows64 = rows.to(tl.int64)
    amax = tl.load(amax_ptr + rows, mask=row_ok, other=0).to(tl.float32, bitcast=True)
    has_nan = tl.load(nan_ptr + rows, mask=row_ok, other=0) > 0
    scale, row_scaled_max = _rowwise_scale(amax, has_nan)
    x, ks, ok = _load_chunk(x_ptr, rows64, row_ok, kb * BLOCK_K, K, stride_xm, stride_xk, BLOCK_K)
    size = (tl.minimum(M - block * BLOCK_M, BLOCK_M) * tl.minimum(K - kb * BLOCK_K, BLOCK_K)).to(tl.int64)
    return rows64, row_ok, kb, scale, row_scaled_max, x, ks, ok, size


@triton.jit
def _split_quantize_kernel(x_ptr, q_ptr, s_ptr, amax_ptr, nan_ptr, stats_ptr, M, K, row_blocks, tiles,
                           stride_xm, stride_xk, stride_qm, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                           STATS: tl.constexpr):
    # Persistent: program p quantises tiles p, p + P, ... of the (row block, K block) tiles, row-block-major
    # within a K block (the order in which the one-program-a-tile grid it replaced ran), each with its
    # rows' scales (from the merged amax and NaN flag, as `_quantize_rowwise_kernel` makes them); the
    # tiles of the first K block store the scales. STATS as `_quantize_rowwise_kernel` counts them (the
    # counters reduced across the program's warps and added by five atomics a tile before): per element
    # position and row position, summed once a program; a row's largest |x / scale| comes from its whole
    # row's amax, which some program's tile holds, so the atomic max over programs is the elements'.
    # A program that met a non-finite input or a saturating scale counts its tiles again element by
    # element.
    packed = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.int32)
    peak = tl.zeros((BLOCK_M,), dtype=tl.float32)
    total = tl.zeros((), dtype=tl.int64)
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        rows64, row_ok, kb, scale, row_scaled_max, x, ks, ok, size = _split_tile(
            x_ptr, amax_ptr, nan_ptr, tile, row_blocks, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
        if kb == 0:
            tl.store(s_ptr + rows64, scale, mask=row_ok)
        scaled, q = _quantize_chunk(x, ks, ok, scale, q_ptr, rows64, stride_qm)
        if STATS:
            packed = fp8._count_positions(packed, x, q)
            peak = tl.maximum(peak, row_scaled_max)
            total += size
    if STATS:
        largest = tl.max(peak, axis=0)
        if fp8._positions_clean(packed, largest):
            fp8._add_position_counts(stats_ptr, packed, largest, total)
        else:
            amax_bits, saturated, underflow, counted, nonfinite = fp8._no_counts()
            for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
                rows64, row_ok, kb, scale, _, x, ks, ok, _ = _split_tile(
                    x_ptr, amax_ptr, nan_ptr, tile, row_blocks, M, K, stride_xm, stride_xk, BLOCK_M, BLOCK_K)
                scaled, q = _scaled_chunk(x, scale)
                amax_bits, saturated, underflow, counted, nonfinite = fp8._count_tile(
                    amax_bits, saturated, underflow, counted, nonfinite, x, scaled, q, ok)
            fp8._add_counts(stats_ptr, amax_bits, saturated, underflow, counted, nonfinite)


def tiles_for(x_MK: torch.Tensor) -> tuple[int, int]:
    """(block_m, block_k) of a launch on x: `gpu_tiles`, or small ones on the CPU (the interpreter),
    so that small tests cover the chunked loop."""
    return (8, 32) if x_MK.device.type == "cpu" else gpu_tiles(x_MK)


def gpu_tiles(x_MK: torch.Tensor) -> tuple[int, int]:
    """Rows held whole where they fit the tile (one read), else chunks along K. A column-major x
    (a transposed view: few rows, long ones) reads 64, 32 or 16 consecutive rows of each column
    (128, 64 or 32 bytes of bf16), the most that still leaves two programs per SM."""
    rows, k = x_MK.shape
    if x_MK.stride(1) != 1 and x_MK.stride(0) == 1:
        programs = 2 * gg.default_num_programs(x_MK.device)
        block_m = next((b for b in (64, 32) if triton.cdiv(rows, b) >= programs), 16)
        return block_m, TILE // block_m
    if k <= ONE_READ_K:
        block_k = triton.next_power_of_2(k)
        return max(1, TILE // block_k), block_k
    return 2, TILE // 2


def quantize_rowwise(x_MK: torch.Tensor, stats_row: torch.Tensor | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None, *, block_m: int | None = None,
                     block_k: int | None = None, num_warps: int = 4, split_k: bool = False,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_MK e4m3, scale_M1 fp32) of `fp8_dense.quantize_rowwise_reference`, bit for bit (NaNs as
    0x7F). x bf16 or fp32, any strides. `stats_row`: an int64 `Fp8Stats` row the launch adds its
    counters into. `out`: (q_MK, scale_M1) to write into (contiguous; the same buffers every call
    for a CUDA graph). block_m / block_k: the tile (default `tiles_for`); num_warps its warps (a
    probe's sweep: the transposed operands' few programs may want more loads in flight).
    `split_k`: two launches over (row block, K block) tiles instead of one program per row block
    (`_split_amax_kernel` merges each row's amax by atomics, then `_split_quantize_kernel`), the
    same bits: for a transposed x, whose few long rows leave most of the GPU idle in one launch
    (4,096 rows of 8,192 tokens: 256 programs). Off until measured against the one launch."""
    rows, k = x_MK.shape
    if out is None:
        out = (torch.empty((rows, k), dtype=E4M3, device=x_MK.device),
               torch.empty((rows, 1), dtype=torch.float32, device=x_MK.device))
    q_MK, scale_M1 = out
    assert q_MK.shape == (rows, k) and q_MK.dtype == E4M3 and q_MK.stride(1) == 1, (q_MK.shape, q_MK.stride())
    assert scale_M1.shape == (rows, 1) and scale_M1.dtype == torch.float32 and scale_M1.is_contiguous()
    if rows == 0 or k == 0:
        return q_MK, scale_M1
    q_bits = q_MK.view(torch.uint8)
    if split_k:
        _quantize_split_k(x_MK, q_bits, scale_M1, stats_row, block_m, block_k, num_warps)
        return q_MK, scale_M1
    default_m, default_k = tiles_for(x_MK)
    block_m, block_k = block_m or default_m, block_k or default_k
    one_read = k <= block_k
    blocks = triton.cdiv(rows, block_m)
    grid = (min(blocks, fp8.counted_programs(x_MK.device, blocks, triton.cdiv(k, block_k))),)
    _quantize_rowwise_kernel[grid](
        x_MK, q_bits, scale_M1, fp8._stats_ptr(stats_row, scale_M1), rows, k, x_MK.stride(0), x_MK.stride(1),
        q_bits.stride(0), BLOCK_M=block_m, BLOCK_K=block_k, ONE_READ=one_read, STATS=stats_row is not None,
        num_warps=num_warps)
    return q_MK, scale_M1


def _quantize_split_k(x_MK: torch.Tensor, q_bits: torch.Tensor, scale_M1: torch.Tensor,
                      stats_row: torch.Tensor | None, block_m: int | None, block_k: int | None,
                      num_warps: int) -> None:
    """`quantize_rowwise(split_k=True)`'s two launches into q_bits (uint8 view of q) and scale_M1.
    Tiles: 64 x 64 by default (16 x 16 on the CPU), coalesced along whichever of x's
    dimensions is contiguous (Triton lays the loads out by the strides)."""
    rows, k = x_MK.shape
    cpu = x_MK.device.type == "cpu"
    block_m, block_k = block_m or (16 if cpu else 64), block_k or (16 if cpu else 64)
    amax_M = torch.zeros(rows, dtype=torch.int32, device=x_MK.device)
    nan_M = torch.zeros(rows, dtype=torch.int32, device=x_MK.device)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(k, block_k))
    _split_amax_kernel[grid](x_MK, amax_M, nan_M, rows, k, x_MK.stride(0), x_MK.stride(1),
                             BLOCK_M=block_m, BLOCK_K=block_k, num_warps=num_warps)
    tiles = grid[0] * grid[1]
    _split_quantize_kernel[(min(tiles, fp8.counted_programs(x_MK.device, tiles, 1)),)](
        x_MK, q_bits, scale_M1, amax_M, nan_M, fp8._stats_ptr(stats_row, scale_M1), rows, k, grid[0], tiles,
        x_MK.stride(0), x_MK.stride(1), q_bits.stride(0), BLOCK_M=block_m, BLOCK_K=block_k,
        STATS=stats_row is not None, num_warps=num_warps)
