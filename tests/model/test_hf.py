"""Logit parity with transformers' own Mixtral / Qwen3-MoE / DeepSeek-V3 on tiny random models,
and export round trips (ours -> HF files -> transformers and ours)."""

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from disagmoe.model_ref import load_model  # noqa: E402
from disagmoe.model.hf import export_hf, hf_config_from_model, load_hf  # noqa: E402
from disagmoe.model.transformer import MoETransformer  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=64, rms_norm_eps=1e-6)


def mixtral():
    return transformers.MixtralForCausalLM(transformers.MixtralConfig(
        **COMMON, num_key_value_heads=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2))


# YaRN as published configs set it, with a short "original" context so that tokens 0..10 span
# kept, blended and interpolated frequencies
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 4,
                 "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 1.0}
QWEN_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 8}


def qwen3_moe(tie_word_embeddings=False, rope_parameters=None):
    extra = {} if rope_parameters is None else {"rope_parameters": rope_parameters}
    return transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, intermediate_size=48, moe_intermediate_size=24,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, tie_word_embeddings=tie_word_embeddings,
        **extra))


def deepseek_v3(q_lora_rank=16, rope_interleave=True, rope_parameters=None):
    extra = {} if rope_parameters is None else {"rope_parameters": rope_parameters}
    return transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=4, intermediate_size=48,
        moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2,
        first_k_dense_replace=1, n_shared_experts=2, q_lora_rank=q_lora_rank, kv_lora_rank=12,
        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, routed_scaling_factor=2.5,
        rope_interleave=rope_interleave, **extra))


BUILDERS = {
    "mixtral": mixtral,
    "qwen3_moe": qwen3_moe,
    "qwen3_moe-tied": lambda: qwen3_moe(tie_word_embeddings=True),
    "deepseek_v3": deepseek_v3,
    "deepseek_v3-no-q-lora-no-interleave": lambda: deepseek_v3(q_lora_rank=None, rope_interleave=False),
    "deepseek_v3-yarn": lambda: deepseek_v3(rope_parameters=DEEPSEEK_YARN),
    "qwen3_moe-yarn": lambda: qwen3_moe(rope_parameters=QWEN_YARN),
}


def randomized(hf_model):
    """Every weight random (norm weights around 1, routers decisive), seeded."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, t in [*hf_model.named_parameters(), *hf_model.named_buffers()]:
            if "rotary_emb" in name:
                continue
            noise = torch.randn(t.shape, generator=gen, dtype=torch.float32).to(t.dtype)
            if "norm" in name:
                t.copy_(1.0 + 0.2 * noise)
            elif name.endswith((".gate.weight", "e_score_correction_bias")):
                t.copy_(noise)
            else:
                t.copy_(0.1 * noise)
    return hf_model.eval()


def hf_logits(hf_model, tokens):
    with torch.no_grad():
        return hf_model(input_ids=tokens).logits


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, 64, (2, 11), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_logits_match_transformers(arch, tokens, tmp_path):
    torch.manual_seed(0)
    hf_model = randomized(BUILDERS[arch]())
    hf_model.save_pretrained(tmp_path)
    ours = load_hf(tmp_path)
    with torch.no_grad():
        diff = (ours(tokens).logits_BSV - hf_logits(hf_model, tokens)).abs().max().item()
    assert diff < 1e-4, f"{arch}: max |logit diff| = {diff}"


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "deepseek_v3-yarn"])
def test_export_round_trip(arch, tokens, tmp_path):
    torch.manual_seed(0)
    hf_model = randomized(BUILDERS[arch]())
    hf_model.save_pretrained(tmp_path / "src")
    ours = load_hf(tmp_path / "src")
    export_hf(ours, tmp_path / "out", arch.split("-")[0])

    again = load_hf(tmp_path / "out")
    for (name, a), b in zip(ours.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    diff = (hf_logits(reloaded, tokens) - hf_logits(hf_model, tokens)).abs().max().item()
    assert diff < 1e-5, f"{arch}: exported checkpoint's logits differ by {diff}"


def test_the_published_deepseek_v3_rope_scaling_maps_to_yarn():
    """deepseek-ai/DeepSeek-V3's config.json (the older `rope_scaling` key, `type`), as our preset has it."""
    from disagmoe.hf_config import rope_scaling

    published = {"max_position_embeddings": 163840, "rope_scaling": {
        "beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096, "type": "yarn"}}
    preset = load_model("deepseek-v3").rope_scaling
    assert preset is not None and preset.model_dump() == {**rope_scaling(published, "config.json"), "type": "yarn"}
    with pytest.raises(ValueError, match="RoPE scaling 'dynamic' is not implemented"):
        rope_scaling({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "config.json")
    with pytest.raises(ValueError, match="needs original_max_position_embeddings and a factor"):
        rope_scaling({"rope_scaling": {"type": "yarn"}}, "config.json")
    assert rope_scaling({"max_position_embeddings": 64, "rope_scaling": {
        "type": "yarn", "original_max_position_embeddings": 16, "truncate": None}}, "config.json")["truncate"]


def test_sharded_checkpoints_load(tokens, tmp_path):
    hf_model = randomized(mixtral())
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    ours = load_hf(tmp_path / "hf")
    export_hf(ours, tmp_path / "out", "mixtral", max_shard_bytes=30_000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    torch.testing.assert_close(load_hf(tmp_path / "out")(tokens).logits_BSV, ours(tokens).logits_BSV)


@pytest.mark.parametrize("entry", ["../outside.safetensors", "/etc/passwd", "sub/../../x.safetensors", "link"])
def test_weight_map_entries_stay_inside_the_checkpoint_folder(tmp_path, entry):
    randomized(mixtral()).save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    (tmp_path / "hf" / "link").symlink_to(tmp_path / "elsewhere.safetensors")
    index_path = tmp_path / "hf" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][next(iter(index["weight_map"]))] = entry
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match=f"weight_map entry '{re.escape(entry)}' is not a file inside"):
        load_hf(tmp_path / "hf")


def test_config_json_maps_through_load_model(tmp_path):
    qwen3_moe().config.save_pretrained(tmp_path)
    cfg = load_model(str(tmp_path / "config.json"))
    assert (cfg.num_experts, cfg.top_k, cfg.qk_norm, cfg.router.normalize_topk) == (4, 2, True, True)
    mixtral().config.save_pretrained(tmp_path)
    assert load_model(str(tmp_path / "config.json")).rope_theta == 1e6  # transformers-5 rope_parameters


def test_our_presets_export_to_their_architecture():
    tiny_ds = load_model("deepseek-v3").model_copy(update=dict(num_layers=4, vocab_size=100))
    hf = hf_config_from_model(tiny_ds, "deepseek_v3")
    assert (hf["n_group"], hf["topk_group"], hf["n_shared_experts"]) == (8, 4, 1)
    with pytest.raises(ValueError, match="cannot be written as a 'mixtral'"):
        hf_config_from_model(tiny_ds, "mixtral")
    with pytest.raises(ValueError, match="cannot be written as a 'mixtral'"):
        hf_config_from_model(load_model("tiny"), "mixtral")  # shared expert, dense layer


def test_unreproducible_settings_are_rejected(tmp_path):
    hf_model = deepseek_v3()
    hf_model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 2,
                                 "long_factor": [2.0] * 2, "original_max_position_embeddings": 16}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="RoPE scaling 'longrope' is not implemented"):
        load_hf(tmp_path)
    del config["rope_parameters"]
    config["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"quantized checkpoints \(fp8\)"):
        load_hf(tmp_path)


def test_checkpoint_tensors_without_a_place_are_errors(tmp_path):
    from safetensors.torch import load_file, save_file

    mixtral().save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.zeros(32)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="q_proj.bias"):
        load_hf(tmp_path)


def test_non_zero_bias_cannot_go_to_an_architecture_without_one(make_config, tmp_path):
    cfg = make_config(num_heads=4, num_kv_heads=2, head_dim=4, router=dict(bias_balancing=True))
    model = MoETransformer(cfg)
    export_hf(model, tmp_path / "zero", "mixtral")  # a zero bias changes nothing
    model.update_router_bias(torch.tensor([[3, 1, 2, 2], [2, 2, 2, 2]]))
    with pytest.raises(ValueError, match="no routing bias"):
        export_hf(model, tmp_path / "nonzero", "mixtral")


def test_fused_expert_tensors_load_like_per_expert_ones(tokens, tmp_path):
    """transformers-5 style `experts.gate_up_proj` [E, 2F, H] / `experts.down_proj` [E, H, F]."""
    from safetensors.torch import load_file, save_file

    hf_model = randomized(qwen3_moe())
    hf_model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    for layer in range(2):
        prefix = f"model.layers.{layer}.mlp.experts"
        take = lambda proj: torch.stack([tensors.pop(f"{prefix}.{e}.{proj}.weight") for e in range(4)])  # noqa: E731
        gate, up, down = take("gate_proj"), take("up_proj"), take("down_proj")
        tensors[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        tensors[f"{prefix}.down_proj"] = down
    save_file(tensors, tmp_path / "model.safetensors")
    diff = (load_hf(tmp_path)(tokens).logits_BSV - hf_logits(hf_model, tokens)).abs().max().item()
    assert diff < 1e-4
