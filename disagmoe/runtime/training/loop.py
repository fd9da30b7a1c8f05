"""The step loop every training mode shares: train, validate, checkpoint, log, summarise.

A mode (`SingleProcessTrainer`, `DistributedTrainer`) subclasses `TrainingLoop` and supplies one
optimizer step (`_train_one_step`, returning the step's metrics record), a validation pass
(`validate`) and a checkpoint (`save`). The loop validates every `eval_every` steps and at the
end, checkpoints every `checkpoint_every` steps, whenever `checkpoint_minutes` passed since the
last checkpoint, and at the end (keeping the newest `keep_checkpoints`), writes one JSONL record
per step and averages any per-group `busy` fractions the records carry into the summary.

A step whose loss or gradient norm is not finite, or (precision fp8) whose FP8 quantisers met an inf
or NaN (the record's `fp8_nonfinite` kinds), stops the run (`TrainingDiverged`) before it is
checkpointed: the newest checkpoint stays the last good one. Its record goes into metrics.jsonl with
the non-finite numbers as null (the file is strict JSON). The whole loop holds out_dir's lock
(`run_lock`).

SIGINT (Ctrl-C) or SIGTERM (a scheduler's preemption) stops the run gracefully: the step in
flight finishes, a checkpoint is written and `TrainingInterrupted` says where to resume from. A
signal during an evaluation abandons it at once (its result is not needed to stop); in the
distributed modes, whose actors are still inside it, the run then stops with its last checkpoint.
A second signal aborts at once.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from disagmoe.config import TrainConfig
from disagmoe.runtime.state.checkpoint import checkpoint_dir, latest_checkpoint, prune_checkpoints
from disagmoe.runtime.failures import TrainingDiverged, TrainingInterrupted
from disagmoe.runtime.observe.metrics import MetricsLog, mfu
from disagmoe.runtime.observe.throughput import Throughput
from disagmoe.runtime.out_dir import CHECKPOINTS_DIR, clean_stale_files
from disagmoe.runtime.run_lock import run_lock

if TYPE_CHECKING:
    from disagmoe.runtime.training.micro_batches import MicroBatchChoice

METRICS_FILE = "metrics.jsonl"
_clock = time.monotonic  # for checkpoint_minutes (tests substitute a fake)
StepCallback = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class TrainSummary:
    steps: int  # optimizer steps taken in total (including those before a resume)
    final_loss: float | None
    final_val_loss: float | None
    tokens_per_s: float | None  # `runtime.observe.throughput.Throughput` over this process's training steps
    mfu: float | None  # likewise; None without `hardware`
    out_dir: str
    metrics_path: str
    checkpoint_path: str | None
    busy: dict[str, float] | None = None  # distributed modes: per group, mean compute / step time
    restarts: int = 0  # distributed modes: times the run restarted itself after a failed rank (max_restarts)
    hop: str | None = None  # distributed modes: how expert outputs returned (`runtime.stages.messages.hop_mode`)
    dispatch: str | None = None  # distributed modes: dense or sparse (`runtime.stages.messages.dispatch_mode`)
    # distributed modes: bytes of the rows sent between ranks per step (mean over the steps run), per
    # payload, each with its `_dense` figure (`comm.base.Traffic`)
    traffic: dict[str, float] | None = None
    transport: str | None = None  # distributed modes: the transport every rank ran
    gpus: int | None = None  # distributed modes on cuda: GPUs the ranks ran on
    ranks_per_gpu: int = 1  # > 1: ranks time-sliced each GPU (`runtime.cluster.sharing`): not a speed figure
    time_sliced: bool = False
    processes: list[dict[str, Any]] | None = None  # distributed modes: each rank's pid, node, device, role, hop
    # the memory model's peak (GiB of torch's allocator: the step records' measured peak_memory_gib beside it)
    predicted_peak_gib: float | None = None
    predicted_peak_gib_per_rank: list[float] | None = None  # distributed modes
    # distributed modes: each rank's transport buffers (nvshmem arena / nccl receive buffers), in the peak above
    transport_gib_per_rank: list[float] | None = None
    offloaded_host_gib: float | None = None  # offload_optimizer on GPUs: host memory of the masters and moments
    micro_batches: int | None = None  # the split each step ran in
    cuda_graph_replays: int | None = None  # a captured step: steps replayed from the graph (the rest eager)
    cuda_graphs_note: str | None = None  # whether the step was captured, and why (`graphed_step.resolve_cuda_graphs`)
    micro_batches_note: str | None = None  # micro_batches: auto: the choice and why (`runtime.training.micro_batches`)
    # whether the expert weight gradients ran over pairs of micro-batches (each expert rank its own, distributed),
    # and the start line saying so (`single_memory.resolve_wgrad_pairs`, `driver.resolve_distributed_wgrad_pairs`)
    expert_wgrad_pairs: bool | None = None
    expert_wgrad_pairs_note: str | None = None
    # the expert GEMM classes the run launched with the heuristic tiles, untuned on its GPU
    # (`tile_coverage.untuned_tiles_note`)
    expert_tiles_note: str | None = None
    # the dense projections' GEMMs as run (`TrainConfig.dense_recipe` of the resolved config: bf16 where precision
    # fp8's default blockwise recipe could not run, `trainer.resolve_dense_fp8`)
    dense_recipe: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@contextmanager
def signals_held(note: str) -> Iterator[None]:
    """Inside the block SIGINT and SIGTERM are ignored (main thread only; elsewhere a no-op): a
    shutdown that a second Ctrl-C interrupts leaves Ray's agents and actors behind. A signal that
    arrives prints `note` once."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    told = []

    def hold(signum: int, frame: object) -> None:
        if not told:
            told.append(signum)
            sys.stderr.write(f"\n{note}\n")
            sys.stderr.flush()

    previous = {s: signal.getsignal(s) for s in StopRequest.SIGNALS}
    for s in StopRequest.SIGNALS:
        signal.signal(s, hold)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


class StopRequest:
    """Set by the first SIGINT / SIGTERM while installed; a second one raises KeyboardInterrupt."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signal: str | None = None
        self.evaluating = False  # inside `validate`: the first signal abandons it (EvaluationStopped)

    @contextmanager
    def installed(self) -> Iterator[StopRequest]:
        """Handle the signals inside the block (only the main thread can; elsewhere a no-op)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        previous = {s: signal.getsignal(s) for s in self.SIGNALS}
        for s in self.SIGNALS:
            signal.signal(s, self._handle)
        try:
            yield self
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.signal is not None:
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name
        what = "abandoning the evaluation in flight" if self.evaluating else "stopping after this step"
        sys.stderr.write(f"\n{self.signal}: {what} with a checkpoint (again to abort now)\n")
        sys.stderr.flush()
        if self.evaluating:
            raise EvaluationStopped


class EvaluationStopped(Exception):
    """Raised by the first signal inside an evaluation: a long evaluation does not hold a stop up."""


class TrainingLoop:
    """Base of every mode; see the module docstring for what a subclass provides."""

    cfg: TrainConfig
    step: int
    out_dir: Path
    tokens_per_step: int
    flops_per_step: float
    peak_flops: float | None
    ceiling_flops: float | None
    evaluates: bool  # a validation split exists and eval_every > 0
    # After an evaluation abandoned mid-way, can the step still be checkpointed? (distributed: no,
    # its actors are still inside the evaluation; the run stops with its last checkpoint)
    checkpoints_after_stopped_evaluation = True
    restarts: int = 0  # automatic restarts so far (distributed modes: DistributedTrainer.run)
    # a start line where some expert GEMM classes the run launches have no tuned tiles on its GPU (`tile_coverage`;
    # mode single only)
    tiles_note: str | None = None

    def _train_one_step(self) -> dict[str, Any]:
        raise NotImplementedError

    def step_speed(self, seconds: float) -> dict[str, Any]:
        """The speed fields of a step's metrics record, the same in every mode."""
        cfg = self.cfg
        return {
            "tokens": self.tokens_per_step,
            "step_time_s": seconds,
            "tokens_per_s": self.tokens_per_step / seconds,
            "flops": self.flops_per_step,
            "mfu": mfu(self.flops_per_step, seconds, self.peak_flops),
            "mfu_ceiling": mfu(self.flops_per_step, seconds, self.ceiling_flops),
            "routing": cfg.routing,
            "precision": cfg.expert_precision,
        }

    micro_batch_choice: MicroBatchChoice | None = None  # micro_batches: auto (`_auto_split`)

    def _auto_split(self, resolved: tuple[TrainConfig, MicroBatchChoice | None]) -> TrainConfig:
        """Keep `micro_batches: auto`'s choice (for the summary) and return the config with its number."""
        cfg, self.micro_batch_choice = resolved
        return cfg

    def split_facts(self) -> dict[str, Any]:
        """The summary's micro_batches and, when auto chose it, why."""
        choice = self.micro_batch_choice
        return {"micro_batches": self.cfg.micro_batches, "micro_batches_note": choice.note() if choice else None}

    def run_facts(self) -> dict[str, Any]:
        """What the summary records about how the run ran, beyond its figures (TrainSummary's
        optional fields); none for one process."""
        return {}

    def validate(self) -> float:
        raise NotImplementedError

    def save(self) -> Path:
        raise NotImplementedError

    def _checkpoint(self) -> Path:
        """`save`, then delete all but the newest `keep_checkpoints`."""
        checkpoint = self.save()
        prune_checkpoints(checkpoint.parent, self.cfg.keep_checkpoints, checkpoint)
        return checkpoint

    def _run(self, on_step: StepCallback | None) -> TrainSummary:
        cfg = self.cfg
        metrics_path = self.out_dir / METRICS_FILE
        last: dict[str, Any] = {}
        last_val: float | None = None
        checkpoint: Path | None = None
        throughput = Throughput()
        busy_sums: dict[str, float] = {}
        steps_run = 0
        last_save = _clock()
        stop = StopRequest()
        with run_lock(self.out_dir), stop.installed():
            clean_stale_files(self.out_dir)
            with MetricsLog(metrics_path, resume_after_step=self.step if cfg.resume else None) as log:
                while self.step < cfg.steps:
                    record = self._train_one_step()
                    if not_finite(record) or record.get("fp8_nonfinite"):
                        log.write(record)
                        raise TrainingDiverged(self.step, diverged_report(cfg, record, self._last_good(checkpoint)))
                    throughput.add(record)
                    steps_run += 1
                    for group, fraction in record.get("busy", {}).items():
                        busy_sums[group] = busy_sums.get(group, 0.0) + fraction
                    if self.evaluates and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                        last_val = record["val_loss"] = self._validate_unless_stopped(stop)
                        if last_val is None and not self.checkpoints_after_stopped_evaluation:
                            log.write(record)
                            raise TrainingInterrupted(stop.signal or "signal", self.step, self._last_good(checkpoint))
                    due_by_time = cfg.checkpoint_minutes and _clock() - last_save >= 60 * cfg.checkpoint_minutes
                    at_end = self.step == cfg.steps and cfg.checkpoint_at_end
                    if (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0) or due_by_time or at_end:
                        checkpoint, last_save = self._checkpoint(), _clock()
                    log.write(record)
                    if on_step is not None:
                        on_step(record)
                    last = record
                    if stop.signal is not None and self.step < cfg.steps:
                        if checkpoint is None or checkpoint.name != checkpoint_dir(checkpoint.parent, self.step).name:
                            checkpoint = self._checkpoint()
                        raise TrainingInterrupted(stop.signal, self.step, checkpoint)
        return TrainSummary(
            steps=self.step,
            final_loss=last.get("loss"),
            final_val_loss=last_val,
            tokens_per_s=throughput.tokens_per_s,
            mfu=mfu(self.flops_per_step * throughput.tokens / self.tokens_per_step, throughput.seconds, self.peak_flops),
            out_dir=str(self.out_dir),
            metrics_path=str(metrics_path),
            checkpoint_path=None if checkpoint is None else str(checkpoint),
            busy={g: total / steps_run for g, total in busy_sums.items()} if busy_sums and steps_run else None,
            restarts=self.restarts,
            dense_recipe=self.cfg.dense_recipe,
            **self.run_facts(),
        )

    def _validate_unless_stopped(self, stop: StopRequest) -> float | None:
        """`validate()`, or None if a first signal abandoned it (the step's weights stay intact)."""
        stop.evaluating = True
        try:
            return self.validate()
        except EvaluationStopped:
            self.evaluation_stopped()
            return None
        finally:
            stop.evaluating = False

    def evaluation_stopped(self) -> None:
        """Called after an evaluation was abandoned mid-way (a subclass puts its model back in training mode)."""

    def _last_good(self, written: Path | None) -> Path | None:
        """The newest checkpoint: the one this run wrote last, else the one it resumed from."""
        if written is not None:
            return written
        return latest_checkpoint(self.out_dir / CHECKPOINTS_DIR)


WATCHED = ("loss", "grad_norm")  # a step's numbers that must be finite


def not_finite(record: dict[str, Any]) -> list[str]:
    """The `WATCHED` numbers of a step record that are NaN or infinite."""
    return [name for name in WATCHED if isinstance(record.get(name), float) and not math.isfinite(record[name])]


def likely_setting(cfg: TrainConfig) -> str:
    """The setting most likely to make a step's loss or gradients overflow, with the fix."""
    o = cfg.optim
    if o.lr > 1.0:
        return f"optim.lr={o.lr:g} is far above any working learning rate (try 1e-4 to 1e-2)"
    if o.lr * o.weight_decay >= 1.0:
        return (f"optim.weight_decay={o.weight_decay:g} with optim.lr={o.lr:g} scales every weight by "
                f"1 - lr * weight_decay = {1 - o.lr * o.weight_decay:g} per step (keep lr * weight_decay well below 1)")
    if o.eps < 1e-12:
        return f"optim.eps={o.eps:g} lets AdamW divide by almost zero (use 1e-8)"
    if o.grad_clip == 0:
        return "optim.grad_clip=0 leaves gradients unclipped (use 1.0) or lower optim.lr"
    return f"no setting stands out: lower optim.lr (now {o.lr:g}), check the model's sizes and the data"


def diverged_report(cfg: TrainConfig, record: dict[str, Any], checkpoint: Path | None) -> str:
    """One line: which numbers of which step were not finite, the likely setting, where to resume."""
    keep = (f"the last good checkpoint is {checkpoint} (resume=true continues from it)" if checkpoint is not None
            else "no checkpoint was written")
    if record.get("fp8_nonfinite"):
        return f"{fp8_report(cfg, record)}; {keep}"
    bad = ", ".join(f"{name} {record[name]}" for name in not_finite(record))
    skipped = ("; the optimizer skipped its update on the GPU (precision fp8 skips a step whose gradient norm is "
               "not finite: the weights are the previous step's)" if record.get("fp8_update_skipped") else "")
    return f"step {record['step']}: {bad} (not finite){skipped}; {likely_setting(cfg)}; {keep}"


def fp8_report(cfg: TrainConfig, record: dict[str, Any]) -> str:
    """The step, the tensor kinds whose FP8 scale went non-finite (an inf or NaN among the values a
    quantiser scaled), the fix, and what became of the step's update: on CUDA the optimizer skipped
    it on the device (`fp8_update_skipped`); the host learns of it only when the step is read (a
    check before the update would wait on the GPU inside the step, which the step never does)."""
    kinds = " and ".join(record["fp8_nonfinite"])
    also = [f"{name} {record[name]}" for name in not_finite(record)]
    update = ("the optimizer skipped its update on the GPU (the weights are the previous step's)"
              if record.get("fp8_update_skipped") else
              "found when the step was read, after its optimizer update, which is not checkpointed")
    return (f"FP8 scale non-finite at step {record['step']} in {kinds}: the loss or gradients overflowed"
            + (f" ({', '.join(also)})" if also else "")
            + f"; lower the learning rate (optim.lr={cfg.optim.lr:g}) or run precision: bf16; {update}")
