"""The LM head and next-token cross-entropy in chunks of tokens, never a whole micro-batch's logits.

`linear_cross_entropy(h_NH, w_VH, targets_N)` = mean_n CE(h_n @ w^T, target_n), the log-softmax
in fp32. A micro-batch of N tokens over a vocabulary V would materialise N x V fp32 logits (8k
tokens x Qwen3's 151,936 = 5 GB, and as much again for their gradient); here at most
`chunk_tokens` x V live at a time. With gradients enabled the forward computes each chunk's
gradients right away (d logits = softmax - onehot) and keeps only dh [N, H] and an fp32 dW
[V, H]; the backward scales them by the incoming gradient, and adds dW straight into the head's
fp32 main gradient where a mixed-precision optimizer keeps one (`param.main_grad`, FlatAdamW). Without gradients it is a plain
chunked forward.

On a GPU each chunk's softmax, loss and d logits run as one fused pass over the logits in their own dtype
(`kernels.cross_entropy`: the same fp32 arithmetic, 6 bytes a bf16 logit against torch's five passes' 44);
on the CPU, with `fused=False`, or in a run with `fused_loss: false` (`set_fused_loss`), the torch ops below.

Shape legend: N tokens, H hidden, V vocabulary, C tokens of one chunk.
"""

from __future__ import annotations

import torch

from disagmoe.kernels import cross_entropy as fused_ce
from disagmoe.model.layers import add_product_into_fp32_


class _Fused:
    """Whether a CUDA chunk's softmax runs in the fused kernel by default (`set_fused_loss`; default on)."""

    enabled = True


def set_fused_loss(enabled: bool) -> None:
    """The default of `linear_cross_entropy(fused=None)` on CUDA tensors: the fused kernel or torch's ops
    (`TrainConfig.fused_loss`, set process-wide by the trainer and each rank, as `layers.set_fusion`)."""
    _Fused.enabled = enabled


def _fused_default(h_NH: torch.Tensor) -> bool:
    """`linear_cross_entropy`'s `fused` where not given: on CUDA tensors, unless a run turned it off."""
    return h_NH.is_cuda and _Fused.enabled


DEFAULT_CHUNK_TOKENS = 4096
LOGIT_BYTES_PER_CHUNK = 1 << 28  # one chunk's logits as its softmax holds them: the chunk shrinks for big vocabularies


def chunk_size(tokens: int, vocab: int, chunk_tokens: int | None = None, logit_bytes: int = 4) -> int:
    """Tokens per chunk: `chunk_tokens`, else as many as keep one chunk's logits near 256 MiB at `logit_bytes`
    bytes a logit (4: torch's ops hold an fp32 copy; the fused kernel works over the logits' own dtype)."""
    if chunk_tokens is None:
        chunk_tokens = max(256, min(DEFAULT_CHUNK_TOKENS, LOGIT_BYTES_PER_CHUNK // (logit_bytes * vocab)))
    return max(1, min(tokens, chunk_tokens))


def _torch_chunk(logits_CV: torch.Tensor, t_C: torch.Tensor, divisor: int | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the chunk's summed loss, its d logits in `dtype` or None without `divisor`) by torch's ops, in fp32."""
    loss_C, d_CV = fused_ce.softmax_cross_entropy_torch_(logits_CV, t_C, divisor, dtype)
    return loss_C.sum(), d_CV


def _fused_chunk(logits_CV: torch.Tensor, t_C: torch.Tensor, divisor: int | None,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_torch_chunk` in one kernel (`kernels.cross_entropy`), d logits written over the logits."""
    total = fused_ce.softmax_cross_entropy_(logits_CV, t_C, divisor).sum()
    return total, None if divisor is None else logits_CV.to(dtype)


def _chunked(h_NH: torch.Tensor, w_VH: torch.Tensor, targets_N: torch.Tensor, chunk: int, needs_h: bool,
             needs_w: bool, fused: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(mean loss, d loss / d h or None, fp32 d loss / d w or None), one chunk of tokens at a time, each
    chunk's softmax by `_fused_chunk` where `fused`, else `_torch_chunk`; where `fused`, each chunk's d w is
    also summed into the fp32 d w by the GEMM itself (`layers.add_product_into_fp32_`: no product and no cast
    of [V, H] a chunk, 8 bytes an element against 20), else formed, cast and added by torch's ops."""
    N = h_NH.shape[0]
    total = torch.zeros((), dtype=torch.float32, device=h_NH.device)
    dh_NH = torch.empty_like(h_NH) if needs_h else None
    dw_VH = torch.zeros(w_VH.shape, dtype=torch.float32, device=w_VH.device) if needs_w else None
    softmax = _fused_chunk if fused else _torch_chunk
    for start in range(0, N, chunk):
        h_CH, t_C = h_NH[start:start + chunk], targets_N[start:start + chunk]
        chunk_total, d_CV = softmax(h_CH @ w_VH.T, t_C, N if needs_h or needs_w else None, h_NH.dtype)
        total += chunk_total
        if d_CV is not None:
            if needs_h:
                dh_NH[start:start + chunk] = d_CV @ w_VH
            if needs_w and not (fused and add_product_into_fp32_(dw_VH, d_CV.T, h_CH)):
                dw_VH += (d_CV.T @ h_CH).float()
        del d_CV  # before the next chunk's logits: one chunk's at a time (`roofline.memory.head_bytes`)
    return total / N, dh_NH, dw_VH


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_NH: torch.Tensor, w_VH: torch.Tensor, targets_N: torch.Tensor, chunk: int,
                fused: bool) -> torch.Tensor:
        loss, dh_NH, dw_VH = _chunked(h_NH, w_VH, targets_N, chunk, *ctx.needs_input_grad[:2], fused)
        ctx.save_for_backward(dh_NH, dw_VH)
        ctx.w_dtype = w_VH.dtype
        main = getattr(w_VH, "main_grad", None)  # FlatAdamW's fp32 buffer: add there, in fp32
        ctx.main_grad = main if isinstance(w_VH, torch.nn.Parameter) else None
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        dh_NH, dw_VH = ctx.saved_tensors
        dh = None if dh_NH is None else dh_NH * grad_loss.to(dh_NH.dtype)
        if dw_VH is None:
            return dh, None, None, None, None
        if ctx.main_grad is not None:
            ctx.main_grad.addcmul_(dw_VH, grad_loss)  # no [V, H] temporary (`roofline.memory.head_bytes`)
            return dh, None, None, None, None
        return dh, (dw_VH * grad_loss).to(ctx.w_dtype), None, None, None


def linear_cross_entropy(h_NH: torch.Tensor, w_VH: torch.Tensor, targets_N: torch.Tensor,
                         chunk_tokens: int | None = None, fused: bool | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of the logits h @ w^T (fp32 log-softmax), in token chunks
    (module docstring). `h_NH` [N, H] final-normed hidden states, `w_VH` the LM head. `fused`: each
    chunk's softmax in `kernels.cross_entropy`'s kernel (default: on a GPU unless `set_fused_loss(False)`),
    else torch's ops."""
    fused = _fused_default(h_NH) if fused is None else fused
    if h_NH.dim() != 2 or w_VH.dim() != 2 or h_NH.shape[1] != w_VH.shape[1] or targets_N.shape != h_NH.shape[:1]:
        raise ValueError(f"linear_cross_entropy wants h [N, H], w [V, H], targets [N]; got "
                         f"{tuple(h_NH.shape)}, {tuple(w_VH.shape)}, {tuple(targets_N.shape)}")
    chunk = chunk_size(h_NH.shape[0], w_VH.shape[0], chunk_tokens, h_NH.element_size() if fused else 4)
    if not torch.is_grad_enabled() or not (h_NH.requires_grad or w_VH.requires_grad):
        with torch.no_grad():
            return _chunked(h_NH, w_VH, targets_N, chunk, False, False, fused)[0]
    return _LinearCrossEntropy.apply(h_NH, w_VH, targets_N, chunk, fused)
