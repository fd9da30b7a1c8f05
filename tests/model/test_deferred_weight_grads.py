"""Weight gradients held back until the input gradient is out (disagmoe/model/layers.py:
`DeferrableLinear`, `deferred_weight_grads`): a block's backward inside the context gives the
plain backward's input and parameter gradients bit for bit once the held-back work has run, and
the plain backward is `nn.Linear`'s."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from torch import nn
from torch.func import functional_call

from disagmoe.config import ModelConfig, OptimConfig
from disagmoe.model.block import DenseBlock
from disagmoe.model.layers import DeferrableLinear
from disagmoe.kernels.deferral import deferred_weight_grads
from disagmoe.runtime.state.flat_adamw import FlatAdamW

CASES = {  # attention, dense FFN (the shared experts' SwiGLU) and the norms of one block
    "gqa": ("gqa", dict(dense_ffn_size=12)),
    "gqa-qk-norm": ("gqa", dict(dense_ffn_size=12, qk_norm=True)),
    "mla": ("mla", {}),
    "mla-without-q-lora": ("mla", dict(mla=dict(q_lora_rank=None, kv_lora_rank=6, qk_nope_head_dim=4,
                                                qk_rope_head_dim=2, v_head_dim=4))),
}


@pytest.fixture(params=CASES)
def cfg(request, make_config, make_mla_config) -> ModelConfig:
    attention, overrides = CASES[request.param]
    return (make_mla_config if attention == "mla" else make_config)(**overrides)


def random_block(cfg: ModelConfig, dtype: torch.dtype) -> DenseBlock:
    """A block of `cfg` whose parameters (norm gains too) are random, in `dtype`."""
    block = DenseBlock(cfg).to(dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return block


def inputs(block: DenseBlock, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [B, S, H] and the gradient d out that comes back for it."""
    g = torch.Generator().manual_seed(seed)
    hidden = block.attention_norm.weight.shape[0]
    return (torch.randn(2, 7, hidden, generator=g).to(dtype).requires_grad_(),
            torch.randn(2, 7, hidden, generator=g).to(dtype))


def projections(block: nn.Module) -> set[str]:
    return {f"{name}.weight" for name, m in block.named_modules() if isinstance(m, DeferrableLinear)}


def backward(block: DenseBlock, x_BSH: torch.Tensor, dy_BSH: torch.Tensor, defer: bool) -> list:
    """Backpropagate d out; inside `deferred_weight_grads` when `defer` (returns the held work)."""
    if not defer:
        block(x_BSH).backward(dy_BSH)
        return []
    with deferred_weight_grads() as held:
        block(x_BSH).backward(dy_BSH)
    return held


def grads(block: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in block.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_back_weight_gradients_equal_the_plain_backward_bit_for_bit(cfg, dtype):
    """Inside the context: the input gradient and the norms' gains at once, no projection weight
    gradient, one held item per projection; once run, every gradient is the plain backward's."""
    plain, deferred = random_block(cfg, dtype), random_block(cfg, dtype)
    x_plain, dy_BSH = inputs(plain, dtype, seed=1)
    x_deferred = x_plain.detach().clone().requires_grad_()
    backward(plain, x_plain, dy_BSH, defer=False)
    held = backward(deferred, x_deferred, dy_BSH, defer=True)
    assert torch.equal(x_deferred.grad, x_plain.grad)
    assert len(held) == len(projections(deferred))
    assert set(grads(deferred)) == set(grads(plain)) - projections(deferred)
    for item in held:
        item()
    want, got = grads(plain), grads(deferred)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_outside_the_context_the_projections_are_nn_linear_bit_for_bit(cfg):
    """The plain backward's gradients (fp64, the gradcheck dtype, and fp32) equal those of the
    same block whose projections run `nn.Linear.forward`: nothing changes for the oracle."""
    for dtype in (torch.float64, torch.float32):
        ours = random_block(cfg, dtype)
        linear = copy.deepcopy(ours)
        for m in linear.modules():
            if isinstance(m, DeferrableLinear):
                m.forward = types.MethodType(nn.Linear.forward, m)
        x_ours, dy_BSH = inputs(ours, dtype, seed=2)
        x_linear = x_ours.detach().clone().requires_grad_()
        out_ours, out_linear = ours(x_ours), linear(x_linear)
        assert torch.equal(out_ours, out_linear)
        out_ours.backward(dy_BSH)
        out_linear.backward(dy_BSH)
        assert torch.equal(x_ours.grad, x_linear.grad)
        want = grads(linear)
        for name, grad in grads(ours).items():
            assert torch.equal(grad, want[name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_held_back_gradients_land_in_flat_adamws_main_gradients(make_config, dtype):
    """With FlatAdamW (fp32: `.grad` is the main gradient's view; bf16: the post-accumulate hook
    adds into `main_grad`) two micro-batches leave the same main gradients, bit for bit."""
    main = {}
    for defer in (False, True):
        block = random_block(make_config(dense_ffn_size=12, qk_norm=True), torch.float32)
        optimizer = FlatAdamW(block.named_parameters(), OptimConfig(), dtype)
        optimizer.zero_grad()
        for mb in range(2):
            x_BSH, dy_BSH = inputs(block, dtype, seed=10 + mb)
            for item in backward(block, x_BSH, dy_BSH, defer):
                item()
        main[defer] = [b.grad_N.clone() for b in optimizer.buckets]
        assert all(p.grad is None or p.grad.dtype == torch.float32 for p in block.parameters())
    assert all(torch.equal(got, want) for got, want in zip(main[True], main[False], strict=True))
    assert all(g.any() for g in main[True])


def test_non_leaf_weights_are_not_held_back(make_config):
    """Weights that are not leaves (e.g. `functional_call` over a flat vector, as the gradcheck
    does) get their gradients inside the backward even in the context: autograd must carry them
    on to their leaf, which a later accumulation could not."""
    block = random_block(make_config(dense_ffn_size=12), torch.float32)
    names = [name for name, _ in block.named_parameters()]
    flat = torch.cat([p.detach().reshape(-1) for p in block.parameters()]).requires_grad_()
    views = dict(zip(names, (v.view_as(p) for v, p in zip(flat.split([p.numel() for p in block.parameters()]),
                                                          block.parameters(), strict=True)), strict=True))
    x_BSH, dy_BSH = inputs(block, torch.float32, seed=3)
    with deferred_weight_grads() as held:
        functional_call(block, views, (x_BSH,)).backward(dy_BSH)
    assert held == []
    backward(block, x_BSH.detach().requires_grad_(), dy_BSH, defer=False)
    want = torch.cat([p.grad.reshape(-1) for p in block.parameters()])
    assert torch.equal(flat.grad, want)


@pytest.mark.parametrize("recompute", [{"attention"}, {"block"}], ids=["selective-attention", "full"])
def test_held_back_gradients_of_a_recomputed_block_land_on_its_parameters_after_its_graph_is_gone(cfg, recompute):
    """Inside a checkpoint (`recompute`) a projection's saved weight unpacks as an alias whose link
    to the parameter's gradient accumulator is weak: a rank frees the segment's graph before it
    runs the held-back work (after its sends). The work still accumulates into the parameters
    themselves, FlatAdamW's fp32 main gradients here, bit for bit the plain backward's."""
    main = {}
    for lean in (False, True):
        block = random_block(cfg, torch.float32)
        block.set_recompute(frozenset(recompute) if lean else frozenset())
        optimizer = FlatAdamW(block.named_parameters(), OptimConfig(), torch.float32)
        optimizer.zero_grad()
        x_BSH, dy_BSH = inputs(block, torch.float32, seed=4)
        held = backward(block, x_BSH, dy_BSH, defer=True)  # the block's output and graph are gone on return
        assert len(held) == len(projections(block))
        for item in held:
            item()
        main[lean] = [b.grad_N.clone() for b in optimizer.buckets]
    assert all(torch.equal(got, want) for got, want in zip(main[True], main[False], strict=True))


def test_a_cpu_weight_gradient_is_left_to_autograd():
    """`add_weight_grad_into_main` acts on CUDA only: on the CPU (and in double backward, and for a
    weight without a main gradient) it declines and the caller returns d W to autograd."""
    from disagmoe.model.layers import add_weight_grad_into_main

    w = nn.Parameter(torch.zeros(3, 4, dtype=torch.bfloat16))
    w.main_grad = torch.zeros(3, 4)
    dy, x = torch.ones(5, 3, dtype=torch.bfloat16), torch.ones(5, 4, dtype=torch.bfloat16)
    with torch.no_grad():
        assert not add_weight_grad_into_main(w, dy, x)
        assert not add_weight_grad_into_main(None, dy, x)
    assert not w.main_grad.any()


@pytest.mark.gpu
@pytest.mark.parametrize("defer", [False, True], ids=["inline", "held-back"])
def test_cuda_bf16_projection_gradients_go_into_the_main_gradients_by_the_gemm(make_mla_config, defer):
    """On CUDA with FlatAdamW over bf16 parameters the projections' d W is added into the fp32 main
    gradients by the GEMM (fp32 C, beta = 1), inline and held back alike: no bf16 `.grad` is left on
    them, and over two micro-batches the main gradients are autograd's path's (bf16 d W added by
    FlatAdamW's hook) within the bf16 rounding that path applies to each d W."""
    from disagmoe.model import layers

    cuda = torch.device("cuda")
    main = {}
    for fused_path in (True, False):
        block = random_block(make_mla_config(), torch.float32).to(cuda).to(torch.bfloat16)
        optimizer = FlatAdamW(block.named_parameters(), OptimConfig(), torch.bfloat16)
        optimizer.zero_grad()
        if not fused_path:
            layers._Fp32AccumulatorGemm.supported = False  # autograd's path: bf16 d W, the hook's add
        try:
            for mb in range(2):
                x_BSH, dy_BSH = inputs(block, torch.bfloat16, seed=20 + mb)
                for item in backward(block, x_BSH.to(cuda).detach().requires_grad_(), dy_BSH.to(cuda), defer):
                    item()
        finally:
            layers._Fp32AccumulatorGemm.supported = None
        torch.cuda.synchronize()
        main[fused_path] = {name: p.main_grad.clone() for name, p in block.named_parameters()}
        if fused_path:
            assert all(p.grad is None for name, p in block.named_parameters() if name in projections(block))
    for name in projections(block):
        got, want = main[True][name], main[False][name]
        assert got.dtype == torch.float32 and got.any(), name
        # autograd's bf16-rounded d W per micro-batch against the unrounded sum: bf16's 2^-8
        torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7 * want.abs().max().item(), msg=name)
