"""The FP8 kernels' scale mapping on operands whose rows, 128-column groups and 128 x 128 weight
blocks differ in magnitude by orders of magnitude (each row x 10^U(-3, 3), each (row, group)
another 10^U(-2, 2), each weight block 10^U(-2, 2)), ragged expert counts with empty experts:
every kernel against a torch fake-quant reference written here (each 1 x 128 group or 128 x 128
block quantised to e4m3 with its own scale amax / 448 and dequantised, then an fp64 matmul), to
1e-5 per row (fp32 accumulation order only). On randn operands every group's amax is about the
same, so a scale read from the wrong row, group, block or expert stays within the 6e-2 bounds
against unquantised fp32 the other tests use; here it misses by orders of magnitude
(`_assert_discriminates` checks that the inputs make it so). Covered: the quantising permute
into the gate/up GEMM, `quantize_rows` into the row GEMM on a worst-case buffer, dy's 1 x 128
rows into the down GEMM's data gradient and d h13's into the gate/up one (the forward's blocks
laid out transposed, `Fp8ExpertWeights`), and the "gate-up" forward end to end. The same
checks run compiled on a Hopper GPU, where the row GEMMs are the Gluon kernel's."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
GROUP = 128
# the kernels against the fake-quant reference, per row: fp32 rounding of equal terms
FAKE_QUANT_ROW_REL_ERR = 1e-5
# on a GPU the tensor cores accumulate one 128-deep slice's fp8 products in a narrower sum than fp32
GPU_FAKE_QUANT_ROW_REL_ERR = 2e-3
# a scale from the wrong row, group or block must move some row by more than this on these inputs
WRONG_SCALE_ROW_REL_ERR = 0.1

ROWS = TileConfig(block_m=16, block_n=32, block_k=128, group_m=2, num_warps=4, num_stages=1)
SWIGLU = TileConfig(block_m=16, block_n=128, block_k=128, group_m=2, num_warps=4, num_stages=1)
TILES = dict(rows=ROWS, swiglu=SWIGLU,
             wgrad=TileConfig(block_m=128, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1))


def _cdiv(a, b):
    return -(-a // b)


def _log_uniform(shape, low, high, gen):
    return 10.0 ** (torch.rand(shape, generator=gen, dtype=torch.float64) * (high - low) + low)


def _wild_rows(rows, k, gen):
    """[rows, k] fp32: randn x 10^U(-3, 3) per row x 10^U(-2, 2) per (row, 128-column group)."""
    groups = _log_uniform((rows, _cdiv(k, GROUP)), -2, 2, gen).repeat_interleave(GROUP, 1)[:, :k]
    return (torch.randn(rows, k, generator=gen, dtype=torch.float64) * _log_uniform((rows, 1), -3, 3, gen)
            * groups).float()


def _wild_weights(experts, k, n, gen):
    """[E, K, N] fp32: randn / sqrt(K) x 10^U(-2, 2) per 128 x 128 block."""
    blocks = _log_uniform((experts, _cdiv(k, GROUP), _cdiv(n, GROUP)), -2, 2, gen)
    blocks = blocks.repeat_interleave(GROUP, 1).repeat_interleave(GROUP, 2)[:, :k, :n]
    return (torch.randn(experts, k, n, generator=gen, dtype=torch.float64) / k**0.5 * blocks).float()


def _fake_quant(x_f32, amax):
    """x dequantised from e4m3 at scale max(amax, 1e-30) / 448 (amax broadcast to x), fp64."""
    scale = amax.float().clamp_min(1e-30) / torch.full((), E4M3_MAX)
    return ((x_f32 / scale).clamp(-E4M3_MAX, E4M3_MAX).to(FP8).double() * scale.double())


def _fake_rows(x_MK):
    """1 x 128 groups along K, each quantised with its own amax."""
    rows, k = x_MK.shape
    x = torch.nn.functional.pad(x_MK.float().cpu(), (0, -k % GROUP)).reshape(rows, -1, GROUP)
    return _fake_quant(x, x.abs().amax(dim=2, keepdim=True)).reshape(rows, -1)[:, :k]


def _fake_blocks(w_EKN):
    """128 x 128 blocks of each expert's [K, N], each quantised with its own amax."""
    experts, k, n = w_EKN.shape
    w = torch.nn.functional.pad(w_EKN.float().cpu(), (0, -n % GROUP, 0, -k % GROUP))
    w = w.reshape(experts, w.shape[1] // GROUP, GROUP, w.shape[2] // GROUP, GROUP)
    return _fake_quant(w, w.abs().amax(dim=(2, 4), keepdim=True)).reshape(experts, w.shape[1] * GROUP, -1)[:, :k, :n]


def _grouped(a_MK, offsets, b_EKN):
    """Per row group g (cumulative `offsets`), a's rows @ b[g mod E], fp64 on the CPU (rows past
    the last group zero; computed on a GPU where there is one, for the large cases' speed)."""
    where = "cuda" if torch.cuda.is_available() else "cpu"
    a, b = a_MK.double().to(where), b_EKN.double().to(where)
    out = torch.zeros((a_MK.shape[0], b_EKN.shape[2]), dtype=torch.float64, device=where)
    ends = offsets.tolist()
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        out[start:end] = a[start:end] @ b[g % b.shape[0]]
    return out.cpu()


def _row_rel_err(got, want):
    """Worst |got_row - want_row| / |want_row| over the rows with a nonzero reference."""
    got, want = got.double().cpu(), want.double().cpu()
    keep = want.norm(dim=1) > 0
    return ((got - want).norm(dim=1)[keep] / want.norm(dim=1)[keep]).max().item()


def _assert_discriminates(a_MK, offsets, w_EKN):
    """The inputs tell the scales apart: the fake-quant product with each row's groups quantised
    at a neighbouring row's (or group's) scale, or each weight block at another block's, misses
    the right one by more than WRONG_SCALE_ROW_REL_ERR in some row (so the 1e-5 checks below
    would catch a kernel that read them)."""
    right = _grouped(_fake_rows(a_MK), offsets, _fake_blocks(w_EKN))
    x = a_MK.float().cpu()
    rows, k = x.shape
    x_MGS = torch.nn.functional.pad(x, (0, -k % GROUP)).reshape(rows, -1, GROUP)
    amax = x_MGS.abs().amax(dim=2, keepdim=True)
    wrong = []
    for moved in (amax.roll(1, 0), amax.roll(1, 1)):  # the next row's scale, the next group's
        wrong.append(_grouped(_fake_quant(x_MGS, moved).reshape(rows, -1)[:, :k], offsets, _fake_blocks(w_EKN)))
    w = w_EKN.float().cpu()
    experts, kw, n = w.shape
    w_b = torch.nn.functional.pad(w, (0, -n % GROUP, 0, -kw % GROUP))
    w_b = w_b.reshape(experts, w_b.shape[1] // GROUP, GROUP, w_b.shape[2] // GROUP, GROUP)
    w_amax = w_b.abs().amax(dim=(2, 4), keepdim=True)
    # another block's scale: the next one along K, else along N, else the next expert's
    moved = w_amax.roll(1, 1 if w_amax.shape[1] > 1 else 3 if w_amax.shape[3] > 1 else 0)
    fake_w = _fake_quant(w_b, moved).reshape(experts, w_b.shape[1] * GROUP, -1)[:, :kw, :n]
    wrong.append(_grouped(_fake_rows(a_MK), offsets, fake_w))
    for w_out in wrong:
        assert _row_rel_err(w_out, right) > WRONG_SCALE_ROW_REL_ERR


def _offsets(counts, device="cpu"):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _routing(tokens, top_k, experts, empty, gen):
    """topk ids [T, K]: each token's K distinct experts, none of them in `empty`."""
    allowed = torch.tensor([e for e in range(experts) if e not in empty])
    picks = torch.stack([torch.randperm(len(allowed), generator=gen)[:top_k] for _ in range(tokens)])
    return allowed[picks]


def _tiles(ffn8, device):
    """The small tiles in the interpreter, the FFN's defaults compiled."""
    return ffn8.Fp8Tiles(**TILES) if device == "cpu" else ffn8.Fp8Tiles()


def _programs(device):
    """A forced program count in the interpreter (the stride loops), none compiled (so Hopper takes
    the Gluon row GEMM, `fp8_ffn._gluon_rows_take`)."""
    return 3 if device == "cpu" else None


# --- the checks, each on a module set (interpreted on the CPU, compiled on a GPU)

def _check_permute_into_gate_up(fp8, permute, ffn8, device, tol, *, tokens, top_k, experts, empty, hidden, ffn,
                                swiglu=True):
    """The quantising permute's e4m3 rows and scales (each grouped row's scales its own token's)
    into the gate/up GEMM: rows and scales dequantise to the fake-quant rows of x[token] exactly;
    the plain row GEMM (the trainer's "gate-up" forward) and, with `swiglu`, the fused SwiGLU GEMM's
    pre-activations, against the fake-quant product."""
    gen = torch.Generator().manual_seed(hidden + ffn)
    x_TH = _wild_rows(tokens, hidden, gen)
    w13 = _wild_weights(experts, hidden, 2 * ffn, gen)
    idx = _routing(tokens, top_k, experts, empty, gen)
    offsets, dest = permute.pair_destinations(idx.to(device), experts)
    q_NH, s_NG = permute.quantize_then_permute(x_TH.to(device), dest)
    offsets, dest = offsets.cpu(), dest.cpu()
    assert offsets.diff(prepend=offsets.new_zeros(1))[list(empty)].eq(0).all()
    token_N = torch.empty(tokens * top_k, dtype=torch.int64)
    token_N[dest.reshape(-1).long()] = torch.arange(tokens).repeat_interleave(top_k)
    x_NH = x_TH[token_N]  # the grouped rows, row n from token token_N[n]
    deq = q_NH.cpu().double() * s_NG.cpu().double().repeat_interleave(GROUP, 1)[:, :hidden]
    assert torch.equal(deq, _fake_rows(x_NH))
    _assert_discriminates(x_NH, offsets, w13)
    weights = ffn8.Fp8ExpertWeights.quantize(w13.to(device), torch.zeros(experts, ffn, hidden, device=device))
    want = _grouped(_fake_rows(x_NH), offsets, _fake_blocks(w13))
    tiles = _tiles(ffn8, device)
    h13 = ffn8._rows_gemm(q_NH, s_NG, offsets.to(device), *weights.w13, tiles.rows, out_dtype=torch.float32,
                          num_programs=_programs(device), gluon=True)
    assert _row_rel_err(h13, want) < tol
    if swiglu:
        h13_fused = torch.full((tokens * top_k, 2 * ffn), float("nan"), device=device)
        fp8.fp8_swiglu_gemm(q_NH, s_NG, offsets.to(device), *weights.w13, tiles.swiglu, h13_M2F=h13_fused,
                            num_programs=_programs(device))
        assert _row_rel_err(h13_fused, want) < tol


def _check_rows_on_a_padded_buffer(fp8, ffn8, device, tol, *, counts, hidden, out_cols, pad, promote="inline"):
    """`quantize_rows` of a worst-case buffer (rows past offsets[-1] NaN and inf, valid_rows as the
    FFN passes it) into the row GEMM, its K loop promoted as `promote` says (`fp8.PROMOTE_VARIANTS`:
    "hoisted" reads one weight-block scale per column tile), against both layouts of the weights
    (`Fp8ExpertWeights`: the forward's [E, K, N] and the data gradient's transposed blocks)."""
    gen = torch.Generator().manual_seed(sum(counts) + hidden)
    rows = sum(counts)
    x = _wild_rows(rows, hidden, gen)
    garbage = torch.full((pad, hidden), float("nan"))
    garbage[::2] = float("inf")
    offsets = _offsets(counts)
    q, s = fp8.quantize_rows(torch.cat([x, garbage]).to(device), None, offsets[-1:].to(device))
    deq = q[:rows].cpu().double() * s[:rows].cpu().double().repeat_interleave(GROUP, 1)[:, :hidden]
    assert torch.equal(deq, _fake_rows(x))
    w_fwd = _wild_weights(len(counts), hidden, out_cols, gen)  # [E, K, N]: the forward's operand
    w_dgrad = _wild_weights(len(counts), out_cols, hidden, gen)  # its transpose is the dgrad's [E, K, N]
    weights = ffn8.Fp8ExpertWeights.quantize(w_fwd.to(device), w_dgrad.to(device))
    for (qb, sb), w_EKN in ((weights.w13, w_fwd), (weights.w2_t, w_dgrad.transpose(1, 2))):
        _assert_discriminates(x, offsets, w_EKN)
        tiles = _tiles(ffn8, device).with_promote(promote)
        got = ffn8._rows_gemm(q, s, offsets.to(device), qb, sb, tiles.rows, out_dtype=torch.float32,
                              num_programs=_programs(device), gluon=True)
        # the data gradient's blocks are the forward's transposed: fake-quant blocks of w, then transposed
        fake_w = _fake_blocks(w_EKN) if w_EKN is w_fwd else _fake_blocks(w_dgrad).transpose(1, 2)
        assert _row_rel_err(got[:rows], _grouped(_fake_rows(x), offsets, fake_w)) < tol


def _check_backward_data_gradients(fp8, ffn8, device, tol, *, counts, hidden, ffn):
    """The FFN's data gradients as its backward launches them: dy quantised 1 x 128 along H by the
    one-pass quantiser (the "fp8" backward) and by `quantize_rows` (the default "bf16-wgrad"), the
    down GEMM's data gradient against w2's transposed blocks with the SwiGLU derivative (fused, or
    the Gluon row GEMM and the split epilogue on a GPU: `fp8_ffn._down_data_gradient`), then d h13
    quantised and its data gradient against w13's transposed blocks, each stage against the
    fake-quant reference of its own input."""
    gen = torch.Generator().manual_seed(hidden + 3 * ffn)
    rows = sum(counts)
    offsets = _offsets(counts)
    served = offsets[-1:].to(device)
    dy = _wild_rows(rows, hidden, gen)
    h13 = (torch.randn(rows, 2 * ffn, generator=gen) * 3).to(device)
    w13, w2 = _wild_weights(len(counts), hidden, 2 * ffn, gen), _wild_weights(len(counts), ffn, hidden, gen)
    _assert_discriminates(dy, offsets, w2.transpose(1, 2))
    weights = ffn8.Fp8ExpertWeights.quantize(w13.to(device), w2.to(device))
    fake_dy = _fake_rows(dy)
    (q1, s1), _ = fp8.quantize_rows_and_token_groups(dy.to(device), offsets.to(device), None, served)
    q2, s2 = fp8.quantize_rows(dy.to(device), None, served)
    for q, s in ((q1, s1), (q2, s2)):
        assert torch.equal(q.cpu().double() * s.cpu().double().repeat_interleave(GROUP, 1)[:, :hidden], fake_dy)
    d_act = _grouped(fake_dy, offsets, _fake_blocks(w2).transpose(1, 2))
    gate, up = h13.cpu().double().chunk(2, dim=1)
    sig = torch.sigmoid(gate)
    want_dh13 = torch.cat([d_act * up * sig * (1 + gate * (1 - sig)), d_act * gate * sig], dim=1)
    act = torch.empty(rows, ffn, device=device)
    tiles = _tiles(ffn8, device)
    dh13, _ = ffn8._down_data_gradient(q1, s1, offsets.to(device), weights.w2_t, tiles.swiglu, h13, act,
                                       torch.float32, num_programs=_programs(device), split=True)
    assert _row_rel_err(dh13, want_dh13) < tol
    q_dh, s_dh = fp8.quantize_rows(dh13, None, served)
    assert torch.equal(q_dh.cpu().double() * s_dh.cpu().double().repeat_interleave(GROUP, 1)[:, :2 * ffn],
                       _fake_rows(dh13))
    _assert_discriminates(dh13.cpu(), offsets, w13.transpose(1, 2))
    dx = ffn8._rows_gemm(q_dh, s_dh, offsets.to(device), *weights.w13_t, tiles.rows, out_dtype=torch.float32,
                         num_programs=_programs(device), gluon=True)
    assert _row_rel_err(dx, _grouped(_fake_rows(dh13), offsets, _fake_blocks(w13).transpose(1, 2))) < tol


def _check_gate_up_forward(ffn8, device, tol, *, counts, hidden, ffn):
    """`expert_ffn_fp8(..., forward="gate-up")` as the trainer calls it: y = silu(gate) * up of the
    fake-quant gate/up product, times the unquantised w2; the saved h13 that fake-quant product."""
    gen = torch.Generator().manual_seed(hidden + 5 * ffn)
    rows = sum(counts)
    offsets = _offsets(counts)
    x = _wild_rows(rows, hidden, gen)
    w13, w2 = _wild_weights(len(counts), hidden, 2 * ffn, gen), _wild_weights(len(counts), ffn, hidden, gen)
    _assert_discriminates(x, offsets, w13)
    weights = ffn8.Fp8ExpertWeights.quantize(w13.to(device), w2.to(device))
    h13_want = _grouped(_fake_rows(x), offsets, _fake_blocks(w13))
    gate, up = h13_want.chunk(2, dim=1)
    y_want = _grouped(torch.nn.functional.silu(gate) * up, offsets, w2.double())
    y, h13 = ffn8.fp8_ffn_forward(x.to(device), offsets.to(device), weights, _tiles(ffn8, device),
                                  save_for_backward=True, forward="gate-up",
                                  bf16_weights=(w13.to(device), w2.to(device)), num_programs=_programs(device))
    assert _row_rel_err(h13, h13_want) < tol
    assert _row_rel_err(y, y_want) < tol
    y_autograd = ffn8.expert_ffn_fp8(x.to(device), offsets.to(device), w13.to(device), w2.to(device),
                                     weights=weights, tiles=_tiles(ffn8, device), backward="bf16",
                                     forward="gate-up", num_programs=_programs(device))
    assert torch.equal(y_autograd, y)


# --- CPU: the interpreter (e4m3 values exact, fp32 accumulation)

@pytest.fixture
def mods(interpreted):
    _, fp8, permute, ffn8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                        "disagmoe.kernels.permute", "disagmoe.kernels.fp8_ffn")
    return fp8, permute, ffn8


@pytest.mark.slow  # about 6 s in the interpreter on 2 cores
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # the interpreter's sigmoid of a large -x: 0
def test_permute_fp8_into_the_gate_up_gemm(mods):
    fp8, permute, ffn8 = mods
    _check_permute_into_gate_up(fp8, permute, ffn8, "cpu", FAKE_QUANT_ROW_REL_ERR, tokens=20, top_k=3, experts=6,
                                empty=(1, 4), hidden=384, ffn=128)


@pytest.mark.slow  # about 7 s each in the interpreter on 2 cores
@pytest.mark.parametrize("promote", ["inline", "hoisted"])
def test_quantize_rows_into_the_row_gemm_on_a_padded_buffer(mods, promote):
    fp8, _, ffn8 = mods
    _check_rows_on_a_padded_buffer(fp8, ffn8, "cpu", FAKE_QUANT_ROW_REL_ERR, counts=[9, 0, 23, 0, 2], hidden=320,
                                   out_cols=256, pad=5, promote=promote)


def test_dy_and_dh13_rows_into_the_data_gradients(mods):
    fp8, _, ffn8 = mods
    _check_backward_data_gradients(fp8, ffn8, "cpu", FAKE_QUANT_ROW_REL_ERR, counts=[7, 0, 19, 3], hidden=256,
                                   ffn=128)


def test_the_gate_up_forward_end_to_end(mods):
    _, _, ffn8 = mods
    _check_gate_up_forward(ffn8, "cpu", FAKE_QUANT_ROW_REL_ERR, counts=[5, 0, 17, 0, 4], hidden=256, ffn=128)


# --- GPU: compiled kernels, hardware rounding, the Gluon row GEMM on Hopper (K and N multiples of 128)

needs_fp8_gpu = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs a GPU with FP8 (sm_89+)")


def _gpu_mods():
    from disagmoe.kernels import fp8, fp8_ffn, permute

    return fp8, permute, fp8_ffn


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("tokens,top_k,experts,hidden,ffn", [(512, 8, 128, 2048, 768), (300, 2, 8, 384, 128)])
def test_gpu_permute_fp8_into_the_gate_up_gemm(tokens, top_k, experts, hidden, ffn):
    fp8, permute, ffn8 = _gpu_mods()
    _check_permute_into_gate_up(fp8, permute, ffn8, "cuda", GPU_FAKE_QUANT_ROW_REL_ERR, tokens=tokens, top_k=top_k,
                                experts=experts, empty=(1, 4, experts - 1), hidden=hidden, ffn=ffn)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("counts,hidden,out_cols", [([300, 0, 1000, 7, 129, 0], 2048, 1536),
                                                    ([9, 0, 23, 0, 2], 320, 256)])
def test_gpu_quantize_rows_into_the_row_gemm_on_a_padded_buffer(counts, hidden, out_cols):
    fp8, _, ffn8 = _gpu_mods()
    _check_rows_on_a_padded_buffer(fp8, ffn8, "cuda", GPU_FAKE_QUANT_ROW_REL_ERR, counts=counts, hidden=hidden,
                                   out_cols=out_cols, pad=40)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("counts,hidden,ffn", [([300, 0, 1000, 7, 129, 0], 2048, 768), ([7, 0, 19, 3], 256, 128)])
def test_gpu_dy_and_dh13_rows_into_the_data_gradients(counts, hidden, ffn):
    fp8, _, ffn8 = _gpu_mods()
    _check_backward_data_gradients(fp8, ffn8, "cuda", GPU_FAKE_QUANT_ROW_REL_ERR, counts=counts, hidden=hidden,
                                   ffn=ffn)


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("counts,hidden,ffn", [([300, 0, 1000, 7, 129, 0], 2048, 768), ([5, 0, 17, 0, 4], 256, 128)])
def test_gpu_the_gate_up_forward_end_to_end(counts, hidden, ffn):
    _, _, ffn8 = _gpu_mods()
    _check_gate_up_forward(ffn8, "cuda", GPU_FAKE_QUANT_ROW_REL_ERR, counts=counts, hidden=hidden, ffn=ffn)
