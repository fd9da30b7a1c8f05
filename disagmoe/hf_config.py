"""Map a Hugging Face `config.json` (Mixtral, Qwen3-MoE, DeepSeek-V3) to a `ModelConfig`.

Local files only: nothing is downloaded. No torch import (the planner reads these too).
"""

from __future__ import annotations

import math
from typing import Any

from disagmoe.config import ModelConfig, validate

SUPPORTED = ("mixtral", "qwen3_moe", "deepseek_v3")

# The type of every key the mapping reads (None is allowed where Hugging Face writes null for
# "not set"; a required key must have a value, `_need`). Checked before any arithmetic on them.
INT, NUMBER, BOOL, MAPPING, TEXT, LIST = "an integer", "a number", "true or false", "a mapping", "a string", "a list"
KEY_TYPES: dict[str, str] = {
    **dict.fromkeys((
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
        "max_position_embeddings", "head_dim", "num_local_experts", "num_experts", "num_experts_per_tok",
        "intermediate_size", "moe_intermediate_size", "decoder_sparse_step", "qk_nope_head_dim", "qk_rope_head_dim",
        "q_lora_rank", "kv_lora_rank", "v_head_dim", "first_k_dense_replace", "n_routed_experts", "n_shared_experts",
        "n_group", "topk_group", "original_max_position_embeddings"), INT),
    **dict.fromkeys(("rope_theta", "rms_norm_eps", "router_aux_loss_coef", "routed_scaling_factor", "aux_loss_alpha",
                     "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"), NUMBER),
    **dict.fromkeys(("tie_word_embeddings", "norm_topk_prob", "truncate"), BOOL),
    **dict.fromkeys(("rope_scaling", "rope_parameters"), MAPPING),
    **dict.fromkeys(("_name_or_path", "model_type", "rope_type", "type"), TEXT),
    "mlp_only_layers": LIST,
}
POSITIVE = ("num_attention_heads", "hidden_size")  # divided by before the schema checks the sizes


def _is(value: Any, kind: str) -> bool:
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, {BOOL: bool, MAPPING: dict, TEXT: str, LIST: list}[kind])


def check_types(data: dict[str, Any], source: str, where: str = "") -> None:
    """ValueError naming the first key of `KEY_TYPES` (in `data`, or in its RoPE mapping) whose
    value has another type, or a `POSITIVE` one that is not above zero."""
    for key, value in data.items():
        kind = KEY_TYPES.get(key)
        if kind is None or value is None:
            continue
        if not _is(value, kind):
            raise ValueError(f"{source}: {where}{key} is {value!r} ({type(value).__name__}); it must be {kind}")
        if key in POSITIVE and value <= 0:
            raise ValueError(f"{source}: {where}{key} is {value!r}; it must be above 0")
        if kind == MAPPING:
            check_types(value, source, f"{where}{key}.")


def _need(data: dict[str, Any], key: str, source: str) -> Any:
    if data.get(key) is None:
        raise ValueError(f"{source}: Hugging Face config has no {key!r}{' value' if key in data else ''}; "
                         "is it a complete config.json?")
    return data[key]


def rope_theta(data: dict[str, Any]) -> float:
    """RoPE base: top-level `rope_theta` (older configs) or `rope_parameters.rope_theta` (transformers 5)."""
    if "rope_theta" in data:
        return float(data["rope_theta"])
    return float((data.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def rope_scaling(data: dict[str, Any], source: str) -> dict[str, Any] | None:
    """YaRN settings from `rope_scaling` (older configs) or `rope_parameters` (transformers 5);
    None for plain RoPE; ValueError for a scaling the model does not implement."""
    rope = data.get("rope_scaling") or data.get("rope_parameters") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        raise ValueError(f"{source}: RoPE scaling {kind!r} is not implemented by disagmoe.model (yarn is); remove "
                         "rope_scaling from config.json to load the weights with plain RoPE (logits will differ "
                         "from the scaled model's)")
    original = rope.get("original_max_position_embeddings") or data.get("max_position_embeddings")
    factor = rope.get("factor") or (data.get("max_position_embeddings") or 0) / (original or 1)
    if not original or not factor:
        raise ValueError(f"{source}: yarn RoPE scaling needs original_max_position_embeddings and a factor "
                         "(or max_position_embeddings to derive it from)")
    scaling = dict(factor=factor, original_max_position_embeddings=original,
                   beta_fast=rope.get("beta_fast") or 32.0, beta_slow=rope.get("beta_slow") or 1.0,
                   mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
                   attention_factor=rope.get("attention_factor"), truncate=rope.get("truncate") is not False)
    return scaling


def model_config_from_hf(data: dict[str, Any], source: str = "config.json") -> ModelConfig:
    """Build our config from a parsed HF config dict; reject architectures we do not implement."""
    model_type = data.get("model_type")
    if not isinstance(model_type, str) or model_type not in SUPPORTED:
        raise ValueError(
            f"{source}: model_type {model_type!r} is not supported; supported Hugging Face "
            f"architectures: {', '.join(SUPPORTED)}"
        )
    check_types(data, source)
    g = lambda key: _need(data, key, source)  # noqa: E731
    hidden = g("hidden_size")
    heads = g("num_attention_heads")
    common: dict[str, Any] = dict(
        name=data.get("_name_or_path") or model_type,
        vocab_size=g("vocab_size"),
        hidden_size=hidden,
        num_layers=g("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=data.get("num_key_value_heads") or heads,
        rope_theta=rope_theta(data),
        rope_scaling=rope_scaling(data, source),
        norm_eps=data.get("rms_norm_eps", 1e-6),
        tie_embeddings=bool(data.get("tie_word_embeddings", False)),
        seq_len=min(int(data.get("max_position_embeddings", 4096)), 4096),
    )
    if model_type == "mixtral":
        common.update(
            head_dim=data.get("head_dim") or hidden // heads,
            num_experts=g("num_local_experts"),
            top_k=g("num_experts_per_tok"),
            expert_ffn_size=g("intermediate_size"),
            router=dict(score="softmax", normalize_topk=True,
                        aux_loss_coef=data.get("router_aux_loss_coef", 0.0)),
        )
    elif model_type == "qwen3_moe":
        if data.get("mlp_only_layers") or data.get("decoder_sparse_step", 1) != 1:
            raise ValueError(
                f"{source}: Qwen3-MoE configs with dense layers interleaved (mlp_only_layers / "
                "decoder_sparse_step != 1) are not supported"
            )
        common.update(
            head_dim=data.get("head_dim") or hidden // heads,
            qk_norm=True,
            # transformers 5 writes `num_local_experts`; published configs say `num_experts`
            num_experts=data.get("num_experts") or g("num_local_experts"),
            top_k=g("num_experts_per_tok"),
            expert_ffn_size=g("moe_intermediate_size"),
            dense_ffn_size=data.get("intermediate_size", 0),
            # Qwen3MoeConfig's default is norm_topk_prob=False (published checkpoints set True)
            router=dict(score="softmax", normalize_topk=bool(data.get("norm_topk_prob", False)),
                        aux_loss_coef=data.get("router_aux_loss_coef", 0.0)),
        )
    else:  # deepseek_v3
        nope, rope = g("qk_nope_head_dim"), g("qk_rope_head_dim")
        common.update(
            head_dim=nope + rope,
            num_kv_heads=heads,
            attention="mla",
            mla=dict(q_lora_rank=data.get("q_lora_rank"), kv_lora_rank=g("kv_lora_rank"),
                     qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=g("v_head_dim")),
            num_dense_layers=data.get("first_k_dense_replace", 0),
            dense_ffn_size=g("intermediate_size"),
            num_experts=g("n_routed_experts"),
            top_k=g("num_experts_per_tok"),
            expert_ffn_size=g("moe_intermediate_size"),
            num_shared_experts=data.get("n_shared_experts") or 0,
            router=dict(score="sigmoid", normalize_topk=bool(data.get("norm_topk_prob", True)),
                        num_groups=data.get("n_group") or 1, topk_groups=data.get("topk_group") or 1,
                        routed_scaling=data.get("routed_scaling_factor", 1.0),
                        aux_loss_coef=data.get("aux_loss_alpha", 0.0), bias_balancing=True),
        )
    return validate(ModelConfig, common, source)
