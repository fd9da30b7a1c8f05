"""The pair-row return (disagmoe/runtime/stages/pair_return.py) against a plain MoE layer with autograd.

Q expert "ranks" (experts split between them, some empty) write their pairs' rows into one shared
buffer with a [Q, S] flag block, as the nvshmem transport gives them, and in the backward their
pairs' d x into a second one (or d x compactly); the attention side's combine and sum and both
sides' backward must give the layer's output, d x, d routing weights and every expert's weight
gradients. Three ways: plain torch on CPU (fp32), the fused kernels under Triton's
interpreter (fp32, CPU tensors standing for the peer buffer; sources run before the combine) and
on a GPU (bf16). With sparse dispatch each source receives only the tokens it serves, in dispatch
order with stale padding past the count (as a peer store leaves it), and must still address the
attention rank's pair rows by token.
"""

from __future__ import annotations

import pytest
import torch

from disagmoe.comm.base import PairLanding, PairTarget
from disagmoe.model.experts import RoutedExperts
from disagmoe.runtime.stages import pair_return
from disagmoe.runtime.stages.sparse_dispatch import pick_rows, received_locals, received_order, unpermute

# (tokens, top_k, experts, sources, hidden, ffn, segment_tokens, skew)
CASES = [
    (37, 2, 6, 2, 40, 24, 8, False),  # ragged, two sources sharing every segment
    (24, 3, 6, 3, 16, 16, 32, False),  # one segment larger than the tokens
    (40, 2, 8, 2, 16, 16, 4, True),  # every pair on experts 0 and 1: empty experts, a source with no rows
]


def _layer(case, device, dtype, seed=0):
    tokens, top_k, experts, sources, hidden, ffn, seg, skew = case
    gen = torch.Generator().manual_seed(seed)
    full = RoutedExperts(experts, hidden, ffn, backend="loop")
    with torch.no_grad():
        full.w13_EH2F.copy_(torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5)
        full.w2_EFH.copy_(torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5)
    pool = 2 if skew else experts
    topk = torch.stack([torch.randperm(pool, generator=gen)[:top_k] for _ in range(tokens)])
    x = torch.randn(tokens, hidden, generator=gen)
    w = torch.rand(tokens, top_k, generator=gen)
    dy = torch.randn(tokens, hidden, generator=gen)
    return full.to(device, dtype), topk.to(device), x.to(device, dtype), w.to(device, dtype), dy.to(device, dtype)


def _reference(full, topk, x, w, dy):
    """y[t] = sum_j w[t, j] FFN_{topk[t, j]}(x[t]) in fp32 with autograd: (y, dx, dw, dw13, dw2)."""
    ref = RoutedExperts(full.num_experts, x.shape[1], full.w2_EFH.shape[1], backend="loop").to(x.device)
    with torch.no_grad():
        ref.w13_EH2F.copy_(full.w13_EH2F.float())
        ref.w2_EFH.copy_(full.w2_EFH.float())
    x_leaf, w_leaf = x.float().requires_grad_(), w.float().requires_grad_()
    flat = topk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offsets = torch.bincount(flat, minlength=full.num_experts).cumsum(0).to(torch.int32)
    y_rows = torch.empty(flat.numel(), x.shape[1], device=x.device).index_copy(
        0, order, ref(x_leaf[order // topk.shape[1]], offsets))
    y = (y_rows.view(*topk.shape, -1) * w_leaf[..., None]).sum(1)
    y.backward(dy.float())
    return y.detach(), x_leaf.grad, w_leaf.grad, ref.w13_EH2F.grad, ref.w2_EFH.grad


class _Received:
    """What source q receives: every token (dense), or with sparse dispatch only those it serves,
    in dispatch order (`pick_rows`), the rows, ids, weights, index and dy past the count stale."""

    def __init__(self, x, local_TK, num_local: int, w, dy, sparse: bool, gen: torch.Generator) -> None:
        self.sparse = sparse
        if not sparse:
            self.x, self.local_TK, self.w, self.dy, self.token_T = x, local_TK, w, dy, None
            return
        tokens, device = x.shape[0], x.device
        index_1T, count_11 = pick_rows((local_TK < num_local).any(1)[None])
        self.count_1 = count_11[0].to(torch.int32)
        stale_T = torch.arange(tokens, device=device) >= self.count_1
        scrambled_T = torch.randint(0, max(tokens, 1), (tokens,), generator=gen).to(device)
        self.index_T = torch.where(stale_T, scrambled_T, index_1T[0]).to(torch.int32)

        def received(t, junk):
            return torch.where(stale_T.view(-1, *[1] * (t.dim() - 1)), junk, t[index_1T[0]])

        self.x = received(x, torch.randn(x.shape, generator=gen).to(device, x.dtype) * 1e3)
        self.local_TK = received_locals(received(local_TK, 0), self.count_1, num_local)  # a local id past the count
        self.w = received(w, 7.0)
        self.dy = received(dy, 1e3)
        self.token_T = received_order(self.index_T, self.count_1)

    def dx(self, leaf: torch.Tensor) -> torch.Tensor:
        """The source's d x back at its tokens (sparse: `unpermute`, the padding rows dropped)."""
        if not self.sparse:
            return leaf.grad.float()
        return unpermute(leaf.grad.float()[None], self.index_T[None], self.count_1[None])[0]


def _pair_path(full, topk, x, w, dy, case, fused, backend, grads_as_pairs=True, recompute=frozenset(), sparse=False):
    tokens, top_k, experts, sources, hidden, ffn, seg, _ = case
    per = experts // sources
    device = x.device
    segments = -(-tokens // seg)
    rows = torch.full((tokens * top_k, hidden), float("nan"), device=device, dtype=x.dtype)
    flags = torch.zeros(sources, segments, dtype=torch.int64, device=device)
    counters = torch.zeros(segments, dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(11)
    parts, saved, leaves, got = [], [], [], []
    for q in range(sources):
        part = RoutedExperts.from_slice(full, q * per, (q + 1) * per, backend=backend)
        part.set_recompute(recompute)
        local_TK = torch.where(topk // per == q, topk % per, per).to(torch.int32)
        mine = _Received(x, local_TK, per, w, dy, sparse, gen)
        x_leaf = mine.x.detach().requires_grad_()
        saved.append(pair_return.expert_pair_rows(x_leaf, mine.local_TK, mine.w, part, PairTarget(rows, flags, q),
                                                  counters, seg, fused=fused, num_programs=3 if fused else None,
                                                  token_T=mine.token_T))
        parts.append(part)
        leaves.append(x_leaf)
        got.append(mine)
    assert (flags == 1).all() and (counters == 0).all(), "every source raised every segment"
    status = torch.zeros(2, dtype=torch.int32, device=device) if fused else None
    w_leaf = w.detach().requires_grad_()
    landing = PairLanding(rows, flags, torch.zeros_like(flags), status)
    y = pair_return.combine_pairs(landing, w_leaf, seg, num_programs=2)
    y.backward(dy)
    if grads_as_pairs:  # d x returns as pair rows into a second buffer, summed on the receiver
        dx_rows = torch.full_like(rows, float("nan"))
        dx_flags = torch.zeros_like(flags)
        for q, (s, mine) in enumerate(zip(saved, got, strict=True)):
            pair_return.expert_pair_rows_backward(s, mine.dy, PairTarget(dx_rows, dx_flags, q), counters, seg)
        assert (dx_flags == 1).all() and (counters == 0).all()
        landing = PairLanding(dx_rows, dx_flags, torch.zeros_like(dx_flags), status)
        dx = pair_return.sum_pairs(landing, top_k, seg, num_programs=2).float()
    else:  # d x compactly into each source's leaf (sparse dispatch: in its received order, back per source)
        for s, mine in zip(saved, got, strict=True):
            pair_return.expert_pair_rows_backward(s, mine.dy)
        dx = sum(mine.dx(leaf) for mine, leaf in zip(got, leaves, strict=True))
    dw13 = torch.cat([p.w13_EH2F.grad.float() for p in parts])
    dw2 = torch.cat([p.w2_EFH.grad.float() for p in parts])
    return y.float(), dx, w_leaf.grad.float(), dw13, dw2


def _assert_close(got, want, rtol):
    for name, g, r in zip(("y", "dx", "dw", "dw13", "dw2"), got, want, strict=True):
        err = ((g - r).norm() / r.norm().clamp_min(1e-12)).item()
        assert err <= rtol, (name, err)


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("grads_as_pairs", [True, False], ids=["dx-pair-rows", "dx-compact"])
@pytest.mark.parametrize("case", CASES, ids=["two-sources", "one-segment", "skew"])
def test_plain_torch_pair_rows_are_the_moe_layer(case, grads_as_pairs, sparse):
    full, topk, x, w, dy = _layer(case, "cpu", torch.float32)
    _assert_close(_pair_path(full, topk, x, w, dy, case, fused=False, backend="loop", grads_as_pairs=grads_as_pairs,
                             sparse=sparse), _reference(full, topk, x, w, dy), 1e-5)


@pytest.fixture
def kernels(interpreted):
    """The kernel modules rebuilt for Triton's interpreter (see tests/kernels/conftest.py)."""
    interpreted("disagmoe.kernels.signal", "disagmoe.kernels.grouped_gemm", "disagmoe.kernels.permute",
                "disagmoe.kernels.moe_ffn", "disagmoe.kernels.fused_return")


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("grads_as_pairs", [True, False], ids=["dx-pair-rows", "dx-compact"])
@pytest.mark.parametrize("case", CASES, ids=["two-sources", "one-segment", "skew"])
def test_fused_pair_rows_are_the_moe_layer_in_the_interpreter(kernels, case, grads_as_pairs, sparse):
    full, topk, x, w, dy = _layer(case, "cpu", torch.float32, seed=1)
    _assert_close(_pair_path(full, topk, x, w, dy, case, fused=True, backend="triton", grads_as_pairs=grads_as_pairs,
                             sparse=sparse), _reference(full, topk, x, w, dy), 1e-4)


_PLAIN: dict[tuple[bool, bool], tuple] = {}  # (grads_as_pairs, sparse) -> the plain run, shared by the recompute sets


def _plain(full, topk, x, w, dy, case, grads_as_pairs, sparse):
    """The plain run (nothing recomputed), made once per process (these tests run on one xdist
    worker: tests/conftest.py's SHARED_UNITS)."""
    if (grads_as_pairs, sparse) not in _PLAIN:
        _PLAIN[grads_as_pairs, sparse] = _pair_path(full, topk, x, w, dy, case, fused=True, backend="triton",
                                                    grads_as_pairs=grads_as_pairs, sparse=sparse)
    return _PLAIN[grads_as_pairs, sparse]


@pytest.mark.parametrize("recompute", [{"expert_swiglu"}, {"expert_input"}, {"expert_input", "expert_swiglu"}],
                         ids=["swiglu", "input", "both"])
@pytest.mark.parametrize("grads_as_pairs, sparse", [(True, False), (False, False), (False, True)],
                         ids=["dx-pair-rows", "dx-compact", "dx-compact-sparse"])
def test_recomputed_pair_rows_keep_less_and_give_the_same_bits_in_fp32(kernels, recompute, grads_as_pairs, sparse):
    """`recompute: selective` on the fused pair path: the forward keeps no SwiGLU output / no
    grouped rows (their source tokens instead), and in fp32 the backward recomputes them exactly,
    so every gradient is the plain run's to the bit (bf16 on a GPU: the SwiGLU output rounds from
    the kept bf16 pre-activations instead, the GPU test's tolerance)."""
    case = CASES[0]
    full, topk, x, w, dy = _layer(case, "cpu", torch.float32, seed=3)
    plain = _plain(full, topk, x, w, dy, case, grads_as_pairs, sparse)
    got = _pair_path(full, topk, x, w, dy, case, fused=True, backend="triton", grads_as_pairs=grads_as_pairs,
                     recompute=frozenset(recompute), sparse=sparse)
    for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), got, plain, strict=True):
        assert torch.equal(a, b), name
    part = RoutedExperts.from_slice(full, 0, 3, backend="triton")
    part.set_recompute(frozenset(recompute))
    tokens, top_k, _, _, hidden, _, seg, _ = case
    rows = torch.zeros(tokens * top_k, hidden)
    flags = torch.zeros(1, -(-tokens // seg), dtype=torch.int64)
    saved = pair_return.expert_pair_rows(x.requires_grad_(), torch.where(topk < 3, topk, 3).to(torch.int32), w, part,
                                         PairTarget(rows, flags, 0), torch.zeros(flags.shape[1], dtype=torch.int32),
                                         seg, fused=True, num_programs=2)
    assert (saved.fused.act_NF is None) == ("expert_swiglu" in recompute)
    assert isinstance(saved.fused.x_N, pair_return.RowSource) == ("expert_input" in recompute)
    assert (saved.x_N is None) == ("expert_input" in recompute)


@pytest.mark.parametrize("grads_as_pairs, sparse", [(True, False), (False, False), (False, True)],
                         ids=["dx-pair-rows", "dx-compact", "dx-compact-sparse"])
def test_recomputed_pair_rows_keep_less_under_full_only_rows_and_routing(kernels, grads_as_pairs, sparse):
    """`recompute: full` on the fused pair path: the forward keeps neither the grouped rows, nor
    the gate/up pre-activations, nor the SwiGLU output; the backward runs the gate/up GEMM again
    from the received rows, and in fp32 every gradient is the plain run's to the bit (the stores
    into the receiver's buffer are not run again: the flags stay at the forward's count)."""
    case = CASES[0]
    full, topk, x, w, dy = _layer(case, "cpu", torch.float32, seed=3)
    plain = _plain(full, topk, x, w, dy, case, grads_as_pairs, sparse)
    got = _pair_path(full, topk, x, w, dy, case, fused=True, backend="triton", grads_as_pairs=grads_as_pairs,
                     recompute=frozenset({"block"}), sparse=sparse)
    for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), got, plain, strict=True):
        assert torch.equal(a, b), name
    part = RoutedExperts.from_slice(full, 0, 3, backend="triton")
    part.set_recompute(frozenset({"block"}))
    tokens, top_k, _, _, hidden, _, seg, _ = case
    rows = torch.zeros(tokens * top_k, hidden)
    flags = torch.zeros(1, -(-tokens // seg), dtype=torch.int64)
    saved = pair_return.expert_pair_rows(x.requires_grad_(), torch.where(topk < 3, topk, 3).to(torch.int32), w, part,
                                         PairTarget(rows, flags, 0), torch.zeros(flags.shape[1], dtype=torch.int32),
                                         seg, fused=True, num_programs=2)
    assert saved.fused.h13_N2F is None and saved.fused.act_NF is None and saved.x_N is None
    assert isinstance(saved.fused.x_N, pair_return.RowSource) and saved.fused.x_N.x_TH.data_ptr() == x.data_ptr()


@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
@pytest.mark.parametrize("grads_as_pairs", [True, False], ids=["dx-pair-rows", "dx-compact"])
def test_fully_recomputed_plain_torch_pair_rows_are_the_plain_runs(grads_as_pairs, sparse):
    """The torch path (CPU ranks, other backends) under `recompute: full`: the experts' call runs
    under a checkpoint of the grouped rows, the gradients the plain run's to the bit."""
    case = CASES[2]
    full, topk, x, w, dy = _layer(case, "cpu", torch.float32)
    plain, got = (_pair_path(full, topk, x, w, dy, case, fused=False, backend="loop", grads_as_pairs=grads_as_pairs,
                             recompute=recompute, sparse=sparse) for recompute in (frozenset(), frozenset({"block"})))
    for name, a, b in zip(("y", "dx", "dw", "dw13", "dw2"), got, plain, strict=True):
        assert torch.equal(a, b), name


def test_a_target_of_the_wrong_shape_is_refused():
    full, topk, x, w, _ = _layer(CASES[0], "cpu", torch.float32)
    target = PairTarget(torch.zeros(3, x.shape[1]), torch.zeros(1, 5, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="one row per pair"):
        pair_return.expert_pair_rows(x, topk.to(torch.int32), w, full, target, torch.zeros(5, dtype=torch.int32), 8)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("recompute", [frozenset(), frozenset({"expert_input", "expert_swiglu"})],
                         ids=["keep", "recompute"])
@pytest.mark.parametrize("case", CASES, ids=["two-sources", "one-segment", "skew"])
@pytest.mark.parametrize("sparse", [False, True], ids=["dense", "sparse"])
def test_gpu_fused_pair_rows_are_the_moe_layer_in_bf16(case, recompute, sparse):
    full, topk, x, w, dy = _layer(case, "cuda", torch.bfloat16, seed=2)
    _assert_close(_pair_path(full, topk, x, w, dy, case, fused=True, backend="triton", recompute=recompute,
                             grads_as_pairs=not sparse, sparse=sparse), _reference(full, topk, x, w, dy), 3e-2)


def test_a_run_s_pair_settings_come_from_its_config():
    from disagmoe.config import TrainConfig

    cfg = TrainConfig(model="tiny", hop="pair_rows", pair_segment_tokens=64, pair_bands=2,
                      pair_combine_programs_per_sm=8)
    hop = pair_return.PairHop.of(cfg)
    assert (hop.segment_tokens, hop.bands, hop.combine_programs_per_sm) == (64, 2, 8)
    assert hop.combine_programs(torch.device("cpu")) == 2  # the interpreter runs a couple
    defaults = pair_return.PairHop.of(TrainConfig(model="tiny"))
    assert (defaults.bands, defaults.combine_programs_per_sm) == (pair_return.BANDS, pair_return.COMBINE_PROGRAMS_PER_SM)


def test_fused_pair_rows_store_each_weight_gradients_first_touch(kernels):
    """An expert rank holding every expert serves two sources per micro-batch over two micro-batches,
    the weight-gradient launches held back (`deferred_weight_grads`, as `ExpertStage.backward`) and
    run after each micro-batch's backward: with FlatAdamW's first touch of the experts' main gradients
    (NaN before zero_grad, which leaves them alone) the step's main gradients are those of zeroing
    them, bit for bit; the skewed routing leaves experts without rows."""
    from disagmoe.config import OptimConfig
    from disagmoe.kernels.deferral import deferred_weight_grads
    from disagmoe.model.experts import first_touch_params
    from disagmoe.runtime.state.flat_adamw import FlatAdamW

    case = (20, 2, 6, 2, 16, 16, 8, True)  # every pair on experts 0 and 1 (or elsewhere): 2..5 empty
    tokens, top_k, experts, sources, hidden, ffn, seg, _ = case
    full, *_ = _layer(case, "cpu", torch.float32, seed=2)
    gen = torch.Generator().manual_seed(3)
    inputs = []  # (micro-batch, source) -> x, local ids (`experts`: served elsewhere), w, dy
    for _ in range(2 * sources):
        local = torch.stack([torch.randperm(3, generator=gen)[:top_k] for _ in range(tokens)])
        local = torch.where(local == 2, experts, local).to(torch.int32)  # id 2: a pair served elsewhere
        inputs.append((torch.randn(tokens, hidden, generator=gen), local, torch.rand(tokens, top_k, generator=gen),
                       torch.randn(tokens, hidden, generator=gen)))
    grads = []
    for first_touch in (False, True):
        part = RoutedExperts.from_slice(full, 0, experts, backend="triton")
        flat = FlatAdamW(part.named_parameters(), OptimConfig(), torch.float32,
                         first_touch=first_touch_params(part) if first_touch else ())
        assert sum(len(b.first_touch) for b in flat.buckets) == (2 if first_touch else 0)
        for b in flat.buckets:
            b.grad_N.fill_(float("nan"))
        flat.zero_grad()
        for mb in range(2):
            saved = []
            for q in range(sources):
                x, local, w, dy = inputs[mb * sources + q]
                rows = torch.full((tokens * top_k, hidden), float("nan"))
                flags = torch.zeros(sources, -(-tokens // seg), dtype=torch.int64)
                counters = torch.zeros(flags.shape[1], dtype=torch.int32)
                saved.append((pair_return.expert_pair_rows(x.clone().requires_grad_(), local, w, part,
                                                           PairTarget(rows, flags, q), counters, seg, fused=True,
                                                           num_programs=3), dy))
            with deferred_weight_grads() as held:
                for s, dy in saved:
                    pair_return.expert_pair_rows_backward(s, dy)
            assert len(held) == sources
            for work in held:
                work()
        assert torch.isfinite(flat.grad_squares())
        grads.append([b.grad_N.clone() for b in flat.buckets])
    for a, b in zip(*grads, strict=True):
        assert torch.isfinite(b).all() and torch.equal(a.view(torch.int32), b.view(torch.int32))
