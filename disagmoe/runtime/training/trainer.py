"""Single-process training: the correctness oracle every distributed mode must reproduce.

The loss of a step, precisely. The step's batch [B, S + 1] (`disagmoe.data`) is cut into M
micro-batches by `batching.batch_rows` (one data-parallel rank). For micro-batch m, one forward
over its whole [B/M, S] inputs gives

    loss_m = CE_m + aux_m + z_m

CE_m: mean next-token cross-entropy over the micro-batch's B/M * S tokens (fp32 log-softmax);
aux_m, z_m: the router's load-balancing loss and z-loss as the model returns them (summed over MoE
layers, weighted by their coefficients), computed over all tokens of the micro-batch, so a
runtime that spreads a micro-batch over data-parallel ranks must combine the routing statistics
of those ranks before forming them. The step loss is the mean over micro-batches,

    loss = (1 / M) * sum_m loss_m

and the gradients are those of this loss: each micro-batch backpropagates loss_m / M and the
gradients accumulate. Then: clip to the global norm `optim.grad_clip`, AdamW step at `lr_at(step)`,
and the router bias update from the step's expert loads summed over its micro-batches.
Validation loss: mean CE over `eval_batches` fixed held-out batches (no auxiliary terms).

Legend: B sequences per step, S sequence length, V vocabulary, L MoE layers, E experts.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from disagmoe.config import ModelConfig, TrainConfig, memory_knob_changes
from disagmoe.model_ref import load_model
from disagmoe.data import TokenDataset, load_splits
from disagmoe.kernels.fp8_stats import Fp8Stats
from disagmoe.kernels.tile_configs import device_architecture, loads_of_routing, set_expert_loads
from disagmoe.kernels.wgrad_pairs import paired_weight_grads
from disagmoe.model import ModelOutput, MoETransformer
from disagmoe.model.experts import check_backend_device, first_touch_params
from disagmoe.model.init import materialise
from disagmoe.model.layers import set_fusion
from disagmoe.model.loss import linear_cross_entropy, set_fused_loss
from disagmoe.roofline.flops import step_flops
from disagmoe.roofline.optimizer_state import state_bytes
from disagmoe.roofline.params import count_params
from disagmoe.runtime.rank_model import compute_dtype, offload_bucket_bytes
from disagmoe.runtime.batching import batch_rows, check_divisible, inputs_and_targets
from disagmoe.runtime.state.flat_adamw import FlatAdamW
from disagmoe.runtime.state.offload import check_host_memory
from disagmoe.runtime.state.checkpoint import (
    TrainerState,
    load_checkpoint,
    read_manifest,
    resume_checkpoint,
    save_checkpoint,
    training_settings,
    warn_changed_training,
)
from disagmoe.runtime.failures import RunWarning
from disagmoe.runtime.training.loop import StepCallback, TrainingLoop, TrainSummary
from disagmoe.runtime.training.graphed_step import GraphedStep, resolve_cuda_graphs
from disagmoe.runtime.training.micro_batches import MicroBatchChoice, device_capacity_bytes, resolved
from disagmoe.runtime.training.single_memory import resolve_wgrad_pairs, single_peak_bytes
from disagmoe.runtime.training.tile_coverage import untuned_tiles_note
from disagmoe.runtime.observe.metrics import (
    load_imbalance,
    no_host_syncs,
    out_of_memory_hint,
    peak_and_ceiling,
    peak_memory_gib,
    reset_peak_memory,
)
from disagmoe.runtime.state.optim import build_optimizer, clip_grad_norm, lr_at, set_lr

CHECKPOINTS_DIR = "checkpoints"


@dataclass(frozen=True)
class StepResult:
    loss: float
    ce: float
    aux_loss: float
    z_loss: float
    grad_norm: float
    expert_load_LE: torch.Tensor  # int64, summed over micro-batches
    fp8: list[int] | None = None  # precision fp8: the step's `Fp8Stats` buffer, flattened


def resolve_device(device: str) -> torch.device:
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device=cuda but torch sees no CUDA GPU; set device=cpu or run on a GPU host")
    return torch.device(device)


@contextlib.contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Use `threads` intra-op threads inside the block (None: leave torch's setting alone).

    Tiny models gain nothing from several threads, and a busy host makes them much slower.
    """
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cross_entropy(logits_BSV: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy, computed in fp32 whatever the logits' dtype."""
    return F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten())


# The profiler range around the part of a step the trainer times (from its sync before the step to its
# sync after the read): `bench profile` splits each such range into launch, kernels, gaps and read.
TIMED_STEP_RANGE = "disagmoe timed step"


def train_step(
    model: MoETransformer,
    optimizer: torch.optim.Optimizer,
    tokens_BS1: torch.Tensor,
    micro_batches: int,
    lr: float,
    grad_clip: float,
) -> StepResult:
    """One optimizer step over a batch, as defined in the module docstring."""
    device = next(model.parameters()).device
    batch_size = tokens_BS1.shape[0]
    check_divisible(batch_size, micro_batches, 1)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    totals = torch.zeros(4, dtype=torch.float64)  # loss, ce, aux, z summed over micro-batches
    load_LE = None
    for m in range(micro_batches):
        rows = batch_rows(batch_size, micro_batches, 1, m, 0)
        inputs_BS, targets_BS = inputs_and_targets(tokens_BS1[rows].to(device))
        out = model(inputs_BS)
        ce = cross_entropy(out.logits_BSV, targets_BS)
        loss = ce + out.aux_loss.float() + out.z_loss.float()
        (loss / micro_batches).backward()
        parts = torch.stack([loss, ce, out.aux_loss.float(), out.z_loss.float()]).detach()
        totals += parts.double().cpu()
        load = out.expert_load_LE.detach().cpu()
        load_LE = load if load_LE is None else load_LE + load
    grad_norm = clip_grad_norm(model.parameters(), grad_clip)
    set_lr(optimizer, lr)
    optimizer.step()
    assert load_LE is not None
    model.update_router_bias(load_LE.to(device))
    loss, ce, aux, z = (totals / micro_batches).tolist()
    return StepResult(loss=loss, ce=ce, aux_loss=aux, z_loss=z, grad_norm=grad_norm, expert_load_LE=load_LE)


def train_step_flat(
    model: MoETransformer,
    optimizer: FlatAdamW,
    tokens_BS1: torch.Tensor,
    micro_batches: int,
    lr: float,
    grad_clip: float,
    forbid_host_syncs: bool = False,
    fp8_stats: Fp8Stats | None = None,
    pair_wgrads: bool = False,
) -> StepResult:
    """`train_step` on the fast path: the same loss and update (module docstring) with the
    parameters in the compute dtype, fp32 masters and main gradients in `optimizer`, the LM head
    and loss in token chunks, and nothing read back from the device until the step is done
    (`forbid_host_syncs`: any host wait before that raises). `fp8_stats`: read with the loss, then
    reset (`read_step`). `pair_wgrads`: the expert weight gradients over pairs of micro-batches
    (`TrainConfig.pairs_expert_wgrads`, `kernels.wgrad_pairs`)."""
    device = next(model.parameters()).device
    batch_size = tokens_BS1.shape[0]
    check_divisible(batch_size, micro_batches, 1)
    model.train()
    tokens_BS1 = tokens_BS1.to(device)
    optimizer.set_lr(lr)  # the step's one host value of the lr, into a device scalar: the body below takes none
    with no_host_syncs(forbid_host_syncs, device):
        totals, norm, load_LE = _flat_step_on_device(model, optimizer, tokens_BS1, micro_batches, grad_clip,
                                                     pair_wgrads)
    return read_step(totals, norm, load_LE, micro_batches, fp8_stats)


def read_step(totals: torch.Tensor, norm: torch.Tensor, load_LE: torch.Tensor, micro_batches: int,
              fp8_stats: Fp8Stats | None = None) -> StepResult:
    """The step's one read of its device results (summed loss parts, grad norm, expert loads and,
    with `fp8_stats`, the FP8 counters, which are then reset in place for the next step)."""
    parts = [(totals / micro_batches).double(), norm[None].double(), load_LE.flatten().double()]
    if fp8_stats is not None:
        parts.append(fp8_stats.buffer.flatten().double())  # counts and fp32 bits: exact below 2^53
    read = torch.cat(parts).cpu()
    loss, ce, aux, z, grad_norm = read[:5].tolist()  # the step's one read (loads exact below 2^53)
    loads = 5 + load_LE.numel()
    fp8 = None
    if fp8_stats is not None:
        fp8 = read[loads:].to(torch.int64).tolist()
        fp8_stats.reset()  # after the read: the next step's quantisers count from zero
    return StepResult(loss=loss, ce=ce, aux_loss=aux, z_loss=z, grad_norm=grad_norm,
                      expert_load_LE=read[5:loads].to(torch.int64).view_as(load_LE), fp8=fp8)


def micro_batch_losses(model: MoETransformer, tokens_BS1: torch.Tensor,
                       micro_batches: int) -> Iterator[tuple[torch.Tensor, torch.Tensor, ModelOutput]]:
    """Each micro-batch of a batch (`tokens_BS1`, already on the model's device) through the model,
    in order: (loss, cross-entropy, the forward's output), the LM head and loss in token chunks
    (`linear_cross_entropy`), loss = ce + the routers' aux and z terms in fp32. The fast step, the
    evaluation and `bench first-step` all read a batch through this."""
    batch_size = tokens_BS1.shape[0]
    for m in range(micro_batches):
        inputs_BS, targets_BS = inputs_and_targets(tokens_BS1[batch_rows(batch_size, micro_batches, 1, m, 0)])
        out = model(inputs_BS, logits=False)
        ce = linear_cross_entropy(out.hidden_BSH.flatten(0, 1), model.head_weight(), targets_BS.flatten())
        yield ce + out.aux_loss.float() + out.z_loss.float(), ce, out


def _flat_step_on_device(model: MoETransformer, optimizer: FlatAdamW, tokens_BS1: torch.Tensor, micro_batches: int,
                         grad_clip: float, pair_wgrads: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The body of `train_step_flat`: (summed loss parts, grad norm, expert loads), on the device,
    at the learning rate already in `optimizer.lr`; `pair_wgrads`: `train_step_flat`'s."""
    device = tokens_BS1.device
    optimizer.zero_grad()
    model.prepare_fp8()  # FP8 weight copies (experts, dense projections) from this step's weights
    totals = torch.zeros(4, dtype=torch.float32, device=device)  # loss, ce, aux, z summed over micro-batches
    load_LE = torch.zeros((model.cfg.num_moe_layers, model.cfg.num_experts), dtype=torch.int64, device=device)
    with paired_weight_grads(pair_wgrads and micro_batches > 1):  # the odd launch runs at its end, before the norm
        for loss, ce, out in micro_batch_losses(model, tokens_BS1, micro_batches):
            (loss / micro_batches).backward()
            totals += torch.stack([loss, ce, out.aux_loss.float(), out.z_loss.float()]).detach()
            load_LE += out.expert_load_LE
    norm = optimizer.grad_squares().sqrt().float()
    coef = torch.clamp(grad_clip / (norm + 1e-6), max=1.0) if grad_clip > 0 else None
    skip = fp8_update_skip(model, norm) if device.type == "cuda" else None
    optimizer.step(clip_coef=coef, skip=skip)
    model.update_router_bias(load_LE)
    return totals, norm, load_LE


def fp8_update_skip(model: MoETransformer, norm: torch.Tensor) -> torch.Tensor | None:
    """The optimizer's `skip` under precision fp8 (None outside it), a device scalar: an inf or NaN
    met by a quantiser this step (the counters' NONFINITE) or, on a step without the counters
    (`MoETransformer.set_fp8_counting`), a non-finite gradient norm (an inf or NaN scale makes its
    rows' products inf or NaN, which reach the gradients). The fused AdamW's found_inf then leaves
    the weights as they were; the run stops when the step is read (`fp8_fields`, the loop)."""
    if model.fp8_stats is not None:  # and a non-finite norm from anything else, as on a step without counters
        return torch.maximum(model.fp8_stats.nonfinite_flag(), (~torch.isfinite(norm)).float())
    if model.fp8_uncounted:
        return (~torch.isfinite(norm)).float()
    return None


def counts_fp8(step: int, every: int, first: int, last: int) -> bool:
    """Whether step `step` (1-based) runs the FP8 quantisers with their counters
    (`TrainConfig.fp8_counters_every`): every `every`-th step, the last (`last`), and the first this
    process runs (`first`: with `every` > 1 the warm-up of a captured run then runs both kinds of
    step before either is captured, `graphed_step`)."""
    return every == 1 or step % every == 0 or step in (first, last)


@torch.no_grad()
def evaluate(model: MoETransformer, dataset: TokenDataset, batches: int, micro_batches: int) -> float:
    """Mean next-token cross-entropy over the first `batches` batches of a (validation) dataset."""
    device = next(model.parameters()).device
    model.eval()
    model.prepare_fp8()
    total = torch.zeros((), device=device)
    for b in range(batches):
        for _, ce, _ in micro_batch_losses(model, dataset.batch(b).to(device), micro_batches):
            total = total + ce
    model.train()
    return float(total) / (batches * micro_batches)




def fp8_fields(result: StepResult, device: torch.device) -> dict[str, Any]:
    """A step record's FP8 numerics (`Fp8Stats.fields`: fp8_amax, fp8_saturated_share,
    fp8_underflow_share, fp8_by_kind, fp8_nonfinite); none outside precision fp8. With kinds in
    fp8_nonfinite also fp8_update_skipped: whether the step's optimizer update was skipped on the
    device (CUDA, `_flat_step_on_device`) or applied (the CPU interpreter tests)."""
    return fp8_record_fields(result.fp8, device)


def fp8_guard_fields(counted: bool, grad_norm: float, device: torch.device) -> dict[str, Any]:
    """A precision-fp8 step record's fp8_counted (whether its quantisers counted: `counts_fp8`) and,
    where its gradient norm is not finite, fp8_update_skipped: whether the optimizer skipped its
    update on the device (CUDA, `fp8_update_skip`: on any FP8 step)."""
    fields: dict[str, Any] = {"fp8_counted": counted}
    if not math.isfinite(grad_norm):
        fields["fp8_update_skipped"] = device.type == "cuda"
    return fields


def fp8_record_fields(values: list[int] | None, device: torch.device) -> dict[str, Any]:
    """`fp8_fields` from a host copy of a step's `Fp8Stats` buffer (None: no fields); the
    distributed driver's record takes the ranks' reduced buffer through it."""
    if values is None:
        return {}
    fields = Fp8Stats.fields(values)
    if fields["fp8_nonfinite"]:
        fields["fp8_update_skipped"] = device.type == "cuda"
    return fields


def single_host_bytes(cfg: TrainConfig, model_cfg: ModelConfig) -> int:
    """Host bytes of a one-GPU run's offloaded masters and moments (0 without offload to a host)."""
    if not cfg.offloads_to_host:
        return 0
    return int(count_params(model_cfg).total * state_bytes(cfg.optim.state_dtype, cfg.compute_dtype_name,
                                                           offload=True).host)


def resolve_single_micro_batches(cfg: TrainConfig, model_cfg: ModelConfig, device: torch.device | None,
                                 capacity_bytes: float | None = None) -> tuple[TrainConfig, MicroBatchChoice | None]:
    """A `mode: single` config with `micro_batches: auto` chosen (`runtime.training.micro_batches`)
    from `single_peak_bytes` on this device (or on `capacity_bytes`: a device elsewhere, e.g. a
    hardware preset's), each split's paired weight gradients resolved on it first
    (`resolve_wgrad_pairs`); a number given stays."""
    if cfg.micro_batches != "auto":
        return cfg, None
    capacity = capacity_bytes if capacity_bytes is not None else device_capacity_bytes(device)
    return resolved(cfg, model_cfg, lambda split: sum(single_peak_bytes(split, model_cfg)), capacity,
                    settle=lambda split: resolve_wgrad_pairs(split, model_cfg, capacity)[0])


def check_fp8_device(device: torch.device) -> None:
    """ValueError for `precision: fp8` on a GPU without FP8 tensor cores (before sm_89: Ada, Hopper)."""
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        raise ValueError(f"precision: fp8 needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
                         f"Blackwell); {torch.cuda.get_device_name(device)} is {major}.{minor}: set precision: bf16")


def resolve_dense_fp8(cfg: TrainConfig, device: torch.device) -> TrainConfig:
    """`cfg` with its dense projections in bf16 (`fp8_dense: false`) where it left both `fp8_dense`
    and `fp8_dense_scaling` unset under precision fp8 and `device` cannot run their default, blockwise
    FP8 (`fp8_dense.blockwise_unavailable`), said in one `RunWarning`; else `cfg`. An explicit
    request stays, for `set_dense_fp8` to refuse with the fix; emulated GEMMs run anywhere."""
    if cfg.dense_precision != "fp8" or cfg.fp8_emulate or (cfg.fp8_dense, cfg.fp8_dense_scaling) != (None, None):
        return cfg
    from disagmoe.kernels.fp8_dense import blockwise_unavailable

    reason = blockwise_unavailable(device)
    if reason is None:
        return cfg
    warnings.warn(f"precision: fp8 keeps the dense projections in bf16 here: their default FP8 recipe is blockwise, "
                  f"and {reason}; set fp8_dense: true with fp8_dense_scaling: rowwise to run them in FP8 here, "
                  "or fp8_dense: false to keep them in bf16 without this warning", RunWarning, stacklevel=2)
    return cfg.model_copy(update={"fp8_dense": False})


def set_dense_fp8(model: Any, stats: Fp8Stats | None, scaling: str, emulate: bool, device: torch.device) -> list[str]:
    """The dense projections of `model` held here in FP8 (`MoETransformer.set_dense_fp8`), scaled
    `scaling` (`TrainConfig.dense_fp8_scaling`): blockwise is refused off Hopper unless emulated
    (`fp8_dense.check_blockwise_device`), and the linears it keeps in bf16 (off its 512 grid) are
    named in one `RunWarning`, counted by their name within the layer. Returns their names."""
    if scaling == "blockwise" and not emulate:
        from disagmoe.kernels.fp8_dense import check_blockwise_device

        check_blockwise_device(device)
    kept = model.set_dense_fp8(True, stats, emulate, scaling)
    if kept:
        by_role = collections.Counter(name.split(".", 2)[-1] for name in kept)
        listed = ", ".join(f"{role} x{count}" for role, count in sorted(by_role.items()))
        warnings.warn(f"fp8_dense_scaling: blockwise keeps {len(kept)} dense linear(s) in bf16, their dimensions off "
                      f"the recipe's 512 grid ({listed}); the rest run in FP8", RunWarning, stacklevel=2)
    return kept


def memory_knobs(cfg: TrainConfig, model_cfg: ModelConfig) -> list[tuple[str, float]]:
    """(setting, predicted peak bytes with it) for each memory knob this one-GPU run does not use yet
    and its config accepts (`config.memory_knob_changes`), and the most micro-batches the batch
    divides into; each alone, on top of the run's settings. `cfg.micro_batches` is a number (auto
    resolved)."""
    knobs = memory_knob_changes(cfg)
    if isinstance(cfg.micro_batches, int) and cfg.micro_batches < cfg.batch_size:
        knobs.append((f"micro_batches: {cfg.batch_size}", cfg.model_copy(update={"micro_batches": cfg.batch_size})))
    return [(label, float(sum(single_peak_bytes(other, model_cfg)))) for label, other in knobs]


def check_single_memory(cfg: TrainConfig, model_cfg: ModelConfig, capacity_bytes: float) -> None:
    """ValueError, before the model is allocated, for a one-GPU run whose training state and
    activation peak (`single_peak_bytes`) exceed the device: one line with the numbers and the
    knobs that shrink it, each with its predicted peak (`memory_knobs`), instead of an
    out-of-memory error in the first step."""
    state, acts = single_peak_bytes(cfg, model_cfg)
    if state + acts <= capacity_bytes:
        return
    tokens = cfg.batch_size // cfg.micro_batches * cfg.seq_len
    held = ("weights, gradients and two offload staging buckets (the fp32 masters and AdamW moments are in host "
            "memory)" if cfg.offloads_to_host else "weights, fp32 masters, gradients and AdamW moments")
    knobs = ", ".join(f"{label} ({peak / 2**30:.1f} GiB, {peak / capacity_bytes:.0%} of the device)"
                      for label, peak in memory_knobs(cfg, model_cfg))
    raise ValueError(
        f"mode single needs {(state + acts) / 2**30:.1f} GiB on a {capacity_bytes / 2**30:.1f} GiB device: "
        f"{count_params(model_cfg).total:,} parameters hold {state / 2**30:.1f} GiB of {held}, and a micro-batch of "
        f"{tokens:,} tokens (batch_size={cfg.batch_size} / micro_batches={cfg.micro_batches} x seq_len={cfg.seq_len}) "
        f"{acts / 2**30:.1f} GiB of activations; use {knobs + ', ' if knobs else ''}fewer tokens per step, or a "
        "distributed mode over more GPUs (`disagmoe plan` finds a layout that fits)")


class SingleProcessTrainer(TrainingLoop):
    """Model, optimizer, data and outputs of a `mode: single` run."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        self.model_cfg: ModelConfig = load_model(cfg.model)
        self.device = resolve_device(cfg.device)
        reset_peak_memory(self.device)
        if cfg.expert_precision == "fp8":
            check_fp8_device(self.device)
            cfg = resolve_dense_fp8(cfg, self.device)  # before the memory model prices the dense copies
        self.cfg = cfg = self._auto_split(resolve_single_micro_batches(cfg, self.model_cfg, self.device))
        check_divisible(cfg.batch_size, cfg.micro_batches, 1)
        cfg, self.wgrad_pairs_note = resolve_wgrad_pairs(cfg, self.model_cfg, device_capacity_bytes(self.device))
        self.cfg = cfg
        check_backend_device(cfg.experts_backend, self.device.type)
        if self.device.type == "cuda":
            check_single_memory(cfg, self.model_cfg, torch.cuda.get_device_properties(self.device).total_memory)
            # which of the expert GEMM classes it launches run the heuristic tiles on this GPU (a start line)
            self.tiles_note = untuned_tiles_note(cfg, self.model_cfg, torch.cuda.get_device_name(self.device),
                                                 device_architecture(self.device))
        self.host_state_bytes = single_host_bytes(cfg, self.model_cfg)
        if self.host_state_bytes:
            check_host_memory(self.host_state_bytes, f"{count_params(self.model_cfg).total:,} parameters, mode single")
        self.predicted_peak_gib = sum(single_peak_bytes(cfg, self.model_cfg)) / 2**30
        splits = load_splits(cfg.data, self.model_cfg.vocab_size, cfg.seq_len)
        self.train_data = TokenDataset(splits.train, cfg.seq_len, cfg.batch_size, cfg.data_seed, "train")
        self.val_data = (
            None if splits.val is None
            else TokenDataset(splits.val, cfg.seq_len, cfg.batch_size, cfg.data_seed, "val")
        )
        self.evaluates = self.val_data is not None and cfg.eval_every > 0
        torch.manual_seed(cfg.seed)
        set_fusion(cfg.fuse_elementwise)
        set_fused_loss(cfg.fused_loss)
        set_expert_loads(loads_of_routing(cfg.routing))  # the expert tiles tuned for its loads
        # built on the meta device and initialised once where it runs: each tensor drawn from its CPU
        # stream and copied into device memory once (no constructor's throwaway init, no whole-model
        # copy; at 3.8 B parameters those cost `bench train` about a minute per row on an H200)
        with torch.device("meta"):
            self.model = MoETransformer(self.model_cfg, experts_backend=cfg.experts_backend)
        materialise(self.model, self.device, cfg.seed)
        self.model.set_routing(cfg.routing)
        self.model.set_recompute(cfg.recompute_set)
        self.fp8_stats = None
        self.first_step: int | None = None  # the first step this process runs (`counts_fp8`)
        if cfg.expert_precision == "fp8":
            self.model.set_expert_precision("fp8", cfg.expert_backward_precision, cfg.expert_forward_precision,
                                            cfg.fp8_emulate)
            from disagmoe.kernels.fp8_ffn import set_gluon

            # process-wide, as set_fusion: every FP8 run sets it
            set_gluon(cfg.expert_gluon, cfg.expert_gluon_tma_store, cfg.expert_gluon_block_m)
            self.fp8_stats = Fp8Stats(self.device)  # before the capture below: its kernels keep the address
            self.model.set_fp8_stats(self.fp8_stats)
            if cfg.dense_precision == "fp8":  # the dense projections too (kernels.fp8_dense)
                set_dense_fp8(self.model, self.fp8_stats, cfg.dense_fp8_scaling, cfg.fp8_emulate, self.device)
        # plain torch AdamW on fp32 parameters, the reference; it keeps fp32 moments on the device, so bf16
        # ones (optim.state_dtype) or offloaded ones step the flat optimizer over the same fp32 parameters
        self.oracle = cfg.steps_reference_adamw
        self.optimizer = (build_optimizer(self.model.named_parameters(), cfg.optim) if self.oracle
                          else FlatAdamW(self.model.named_parameters(), cfg.optim, compute_dtype(cfg),
                                         offload_bucket_bytes=offload_bucket_bytes(cfg),
                                         first_touch=first_touch_params(self.model)))
        if cfg.cuda_graphs == "on" and self.oracle:
            raise ValueError("cuda_graphs: on captures the bf16 fast path's step; precision fp32 steps the reference "
                             "torch AdamW, which is not captured: set precision: bf16 (or cuda_graphs: off)")
        self.model.train()
        capture, self.cuda_graphs_note = resolve_cuda_graphs(cfg)
        self.graphed = (GraphedStep(self.model, self.optimizer, (cfg.batch_size, cfg.seq_len + 1), cfg.micro_batches,
                                    cfg.optim.grad_clip, functools.partial(_flat_step_on_device,
                                                                           pair_wgrads=cfg.pairs_expert_wgrads),
                                    self.device)
                        if capture else None)  # never the reference path: on refused above, auto eager there
        self.out_dir = Path(cfg.out_dir)
        self.checkpoint_root = self.out_dir / CHECKPOINTS_DIR
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.flops_per_step = step_flops(self.model_cfg, self.tokens_per_step, cfg.seq_len)
        self.peak_flops, self.ceiling_flops = peak_and_ceiling(cfg, gpus=1)
        self.step = 0
        if cfg.resume:
            self._resume()

    def run_facts(self) -> dict[str, Any]:
        return {"predicted_peak_gib": self.predicted_peak_gib, "offloaded_host_gib": self.host_state_bytes / 2**30,
                **self.split_facts(),
                "cuda_graph_replays": None if self.graphed is None else self.graphed.replays,
                "cuda_graphs_note": self.cuda_graphs_note, "expert_wgrad_pairs": self.cfg.pairs_expert_wgrads,
                "expert_wgrad_pairs_note": self.wgrad_pairs_note, "expert_tiles_note": self.tiles_note}

    def _resume(self) -> None:
        """Load the newest checkpoint that loads (damaged newer ones skipped with a warning each),
        warning about changed training settings."""
        directory, state = resume_checkpoint(
            self.checkpoint_root, lambda d: load_checkpoint(d, self.model, self.optimizer, self.model_cfg))
        warn_changed_training(read_manifest(directory), self.cfg, directory)
        state.restore_rng()
        if state.step >= self.cfg.steps:
            raise ValueError(
                f"checkpoint {directory} is at step {state.step}, already at steps={self.cfg.steps}; "
                f"raise steps to train further"
            )
        assert state.data_step == state.step, "this trainer draws the batch of step t at step t"
        self.step = state.step

    def save(self) -> Path:
        return save_checkpoint(self.checkpoint_root, self.model, self.optimizer, self.model_cfg,
                               TrainerState.capture(self.step), training_settings(self.cfg))

    def run(self, on_step: StepCallback | None = None) -> TrainSummary:
        """Train from the current step to `cfg.steps`, logging every step; returns the summary."""
        with torch_threads(self.cfg.cpu_threads if self.device.type == "cpu" else None):
            return self._run(on_step)

    def validate(self) -> float:
        loss = evaluate(self.model, self.val_data, self.cfg.eval_batches, self.cfg.micro_batches)
        if self.fp8_stats is not None:
            self.fp8_stats.reset()  # the evaluation's quantisations are no step's
        return loss

    def evaluation_stopped(self) -> None:
        self.model.train()  # `evaluate` was left before it put the model back

    def _train_one_step(self) -> dict[str, Any]:
        cfg = self.cfg
        lr = lr_at(self.step, cfg.optim, cfg.steps)
        tokens_BS1 = self.train_data.batch(self.step)
        replays_before = 0 if self.graphed is None else self.graphed.replays
        if self.first_step is None:
            self.first_step = self.step + 1
        counted = counts_fp8(self.step + 1, cfg.counters_every, self.first_step, cfg.steps)
        stats = self.fp8_stats if counted else None
        if self.fp8_stats is not None and self.model.fp8_stats is not stats:  # the kind of step changes
            self.model.set_fp8_counting(stats)
        self._sync()
        start = time.perf_counter()
        with out_of_memory_hint(cfg), torch.profiler.record_function(TIMED_STEP_RANGE):
            if self.oracle:
                result = train_step(self.model, self.optimizer, tokens_BS1, cfg.micro_batches, lr, cfg.optim.grad_clip)
            elif self.graphed is not None:
                tokens_BS1 = tokens_BS1.to(self.device)  # the host copy outside the sync check, as train_step_flat
                with no_host_syncs(cfg.forbid_host_syncs, self.device):
                    out = self.graphed(tokens_BS1, lr, variant=counted)  # one kind without FP8 (counters_every 1)
                result = read_step(*out, cfg.micro_batches, stats)
            else:
                result = train_step_flat(self.model, self.optimizer, tokens_BS1, cfg.micro_batches, lr,
                                         cfg.optim.grad_clip, cfg.forbid_host_syncs, stats, cfg.pairs_expert_wgrads)
            self._sync()
        seconds = time.perf_counter() - start
        self.step += 1
        return {
            "step": self.step,
            "loss": result.loss,
            "ce": result.ce,
            "aux_loss": result.aux_loss,
            "z_loss": result.z_loss,
            "lr": lr,
            "grad_norm": result.grad_norm,
            **self.step_speed(seconds),
            "peak_memory_gib": peak_memory_gib(self.device),
            "predicted_peak_gib": self.predicted_peak_gib,  # `single_peak_bytes`: beside the measured peak
            "cuda_graph": self.graphed is not None and self.graphed.replays > replays_before,  # replayed, not eager
            "expert_load": result.expert_load_LE.tolist(),
            "load_imbalance": load_imbalance(result.expert_load_LE),
            **fp8_fields(result, self.device),
            **({} if self.fp8_stats is None else fp8_guard_fields(counted, result.grad_norm, self.device)),
        }

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


def train_single(cfg: TrainConfig, on_step: StepCallback | None = None) -> TrainSummary:
    """Run a whole `mode: single` training run (resuming if `cfg.resume`)."""
    return SingleProcessTrainer(cfg).run(on_step)
