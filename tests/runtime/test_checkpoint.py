"""Layout-independent checkpoints (disagmoe/runtime/checkpoint.py)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from disagmoe.config import OptimConfig, load_model
from disagmoe.model import MoETransformer
from disagmoe.runtime.checkpoint import (
    MANIFEST,
    TensorKey,
    TrainerState,
    from_keyed,
    key_of,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    to_keyed,
)
from disagmoe.runtime.optim import build_optimizer


def trained_model(seed: int = 0, **model_updates):
    cfg = load_model("tiny").model_copy(update=model_updates)
    model = MoETransformer(cfg)
    model.init_weights(seed)
    optimizer = build_optimizer(model.named_parameters(), OptimConfig())
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(seed))
    out = model(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(out.logits_BSV.flatten(0, 1), tokens[:, 1:].flatten())
    (loss + out.aux_loss).backward()
    optimizer.step()
    return cfg, model, optimizer


def test_keys_name_layer_module_expert_and_parameter():
    assert key_of("layers.2.moe.experts.w13_EH2F", 5) == TensorKey(2, "moe.experts", 5, "w13_EH2F")
    assert key_of("embed.weight") == TensorKey(None, "embed", None, "weight")
    for key in (TensorKey(2, "moe.experts", 5, "w2_EFH"), TensorKey(None, "norm", None, "weight")):
        assert TensorKey.parse(str(key)) == key


def test_stacked_experts_split_per_expert_and_stack_back_exactly():
    cfg, model, _ = trained_model()
    state = model.state_dict()
    keyed = to_keyed(state)
    w13 = keyed[key_of("layers.1.moe.experts.w13_EH2F", 3)]
    assert w13.shape == (cfg.hidden_size, 2 * cfg.expert_ffn_size)
    assert torch.equal(w13, state["layers.1.moe.experts.w13_EH2F"][3])
    assert sum(k.expert is not None for k in keyed) == cfg.num_moe_layers * cfg.num_experts * 2
    back = from_keyed(keyed)
    assert back.keys() == state.keys()
    assert all(torch.equal(back[n], state[n]) for n in state)


def test_save_then_load_restores_model_optimizer_and_trainer_state(tmp_path):
    cfg, model, optimizer = trained_model(seed=1)
    torch.manual_seed(123)
    directory = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=7))
    expected_draw = torch.rand(3)

    _, fresh, fresh_opt = trained_model(seed=2)
    state = load_checkpoint(directory, fresh, fresh_opt, cfg)
    assert (state.step, state.data_step) == (7, 7)
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(a, b), name
    for p, q in zip(model.parameters(), fresh.parameters()):
        sa, sb = optimizer.state[p], fresh_opt.state[q]
        assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    state.restore_rng()
    assert torch.equal(torch.rand(3), expected_draw)


def test_shards_load_with_weights_only_and_match_the_manifest(tmp_path):
    cfg, model, optimizer = trained_model()
    directory = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=1))
    manifest = json.loads((directory / MANIFEST).read_text())
    files = sorted(p.name for p in directory.iterdir())
    assert files == sorted([MANIFEST, *(s["file"] for s in manifest["shards"])])  # no temp files left
    assert {s["file"] for s in manifest["shards"]} == {
        "global.pt", "trainer.pt", *(f"layer-{i:03d}.pt" for i in range(cfg.num_layers))
    }
    for shard in manifest["shards"]:
        data = (directory / shard["file"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == shard["sha256"]
        torch.load(directory / shard["file"], weights_only=True)


def test_a_different_model_config_is_refused_with_the_difference_named(tmp_path):
    cfg, model, optimizer = trained_model()
    directory = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=1))
    other_cfg, other, other_opt = trained_model(expert_ffn_size=32)
    with pytest.raises(ValueError, match="expert_ffn_size: 64 in the checkpoint, 32 now"):
        load_checkpoint(directory, other, other_opt, other_cfg)


def test_a_corrupt_shard_fails_its_checksum(tmp_path):
    cfg, model, optimizer = trained_model()
    directory = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=1))
    shard = directory / "layer-001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        load_checkpoint(directory, model, optimizer, cfg)


def test_latest_ignores_checkpoints_without_a_manifest(tmp_path):
    cfg, model, optimizer = trained_model()
    assert latest_checkpoint(tmp_path) is None
    done = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=2))
    later = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=4))
    (later / MANIFEST).unlink()  # as if the writer died before the manifest
    assert latest_checkpoint(tmp_path) == done


def test_fingerprints_of_checkpoints_written_before_later_fields_existed_still_match():
    import hashlib
    import json

    from disagmoe.config import load_model
    from disagmoe.runtime.checkpoint import model_fingerprint

    cfg = load_model("tiny")
    before = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in ("rope_scaling", "embedding_init_std")}
    assert model_fingerprint(cfg) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    assert model_fingerprint(load_model("deepseek-v3")) != model_fingerprint(
        load_model("deepseek-v3").model_copy(update={"rope_scaling": None}))
