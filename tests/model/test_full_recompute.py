"""`recompute: full` (kernels/recompute.py `BLOCK`, `SavedRouting`, `recomputed`; model/block.py,
model/local_experts.py): a block keeps only its input and its routing and runs whole again in the
backward, routing by the forward's kept top-k ids. In fp32 on the CPU every gradient is the plain
run's to the bit (GQA with shared experts, GQA with qk-norm and a dense first layer, MLA with a
sigmoid group-limited router; loop and grouped_mm experts; deferred weight gradients); the backward
routes as the forward did even when the router's weight changes in between; an expert rank's
share recomputes the same way; what the forward keeps is the memory model's `block_input_bytes`;
and nothing in a step reads a value back to the host."""

from __future__ import annotations

import contextlib

import pytest
import torch

from disagmoe.config import TrainConfig
from disagmoe.kernels.deferral import deferred_weight_grads
from disagmoe.kernels.recompute import BLOCK, SavedRouting
from disagmoe.model.experts import RoutedExperts
from disagmoe.model.local_experts import local_expert_block
from disagmoe.model.router import Router
from disagmoe.model.transformer import MoETransformer
from disagmoe.roofline import memory as mem

FULL = frozenset({BLOCK})
MODELS = {  # name -> (the conftest fixture that builds it, its overrides)
    "gqa-shared": ("make_config", dict(num_shared_experts=1)),
    "gqa-qk-norm-dense-first": ("make_config", dict(qk_norm=True, num_layers=3, num_dense_layers=1,
                                                    dense_ffn_size=12)),
    "mla": ("make_mla_config", {}),  # a dense first layer, a shared expert, sigmoid group-limited routing
}


def _model_cfg(request, name):
    fixture, overrides = MODELS[name]
    return request.getfixturevalue(fixture)(**overrides)


def _tokens(cfg, batch=2, seq=8, seed=0):
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _model(cfg, recompute, backend="loop"):
    model = MoETransformer(cfg, experts_backend=backend)
    model.init_weights(seed=3)
    model.set_recompute(frozenset(recompute))
    return model


def _loss(model, tokens):
    out = model(tokens)
    ce = torch.nn.functional.cross_entropy(out.logits_BSV.flatten(0, 1).float(), tokens.flatten())
    return ce + out.aux_loss + out.z_loss, out


def _step(cfg, recompute, backend="loop", deferred=False):
    """Loss, every parameter's gradient and the routing of one forward and backward."""
    model = _model(cfg, recompute, backend)
    loss, out = _loss(model, _tokens(cfg))
    if deferred:
        with deferred_weight_grads() as held:
            loss.backward()
        assert held, "the projections' weight gradients waited"
        for work in held:
            work()
    else:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, out.topk_idx_LNK


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])
@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("name", list(MODELS))
def test_full_recomputation_gives_the_plain_runs_bits_in_fp32(request, name, deferred, backend):
    cfg = _model_cfg(request, name)
    plain_loss, plain, plain_ids = _step(cfg, frozenset(), backend, deferred)
    loss, grads, ids = _step(cfg, FULL, backend, deferred)
    assert torch.equal(loss, plain_loss)
    assert torch.equal(ids, plain_ids)
    assert grads.keys() == plain.keys()
    for n in plain:
        assert torch.equal(grads[n], plain[n]), n


def test_the_backward_routes_by_the_forwards_ids_not_by_recomputed_scores(make_config):
    """Between the forward and the backward the router's weight is negated, so recomputed scores
    would pick the experts the forward ranked last: the experts' gradients still land on exactly
    the experts the forward chose, and the router selects once per layer (the forward's run)."""
    cfg = make_config(num_layers=2, num_experts=8, top_k=2)
    model = _model(cfg, FULL)
    tokens = _tokens(cfg, batch=1, seq=3)  # 3 tokens x 2 picks: at most 6 of the 8 experts per layer
    selections = []
    select = Router.select

    def counted(router, scores_NE):
        selections.append(router)
        return select(router, scores_NE)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Router, "select", counted)
        loss, out = _loss(model, tokens)
        with torch.no_grad():
            for block in model.moe_blocks:
                block.moe.router.weight.neg_()
        loss.backward()
    assert len(selections) == cfg.num_moe_layers
    with torch.no_grad():  # what recomputed scores pick: the first layer's input is the forward's
        rerouted_NK = model(tokens).topk_idx_LNK[0]
    for n, (kept, again) in enumerate(zip(out.topk_idx_LNK[0].tolist(), rerouted_NK.tolist(), strict=True)):
        assert not set(kept) & set(again), n
    for block, ids_NK in zip(model.moe_blocks, out.topk_idx_LNK, strict=True):
        chosen = set(ids_NK.flatten().tolist())
        assert len(chosen) < cfg.num_experts
        got_grad = {e for e in range(cfg.num_experts) if block.moe.experts.w2_EFH.grad[e].abs().sum() > 0}
        assert got_grad == chosen


def test_the_router_weights_gradient_is_the_plain_runs_under_a_fixed_routing(make_config):
    """The weights are recomputed from the kept ids and the recomputed scores (their gradient is
    the forward's): with ids fixed from outside as well, the router's gradient is the plain run's."""
    cfg = make_config(num_shared_experts=1)
    tokens = _tokens(cfg)
    fixed = _model(cfg, frozenset())(tokens).topk_idx_LNK
    grads = []
    for recompute in (frozenset(), FULL):
        model = _model(cfg, recompute)
        out = model(tokens, fixed_topk_idx_LNK=fixed)
        (out.logits_BSV.float().square().mean() + out.aux_loss).backward()
        grads.append([b.moe.router.weight.grad for b in model.moe_blocks])
    for plain, lean in zip(*grads, strict=True):
        assert plain.abs().sum() > 0 and torch.equal(plain, lean)


def _saved_bytes(fn):
    """Bytes of the distinct storages autograd saves in `fn()` through the saved-tensor hooks
    (a non-reentrant checkpoint saves its input that way), parameters aside."""
    seen = {}

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return sum(seen.values()), result


def test_a_block_keeps_its_input_and_routing_as_the_memory_model_says(make_config, monkeypatch):
    cfg = make_config(num_shared_experts=1)
    block = _model(cfg, FULL).layers[-1]
    batch, seq = 2, 8
    tokens = batch * seq
    x = torch.randn(batch, seq, cfg.hidden_size, requires_grad=True)
    kept = []
    init = SavedRouting.__init__

    def remembered(routing):
        init(routing)
        kept.append(routing)

    monkeypatch.setattr(SavedRouting, "__init__", remembered)
    saved, _ = _saved_bytes(lambda: block(x))
    assert saved == tokens * 4 * cfg.hidden_size  # the block's input, nothing it computed
    (routing,) = kept
    grouping = routing.derived("grouping", lambda: None)
    routing_bytes = sum(t.numel() * t.element_size() for t in (routing.topk_idx_NK, grouping.pair_idx_P))
    assert routing_bytes == tokens * cfg.top_k * mem.ROUTING_BYTES_PER_PAIR
    assert saved + routing_bytes == tokens * mem.block_input_bytes(cfg, True, 4)
    assert grouping.offsets_E.numel() == cfg.num_experts  # and E offsets per layer (not per token)
    plain, _ = _saved_bytes(lambda: _model(cfg, frozenset()).layers[-1](x))
    assert plain > 8 * saved


@pytest.mark.parametrize("backend", ["loop", "grouped_mm"])  # triton: in the interpreter test below
def test_an_expert_ranks_share_recomputes_from_its_rows_and_kept_grouping(backend):
    """`local_expert_block` under BLOCK (an expert rank's `recompute: full`): the partial sums and
    every gradient the plain run's bits, and autograd keeps only the received rows and weights."""
    gen = torch.Generator().manual_seed(0)
    experts, tokens, top_k, hidden, ffn = 5, 13, 2, 16, 8
    part = RoutedExperts(experts, hidden, ffn, backend=backend)
    part.init_weights(1, "e", std=0.3)
    local_TK = torch.randint(0, experts + 1, (tokens, top_k), generator=gen).to(torch.int32)  # 5: elsewhere
    x, w, dy = (torch.randn(*shape, generator=gen) for shape in ((tokens, hidden), (tokens, top_k), (tokens, hidden)))
    results = []
    for recompute in (frozenset(), FULL):
        part.set_recompute(recompute)
        part.zero_grad(set_to_none=True)
        x_leaf, w_leaf = x.clone().requires_grad_(), w.clone().requires_grad_()
        saved, y = _saved_bytes(lambda: local_expert_block(x_leaf, local_TK, w_leaf, part))
        y.backward(dy)
        results.append((saved, y.detach(), x_leaf.grad, w_leaf.grad, part.w13_EH2F.grad, part.w2_EFH.grad))
    (plain_saved, *plain), (lean_saved, *lean) = results
    for a, b in zip(plain, lean, strict=True):
        assert torch.equal(a, b)
    assert lean_saved == 4 * tokens * (hidden + top_k) + 4 * tokens * top_k  # rows, weights, local ids
    assert plain_saved > 2 * lean_saved


def test_a_no_grad_forward_runs_no_checkpoint(make_config):
    cfg = make_config()
    model = _model(cfg, frozenset())
    tokens = _tokens(cfg)
    with torch.no_grad():
        plain = model(tokens).logits_BSV
        model.set_recompute(FULL)
        assert all(b.recompute_block for b in model.layers)
        assert torch.equal(model(tokens).logits_BSV, plain)


HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def _host_reads_raise():
    """A CPU stand-in for `forbid_host_syncs` (`runtime.observe.metrics.no_host_syncs` checks
    only on CUDA, through torch.cuda.set_sync_debug_mode): every Tensor method that reads a
    value back to the host raises inside the block."""
    def refuse(name):
        def read(*_args, **_kwargs):
            raise RuntimeError(f"Tensor.{name} read a value back to the host inside the step")
        return read

    with pytest.MonkeyPatch.context() as patch:
        for name in HOST_READS:
            patch.setattr(torch.Tensor, name, refuse(name))
        yield


def test_a_full_recompute_step_reads_nothing_back_to_the_host(make_mla_config):
    """grouped_mm experts (no host read of their offsets), the MLA model with its group-limited
    router, bias and dense first layer: forward and backward under `recompute: full` make no host
    read; the loop experts' offsets read (`.tolist()`) shows the stand-in catches one."""
    cfg = make_mla_config()
    tokens = _tokens(cfg)
    model = _model(cfg, FULL, backend="grouped_mm")
    with _host_reads_raise():
        loss, _ = _loss(model, tokens)
        loss.backward()
    assert all(p.grad is not None for p in model.moe_blocks[0].moe.experts.parameters())
    with _host_reads_raise(), pytest.raises(RuntimeError, match="Tensor.tolist read a value back"):
        _loss(_model(cfg, FULL, backend="loop"), tokens)


@pytest.mark.slow
def test_full_recomputation_with_the_triton_experts(interpreted, make_config, monkeypatch):
    """The triton experts with the Triton permute and combine (the GPU's path, `fuses_permute`,
    here under Triton's interpreter on CPU tensors), the destinations kept in `SavedRouting` and
    never computed again: the plain run's bits, a whole model and an expert rank's share."""
    interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.permute", "disagmoe.kernels.moe_ffn")
    from disagmoe.kernels import permute

    monkeypatch.setattr(RoutedExperts, "fuses_permute", lambda experts, x: experts.backend == "triton")
    destinations = permute.pair_destinations
    computed = []
    monkeypatch.setattr(permute, "pair_destinations", lambda *a: computed.append(1) or destinations(*a))
    cfg = make_config(num_shared_experts=1)
    plain_loss, plain, _ = _step(cfg, frozenset(), backend="triton")
    computed.clear()
    loss, grads, _ = _step(cfg, FULL, backend="triton", deferred=True)
    assert len(computed) == cfg.num_moe_layers  # in the forward only: the recomputation reuses them
    assert torch.equal(loss, plain_loss)
    for n in plain:
        assert torch.equal(grads[n], plain[n]), n
    test_an_expert_ranks_share_recomputes_from_its_rows_and_kept_grouping("triton")


def test_full_is_a_recompute_choice_of_any_backend_that_ignores_recompute_modules():
    for backend in ("loop", "grouped_mm", "triton"):
        assert TrainConfig(model="tiny", recompute="full", experts_backend=backend).recompute_set == FULL
    # recompute_modules names what selective drops; full recomputes every module, so a list is ignored
    named = TrainConfig(model="tiny", recompute="full", recompute_modules=["attention"])
    assert named.recompute_set == FULL
    with pytest.raises(ValueError, match="precision: fp8 needs .*recompute: none or selective with "
                                         r"recompute_modules such as \[expert_input, expert_swiglu\] \(under full"):
        TrainConfig(model="tiny", recompute="full", precision="fp8", device="cuda", experts_backend="triton")
    with pytest.raises(ValueError, match="recompute"):
        TrainConfig(model="tiny", recompute="everything")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_full_recomputation_is_the_plain_run_and_lowers_the_peak(request, name):
    """bf16 on CUDA, triton experts (the Triton permute with kept destinations), fused norms and
    RoPE inside the checkpoint: the gradients within bf16 rounding of the plain run, the peak lower."""
    cfg = _model_cfg(request, name).model_copy(update={"seq_len": 1024})

    def run(recompute):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = _model(cfg, recompute, backend="triton").to(device="cuda", dtype=torch.bfloat16)
        tokens = torch.randint(0, cfg.vocab_size, (8, 1024), generator=torch.Generator().manual_seed(0)).cuda()
        loss, _ = _loss(model, tokens)
        loss.backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return loss.item(), grads, torch.cuda.max_memory_allocated() - base

    plain_loss, plain, plain_peak = run(frozenset())
    loss, grads, peak = run(FULL)
    assert loss == pytest.approx(plain_loss, rel=1e-3)
    for n in plain:
        err = ((grads[n] - plain[n]).norm() / plain[n].norm().clamp_min(1e-12)).item()
        assert err <= 2e-2, (n, err)
    assert peak < plain_peak, (peak, plain_peak)
