"""`micro_batches: auto`: the split of each step's batch that the roofline prices fastest among
those the memory model says fit.

    choose(cfg, model_cfg, need_bytes, capacity_bytes) -> MicroBatchChoice
    resolved(cfg, model_cfg, need_bytes, capacity_bytes) -> (cfg with a number, the choice or None)
    predicted_step_s(cfg, model_cfg) -> seconds per step of the config's own layout, or None

Fewer micro-batches mean larger ones: fewer passes of the expert weight gradients' fp32
main-gradient traffic (8 bytes per expert parameter per micro-batch) and fewer fixed costs per op,
but more activations in flight. The candidates are the divisors m of the batch per data-parallel
rank (each micro-batch at least one sequence per rank). A candidate fits when the memory model's
peak (`need_bytes`: the single trainer's `single_peak_bytes`, or the largest rank's need in a
distributed run, the numbers the memory checks use) is within `MEMORY_HEADROOM` of the device. Of
those, the one with the least predicted step wins (`predicted_step_s`: the roofline of this
layout on the config's hardware, the `disagmoe roofline -c CFG` figure); with no hardware to price
on, the fewest micro-batches that fit. The headroom covers what the model does not count: the
CUDA context, cuBLAS/Triton workspaces and the allocator's fragmentation (measured peaks on one
H200 were 0.3-3% above the predicted ones, docs/benchmarks.md), so a chosen split is not the one
that runs out of memory in its first step.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagmoe.config import HardwareConfig, ModelConfig, TrainConfig, load_hardware, memory_knob_changes
from disagmoe.placement.cost import evaluate
from disagmoe.placement.solver import problem_of
from disagmoe.placement.trace_compare import run_request
from disagmoe.runtime.training.single_memory import MEMORY_HEADROOM  # the split's budget (module docstring)


@dataclass(frozen=True)
class Candidate:
    """One split tried: its micro-batches, memory need and predicted step (None: not priced)."""

    micro_batches: int
    need_bytes: int
    predicted_step_s: float | None
    fits: bool


@dataclass(frozen=True)
class MicroBatchChoice:
    """The split chosen for `micro_batches: auto`, and every candidate tried (ascending m)."""

    micro_batches: int
    capacity_bytes: float
    tried: tuple[Candidate, ...]

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.tried if c.micro_batches == self.micro_batches)

    def note(self) -> str:
        """One line for the start of a run, e.g. 'micro_batches: auto -> 2 (93.6 of 118.8 GiB ...)'."""
        c, budget = self.chosen, self.capacity_bytes * MEMORY_HEADROOM
        line = (f"micro_batches: auto -> {c.micro_batches} ({_size(c.need_bytes)} of the {_size(budget)} it may use, "
                f"{MEMORY_HEADROOM:.0%} of the device's {_size(self.capacity_bytes)}")
        line += (f"; predicted {c.predicted_step_s * 1e3:,.1f} ms per step)" if c.predicted_step_s is not None
                 else "; the fewest that fit: no hardware preset to price the step on)")
        fewer = [t for t in self.tried if t.micro_batches < c.micro_batches]
        if fewer:
            line += "; " + ", ".join(
                f"{t.micro_batches} needs {_size(t.need_bytes)}" if not t.fits else
                f"{t.micro_batches} predicted {t.predicted_step_s * 1e3:,.1f} ms" for t in fewer)
        more = [t for t in self.tried if t.micro_batches > c.micro_batches and t.predicted_step_s is not None]
        if more and c.predicted_step_s is not None:
            line += "; " + ", ".join(f"{t.micro_batches} predicted {t.predicted_step_s * 1e3:,.1f} ms" for t in more[:2])
        return line


def _size(num_bytes: float) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.0f} MiB"


def data_parallel(cfg: TrainConfig) -> int:
    """Ranks each micro-batch's sequences are split over (the batch is divided by m times this)."""
    if cfg.mode == "disaggregated":
        return cfg.attention_ranks // cfg.pipeline_groups
    return cfg.colocated_ranks // cfg.pipeline_groups if cfg.mode == "colocated" else 1


def candidates(cfg: TrainConfig) -> list[int]:
    """Every m with batch_size = m x data-parallel ranks x whole sequences, ascending."""
    per_rank, rest = divmod(cfg.batch_size, data_parallel(cfg))
    if rest or per_rank == 0:
        raise ValueError(f"micro_batches: auto: batch_size={cfg.batch_size} does not split over "
                         f"{data_parallel(cfg)} data-parallel ranks; make it a multiple of them")
    return [m for m in range(1, per_rank + 1) if per_rank % m == 0]


def device_capacity_bytes(device: torch.device) -> int:
    """Memory a run on `device` has: the GPU's (torch's figure for the whole device), or the host's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def with_micro_batches(cfg: TrainConfig, m: int) -> TrainConfig:
    return cfg.model_copy(update={"micro_batches": m})


def predicted_step_s(cfg: TrainConfig, model_cfg: ModelConfig, hw: HardwareConfig | None = None) -> float | None:
    """The roofline's step of this config's own layout on its hardware (`hw`, else the config's
    preset: `roofline -c CFG`); None without a hardware preset."""
    if hw is None and cfg.hardware is None:
        return None
    req, cand = run_request(cfg, model_cfg, hw or load_hardware(cfg.hardware))
    return float(evaluate(problem_of(req), cand).step_s[0])


def choose(cfg: TrainConfig, model_cfg: ModelConfig, need_bytes: Callable[[TrainConfig], int],
           capacity_bytes: float, settle: Callable[[TrainConfig], TrainConfig] | None = None) -> MicroBatchChoice:
    """The split for `micro_batches: auto` (module docstring); ValueError when even the most
    micro-batches (one sequence per rank each) do not fit, with the numbers and the fix. `settle`:
    each split's settings that depend on its size, decided before it is measured and priced (the
    single trainer's `resolve_wgrad_pairs`)."""
    budget = capacity_bytes * MEMORY_HEADROOM
    hw = None if cfg.hardware is None else load_hardware(cfg.hardware)  # read once, priced per candidate
    tried = []
    split = cfg
    for m in candidates(cfg):
        split = with_micro_batches(cfg, m)
        if settle is not None:
            split = settle(split)
        need = need_bytes(split)
        fits = need <= budget
        priced = fits and hw is not None
        tried.append(Candidate(m, need, predicted_step_s(split, model_cfg, hw) if priced else None, fits))
    fitting = [c for c in tried if c.fits]
    if not fitting:
        most = tried[-1]
        raise ValueError(
            f"micro_batches: auto: even {most.micro_batches} micro-batches (one sequence per rank each) need "
            f"{most.need_bytes / 2**30:.1f} GiB, more than the {budget / 2**30:.1f} GiB ({MEMORY_HEADROOM:.0%} of "
            f"{capacity_bytes / 2**30:.1f}) a run may plan for; lower seq_len, "
            # the knobs of the most micro-batches' split as measured: a number, its settings settled (`settle`)
            f"{''.join(f'{label}, ' for label, _ in memory_knob_changes(split))}or a layout "
            "over more GPUs (`disagmoe plan` finds one)")
    priced = [c for c in fitting if c.predicted_step_s is not None]
    best = min(priced, key=lambda c: (c.predicted_step_s, c.micro_batches)) if priced else fitting[0]
    return MicroBatchChoice(best.micro_batches, capacity_bytes, tuple(tried))


def resolved(cfg: TrainConfig, model_cfg: ModelConfig, need_bytes: Callable[[TrainConfig], int],
             capacity_bytes: float, settle: Callable[[TrainConfig], TrainConfig] | None = None,
             ) -> tuple[TrainConfig, MicroBatchChoice | None]:
    """`cfg` with `micro_batches: auto` replaced by `choose`'s number (and the choice, for the
    start line); a number given stays, with no choice."""
    if cfg.micro_batches != "auto":
        return cfg, None
    choice = choose(cfg, model_cfg, need_bytes, capacity_bytes, settle)
    return with_micro_batches(cfg, choice.micro_batches), choice
