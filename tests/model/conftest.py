"""Tiny model configs shared by the model tests (small enough for float64 gradcheck)."""

from __future__ import annotations

from typing import Any

import pytest

from disagmoe.config import ModelConfig


def tiny_config(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        name="test-tiny", vocab_size=32, hidden_size=16, num_layers=2, num_heads=4, num_kv_heads=2,
        head_dim=4, num_experts=4, top_k=2, expert_ffn_size=8, seq_len=16,
        router=dict(aux_loss_coef=0.01, z_loss_coef=0.001),
    )
    base.update(overrides)
    return ModelConfig.model_validate(base)


def tiny_mla_config(**overrides: Any) -> ModelConfig:
    base: dict[str, Any] = dict(
        attention="mla", num_kv_heads=4, head_dim=6, num_layers=3, num_dense_layers=1, dense_ffn_size=12,
        num_experts=8, num_shared_experts=1,
        mla=dict(q_lora_rank=8, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4),
        router=dict(score="sigmoid", num_groups=4, topk_groups=2, routed_scaling=2.5,
                    bias_balancing=True, aux_loss_coef=0.01),
    )
    base.update(overrides)
    return tiny_config(**base)


@pytest.fixture
def make_config():
    return tiny_config


@pytest.fixture
def make_mla_config():
    return tiny_mla_config
