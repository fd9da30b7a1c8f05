"""The routed experts as one op (disagmoe/kernels/fused_moe.py) against the three ops it fuses
(permute, expert FFN, weighted combine) under Triton's interpreter (fp32, CPU): random routing
over ragged and empty experts, a spare bucket of pairs served elsewhere, every recompute subset;
the same output and gradients (the routing weights' from the backward GEMM's row dots instead of
the kept rows), and nothing of [N, H] or [N, F] kept when everything is dropped. On a GPU in
bf16 within bf16 rounding of the three ops."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels.recompute import RECOMPUTABLE
from disagmoe.kernels.tile_configs import TileConfig

SMALL_TILES = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
CASES = [  # (tokens, top_k, experts, hidden, ffn, seed, spare_last); the quick subset runs the first
    pytest.param((37, 2, 6, 40, 24, 0, False), id="ragged"),
    pytest.param((30, 3, 5, 16, 40, 1, True), id="spare", marks=pytest.mark.slow),
    pytest.param((40, 2, 8, 24, 16, 2, True), id="skew-spare", marks=pytest.mark.slow),
]


@pytest.fixture
def kernels(interpreted):
    return interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.permute", "disagmoe.kernels.moe_ffn",
                       "disagmoe.kernels.fused_moe")


def _inputs(case, device="cpu", dtype=torch.float32):
    tokens, top_k, experts, hidden, ffn, seed, spare = case
    gen = torch.Generator().manual_seed(seed)
    ids = experts + 1 if spare else experts  # id `experts`: served elsewhere
    pool = 2 if seed == 2 else ids  # the skew case: every pair on experts 0 and 1 (or the spare), the rest empty
    topk = torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)]).to(torch.int32)
    if seed == 2 and spare:
        topk[::3, 0] = experts
    x = torch.randn(tokens, hidden, generator=gen)
    w = torch.rand(tokens, top_k, generator=gen)
    w13 = torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5
    dy = torch.randn(tokens, hidden, generator=gen)
    cast = [t.to(device, dtype) for t in (x, w, w13, w2, dy)]
    return topk.to(device), *cast


def _three_ops(moe_ffn, permute, case, tensors, tiles, programs):
    topk, x, w, w13, w2, dy = tensors
    experts, spare = w13.shape[0], case[6]
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]
    rows, offsets, dest = permute.permute_tokens(leaves[0], topk, experts + 1 if spare else experts, spare_last=spare)
    limit = offsets[experts - 1:experts] if spare else None
    y_rows = moe_ffn.expert_ffn_triton(rows, offsets[:experts], leaves[2], leaves[3], tiles=tiles, num_programs=programs)
    y = permute.combine_rows(y_rows, dest, leaves[1], limit=limit)
    y.backward(dy)
    return y.detach(), *(leaf.grad for leaf in leaves)


def _fused(fused_moe, case, tensors, recompute, tiles, programs, saved=None):
    topk, x, w, w13, w2, dy = tensors
    leaves = [t.clone().requires_grad_() for t in (x, w, w13, w2)]

    def pack(t):
        if saved is not None:
            saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fused_moe.fused_moe(leaves[0], topk, leaves[1], leaves[2], leaves[3], spare_last=case[6],
                                recompute=recompute, tiles=tiles, num_programs=programs)
    y.backward(dy)
    return y.detach(), *(leaf.grad for leaf in leaves)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


_THREE_OPS: dict[tuple, tuple] = {}  # case -> the three ops' run, shared by the case's recompute settings


def _three_ops_once(moe_ffn, permute, case, tensors, tiles):
    """The case's three-op run, made once per process (the case's tests run on one xdist worker:
    tests/conftest.py's SHARED_UNITS)."""
    if case not in _THREE_OPS:
        _THREE_OPS[case] = _three_ops(moe_ffn, permute, case, tensors, tiles, 3)
    return _THREE_OPS[case]


@pytest.mark.parametrize("recompute", [frozenset({"expert_output"}), frozenset(RECOMPUTABLE)], ids=["output", "all"])
@pytest.mark.parametrize("case", CASES)
def test_one_op_is_the_three_ops_without_their_rows(kernels, case, recompute):
    _, permute, moe_ffn, fused_moe = kernels
    tensors = _inputs(case)
    tiles = moe_ffn.FFNTiles.uniform(SMALL_TILES)
    want = _three_ops_once(moe_ffn, permute, case, tensors, tiles)
    saved = []
    got = _fused(fused_moe, case, tensors, recompute, tiles, 3, saved)
    for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), got, want, strict=True):
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) < 1e-5, (name, _rel(a, b))
    tokens, top_k, _, hidden, ffn, _, _ = case
    rows = tokens * top_k
    assert (rows, 2 * ffn) in saved  # the pre-activations stay
    if recompute == frozenset(RECOMPUTABLE):
        assert (rows, hidden) not in saved and (rows, ffn) not in saved, saved
    else:
        assert saved.count((rows, hidden)) == 1  # the input rows only: no output rows


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("spare", [False, True])
def test_gpu_bf16_one_op_is_the_three_ops_within_rounding(spare):
    from disagmoe.kernels import fused_moe, moe_ffn, permute

    case = (2048, 8, 16, 512, 256, 5, spare)
    tensors = _inputs(case, "cuda", torch.bfloat16)
    want = _three_ops(moe_ffn, permute, case, tensors, None, None)
    got = _fused(fused_moe, case, tensors, frozenset(RECOMPUTABLE), None, None)
    for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), got, want, strict=True):
        assert _rel(a, b) < 1e-2, (name, _rel(a, b))


def test_operands_that_do_not_fit_together_are_refused_with_the_fix(kernels):
    *_, fused_moe = kernels
    x, w13, w2 = torch.randn(4, 8), torch.randn(2, 8, 6), torch.randn(2, 3, 8)
    topk, w = torch.zeros(4, 2, dtype=torch.int32), torch.rand(4, 2)
    with pytest.raises(ValueError, match=r"x \[T, H\], topk \[T, K\] and w \[T, K\] must agree"):
        fused_moe.fused_moe(x, topk, w[:, :1], w13, w2)
    with pytest.raises(ValueError, match=r"expert weights must be w13 \[E, H, 2F\] and w2 \[E, F, H\]"):
        fused_moe.fused_moe(x, topk, w, w13, torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="must share one dtype"):
        fused_moe.fused_moe(x.double(), topk, w, w13, w2)
