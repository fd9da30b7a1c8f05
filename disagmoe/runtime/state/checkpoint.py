"""Layout-independent checkpoints: any mode and any placement can resume from any other.

A checkpoint is a directory `<out_dir>/checkpoints/step-<step>/` holding
  manifest.json     format, step, model fingerprint and config, and every shard with its sha256
  global.pt         tensors outside the layer stack (embedding, final norm, LM head)
  layer-<i>.pt      layer i's tensors, stacked experts split into one entry per expert
  trainer.pt        step, data position, RNG states
Every tensor is keyed by `TensorKey(layer, module, expert, parameter)`, written as the string
`<layer>/<module>/<expert>/<parameter>` ("-" where a field does not apply), so a rank that holds
a subset (one layer's attention, a few experts) reads and writes just its keys. Shards hold only
tensors, strings and numbers: they load with `torch.load(weights_only=True)`. Files are written
to a temporary name and renamed into place, the manifest last, inside a folder marked as being
written (`out_dir.WRITING`, removed once sealed): a checkpoint without a manifest is incomplete and
ignored (and, if marked, swept at the next start, `out_dir.clean_stale_files`).

Resuming (`newest_loadable`) takes the newest checkpoint that loads: one that is damaged (an
unreadable manifest or one missing a key, a shard path leaving the folder, a missing shard, a
sha256 mismatch) raises `CorruptCheckpoint` naming the file, and is skipped for the previous
one with a `RunWarning`. A checkpoint of another model is refused; one written with other
training settings (seed, batch_size, seq_len, optim; the manifest's `training`, absent from
older checkpoints) resumes with a warning naming them.

Legend: E experts, H hidden size, F expert FFN width.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import torch

from disagmoe.config import ModelConfig, TrainConfig
from disagmoe.runtime.failures import RunWarning
from disagmoe.runtime.out_dir import WRITING, is_run_folder, mark_writing, remove_run_files
from disagmoe.runtime.state.flat_adamw import FlatAdamW

FORMAT = "disagmoe-checkpoint/1"
MANIFEST = "manifest.json"
TRAINER_SHARD = "trainer.pt"
# Stacked expert weights (DESIGN 3b: w13_EH2F [E, H, 2F], w2_EFH [E, F, H]); checkpoints hold
# one [H, 2F] / [F, H] slice per expert, under the stacked parameter's name.
EXPERT_STACKED = ("w13_EH2F", "w2_EFH")
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class TensorKey:
    layer: int | None  # None outside the layer stack
    module: str  # dotted module path inside the layer (or the model), e.g. "attn.wq"
    expert: int | None  # set for one expert's slice of a stacked expert weight
    param: str  # parameter or buffer name, e.g. "weight", "w13_EH2F"

    def __str__(self) -> str:
        layer = "-" if self.layer is None else str(self.layer)
        expert = "-" if self.expert is None else str(self.expert)
        return f"{layer}/{self.module}/{expert}/{self.param}"

    @classmethod
    def parse(cls, text: str) -> TensorKey:
        layer, module, expert, param = text.split("/")
        return cls(None if layer == "-" else int(layer), module, None if expert == "-" else int(expert), param)

    @property
    def state_name(self) -> str:
        """The model's state_dict name this key (or its stacked tensor) belongs to."""
        inner = f"{self.module}.{self.param}" if self.module else self.param
        return inner if self.layer is None else f"layers.{self.layer}.{inner}"

    @property
    def shard(self) -> str:
        return "global.pt" if self.layer is None else f"layer-{self.layer:03d}.pt"


def key_of(state_name: str, expert: int | None = None) -> TensorKey:
    """`layers.3.moe.experts.w13_EH2F` -> TensorKey(3, "moe.experts", expert, "w13_EH2F")."""
    match = _LAYER_NAME.match(state_name)
    layer, inner = (int(match.group(1)), match.group(2)) if match else (None, state_name)
    module, _, param = inner.rpartition(".")
    return TensorKey(layer, module, expert, param)


def is_expert_stacked(state_name: str) -> bool:
    return state_name.rsplit(".", 1)[-1] in EXPERT_STACKED


def to_keyed(named: dict[str, torch.Tensor]) -> dict[TensorKey, torch.Tensor]:
    """Model-named tensors to layout-independent keys, splitting stacked experts per expert."""
    keyed: dict[TensorKey, torch.Tensor] = {}
    for name, tensor in named.items():
        if is_expert_stacked(name):
            for e in range(tensor.shape[0]):
                keyed[key_of(name, e)] = tensor[e]
        else:
            keyed[key_of(name)] = tensor
    return keyed


def from_keyed(keyed: dict[TensorKey, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `to_keyed`: stack per-expert slices back in expert order."""
    plain: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, torch.Tensor]] = {}
    for key, tensor in keyed.items():
        if key.expert is None:
            plain[key.state_name] = tensor
        else:
            experts.setdefault(key.state_name, {})[key.expert] = tensor
    for name, slices in experts.items():
        if sorted(slices) != list(range(len(slices))):
            raise ValueError(f"checkpoint is missing experts of {name}: has {sorted(slices)}")
        plain[name] = torch.stack([slices[e] for e in range(len(slices))])
    return plain


# Model settings added after checkpoints were first written: left out of the fingerprint while
# unset, so checkpoints written before they existed keep loading.
LATER_FIELDS = ("rope_scaling", "embedding_init_std")


# Documentation, not a model setting: never part of the fingerprint.
UNFINGERPRINTED = ("source",)


def _fingerprinted(model_cfg: ModelConfig) -> dict[str, Any]:
    dump = model_cfg.model_dump(mode="json", exclude=set(UNFINGERPRINTED))
    return {k: v for k, v in dump.items() if not (k in LATER_FIELDS and v is None)}


def model_fingerprint(model_cfg: ModelConfig) -> str:
    """sha256 of the model config: a checkpoint only loads into the model it was written from."""
    canonical = json.dumps(_fingerprinted(model_cfg), sort_keys=True)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class TrainerState:
    step: int  # optimizer steps taken
    data_step: int  # the next batch to draw is the batch of this step
    torch_rng: torch.Tensor
    cuda_rng: list[torch.Tensor]

    @classmethod
    def capture(cls, step: int) -> TrainerState:
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
        return cls(step=step, data_step=step, torch_rng=torch.get_rng_state(), cuda_rng=cuda)

    def restore_rng(self) -> None:
        torch.set_rng_state(self.torch_rng)
        if self.cuda_rng and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(self.cuda_rng)


# ----------------------------------------------------------------------------------------------
# Model and optimizer <-> keyed tensors
# ----------------------------------------------------------------------------------------------


Optimizer = torch.optim.Optimizer | FlatAdamW


def optimizer_state_by_name(model: torch.nn.Module, optimizer: Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's per-parameter state (step, exp_avg, exp_avg_sq) under the parameters' names."""
    if isinstance(optimizer, FlatAdamW):
        return optimizer.state_by_name()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: dict(state) for p, state in optimizer.state.items()}


def model_state_by_name(model: torch.nn.Module, optimizer: Optimizer) -> dict[str, torch.Tensor]:
    """The model's tensors on the CPU with the fp32 master weights in place of parameters held in a
    lower precision for compute: what a checkpoint stores whatever the precision."""
    state = {n: t.detach().cpu() for n, t in model.state_dict().items()}
    if isinstance(optimizer, FlatAdamW):
        state.update(optimizer.masters_by_name())
    return state


def load_training_state(model: torch.nn.Module, optimizer: Optimizer, model_tensors: dict[str, torch.Tensor],
                        keyed_optim: dict[TensorKey, dict[str, torch.Tensor]]) -> None:
    """Load model tensors (fp32 masters; cast into the parameters' dtype) and optimizer state."""
    model.load_state_dict(model_tensors, strict=True)
    if isinstance(optimizer, FlatAdamW):
        params = {n for n, _ in model.named_parameters()}
        optimizer.load_state({n: t for n, t in model_tensors.items() if n in params},
                             _state_by_name(keyed_optim))
    else:
        load_optimizer_state(model, optimizer, keyed_optim)


def keyed_optimizer_state(by_name: dict[str, dict[str, torch.Tensor]]) -> dict[TensorKey, dict[str, torch.Tensor]]:
    """Split per-expert like the parameters; the scalar `step` is copied to every expert."""
    keyed: dict[TensorKey, dict[str, torch.Tensor]] = {}
    for name, state in by_name.items():
        if not is_expert_stacked(name):
            keyed[key_of(name)] = state
            continue
        num_experts = next(t.shape[0] for t in state.values() if t.ndim > 0)
        for e in range(num_experts):
            keyed[key_of(name, e)] = {k: (t[e] if t.ndim > 0 else t) for k, t in state.items()}
    return keyed


def _state_by_name(keyed: dict[TensorKey, dict[str, torch.Tensor]]) -> dict[str, dict[str, torch.Tensor]]:
    """Keyed optimizer entries back to per-parameter state, per-expert slices stacked."""
    per_name: dict[str, dict[str, torch.Tensor]] = {}
    stacked: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, state in keyed.items():
        if key.expert is None:
            per_name[key.state_name] = state
            continue
        for k, t in state.items():
            stacked.setdefault(key.state_name, {}).setdefault(k, {})[key.expert] = t
    for name, states in stacked.items():
        per_name[name] = {
            k: (torch.stack([s[e] for e in range(len(s))]) if s[0].ndim > 0 else s[0])
            for k, s in states.items()
        }
    return per_name


def load_optimizer_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, keyed: dict[TensorKey, dict[str, torch.Tensor]]
) -> None:
    """Rebuild a torch optimizer's state dict from keyed entries and load it."""
    per_name = _state_by_name(keyed)
    names = {id(p): n for n, p in model.named_parameters()}
    sd = optimizer.state_dict()
    index_to_name = {}
    for group_sd, group in zip(sd["param_groups"], optimizer.param_groups):
        for index, p in zip(group_sd["params"], group["params"]):
            index_to_name[index] = names[id(p)]
    sd["state"] = {i: per_name[n] for i, n in index_to_name.items() if n in per_name}
    optimizer.load_state_dict(sd)


# ----------------------------------------------------------------------------------------------
# Files
# ----------------------------------------------------------------------------------------------


def checkpoint_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> list[Path]:
    """The complete checkpoints (those with a manifest) under `root`, oldest first."""
    return sorted(p for p in root.glob("step-*") if (p / MANIFEST).is_file())


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint (one with a manifest) of the highest step under `root`."""
    done = complete_checkpoints(root)
    return done[-1] if done else None


T = TypeVar("T")


def newest_loadable(root: Path, load: Callable[[Path], T]) -> tuple[Path, T] | None:
    """`(checkpoint, load(checkpoint))` for the newest complete checkpoint under `root` that
    `load` takes without a `CorruptCheckpoint`; each newer one is skipped with a one-line
    `RunWarning` naming the bad file. None when there is no complete checkpoint, or none loads."""
    candidates = complete_checkpoints(root)[::-1]
    for i, directory in enumerate(candidates):
        try:
            return directory, load(directory)
        except CorruptCheckpoint as err:
            then = (f"resuming from {candidates[i + 1].name} instead" if i + 1 < len(candidates)
                    else "no earlier checkpoint is left")
            warnings.warn(f"skipped checkpoint {directory.name}: {err}; {then}", RunWarning, stacklevel=2)
    return None


def resume_checkpoint(root: Path, load: Callable[[Path], T]) -> tuple[Path, T]:
    """`newest_loadable`, or a ValueError for `resume=true` saying why nothing can be resumed."""
    found = newest_loadable(root, load)
    if found is not None:
        return found
    count = len(complete_checkpoints(root))
    if not count:
        raise ValueError(f"resume=true but {root} holds no complete checkpoint; "
                         "check out_dir or set resume=false to start fresh")
    raise ValueError(f"resume=true but none of the {count} complete checkpoints under {root} can be loaded "
                     "(the warnings name the bad files); restore one, or set resume=false to start fresh")


def prune_checkpoints(root: Path, keep: int, newest: Path) -> list[Path]:
    """Delete complete checkpoints older than `newest` (the one just written) beyond the `keep`
    newest up to it (keep = 0: none); returns what was deleted. Later steps (an earlier run's, in a
    reused out_dir) and incomplete ones are left alone. Only the files a run writes go
    (`out_dir.remove_run_files`: marker first, manifest before shards, so an interrupted deletion
    never leaves a complete-looking partial checkpoint and the next start sweeps it)."""
    if keep <= 0:
        return []
    done = sorted(p for p in root.glob("step-*") if (p / MANIFEST).is_file() and p.name <= newest.name)
    old = done[:-keep]
    for directory in old:
        remove_run_files(directory)
    return old


def clear_for_checkpoint(directory: Path) -> None:
    """Make room for a checkpoint at `directory`: an earlier one there (a run's folder) has its
    files removed; whatever is left (files no run wrote) is moved aside to `<name>.kept-<n>`
    with a RunWarning, never deleted."""
    if not (directory.exists() or directory.is_symlink()):
        return
    if is_run_folder(directory) and not remove_run_files(directory):
        return
    n = 1
    while (aside := directory.with_name(f"{directory.name}.kept-{n}")).exists():
        n += 1
    directory.rename(aside)
    warnings.warn(f"moved {directory} to {aside}: a new checkpoint of that step goes there", RunWarning, stacklevel=3)


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _serialise(obj: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def save_checkpoint(
    root: Path,
    model: torch.nn.Module,
    optimizer: Optimizer,
    model_cfg: ModelConfig,
    state: TrainerState,
    training: dict[str, Any] | None = None,
) -> Path:
    """Write the model, optimizer and trainer state as a checkpoint for `state.step`; returns its
    dir. `training`: the run's `training_settings`, recorded in the manifest."""
    directory = checkpoint_dir(root, state.step)
    clear_for_checkpoint(directory)
    mark_writing(directory)
    shards: dict[str, dict[str, dict[str, Any]]] = {}
    model_state = model_state_by_name(model, optimizer)
    for key, tensor in to_keyed(model_state).items():
        shards.setdefault(key.shard, {"model": {}, "optim": {}})["model"][str(key)] = tensor.clone()
    optim_state = keyed_optimizer_state(optimizer_state_by_name(model, optimizer))
    for key, entry in optim_state.items():
        shards[key.shard]["optim"][str(key)] = {k: t.detach().cpu().clone() for k, t in entry.items()}
    shards[TRAINER_SHARD] = {
        "step": state.step,
        "data_step": state.data_step,
        "torch_rng": state.torch_rng,
        "cuda_rng": list(state.cuda_rng),
    }
    listing = []
    for name in sorted(shards):
        data = _serialise(shards[name])
        _atomic_write(directory / name, data)
        listing.append({"file": name, "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)})
    manifest = {
        "format": FORMAT,
        "step": state.step,
        "model_fingerprint": model_fingerprint(model_cfg),
        "model_config": model_cfg.model_dump(mode="json"),
        **({} if training is None else {"training": training}),
        "shards": listing,
    }
    _atomic_write(directory / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    (directory / WRITING).unlink()
    return directory


class CorruptCheckpoint(ValueError):
    """A complete-looking checkpoint that cannot be loaded as written; names the file and why."""


# What every manifest holds (a `training` entry is optional: older checkpoints lack it).
MANIFEST_KEYS = {"format": str, "step": int, "model_fingerprint": str, "model_config": dict, "shards": list}
SHARD_KEYS = {"file": str, "sha256": str, "bytes": int}


def read_manifest(directory: Path) -> dict[str, Any]:
    """The checked manifest: ValueError without one or for another format, `CorruptCheckpoint`
    (naming the file) when it is unreadable, lacks a key, or lists a shard outside `directory`."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(f"{directory} is not a complete checkpoint (no {MANIFEST})")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise CorruptCheckpoint(f"manifest {path} is unreadable ({getattr(err, 'strerror', None) or err})") from None
    if not isinstance(manifest, dict):
        raise CorruptCheckpoint(f"manifest {path} is not a JSON object")
    if "format" in manifest and manifest["format"] != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {manifest.get('format')!r}; expected {FORMAT}")
    _check_keys(manifest, MANIFEST_KEYS, f"manifest {path}")
    for i, entry in enumerate(manifest["shards"]):
        _check_keys(entry, SHARD_KEYS, f"manifest {path}: shards[{i}]")
        inside(directory, entry["file"], f"manifest {path}: shard")
    return manifest


def _check_keys(data: Any, keys: dict[str, type], where: str) -> None:
    if not isinstance(data, dict):
        raise CorruptCheckpoint(f"{where} is not a JSON object")
    for key, kind in keys.items():
        if key not in data:
            raise CorruptCheckpoint(f"{where} lacks the key {key!r}")
        if not isinstance(data[key], kind) or (kind is int and isinstance(data[key], bool)):
            raise CorruptCheckpoint(f"{where}: {key!r} is {type(data[key]).__name__}, not {kind.__name__}")


def inside(directory: Path, name: str, what: str) -> Path:
    """`directory / name`, refusing (CorruptCheckpoint) a name that is absolute, climbs out with
    `..`, or leads outside `directory` through a symlink."""
    pure = PurePosixPath(name)
    path = directory / name
    if (not name or pure.is_absolute() or "\\" in name or ".." in pure.parts
            or not path.resolve().is_relative_to(directory.resolve())):
        raise CorruptCheckpoint(f"{what} path {name!r} leaves {directory} (shard paths are relative names inside it)")
    return path


def check_compatible(manifest: dict[str, Any], model_cfg: ModelConfig, directory: Path) -> None:
    """ValueError naming the differing model settings unless the fingerprints match."""
    if manifest["model_fingerprint"] == model_fingerprint(model_cfg):
        return
    saved, current = manifest["model_config"], model_cfg.model_dump(mode="json", exclude=set(UNFINGERPRINTED))
    differ = [f"{k}: {saved.get(k)!r} in the checkpoint, {current.get(k)!r} now"
              for k in sorted((set(saved) | set(current)) - set(UNFINGERPRINTED)) if saved.get(k) != current.get(k)]
    raise ValueError(
        f"checkpoint {directory} was written for a different model config ({'; '.join(differ)}); "
        f"resume with the model config it was trained with, or use a fresh out_dir / resume=false"
    )


# Settings a resume may change, with a warning: the run goes on, but not as the checkpoint's run would
# have (optim.shard_states is layout and optim.update_kernel the kernel of the same update, a few fp32
# ulps of the operands apart: they are left out).
TRAINING_FIELDS = ("seed", "batch_size", "seq_len")
NOT_THE_STEP = ("shard_states", "update_kernel")
# The GEMMs' precision recipe, as resolved (an unset field's default may change between versions: session 32
# moved precision fp8's to the down GEMM alone with bf16 dense projections, session 34 the dense projections to
# blockwise FP8); recorded since session 32
PRECISION_FIELDS = ("precision", "expert_forward_precision", "expert_backward_precision", "dense_precision",
                    "dense_fp8_scaling")
# The config setting that gives a recorded precision field back (dense_precision's: `recipe_settings`)
RECIPE_SETTINGS = {"precision": "precision", "expert_forward_precision": "fp8_expert_forward",
                   "expert_backward_precision": "fp8_expert_backward", "dense_fp8_scaling": "fp8_dense_scaling"}


def training_settings(cfg: TrainConfig) -> dict[str, Any]:
    """What a checkpoint's manifest records of the run that wrote it (`training`): the seed and
    batch, the optimizer's settings and the precision recipe as resolved (`PRECISION_FIELDS`)."""
    optim = {f"optim.{k}": v for k, v in cfg.optim.model_dump(mode="json").items() if k not in NOT_THE_STEP}
    return {**{k: getattr(cfg, k) for k in TRAINING_FIELDS + PRECISION_FIELDS}, **optim}


def warn_changed_training(manifest: dict[str, Any], cfg: TrainConfig, directory: Path) -> list[str]:
    """One `RunWarning` naming the training settings that differ from the checkpoint's (none for
    a checkpoint that predates the record); returns the names."""
    saved = manifest.get("training")
    if not isinstance(saved, dict):
        return []
    now = training_settings(cfg)
    if saved.get("dense_precision") == "fp8" and "dense_fp8_scaling" not in saved:
        saved = {**saved, "dense_fp8_scaling": "rowwise"}  # recorded from session 33 on; rowwise was the only one
    changed = [k for k in now if k in saved and saved[k] != now[k]]
    if changed:
        listed = ", ".join(f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed)
        settings = recipe_settings(saved, changed)
        recipe = (f"; to resume with the checkpoint's precision recipe set {', '.join(settings)} (a setting left "
                  "unset takes this version's default)" if settings else "")
        warnings.warn(f"resuming from {directory} with changed training settings ({listed}); the run continues "
                      f"with the new ones, not as an uninterrupted run would{recipe}", RunWarning, stacklevel=2)
    return changed


def recipe_settings(saved: dict[str, Any], changed: list[str]) -> list[str]:
    """The config settings ('fp8_dense: false', ...) that give back the `changed` precision fields'
    recorded values (`saved`, a manifest's `training`); a field another one implies (a bf16 run's
    FP8 recipe: its precision) gets none."""
    settings = []
    for key in changed:
        if key not in PRECISION_FIELDS or saved[key] is None:
            continue
        if key == "dense_precision":
            if saved.get("precision") == "fp8":
                settings.append(f"fp8_dense: {'true' if saved[key] == 'fp8' else 'false'}")
        else:
            settings.append(f"{RECIPE_SETTINGS[key]}: {saved[key]}")
    return settings


def read_shards(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Every shard, after checking its sha256 against the manifest (`CorruptCheckpoint` naming
    the file when one is missing, unreadable or fails the check)."""
    shards = {}
    for entry in manifest["shards"]:
        path = _shard_path(directory, entry)
        try:
            data = path.read_bytes()
        except OSError as err:
            raise CorruptCheckpoint(f"checkpoint shard {path} is unreadable ({err.strerror or err})") from None
        _check_digest(path, entry, hashlib.sha256(data).hexdigest(), len(data))
        shards[entry["file"]] = torch.load(io.BytesIO(data), weights_only=True)
    return shards


def verify_checkpoint(directory: Path) -> dict[str, Any]:
    """The manifest, once every shard it lists is present and passes its sha256 (each is read
    through, in pieces; `CorruptCheckpoint` naming the first bad file)."""
    manifest = read_manifest(directory)
    for entry in manifest["shards"]:
        path = _shard_path(directory, entry)
        digest, size = hashlib.sha256(), 0
        try:
            with path.open("rb") as f:
                while chunk := f.read(1 << 24):
                    digest.update(chunk)
                    size += len(chunk)
        except OSError as err:
            raise CorruptCheckpoint(f"checkpoint shard {path} is unreadable ({err.strerror or err})") from None
        _check_digest(path, entry, digest.hexdigest(), size)
    return manifest


def _shard_path(directory: Path, entry: dict[str, Any]) -> Path:
    path = inside(directory, entry["file"], f"manifest {directory / MANIFEST}: shard")
    if not path.is_file():
        raise CorruptCheckpoint(f"checkpoint shard {path} is missing; the checkpoint is incomplete")
    return path


def _check_digest(path: Path, entry: dict[str, Any], sha256: str, size: int) -> None:
    if sha256 != entry["sha256"]:
        detail = f"{size:,} of {entry['bytes']:,} bytes" if size != entry["bytes"] else "same size"
        raise CorruptCheckpoint(f"checkpoint shard {path} fails its sha256 check ({detail}); the file is corrupt")


def load_checkpoint(
    directory: Path, model: torch.nn.Module, optimizer: Optimizer, model_cfg: ModelConfig
) -> TrainerState:
    """Load a checkpoint into `model` and `optimizer` (in place) and return the trainer state."""
    manifest = read_manifest(directory)
    check_compatible(manifest, model_cfg, directory)
    shards = read_shards(directory, manifest)
    model_keyed: dict[TensorKey, torch.Tensor] = {}
    optim_keyed: dict[TensorKey, dict[str, torch.Tensor]] = {}
    for name, shard in shards.items():
        if name == TRAINER_SHARD:
            continue
        model_keyed.update({TensorKey.parse(k): t for k, t in shard["model"].items()})
        optim_keyed.update({TensorKey.parse(k): s for k, s in shard["optim"].items()})
    load_training_state(model, optimizer, from_keyed(model_keyed), optim_keyed)
    trainer = shards[TRAINER_SHARD]
    return TrainerState(
        step=trainer["step"], data_step=trainer["data_step"],
        torch_rng=trainer["torch_rng"], cuda_rng=trainer["cuda_rng"],
    )
