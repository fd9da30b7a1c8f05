"""The LM head's softmax cross-entropy over a chunk of logits in one fused kernel (`model.loss`'s chunks).

For each row c of logits_CV (a chunk's head GEMM output, bf16 or fp32) and its target t_c:
lse_c = log sum_v exp(l_cv) in fp32 (an online max and sum over V in blocks), loss_c = lse_c - l_c,t_c,
and, where gradients are asked, d_cv = (exp(l_cv - lse_c) - [v == t_c]) / divisor written over the logits
in place, in their dtype (`model.loss` divides by the micro-batch's tokens: the mean's gradient).

Why: torch's chunk (`model.loss`'s `_torch_chunk`) casts the logits to fp32, runs logsumexp, `sub_`,
`exp_`, `div_` and a cast back: about 44 bytes of HBM traffic a logit; this reads each logit twice and writes
it once (6 bytes in bf16). In the profiled Qwen3 config's step (3 of its 6 layers at m=2 on one H100, session
44) those five passes took 6.0 ms of 227, 2.7% of the step; with a published vocabulary (Qwen3's 151,936
tokens against the config's 4,096) they scale with it. In place is safe: each program reads its row's
elements in the second pass before it overwrites them, and no other program touches the row.

A target outside [0, V) gives a NaN loss (where torch's gather raises on the device) and no one-hot term. A row
whose logits are all -inf gives a NaN loss and NaN gradients, as torch's ops do; -inf logits beside finite ones (a
masked vocabulary) add nothing to the sum.
Legend: C rows of the chunk, V vocabulary.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK_V = 4096  # a row's elements a program loads at once (16 fp32 registers a thread at its 8 warps)


@triton.jit
def _softmax_cross_entropy_kernel(logits_ptr, targets_ptr, loss_ptr, V, stride_c, stride_t, divisor,
                                  BLOCK_V: tl.constexpr, GRAD: tl.constexpr):
    row = tl.program_id(0)
    row_ptr = logits_ptr + row.to(tl.int64) * stride_c
    cols = tl.arange(0, BLOCK_V)
    # the row's max and sum of exp(l - max), online over blocks: masked lanes and -inf logits add exp(-inf) = 0;
    # while every logit so far is -inf the max is too, and the exponents shift by 0 instead (-inf - -inf is NaN)
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(row_ptr + start + cols, mask=start + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - shift) + tl.sum(tl.exp(x - shift), axis=0)
        m = m_new
    lse = m + tl.log(s)
    target = tl.load(targets_ptr + row * stride_t).to(tl.int64)
    valid = (target >= 0) & (target < V)
    target_logit = tl.load(row_ptr + target, mask=valid, other=float("nan")).to(tl.float32)
    tl.store(loss_ptr + row, lse - target_logit)
    if GRAD:
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            x = tl.load(row_ptr + offs, mask=offs < V, other=0.0).to(tl.float32)
            d = tl.exp(x - lse) - (offs == target).to(tl.float32)
            tl.store(row_ptr + offs, (d / divisor).to(logits_ptr.dtype.element_ty), mask=offs < V)


def block_v(vocab: int) -> int:
    """The V block a program loads at once: the vocabulary's next power of 2, at most `MAX_BLOCK_V`."""
    return min(MAX_BLOCK_V, triton.next_power_of_2(max(1, vocab)))


def softmax_cross_entropy_(logits_CV: torch.Tensor, targets_C: torch.Tensor, divisor: float | None) -> torch.Tensor:
    """fp32 loss_C of each row (module docstring); with `divisor`, the rows' gradients (softmax - onehot) /
    divisor replace the logits in place (their dtype), None leaves the logits as they are."""
    if logits_CV.dim() != 2 or targets_C.shape != logits_CV.shape[:1] or logits_CV.stride(1) != 1:
        raise ValueError(f"softmax_cross_entropy_ wants logits [C, V] with unit column stride and targets [C]; got "
                         f"{tuple(logits_CV.shape)} (strides {logits_CV.stride()}), {tuple(targets_C.shape)}")
    if not logits_CV.dtype.is_floating_point or targets_C.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"softmax_cross_entropy_ wants float logits and int32/int64 targets; got {logits_CV.dtype}, "
                         f"{targets_C.dtype}")
    rows, vocab = logits_CV.shape
    loss_C = torch.empty(rows, dtype=torch.float32, device=logits_CV.device)
    if rows == 0:
        return loss_C
    block = block_v(vocab)
    _softmax_cross_entropy_kernel[(rows,)](logits_CV, targets_C, loss_C, vocab, logits_CV.stride(0),
                                           targets_C.stride(0), float(divisor if divisor is not None else 1.0),
                                           BLOCK_V=block, GRAD=divisor is not None,
                                           num_warps=8 if block >= 2048 else 4)
    return loss_C


def softmax_cross_entropy_torch_(logits_CV: torch.Tensor, targets_C: torch.Tensor, divisor: float | None,
                                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 loss_C, the gradients in `dtype` or None without `divisor`): the kernel's arithmetic by torch's ops
    (`model.loss` off the GPU), in place over an fp32 copy of the logits, over the logits themselves where they
    are fp32."""
    logits = logits_CV.float()
    lse_C = torch.logsumexp(logits, dim=-1)
    loss_C = lse_C - logits.gather(1, targets_C.long()[:, None]).squeeze(1)
    if divisor is None:
        return loss_C, None
    d_CV = logits.sub_(lse_C[:, None]).exp_()  # softmax, in place
    d_CV.scatter_add_(1, targets_C.long()[:, None], torch.full_like(lse_C[:, None], -1.0))
    return loss_C, d_CV.div_(divisor).to(dtype)


def softmax_cross_entropy_reference(logits_CV: torch.Tensor, targets_C: torch.Tensor,
                                    divisor: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(fp32 loss_C, gradients in the logits' dtype or None): `softmax_cross_entropy_torch_` on a copy."""
    return softmax_cross_entropy_torch_(logits_CV.clone(), targets_C, divisor, logits_CV.dtype)
