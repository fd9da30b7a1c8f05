"""Training FLOPs per step against the 6 * N * D rule (disagmoe/roofline/flops.py)."""

from __future__ import annotations

import pytest

from disagmoe.config import preset_names
from disagmoe.model_ref import load_model
from disagmoe.roofline.flops import step_flops
from disagmoe.roofline.params import count_params


@pytest.mark.parametrize("name", preset_names("models"))
def test_without_attention_it_is_six_n_d_over_the_matmul_params(name):
    m = load_model(name)
    tokens = 4096
    lookup = 0 if m.tie_embeddings else m.vocab_size * m.hidden_size
    six_nd = 6 * (count_params(m).active - lookup) * tokens
    # the attention term is linear in seq_len: extrapolate it away
    at_1, at_2 = step_flops(m, tokens, 1), step_flops(m, tokens, 2)
    assert 2 * at_1 - at_2 == pytest.approx(six_nd, rel=1e-12)


def test_gqa_attention_term_is_twelve_l_h_d_s_t_over_two():
    m = load_model("mixtral-8x7b")
    tokens, seq = 8192, 4096
    dense = 6 * (count_params(m).active - m.vocab_size * m.hidden_size) * tokens
    expected = 12 * m.num_layers * m.num_heads * m.head_dim * seq * tokens / 2
    assert step_flops(m, tokens, seq) - dense == pytest.approx(expected, rel=1e-12)


def test_mla_attention_uses_qk_and_v_widths():
    m = load_model("deepseek-v3")
    assert m.mla is not None
    tokens = 1024
    per_seq = step_flops(m, tokens, 2) - step_flops(m, tokens, 1)
    d_qk = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
    assert per_seq == pytest.approx(6 * m.num_layers * m.num_heads * (d_qk + m.mla.v_head_dim) * tokens / 2)


def test_tied_embeddings_keep_the_table_as_lm_head():
    untied = load_model("tiny")
    tied = untied.model_copy(update={"tie_embeddings": True})
    tokens = 100
    # a tied table is counted once, as the LM head: nothing is subtracted for the lookup
    assert 2 * step_flops(tied, tokens, 1) - step_flops(tied, tokens, 2) == pytest.approx(
        6 * count_params(tied).active * tokens
    )


def test_close_to_six_n_d_for_a_large_model_at_moderate_context():
    m = load_model("qwen3-235b-a22b")
    tokens = 4 * 1024 * 1024
    ratio = step_flops(m, tokens, 4096) / (6 * count_params(m).active * tokens)
    assert 1.0 < ratio < 1.3


def test_negative_tokens_are_rejected():
    with pytest.raises(ValueError, match="tokens >= 0"):
        step_flops(load_model("tiny"), -1, 128)
