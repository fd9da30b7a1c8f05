"""Layout-independent checkpoints (disagmoe/runtime/state/checkpoint.py)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from disagmoe.config import OptimConfig, TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.model import MoETransformer
from disagmoe.runtime.state.checkpoint import (
    MANIFEST,
    CorruptCheckpoint,
    TensorKey,
    TrainerState,
    from_keyed,
    key_of,
    latest_checkpoint,
    load_checkpoint,
    newest_loadable,
    read_manifest,
    recipe_settings,
    resume_checkpoint,
    save_checkpoint,
    to_keyed,
    training_settings,
    verify_checkpoint,
    warn_changed_training,
)
from disagmoe.runtime.failures import RunWarning
from disagmoe.runtime.state.optim import build_optimizer


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

    from disagmoe.model_ref import load_model
    from disagmoe.runtime.state.checkpoint import model_fingerprint

    cfg = load_model("tiny")
    before = {k: v for k, v in cfg.model_dump(mode="json").items()
              if k not in ("rope_scaling", "embedding_init_std", "source")}
    assert model_fingerprint(cfg) == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    assert model_fingerprint(cfg) == model_fingerprint(cfg.model_copy(update={"source": "elsewhere"}))  # documentation
    assert model_fingerprint(load_model("deepseek-v3")) != model_fingerprint(
        load_model("deepseek-v3").model_copy(update={"rope_scaling": None}))


def _flip_a_byte(directory):
    shard = directory / "layer-001.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return f"{shard} fails its sha256 check (same size)"


def _truncate(directory):
    shard = directory / "layer-001.pt"
    size = shard.stat().st_size
    shard.write_bytes(shard.read_bytes()[: size // 2])
    return f"{shard} fails its sha256 check ({size // 2:,} of {size:,} bytes)"


def _remove_shard(directory):
    (directory / "trainer.pt").unlink()
    return f"{directory / 'trainer.pt'} is missing"


def _garble_manifest(directory):
    (directory / MANIFEST).write_bytes(b'{"format": "disagmoe-checkpoint/1", "st\xff')
    return f"manifest {directory / MANIFEST} is unreadable"


def _edit_manifest(edit, message=""):
    """Damage: `edit(manifest)` in place; the expected message names {manifest} or {directory}."""
    def damage(directory):
        manifest = json.loads((directory / MANIFEST).read_text())
        edit(manifest)
        (directory / MANIFEST).write_text(json.dumps(manifest))
        return message.format(manifest=directory / MANIFEST, directory=directory)
    return damage


DAMAGE = {
    "flipped-byte": _flip_a_byte,
    "truncated-shard": _truncate,
    "missing-shard": _remove_shard,
    "unreadable-manifest": _garble_manifest,
    "no-shards-key": _edit_manifest(lambda m: m.pop("shards"), "manifest {manifest} lacks the key 'shards'"),
    "no-fingerprint": _edit_manifest(lambda m: m.pop("model_fingerprint"),
                                     "manifest {manifest} lacks the key 'model_fingerprint'"),
    "shard-without-sha": _edit_manifest(lambda m: m["shards"][0].pop("sha256"),
                                        "manifest {manifest}: shards[0] lacks the key 'sha256'"),
    "parent-path": _edit_manifest(lambda m: m["shards"][0].update(file="../step-00000002/global.pt"),
                                  "shard path '../step-00000002/global.pt' leaves {directory}"),
    "absolute-path": _edit_manifest(lambda m: m["shards"][0].update(file="/etc/hostname"),
                                    "shard path '/etc/hostname' leaves {directory}"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_previous_one_naming_the_file(tmp_path, damage):
    cfg, model, optimizer = trained_model()
    good = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=2))
    newest = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=4))
    expected = DAMAGE[damage](newest)
    with pytest.warns(RunWarning) as warned:
        found = newest_loadable(tmp_path, lambda d: load_checkpoint(d, model, optimizer, cfg))
    assert found is not None and found[0] == good and found[1].step == 2
    assert len(warned) == 1
    message = str(warned[0].message)
    assert message.startswith("skipped checkpoint step-00000004: ") and expected in message, message
    assert message.endswith("; resuming from step-00000002 instead") and "\n" not in message
    with pytest.warns(RunWarning):  # the driver checks a checkpoint without loading it: the same verdict
        assert newest_loadable(tmp_path, verify_checkpoint)[0] == good


def test_when_no_checkpoint_loads_resume_says_so(tmp_path):
    cfg, model, optimizer = trained_model()
    with pytest.raises(ValueError, match="holds no complete checkpoint"):
        resume_checkpoint(tmp_path, verify_checkpoint)
    _truncate(save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=2)))
    with pytest.warns(RunWarning, match="no earlier checkpoint is left"):
        with pytest.raises(ValueError, match="none of the 1 complete checkpoints .* can be loaded"):
            resume_checkpoint(tmp_path, verify_checkpoint)


def test_another_format_is_refused_not_skipped(tmp_path):
    cfg, model, optimizer = trained_model()
    directory = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=2))
    _edit_manifest(lambda m: m.update(format="disagmoe-checkpoint/9"))(directory)
    with pytest.raises(ValueError, match="unknown checkpoint format 'disagmoe-checkpoint/9'") as refused:
        newest_loadable(tmp_path, verify_checkpoint)
    assert not isinstance(refused.value, CorruptCheckpoint)


def test_changed_training_settings_resume_with_a_warning_naming_them(tmp_path):
    cfg, model, optimizer = trained_model()
    run = TrainConfig(model=cfg, seed=0, batch_size=8, seq_len=16, optim=OptimConfig(lr=1e-3))
    directory = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=2), training_settings(run))
    manifest = read_manifest(directory)
    assert manifest["training"]["seed"] == 0 and manifest["training"]["optim.lr"] == 1e-3
    assert warn_changed_training(manifest, run, directory) == []
    same_step = run.model_copy(update={"optim": run.optim.model_copy(update={"shard_states": True}), "steps": 7})
    assert warn_changed_training(manifest, same_step, directory) == []  # layout and length are not the step
    other_kernel = run.model_copy(update={"optim": run.optim.model_copy(update={"update_kernel": "torch"})})
    assert warn_changed_training(manifest, other_kernel, directory) == []  # the same update, another kernel
    assert "optim.update_kernel" not in manifest["training"]
    changed = run.model_copy(update={"seed": 3, "seq_len": 32, "optim": OptimConfig(lr=2e-3, beta2=0.99)})
    with pytest.warns(RunWarning) as warned:
        names = warn_changed_training(manifest, changed, directory)
    assert names == ["seed", "seq_len", "optim.lr", "optim.beta2"]
    assert len(warned) == 1 and "seed: 0 -> 3, seq_len: 16 -> 32, optim.lr: 0.001 -> 0.002" in str(warned[0].message)
    old = save_checkpoint(tmp_path / "old", model, optimizer, cfg, TrainerState.capture(step=2))  # no record
    assert "training" not in read_manifest(old)
    assert warn_changed_training(read_manifest(old), changed, old) == []


def test_a_resume_under_another_precision_recipe_warns_naming_it(tmp_path):
    """The manifest records the GEMMs' precision recipe as resolved (`PRECISION_FIELDS`), so a resume
    whose unset fields now resolve otherwise (session 32 moved precision fp8's defaults), or that sets
    another recipe, says so and names the settings that give the checkpoint's back; a manifest from
    before the record says nothing of it."""
    cfg, model, optimizer = trained_model()
    fp8 = dict(model=cfg, mode="single", device="cuda", experts_backend="triton", precision="fp8")
    both = TrainConfig(**fp8, fp8_expert_forward="both", fp8_dense=True, fp8_dense_scaling="rowwise")
    directory = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=2), training_settings(both))
    manifest = read_manifest(directory)
    assert {k: manifest["training"][k] for k in ("precision", "expert_forward_precision", "dense_precision")} == {
        "precision": "fp8", "expert_forward_precision": "both", "dense_precision": "fp8"}
    with pytest.warns(RunWarning, match=r"expert_forward_precision: 'both' -> 'down', .*dense_precision: 'fp8' -> "
                                        r"'bf16'.*set fp8_expert_forward: both, fp8_dense: true, "
                                        r"fp8_dense_scaling: rowwise \(a setting left unset"):
        assert warn_changed_training(manifest, TrainConfig(**fp8, fp8_dense=False), directory) == [
            "expert_forward_precision", "dense_precision", "dense_fp8_scaling"]
    blockwise = TrainConfig(**fp8, fp8_expert_forward="both", fp8_dense=True, fp8_dense_scaling="blockwise")
    with pytest.warns(RunWarning, match=r"dense_fp8_scaling: 'rowwise' -> 'blockwise'.*set fp8_dense_scaling: rowwise"):
        assert warn_changed_training(manifest, blockwise, directory) == ["dense_fp8_scaling"]
    del manifest["training"]["dense_fp8_scaling"]  # a manifest from before the field: its dense FP8 was rowwise
    with pytest.warns(RunWarning, match=r"dense_fp8_scaling: 'rowwise' -> 'blockwise'"):
        assert warn_changed_training(manifest, blockwise, directory) == ["dense_fp8_scaling"]
    for key in ("expert_forward_precision", "dense_precision"):
        del manifest["training"][key]
    assert warn_changed_training(manifest, TrainConfig(**fp8), directory) == []


def test_a_checkpoint_of_the_bf16_dense_default_resumes_naming_the_setting_that_keeps_it(tmp_path):
    """A checkpoint written before session 34 by a precision-fp8 run that left fp8_dense unset trained
    its dense projections in bf16 (recorded as resolved); resumed with it still unset they now run
    blockwise FP8: the warning names both fields and fp8_dense: false, which resumes the recipe it
    trained with, silently. A run of then that set fp8_dense: true alone trained them rowwise (the
    default then): fp8_dense_scaling: rowwise gives that back. A bf16 run's recipe follows its
    precision (no FP8 setting named)."""
    cfg, model, optimizer = trained_model()
    fp8 = dict(model=cfg, mode="single", device="cuda", experts_backend="triton", precision="fp8")
    before = {**training_settings(TrainConfig(**fp8)), "dense_precision": "bf16", "dense_fp8_scaling": None}
    directory = save_checkpoint(tmp_path, model, optimizer, cfg, TrainerState.capture(step=2), before)
    manifest = read_manifest(directory)
    with pytest.warns(RunWarning, match=r"\(dense_precision: 'bf16' -> 'fp8', dense_fp8_scaling: None -> "
                                        r"'blockwise'\).*set fp8_dense: false \(") as warned:
        assert warn_changed_training(manifest, TrainConfig(**fp8), directory) == ["dense_precision",
                                                                                   "dense_fp8_scaling"]
    assert len(warned) == 1
    assert warn_changed_training(manifest, TrainConfig(**fp8, fp8_dense=False), directory) == []
    manifest["training"].update(dense_precision="fp8", dense_fp8_scaling="rowwise")  # fp8_dense: true, then
    with pytest.warns(RunWarning, match=r"set fp8_dense_scaling: rowwise \("):
        assert warn_changed_training(manifest, TrainConfig(**fp8, fp8_dense=True), directory) == ["dense_fp8_scaling"]
    assert warn_changed_training(manifest, TrainConfig(**fp8, fp8_dense_scaling="rowwise"), directory) == []
    bf16 = {**training_settings(TrainConfig(**{**fp8, "precision": "bf16"}))}
    assert recipe_settings(bf16, ["precision", "expert_forward_precision", "dense_precision",
                                  "dense_fp8_scaling"]) == ["precision: bf16"]


