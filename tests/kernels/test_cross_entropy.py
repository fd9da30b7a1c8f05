"""The fused softmax cross-entropy kernel (disagmoe/kernels/cross_entropy.py) against its torch reference:
interpreted on the CPU in fp32 at random shapes, on a GPU in bf16; and `model.loss` with it against torch's ops."""

import pytest
import torch

from disagmoe.kernels import cross_entropy as ce


def _case(seed: int, rows: int, vocab: int, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    logits_CV = (torch.randn(rows, vocab, generator=g) * 4).to(device=device, dtype=dtype)
    targets_C = torch.randint(0, vocab, (rows,), generator=g).to(device)
    return logits_CV, targets_C


@pytest.mark.parametrize("seed", range(6))
def test_the_kernel_matches_its_reference_at_random_shapes_in_the_interpreter(interpreted, monkeypatch, seed):
    """Random rows (none included) and vocabularies (not powers of 2), the online max and sum over several V
    blocks (the block shrunk to 8 or 16 so that the interpreter walks many), with and without gradients."""
    kernels = interpreted("disagmoe.kernels.cross_entropy")
    g = torch.Generator().manual_seed(100 + seed)
    rows, vocab = int(torch.randint(0, 9, (), generator=g)), int(torch.randint(1, 70, (), generator=g))
    monkeypatch.setattr(kernels, "block_v", lambda v: 8 if seed % 2 else 16)
    logits_CV, targets_C = _case(seed, rows, vocab)
    for divisor in (None, 37.0):
        want_loss, want_d = ce.softmax_cross_entropy_reference(logits_CV, targets_C, divisor)
        got_logits = logits_CV.clone()
        got_loss = kernels.softmax_cross_entropy_(got_logits, targets_C, divisor)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
        if divisor is None:
            assert torch.equal(got_logits, logits_CV)  # the logits left as they were
        else:
            torch.testing.assert_close(got_logits, want_d, rtol=1e-5, atol=1e-7)


def test_a_strided_chunk_of_rows_and_int32_targets(interpreted):
    """A row slice of a wider buffer (row stride past V) and int32 targets: the rows it owns alone change."""
    kernels = interpreted("disagmoe.kernels.cross_entropy")
    buffer = torch.randn(5, 24, generator=torch.Generator().manual_seed(3))
    logits_CV, targets_C = buffer[:, :19], torch.tensor([0, 18, 7, 3, 11], dtype=torch.int32)
    want_loss, want_d = ce.softmax_cross_entropy_reference(logits_CV, targets_C, 5.0)
    spare = buffer[:, 19:].clone()
    got_loss = kernels.softmax_cross_entropy_(logits_CV, targets_C, 5.0)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(buffer[:, :19], want_d, rtol=1e-5, atol=1e-7)
    assert torch.equal(buffer[:, 19:], spare)


def test_minus_infinity_logits_and_strided_targets(interpreted, monkeypatch):
    """-inf logits (a masked vocabulary) filling the first blocks of a row add nothing (the running max stays -inf
    there: its exponents must not turn NaN); a row of -inf alone gives NaN as torch's ops do; targets read at their
    stride (a view of every second target)."""
    kernels = interpreted("disagmoe.kernels.cross_entropy")
    monkeypatch.setattr(kernels, "block_v", lambda v: 4)
    logits_CV, _ = _case(2, 3, 14)
    logits_CV[0, :9] = float("-inf")  # two whole blocks and part of a third
    logits_CV[2, :] = float("-inf")
    targets_C = torch.tensor([11, 0, 5, 1, 3, 2])[::2]  # 11, 5, 3
    want_loss, want_d = ce.softmax_cross_entropy_reference(logits_CV, targets_C, 2.0)
    got_d = logits_CV.clone()
    got_loss = kernels.softmax_cross_entropy_(got_d, targets_C, 2.0)
    torch.testing.assert_close(got_loss[:2], want_loss[:2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_d[:2], want_d[:2], rtol=1e-5, atol=1e-7)
    assert torch.isnan(want_loss[2]) and torch.isnan(got_loss[2]) and torch.isnan(got_d[2]).all()


def test_a_target_outside_the_vocabulary_gives_a_nan_loss_and_no_one_hot(interpreted):
    kernels = interpreted("disagmoe.kernels.cross_entropy")
    logits_CV, _ = _case(0, 2, 10)
    targets_C = torch.tensor([3, 10])
    d_CV = logits_CV.clone()
    loss_C = kernels.softmax_cross_entropy_(d_CV, targets_C, 1.0)
    assert torch.isfinite(loss_C[0]) and torch.isnan(loss_C[1])
    torch.testing.assert_close(d_CV[1], torch.softmax(logits_CV[1], dim=0), rtol=1e-5, atol=1e-7)


def test_arguments_it_cannot_take_are_refused():
    logits_CV, targets_C = _case(0, 4, 6)
    with pytest.raises(ValueError, match="unit column stride"):
        ce.softmax_cross_entropy_(logits_CV.T, targets_C, 1.0)
    with pytest.raises(ValueError, match="int32/int64 targets"):
        ce.softmax_cross_entropy_(logits_CV, targets_C.float(), 1.0)
    assert ce.block_v(4096) == 4096 and ce.block_v(151_936) == ce.MAX_BLOCK_V and ce.block_v(50) == 64


@pytest.mark.parametrize("tokens,vocab,chunk", [(37, 11, 8), (20, 50, 64)])
def test_the_fused_loss_equals_torchs_ops_in_the_interpreter(interpreted, tokens, vocab, chunk):
    """`linear_cross_entropy(fused=True)` (the GPU's default) against `fused=False`: the loss, d h and the head's
    gradient, fp32 operands, chunked."""
    interpreted("disagmoe.kernels.cross_entropy")
    from disagmoe.model.loss import linear_cross_entropy

    g = torch.Generator().manual_seed(tokens)
    h = torch.randn(tokens, 16, generator=g)
    w = torch.randn(vocab, 16, generator=g)
    t = torch.randint(0, vocab, (tokens,), generator=g)
    results = []
    for fused in (True, False):
        h_, w_ = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(h_, w_, t, chunk, fused=fused)
        (1.5 * loss).backward()
        results.append((loss.detach(), h_.grad, w_.grad))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows,vocab", [(4096, 4096), (257, 151_936), (3, 5), (0, 100)])
def test_gpu_bf16_matches_the_reference(rows, vocab):
    """bf16 logits on a GPU: the loss within fp32 rounding of torch's, each gradient within a bf16 rounding."""
    logits_CV, targets_C = _case(1, rows, vocab, torch.bfloat16, "cuda")
    want_loss, want_d = ce.softmax_cross_entropy_reference(logits_CV, targets_C, 8192.0)
    got_loss = ce.softmax_cross_entropy_(logits_CV, targets_C, 8192.0)
    torch.testing.assert_close(got_loss, want_loss, rtol=2e-6, atol=2e-5)
    torch.testing.assert_close(logits_CV.float(), want_d.float(), rtol=1.6e-2, atol=1e-9)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_fused_loss_trains_as_torchs_ops_do():
    """The LM head's loss and gradients in bf16 on a GPU, fused (the default there) against torch's ops: d W within
    a bf16 rounding in norm (the fused path sums each chunk's product unrounded in fp32, torch's ops round it to
    bf16 first, so elements near zero differ by more than any elementwise tolerance)."""
    from disagmoe.model.loss import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(3000, 256, generator=g).cuda().to(torch.bfloat16)
    w = (torch.randn(5000, 256, generator=g) * 0.05).cuda().to(torch.bfloat16)
    t = torch.randint(0, 5000, (3000,), generator=g).cuda()
    results = []
    for fused in (True, False):
        h_, w_ = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(h_, w_, t, 1024, fused=fused)
        loss.backward()
        results.append((loss.detach().float(), h_.grad.float(), w_.grad.float()))
    (loss_f, dh_f, dw_f), (loss_t, dh_t, dw_t) = results
    torch.testing.assert_close(loss_f, loss_t, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dh_f, dh_t, rtol=2e-2, atol=1e-6)
    assert ((dw_f - dw_t).norm() / dw_t.norm()).item() < 4e-3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_fused_loss_replays_in_a_cuda_graph_as_it_ran_eagerly():
    """A captured step replays the fused loss (no host read, no allocation it does not own): the loss and both
    gradients of a replay equal the eager run's bit for bit, on inputs changed in place between replays."""
    from disagmoe.model.loss import linear_cross_entropy

    g = torch.Generator().manual_seed(1)
    h = torch.randn(1500, 128, generator=g).cuda().to(torch.bfloat16).requires_grad_()
    w = (torch.randn(3000, 128, generator=g) * 0.05).cuda().to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, 3000, (1500,), generator=g).cuda()

    def step() -> torch.Tensor:
        h.grad = w.grad = None
        loss = linear_cross_entropy(h, w, t, 512, fused=True)
        loss.backward()
        return loss.detach()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm-up off the capture: the kernel's compile, autograd's buffers
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    h.grad = w.grad = None
    with torch.cuda.graph(graph):
        captured_loss = linear_cross_entropy(h, w, t, 512, fused=True)
        captured_loss.backward()
    captured_dh, captured_dw = h.grad, w.grad  # the graph's own gradient buffers (an eager step rebinds .grad)
    for scale in (1.0, 0.5):
        with torch.no_grad():
            h.mul_(scale)
        graph.replay()
        replay = (captured_loss.detach().clone(), captured_dh.clone(), captured_dw.clone())
        eager_loss = step()
        assert torch.equal(replay[0], eager_loss)
        assert torch.equal(replay[1], h.grad) and torch.equal(replay[2], w.grad)
