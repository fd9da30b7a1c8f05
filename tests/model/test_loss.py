"""Chunked LM head + cross-entropy (disagmoe/model/loss.py) against logits materialised whole."""

import pytest
import torch
import torch.nn.functional as F

from disagmoe.model.loss import chunk_size, linear_cross_entropy


@pytest.mark.parametrize("tokens,vocab,chunk", [(37, 11, 8), (64, 50, 64), (5, 3, 1), (100, 7, None)])
def test_matches_full_logits_loss_and_gradients(tokens: int, vocab: int, chunk: int | None) -> None:
    g = torch.Generator().manual_seed(tokens * vocab)
    h = torch.randn(tokens, 16, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(vocab, 16, generator=g, dtype=torch.float64, requires_grad=True)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    loss = linear_cross_entropy(h, w, t, chunk)
    (2.5 * loss).backward()
    h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref = F.cross_entropy(h_ref @ w_ref.T, t)
    (2.5 * ref).backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=0)  # fp32 log-softmax
    torch.testing.assert_close(h.grad, h_ref.grad, rtol=1e-5, atol=1e-6)  # fp32 softmax
    torch.testing.assert_close(w.grad, w_ref.grad, rtol=1e-5, atol=1e-6)  # fp32 softmax


def test_no_grad_forward_and_bad_shapes() -> None:
    h, w, t = torch.randn(9, 4), torch.randn(6, 4), torch.randint(0, 6, (9,))
    with torch.no_grad():
        loss = linear_cross_entropy(h, w, t, 4)
    torch.testing.assert_close(loss, F.cross_entropy(h @ w.T, t))
    with pytest.raises(ValueError, match="wants h"):
        linear_cross_entropy(h, w.T, t)


def test_chunk_keeps_big_vocabularies_near_256_mib_of_logits() -> None:
    assert chunk_size(8192, 151_936) * 151_936 * 4 <= 1 << 28
    assert chunk_size(8192, 151_936, None, 2) * 151_936 * 2 <= 1 << 28  # the fused kernel's bf16 logits
    assert chunk_size(8192, 151_936, None, 2) > 1.9 * chunk_size(8192, 151_936)
    assert chunk_size(8192, 4096) == 4096 and chunk_size(100, 4096) == 100


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_peak_memory_of_a_qwen3_vocabulary_stays_bounded() -> None:
    """8k tokens x 151,936 vocabulary: whole fp32 logits and their gradient would be ~10 GB; the
    chunked loss keeps the head's fp32 gradient (1.2 GB), its bf16 copy and one chunk's logits."""
    device = torch.device("cuda")
    h = torch.randn(8192, 2048, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(151_936, 2048, device=device, dtype=torch.bfloat16) * 0.02).requires_grad_()
    t = torch.randint(0, 151_936, (8192,), device=device)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(h, w, t).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 4 * 2**30, f"the loss took {extra / 2**30:.1f} GiB beyond its inputs"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch-ops"])
def test_gpu_the_heads_peak_is_what_the_memory_model_counts(fused: bool) -> None:
    """Qwen3-30B's head over 8k tokens into FlatAdamW's fp32 main gradient, as a training step runs it: the
    memory beyond its inputs at the peak is `roofline.memory.head_bytes` less the final norm's input (no norm
    here), within the allocator's rounding and cuBLAS's workspace."""
    from disagmoe.model_ref import load_model
    from disagmoe.roofline import memory as mem

    m = load_model("qwen3-30b-a3b")
    device, tokens = torch.device("cuda"), 8192
    h = torch.randn(tokens, m.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(m.vocab_size, m.hidden_size, device=device, dtype=torch.bfloat16) * 0.02)
    w.main_grad = torch.zeros(w.shape, device=device)
    t = torch.randint(0, m.vocab_size, (tokens,), device=device)
    linear_cross_entropy(h, w, t, fused=fused).backward()  # warm-up: cuBLAS's workspace, the kernel's compile
    h.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    linear_cross_entropy(h, w, t, fused=fused).backward()
    torch.cuda.synchronize()
    measured = torch.cuda.max_memory_allocated() - base
    counted = mem.head_bytes(m, tokens, 2, fused=fused) - tokens * 2 * m.hidden_size
    assert counted - 2**26 <= measured <= counted + 2**26, (measured / 2**20, counted / 2**20)


def test_the_head_gradient_goes_into_an_fp32_main_gradient_where_there_is_one() -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(20, 8, generator=g, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(11, 8, generator=g).to(torch.bfloat16))
    w.main_grad = torch.zeros(11, 8)
    t = torch.randint(0, 11, (20,), generator=g)
    for _ in range(2):
        linear_cross_entropy(h.to(torch.bfloat16), w, t, 7).backward()
    assert w.grad is None
    w_ref = w.detach().float().requires_grad_()
    F.cross_entropy(h.detach().to(torch.bfloat16).float() @ w_ref.T, t).backward()
    torch.testing.assert_close(w.main_grad, 2 * w_ref.grad, rtol=3e-2, atol=3e-3)  # bf16 operands


def test_the_fused_softmax_runs_where_asked_and_on_cuda_by_default(monkeypatch) -> None:
    """`fused=True` runs each chunk's softmax in `kernels.cross_entropy` (here spied on: the kernel's own tests are
    tests/kernels/test_cross_entropy.py), `fused=False` torch's ops; the default is the fused one on CUDA tensors
    unless a run turned it off (`set_fused_loss`), never on the CPU."""
    from disagmoe.model import loss

    ran = []
    monkeypatch.setattr(loss, "_fused_chunk", lambda *a: ran.append("fused") or loss._torch_chunk(*a))
    monkeypatch.setattr(loss._Fused, "enabled", True)
    h, w, t = torch.randn(9, 4), torch.randn(6, 4), torch.randint(0, 6, (9,))
    for fused, want in ((True, ["fused"] * 3), (False, []), (None, [])):  # 3 chunks of 4; the CPU: torch's
        ran.clear()
        linear_cross_entropy(h.requires_grad_(), w, t, 4, fused=fused).backward()
        assert ran == want, fused
    on_cuda = torch.empty(0, device="meta")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: self.device.type == "meta"))
    assert loss._fused_default(on_cuda) is True
    loss.set_fused_loss(False)
    assert loss._fused_default(on_cuda) is False
