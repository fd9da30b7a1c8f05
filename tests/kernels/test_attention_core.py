"""`kernels/attention_core.py`: inside the attention block's recomputing checkpoint the core runs its
kernel once (the forward), keeps its output, and its backward is F.sdpa's: gradients to the bit of
the plain run, for grouped-query heads and for a value head dim other than the query's (MLA); other
backends run as F.sdpa and are recomputed; without grad nothing is kept."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from disagmoe.kernels import attention_core
from disagmoe.kernels.attention_core import KeptCore, causal_attention

SHAPES = {  # name -> (B, n, g, S, D, Dv, gqa)
    "gqa": (2, 8, 2, 24, 16, 16, True),
    "mha": (1, 4, 4, 17, 32, 32, False),
    "mla-like": (2, 4, 4, 9, 24, 16, False),
}


def _count_kernels(monkeypatch) -> list[int]:
    launched: list[int] = []
    real = attention_core._forward

    def counted(backend, *args):
        launched.append(backend)
        return real(backend, *args)

    monkeypatch.setattr(attention_core, "_forward", counted)
    return launched


def _block(x_BSH, w_qkv, shape, kept):
    """A stand-in for the block's core: projections to q, k, v (saved by autograd: the checkpoint
    drops them), heads-first, the core, heads back."""
    B, n, g, S, D, Dv, gqa = shape
    q, k, v = (x_BSH @ w_qkv).split([n * D, g * D, g * Dv], dim=-1)
    q, k, v = (t.view(B, S, -1, d).transpose(1, 2) for t, d in ((q, D), (k, D), (v, Dv)))
    o = causal_attention(torch.tanh(q), k * 1.5, v, kept, gqa=gqa)
    return o.transpose(1, 2).reshape(B, S, n * Dv)


def _grads(shape, device, dtype, kept_core: bool, seed=0):
    B, n, g, S, D, Dv, _ = shape
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, S, 32, generator=gen).to(device, dtype).requires_grad_()
    w = (torch.randn(32, n * D + g * D + g * Dv, generator=gen) / 6).to(device, dtype).requires_grad_()
    dy = torch.randn(B, S, n * Dv, generator=gen).to(device, dtype)
    if kept_core:
        out = checkpoint(lambda x_, w_, kept: _block(x_, w_, shape, kept), x, w, KeptCore(), use_reentrant=False,
                         preserve_rng_state=False)
    else:
        out = _block(x, w, shape, None)
    out.backward(dy)
    return out.detach(), x.grad, w.grad


@pytest.mark.parametrize("name", list(SHAPES))
def test_the_kept_core_runs_its_kernel_once_and_gives_the_plain_bits(monkeypatch, name):
    shape = SHAPES[name]
    plain = _grads(shape, "cpu", torch.float32, kept_core=False)
    launched = _count_kernels(monkeypatch)
    kept = _grads(shape, "cpu", torch.float32, kept_core=True)
    # the forward's launch, the recomputation's none; the CPU's flash kernel takes one head dim only
    # (a value head dim other than the query's runs the math kernel: as F.sdpa, recomputed)
    assert launched == ([attention_core.FLASH] if shape[4] == shape[5] else [])
    for a, b in zip(kept, plain, strict=True):
        assert torch.equal(a, b)


def test_another_backend_runs_as_sdpa_and_is_recomputed(monkeypatch):
    shape = SHAPES["gqa"]
    with sdpa_kernel(SDPBackend.MATH):
        plain = _grads(shape, "cpu", torch.float32, kept_core=False)
        launched = _count_kernels(monkeypatch)
        kept = _grads(shape, "cpu", torch.float32, kept_core=True)
    assert launched == []
    for a, b in zip(kept, plain, strict=True):
        assert torch.equal(a, b)


def test_without_grad_nothing_is_kept(monkeypatch):
    launched = _count_kernels(monkeypatch)
    q = torch.randn(1, 2, 5, 8)
    kept = KeptCore()
    with torch.no_grad():
        o = causal_attention(q, q, q, kept)
    assert launched == [] and kept.out_BnSD is None
    assert torch.equal(o, F.scaled_dot_product_attention(q, q, q, is_causal=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", list(SHAPES))
def test_gpu_the_kept_core_runs_its_kernel_once_and_gives_the_plain_bits(monkeypatch, name):
    """bf16 on the GPU: the kernel F.sdpa picks (cuDNN or flash), once; the gradients are the
    plain run's wherever the plain run repeats its own bits (cuDNN's backward may not)."""
    B, n, g, S, D, Dv, gqa = SHAPES[name]
    shape = (B, n, g, 256, 64, 64 if Dv == D else 32, gqa)  # head dims the fused kernels take
    plain = _grads(shape, "cuda", torch.bfloat16, kept_core=False)
    again = _grads(shape, "cuda", torch.bfloat16, kept_core=False)
    launched = _count_kernels(monkeypatch)
    kept = _grads(shape, "cuda", torch.bfloat16, kept_core=True)
    q = torch.empty(B, n, 256, 64, device="cuda", dtype=torch.bfloat16)
    kv = torch.empty(B, g, 256, shape[5], device="cuda", dtype=torch.bfloat16)
    chosen = attention_core.fused_backend(q, q[:, :g], kv, None, gqa)
    assert chosen in (attention_core.CUDNN, attention_core.FLASH) and launched == [chosen]
    for a, b, c in zip(kept, plain, again, strict=True):
        if torch.equal(b, c):
            assert torch.equal(a, b)
        else:
            assert (a.float() - b.float()).abs().max() <= 2 * (c.float() - b.float()).abs().max()


def test_the_backward_lets_the_kept_output_go_though_the_graph_lives_on(monkeypatch):
    """A trainer holds the last micro-batch's loss (and so its graph) while the next forward runs:
    the kept output, log-sum-exp and kernel outputs must not live that long (plain F.sdpa's autograd
    node frees them at its backward); a second backward through the graph is refused by name."""
    import weakref

    shape = SHAPES["gqa"]
    B, n, g, S, D, Dv, _ = shape
    x = torch.randn(B, S, 32, requires_grad=True)
    w = (torch.randn(32, n * D + g * D + g * Dv) / 6).requires_grad_()
    kept = KeptCore()
    out = checkpoint(lambda x_, w_, k: _block(x_, w_, shape, k), x, w, kept, use_reentrant=False,
                     preserve_rng_state=False)
    alive = weakref.ref(kept.out_BnSD)
    loss = out.square().sum()
    loss.backward(retain_graph=True)
    assert kept.out_BnSD is None and kept.aux == () and alive() is None  # the graph (loss) still lives
    with pytest.raises(RuntimeError, match="retain_graph is not supported"):
        loss.backward()


def test_the_recomputation_takes_the_forwards_kernel_whatever_the_backends_allow_then(monkeypatch):
    """The recomputation must save what the forward saved: it takes the forward's choice even where
    the backends allowed in the backward differ (a `sdpa_kernel` context around the forward only)."""
    shape = SHAPES["mha"]
    plain = _grads(shape, "cpu", torch.float32, kept_core=False)
    launched = _count_kernels(monkeypatch)
    B, n, g, S, D, Dv, _ = shape
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(B, S, 32, generator=gen).requires_grad_()
    w = (torch.randn(32, n * D + g * D + g * Dv, generator=gen) / 6).requires_grad_()
    dy = torch.randn(B, S, n * Dv, generator=gen)
    with sdpa_kernel(SDPBackend.MATH):  # the forward: math, so F.sdpa, recomputed as F.sdpa
        out = checkpoint(lambda x_, w_, k: _block(x_, w_, shape, k), x, w, KeptCore(), use_reentrant=False,
                         preserve_rng_state=False)
    out.backward(dy)  # the backward allows flash again; the recomputation still runs F.sdpa's math
    assert launched == []
    for a, b in zip((out.detach(), x.grad, w.grad), plain, strict=True):
        torch.testing.assert_close(a, b)
