"""Small building blocks: RMSNorm, rotary position embedding, the SwiGLU feed-forward.

Shape legend: B batch, S sequence, H hidden, N tokens (B*S), D head dim, R rotary dims, F FFN width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions (norms, router softmax) run in at least fp32; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in fp32 (as in Llama, Mixtral, Qwen3, DeepSeek)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.to(compute_dtype(x.dtype))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(
    seq_len: int, rot_dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [S, R] for positions 0..S-1, frequencies repeated over the two halves."""
    work = compute_dtype(dtype)
    inv_freq_R2 = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, device=device, dtype=work) / rot_dim))
    angles_SR2 = torch.arange(seq_len, device=device, dtype=work)[:, None] * inv_freq_R2[None, :]
    angles_SR = torch.cat([angles_SR2, angles_SR2], dim=-1)
    return angles_SR.cos().to(dtype), angles_SR.sin().to(dtype)


def apply_rope(x_BSnR: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + R/2) of the last dim ("rotate half" layout) of a [B, S, heads, R] tensor."""
    half = x_BSnR.shape[-1] // 2
    x1, x2 = x_BSnR[..., :half], x_BSnR[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_BSnR * cos_SR[:, None, :] + rotated * sin_SR[:, None, :]


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); the leading dense layers' FFN and the shared experts.

    Names follow Llama: `w1` gate [F, H], `w3` up [F, H], `w2` down [H, F] (nn.Linear is [out, in]).
    """

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
