"""`recompute_modules: [attention]` (model/block.py `Block.attention_part`, kernels/recompute.py):
the attention block keeps only its input and the output projection's input, and the backward runs
the norm, the projections, qk-norm, RoPE and the core again. In fp32 on the CPU every gradient is
the plain run's to the bit (the same ops on the same values), for grouped-query attention with and
without qk-norm and for MLA, with deferred weight gradients, and combined with the triton experts'
modules; what autograd keeps per layer drops by at least the memory model's amount and keeps
exactly what the model says it keeps. On a GPU (bf16, fused elementwise kernels) the same holds
within rounding and the peak memory falls."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels.deferral import deferred_weight_grads
from disagmoe.kernels.recompute import ATTENTION, MODULES, RECOMPUTABLE
from disagmoe.model.transformer import MoETransformer
from disagmoe.roofline import memory as mem

MODELS = {  # name -> (the conftest fixture that builds it, its overrides)
    "gqa": ("make_config", dict(num_shared_experts=1)),
    "gqa-qk-norm": ("make_config", dict(qk_norm=True, num_layers=3, num_dense_layers=1, dense_ffn_size=12)),
    "mla": ("make_mla_config", {}),
}


def _model_cfg(request, name):
    fixture, overrides = MODELS[name]
    return request.getfixturevalue(fixture)(**overrides)


def _tokens(cfg, batch=2, seq=8, seed=0):
    return torch.randint(0, cfg.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _step(cfg, recompute, backend="loop", deferred=False, device="cpu", dtype=torch.float32):
    """Loss and every parameter's gradient of one forward and backward (the same seed and tokens)."""
    model = MoETransformer(cfg, experts_backend=backend)
    model.init_weights(seed=3)
    model.to(device=device, dtype=dtype)
    model.set_recompute(frozenset(recompute))
    tokens = _tokens(cfg).to(device)
    out = model(tokens)
    loss = torch.nn.functional.cross_entropy(out.logits_BSV.flatten(0, 1).float(), tokens.flatten())
    loss = loss + out.aux_loss + out.z_loss
    if deferred:
        with deferred_weight_grads() as held:
            loss.backward()
        assert held, "the projections' weight gradients waited"
        for work in held:
            work()
    else:
        loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}, model


@pytest.mark.parametrize("deferred", [False, True], ids=["eager", "deferred"])
@pytest.mark.parametrize("name", list(MODELS))
def test_recomputed_attention_gives_the_same_bits_in_fp32(request, name, deferred):
    cfg = _model_cfg(request, name)
    plain_loss, plain, _ = _step(cfg, frozenset(), deferred=deferred)
    loss, grads, model = _step(cfg, {ATTENTION}, deferred=deferred)
    assert all(b.recompute_attention for b in model.layers)
    assert torch.equal(loss, plain_loss)
    assert grads.keys() == plain.keys()
    for n in plain:
        assert torch.equal(grads[n], plain[n]), n


@pytest.mark.slow
def test_recomputed_attention_with_the_triton_experts_modules(interpreted, make_config):
    """Every module at once (the triton experts under Triton's interpreter): the plain run's bits."""
    interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.permute", "disagmoe.kernels.moe_ffn")
    cfg = make_config()
    plain_loss, plain, _ = _step(cfg, frozenset(), backend="triton")
    loss, grads, _ = _step(cfg, frozenset(MODULES), backend="triton", deferred=True)
    assert torch.equal(loss, plain_loss)
    for n in plain:
        assert torch.equal(grads[n], plain[n]), n


def _saved_bytes(block, x):
    """Bytes of the distinct storages autograd saves in `block.attention_part(x)`, parameters aside
    (a non-reentrant checkpoint saves its input through the hooks too)."""
    params = {p.untyped_storage().data_ptr() for p in block.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block.attention_part(x)
    return sum(seen.values())


@pytest.mark.parametrize("name", list(MODELS))
def test_recomputed_attention_keeps_what_the_memory_model_says(request, name):
    cfg = _model_cfg(request, name)
    model = MoETransformer(cfg)
    block = model.layers[-1]
    tokens = 16
    x = torch.randn(2, tokens // 2, cfg.hidden_size, requires_grad=True)
    plain = _saved_bytes(block, x)
    block.set_recompute(frozenset({ATTENTION}))
    lean = _saved_bytes(block, x)
    o_in = cfg.num_heads * (cfg.mla.v_head_dim if cfg.mla else cfg.head_dim)
    assert lean == tokens * 4 * (cfg.hidden_size + o_in)  # the block's input and the o-projection's
    # the model's terms are what SDPA saves on a GPU (flash: no score matrix); the CPU's math
    # kernel saves more, so the measured drop is at least the modelled one
    assert plain - lean >= tokens * mem.attention_recomputed_bytes(cfg, 4)
    for moe in (True, False):
        drop = mem.attention_bytes(cfg, moe, 2) - mem.attention_bytes(cfg, moe, 2, frozenset({ATTENTION}))
        assert drop == mem.attention_recomputed_bytes(cfg, 2)
        grad = mem.attention_grad_bytes(cfg, moe, 2, frozenset({ATTENTION})) - mem.attention_grad_bytes(cfg, moe, 2)
        assert grad == drop  # the backward holds them again for the layer's span


def test_no_grad_forward_runs_no_checkpoint(make_config):
    cfg = make_config()
    model = MoETransformer(cfg)
    tokens = _tokens(cfg)
    with torch.no_grad():
        plain = model(tokens).logits_BSV
        model.set_recompute(frozenset({ATTENTION}))
        assert torch.equal(model(tokens).logits_BSV, plain)


def test_attention_is_a_module_recompute_selective_may_name():
    from disagmoe.config import TrainConfig

    run = TrainConfig(model="tiny", recompute="selective", recompute_modules=["attention"])  # any backend
    assert run.recompute_set == {ATTENTION}
    run = TrainConfig(model="tiny", recompute="selective", experts_backend="triton",
                      recompute_modules=[*RECOMPUTABLE, "attention"])
    assert run.recompute_set == frozenset(MODULES)
    with pytest.raises(ValueError, match="expert_input drops the triton experts' saved rows.*recompute_modules: "
                                         r"\[attention\] \(any backend\)"):
        TrainConfig(model="tiny", recompute="selective", recompute_modules=["attention", "expert_input"])
    with pytest.raises(ValueError, match="names a module twice"):
        TrainConfig(model="tiny", recompute="selective", recompute_modules=["attention", "attention"])
    assert TrainConfig(model="tiny", recompute="none", recompute_modules=["attention"]).recompute_set == frozenset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(MODELS))
def test_gpu_recomputed_attention_is_the_plain_run_and_lowers_the_peak(request, name):
    """bf16 on CUDA with the fused (torch.compile'd) norms and RoPE inside the checkpoint: the
    gradients within bf16 rounding of the plain run, and the peak lower (a model large enough
    that the attention's internals dominate)."""
    cfg = _model_cfg(request, name).model_copy(update={"seq_len": 1024})
    torch.manual_seed(0)

    def run(recompute):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        model = MoETransformer(cfg, experts_backend="triton")
        model.init_weights(seed=3)
        model.to(device="cuda", dtype=torch.bfloat16)
        model.set_recompute(frozenset(recompute))
        tokens = torch.randint(0, cfg.vocab_size, (8, 1024), generator=torch.Generator().manual_seed(0)).cuda()
        out = model(tokens)
        loss = torch.nn.functional.cross_entropy(out.logits_BSV.flatten(0, 1).float(), tokens.flatten())
        (loss + out.aux_loss + out.z_loss).backward()
        torch.cuda.synchronize()
        grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
        return loss.item(), grads, torch.cuda.max_memory_allocated() - base

    plain_loss, plain, plain_peak = run(frozenset())
    loss, grads, peak = run({ATTENTION})
    assert loss == pytest.approx(plain_loss, rel=1e-3)
    for n in plain:
        err = ((grads[n] - plain[n]).norm() / plain[n].norm().clamp_min(1e-12)).item()
        assert err <= 2e-2, (n, err)
    assert peak < plain_peak, (peak, plain_peak)
