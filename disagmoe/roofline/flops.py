"""Model FLOPs of one training step (forward + backward), the numerator of MFU.

    step_flops = 6 * N_matmul * T  +  6 * L * heads * (d_qk + d_v) * S * T / 2

N_matmul is the active parameter count (`count_params(m).active`) minus the input embedding
table, which is a lookup and does no multiply-adds (a tied table still counts once, as the LM
head). T is the number of tokens in the step, S the sequence length, L the number of layers,
d_qk / d_v the per-head query-key and value widths (both `head_dim` for GQA). The second term is
the attention score and value matmuls, 2 * S * heads * (d_qk + d_v) FLOPs per token forward,
times 3 for forward plus backward, halved because causal attention skips the upper triangle;
for GQA it is the familiar 12 * L * heads * head_dim * S * T / 2. Norms, softmax, RoPE and the
router's top-k are not counted (the usual convention for model FLOPs utilisation).

No torch import: the planner and the trainer both use this.
"""

from __future__ import annotations

from disagmoe.config import ModelConfig
from disagmoe.roofline.params import count_params


def matmul_params(m: ModelConfig) -> int:
    """Active parameters that take part in a matmul: all active ones but the input lookup table."""
    input_lookup = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size
    return count_params(m).active - input_lookup


def attention_head_dims(m: ModelConfig) -> tuple[int, int]:
    """(query-key width, value width) per head."""
    if m.attention == "mla":
        assert m.mla is not None
        return m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim
    return m.head_dim, m.head_dim


def step_flops(m: ModelConfig, tokens: int, seq_len: int) -> float:
    """Forward + backward FLOPs of a training step over `tokens` tokens in sequences of `seq_len`."""
    if tokens < 0 or seq_len <= 0:
        raise ValueError(f"need tokens >= 0 and seq_len > 0, got tokens={tokens}, seq_len={seq_len}")
    d_qk, d_v = attention_head_dims(m)
    dense = 6.0 * matmul_params(m) * tokens
    attention = 6.0 * m.num_layers * m.num_heads * (d_qk + d_v) * seq_len * tokens / 2
    return dense + attention
