"""`disagmoe bench loss`: the LM head's chunked cross-entropy with the fused softmax kernel against torch's ops,
in the same run.

A training step's loss (`model.loss.linear_cross_entropy`) runs the head GEMM over chunks of a micro-batch's
tokens and each chunk's softmax, loss and d logits; on a GPU the softmax is one fused pass
(`kernels.cross_entropy`) and each chunk's d W is summed by its GEMM in fp32, over chunks of twice the tokens
at large vocabularies; torch's ops make five passes over fp32 logits. Per case (a micro-batch's tokens of
the config's model, at its vocabulary and at each `--vocab`): GPU kernel time of the whole head, forward and
backward, each way (each at its own chunk), and of one torch-sized chunk's softmax alone (its bytes over its
time against the HBM copy rate of the same run: a memory-bound pass), with the two losses' relative difference.

Legend: N tokens of a micro-batch, H hidden, V vocabulary, C tokens of a chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from disagmoe.bench.timing import environment, hbm_copy_gbps, kernel_ms


def _head_ms(h_NH: torch.Tensor, w_VH: torch.Tensor, t_N: torch.Tensor, fused: bool, warmup: int,
             iters: int) -> tuple[float, float]:
    """(GPU ms of one forward + backward of the chunked head, its loss)."""
    from disagmoe.model.loss import linear_cross_entropy

    h, w = h_NH.detach().requires_grad_(), w_VH.detach().requires_grad_()

    def step(_: int) -> None:
        h.grad = w.grad = None
        linear_cross_entropy(h, w, t_N, fused=fused).backward()

    ms = kernel_ms(step, warmup, iters)
    with torch.no_grad():
        loss = float(linear_cross_entropy(h, w, t_N, fused=fused))
    return ms, loss


def _softmax_ms(logits_CV: torch.Tensor, t_C: torch.Tensor, divisor: int, fused: bool, warmup: int,
                iters: int) -> float:
    """GPU ms of one chunk's softmax, loss and d logits (`kernels.cross_entropy`: the fused kernel, or torch's ops)
    on a copy of the chunk's logits (the fused pass writes its gradients over them: the kernel's work is the same
    whatever the values)."""
    from disagmoe.kernels import cross_entropy as ce

    logits = logits_CV.clone()
    if fused:
        return kernel_ms(lambda _: ce.softmax_cross_entropy_(logits, t_C, divisor), warmup, iters)
    return kernel_ms(lambda _: ce.softmax_cross_entropy_torch_(logits, t_C, divisor, logits_CV.dtype), warmup, iters)


def run(tokens: int, hidden: int, vocabs: list[int], warmup: int, iters: int,
        log: Callable[[str], None] = print, seed: int = 0) -> dict:
    """Each vocabulary's case (module docstring) at `tokens` tokens of `hidden`, bf16, on this GPU."""
    from disagmoe.model.loss import chunk_size

    if not torch.cuda.is_available():
        raise ValueError("`disagmoe bench loss` times GPU kernels: run it on a machine with a CUDA GPU")
    device = torch.device("cuda")
    copy_gbps = hbm_copy_gbps(device, warmup, iters)
    gen = torch.Generator(device=device).manual_seed(seed)
    rows = []
    for vocab in vocabs:
        h_NH = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=gen)
        w_VH = torch.randn(vocab, hidden, device=device, dtype=torch.bfloat16, generator=gen) * hidden**-0.5
        t_N = torch.randint(0, vocab, (tokens,), device=device, generator=gen)
        fused_ms, fused_loss = _head_ms(h_NH, w_VH, t_N, True, warmup, iters)
        torch_ms, torch_loss = _head_ms(h_NH, w_VH, t_N, False, warmup, iters)
        chunk = chunk_size(tokens, vocab)  # torch's chunk: the fused head's holds 2x the tokens at large vocabularies
        logits_CV = h_NH[:chunk] @ w_VH.T
        softmax_fused = _softmax_ms(logits_CV, t_N[:chunk], tokens, True, warmup, iters)
        softmax_torch = _softmax_ms(logits_CV, t_N[:chunk], tokens, False, warmup, iters)
        fused_bytes = 3 * logits_CV.numel() * logits_CV.element_size()  # read twice, written once
        row = {"tokens": tokens, "hidden": hidden, "vocab": vocab, "chunk": chunk,
               "fused_chunk": chunk_size(tokens, vocab, None, h_NH.element_size()),
               "head_fused_ms": fused_ms, "head_torch_ms": torch_ms, "head_speedup": torch_ms / fused_ms,
               "softmax_fused_ms": softmax_fused, "softmax_torch_ms": softmax_torch,
               "softmax_speedup": softmax_torch / softmax_fused,
               "softmax_fused_gbps": fused_bytes / softmax_fused / 1e6,
               "softmax_fused_of_copy": fused_bytes / softmax_fused / 1e6 / copy_gbps,
               "loss_rel_diff": abs(fused_loss - torch_loss) / abs(torch_loss)}
        log(f"V={vocab}: head {torch_ms:.3f} -> {fused_ms:.3f} ms ({row['head_speedup']:.2f}x), a chunk's softmax "
            f"{softmax_torch:.3f} -> {softmax_fused:.3f} ms ({row['softmax_speedup']:.2f}x, "
            f"{row['softmax_fused_of_copy']:.0%} of the copy rate)")
        rows.append(row)
        del h_NH, w_VH, logits_CV
        torch.cuda.empty_cache()
    return {"environment": environment(device), "copy_gbps": copy_gbps, "rows": rows}
