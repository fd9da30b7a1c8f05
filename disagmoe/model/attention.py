"""Causal self-attention: grouped-query (Mixtral, Qwen3 with qk-norm) and multi-head latent (DeepSeek-V3).

Both take the normed hidden states [B, S, H] and return the attention output [B, S, H] (before
the residual add); `core` is everything before the output projection (what `recompute` with
`attention` runs again in the backward: `model.block.Block.attention_part`, but for the attention
kernel itself, whose output it keeps: `kernels.attention_core`). Attention itself is
`F.scaled_dot_product_attention(is_causal=True)` (`kernels.attention_core.causal_attention`). The
projections are `DeferrableLinear`: inside `kernels.deferral.deferred_weight_grads` their weight gradients
wait until the rank has sent the block's input gradient.

Shape legend: B batch, S sequence, H hidden, n heads, g kv heads, D head dim, R rotary dims,
C compressed (latent) rank, V value head dim.
"""

from __future__ import annotations

import torch
from torch import nn

from disagmoe.config import ModelConfig
from disagmoe.kernels.attention_core import KeptCore, causal_attention
from disagmoe.model.layers import (DeferrableLinear, RMSNorm, apply_rope, fused, rms_norm, rope_cos_sin,
                                   shared_input_linears, yarn_mscale)


def heads_first(*tensors_BSxD: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """[B, S, heads, D] tensors viewed heads-first ([B, heads, S, D]) for attention, token-major in
    memory: the fused attention kernels take the strides and allocate their output (and the
    gradients) in the same layout, so the heads' outputs reshape to [B, S, n D] without a copy, and
    the gradients come back through the transposes' backward (a stride change) as contiguous
    [B, S, heads, D] tensors that view back to the projections' outputs.

    The transposes run eagerly, after the `fused` functions, which return contiguous token-major
    tensors: compiled, an output's gradient is traced in a layout AOTAutograd guesses, and the one
    that comes is copied into it. Where the guess is contiguous (the torch 2.11 of the GPU machines,
    the profile says; 2.13's `guess_tangent_strides_as_outputs` takes the output's strides), a
    heads-first output's token-major gradient (what cuDNN returns) was copied heads-first in the
    compiled backward, and the projection's gradient the backward then wrote heads-first was copied
    back by its view's backward: q's two copies were 9.9 ms of the Qwen3 config's 497 ms step on an
    H100 (k's two an eighth of that). A contiguous output's guess is its own layout either way."""
    return tuple(t.transpose(1, 2) for t in tensors_BSxD)


@fused
def rope_tokens(q_BSnD: torch.Tensor, k_BSgD: torch.Tensor, cos_SD: torch.Tensor,
                sin_SD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE on q and k, token-major ([B, S, heads, D], contiguous)."""
    return apply_rope(q_BSnD, cos_SD, sin_SD), apply_rope(k_BSgD, cos_SD, sin_SD)


@fused
def qk_norm_rope_tokens(q_BSnD: torch.Tensor, k_BSgD: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor,
                        cos_SD: torch.Tensor, sin_SD: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q and k (Qwen3's qk-norm), then `rope_tokens`."""
    return rope_tokens.__wrapped__(rms_norm.__wrapped__(q_BSnD, q_w, eps), rms_norm.__wrapped__(k_BSgD, k_w, eps),
                                   cos_SD, sin_SD)


def rope_heads(q_BSnD: torch.Tensor, k_BSgD: torch.Tensor, v_BSgD: torch.Tensor, cos_SD: torch.Tensor,
               sin_SD: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """RoPE on q and k (`rope_tokens`, compiled on CUDA), then q, k, v `heads_first`."""
    return heads_first(*rope_tokens(q_BSnD, k_BSgD, cos_SD, sin_SD), v_BSgD)


def qk_norm_rope_heads(q_BSnD: torch.Tensor, k_BSgD: torch.Tensor, v_BSgD: torch.Tensor, q_w: torch.Tensor,
                       k_w: torch.Tensor, cos_SD: torch.Tensor, sin_SD: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, ...]:
    """qk-norm and RoPE (`qk_norm_rope_tokens`, compiled on CUDA), then q, k, v `heads_first`."""
    return heads_first(*qk_norm_rope_tokens(q_BSnD, k_BSgD, q_w, k_w, cos_SD, sin_SD, eps), v_BSgD)


@fused
def mla_rope_tokens(q_BSnQ: torch.Tensor, kv_BSnX: torch.Tensor, k_rope_BSR: torch.Tensor, cos_SR: torch.Tensor,
                    sin_SR: torch.Tensor, nope_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's q, k and v for attention, token-major ([B, S, heads, dim]; `mla_rope_heads` views them
    heads-first): q = [q_nope, RoPE(q_rope)] per head from the query projection's [nope | rope]
    heads, k = [k_nope, RoPE(k_rope)] with the one rotary key every head shares, v the rest of the
    kv projection's heads. One fused function, so that compiled (CUDA) the forward writes q and k
    once each (no rotary pass of its own, no concatenation) and the backward writes the gradients
    of the two projections' outputs whole (the splits' backward concatenations, 56 ms of the
    DeepSeek config's eager step with the rotary passes' copies, fused into them)."""
    B, S, n, qk_dim = q_BSnQ.shape
    rope_dim = qk_dim - nope_dim
    q_nope_BSnD, q_rope_BSnR = q_BSnQ.split([nope_dim, rope_dim], dim=-1)
    k_nope_BSnD, v_BSnV = kv_BSnX.split([nope_dim, kv_BSnX.shape[-1] - nope_dim], dim=-1)
    q_BSnQ = torch.cat([q_nope_BSnD, apply_rope(q_rope_BSnR, cos_SR, sin_SR)], dim=-1)
    k_rope_BS1R = apply_rope(k_rope_BSR[:, :, None, :], cos_SR, sin_SR)
    k_BSnQ = torch.cat([k_nope_BSnD, k_rope_BS1R.expand(B, S, n, rope_dim)], dim=-1)
    return q_BSnQ, k_BSnQ, v_BSnV


def mla_rope_heads(q_BSnQ: torch.Tensor, kv_BSnX: torch.Tensor, k_rope_BSR: torch.Tensor, cos_SR: torch.Tensor,
                   sin_SR: torch.Tensor, nope_dim: int) -> tuple[torch.Tensor, ...]:
    """`mla_rope_tokens` (compiled on CUDA), then q, k, v `heads_first`."""
    return heads_first(*mla_rope_tokens(q_BSnQ, kv_BSnX, k_rope_BSR, cos_SR, sin_SR, nope_dim))


class GroupedQueryAttention(nn.Module):
    """Multi-head attention with `num_kv_heads` shared key/value heads and RoPE on the full head dim."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.rope_theta, self.rope_scaling = cfg.rope_theta, cfg.rope_scaling
        h = cfg.hidden_size
        self.wq = DeferrableLinear(h, self.num_heads * self.head_dim)
        self.wk = DeferrableLinear(h, self.num_kv_heads * self.head_dim)
        self.wv = DeferrableLinear(h, self.num_kv_heads * self.head_dim)
        self.wo = DeferrableLinear(self.num_heads * self.head_dim, h)
        self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.wo(self.core(x_BSH))

    def core(self, x_BSH: torch.Tensor, kept: KeptCore | None = None) -> torch.Tensor:
        """Everything before the output projection: its input [B, S, n D] (the heads' outputs);
        `kept`: the recomputing checkpoint's (`kernels.attention_core`)."""
        B, S, _ = x_BSH.shape
        q_BSO, k_BSO, v_BSO = shared_input_linears(x_BSH, self.wq, self.wk, self.wv)  # d x summed by the GEMMs
        q_BSnD = q_BSO.view(B, S, self.num_heads, self.head_dim)
        k_BSgD = k_BSO.view(B, S, self.num_kv_heads, self.head_dim)
        v_BSgD = v_BSO.view(B, S, self.num_kv_heads, self.head_dim)
        cos_SD, sin_SD = rope_cos_sin(S, self.head_dim, self.rope_theta, x_BSH.device, x_BSH.dtype,
                                      self.rope_scaling)
        if self.q_norm is not None:
            q_BnSD, k_BgSD, v_BgSD = qk_norm_rope_heads(q_BSnD, k_BSgD, v_BSgD, self.q_norm.weight,
                                                         self.k_norm.weight, cos_SD, sin_SD, self.q_norm.eps)
        else:
            q_BnSD, k_BgSD, v_BgSD = rope_heads(q_BSnD, k_BSgD, v_BSgD, cos_SD, sin_SD)
        o_BnSD = causal_attention(q_BnSD, k_BgSD, v_BgSD, kept, gqa=self.num_kv_heads != self.num_heads)
        return o_BnSD.transpose(1, 2).reshape(B, S, -1)


class MultiHeadLatentAttention(nn.Module):
    """DeepSeek-V2/V3 MLA: q through an optional low-rank bottleneck (`wq_a`, `q_a_norm`, `wq_b`),
    k/v from a normed compressed latent (`wkv_a`, `kv_a_norm`, `wkv_b`); RoPE only on R decoupled
    dims per head, with one rotary key shared by all heads.

    RoPE uses the "rotate half" pairing. DeepSeek's checkpoints pair adjacent dims instead
    (`rope_interleave`); `disagmoe.model.hf` permutes those weight rows on import and export.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.mla is not None
        m = cfg.mla
        h = cfg.hidden_size
        self.num_heads, self.rope_theta, self.rope_scaling = cfg.num_heads, cfg.rope_theta, cfg.rope_scaling
        self.nope_dim, self.rope_dim, self.v_dim, self.kv_rank = (
            m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank,
        )
        qk_dim = self.nope_dim + self.rope_dim
        self.softmax_scale = qk_dim ** -0.5  # YaRN (DeepSeek): times mscale(factor, mscale_all_dim)^2
        if self.rope_scaling is not None and self.rope_scaling.mscale_all_dim:
            self.softmax_scale *= yarn_mscale(self.rope_scaling.factor, self.rope_scaling.mscale_all_dim) ** 2
        if m.q_lora_rank is None:
            self.wq = DeferrableLinear(h, self.num_heads * qk_dim)
        else:
            self.wq_a = DeferrableLinear(h, m.q_lora_rank)
            self.q_a_norm = RMSNorm(m.q_lora_rank, cfg.norm_eps)
            self.wq_b = DeferrableLinear(m.q_lora_rank, self.num_heads * qk_dim)
        self.q_low_rank = m.q_lora_rank is not None
        self.wkv_a = DeferrableLinear(h, self.kv_rank + self.rope_dim)
        self.kv_a_norm = RMSNorm(self.kv_rank, cfg.norm_eps)
        self.wkv_b = DeferrableLinear(self.kv_rank, self.num_heads * (self.nope_dim + self.v_dim))
        self.wo = DeferrableLinear(self.num_heads * self.v_dim, h)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        return self.wo(self.core(x_BSH))

    def core(self, x_BSH: torch.Tensor, kept: KeptCore | None = None) -> torch.Tensor:
        """Everything before the output projection: its input [B, S, n V] (the heads' outputs);
        `kept`: the recomputing checkpoint's (`kernels.attention_core`)."""
        B, S, _ = x_BSH.shape
        n = self.num_heads
        q_in, kv_a_BSX = shared_input_linears(x_BSH, self.wq_a if self.q_low_rank else self.wq, self.wkv_a)
        q_flat = self.wq_b(self.q_a_norm(q_in)) if self.q_low_rank else q_in
        c_BSC, k_rope_BSR = kv_a_BSX.split([self.kv_rank, self.rope_dim], dim=-1)
        kv_BSnX = self.wkv_b(self.kv_a_norm(c_BSC)).view(B, S, n, self.nope_dim + self.v_dim)
        cos_SR, sin_SR = rope_cos_sin(S, self.rope_dim, self.rope_theta, x_BSH.device, x_BSH.dtype,
                                      self.rope_scaling)
        q_BnSQ, k_BnSQ, v_BnSV = mla_rope_heads(q_flat.view(B, S, n, -1), kv_BSnX, k_rope_BSR, cos_SR, sin_SR,
                                                self.nope_dim)
        o_BnSV = causal_attention(q_BnSQ, k_BnSQ, v_BnSV, kept, scale=self.softmax_scale)
        return o_BnSV.transpose(1, 2).reshape(B, S, n * self.v_dim)


def build_attention(cfg: ModelConfig) -> nn.Module:
    return MultiHeadLatentAttention(cfg) if cfg.attention == "mla" else GroupedQueryAttention(cfg)
