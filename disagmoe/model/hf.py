"""Hugging Face checkpoints <-> `MoETransformer`: Mixtral, Qwen3-MoE and DeepSeek-V3.

    model = load_hf("path/to/hf_dir")            # config.json + *.safetensors (sharded or not)
    export_hf(model, "out_dir", "qwen3_moe")     # config.json + model.safetensors with HF names

Local files only. Names are translated per tensor (the table `_LOCAL_NAMES`); routed experts are
stacked: HF stores per-expert Linear weights [out, in] (`w1`/`w3`/`w2` in Mixtral,
`gate_proj`/`up_proj`/`down_proj` otherwise), or transformers-5 fused `gate_up_proj` [E, 2F, H]
and `down_proj` [E, H, F]; ours are `w13_EH2F` [E, H, 2F] (gate then up) and `w2_EFH` [E, F, H].
DeepSeek checkpoints pair RoPE dims as (0,1), (2,3), ... (`rope_interleave`, the default); our MLA
pairs (i, i + R/2), so import permutes those weight rows and export permutes them back.

Shape legend: E experts, H hidden, F expert FFN width, R rotary dims, n heads, D q/k head dim.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path, PurePosixPath
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from disagmoe.config import ModelConfig, read_mapping
from disagmoe.hf_config import SUPPORTED, model_config_from_hf, rope_scaling
from disagmoe.model.transformer import MoETransformer

# our name inside `layers.{i}.` -> HF name inside `model.layers.{i}.`; "{moe}" is the MoE module
_LOCAL_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_a_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "ffn.w1.weight": "mlp.gate_proj.weight",
    "ffn.w3.weight": "mlp.up_proj.weight",
    "ffn.w2.weight": "mlp.down_proj.weight",
    "moe.router.weight": "{moe}.gate.weight",
    "moe.router.expert_bias": "{moe}.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "{moe}.shared_experts.gate_proj.weight",
    "moe.shared_experts.w3.weight": "{moe}.shared_experts.up_proj.weight",
    "moe.shared_experts.w2.weight": "{moe}.shared_experts.down_proj.weight",
}
_GLOBAL_NAMES = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
                 "lm_head.weight": "lm_head.weight"}
_EXPERTS = ("moe.experts.w13_EH2F", "moe.experts.w2_EFH")
_ARCHITECTURES = {"mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                  "deepseek_v3": "DeepseekV3ForCausalLM"}


def _moe_module(model_type: str) -> str:
    return "block_sparse_moe" if model_type == "mixtral" else "mlp"


def _expert_names(model_type: str) -> tuple[str, str, str]:
    """HF per-expert (gate, up, down) Linear names."""
    return ("w1", "w3", "w2") if model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")


def hf_name(name: str, model_type: str) -> str:
    """The HF tensor name of one of our (non-expert) state-dict names."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    _, layer, local = name.split(".", 2)
    return f"model.layers.{layer}." + _LOCAL_NAMES[local].format(moe=_moe_module(model_type))


# ----------------------------------------------------------------------------------------------
# What we can reproduce exactly
# ----------------------------------------------------------------------------------------------


def check_reproducible(hf: dict[str, Any], source: str) -> None:
    """Reject HF settings the reference model does not implement (its logits would differ)."""
    if hf.get("model_type") not in SUPPORTED:
        raise ValueError(f"{source}: model_type {hf.get('model_type')!r} is not one of {', '.join(SUPPORTED)}")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?")
        raise ValueError(
            f"{source}: quantized checkpoints ({method}) are not supported; dequantize the weights "
            "to bf16/fp32 safetensors first"
        )
    rope_scaling(hf, source)  # raises for a scaling other than yarn
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{source}: hidden_act={hf['hidden_act']!r}; only SwiGLU with silu is implemented")
    if hf.get("attention_bias"):
        raise ValueError(f"{source}: attention_bias=true is not implemented (projections have no bias)")
    if hf.get("use_sliding_window") or (hf.get("model_type") == "mixtral" and hf.get("sliding_window")):
        raise ValueError(
            f"{source}: sliding-window attention is not implemented; set sliding_window to null "
            "(exact for sequences no longer than the window)"
        )


def _rope_interleaved(hf: dict[str, Any]) -> bool:
    return hf.get("model_type") == "deepseek_v3" and bool(hf.get("rope_interleave", True))


def _deinterleave_perm(rot_dim: int) -> torch.Tensor:
    """Row order taking pairs (0,1), (2,3), ... to pairs (i, i + R/2)."""
    return torch.cat([torch.arange(0, rot_dim, 2), torch.arange(1, rot_dim, 2)])


def _permute_rope_rows(name: str, w: torch.Tensor, cfg: ModelConfig, inverse: bool) -> torch.Tensor:
    """Reorder the RoPE output rows of MLA's q and kv-a projections (identity for other tensors)."""
    assert cfg.mla is not None
    perm = _deinterleave_perm(cfg.mla.qk_rope_head_dim)
    if inverse:
        perm = torch.argsort(perm)
    nope, rope = cfg.mla.qk_nope_head_dim, cfg.mla.qk_rope_head_dim
    if name.endswith(("attention.wq.weight", "attention.wq_b.weight")):
        w_nDi = w.view(cfg.num_heads, nope + rope, -1)
        return torch.cat([w_nDi[:, :nope], w_nDi[:, nope:][:, perm]], dim=1).reshape_as(w)
    if name.endswith("attention.wkv_a.weight"):
        kv_rank = cfg.mla.kv_lora_rank
        return torch.cat([w[:kv_rank], w[kv_rank:][perm]])
    return w


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------


class SafetensorsDir:
    """Tensors of a HF directory by name, read lazily; shards found through the index json."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.is_file():
            weight_map = read_mapping(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' mapping of tensor names to shard files")
            self.file_of = {name: _shard_inside(path, file, index) for name, file in weight_map.items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise ValueError(f"{path}: no *.safetensors files (only safetensors checkpoints are read)")
            self.file_of = {}
            for file in files:
                with safe_open(file, "pt") as f:
                    self.file_of.update({name: file for name in f.keys()})  # noqa: SIM118
        self._stack = ExitStack()
        self._open: dict[Path, Any] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self.file_of)

    def read(self, name: str) -> torch.Tensor:
        if name not in self.file_of:
            raise ValueError(f"checkpoint has no tensor {name!r}; is it a complete checkpoint?")
        file = self.file_of[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(file, "pt"))
        return self._open[file].get_tensor(name)

    def close(self) -> None:
        self._stack.close()


def _shard_inside(directory: Path, file: Any, index: Path) -> Path:
    """`directory / file` for a weight_map entry, refusing one that is not a relative name
    inside `directory` (absolute, `..`, or through a symlink leading out)."""
    pure = PurePosixPath(file) if isinstance(file, str) else None
    path = directory / file if pure is not None else None
    if (pure is None or not file or pure.is_absolute() or "\\" in file or ".." in pure.parts
            or not path.resolve().is_relative_to(directory.resolve())):
        raise ValueError(f"{index}: weight_map entry {file!r} is not a file inside {directory}; "
                         "shard names must be relative names in the checkpoint's folder")
    return path


def _read_experts(tensors: SafetensorsDir, cfg: ModelConfig, model_type: str, layer: int,
                  used: set[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked (w13_EH2F, w2_EFH) of one layer from per-expert or fused HF tensors."""
    prefix = f"model.layers.{layer}.{_moe_module(model_type)}.experts"
    if f"{prefix}.gate_up_proj" in tensors:  # transformers-5 fused layout
        used.update({f"{prefix}.gate_up_proj", f"{prefix}.down_proj"})
        return (tensors.read(f"{prefix}.gate_up_proj").transpose(1, 2),
                tensors.read(f"{prefix}.down_proj").transpose(1, 2))
    gate, up, down = _expert_names(model_type)
    w13, w2 = [], []
    for e in range(cfg.num_experts):
        names = [f"{prefix}.{e}.{proj}.weight" for proj in (gate, up, down)]
        used.update(names)
        g_FH, u_FH, d_HF = (tensors.read(n) for n in names)
        w13.append(torch.cat([g_FH.T, u_FH.T], dim=1))
        w2.append(d_HF.T)
    return torch.stack(w13), torch.stack(w2)


def state_dict_from_hf(model: MoETransformer, hf: dict[str, Any], tensors: SafetensorsDir) -> dict[str, torch.Tensor]:
    """Our state dict from a HF checkpoint's tensors; unknown checkpoint tensors are errors."""
    cfg, model_type = model.cfg, hf["model_type"]
    ours: dict[str, torch.Tensor] = {}
    used: set[str] = set()
    for name in model.state_dict():
        if name.endswith(_EXPERTS[0]):
            layer = int(name.split(".")[1])
            ours[name], ours[name.replace(_EXPERTS[0], _EXPERTS[1])] = _read_experts(
                tensors, cfg, model_type, layer, used)
        elif not name.endswith(_EXPERTS[1]):
            source = hf_name(name, model_type)
            used.add(source)
            w = tensors.read(source)
            ours[name] = _permute_rope_rows(name, w, cfg, inverse=False) if _rope_interleaved(hf) else w
    leftover = [n for n in tensors if n not in used and not _ignorable(n, cfg)]
    if leftover:
        raise ValueError(
            f"checkpoint tensors with no place in the model (is config.json for these weights?): "
            f"{', '.join(sorted(leftover)[:8])}{' ...' if len(leftover) > 8 else ''}"
        )
    return ours


def _ignorable(name: str, cfg: ModelConfig) -> bool:
    """Tensors HF checkpoints may carry that the model does not use: DeepSeek's multi-token-
    prediction layers (index >= num_layers), cached rotary tables, a tied LM head's copy."""
    if name.endswith("rotary_emb.inv_freq") or (cfg.tie_embeddings and name == "lm_head.weight"):
        return True
    return name.startswith("model.layers.") and int(name.split(".")[2]) >= cfg.num_layers


def load_hf(path: str | Path, experts_backend: str = "loop", dtype: torch.dtype = torch.float32) -> MoETransformer:
    """Build a `MoETransformer` from a local HF directory (config.json + safetensors)."""
    path = Path(path)
    source = str(path / "config.json")
    hf = read_mapping(path / "config.json")
    check_reproducible(hf, source)
    cfg = model_config_from_hf(hf, source)
    model = MoETransformer(cfg, experts_backend)
    tensors = SafetensorsDir(path)
    try:
        state = state_dict_from_hf(model, hf, tensors)
    finally:
        tensors.close()
    model.load_state_dict(state, strict=True)
    return model.to(dtype)


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------


def hf_config_from_model(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """A HF config.json dict for `cfg`; ValueError when that architecture cannot express it."""
    if model_type not in _ARCHITECTURES:
        raise ValueError(f"unknown Hugging Face model_type {model_type!r}; choose one of {', '.join(_ARCHITECTURES)}")
    r = cfg.router
    hf: dict[str, Any] = dict(
        architectures=[_ARCHITECTURES[model_type]], model_type=model_type, vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, rms_norm_eps=cfg.norm_eps, hidden_act="silu",
        rope_parameters=_rope_parameters(cfg),
        tie_word_embeddings=cfg.tie_embeddings, max_position_embeddings=cfg.seq_len,
        num_experts_per_tok=cfg.top_k, attention_bias=False,
    )
    if model_type == "mixtral":
        hf.update(head_dim=cfg.head_dim, intermediate_size=cfg.expert_ffn_size,
                  num_local_experts=cfg.num_experts, router_aux_loss_coef=r.aux_loss_coef, sliding_window=None)
    elif model_type == "qwen3_moe":
        hf.update(head_dim=cfg.head_dim, moe_intermediate_size=cfg.expert_ffn_size, num_experts=cfg.num_experts,
                  intermediate_size=cfg.dense_ffn_size or cfg.expert_ffn_size, norm_topk_prob=r.normalize_topk,
                  router_aux_loss_coef=r.aux_loss_coef, decoder_sparse_step=1, mlp_only_layers=[],
                  use_sliding_window=False)
    else:
        m = cfg.mla
        if m is None:
            raise ValueError("model_type 'deepseek_v3' needs attention='mla'")
        n_shared = cfg.shared_ffn_size // cfg.expert_ffn_size
        hf.update(q_lora_rank=m.q_lora_rank, kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                  qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim,
                  first_k_dense_replace=cfg.num_dense_layers, intermediate_size=cfg.dense_ffn_size or cfg.expert_ffn_size,
                  n_routed_experts=cfg.num_experts, moe_intermediate_size=cfg.expert_ffn_size,
                  n_shared_experts=n_shared, norm_topk_prob=r.normalize_topk, n_group=r.num_groups,
                  topk_group=r.topk_groups, routed_scaling_factor=r.routed_scaling,
                  aux_loss_alpha=r.aux_loss_coef, rope_interleave=True, num_nextn_predict_layers=0)
    _check_round_trip(cfg, hf, model_type)
    return hf


def _rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """config.json's `rope_parameters` (transformers 5) for plain or YaRN-scaled RoPE."""
    if cfg.rope_scaling is None:
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    y = cfg.rope_scaling
    optional = {"mscale": y.mscale, "mscale_all_dim": y.mscale_all_dim, "attention_factor": y.attention_factor}
    return {"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": y.factor,
            "original_max_position_embeddings": y.original_max_position_embeddings, "beta_fast": y.beta_fast,
            "beta_slow": y.beta_slow, "truncate": y.truncate, **{k: v for k, v in optional.items() if v is not None}}


def _check_round_trip(cfg: ModelConfig, hf: dict[str, Any], model_type: str) -> None:
    """The HF config must map back to the same model, training-only knobs aside (the balancing
    bias itself is checked tensor by tensor in `state_dict_to_hf`)."""
    ignored: dict[str, Any] = {  # names, sources, lengths and initialisation: not a checkpoint's architecture
        "name": True, "source": True, "seq_len": True, "embedding_init_std": True, "num_shared_experts": True,
        "shared_expert_ffn_size": True,
        "router": {"z_loss_coef", "bias_update_rate", "bias_balancing"},
    }
    if cfg.num_dense_layers == 0:
        ignored["dense_ffn_size"] = True
    back = model_config_from_hf(hf, f"generated {model_type} config")
    want = {**cfg.model_dump(exclude=ignored), "shared_ffn_size": cfg.shared_ffn_size}
    got = {**back.model_dump(exclude=ignored), "shared_ffn_size": back.shared_ffn_size}
    diff = sorted(k for k in want if want[k] != got[k])
    if diff:
        raise ValueError(
            f"this model cannot be written as a {model_type!r} checkpoint: it differs in "
            f"{', '.join(f'{k}={want[k]!r}' for k in diff)}; pick the architecture that matches"
        )


def state_dict_to_hf(model: MoETransformer, model_type: str) -> dict[str, torch.Tensor]:
    """HF-named tensors (per-expert Linear weights, DeepSeek RoPE rows interleaved)."""
    cfg = model.cfg
    gate, up, down = _expert_names(model_type)
    out: dict[str, torch.Tensor] = {}
    for name, w in model.state_dict().items():
        w = w.detach()
        if name.endswith(_EXPERTS[0]):
            prefix = f"model.layers.{name.split('.')[1]}.{_moe_module(model_type)}.experts"
            F = w.shape[2] // 2
            for e in range(w.shape[0]):
                out[f"{prefix}.{e}.{gate}.weight"] = w[e, :, :F].T
                out[f"{prefix}.{e}.{up}.weight"] = w[e, :, F:].T
        elif name.endswith(_EXPERTS[1]):
            prefix = f"model.layers.{name.split('.')[1]}.{_moe_module(model_type)}.experts"
            for e in range(w.shape[0]):
                out[f"{prefix}.{e}.{down}.weight"] = w[e].T
        elif name.endswith("moe.router.expert_bias") and model_type != "deepseek_v3":
            if w.abs().max() > 0:
                raise ValueError(
                    f"{name} is non-zero but a {model_type!r} checkpoint has no routing bias (its "
                    "routing would differ); export as 'deepseek_v3' or train without bias_balancing"
                )
        else:
            out[hf_name(name, model_type)] = (
                _permute_rope_rows(name, w, cfg, inverse=True) if model_type == "deepseek_v3" else w
            )
    if model_type == "deepseek_v3":  # its router always has the bias: zeros if we trained without
        for i in range(cfg.num_dense_layers, cfg.num_layers):
            out.setdefault(f"model.layers.{i}.mlp.gate.e_score_correction_bias", torch.zeros(cfg.num_experts))
    return {k: v.contiguous().clone() for k, v in out.items()}


def export_hf(model: MoETransformer, out_dir: str | Path, model_type: str,
              max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write config.json and safetensors (sharded with an index json above `max_shard_bytes`)."""
    out = Path(out_dir)
    hf = hf_config_from_model(model.cfg, model_type)
    tensors = state_dict_to_hf(model, model_type)
    out.mkdir(parents=True, exist_ok=True)
    hf["dtype"] = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / "model.safetensors", metadata={"format": "pt"})
        return out
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out
