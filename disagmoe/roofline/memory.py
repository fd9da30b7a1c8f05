"""Activation memory of a training step: what the forward keeps for the backward, per token.

    activation_bytes(model, tokens, value_bytes) -> bytes held at the peak of one forward of
    `tokens` tokens (a micro-batch), with activations of `value_bytes` each (2: bf16, 4: fp32)

The same per-token terms as the planner's memory model (placement/cost.py prices them per GPU):
per layer the attention block's inputs and projections (q, k, v, the attention output), the
routed tokens' top-k expert rows (gate, up, SwiGLU output and input), shared or dense FFN
activations and the router's fp32 scores; plus the fp32 logits of the LM head. It is an
estimate, not a count of every buffer (no allocator slack, no attention score matrix: the
attention is flash or chunked); the memory issue refines it here.
"""

from __future__ import annotations

from disagmoe.config import ModelConfig
from disagmoe.roofline.stages import FP32, attention_io_per_token


def attention_layer_values(m: ModelConfig, moe: bool) -> int:
    """Activation values one token keeps in one layer on the attention side."""
    q, k, v = attention_io_per_token(m)
    o_in = m.num_heads * (m.mla.v_head_dim if m.mla else m.head_dim)
    common = 3 * m.hidden_size + q + k + v + o_in
    if moe:
        return common + m.top_k * m.hidden_size + 3 * m.shared_ffn_size
    return common + 3 * m.dense_ffn_size


def expert_row_values(m: ModelConfig) -> int:
    """Activation values of one (token, expert) row in the routed experts."""
    return m.hidden_size + 3 * m.expert_ffn_size


def activation_bytes(m: ModelConfig, tokens: int, value_bytes: int) -> int:
    """Bytes the forward of `tokens` tokens keeps until its backward (module docstring)."""
    moe_layers = m.num_moe_layers
    dense_layers = m.num_layers - moe_layers
    per_token = value_bytes * (moe_layers * (attention_layer_values(m, True) + m.top_k * expert_row_values(m))
                               + dense_layers * attention_layer_values(m, False))
    per_token += FP32 * (moe_layers * m.num_experts + m.num_layers * m.num_heads + m.vocab_size)
    return tokens * per_token
