"""Checkpoints written by many ranks, in the one layout-independent format of `runtime.state.checkpoint`.

Each rank writes `rank-<r>.pt` = {"model": {key: tensor}, "optim": {key: state}} holding the
keys it owns (replicated attention parameters only from data-parallel index 0; every expert
under its layer-wide id, written by its primary owner only when the plan replicates it); the driver adds `trainer.pt` and the manifest. Everything goes to a
temporary directory first that is renamed to `step-<step>` at the end, so a checkpoint either
exists complete or not at all. Since the keys are layout-independent, `load_checkpoint` (single
mode) reads these checkpoints, and `load_rank_state` reads any checkpoint into one rank's part
of the model, whatever layout wrote it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disagmoe.config import ModelConfig
from disagmoe.runtime.out_dir import WRITING, mark_writing
from disagmoe.runtime.state.checkpoint import (
    clear_for_checkpoint,
    FORMAT,
    MANIFEST,
    TRAINER_SHARD,
    TensorKey,
    TrainerState,
    _atomic_write,
    _serialise,
    check_compatible,
    checkpoint_dir,
    from_keyed,
    is_expert_stacked,
    Optimizer,
    keyed_optimizer_state,
    load_training_state,
    model_fingerprint,
    model_state_by_name,
    optimizer_state_by_name,
    read_manifest,
    read_shards,
    to_keyed,
)
from disagmoe.runtime.rank_model import RankModel

Listing = dict[str, Any]  # {"file", "sha256", "bytes"}: one manifest entry


def staging_dir(root: Path, step: int) -> Path:
    """Where the ranks write step `step`'s shards before the rename (ignored by `latest_checkpoint`)."""
    return root / f".staging-{checkpoint_dir(root, step).name}"


def begin_checkpoint(root: Path, step: int) -> Path:
    """The staging folder of step `step`, created empty and marked as a run's (`out_dir.WRITING`)
    before any rank writes into it; an earlier run's half-written one there goes first."""
    staging = staging_dir(root, step)
    clear_for_checkpoint(staging)
    mark_writing(staging)
    return staging


def _expert_ids(model: RankModel) -> dict[str, tuple[int, ...]]:
    """Stacked expert tensor name -> the layer-wide ids of its experts, in stacking order."""
    ids = {}
    for name, module in model.named_modules():
        if name.endswith("moe.experts"):
            for param in ("w13_EH2F", "w2_EFH"):
                ids[f"{name}.{param}"] = module.expert_ids
    return ids


def _global_key(key: TensorKey, ids: dict[str, tuple[int, ...]]) -> TensorKey:
    """A rank-local key (expert index within the rank's stack) -> the layout-independent key."""
    if key.expert is None:
        return key
    return TensorKey(key.layer, key.module, ids[key.state_name][key.expert], key.param)


def _globalise(keyed: dict[TensorKey, Any], ids: dict[str, tuple[int, ...]]) -> dict[TensorKey, Any]:
    return {_global_key(k, ids): v for k, v in keyed.items()}


def rank_shard(model: RankModel, optimizer: Optimizer, include_replicated: bool,
               writes_expert: Callable[[int, int], bool] = lambda layer, expert: True) -> dict[str, Any]:
    """This rank's keyed model tensors (fp32 masters) and optimizer state: attention-side
    (replicated) ones only if `include_replicated`, an expert only if `writes_expert(layer, expert)`
    (its primary owner). A collective over a ZeRO-1 group (its slices are gathered): every rank
    calls it."""
    ids = _expert_ids(model)
    keep = (lambda name: True) if include_replicated else is_expert_stacked
    model_state = {n: t.clone() for n, t in model_state_by_name(model, optimizer).items() if keep(n)}
    by_name = optimizer_state_by_name(model, optimizer)
    optim_state = {n: {k: t.detach().cpu().clone() for k, t in s.items()} for n, s in by_name.items() if keep(n)}

    def mine(keyed: dict[TensorKey, Any]) -> dict[str, Any]:
        return {str(k): v for k, v in _globalise(keyed, ids).items()
                if k.expert is None or writes_expert(k.layer, k.expert)}

    return {"model": mine(to_keyed(model_state)), "optim": mine(keyed_optimizer_state(optim_state))}


def write_shard(directory: Path, name: str, shard: Any) -> Listing:
    directory.mkdir(parents=True, exist_ok=True)
    data = _serialise(shard)
    _atomic_write(directory / name, data)
    return {"file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def finish_checkpoint(root: Path, step: int, listings: list[Listing], model_cfg: ModelConfig,
                      state: TrainerState, training: dict[str, Any] | None = None) -> Path:
    """Add trainer.pt and the manifest (with `training`, the run's `training_settings`) to the
    staged shards, then rename into `step-<step>`."""
    staging = staging_dir(root, step)
    trainer = {"step": state.step, "data_step": state.data_step, "torch_rng": state.torch_rng,
               "cuda_rng": list(state.cuda_rng)}
    listings = sorted([*listings, write_shard(staging, TRAINER_SHARD, trainer)], key=lambda e: e["file"])
    manifest = {
        "format": FORMAT,
        "step": step,
        "model_fingerprint": model_fingerprint(model_cfg),
        "model_config": model_cfg.model_dump(mode="json"),
        **({} if training is None else {"training": training}),
        "shards": listings,
    }
    _atomic_write(staging / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    final = checkpoint_dir(root, step)
    clear_for_checkpoint(final)
    staging.rename(final)
    (final / WRITING).unlink(missing_ok=True)
    return final


def read_trainer_state(directory: Path) -> TrainerState:
    manifest = read_manifest(directory)
    trainer = read_shards(directory, {"shards": [e for e in manifest["shards"] if e["file"] == TRAINER_SHARD]})
    t = trainer[TRAINER_SHARD]
    return TrainerState(step=t["step"], data_step=t["data_step"], torch_rng=t["torch_rng"], cuda_rng=t["cuda_rng"])


def load_rank_state(directory: Path, model: RankModel, optimizer: Optimizer, model_cfg: ModelConfig) -> None:
    """Load this rank's tensors and optimizer state (a ZeRO-1 slice: only its slice) from any
    checkpoint (every shard is checked)."""
    manifest = read_manifest(directory)
    check_compatible(manifest, model_cfg, directory)
    model_keyed: dict[TensorKey, torch.Tensor] = {}
    optim_keyed: dict[TensorKey, dict[str, torch.Tensor]] = {}
    for name, shard in read_shards(directory, manifest).items():
        if name != TRAINER_SHARD:
            model_keyed.update({TensorKey.parse(k): t for k, t in shard["model"].items()})
            optim_keyed.update({TensorKey.parse(k): s for k, s in shard["optim"].items()})
    ids = _expert_ids(model)
    local_of = {_global_key(k, ids): k for k in to_keyed(dict(model.state_dict()))}
    missing = [str(k) for k in local_of if k not in model_keyed]
    if missing:
        raise ValueError(f"checkpoint {directory} lacks {len(missing)} tensors this rank needs, e.g. {missing[:3]}")
    load_training_state(model, optimizer, from_keyed({local_of[k]: model_keyed[k] for k in local_of}),
                        {local_of[k]: optim_keyed[k] for k in local_of if k in optim_keyed})
