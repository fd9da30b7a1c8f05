"""`bench train --baseline hf` (disagmoe/bench/hf_baseline.py) on CPU: each family's model is
picked from the config's shape, built with exactly our parameters, and trained by the loop the
GPU baseline times; a model no family expresses is refused naming each family's reason."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from disagmoe.bench import hf_baseline  # noqa: E402
from disagmoe.config import DataConfig, OptimConfig, TrainConfig  # noqa: E402
from disagmoe.data import TokenDataset, load_splits  # noqa: E402
from disagmoe.hf_config import model_config_from_hf  # noqa: E402
from disagmoe.model import MoETransformer  # noqa: E402
from disagmoe.model_ref import load_model  # noqa: E402

COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
              rms_norm_eps=1e-6)
HF_CONFIGS = {
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON, num_key_value_heads=2, head_dim=16, intermediate_size=24, moe_intermediate_size=24, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_key_value_heads=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2),
    "deepseek_v3": lambda: transformers.DeepseekV3Config(
        **{**COMMON, "num_hidden_layers": 3}, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
        n_routed_experts=8, num_experts_per_tok=3, n_group=4, topk_group=2, first_k_dense_replace=1,
        n_shared_experts=2, q_lora_rank=None, kv_lora_rank=12, qk_nope_head_dim=8, qk_rope_head_dim=4,
        v_head_dim=6, routed_scaling_factor=2.5),
}


def ours(family: str):
    data = HF_CONFIGS[family]().to_dict()
    return model_config_from_hf({**data, "model_type": family}, f"a tiny {family}")


@pytest.mark.parametrize("family", HF_CONFIGS)
def test_each_family_is_picked_from_the_shape_and_built_with_our_parameters(family):
    m = ours(family)
    assert hf_baseline.hf_family(m)[0] == family
    model, model_type, _ = hf_baseline.build_model(m, torch.device("cpu"), dtype=torch.float32)
    assert model_type == family
    assert type(model).__name__ == {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
                                    "deepseek_v3": "DeepseekV3ForCausalLM"}[family]
    theirs = sum(p.numel() for p in model.parameters())
    assert theirs == sum(p.numel() for p in MoETransformer(m).parameters())
    if family in hf_baseline.WITH_AUX_LOSS:
        assert model.config.output_router_logits is (m.router.aux_loss_coef > 0)


@pytest.mark.parametrize("family", HF_CONFIGS)
def test_the_timed_loop_trains_each_family_on_our_batches(family):
    m = ours(family)
    cfg = TrainConfig(model=m, mode="single", steps=4, batch_size=4, seq_len=16, micro_batches=2,
                      data=DataConfig(kind="synthetic", synthetic_alphabet=64), optim=OptimConfig(lr=1e-2, warmup_steps=1))
    torch.manual_seed(0)
    model, model_type, _ = hf_baseline.build_model(m, torch.device("cpu"), dtype=torch.float32)
    splits = load_splits(cfg.data, m.vocab_size, cfg.seq_len)
    data = TokenDataset(splits.train, cfg.seq_len, cfg.batch_size, cfg.data_seed, "train")
    marks = []  # the clock sampler's: 0 before the first step, then each step's number as it ends
    losses, seconds = hf_baseline.train_steps(model, model_type, m, cfg, data, cfg.steps, torch.device("cpu"), marks.append)
    assert len(losses) == len(seconds) == 4 and all(torch.isfinite(torch.tensor(losses))) and marks == [0, 1, 2, 3, 4]
    assert losses[-1] < losses[0]


def test_a_model_no_family_expresses_is_refused_with_each_reason():
    with pytest.raises(ValueError, match=r"no family expresses model 'tiny' exactly \(qwen3_moe: .*; mixtral: .*; "
                                         r"deepseek_v3: .*needs attention='mla'\); drop --baseline"):
        hf_baseline.hf_family(load_model("tiny"))


@pytest.mark.parametrize("config, family", [("configs/h200x2-qwen3-30b.yaml", "qwen3_moe"),
                                            ("configs/h200-mixtral-8x7b.yaml", "mixtral"),
                                            ("configs/h200-deepseek-v3.yaml", "deepseek_v3")])
def test_the_one_gpu_configs_of_each_family_have_their_baseline(config, family):
    """Each family's config trains on one H200: its fp32 masters, gradients and moments and bf16
    weights (18 bytes a parameter) leave a third of the 141 GB for activations."""
    from disagmoe.config import load_train_config
    from disagmoe.roofline.params import count_params

    cfg = load_train_config(config)
    m = load_model(cfg.model)
    assert hf_baseline.hf_family(m)[0] == family
    assert cfg.device == "cuda" and 18 * count_params(m).total < 0.67 * 141e9
