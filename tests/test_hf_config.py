"""Hugging Face config.json -> ModelConfig, from configs that transformers itself writes."""

import json

import pytest

from disagmoe.model_ref import load_model
from disagmoe.roofline.params import count_params

transformers = pytest.importorskip("transformers")


def _write(tmp_path, hf_config):
    path = tmp_path / "config.json"
    path.write_text(hf_config.to_json_string())
    return str(path)


def test_mixtral(tmp_path):
    hf = transformers.MixtralConfig(vocab_size=1000, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
                                    num_experts_per_tok=2)
    m = load_model(_write(tmp_path, hf))
    assert (m.num_experts, m.top_k, m.expert_ffn_size, m.head_dim, m.num_kv_heads) == (6, 2, 96, 16, 2)
    assert m.attention == "gqa" and not m.qk_norm


def test_qwen3_moe(tmp_path):
    hf = transformers.Qwen3MoeConfig(vocab_size=1000, hidden_size=64, moe_intermediate_size=32,
                                     intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=3)
    m = load_model(_write(tmp_path, hf))
    assert (m.num_experts, m.top_k, m.expert_ffn_size, m.head_dim) == (8, 3, 32, 32)
    assert m.qk_norm


def test_deepseek_v3_full_size_counts(tmp_path):
    hf = transformers.DeepseekV3Config()  # the published DeepSeek-V3 shape
    m = load_model(_write(tmp_path, hf))
    assert m.attention == "mla" and m.num_dense_layers == 3 and m.router.score == "sigmoid"
    assert abs(count_params(m).total / 671e9 - 1) < 0.02


def test_foreign_architecture_is_refused(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    with pytest.raises(ValueError, match="model_type 'llama' is not supported"):
        load_model(str(path))


def test_incomplete_config_names_the_missing_key(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mixtral", "hidden_size": 64}))
    with pytest.raises(ValueError, match="no 'num_attention_heads'"):
        load_model(str(path))
