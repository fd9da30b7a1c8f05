"""A model named by reference: a preset, a YAML file or a Hugging Face `config.json`.

Sits above `config` (the schema, presets and YAML) and `hf_config` (the `config.json` mapping), so
neither imports the other's dispatch. No torch import: the planner reads models through it.
"""

from __future__ import annotations

from disagmoe.config import ModelConfig, load_preset_or_file, validate
from disagmoe.hf_config import model_config_from_hf


def load_model(ref: str | ModelConfig) -> ModelConfig:
    """A preset name, a YAML file, or a Hugging Face `config.json` (Mixtral, Qwen3-MoE, DeepSeek-V3)."""
    if isinstance(ref, ModelConfig):
        return ref
    data, source = load_preset_or_file(ref, "models")
    if "model_type" in data or "architectures" in data:
        return model_config_from_hf(data, source)
    return validate(ModelConfig, data, source)
