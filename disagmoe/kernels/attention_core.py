"""The causal attention core whose recomputation reruns its inputs but not itself.

`causal_attention(q, k, v, kept, scale, gqa)` is `F.scaled_dot_product_attention(q, k, v,
is_causal=True, scale=scale, enable_gqa=gqa)`. Under `recompute_modules: [attention]`
(`model.block.Block.attention_part`) the block's attention runs inside a non-reentrant checkpoint
that drops every tensor it saves and recomputes them in the backward: the norm, the projections,
qk-norm and RoPE, and, through F.sdpa, the attention core's forward too, which is most of the
recomputation's cost (the core's forward is about 1 of the 2.5 its forward and backward take) though
its backward needs none of the core's work but its output and log-sum-exp.

With a `KeptCore` (one per checkpointed call, passed as the checkpoint's argument) the core runs as
one autograd function over the fused kernel F.sdpa itself chooses (`torch._fused_sdp_choice`: cuDNN
or flash on a GPU, the CPU's flash kernel), the same aten op with the same arguments, so the
forward's bits are F.sdpa's. It saves q, k and v for the backward (the checkpoint drops them and
the recomputation makes them again) and keeps the kernel's output and log-sum-exp outside the
checkpoint: the output is the tensor the output projection reads anyway (the same storage, or its
source), the log-sum-exp one fp32 value per head and token. When the checkpoint recomputes the
block in the backward, the function hands back the kept output instead of launching the kernel,
and its backward is the kernel's own backward op on the recomputed q, k, v with the kept output
and log-sum-exp: the plain run's gradients to the bit. Where F.sdpa would choose another backend
(memory-efficient, math; flash with fewer key/value heads than query heads, as GQA has, or with a
head dim it pads), the core runs as F.sdpa and the recomputation runs it again, as before: the
planner prices the kept case (`roofline.stages.attention_recompute`), which holds where cuDNN runs
(an H200 with torch 2.11 picks it for GQA and MHA).

No host reads (the kernel choice is a host decision on shapes and dtypes, made in the forward), so
the step can be captured in a CUDA graph. Shape legend: B batch, n query heads, g key/value heads,
S sequence, D head dim (Dv the value head dim).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

CUDNN, FLASH = int(SDPBackend.CUDNN_ATTENTION), int(SDPBackend.FLASH_ATTENTION)


class KeptCore:
    """One checkpointed call's attention core: the kernel the forward chose, its output (detached:
    an alias, no copy) and the kernel's other outputs its backward needs, set by the first run, read
    by the recomputation (which takes the same kernel whatever the backends allowed then) and by the
    backward, which lets them go (the autograd graph may outlive it: a trainer holds the last
    micro-batch's loss while the next one's forward runs). One backward: `retain_graph` is not
    supported."""

    def __init__(self) -> None:
        self.sdpa: int | None = None  # the backend F.sdpa chose in the forward (None: not chosen yet)
        self.backend: int | None = None  # the kept kernel of that choice, or None: F.sdpa, pinned to `sdpa`
        self.out_BnSD: torch.Tensor | None = None
        self.aux: tuple[Any, ...] = ()


def sdpa_choice(q_BnSD: torch.Tensor, k_BgSD: torch.Tensor, v_BgSD: torch.Tensor, scale: float | None,
                gqa: bool) -> int:
    """The backend F.sdpa runs for these operands under the backends allowed now (`SDPBackend`'s value)."""
    return int(torch._fused_sdp_choice(q_BnSD, k_BgSD, v_BgSD, is_causal=True, scale=scale, enable_gqa=gqa))


def fused_backend(q_BnSD: torch.Tensor, k_BgSD: torch.Tensor, v_BgSD: torch.Tensor, scale: float | None,
                  gqa: bool, choice: int | None = None) -> int | None:
    """The fused kernel F.sdpa would run for these operands (`choice`: `sdpa_choice`'s), if it is
    one this module can keep the output of (its backward op taken as is): cuDNN; flash on the CPU,
    or on a GPU with equal head counts and a head dim it does not pad. None: another backend."""
    choice = sdpa_choice(q_BnSD, k_BgSD, v_BgSD, scale, gqa) if choice is None else choice
    if choice == CUDNN and q_BnSD.is_cuda:
        return CUDNN
    if choice == FLASH and (not q_BnSD.is_cuda or (q_BnSD.shape[1] == k_BgSD.shape[1]
                                                   and q_BnSD.shape[-1] % 8 == 0 and v_BgSD.shape[-1] % 8 == 0)):
        return FLASH
    return None


def _forward(backend: int, q_BnSD: torch.Tensor, k_BgSD: torch.Tensor, v_BgSD: torch.Tensor,
             scale: float | None) -> tuple[torch.Tensor, tuple[Any, ...]]:
    """The kernel's output and what its backward op takes beside q, k, v and the output."""
    aten = torch.ops.aten
    if backend == CUDNN:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
            q_BnSD, k_BgSD, v_BgSD, None, True, 0.0, True, False, scale=scale)
        return out, (lse, seed, offset, cum_q, cum_k, max_q, max_k)
    if q_BnSD.is_cuda:
        out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
            q_BnSD, k_BgSD, v_BgSD, 0.0, True, False, scale=scale)
        return out, (lse, cum_q, cum_k, max_q, max_k, seed, offset)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q_BnSD, k_BgSD, v_BgSD, 0.0, True, scale=scale)
    return out, (lse,)


def _backward(backend: int, dout_BnSD: torch.Tensor, q_BnSD: torch.Tensor, k_BgSD: torch.Tensor,
              v_BgSD: torch.Tensor, out_BnSD: torch.Tensor, aux: tuple[Any, ...],
              scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv: the backward op autograd runs for the kernel `_forward` ran."""
    aten = torch.ops.aten
    if backend == CUDNN:
        lse, seed, offset, cum_q, cum_k, max_q, max_k = aux
        return aten._scaled_dot_product_cudnn_attention_backward(
            dout_BnSD, q_BnSD, k_BgSD, v_BgSD, out_BnSD, lse, seed, offset, None, cum_q, cum_k, max_q, max_k,
            0.0, True, scale=scale)
    if q_BnSD.is_cuda:
        lse, cum_q, cum_k, max_q, max_k, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            dout_BnSD, q_BnSD, k_BgSD, v_BgSD, out_BnSD, lse, cum_q, cum_k, max_q, max_k, 0.0, True, seed, offset,
            scale=scale)
    (lse,) = aux
    return aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout_BnSD, q_BnSD, k_BgSD, v_BgSD, out_BnSD, lse, 0.0, True, scale=scale)


class _KeptAttention(torch.autograd.Function):
    """The core over `kept.backend`'s kernel; its output kept in `kept`, its q, k, v saved (for the
    checkpoint to drop and recompute)."""

    @staticmethod
    def forward(ctx: Any, q_BnSD: torch.Tensor, k_BgSD: torch.Tensor, v_BgSD: torch.Tensor, kept: KeptCore,
                scale: float | None) -> torch.Tensor:
        ctx.save_for_backward(q_BnSD, k_BgSD, v_BgSD)
        if kept.out_BnSD is None:  # the forward; the checkpoint's recomputation finds it kept
            out_BnSD, kept.aux = _forward(kept.backend, q_BnSD, k_BgSD, v_BgSD, scale)
            kept.out_BnSD = out_BnSD.detach()  # an alias without this node: no reference cycle
            ctx.kept, ctx.scale = kept, scale
            return out_BnSD
        return kept.out_BnSD.detach()  # the recomputation's: only its saved q, k, v are read

    @staticmethod
    def backward(ctx: Any, dout_BnSD: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        kept: KeptCore | None = ctx.kept
        if kept is None or kept.out_BnSD is None:
            raise RuntimeError("the kept attention core's backward ran twice (retain_graph is not supported with "
                               "recompute_modules: [attention])")
        q_BnSD, k_BgSD, v_BgSD = ctx.saved_tensors
        dq, dk, dv = _backward(kept.backend, dout_BnSD, q_BnSD, k_BgSD, v_BgSD, kept.out_BnSD, kept.aux, ctx.scale)
        kept.out_BnSD, kept.aux, ctx.kept = None, (), None  # as autograd frees a node's saved tensors
        return dq, dk, dv, None, None


def causal_attention(q_BnSD: torch.Tensor, k_BgSD: torch.Tensor, v_BgSD: torch.Tensor, kept: KeptCore | None = None,
                     scale: float | None = None, gqa: bool = False) -> torch.Tensor:
    """Causal attention [B, n, S, Dv]: F.sdpa, or with `kept` (inside the attention block's
    recomputing checkpoint, grad mode on) the kept-output function over the same kernel."""
    if kept is None or not torch.is_grad_enabled():
        return F.scaled_dot_product_attention(q_BnSD, k_BgSD, v_BgSD, is_causal=True, scale=scale, enable_gqa=gqa)
    if kept.sdpa is None:  # the forward chooses; its recomputation takes the same kernel
        kept.sdpa = sdpa_choice(q_BnSD, k_BgSD, v_BgSD, scale, gqa)
        kept.backend = fused_backend(q_BnSD, k_BgSD, v_BgSD, scale, gqa, kept.sdpa)
    if kept.backend is None:  # F.sdpa, pinned to its forward's backend so the recomputation saves the same
        with sdpa_kernel(SDPBackend(kept.sdpa)):
            return F.scaled_dot_product_attention(q_BnSD, k_BgSD, v_BgSD, is_causal=True, scale=scale,
                                                  enable_gqa=gqa)
    return _KeptAttention.apply(q_BnSD, k_BgSD, v_BgSD, kept, scale)
