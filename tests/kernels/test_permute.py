"""Token permutation and weighted combine vs the torch references (interpreter fp32, GPU bf16)."""

from __future__ import annotations

import pytest
import torch

# (tokens, k, experts, hidden): empty experts, one expert taking every pair, sizes that are not
# multiples of the blocks, more experts than fit one power of two below.
CASES = [(37, 2, 8, 40), (20, 4, 3, 24), (130, 1, 5, 300), (9, 3, 70, 16)]


def _routing(tokens, top_k, experts, hidden, seed, device="cpu", dtype=torch.float32,
             one_expert=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    idx = torch.randint(0, max(1, experts // 2), (tokens, top_k), generator=gen)  # upper half empty
    if one_expert:
        idx.fill_(experts - 1)
    weights = torch.rand(tokens, top_k, generator=gen)
    return x.to(device, dtype), idx.to(device), weights.to(device)


@pytest.fixture
def permute(interpreted):
    return interpreted("disagmoe.kernels.permute")


@pytest.mark.parametrize("case", range(len(CASES)))
def test_permute_matches_stable_sort(permute, case):
    tokens, top_k, experts, hidden = CASES[case]
    x, idx, _ = _routing(*CASES[case], seed=case, one_expert=case == 1)
    rows, offsets, dest = permute.permute_forward(x, idx, experts)
    want_rows, want_offsets, want_dest = permute.permute_reference(x, idx, experts)
    assert torch.equal(offsets, want_offsets)
    assert torch.equal(dest, want_dest)
    assert torch.equal(rows, want_rows)


@pytest.mark.parametrize("residual", [False, True], ids=["sum", "residual-plus-sum"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_permute_and_combine_backward_match_reference(permute, case, residual):
    """The permute and the weighted combine, forward and backward; with a residual stream added in the
    combine's pass (`residual_TH`: the block's h + FFN), its gradient dy itself."""
    tokens, top_k, experts, hidden = CASES[case]
    x, idx, weights = _routing(*CASES[case], seed=20 + case)
    gen = torch.Generator().manual_seed(case)
    dy = torch.randn(tokens, hidden, generator=gen)
    h = torch.randn(tokens, hidden, generator=gen)
    results = []
    for permute_fn, combine_fn in ((permute.permute_tokens, permute.combine_rows),
                                   (permute.permute_reference, permute.combine_reference)):
        x_leaf, w_leaf, h_leaf = (t.clone().requires_grad_() for t in (x, weights, h))
        rows, _, dest = permute_fn(x_leaf, idx, experts)
        rows = rows * 2.0  # a stand-in for the experts, so d rows differs from d y
        y = combine_fn(rows, dest, w_leaf, **({"residual_TH": h_leaf} if residual else {}))
        y.backward(dy)
        results.append((y.detach(), x_leaf.grad, w_leaf.grad, h_leaf.grad if residual else dy))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(results[0][3], dy)


def _check_weighted_rows(permute, case: int, device: str, dtype: torch.dtype) -> None:
    """copy_rows with weights (the fused experts' backward rows dy[t] w[t, k]): every row the fp32
    product of its token's row and its pair's weight rounded to the rows' dtype, as torch's
    `(x.float() * w.float()).to(dtype)` rounds it; rows at or after the limit are the row times 0
    (signed zeros, NaN kept); no limit: every row weighted."""
    tokens, top_k, experts, hidden = CASES[case]
    x, idx, weights = _routing(*CASES[case], seed=40 + case, device=device, dtype=dtype)
    x[0, 0] = float("nan")
    _, offsets, dest = permute.permute_reference(x, idx, experts)
    rows_N = tokens * top_k
    row_of_pair = dest.reshape(-1).long()
    product = x.float()[torch.arange(rows_N, device=device) // top_k] * weights.reshape(-1)[:, None].float()
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for limit in (None, offsets[experts // 4 - 1: experts // 4] if experts >= 4 else offsets[:1],
                  torch.zeros(1, dtype=torch.int32, device=device)):  # a limit of 0: every row weighted 0
        got = permute.copy_rows(x, dest, weights, None if limit is None else limit.to(torch.int32))
        kept = (torch.ones(rows_N, dtype=torch.bool, device=device) if limit is None
                else row_of_pair < int(limit))
        want = torch.empty_like(got)
        want[row_of_pair] = torch.where(kept[:, None], product, product * 0.0).to(dtype)
        assert torch.equal(got.view(bits), want.view(bits)), limit


@pytest.mark.parametrize("case", range(len(CASES)))
def test_weighted_rows_are_the_torch_product_bit_for_bit(permute, case):
    """fp32 in the interpreter (whose fp32 -> bf16 cast truncates: bf16 on the GPU below)."""
    _check_weighted_rows(permute, case, "cpu", torch.float32)


def test_a_limit_without_weights_is_refused(permute):
    x, idx, _ = _routing(*CASES[0], seed=3)
    _, _, dest = permute.permute_reference(x, idx, CASES[0][2])
    with pytest.raises(ValueError, match="needs weights_TK"):
        permute.copy_rows(x, dest, None, torch.zeros(1, dtype=torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gpu_bf16_weighted_rows_are_the_torch_product_bit_for_bit(case):
    from disagmoe.kernels import permute

    _check_weighted_rows(permute, case, "cuda", torch.bfloat16)


def test_combine_kernels_write_every_element(permute):
    x, idx, weights = _routing(23, 3, 6, 33, seed=5)
    rows, _, dest = permute.permute_reference(x, idx, 6)
    dy = torch.randn(23, 33, generator=torch.Generator().manual_seed(0))
    y = permute.combine_forward(rows, dest, weights)
    d_rows, d_w = permute.combine_backward(dy, rows, dest, weights)
    for t in (y, d_rows, d_w):
        assert torch.isfinite(t).all()
    torch.testing.assert_close(y, permute.combine_reference(rows, dest, weights))
    with pytest.raises(ValueError, match=r"residual must be \[tokens, hidden\] = \(23, 33\)"):
        permute.combine_forward(rows, dest, weights, residual_TH=dy[:, :32])


@pytest.mark.parametrize("case", [(37, 2, 8, 300), (20, 4, 3, 128), (9, 3, 70, 40), (0, 2, 4, 256)])
def test_fp8_permute_writes_the_quantised_rows(interpreted, case):
    """quantize_then_permute (each token's row quantised once, then copied to its pairs' rows) =
    quantize_rows of the stable-sorted rows, to the bit (bf16 tokens with rows 2^+-8 apart, hidden
    sizes that are not multiples of 128, empty experts, no tokens), and it counts the tokens'
    elements."""
    _, fp8, permute = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                  "disagmoe.kernels.permute")
    from disagmoe.kernels.fp8_stats import ACTIVATIONS, TOTAL, Fp8Stats

    tokens, top_k, experts, hidden = case
    x, idx, _ = _routing(tokens, top_k, experts, hidden, seed=hidden, dtype=torch.bfloat16)
    x = x * torch.exp2(torch.randn(tokens, 1, generator=torch.Generator().manual_seed(1)) * 8).bfloat16()
    rows, offsets, dest = permute.permute_reference(x, idx, experts)
    q_ref, s_ref = fp8.quantize_rows_reference(rows)
    stats = Fp8Stats("cpu")
    q, s = permute.quantize_then_permute(x, dest, stats.row(ACTIVATIONS))
    assert q.dtype == fp8.FP8 and q.shape == (tokens * top_k, hidden) and torch.equal(s, s_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert stats.row(ACTIVATIONS)[TOTAL] == tokens * hidden


def test_rejects_bad_routing_shapes(permute):
    x, idx, weights = _routing(8, 2, 4, 16, seed=0)
    with pytest.raises(ValueError, match="tokens"):
        permute.permute_tokens(x[:5], idx, 4)
    with pytest.raises(ValueError, match="weights"):
        permute.combine_rows(x.repeat(2, 1), idx.int(), weights[:, :1])


@pytest.mark.gpu
@pytest.mark.parametrize("tokens,top_k,experts,hidden", [(4096, 8, 128, 2048), (1000, 2, 8, 4096), (64, 2, 8, 64),
                                                         (300, 3, 5, 16), (77, 2, 9, 40), (500, 4, 16, 300)])
def test_gpu_bf16_permute_combine(tokens, top_k, experts, hidden):
    from disagmoe.kernels import permute

    x, idx, weights = _routing(tokens, top_k, experts, hidden, seed=1, device="cuda",
                               dtype=torch.bfloat16)
    rows, offsets, dest = permute.permute_tokens(x, idx, experts)
    want_rows, want_offsets, want_dest = permute.permute_reference(x, idx, experts)
    assert torch.equal(offsets, want_offsets) and torch.equal(dest, want_dest)
    assert torch.equal(rows, want_rows)
    y = permute.combine_rows(rows, dest, weights)
    torch.testing.assert_close(y, permute.combine_reference(rows, dest, weights),
                               rtol=1e-2, atol=1e-2)
    h = torch.randn_like(x)  # the residual stream added in the same pass, rounded once
    torch.testing.assert_close(permute.combine_rows(rows, dest, weights, residual_TH=h),
                               permute.combine_reference(rows, dest, weights, h), rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("tokens,top_k,experts,hidden", [(4096, 8, 128, 2048), (1000, 2, 8, 4096), (500, 4, 16, 300)])
def test_gpu_fp8_permute(tokens, top_k, experts, hidden):
    """The quantising permute on the GPU (each token's row quantised once, then copied): kernels.fp8's
    reference quantisation of the sorted rows, to the bit."""
    from disagmoe.kernels import fp8, permute

    x, idx, _ = _routing(tokens, top_k, experts, hidden, seed=2, device="cuda", dtype=torch.bfloat16)
    offsets, dest = permute.pair_destinations(idx, experts)
    rows, want_offsets, want_dest = permute.permute_reference(x, idx, experts)
    q_ref, s_ref = fp8.quantize_rows_reference(rows)
    assert torch.equal(offsets, want_offsets) and torch.equal(dest, want_dest)
    q, s = permute.quantize_then_permute(x, dest)
    assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


@pytest.mark.parametrize("seed", range(3))
def test_spare_bucket_kernels_match_the_torch_expert_block(interpreted, seed):
    """The expert rank's fused path (permute with a spare last bucket, combine with a row limit)
    equals the plain-torch one, forward and backward, pairs served elsewhere included."""
    _, _, _ = interpreted("disagmoe.kernels.permute", "disagmoe.kernels.grouped_gemm", "disagmoe.kernels.moe_ffn")
    from disagmoe.model import local_experts
    from disagmoe.model.experts import RoutedExperts

    g = torch.Generator().manual_seed(seed)
    tokens, top_k, experts, local = 37, 3, 7, [1, 4, 5]
    full = RoutedExperts(experts, 16, 24, backend="triton")
    full.init_weights(seed, "e", std=0.3)
    part = RoutedExperts.from_indices(full, local)
    x = torch.randn(tokens, 16, generator=g)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=g)
    table = torch.full((experts,), len(local), dtype=torch.int32)
    table[local] = torch.arange(len(local), dtype=torch.int32)
    results = []
    for path in (local_experts._fused, local_experts._torch):
        leaves = [t.clone().requires_grad_() for t in (x, w)]
        part.zero_grad()
        out = path(leaves[0], table[idx], leaves[1], part)
        out.backward(torch.ones_like(out))
        results.append([out, leaves[0].grad, leaves[1].grad, part.w13_EH2F.grad.clone()])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
