"""Parameter counts of a `ModelConfig`, per component, total and active per token.

The counts mirror the weights `disagmoe.model` builds (and Hugging Face's layouts), so they
reproduce the published totals: DeepSeek-V3 671B / 37B, Qwen3-235B-A22B 235B / 22B,
Mixtral-8x7B 46.7B / 12.9B.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from disagmoe.config import ModelConfig


def attention_params(m: ModelConfig) -> int:
    """Projections and norms of one attention block (input RMSNorm included)."""
    h = m.hidden_size
    if m.attention == "mla":
        a = m.mla
        assert a is not None
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.q_lora_rank:
            q = h * a.q_lora_rank + a.q_lora_rank + a.q_lora_rank * m.num_heads * qk
        else:
            q = h * m.num_heads * qk
        kv = h * (a.kv_lora_rank + a.qk_rope_head_dim) + a.kv_lora_rank
        kv += a.kv_lora_rank * m.num_heads * (a.qk_nope_head_dim + a.v_head_dim)
        o = m.num_heads * a.v_head_dim * h
        return q + kv + o + h
    q = h * m.num_heads * m.head_dim
    kv = 2 * h * m.num_kv_heads * m.head_dim
    o = m.num_heads * m.head_dim * h
    qk_norm = 2 * m.head_dim if m.qk_norm else 0
    return q + kv + o + qk_norm + h


def attention_norm_params(m: ModelConfig) -> int:
    """The gains of one attention block's RMSNorms (its input norm, MLA's low-rank norms, qk-norm):
    the part of `attention_params` that is not a projection weight."""
    h = m.hidden_size
    if m.attention == "mla":
        a = m.mla
        assert a is not None
        return h + (a.q_lora_rank or 0) + a.kv_lora_rank
    return h + (2 * m.head_dim if m.qk_norm else 0)


class DenseLinear(NamedTuple):
    """One dense linear y = x W^T of a layer (a `model.layers.DeferrableLinear`): its module name,
    its in and out features, and whether it reads the block's input (the normed hidden row)."""

    name: str
    in_features: int
    out_features: int
    reads_block_input: bool


DENSE_PARTS = ("attention", "shared experts", "dense ffn")  # the parts of a layer whose linears are dense


def dense_linears(m: ModelConfig, part: str) -> list[DenseLinear]:
    """The dense linears of one layer's `part` (DENSE_PARTS), in the order its forward calls them:
    "attention" (`model.attention`: GQA's q, k, v and o; MLA's q, or its low-rank q_a and q_b, then
    kv_a, kv_b and o), "shared experts" or "dense ffn" (`model.layers.SwiGLU`: gate w1, up w3, down
    w2; F = 0 without them). Their weights are `attention_params` less `attention_norm_params`, or
    `swiglu_params`; tests/roofline/test_params.py holds them to the modules `model` builds."""
    h = m.hidden_size
    if part == "attention" and m.attention == "mla":
        a = m.mla
        assert a is not None
        qk = m.num_heads * (a.qk_nope_head_dim + a.qk_rope_head_dim)
        q = ([DenseLinear("wq", h, qk, True)] if a.q_lora_rank is None else
             [DenseLinear("wq_a", h, a.q_lora_rank, True), DenseLinear("wq_b", a.q_lora_rank, qk, False)])
        return [*q, DenseLinear("wkv_a", h, a.kv_lora_rank + a.qk_rope_head_dim, True),
                DenseLinear("wkv_b", a.kv_lora_rank, m.num_heads * (a.qk_nope_head_dim + a.v_head_dim), False),
                DenseLinear("wo", m.num_heads * a.v_head_dim, h, False)]
    if part == "attention":
        q, kv = m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim
        return [DenseLinear("wq", h, q, True), DenseLinear("wk", h, kv, True), DenseLinear("wv", h, kv, True),
                DenseLinear("wo", q, h, False)]
    if part not in DENSE_PARTS:
        raise ValueError(f"dense linears of part {part!r}: choose one of {', '.join(DENSE_PARTS)}")
    f = m.shared_ffn_size if part == "shared experts" else m.dense_ffn_size
    return [DenseLinear("w1", h, f, True), DenseLinear("w3", h, f, True), DenseLinear("w2", f, h, False)]


def swiglu_params(hidden: int, ffn: int) -> int:
    return 3 * hidden * ffn


def expert_params(m: ModelConfig) -> int:
    """One routed expert."""
    return swiglu_params(m.hidden_size, m.expert_ffn_size)


def router_params(m: ModelConfig) -> int:
    return m.hidden_size * m.num_experts


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts split by where they live in the disaggregated layout."""

    embedding: int  # input embedding + LM head (+ final norm)
    attention: int  # all layers' attention blocks
    dense_ffn: int  # leading dense layers' FFNs (+ their norms)
    shared_experts: int  # all MoE layers' shared experts
    router: int  # all MoE layers' gates (+ the FFN norms of MoE layers)
    routed_experts: int  # all MoE layers' routed experts
    active_routed: int  # routed expert weights one token touches

    @property
    def total(self) -> int:
        return self.non_expert + self.routed_experts

    @property
    def non_expert(self) -> int:
        """What an attention rank holds: everything but the routed experts."""
        return self.embedding + self.attention + self.dense_ffn + self.shared_experts + self.router

    @property
    def active(self) -> int:
        return self.non_expert + self.active_routed


def params_text(n: float) -> str:
    """A parameter count for people: 671.0B, 1.2M, 950K, 12."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def count_params(m: ModelConfig) -> ParamCounts:
    h = m.hidden_size
    embedding = m.vocab_size * h * (1 if m.tie_embeddings else 2) + h
    moe = m.num_moe_layers
    return ParamCounts(
        embedding=embedding,
        attention=m.num_layers * attention_params(m),
        dense_ffn=m.num_dense_layers * (swiglu_params(h, m.dense_ffn_size) + h),
        shared_experts=moe * swiglu_params(h, m.shared_ffn_size),
        router=moe * (router_params(m) + h),
        routed_experts=moe * m.num_experts * expert_params(m),
        active_routed=moe * m.top_k * expert_params(m),
    )
