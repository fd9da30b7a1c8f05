"""FP8 quantisers and grouped GEMMs (kernels/fp8.py) vs their torch references: interpreter
(CPU, fp8 values exact, fp32 accumulation) and GPU (real e4m3 tensor cores, bf16 out)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig

FP8 = torch.float8_e4m3fn
# Fine-grained FP8's error against the fp32 GEMM of the unquantised operands: for every row of
# the output, |out_row - exact_row| / |exact_row| (2-norms) stays under this. Both operands round
# to 3 mantissa bits (relative error up to 2^-4 each); on Gaussian data the row errors measure
# 0.037 on average and 0.055 at most, with or without rows 2^16 larger than the rest.
FP8_ROW_REL_ERR = 0.08
# The expert FFN (four operands quantised: x, w13, the SwiGLU output, w2) against fp32, per row:
# measured 0.064 on average and 0.106 at most over 9 ragged cases with an outlier row.
FP8_FFN_ROW_REL_ERR = 0.15
# The interpreter's kernel against the reference's same sums (fp32 rounding of equal terms).
SAME_SUMS_REL_ERR = 1e-6

SMALL_TILES = TileConfig(block_m=16, block_n=32, block_k=128, group_m=2, num_warps=4, num_stages=1)

# (rows per expert, K, N): empty experts, an expert taking everything, K and N not multiples of
# 128 (short last groups and blocks), K under 128.
RAGGED_CASES = [
    ([5, 0, 37, 1], 200, 72),
    ([0, 0, 50, 0], 128, 40),
    ([17, 16, 0, 33, 2], 72, 136),
]


@pytest.fixture
def fp8k(interpreted):
    _, fp8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8")
    return fp8


def _offsets(counts):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)


def _per_expert(offsets, fn):
    ends = offsets.tolist()
    return torch.cat([fn(e, s, t) for e, (s, t) in enumerate(zip([0, *ends[:-1]], ends))])


def _ragged_inputs(counts, k, n, seed, outlier_rows=0, device="cpu"):
    """a [M, K] rows with a spread of magnitudes (2^N(0,1) per row; `outlier_rows` of them 2^16
    larger), b [E, K, N] at 1/sqrt(K), offsets_E."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    row_scale = torch.exp2(torch.randn(rows, generator=gen))
    row_scale[torch.randperm(rows, generator=gen)[:outlier_rows]] *= 2.0**16
    a = torch.randn(rows, k, generator=gen) * row_scale[:, None]
    b = torch.randn(len(counts), k, n, generator=gen) / k**0.5
    return a.to(device), b.to(device), _offsets(counts).to(device)


def _exact(a, b, offsets):
    return _per_expert(offsets.cpu(), lambda e, s, t: a[s:t].double() @ b[e].double()).to(a.device)


def _row_rel_err(got, want):
    return ((got.double() - want.double()).norm(dim=1) / want.double().norm(dim=1).clamp_min(1e-300))


def _rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-300)).item()


def _e4m3_probe(seed):
    """Values that exercise every rounding case at scale 1: each finite e4m3 value, the midpoints
    between neighbours (ties) and their fp32 neighbours, random values over 2^-14..2^9, fp32
    subnormals, +-0, both signs; each row of 128 leads with 448 (so its scale is exactly 1)."""
    gen = torch.Generator().manual_seed(seed)
    grid = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    grid = grid[grid.isfinite() & (grid >= 0)].sort().values
    mids = (grid[1:] + grid[:-1]) / 2
    spread = torch.rand(4096, generator=gen) * torch.exp2(torch.randint(-14, 9, (4096,), generator=gen).float())
    v = torch.cat([grid, mids, mids.nextafter(torch.zeros(())), mids.nextafter(torch.full((), 1e9)), spread,
                   torch.tensor([2.0**-130, 1e-40, 0.0])])
    v = torch.cat([v, -v])
    v = torch.cat([v, v.new_zeros(-v.numel() % 127)]).reshape(-1, 127)
    return torch.cat([v.new_full((v.shape[0], 1), 448.0), v], 1)


def test_the_quantiser_rounds_like_torch_to_the_bit(fp8k):
    """Round to nearest even, subnormals, saturation, -0.0: the kernel's bytes are torch's cast's
    (the interpreter's own fp32 -> fp8 cast would differ on about 11% of random values)."""
    v = _e4m3_probe(seed=0)
    q, s = fp8k.quantize_rows(v)
    assert (s == 1.0).all()
    assert torch.equal(q.view(torch.uint8), v.to(FP8).view(torch.uint8))


def _fma32(a, b, c):
    """fp32 fma(a, b, c) (one rounding) of fp32 numpy arrays, exact: the product in float64 (48 bits,
    exact), the sum as float64 s + its error e (TwoSum), s moved off an fp32 midpoint toward e before the
    last rounding (only there can rounding twice differ from once); an exact zero is -0 only from -0 + -0."""
    import numpy as np

    p, c = a.astype(np.float64) * b.astype(np.float64), c.astype(np.float64)
    s = p + c
    bb = s - p
    e = (p - (s - bb)) + (c - bb)
    r = s.astype(np.float32)
    neighbours = [np.nextafter(r, np.float32(v)).astype(np.float64) for v in (-np.inf, np.inf)]
    mid = ((s == (r + neighbours[0]) / 2) | (s == (r + neighbours[1]) / 2)) & (e != 0)
    out = np.where(mid, np.nextafter(s, s + e), s).astype(np.float32)
    return np.where((s == 0) & (e == 0), np.where(np.signbit(p) & np.signbit(c), np.float32(-0.0), np.float32(0.0)),
                    out)


def _quotient_by_fma(x, scale):
    """The compiled `fp8._reciprocal_of` and `fp8._quotient` (x / scale) in numpy fp32, the FMAs exact (`_fma32`)."""
    import numpy as np

    from disagmoe.kernels import fp8

    f32 = np.float32
    up = np.where(scale < f32(fp8._TINY_SCALE.value), f32(fp8._TINY_SCALE_UP.value), f32(1.0))
    s = (scale * up).astype(f32)
    with np.errstate(all="ignore"):
        y = (f32(1.0) / s).astype(f32)
        x = (x * up).astype(f32)
        q = (x * y).astype(f32)
        return _fma32(_fma32(q, np.minimum(s, f32(fp8._FP32_MAX.value)), -x), -y, q)


def _e4m3_bytes(v):
    """torch's e4m3 bytes of fp32 values clamped to +-448 (the quantisers' rounding), NaN as +-448 by its sign."""
    t = torch.from_numpy(v)
    clamped = torch.where(t.isnan(), torch.full_like(t, 448.0), t.abs().clamp_max(448.0)).copysign(t)
    return clamped.to(FP8).view(torch.uint8)


def test_the_fma_quotient_is_div_rn_to_the_bit():
    """The compiled quantisers' x / scale (`fp8._quotient`: a reciprocal a scale, then q = x y corrected by
    one FMA remainder) emulated exactly in numpy against IEEE division, over scales from amax at every
    magnitude (0, subnormal to near the fp32 maximum, all-ones significands, scales under 2^-64 that the
    kernel scales up) and x from the group (its amax, quotients a few ulps from each e4m3 rounding
    boundary, +-0), and an inf scale with finite, inf and NaN x: the same fp32 bits for every quotient
    from 2^-11 up (e4m3's rounding reads them) and below it the same e4m3 byte (0 by x's sign)."""
    import numpy as np

    f32, rng = np.float32, np.random.default_rng(0)
    n = 1 << 19
    amax = np.concatenate([np.exp2(rng.uniform(-150, 127.9, n)),
                           np.ldexp(2.0 - 2.0**-23 * rng.integers(0, 4, n), rng.integers(-126, 127, n)),
                           np.exp2(rng.uniform(-130, -60, n))]).astype(f32)
    amax[rng.random(amax.size) < 0.01] = 0.0
    scale = (np.maximum(amax, f32(1e-30)) / f32(448.0)).astype(f32)
    kind = rng.random(amax.size)
    x = (amax * rng.random(amax.size).astype(f32)).astype(f32)
    x = np.where(kind < 0.05, amax, x)
    boundary = np.exp2(rng.integers(-10, 9, amax.size)) * (1 + rng.integers(0, 8, amax.size) / 8 + 1 / 16)
    near = ((scale.astype(np.float64) * boundary).astype(f32).view(np.int32)
            + rng.integers(-3, 4, amax.size).astype(np.int32)).view(f32)
    x = np.where((kind > 0.1) & (kind < 0.6) & (np.abs(near) <= amax), near, x)
    x = np.where(rng.random(amax.size) < 0.5, -x, x).astype(f32)
    x[rng.random(amax.size) < 0.01] = -0.0
    with np.errstate(all="ignore"):
        want = (x / scale).astype(f32)
    got = _quotient_by_fma(x, scale)
    wide = np.abs(want) >= 2.0**-11
    assert np.array_equal(want[wide].view(np.int32), got[wide].view(np.int32))
    assert torch.equal(_e4m3_bytes(want), _e4m3_bytes(got))
    x = np.array([1.5, -2.0, 0.0, -0.0, 3e38, np.inf, -np.inf, np.nan], dtype=f32)
    inf = np.full_like(x, np.inf)
    with np.errstate(all="ignore"):
        want = (x / inf).astype(f32)
    got = _quotient_by_fma(x, inf)
    assert np.array_equal(np.isnan(want), np.isnan(got))
    assert np.array_equal(want[~np.isnan(want)].view(np.int32), got[~np.isnan(got)].view(np.int32))


@pytest.mark.slow
def test_the_fma_scale_is_div_rn_to_the_bit_for_every_significand():
    """The compiled quantisers' scale (`fp8._scale_by_fma`: amax / 448 as q = amax y corrected by one FMA
    remainder, y = RN(1 / 448)) emulated exactly in numpy against IEEE division for every fp32 significand
    at the floor's exponent and just above (its remainder the smallest), at 1 and at the largest exponent:
    the quotient's rounding depends on the significands alone in between."""
    import numpy as np

    from disagmoe.kernels import fp8

    f32 = np.float32
    y = f32(fp8._E4M3_MAX_RECIPROCAL.value)
    assert y == f32(1.0) / f32(448.0)
    significands = np.arange(1 << 23, dtype=np.uint32)
    for exponent in (-100, -99, 0, 127):
        a = ((np.uint32(exponent + 127) << np.uint32(23)) | significands).view(f32)
        a = a[a >= f32(fp8.AMAX_FLOOR)]
        q = (a * y).astype(f32)
        got = _fma32(_fma32(q, np.full_like(a, 448.0), -a), np.full_like(a, -y), q)
        assert np.array_equal(got.view(np.int32), (a / f32(448.0)).astype(f32).view(np.int32)), exponent


@pytest.mark.parametrize("shape,dtype", [((37, 300), torch.float32), ((20, 128), torch.bfloat16),
                                         ((9, 40), torch.float32), ((0, 256), torch.float32)])
def test_quantize_rows_matches_reference_and_bounds_the_error(fp8k, shape, dtype):
    """Bytes and scales equal the reference's; zero rows and zero groups get the floor's finite
    scale and dequantise to 0; each element is within half an e4m3 step of x (2^-4 relative in
    e4m3's normal range, 2^-10 x scale below it); a strided input reads the same."""
    gen = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=gen) * torch.exp2(torch.randint(-30, 30, (shape[0], 1), generator=gen).float())
    if shape[0]:
        x[min(3, shape[0] - 1)] = 0.0
        x[0, : min(128, shape[1])] = 0.0
    x = x.to(dtype)
    q, s = fp8k.quantize_rows(x)
    q_ref, s_ref = fp8k.quantize_rows_reference(x)
    assert q.dtype == FP8 and s.shape == (shape[0], -(-shape[1] // 128))
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.isfinite(s).all() and (s > 0).all()
    deq, xf = fp8k.dequantize_rows(q, s), x.float()
    assert (deq[xf == 0] == 0).all()
    step = torch.maximum(xf.abs() * 2.0**-4, s.repeat_interleave(128, 1)[:, : shape[1]] * 2.0**-10)
    assert ((deq - xf).abs() <= step * (1 + 1e-6)).all()
    q_t, s_t = fp8k.quantize_rows(x.t().contiguous().t())  # column-major view of the same values
    assert torch.equal(q_t.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_t, s)


def test_quantize_blocks_matches_reference(fp8k):
    """[E, K, N] weights per 128 x 128 block, K and N not multiples of 128, one all-zero block;
    the transposed copy dequantises to the transpose."""
    gen = torch.Generator().manual_seed(4)
    w = torch.randn(3, 200, 150, generator=gen) * torch.tensor([1.0, 1e-3, 1e3])[:, None, None]
    w[1, :128, 128:] = 0.0
    q, s = fp8k.quantize_blocks(w)
    q_ref, s_ref = fp8k.quantize_blocks_reference(w)
    assert s.shape == (3, 2, 2) and torch.isfinite(s).all()
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    deq = fp8k.dequantize_blocks(q, s)
    assert (deq[1, :128, 128:] == 0).all()
    assert _rel_err(deq, w) < 2.0**-4
    q_t, s_t = fp8k.transpose_blocks(q, s)
    assert q_t.is_contiguous() and torch.equal(fp8k.dequantize_blocks(q_t, s_t), deq.transpose(1, 2))
    # the same launch writing the transposed copy too: q unchanged, the copy transpose_blocks' bits
    q_both = torch.empty((3, 150, 200), dtype=FP8)
    q2, s2 = fp8k.quantize_blocks(w, transposed_out=q_both)
    assert torch.equal(q2.view(torch.uint8), q.view(torch.uint8)) and torch.equal(s2, s)
    assert torch.equal(q_both.view(torch.uint8), q_t.view(torch.uint8))
    with pytest.raises(ValueError, match=r"transposed_out must be float8_e4m3fn \(3, 150, 200\)"):
        fp8k.quantize_blocks(w, transposed_out=torch.empty((3, 200, 150), dtype=FP8))


# (E, K, N) of the transposed-only store: ragged edge blocks both ways, K or N under one block, one
# block exactly, and an empty expert count or dimension (nothing launched).
TRANSPOSED_ONLY_SHAPES = [(2, 200, 150), (1, 72, 140), (2, 128, 40), (0, 130, 70), (2, 0, 90), (2, 90, 0)]


@pytest.mark.parametrize("shape", TRANSPOSED_ONLY_SHAPES)
def test_quantize_blocks_transposed_only_matches_reference(fp8k, shape):
    """`natural=False`: the transposed copy alone is the reference's transposed bits, the scales the
    reference's; no [E, K, N] copy is returned; the stats counted as with both copies stored."""
    from disagmoe.kernels.fp8_stats import WEIGHTS, Fp8Stats

    gen = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(*shape, generator=gen) * torch.exp2(torch.randn(shape[0], 1, 1, generator=gen) * 6)
    q_ref, s_ref = fp8k.quantize_blocks_reference(w)
    q_ENK = torch.full((shape[0], shape[2], shape[1]), float("nan"), dtype=FP8)
    stats, both_stats = Fp8Stats("cpu"), Fp8Stats("cpu")
    q, s = fp8k.quantize_blocks(w, stats.row(WEIGHTS), transposed_out=q_ENK, natural=False)
    assert q is None and torch.equal(s, s_ref)
    assert torch.equal(q_ENK.view(torch.uint8), q_ref.transpose(1, 2).view(torch.uint8))
    fp8k.quantize_blocks(w, both_stats.row(WEIGHTS), transposed_out=torch.empty_like(q_ENK))
    assert torch.equal(stats.buffer, both_stats.buffer)


def test_quantize_blocks_transposed_only_needs_the_copy(fp8k):
    with pytest.raises(ValueError, match=r"pass transposed_out \(float8_e4m3fn \(3, 150, 200\)\)"):
        fp8k.quantize_blocks(torch.zeros(3, 200, 150), natural=False)


@pytest.mark.parametrize("case", range(len(RAGGED_CASES)))
def test_gemm_matches_reference_sums(fp8k, case):
    """The kernel (fp8 operands in the interpreter, fp32 accumulation) against the reference's
    same per-128 sums, to fp32 rounding; every row written (NaN-filled first); and within the
    fine-grained error bound of the fp32 GEMM."""
    counts, k, n = RAGGED_CASES[case]
    a, b, offsets = _ragged_inputs(counts, k, n, seed=case, outlier_rows=1)
    qa, sa = fp8k.quantize_rows(a)
    qb, sb = fp8k.quantize_blocks(b)
    out = torch.full((a.shape[0], n), float("nan"))
    got = fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb, SMALL_TILES, out=out, num_programs=2 + case)
    want = fp8k.fp8_rows_gemm_reference(qa, sa, offsets, qb, sb)
    assert got is out and torch.isfinite(got).all()
    assert _rel_err(got, want) < SAME_SUMS_REL_ERR
    assert _row_rel_err(got, _exact(a, b, offsets)).max() < FP8_ROW_REL_ERR


def test_gemm_over_banded_groups_and_half_depth_tiles(fp8k):
    """offsets holding 2 x E row groups (group g uses expert g mod E) and block_k = 64 (two dots
    per scale group, each scaled: the same sums up to fp32 rounding); bf16 output."""
    counts, k, n = [6, 0, 11, 3, 0, 9], 160, 32  # groups 3..5 use experts 0..2 again
    a, b, offsets = _ragged_inputs(counts, k, n, seed=7)
    b = b[:3]
    qa, sa = fp8k.quantize_rows(a)
    qb, sb = fp8k.quantize_blocks(b)
    tiles = TileConfig(block_m=16, block_n=32, block_k=64, group_m=1, num_warps=4, num_stages=1)
    got = fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb, tiles, num_programs=3)
    want = fp8k.fp8_rows_gemm_reference(qa, sa, offsets, qb, sb)
    assert got.dtype == torch.bfloat16
    assert _rel_err(got, want) < 2.0**-8  # bf16 rounding of the output
    exact = _per_expert(offsets, lambda e, s, t: a[s:t] @ b[e % 3])
    assert _row_rel_err(got.float(), exact).max() < FP8_ROW_REL_ERR


def test_per_tensor_scaling_fails_the_bound_the_fine_grained_recipe_passes(fp8k):
    """On rows 2^16 larger than the rest (an attention-sink token, a large gradient row), one scale
    for all of a pushes the other rows into e4m3's subnormals or to zero: their errors go far past
    FP8_ROW_REL_ERR. The 1 x 128 / 128 x 128 recipe (kernel) stays under it; without the outlier
    rows per-tensor scaling passes too, so the outliers are what breaks it."""
    counts, k, n = [24, 0, 40, 9], 200, 64
    for outliers, per_tensor_fails in ((4, True), (0, False)):
        a, b, offsets = _ragged_inputs(counts, k, n, seed=11, outlier_rows=outliers)
        exact = _exact(a, b, offsets)
        qa, sa = fp8k.quantize_rows(a)
        qb, sb = fp8k.quantize_blocks(b)
        fine = fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb, SMALL_TILES, out_dtype=torch.float32, num_programs=4)
        assert _row_rel_err(fine, exact).max() < FP8_ROW_REL_ERR
        ta, ts_a = fp8k.quantize_tensor_reference(a)
        tb, ts_b = fp8k.quantize_tensor_reference(b)
        coarse = _per_expert(offsets, lambda e, s, t: (ta[s:t].float() @ tb[e].float()) * (ts_a * ts_b))
        assert (_row_rel_err(coarse, exact).max() > FP8_ROW_REL_ERR) == per_tensor_fails


def test_refusals_name_the_fix(fp8k):
    a, b, offsets = _ragged_inputs([3, 4], 64, 32, seed=0)
    qa, sa = fp8k.quantize_rows(a)
    qb, sb = fp8k.quantize_blocks(b)
    with pytest.raises(ValueError, match="block_k"):
        fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb, TileConfig(block_m=16, block_n=16, block_k=48))
    with pytest.raises(ValueError, match="quantize_rows"):
        fp8k.fp8_rows_gemm(a, sa, offsets, qb, sb, SMALL_TILES)
    with pytest.raises(ValueError, match="sb"):
        fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb[:, :, :0], SMALL_TILES)
    with pytest.raises(ValueError, match="int32"):
        fp8k.fp8_rows_gemm(qa, sa, offsets.long(), qb, sb, SMALL_TILES)
    empty = fp8k.fp8_rows_gemm(qa[:0], sa[:0], torch.zeros(2, dtype=torch.int32), qb, sb, SMALL_TILES)
    assert empty.shape == (0, 32)


SWIGLU_TILES = TileConfig(block_m=16, block_n=128, block_k=128, group_m=2, num_warps=4, num_stages=1)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # sigmoid of the outlier row's -2^16: 0
@pytest.mark.parametrize("counts,hidden,ffn", [([5, 0, 37, 1], 200, 72), ([0, 19, 0, 6], 96, 136)])
def test_swiglu_epilogue_writes_the_down_gemms_fp8_operand(fp8k, counts, hidden, ffn):
    """Gate/up GEMM with SwiGLU and 1 x 128 quantisation in its epilogue: the pre-activations are
    the reference's sums; the e4m3 rows and scales are the reference's quantisation of
    silu(gate) * up (bytes equal but where Triton's sigmoid and torch's silu round an element
    across an e4m3 tie, each within half a step); the down GEMM on them gives the expert FFN
    within FP8_FFN_ROW_REL_ERR of fp32 (F = 136: two column tiles, the second 8 wide)."""
    from disagmoe.kernels.moe_ffn import expert_ffn_reference

    x, w13, offsets = _ragged_inputs(counts, hidden, 2 * ffn, seed=ffn, outlier_rows=1)
    w2 = torch.randn(len(counts), ffn, hidden, generator=torch.Generator().manual_seed(ffn)) / ffn**0.5
    qx, sx = fp8k.quantize_rows(x)
    q13, s13 = fp8k.quantize_blocks(w13)
    h13 = torch.full((x.shape[0], 2 * ffn), float("nan"))
    q_act, s_act = fp8k.fp8_swiglu_gemm(qx, sx, offsets, q13, s13, SWIGLU_TILES, h13_M2F=h13, num_programs=3)
    act_ref, h13_ref = fp8k.fp8_swiglu_reference(qx, sx, offsets, q13, s13)
    assert _rel_err(h13, h13_ref) < SAME_SUMS_REL_ERR
    q_ref, s_ref = fp8k.quantize_rows_reference(act_ref)
    assert ((s_act - s_ref).abs() <= 1e-5 * s_ref).all()
    assert (q_act.view(torch.uint8) == q_ref.view(torch.uint8)).float().mean() > 0.999
    deq = fp8k.dequantize_rows(q_act, s_act)
    step = torch.maximum(act_ref.abs() * 2.0**-4, s_ref.repeat_interleave(128, 1)[:, :ffn] * 2.0**-10)
    assert ((deq - act_ref).abs() <= step * (1 + 1e-4)).all()
    y = fp8k.fp8_rows_gemm(q_act, s_act, offsets, *fp8k.quantize_blocks(w2), SMALL_TILES,
                           out_dtype=torch.float32, num_programs=2)
    exact = expert_ffn_reference(x.double(), offsets, w13.double(), w2.double())
    assert _row_rel_err(y, exact).max() < FP8_FFN_ROW_REL_ERR
    with pytest.raises(ValueError, match="block_n=128"):
        fp8k.fp8_swiglu_gemm(qx, sx, offsets, q13, s13, SMALL_TILES)


def test_swiglu_gradient_epilogue(fp8k):
    """The down GEMM's data gradient with the SwiGLU derivative in its epilogue: d gate | d up from
    the reference's d act sums and the pre-activations (to fp32 rounding of the sigmoid), every
    element written, and silu(gate) * up recomputed into act."""
    counts, hidden, ffn = [6, 0, 25, 2], 136, 40
    dy, _, offsets = _ragged_inputs(counts, hidden, 1, seed=12, outlier_rows=1)
    gen = torch.Generator().manual_seed(13)
    w2 = torch.randn(len(counts), ffn, hidden, generator=gen) / ffn**0.5
    h13 = torch.randn(dy.shape[0], 2 * ffn, generator=gen) * 3
    q_dy, s_dy = fp8k.quantize_rows(dy)
    q_wt, s_wt = fp8k.transpose_blocks(*fp8k.quantize_blocks(w2))
    act = torch.full((dy.shape[0], ffn), float("nan"))
    dh13 = fp8k.fp8_swiglu_grad_gemm(q_dy, s_dy, offsets, q_wt, s_wt, h13, SMALL_TILES, act_MF=act,
                                     out_dtype=torch.float32, num_programs=3)
    gate, up = h13[:, :ffn].clone().requires_grad_(), h13[:, ffn:].clone().requires_grad_()
    (torch.nn.functional.silu(gate) * up).backward(fp8k.fp8_rows_gemm_reference(q_dy, s_dy, offsets, q_wt, s_wt))
    assert torch.isfinite(dh13).all() and torch.isfinite(act).all()
    assert _rel_err(dh13, torch.cat([gate.grad, up.grad], dim=1)) < 1e-5
    assert _rel_err(act, torch.nn.functional.silu(h13[:, :ffn]) * h13[:, ffn:]) < 1e-6
    with pytest.raises(ValueError, match="h13"):
        fp8k.fp8_swiglu_grad_gemm(q_dy, s_dy, offsets, q_wt, s_wt, h13[:, :ffn], SMALL_TILES)



@pytest.mark.parametrize("promote, chunk", [("inline", 8), ("inline", 16), ("pingpong", 8)],
                         ids=["inline-8-of-32", "inline-16-of-32", "pingpong-8-of-16"])
def test_swiglu_gradient_epilogue_in_column_chunks_is_the_whole_tiles(fp8k, promote, chunk):
    """The SwiGLU-gradient epilogue finishing its tile `epilogue_chunk` columns at a time
    (`fp8._swiglu_grad_epilogue`; pingpong: each 16-column half) gives the whole tile's bits: d gate |
    d up and the recomputed SwiGLU output (the same arithmetic per element), every element written
    (NaN-filled outputs). Ragged experts, an empty one, F = 40 (the last column tile 8 wide: its
    chunks past F store nothing); the reference as `test_swiglu_gradient_epilogue`."""
    import dataclasses

    counts, hidden, ffn = [6, 0, 25, 2], 136, 40
    dy, _, offsets = _ragged_inputs(counts, hidden, 1, seed=14, outlier_rows=1)
    gen = torch.Generator().manual_seed(15)
    w2 = torch.randn(len(counts), ffn, hidden, generator=gen) / ffn**0.5
    h13 = torch.randn(dy.shape[0], 2 * ffn, generator=gen) * 3
    q_dy, s_dy = fp8k.quantize_rows(dy)
    q_wt, s_wt = fp8k.transpose_blocks(*fp8k.quantize_blocks(w2))
    tiles = dataclasses.replace(SMALL_TILES, promote=promote)

    def run(config):
        act = torch.full((dy.shape[0], ffn), float("nan"))
        dh13 = fp8k.fp8_swiglu_grad_gemm(q_dy, s_dy, offsets, q_wt, s_wt, h13, config, act_MF=act,
                                         out_dtype=torch.float32, num_programs=3)
        return dh13, act

    dh13, act = run(dataclasses.replace(tiles, epilogue_chunk=chunk))
    whole = run(dataclasses.replace(tiles, epilogue_chunk=tiles.block_n))
    assert torch.isfinite(dh13).all() and torch.isfinite(act).all()
    assert torch.equal(dh13, whole[0]) and torch.equal(act, whole[1])
    gate, up = h13[:, :ffn].clone().requires_grad_(), h13[:, ffn:].clone().requires_grad_()
    (torch.nn.functional.silu(gate) * up).backward(fp8k.fp8_rows_gemm_reference(q_dy, s_dy, offsets, q_wt, s_wt))
    assert _rel_err(dh13, torch.cat([gate.grad, up.grad], dim=1)) < 1e-5
    with pytest.raises(ValueError, match="epilogue_chunk"):
        run(dataclasses.replace(tiles, epilogue_chunk=12))


def test_data_gradient_reads_the_transposed_blocks(fp8k):
    """dx = dy @ W^T: dy quantised per 1 x 128 along N, W^T from `transpose_blocks` (the forward's
    block values and scales, laid out K-major); against the reference's sums and the fp32 GEMM."""
    counts, k, n = [9, 0, 30, 4], 144, 80
    dy, _, offsets = _ragged_inputs(counts, n, k, seed=5, outlier_rows=1)  # dy [M, N]
    w = torch.randn(len(counts), k, n, generator=torch.Generator().manual_seed(6)) / k**0.5
    q_dy, s_dy = fp8k.quantize_rows(dy)
    q_wt, s_wt = fp8k.transpose_blocks(*fp8k.quantize_blocks(w))
    got = fp8k.fp8_rows_gemm(q_dy, s_dy, offsets, q_wt, s_wt, SMALL_TILES, out_dtype=torch.float32,
                             num_programs=3)
    assert _rel_err(got, fp8k.fp8_rows_gemm_reference(q_dy, s_dy, offsets, q_wt, s_wt)) < SAME_SUMS_REL_ERR
    exact = _per_expert(offsets, lambda e, s, t: dy[s:t].double() @ w[e].double().t())
    assert _row_rel_err(got, exact).max() < FP8_ROW_REL_ERR


def test_token_groups_are_padded_to_the_scale_block(fp8k):
    """Each group's rows start at a multiple of 128 in the token-contiguous copy, the padding is
    zeros, no 128-row chunk straddles two groups (its column scales are the reference's, from its
    group's rows alone), empty groups take no room, and columns past the last group are zeros
    with the floor's finite scale."""
    counts = [130, 0, 5, 260]
    offsets = _offsets(counts)
    gen = torch.Generator().manual_seed(8)
    x = torch.randn(sum(counts), 40, generator=gen) * torch.exp2(torch.randn(sum(counts), 1, generator=gen) * 4)
    q, s, padded = fp8k.quantize_token_groups(x, offsets)
    q_ref, s_ref, padded_ref = fp8k.quantize_token_groups_reference(x, offsets)
    assert padded.tolist() == [256, 256, 384, 768] and torch.equal(padded, padded_ref)
    assert q.shape == (40, fp8k.padded_capacity(395, 4)) and s.shape == (40, q.shape[1] // 128)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    deq = q.float() * s.repeat_interleave(128, dim=1)
    rows = torch.cat([torch.arange(0, 130), torch.arange(256, 261), torch.arange(384, 644)])
    kept = torch.zeros(q.shape[1], dtype=torch.bool)
    kept[rows] = True
    assert (deq[:, ~kept] == 0).all() and torch.isfinite(s).all()
    xf = x.t()
    step = torch.maximum(xf.abs() * 2.0**-4, s.repeat_interleave(128, dim=1)[:, rows] * 2.0**-10)
    assert ((deq[:, rows] - xf).abs() <= step * (1 + 1e-6)).all()


# (rows per expert, K, dtype, rows past the last expert): empty experts, experts over 128 rows
# (two and three token chunks), K not a multiple of 128 and under 128, bf16 and fp32, spare rows
# (read as rows by `quantize_rows` without valid_rows, in no token group) past one chunk.
ROWS_AND_TOKEN_GROUPS_CASES = [
    ([130, 0, 5, 140, 1], 200, torch.float32, 7),
    ([0, 0, 50, 0], 128, torch.bfloat16, 0),
    ([17, 260, 0, 33, 2], 72, torch.bfloat16, 130),
    ([0, 129], 40, torch.float32, 0),
]
UNWRITTEN = 0x7F  # an e4m3 NaN (no quantiser writes one: they saturate), fp32 3.4e38 as 0x7F7F7F7F


def _unwritten_is_marked(monkeypatch):
    """torch.empty, as the quantisers allocate, filled with UNWRITTEN bytes: what two launches
    leave unwritten compares equal only where both leave it so, and can be seen."""
    empty = torch.empty

    def marked(*args, **kwargs):
        t = empty(*args, **kwargs)
        t.view(torch.uint8).fill_(UNWRITTEN)
        return t

    monkeypatch.setattr(torch, "empty", marked)


def _bits(t: torch.Tensor) -> torch.Tensor:
    """t's bit patterns (NaN-safe equality): fp8 as uint8, fp32 as int32."""
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int32) if t.dtype == torch.float32 else t


def _assert_the_two_quantisers(fp8k, x, offsets, stats_kind, valid_rows=None):
    """`quantize_rows_and_token_groups` against `quantize_rows` then `quantize_token_groups` of the
    same x into the same stats kind: every byte of both copies (unwritten rows included) and of
    their scales, padded_E, and the counters equal (None: no counters on either side)."""
    from disagmoe.kernels.fp8_stats import Fp8Stats

    two, one = (None, None) if stats_kind is None else (Fp8Stats("cpu"), Fp8Stats("cpu"))
    row = lambda stats: None if stats is None else stats.row(stats_kind)  # noqa: E731
    want = (fp8k.quantize_rows(x, row(two), valid_rows), fp8k.quantize_token_groups(x, offsets, row(two)))
    got = fp8k.quantize_rows_and_token_groups(x, offsets, row(one), valid_rows)
    for got_part, want_part in zip(got, want, strict=True):
        for g, w in zip(got_part, want_part, strict=True):
            assert g.shape == w.shape and g.dtype == w.dtype and torch.equal(_bits(g), _bits(w))
    if two is not None:
        assert torch.equal(one.buffer, two.buffer), (one.buffer, two.buffer)
    return got, one


@pytest.mark.parametrize("counted", [False, True], ids=["plain", "counted"])
@pytest.mark.parametrize("counts,k,dtype,spare", ROWS_AND_TOKEN_GROUPS_CASES)
def test_one_pass_quantises_rows_and_token_groups_as_the_two_quantisers(fp8k, monkeypatch, counts, k, dtype, spare,
                                                                          counted):
    """Both quantisations of x from one launch: the bytes, scales, padded offsets and counters of
    `quantize_rows` and `quantize_token_groups`, rows past the last expert quantised as rows (the
    chunks past the last group hold them) and in no token group. x is a column slice of a wider
    tensor (rows strided), magnitudes 2^(4 N(0,1)) per row, an all-zero row."""
    _unwritten_is_marked(monkeypatch)
    gen = torch.Generator().manual_seed(k + spare)
    rows = sum(counts) + spare
    wide = torch.randn(rows, k + 56, generator=gen) * torch.exp2(4 * torch.randn(rows, 1, generator=gen))
    wide[rows // 3] = 0.0
    x = wide.to(dtype)[:, :k]
    ((q_MK, _), _), _ = _assert_the_two_quantisers(fp8k, x, _offsets(counts), 1 if counted else None)
    assert (q_MK.view(torch.uint8) != UNWRITTEN).all()  # every row written (no valid_rows)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("valid", [275, 100, 0])
def test_one_pass_leaves_a_worst_case_buffers_padding_rows_as_quantize_rows_does(fp8k, monkeypatch, valid):
    """A worst-case buffer whose rows past offsets_E[-1] hold NaN and inf, with valid_rows =
    offsets_E[-1:] as the FP8 backward passes it (275), or fewer (rows of the groups past it are
    quantised along tokens, not as rows): both quantisers' bytes, scales and counters; the row
    copy's rows past valid_rows never written; no non-finite value counted."""
    from disagmoe.kernels.fp8_stats import GRADIENTS, NONFINITE, TOTAL

    _unwritten_is_marked(monkeypatch)
    counts, k, pad = [130, 0, 5, 140], 136, 20
    offsets = _offsets(counts)
    gen = torch.Generator().manual_seed(valid)
    x = torch.randn(sum(counts) + pad, k, generator=gen).bfloat16()
    x[sum(counts):] = float("nan")
    x[sum(counts)::3] = float("inf")
    valid_rows = offsets[-1:] if valid == 275 else torch.tensor([valid], dtype=torch.int32)
    ((q_MK, s_MG), _), stats = _assert_the_two_quantisers(fp8k, x, offsets, GRADIENTS, valid_rows)
    assert (q_MK[valid:].view(torch.uint8) == UNWRITTEN).all() and (s_MG[valid:].view(torch.uint8) == UNWRITTEN).all()
    assert (q_MK[:valid].view(torch.uint8) != UNWRITTEN).all()  # e4m3 NaN: never a quantiser's output
    assert stats.buffer[GRADIENTS, NONFINITE] == 0
    assert stats.buffer[GRADIENTS, TOTAL] == (valid + sum(counts)) * k


def _random_ragged(seed, max_rows=150):
    """(x, offsets_E) of a seeded random shape: 1-5 groups of 0-max_rows rows (empty ones among them),
    K from 1 to 300 (one to three column groups, the last one's halves partly or wholly past K), spare
    rows past the last group, bf16 or fp32, magnitudes 2^(4 N(0,1)) per row, an all-zero row."""
    gen = torch.Generator().manual_seed(seed)
    groups = int(torch.randint(1, 6, (1,), generator=gen))
    counts = torch.randint(0, max_rows, (groups,), generator=gen)
    counts[torch.rand(groups, generator=gen) < 0.3] = 0
    rows = int(counts.sum()) + int(torch.randint(0, 20, (1,), generator=gen))
    k = int(torch.randint(1, 301, (1,), generator=gen))
    x = torch.randn(rows, k, generator=gen) * torch.exp2(4 * torch.randn(rows, 1, generator=gen))
    if rows:
        x[int(torch.randint(0, rows, (1,), generator=gen))] = 0.0
    return x.to((torch.float32, torch.bfloat16)[seed % 2]), counts.cumsum(0).to(torch.int32)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_token_groups_of_random_ragged_shapes_are_the_reference(fp8k, seed):
    """`quantize_token_groups` over random shapes (`_random_ragged`), each program striding over several
    tiles: the reference's bytes and scales, read in place, with a stats row, and gathered from shuffled
    tokens (rows_M)."""
    from disagmoe.kernels.fp8_stats import Fp8Stats

    x, offsets = _random_ragged(seed)
    grouped = x[: int(offsets[-1])]
    q_ref, s_ref, padded_ref = fp8k.quantize_token_groups_reference(grouped, offsets)
    order = torch.randperm(grouped.shape[0], generator=torch.Generator().manual_seed(seed))
    tokens = torch.empty_like(grouped)
    tokens[order] = grouped  # grouped row r is token order[r]
    for q, s, padded in (fp8k.quantize_token_groups(grouped, offsets),
                         fp8k.quantize_token_groups(grouped, offsets, Fp8Stats("cpu").row(0)),
                         fp8k.quantize_token_groups(tokens, offsets, rows_M=order)):
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
        assert torch.equal(padded, padded_ref)


@pytest.mark.parametrize("seed", range(4))
def test_one_pass_over_random_ragged_shapes_is_the_two_quantisers(fp8k, monkeypatch, seed):
    """`quantize_rows_and_token_groups` over random shapes (`_random_ragged`), with a stats row (odd seeds)
    and without, with valid_rows at the last group's end, at a random count or none: the bytes, scales,
    unwritten rows and counters of `quantize_rows` and `quantize_token_groups`."""
    _unwritten_is_marked(monkeypatch)
    x, offsets = _random_ragged(seed + 10)
    gen = torch.Generator().manual_seed(seed)
    valid = (None, offsets[-1:], torch.randint(0, x.shape[0] + 1, (1,), generator=gen, dtype=torch.int32))[seed % 3]
    _assert_the_two_quantisers(fp8k, x, offsets, 1 if seed % 2 else None, valid)


def _wild_rows(rows, k, seed, device="cpu"):
    """x [rows, k] fp32 at every magnitude: rows and columns scaled by 2^U(-75, 62) each (subnormals, values
    near the fp32 maximum), a column and a row of values around 1e-25 (scales under 2^-64), -0 rows, an
    all-zero column, and an inf and a NaN planted."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x *= torch.exp2(torch.empty(rows, 1).uniform_(-75, 62, generator=gen))
    x *= torch.exp2(torch.empty(1, k).uniform_(-75, 62, generator=gen))
    x[:, min(1, k - 1)] = torch.randn(rows, generator=gen) * 1e-25
    x[:, k // 2] = 0.0
    x[:: 7] = -0.0 * x[:: 7].abs()
    x[1] = torch.randn(k, generator=gen) * 1e-25
    x[rows // 3, k - 1], x[rows // 2, 0] = float("inf"), float("nan")
    return x.to(device)


def _assert_token_groups_are_the_row_quantisers(fp8, x, offsets):
    """`quantize_token_groups(x, offsets)` and the one pass's token groups are `quantize_rows` of x's padded
    transpose (each group's rows at its padded offset, zeros between: its 1 x 128 groups along the tokens
    are the chunks) byte for byte, the one pass's rows `quantize_rows(x)`'. Compiled, the row quantiser
    divides by div_rn, the token-group quantisers by `fp8._quotient`."""
    x_PK = x.new_zeros((fp8.padded_capacity(x.shape[0], offsets.shape[0]), x.shape[1]))
    ends, padded_ends = offsets.tolist(), fp8.padded_offsets(offsets).tolist()
    for start, end, padded_start in zip([0, *ends[:-1]], ends, [0, *padded_ends[:-1]]):
        x_PK[padded_start:padded_start + end - start] = x[start:end]
    q_want, s_want = fp8.quantize_rows(x_PK.t().contiguous())
    (q_MK, s_MG), (q_KP, s_KC, _) = fp8.quantize_rows_and_token_groups(x, offsets)
    for q, s in ((q_KP, s_KC), fp8.quantize_token_groups(x, offsets)[:2]):
        assert torch.equal(q.view(torch.uint8), q_want.view(torch.uint8)) and torch.equal(_bits(s), _bits(s_want))
    q_rows, s_rows = fp8.quantize_rows(x)
    assert torch.equal(q_MK.view(torch.uint8), q_rows.view(torch.uint8)) and torch.equal(_bits(s_MG), _bits(s_rows))


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning", "ignore:overflow:RuntimeWarning")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_token_groups_are_the_row_quantisers_bytes_of_the_padded_transpose(fp8k, dtype):
    """At every magnitude, with an inf and a NaN (`_wild_rows`): `quantize_token_groups` and the one-pass
    quantiser's token groups are `quantize_rows` of x's padded transpose, byte for byte; the one pass's
    rows are `quantize_rows`' (`_assert_token_groups_are_the_row_quantisers`; compiled:
    `test_gpu_the_fma_quotient_gives_div_rns_bytes_at_every_magnitude`)."""
    x = _wild_rows(300, 200, seed=3).to(dtype)
    _assert_token_groups_are_the_row_quantisers(fp8k, x, _offsets([130, 0, 41, 129]))


def test_one_pass_refusals_name_the_fix(fp8k):
    x = torch.randn(8, 128)
    with pytest.raises(ValueError, match="valid_rows must be an int32"):
        fp8k.quantize_rows_and_token_groups(x, _offsets([8]), valid_rows=torch.tensor([8]))
    with pytest.raises(ValueError, match="at least one group"):
        fp8k.quantize_rows_and_token_groups(x, torch.zeros(0, dtype=torch.int32))


WGRAD_TILES = TileConfig(block_m=128, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)


@pytest.mark.parametrize("counts,k,n", [([130, 0, 5, 260], 40, 24), ([0, 17, 0], 24, 48)])
def test_weight_gradient_matches_reference_sums(fp8k, counts, k, n):
    """dW[e] = x[rows_e]^T dy[rows_e] from the token-group copies: the reference's sums to fp32
    rounding, zeros for empty experts (every element written: NaN-filled first), each row of each
    dW[e] within FP8_ROW_REL_ERR of the fp32 GEMM; added into an fp32 main gradient with
    `accumulate` (block_m = 64: two steps per scale chunk)."""
    x, _, offsets = _ragged_inputs(counts, k, n, seed=sum(counts))
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(1))
    qx = fp8k.quantize_token_groups(x, offsets)
    qd = fp8k.quantize_token_groups(dy, offsets)
    out = torch.full((len(counts), k, n), float("nan"))
    got = fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], WGRAD_TILES, out=out, num_programs=3)
    want = fp8k.fp8_weight_grad_reference(qx[:2], qd[:2], qx[2])
    assert got is out and torch.isfinite(got).all()
    assert _rel_err(got, want) < SAME_SUMS_REL_ERR
    starts = [0, *offsets[:-1].tolist()]
    for e, (start, end) in enumerate(zip(starts, offsets.tolist())):
        if start == end:
            assert (got[e] == 0).all()
        else:
            assert _row_rel_err(got[e], x[start:end].double().t() @ dy[start:end].double()).max() < FP8_ROW_REL_ERR
    main = torch.randn(len(counts), k, n, generator=torch.Generator().manual_seed(2))
    start_main = main.clone()
    half = TileConfig(block_m=64, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=1)
    fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], half, out=main, accumulate=True, num_programs=2)
    assert _rel_err(main - start_main, want) < 1e-5  # rounding of the additions to start_main


def test_weight_gradient_added_by_atomics_is_the_load_add_store_sum(fp8k):
    """`atomic_accumulate` tiles add each finished tile into the fp32 main gradient by relaxed
    reductions: the same values as loading, adding and storing it (one writer per element), empty
    experts' rows included (they add zeros)."""
    counts, k, n = [130, 0, 5, 260], 40, 24
    x, _, offsets = _ragged_inputs(counts, k, n, seed=5)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(4))
    qx = fp8k.quantize_token_groups(x, offsets)
    qd = fp8k.quantize_token_groups(dy, offsets)
    main = torch.randn(len(counts), k, n, generator=torch.Generator().manual_seed(6))
    stored, added = main.clone(), main.clone()
    fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], WGRAD_TILES, out=stored, accumulate=True, num_programs=3)
    atomic = dataclasses.replace(WGRAD_TILES, atomic_accumulate=True)
    fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], atomic, out=added, accumulate=True, num_programs=3)
    assert torch.equal(added, stored)


def test_weight_gradient_over_banded_groups(fp8k):
    """2 x E row groups, group g to weight g mod E (segment-major order): dW[e] sums both."""
    counts, k, n = [7, 0, 20, 3, 11, 0], 24, 16
    x, _, offsets = _ragged_inputs(counts, k, n, seed=9)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(3))
    qx = fp8k.quantize_token_groups(x, offsets)
    qd = fp8k.quantize_token_groups(dy, offsets)
    got = fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], WGRAD_TILES, weights=3, num_programs=2)
    assert got.shape == (3, k, n)
    assert _rel_err(got, fp8k.fp8_weight_grad_reference(qx[:2], qd[:2], qx[2], weights=3)) < SAME_SUMS_REL_ERR
    with pytest.raises(ValueError, match="block_m"):
        fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], TileConfig(block_m=48, block_n=16, block_k=16))
    with pytest.raises(ValueError, match="multiple of 4"):
        fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], WGRAD_TILES, weights=4)
    with pytest.raises(ValueError, match="quantize_token_groups"):
        fp8k.fp8_weight_grad(qx[:2], (qd[0][:, :128], qd[1][:, :1]), qx[2], WGRAD_TILES)


# --- the K loop's promotion variants (`fp8.PROMOTE_VARIANTS`, `TileConfig.promote`) against the inline loop

PROMOTED = ("hoisted", "pipelined", "pingpong")
# pingpong halves block_n (but the SwiGLU GEMM's: its gate and up dots), pipelined block_k (the
# weight gradient: block_m, its token step)
ROWS_TILES = [TileConfig(block_m=16, block_n=32, block_k=128, group_m=2, num_warps=4, num_stages=1),  # 1 sb a tile
              TileConfig(block_m=32, block_n=256, block_k=64, group_m=2, num_warps=4, num_stages=1)]  # over 2 blocks
SWIGLU_PROMOTED = TileConfig(block_m=32, block_n=128, block_k=64, group_m=2, num_warps=4, num_stages=1)
WGRAD_PROMOTED = [TileConfig(block_m=128, block_n=32, block_k=16, group_m=2, num_warps=4, num_stages=1),
                  TileConfig(block_m=64, block_n=32, block_k=64, group_m=1, num_warps=4, num_stages=1)]


def _promoted(tiles, promote):
    import dataclasses

    return dataclasses.replace(tiles, promote=promote)


def _same_sums(promote):
    """Bit for bit, but "pipelined" (the interpreter adds its two half-depth products in fp32) and
    "pingpong" (its half-width dots are numpy matmuls of another shape, whose BLAS may order a dot
    product's sums otherwise: equal on the CI machine, not on every CPU)."""
    if promote in ("pipelined", "pingpong"):
        return lambda got, want: _rel_err(got, want) < SAME_SUMS_REL_ERR
    return lambda got, want: torch.equal(got, want)


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
@pytest.mark.parametrize("promote", PROMOTED)
def test_each_promotion_gives_the_inline_loops_sums(fp8k, promote):
    """Every K-loop variant against the inline loop on ragged rows with empty experts and K, N not
    multiples of 128 (NaN-filled outputs: every element written): the plain GEMM (one weight-block
    scale per column tile, and a tile over two blocks), the SwiGLU GEMM's pre-activations, e4m3 rows
    and scales (F = 72: the up columns straddle blocks; F = 128: one block per tile), the SwiGLU
    gradient's outputs and the weight gradient (into a main gradient)."""
    same = _same_sums(promote)
    counts, k, n = [17, 0, 40, 5], 200, 136
    a, b, offsets = _ragged_inputs(counts, k, n, seed=21, outlier_rows=1)
    qa, sa = fp8k.quantize_rows(a)
    qb, sb = fp8k.quantize_blocks(b)
    rows = a.shape[0]
    for tiles in ROWS_TILES:
        want = fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb, tiles, out_dtype=torch.float32, num_programs=3)
        got = fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb, _promoted(tiles, promote),
                                 out=torch.full((rows, n), float("nan")), num_programs=3)
        assert torch.isfinite(got).all() and same(got, want)

    for ffn in (72, 128):
        x, w13, _ = _ragged_inputs(counts, k, 2 * ffn, seed=ffn)
        qx, sx = fp8k.quantize_rows(x)
        q13, s13 = fp8k.quantize_blocks(w13)
        results = []
        for tiles in (SWIGLU_PROMOTED, _promoted(SWIGLU_PROMOTED, promote)):
            h13 = torch.full((rows, 2 * ffn), float("nan"))
            results.append((*fp8k.fp8_swiglu_gemm(qx, sx, offsets, q13, s13, tiles, h13_M2F=h13, num_programs=3), h13))
        (q_want, s_want, h_want), (q_got, s_got, h_got) = results
        assert torch.isfinite(h_got).all() and same(h_got, h_want) and same(s_got, s_want)
        agree = (q_got.view(torch.uint8) == q_want.view(torch.uint8)).float().mean()
        assert agree == 1 if promote not in ("pipelined", "pingpong") else agree > 0.999

    h13 = torch.randn(rows, 2 * n, generator=torch.Generator().manual_seed(22)) * 3
    w2t = fp8k.transpose_blocks(*fp8k.quantize_blocks(b.transpose(1, 2).contiguous()))
    results = []
    for tiles in (ROWS_TILES[0], _promoted(ROWS_TILES[0], promote)):
        act = torch.full((rows, n), float("nan"))
        results.append((fp8k.fp8_swiglu_grad_gemm(qa, sa, offsets, *w2t, h13, tiles, act_MF=act,
                                                  out_dtype=torch.float32, num_programs=3), act))
    (dh_want, act_want), (dh_got, act_got) = results
    assert torch.isfinite(dh_got).all() and same(dh_got, dh_want) and torch.equal(act_got, act_want)

    dy = torch.randn(rows, 24, generator=torch.Generator().manual_seed(23))
    qx, qd = fp8k.quantize_token_groups(a[:, :40], offsets), fp8k.quantize_token_groups(dy, offsets)
    for tiles in WGRAD_PROMOTED:
        want = fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], tiles, num_programs=3)
        main = torch.randn(want.shape, generator=torch.Generator().manual_seed(24))
        got = main.clone()
        fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], _promoted(tiles, promote), out=got, accumulate=True,
                             num_programs=2)
        assert not got[1].ne(main[1]).any()  # the empty expert's gradient adds zeros
        assert same(got, fp8k.fp8_weight_grad(qx[:2], qd[:2], qx[2], tiles, out=main.clone(), accumulate=True,
                                              num_programs=2))


def test_promotion_refusals_name_the_fix(fp8k):
    a, b, offsets = _ragged_inputs([3, 4], 64, 32, seed=0)
    qa, sa = fp8k.quantize_rows(a)
    qb, sb = fp8k.quantize_blocks(b)
    with pytest.raises(ValueError, match="choose one of inline, hoisted, pipelined, pingpong"):
        fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb, _promoted(SMALL_TILES, "overlapped"))
    with pytest.raises(ValueError, match="block_k >= 64"):
        fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb, TileConfig(block_m=16, block_n=16, block_k=32, promote="pipelined"))
    with pytest.raises(ValueError, match="block_n >= 32"):
        fp8k.fp8_rows_gemm(qa, sa, offsets, qb, sb, TileConfig(block_m=16, block_n=16, block_k=128, promote="pingpong"))
    qx = fp8k.quantize_token_groups(a, offsets)
    with pytest.raises(ValueError, match="block_m >= 64"):
        fp8k.fp8_weight_grad(qx[:2], qx[:2], qx[2], TileConfig(block_m=32, block_n=16, block_k=16, promote="pipelined"))
    with pytest.raises(ValueError, match="block_n >= 32"):
        fp8k.fp8_weight_grad(qx[:2], qx[:2], qx[2], _promoted(WGRAD_TILES, "pingpong"))


# --- on a GPU: real e4m3 tensor cores (sm_89+), bf16 activations, bf16 outputs

def _fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


needs_fp8_gpu = pytest.mark.skipif(not _fp8_gpu(), reason="needs a GPU with FP8 tensor cores (sm_89+)")


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_quantisers_match_reference_to_the_bit():
    """div_rn and the integer rounding give torch's bytes and scales on the GPU as well."""
    from disagmoe.kernels import fp8

    v = _e4m3_probe(seed=1).cuda()
    q, s = fp8.quantize_rows(v)
    assert (s == 1.0).all() and torch.equal(q.view(torch.uint8), v.to(FP8).view(torch.uint8))
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(1000, 2112, generator=gen) * torch.exp2(torch.randn(1000, 1, generator=gen) * 8)).cuda()
    for xd in (x, x.bfloat16()):
        q, s = fp8.quantize_rows(xd)
        q_ref, s_ref = fp8.quantize_rows_reference(xd)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    w = torch.randn(4, 1024, 640, generator=gen).cuda().bfloat16()
    q, s = fp8.quantize_blocks(w)
    q_ref, s_ref = fp8.quantize_blocks_reference(w)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_hardware_rounding_is_the_emulations_over_every_exponent():
    """The compiled quantisers' rounding (the hardware's saturating conversion) against the
    interpreter's integer emulation, both on the GPU: the same e4m3 value for 2^22 fp32 bit
    patterns spread over every exponent and sign (NaN payloads among them: clamped alike), and +-inf."""
    import triton
    import triton.language as tl

    from disagmoe.kernels import fp8

    @triton.jit
    def both(v_ptr, hw_ptr, soft_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        v = tl.load(v_ptr + i, mask=i < n)
        tl.store(hw_ptr + i, fp8._round_to_e4m3(v), mask=i < n)
        tl.store(soft_ptr + i, fp8._round_to_e4m3_emulated(v), mask=i < n)

    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(-2**31, 2**31 - 1, (1 << 22,), generator=gen, dtype=torch.int64).to(torch.int32)
    v = torch.cat([bits.view(torch.float32), torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0])])
    v = v.cuda()
    hw, soft = torch.empty_like(v), torch.empty_like(v)
    both[(triton.cdiv(v.numel(), 1024),)](v, hw, soft, v.numel(), BLOCK=1024)
    assert fp8._HARDWARE_ROUNDING
    assert torch.equal(hw.view(torch.int32), soft.view(torch.int32))


GPU_TILES = [TileConfig(block_m=128, block_n=128, block_k=128, num_warps=8, num_stages=3),
             TileConfig(block_m=64, block_n=64, block_k=64, group_m=4, num_warps=4, num_stages=4)]


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("tiles", GPU_TILES, ids=["128x128x128", "64x64x64"])
@pytest.mark.parametrize("imprecise_k", [None, 32], ids=["per-slice", "per-wgmma"])
@pytest.mark.parametrize("counts,k,n", [([300, 0, 1000, 7], 512, 384),
                                        ([0, 2000, 0, 0], 2048, 256),
                                        ([129, 511, 64, 3, 900], 1000, 320)])
def test_gpu_gemm_bf16_out(counts, k, n, tiles, imprecise_k):
    """Tensor-core FP8 (bf16 activations quantised on the GPU, bf16 out) against the reference's
    fp32 sums of the same fp8 values, and within FP8_ROW_REL_ERR of the fp32 GEMM, outlier rows
    included."""
    from disagmoe.kernels import fp8

    a, b, offsets = _ragged_inputs(counts, k, n, seed=3, outlier_rows=8, device="cuda")
    a, b = a.bfloat16(), b.bfloat16()
    qa, sa = fp8.quantize_rows(a)
    qb, sb = fp8.quantize_blocks(b)
    got = fp8.fp8_rows_gemm(qa, sa, offsets, qb, sb, tiles, imprecise_k=imprecise_k)
    want = fp8.fp8_rows_gemm_reference(qa, sa, offsets, qb, sb)
    assert got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert _rel_err(got, want) < 5e-3  # bf16 output rounding and the tensor cores' accumulator
    assert _row_rel_err(got, _exact(a.float(), b.float(), offsets)).max() < FP8_ROW_REL_ERR


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("counts,k,n", [([300, 0, 1000, 7], 512, 384), ([129, 511, 64, 3, 900], 1000, 320)])
def test_gpu_backward_gemms(counts, k, n):
    """The data gradient (dy against the transposed blocks, bf16 out) and the weight gradient
    (token-group copies, added into an fp32 main gradient) on tensor cores, against the
    references' sums and within FP8_ROW_REL_ERR of the fp32 GEMMs; the token-group quantiser's
    bytes are the reference's."""
    from disagmoe.kernels import fp8

    x, w, offsets = _ragged_inputs(counts, k, n, seed=4, device="cuda")
    x, w = x.bfloat16(), w.bfloat16()
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(5)).cuda().bfloat16()
    q_dy, s_dy = fp8.quantize_rows(dy)
    q_wt, s_wt = fp8.transpose_blocks(*fp8.quantize_blocks(w))
    tiles = GPU_TILES[0]
    dx = fp8.fp8_rows_gemm(q_dy, s_dy, offsets, q_wt, s_wt, tiles)
    assert _rel_err(dx, fp8.fp8_rows_gemm_reference(q_dy, s_dy, offsets, q_wt, s_wt)) < 5e-3
    exact_dx = _per_expert(offsets.cpu(), lambda e, s, t: dy[s:t].double() @ w[e].double().t())
    assert _row_rel_err(dx, exact_dx).max() < FP8_ROW_REL_ERR

    qx, qd = fp8.quantize_token_groups(x, offsets), fp8.quantize_token_groups(dy, offsets)
    ref_x = fp8.quantize_token_groups_reference(x, offsets)
    assert torch.equal(qx[1], ref_x[1]) and torch.equal(qx[0].view(torch.uint8), ref_x[0].view(torch.uint8))
    main = torch.zeros(len(counts), k, n, device="cuda")
    wgrad_tiles = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
    fp8.fp8_weight_grad(qx[:2], qd[:2], qx[2], wgrad_tiles, out=main, accumulate=True)
    assert _rel_err(main, fp8.fp8_weight_grad_reference(qx[:2], qd[:2], qx[2])) < 5e-3  # the tensor cores' accumulator
    starts = [0, *offsets[:-1].tolist()]
    for e, (start, end) in enumerate(zip(starts, offsets.tolist())):
        if end > start:  # per expert: an expert of 3 rows has rows of dW that are sums of 3 products
            exact = x[start:end].double().t() @ dy[start:end].double()
            assert _rel_err(main[e], exact) < FP8_ROW_REL_ERR


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("counted", [False, True], ids=["plain", "counted"])
@pytest.mark.parametrize("counts,k", [([1900, 0, 37, 2100, 129, 5, 1500, 2521], 4096),  # Mixtral's dy: 8192 rows
                                      ([700, 0, 1300, 128, 1, 3, 2000, 1], 2 * 1408 + 72)])
def test_gpu_one_pass_quantises_rows_and_token_groups_as_the_two_quantisers(counts, k, counted):
    """Compiled (the hardware's rounding, 16 warps a [128, 128] tile): `quantize_rows_and_token_groups`
    of bf16 rows in a worst-case buffer (padding rows NaN and inf, valid_rows = offsets_E[-1:]) at
    a realistic size, against `quantize_rows` and `quantize_token_groups`: the same bytes, scales,
    padded offsets and counters; and the token-group copy is the reference's."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels.fp8_stats import GRADIENTS, Fp8Stats

    gen = torch.Generator().manual_seed(k)
    rows, pad = sum(counts), 300
    x = torch.randn(rows + pad, k, generator=gen) * torch.exp2(4 * torch.randn(rows + pad, 1, generator=gen))
    x[rows:] = float("nan")
    x[rows::3] = float("inf")
    x = x.cuda().bfloat16()
    offsets = _offsets(counts).cuda()
    two, one = (Fp8Stats("cuda"), Fp8Stats("cuda")) if counted else (None, None)
    row = lambda stats: None if stats is None else stats.row(GRADIENTS)  # noqa: E731
    (q_MK, s_MG), (q_KP, s_KC, padded_E) = fp8.quantize_rows_and_token_groups(x, offsets, row(one), offsets[-1:])
    q_want, s_want = fp8.quantize_rows(x, row(two), offsets[-1:])
    groups_want = fp8.quantize_token_groups(x, offsets, row(two))
    assert torch.equal(q_MK[:rows].view(torch.uint8), q_want[:rows].view(torch.uint8))
    assert torch.equal(s_MG[:rows], s_want[:rows])
    for got, want in zip((q_KP, s_KC, padded_E), groups_want, strict=True):
        assert torch.equal(_bits(got), _bits(want))
    if counted:
        assert torch.equal(one.buffer, two.buffer)
    # the buffer's padding rows widen the kernels' capacity (padded_capacity of rows + pad) past the
    # reference's (of rows): the reference's columns are equal, the rest zeros at the floor scale
    q_ref, s_ref, _ = fp8.quantize_token_groups_reference(x[:rows], offsets)
    chunks, tokens = s_ref.shape[1], q_ref.shape[1]
    assert torch.equal(s_KC[:, :chunks], s_ref)
    assert torch.equal(q_KP[:, :tokens].view(torch.uint8), q_ref.view(torch.uint8))
    assert (q_KP[:, tokens:].view(torch.uint8) == 0).all()
    floor = torch.tensor(fp8.AMAX_FLOOR, device="cuda") / torch.tensor(fp8.E4M3_MAX, device="cuda")
    assert torch.equal(s_KC[:, chunks:], floor.expand_as(s_KC[:, chunks:]))


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_the_fma_quotient_gives_div_rns_bytes_at_every_magnitude(dtype):
    """Compiled: the token-group quantisers' x / scale (`fp8._quotient`: a reciprocal and an FMA correction)
    against div_rn's (the row quantiser's, of x's padded transpose), and the one pass's rows (the same
    quotient) against `quantize_rows`', byte for byte at every magnitude with an inf and a NaN (`_wild_rows`),
    at a realistic size (several tiles a program)."""
    from disagmoe.kernels import fp8

    x = _wild_rows(20000, 1000, seed=7, device="cuda").to(dtype)
    _assert_token_groups_are_the_row_quantisers(fp8, x, _offsets([4000, 0, 7000, 129, 8871]).cuda())


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("promote", PROMOTED)
def test_gpu_promotions_give_the_inline_loops_sums(promote):
    """On tensor cores, K-major weights as the FFN holds them, `Fp8Tiles`' defaults: each K-loop
    variant's down GEMM, SwiGLU GEMM (pre-activations, fp32) and weight gradient against the inline
    loop's. The same sums in the same order (pipelined: its halves one wgmma chain), so equal up to
    the tensor cores' order within a chain, which may differ by instruction shape (pingpong's
    half-width wgmma): fp32 rounding, far under the FP8 error."""
    from disagmoe.kernels import fp8, fp8_ffn

    counts, hidden, ffn = [300, 0, 1000, 7], 512, 384
    x, w13, offsets = _ragged_inputs(counts, hidden, 2 * ffn, seed=9, outlier_rows=8, device="cuda")
    w2 = (torch.randn(len(counts), ffn, hidden, generator=torch.Generator().manual_seed(10)) / ffn**0.5).cuda()
    weights = fp8_ffn.Fp8ExpertWeights.quantize(w13.bfloat16(), w2.bfloat16())
    qx, sx = fp8.quantize_rows(x.bfloat16())
    q_act, s_act = fp8.quantize_rows(torch.randn(x.shape[0], ffn, device="cuda"))
    tx = fp8.quantize_token_groups(x.bfloat16(), offsets)
    td = fp8.quantize_token_groups(torch.randn(x.shape[0], ffn, device="cuda"), offsets)
    results = []
    for tiles in (fp8_ffn.Fp8Tiles(), fp8_ffn.Fp8Tiles().with_promote(promote)):
        h13 = torch.empty(x.shape[0], 2 * ffn, device="cuda")
        q, s = fp8.fp8_swiglu_gemm(qx, sx, offsets, *weights.w13, tiles.swiglu, h13_M2F=h13)
        y = fp8.fp8_rows_gemm(q_act, s_act, offsets, *weights.w2, tiles.rows, out_dtype=torch.float32)
        dw = fp8.fp8_weight_grad(tx[:2], td[:2], tx[2], tiles.wgrad)
        results.append((h13, s, y, dw))
    for want, got in zip(*results):
        assert _rel_err(got, want) < 1e-6, (promote, _rel_err(got, want))


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("counts,hidden,ffn", [([300, 0, 1000, 7], 512, 384), ([129, 511, 64, 3, 900], 1024, 320)])
def test_gpu_fp8_expert_ffn_forward(counts, hidden, ffn):
    """x quantised, gate/up with the SwiGLU epilogue writing e4m3 rows and scales (and bf16
    pre-activations), then the down GEMM on them: each step against its reference, the whole
    FFN within FP8_FFN_ROW_REL_ERR of fp32."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels.moe_ffn import expert_ffn_reference

    x, w13, offsets = _ragged_inputs(counts, hidden, 2 * ffn, seed=6, outlier_rows=8, device="cuda")
    w2 = (torch.randn(len(counts), ffn, hidden, generator=torch.Generator().manual_seed(7)) / ffn**0.5).cuda()
    x, w13, w2 = x.bfloat16(), w13.bfloat16(), w2.bfloat16()
    qx, sx = fp8.quantize_rows(x)
    q13, s13 = fp8.quantize_blocks(w13)
    h13 = torch.empty(x.shape[0], 2 * ffn, dtype=torch.bfloat16, device="cuda")
    tiles = TileConfig(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=3)
    q_act, s_act = fp8.fp8_swiglu_gemm(qx, sx, offsets, q13, s13, tiles, h13_M2F=h13)
    act_ref, h13_ref = fp8.fp8_swiglu_reference(qx, sx, offsets, q13, s13)
    assert _rel_err(h13, h13_ref) < 5e-3
    s_ref = fp8.quantize_rows_reference(act_ref)[1]
    assert ((s_act - s_ref).abs() <= 1e-2 * s_ref).all()
    assert _rel_err(fp8.dequantize_rows(q_act, s_act), act_ref) < 2.0**-4
    y = fp8.fp8_rows_gemm(q_act, s_act, offsets, *fp8.quantize_blocks(w2), GPU_TILES[0])
    exact = expert_ffn_reference(x.double(), offsets, w13.double(), w2.double())
    assert _row_rel_err(y, exact).max() < FP8_FFN_ROW_REL_ERR


def test_the_swiglu_row_quantiser_is_quantize_rows_of_silu_gate_times_up(fp8k):
    """`quantize_swiglu_rows(h13)`: the bits of `quantize_rows` of act = gate * sigmoid(gate) * up in
    fp32, silu as the fused epilogue computes it (K = 200: a short last group), the rows past
    `valid_rows` left unwritten and uncounted, and the counters those of quantising act itself."""
    from disagmoe.kernels.fp8_stats import FIELDS

    gen = torch.Generator().manual_seed(5)
    h13 = torch.randn(37, 400, generator=gen) * 3
    act = h13[:, :200] * torch.sigmoid(h13[:, :200]) * h13[:, 200:]
    valid = torch.tensor([30], dtype=torch.int32)
    got_row, want_row = torch.zeros(FIELDS, dtype=torch.int64), torch.zeros(FIELDS, dtype=torch.int64)
    q, s = fp8k.quantize_swiglu_rows(h13, got_row, valid)
    q_want, s_want = fp8k.quantize_rows(act, want_row, valid)
    assert q.shape == (37, 200) and s.shape == (37, 2)
    assert torch.equal(q[:30].view(torch.uint8), q_want[:30].view(torch.uint8)) and torch.equal(s[:30], s_want[:30])
    assert torch.equal(got_row, want_row)
    with pytest.raises(ValueError, match="gate and up"):
        fp8k.quantize_swiglu_rows(h13[:, :399])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_quantising_swiglu_gradient_pass_writes_the_two_passes_bytes(fp8k, seed):
    """`swiglu_grad_rows_quantized`: d h13 and act as `grouped_gemm.swiglu_grad_rows` writes them, and
    d h13's e4m3 rows and scales as `quantize_rows(d h13, valid_rows=offsets[-1:])` makes them from
    what it reads back, byte for byte, bf16 and fp32 operands, random ragged counts with empty
    experts, rows past the last offset (a worst-case buffer's) left unwritten in all four outputs,
    d act values spread over 2^-40..2^40 (underflowing and scale-setting groups); a width off the
    128 grid is refused with the way round it."""
    from disagmoe.kernels import grouped_gemm as gg

    gen = torch.Generator().manual_seed(80 + seed)
    counts = [int(c) for c in torch.randint(0, 30, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen)]
    counts[int(torch.randint(0, len(counts), (1,), generator=gen))] = 0
    width = 128 * int(torch.randint(1, 4, (1,), generator=gen))
    rows = sum(counts) + 7  # padding rows past the last offset
    offsets = _offsets(counts)
    for dtype in (torch.float32, torch.bfloat16):
        d_act = (torch.randn(rows, width, generator=gen) * torch.exp2(torch.randint(-40, 40, (rows, 1), generator=gen)))
        h13 = torch.randn(rows, 2 * width, generator=gen) * 3
        d_act, h13 = d_act.to(dtype), h13.to(dtype)
        act_want, act_got = torch.full((rows, width), 7.0, dtype=dtype), torch.full((rows, width), 7.0, dtype=dtype)
        dh13_want = gg.swiglu_grad_rows(d_act, h13, offsets, out=torch.full((rows, 2 * width), 7.0, dtype=dtype),
                                        act_N_C=act_want)
        q_want, s_want = fp8k.quantize_rows(dh13_want, valid_rows=offsets[-1:])
        dh13_got, (q_got, s_got) = fp8k.swiglu_grad_rows_quantized(d_act, h13, offsets, act_N_C=act_got)
        served = int(offsets[-1])
        assert torch.equal(dh13_got[:served], dh13_want[:served]) and torch.equal(act_got, act_want)
        assert (act_got[served:] == 7.0).all()  # unwritten past the last offset
        assert torch.equal(q_got[:served].view(torch.uint8), q_want[:served].view(torch.uint8))
        assert torch.equal(s_got[:served], s_want[:served])
        assert q_got.shape == q_want.shape and s_got.shape == s_want.shape and q_got.dtype == fp8k.FP8
    with pytest.raises(ValueError, match="multiple of 128.*swiglu_grad_rows and quantize_rows"):
        fp8k.swiglu_grad_rows_quantized(torch.zeros(4, 72), torch.zeros(4, 144), _offsets([4]),
                                        act_N_C=torch.zeros(4, 72))
    assert fp8k.swiglu_grad_quantizes(torch.zeros(4, 256)) and not fp8k.swiglu_grad_quantizes(torch.zeros(4, 72))
    with pytest.raises(ValueError, match="offsets_E must be an int32 tensor"):
        fp8k.swiglu_grad_rows_quantized(torch.zeros(4, 128), torch.zeros(4, 256), _offsets([4]).long(),
                                        act_N_C=torch.zeros(4, 128))
    over = _offsets([3, 9])  # a last offset past the buffer's 6 rows: the rows stop at the buffer
    dh13, (q, s) = fp8k.swiglu_grad_rows_quantized(torch.ones(6, 128), torch.ones(6, 256), over,
                                                   act_N_C=torch.zeros(6, 128))
    want_dh13 = gg.swiglu_grad_rows(torch.ones(6, 128), torch.ones(6, 256), _offsets([6]))
    assert torch.equal(dh13, want_dh13) and torch.equal(s, fp8k.quantize_rows(want_dh13)[1])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_quantising_swiglu_epilogue_writes_quantize_rows_bytes_of_its_act(fp8k, seed):
    """`grouped_gemm.ragged_rows_gemm(..., EPILOGUE_SWIGLU, quantized_out=(q, s))` (the default FP8 recipe's
    bf16 gate/up GEMM writing the FP8 down GEMM's A operand): the e4m3 values and 1 x 128 scales
    `quantize_rows` makes of the act the plain epilogue writes, byte for byte, h13 as the plain launch
    saves it, random ragged counts with an empty expert, a short last scale group (C off the 128 grid), rows
    past the last offset unwritten, fp32 and bf16 (the act rounded to it first); tiles whose columns are not one
    scale group, a given `out` or `act_N_C`, refused."""
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.tile_configs import TileConfig

    gen = torch.Generator().manual_seed(90 + seed)
    counts = [int(c) for c in torch.randint(0, 40, (int(torch.randint(2, 5, (1,), generator=gen)),), generator=gen)]
    counts[int(torch.randint(0, len(counts), (1,), generator=gen))] = 0
    experts, hidden = len(counts), 64
    cols = (128, 200, 256)[seed]
    rows = sum(counts) + 5  # padding rows past the last offset
    offsets = _offsets(counts)
    tile = TileConfig(block_m=16, block_n=128, block_k=32, group_m=2, num_warps=4, num_stages=1)
    x = torch.randn(rows, hidden, generator=gen) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=gen))
    w13 = torch.randn(experts, hidden, 2 * cols, generator=gen) / hidden**0.5
    for dtype in (torch.float32, torch.bfloat16):  # bf16: the act rounded to it before its quantisation
        x, w13 = x.to(dtype), w13.to(dtype)
        h13_want, h13_got = (torch.full((rows, 2 * cols), 7.0, dtype=dtype) for _ in range(2))
        act = gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13_want,
                                  num_programs=3)
        q_want, s_want = fp8k.quantize_rows(act, valid_rows=offsets[-1:])
        # and with the pre-activations stored by TMA (`TileConfig.tma_store`: whole tiles; C off the tile: masked)
        for launch_tile in (tile, dataclasses.replace(tile, tma=True, tma_store=True)):
            h13_got = torch.full((rows, 2 * cols), 7.0, dtype=dtype)
            q = torch.full((rows, cols), 3.0).to(fp8k.FP8)
            s = torch.full((rows, -(-cols // 128)), 7.0)
            got = gg.ragged_rows_gemm(x, offsets, w13, launch_tile, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13_got,
                                      num_programs=3, quantized_out=(q, s))
            served = int(offsets[-1])
            assert act.dtype == dtype and got is q and torch.equal(h13_got, h13_want)
            assert torch.equal(q[:served].view(torch.uint8), q_want[:served].view(torch.uint8))
            assert torch.equal(s[:served], s_want[:served])
            assert (s[served:] == 7.0).all() and (q[served:].float() == 3.0).all()  # unwritten past the last offset
        stored = gg.rows_store_descriptors(None, h13_got, cols, dataclasses.replace(tile, tma_store=True))
        assert (stored is None) == (cols % 128 != 0) and (stored is None or stored[0] is None)
    assert gg.swiglu_quantizes(tile) and not gg.swiglu_quantizes(TileConfig(block_m=16, block_n=64, block_k=32))
    with pytest.raises(ValueError, match="128-column tiles"):
        gg.ragged_rows_gemm(x, offsets, w13, TileConfig(block_m=16, block_n=64, block_k=32), quantized_out=(q, s),
                            epilogue=gg.EPILOGUE_SWIGLU)
    with pytest.raises(ValueError, match=r"q \[N, C\]"):
        gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, quantized_out=(q[:, :64], s))
    with pytest.raises(ValueError, match="without `out` or `act_N_C`"):
        gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, quantized_out=(q, s),
                            act_N_C=torch.zeros(rows, cols, dtype=x.dtype))


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_the_quantising_swiglu_gradient_pass_writes_the_two_passes_bytes():
    """`swiglu_grad_rows_quantized` on the GPU, bf16 at the Qwen3 FFN size (768) and 128, ragged rows
    with padding past the last offset: d h13, act, the e4m3 rows and scales the very bytes of
    `grouped_gemm.swiglu_grad_rows` then `quantize_rows` (the hardware's conversion in both)."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels import grouped_gemm as gg

    gen = torch.Generator().manual_seed(5)
    for width in (768, 128):
        offsets = _offsets([700, 0, 1301, 33]).cuda()
        rows = int(offsets[-1]) + 64
        d_act = (torch.randn(rows, width, generator=gen) * torch.exp2(torch.randint(-30, 30, (rows, 1),
                                                                                    generator=gen))).cuda().bfloat16()
        h13 = (torch.randn(rows, 2 * width, generator=gen) * 3).cuda().bfloat16()
        act_want, act_got = d_act.new_zeros(rows, width), d_act.new_zeros(rows, width)
        dh13_want = gg.swiglu_grad_rows(d_act, h13, offsets, act_N_C=act_want)
        q_want, s_want = fp8.quantize_rows(dh13_want, valid_rows=offsets[-1:])
        dh13_got, (q_got, s_got) = fp8.swiglu_grad_rows_quantized(d_act, h13, offsets, act_N_C=act_got)
        torch.cuda.synchronize()
        n = int(offsets[-1])
        assert torch.equal(dh13_got[:n], dh13_want[:n]) and torch.equal(act_got, act_want)
        assert torch.equal(q_got[:n].view(torch.uint8), q_want[:n].view(torch.uint8))
        assert torch.equal(s_got[:n], s_want[:n])


@pytest.mark.gpu
@needs_fp8_gpu
def test_gpu_the_quantising_swiglu_epilogue_writes_quantize_rows_bytes_of_its_act():
    """`ragged_rows_gemm(..., EPILOGUE_SWIGLU, quantized_out=)` on the GPU, bf16, at the tiles the FFN picks
    for the Qwen3 and Mixtral gate/up shapes (and the heuristic's), ragged rows with an empty expert and
    padding past the last offset: the e4m3 act and scales the very bytes of the plain launch's bf16 act
    through `quantize_rows` (the hardware's conversion in both), h13 the same; with the pre-activations stored by
    TMA (`tma_store`) too."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.moe_ffn import FFNTiles
    from disagmoe.kernels.tile_configs import heuristic

    gen = torch.Generator().manual_seed(6)
    for hidden, ffn in ((2048, 768), (4096, 1536), (1024, 200)):
        offsets = _offsets([700, 0, 1301, 33]).cuda()
        rows, experts = int(offsets[-1]) + 64, 4
        x = (torch.randn(rows, hidden, generator=gen) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=gen)))
        x = x.cuda().bfloat16()
        w13 = (torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5).cuda().bfloat16()
        heuristic_stored = dataclasses.replace(heuristic("gate_up"), tma=True, tma_store=True)  # h13 by TMA
        for tile in (FFNTiles.for_shape(rows, experts, hidden, ffn, x.device, x.dtype).gate_up, heuristic("gate_up"),
                     heuristic_stored):
            if not gg.swiglu_quantizes(tile):
                continue
            h13_want, h13_got = x.new_zeros(rows, 2 * ffn), x.new_zeros(rows, 2 * ffn)
            act = gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13_want)
            q_want, s_want = fp8.quantize_rows(act, valid_rows=offsets[-1:])
            q = torch.empty((rows, ffn), dtype=fp8.FP8, device=x.device)
            s = torch.empty((rows, -(-ffn // 128)), dtype=torch.float32, device=x.device)
            gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13_got,
                                quantized_out=(q, s))
            torch.cuda.synchronize()
            n = int(offsets[-1])
            assert torch.equal(h13_got[:n], h13_want[:n]), tile
            assert torch.equal(q[:n].view(torch.uint8), q_want[:n].view(torch.uint8)), tile
            assert torch.equal(s[:n], s_want[:n]), tile
