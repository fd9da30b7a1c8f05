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
to a temporary name and renamed into place, the manifest last: a checkpoint without a manifest
is incomplete and ignored.

Legend: E experts, H hidden size, F expert FFN width.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from disagmoe.config import ModelConfig
from disagmoe.runtime.flat_adamw import FlatAdamW

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


def _fingerprinted(model_cfg: ModelConfig) -> dict[str, Any]:
    dump = model_cfg.model_dump(mode="json")
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


def latest_checkpoint(root: Path) -> Path | None:
    """The complete checkpoint (one with a manifest) of the highest step under `root`."""
    done = sorted(p for p in root.glob("step-*") if (p / MANIFEST).is_file())
    return done[-1] if done else None


def prune_checkpoints(root: Path, keep: int, newest: Path) -> list[Path]:
    """Delete complete checkpoints older than `newest` (the one just written) beyond the `keep`
    newest up to it (keep = 0: none); returns what was deleted. Later steps (an earlier run's, in a
    reused out_dir) and incomplete ones are left alone. Each goes out of sight (renamed) before it
    is deleted, so an interrupted deletion never leaves a complete-looking partial checkpoint."""
    if keep <= 0:
        return []
    done = sorted(p for p in root.glob("step-*") if (p / MANIFEST).is_file() and p.name <= newest.name)
    old = done[:-keep]
    for directory in old:
        doomed = directory.with_name(f".{directory.name}.deleting")
        directory.rename(doomed)
        shutil.rmtree(doomed)
    return old


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
) -> Path:
    """Write the model, optimizer and trainer state as a checkpoint for `state.step`; returns its dir."""
    directory = checkpoint_dir(root, state.step)
    directory.mkdir(parents=True, exist_ok=True)
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
        "shards": listing,
    }
    _atomic_write(directory / MANIFEST, (json.dumps(manifest, indent=2) + "\n").encode())
    return directory


def read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    if not path.is_file():
        raise ValueError(f"{directory} is not a complete checkpoint (no {MANIFEST})")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: unknown checkpoint format {manifest.get('format')!r}; expected {FORMAT}")
    return manifest


def check_compatible(manifest: dict[str, Any], model_cfg: ModelConfig, directory: Path) -> None:
    """ValueError naming the differing model settings unless the fingerprints match."""
    if manifest["model_fingerprint"] == model_fingerprint(model_cfg):
        return
    saved, current = manifest["model_config"], model_cfg.model_dump(mode="json")
    differ = [f"{k}: {saved.get(k)!r} in the checkpoint, {current.get(k)!r} now"
              for k in sorted(set(saved) | set(current)) if saved.get(k) != current.get(k)]
    raise ValueError(
        f"checkpoint {directory} was written for a different model config ({'; '.join(differ)}); "
        f"resume with the model config it was trained with, or use a fresh out_dir / resume=false"
    )


def read_shards(directory: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Every shard, after checking its sha256 against the manifest."""
    shards = {}
    for entry in manifest["shards"]:
        path = directory / entry["file"]
        if not path.is_file():
            raise ValueError(f"checkpoint shard {path} is missing; the checkpoint is incomplete")
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise ValueError(f"checkpoint shard {path} fails its sha256 check; the file is corrupt")
        shards[entry["file"]] = torch.load(io.BytesIO(data), weights_only=True)
    return shards


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
