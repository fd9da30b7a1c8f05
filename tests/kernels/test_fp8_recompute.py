"""Selective recomputation of the FP8 experts (disagmoe/kernels/fp8_ffn.py, `fp8.quantize_token_groups`'
rows_M): through the Triton permute, the FP8 expert FFN and the weighted combine under Triton's
interpreter (fp32 operands, e4m3 values exact, fp32 accumulation), with random routing over
ragged and empty experts (and an expert rank's spare bucket of pairs served elsewhere), what the
forward saves shrinks as asked (no grouped input rows [N, H] under expert_input; the SwiGLU output
[N, F] is never saved), every gradient (x, the routing weights, w13, w2) is the plain FP8 run's bit
for bit, and the FP8 counters are the plain run's: the backward reads the rows from their tokens
but quantises nothing the plain run does not. On a GPU (bf16) the same, bit for bit too: the rows
are read, never recomputed arithmetically."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels.recompute import EXPERT_INPUT, EXPERT_SWIGLU, FP8_RECOMPUTABLE, RowSource
from disagmoe.kernels.tile_configs import TileConfig

SMALL = dict(rows=TileConfig(block_m=16, block_n=32, block_k=128, group_m=2, num_warps=4, num_stages=1),
             swiglu=TileConfig(block_m=16, block_n=128, block_k=128, group_m=2, num_warps=4, num_stages=1),
             wgrad=TileConfig(block_m=128, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1))
SUBSETS = [pytest.param(frozenset({EXPERT_INPUT}), id="input", marks=pytest.mark.slow),
           pytest.param(frozenset({EXPERT_SWIGLU}), id="swiglu", marks=pytest.mark.slow),
           pytest.param(frozenset(FP8_RECOMPUTABLE), id="both")]  # the quick subset runs both on the first case
CASES = [  # (tokens, top_k, experts, hidden, ffn, seed, spare_last); the quick subset runs the first
    pytest.param((14, 2, 4, 32, 40, 0, False), id="ragged"),
    pytest.param((26, 3, 4, 48, 40, 1, True), id="spare-bucket", marks=pytest.mark.slow),
    pytest.param((70, 2, 3, 32, 24, 2, False), id="over-128-rows", marks=pytest.mark.slow),
]


def _routing(tokens, top_k, experts, hidden, ffn, seed, spare_last, device="cpu", dtype=torch.float32):
    """Random top-k ids with expert 1 left empty (and, with `spare_last`, id `experts` for pairs
    served elsewhere), tokens whose magnitudes spread by 2^N(0, 1), weights, routing weights, dy."""
    gen = torch.Generator().manual_seed(seed)
    pool = [e for e in range(experts + (1 if spare_last else 0)) if e != 1]
    topk_TK = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=gen)[:top_k]]
                           for _ in range(tokens)]).to(torch.int32)
    x_TH = torch.randn(tokens, hidden, generator=gen) * torch.exp2(torch.randn(tokens, 1, generator=gen))
    w_TK = torch.rand(tokens, top_k, generator=gen)
    w13 = torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5
    dy_TH = torch.randn(tokens, hidden, generator=gen) * torch.exp2(torch.randn(tokens, 1, generator=gen))
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return topk_TK.to(device), cast(x_TH), cast(w_TK), cast(w13), cast(w2), cast(dy_TH)


def _run(permute, ffn8, case, recompute, device="cpu", dtype=torch.float32):
    """((y, dx, dw, dw13, dw2), the FP8 counters, the shapes autograd saved) of permute -> FP8 FFN ->
    weighted combine, the FFN dropping `recompute` (its rows' source given under expert_input)."""
    from disagmoe.kernels.fp8_stats import Fp8Stats

    tokens, top_k, experts, hidden, ffn, seed, spare_last = case
    topk_TK, *tensors, dy_TH = _routing(tokens, top_k, experts, hidden, ffn, seed, spare_last, device, dtype)
    leaves = [t.clone().requires_grad_() for t in tensors]
    x_TH, w_TK, w13, w2 = leaves
    stats = Fp8Stats(device)
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t

    cpu = device == "cpu"
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        rows_NH, offsets_E1, dest_TK = permute.permute_tokens(x_TH, topk_TK, experts + spare_last, spare_last)
        offsets_E = offsets_E1[:experts]
        source = RowSource.of_permute(x_TH, dest_TK) if EXPERT_INPUT in recompute else None
        y_NH = ffn8.expert_ffn_fp8(rows_NH, offsets_E, w13, w2, tiles=ffn8.Fp8Tiles(**SMALL) if cpu else None,
                                   num_programs=3 if cpu else None, stats=stats, recompute=recompute, source=source)
        limit = offsets_E1[experts - 1:experts] if spare_last else None
        y_TH = permute.combine_rows(y_NH, dest_TK, w_TK, limit)
    y_TH.backward(dy_TH)
    return (y_TH.detach(), *(leaf.grad for leaf in leaves)), stats.buffer.clone(), saved


@pytest.fixture
def kernels(interpreted):
    _, _, permute, ffn8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                      "disagmoe.kernels.permute", "disagmoe.kernels.fp8_ffn")
    return permute, ffn8


_PLAIN: dict[tuple, tuple] = {}  # case -> its plain run (nothing recomputed), shared by the case's subsets


def _plain(permute, ffn8, case):
    """The case's plain run, made once per process (the case's tests run on one xdist worker:
    tests/conftest.py's SHARED_UNITS)."""
    if case not in _PLAIN:
        _PLAIN[case] = _run(permute, ffn8, case, frozenset())
    return _PLAIN[case]


@pytest.mark.parametrize("recompute", SUBSETS)
@pytest.mark.parametrize("case", CASES)
def test_fp8_recomputation_keeps_less_with_the_same_bits_and_counters(kernels, case, recompute):
    permute, ffn8 = kernels
    tokens, top_k, _, hidden, ffn, _, _ = case
    rows = tokens * top_k
    (plain, plain_stats, plain_saved), (got, stats, saved) = _plain(permute, ffn8, case), _run(permute, ffn8, case,
                                                                                              recompute)
    for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), got, plain, strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(stats, plain_stats)  # each quantisation counted once, as in the plain run
    assert plain_stats.sum() > 0
    # [N, H]: the FFN's input rows (unless expert_input) and the combine's output rows (the FP8
    # experts' expert_output is not built); [N, 2F] the pre-activations; never the SwiGLU output
    assert plain_saved.count((rows, hidden)) == 2 and (rows, 2 * ffn) in saved
    assert saved.count((rows, hidden)) == (1 if EXPERT_INPUT in recompute else 2)
    assert (rows, ffn) not in saved and (rows, ffn) not in plain_saved


def test_the_token_group_quantiser_reads_rows_from_their_tokens_as_from_the_gathered_rows(interpreted):
    """`quantize_token_groups` with rows_M: the gathered copy's values, scales and counters, bit for
    bit; rows past the last group (a spare bucket) are not read (their ids point nowhere)."""
    from disagmoe.kernels.fp8_stats import Fp8Stats

    _, fp8k = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8")
    gen = torch.Generator().manual_seed(3)
    x_TH = torch.randn(9, 40, generator=gen) * torch.exp2(torch.randn(9, 1, generator=gen) * 3)
    offsets = torch.tensor([5, 5, 14], dtype=torch.int32)  # an empty group
    rows_M = torch.randint(0, 9, (17,), generator=gen)
    rows_M[14:] = 1 << 40  # the spare bucket's rows: never read
    results = []
    for kwargs in (dict(x_MK=x_TH[rows_M.clamp_max(8)]), dict(x_MK=x_TH, rows_M=rows_M)):
        stats = Fp8Stats("cpu")
        results.append((*fp8k.quantize_token_groups(**kwargs, offsets_E=offsets, stats=stats.row(0)), stats.buffer))
    for gathered, in_place in zip(*results, strict=True):
        assert torch.equal(gathered.view(torch.uint8) if gathered.dtype == fp8k.FP8 else gathered,
                           in_place.view(torch.uint8) if in_place.dtype == fp8k.FP8 else in_place)
    with pytest.raises(ValueError, match="rows_M must be int64"):
        fp8k.quantize_token_groups(x_TH, offsets, rows_M=rows_M.int())


def test_a_source_of_another_dtype_is_cast_to_the_rows_dtype(kernels):
    """A source whose tokens are not in the rows' dtype (fp64 tokens, fp32 rows): the backward
    gathers and casts them as the forward's rows were cast, so the gradients stay the plain run's."""
    _, ffn8 = kernels
    gen = torch.Generator().manual_seed(5)
    x_TH = torch.randn(12, 32, generator=gen, dtype=torch.float64)
    token_N = torch.randint(0, 12, (20,), generator=gen)
    offsets = torch.tensor([7, 7, 20], dtype=torch.int32)
    w13 = torch.randn(3, 32, 48, generator=gen) / 32**0.5
    w2 = torch.randn(3, 24, 32, generator=gen) / 24**0.5
    dy = torch.randn(20, 32, generator=gen)
    grads = []
    for recompute in (frozenset(), frozenset({EXPERT_INPUT})):
        rows = x_TH[token_N].float().requires_grad_()
        leaves = [w.clone().requires_grad_() for w in (w13, w2)]
        y = ffn8.expert_ffn_fp8(rows, offsets, *leaves, tiles=ffn8.Fp8Tiles(**SMALL), num_programs=2,
                                recompute=recompute, source=RowSource(x_TH, token_N))
        y.backward(dy)
        grads.append((rows.grad, *(w.grad for w in leaves)))
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)


def test_what_the_fp8_experts_cannot_recompute_is_refused_with_the_reason(kernels):
    _, ffn8 = kernels
    x, offsets, w13, w2 = torch.randn(4, 16), torch.tensor([4], dtype=torch.int32), torch.randn(1, 16, 32), \
        torch.randn(1, 16, 16)
    with pytest.raises(ValueError, match="cannot recompute expert_output: the FP8 experts have no fused combine"):
        ffn8.expert_ffn_fp8(x, offsets, w13, w2, recompute=frozenset({"expert_output"}))
    with pytest.raises(ValueError, match=r"recompute expert_input, expert_swiglu; got \['block'\]"):
        ffn8.expert_ffn_fp8(x, offsets, w13, w2, recompute=frozenset({"block"}))
    with pytest.raises(ValueError, match="one token row of hidden 16 per row of x"):
        ffn8.expert_ffn_fp8(x, offsets, w13, w2, recompute=frozenset({EXPERT_INPUT}),
                            source=RowSource(torch.randn(3, 16), torch.zeros(5, dtype=torch.int64)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("recompute", SUBSETS)
@pytest.mark.parametrize("case", [(1500, 8, 16, 512, 384, 0, False), (2000, 4, 7, 1024, 256, 1, True)],
                         ids=["qwen-like", "spare-bucket"])
def test_gpu_fp8_recomputation_gives_the_same_bits_and_counters(case, recompute):
    """bf16 on the tensor cores with the default tiles: the same bits as the plain FP8 run (the
    backward reads the same bf16 rows from their tokens; no value is recomputed arithmetically)
    and the same counters, without the grouped rows saved."""
    from disagmoe.kernels import fp8_ffn, permute

    tokens, top_k, _, hidden, ffn, _, _ = case
    plain, plain_stats, plain_saved = _run(permute, fp8_ffn, case, frozenset(), "cuda", torch.bfloat16)
    got, stats, saved = _run(permute, fp8_ffn, case, recompute, "cuda", torch.bfloat16)
    for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), got, plain, strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(stats, plain_stats)
    rows = tokens * top_k
    assert saved.count((rows, hidden)) == plain_saved.count((rows, hidden)) - (EXPERT_INPUT in recompute)
