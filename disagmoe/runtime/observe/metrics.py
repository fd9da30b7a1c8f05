"""Per-step training metrics and the JSONL file they go to (one JSON object per line).

Every record has `step` (1-based: the number of optimizer steps taken) and, for training steps,
loss, ce, aux_loss, z_loss, lr, grad_norm, tokens, step_time_s, tokens_per_s, flops, mfu (model
FLOPs / step time / (GPUs x the hardware's bf16 dense peak); null without a hardware), mfu_ceiling
(the same against GPUs x the measured matmul ceiling, peak x efficiency.matmul), routing (learned
or balanced), precision, peak_memory_gib (the largest over ranks; null on CPU), `expert_load` (per MoE layer, per expert: token-expert assignments in
the step, summed over micro-batches) and `load_imbalance` (per MoE layer: max / mean of that
layer's loads). Steps with a validation pass also carry `val_loss`. Distributed modes add
`busy` (per group of ranks, e.g. A0 / E0 / colocated: compute time over the step's wall time).
`disagmoe plan --load-histogram metrics.jsonl` reads `expert_load`.

Legend: L MoE layers, E experts.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from disagmoe.config import TrainConfig, load_hardware, memory_knob_changes
from disagmoe.runtime.failures import RunWarning
from disagmoe.safe_io import finite_or_none


def load_imbalance(load_LE: torch.Tensor) -> list[float]:
    """Per layer: the busiest expert's load over the mean load (1.0 is perfectly balanced)."""
    load = load_LE.double()
    mean = load.mean(dim=1)
    ratio = torch.where(mean > 0, load.max(dim=1).values / mean.clamp_min(1e-30), torch.ones_like(mean))
    return [float(r) for r in ratio]


def mfu(flops: float, seconds: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over `peak_flops` (all the run's GPUs together);
    None without a peak."""
    if peak_flops is None or seconds <= 0:
        return None
    return flops / seconds / peak_flops


def peak_and_ceiling(cfg: TrainConfig, gpus: int) -> tuple[float | None, float | None]:
    """(bf16 dense peak, measured matmul ceiling) FLOP/s of `gpus` GPUs of the config's hardware:
    the denominators of `mfu` and `mfu_ceiling` (module docstring); (None, None) without one."""
    if cfg.hardware is None:
        return None, None
    hw = load_hardware(cfg.hardware)
    peak = hw.bf16_tflops * 1e12 * gpus
    return peak, peak * hw.efficiency.matmul


def reset_peak_memory(device: torch.device) -> None:
    """Start this run's `peak_memory_gib` from what is allocated now, so a run in a process that
    ran others before it (`bench train`'s single-mode variants, tests) reports its own peak, not
    the largest of them all."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    """The most GPU memory this process's tensors took so far (torch's allocator), GiB; None on CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.max_memory_allocated(device) / 2**30


@contextmanager
def no_host_syncs(enabled: bool, device: torch.device) -> Iterator[None]:
    """Inside the block any operation that makes the host wait for the GPU raises (`torch.cuda.
    set_sync_debug_mode('error')`), when `enabled` on a CUDA device (`forbid_host_syncs`)."""
    if not enabled or device.type != "cuda":
        yield
        return
    _pause_the_check_while_compiling()
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    _SyncCheck.active += 1
    try:
        yield
    finally:
        _SyncCheck.active -= 1
        torch.cuda.set_sync_debug_mode(before)


class _SyncCheck:
    active = 0  # open no_host_syncs blocks
    hooked = False


def _pause_the_check_while_compiling() -> None:
    """torch.compile's first call of a `fused` function (and its lazily compiled backward) runs
    inductor on the host inside the step, and inductor's constant folding reads CUDA tensors: a
    one-time compilation, not a wait the step makes. Dynamo's compile start/end callbacks lift the
    check for the compilation only; the compiled kernels run under it as every other op."""
    if _SyncCheck.hooked:
        return
    from torch._dynamo.callback import callback_handler

    def pause(*_: object) -> None:
        if _SyncCheck.active:
            torch.cuda.set_sync_debug_mode("default")

    def resume(*_: object) -> None:
        if _SyncCheck.active:
            torch.cuda.set_sync_debug_mode("error")

    callback_handler.register_start_callback(pause)
    callback_handler.register_end_callback(resume)
    _SyncCheck.hooked = True


class OutOfMemory(ValueError):
    """A CUDA out-of-memory error, told as the knobs that shrink a step (one line)."""


@contextmanager
def out_of_memory_hint(cfg: TrainConfig, where: str = "this GPU") -> Iterator[None]:
    """Turn torch's CUDA out-of-memory error into one line that names the knobs."""
    try:
        yield
    except torch.OutOfMemoryError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else "CUDA out of memory"
        shared = (f"{cfg.ranks_per_gpu} ranks share each GPU (ranks_per_gpu): lower it over more GPUs, or "
                  if cfg.ranks_per_gpu > 1 and cfg.mode != "single" else "")
        raise OutOfMemory(
            f"{where} ran out of memory ({first[:160]}); a step of batch_size={cfg.batch_size} x seq_len="
            f"{cfg.seq_len} in micro_batches={cfg.micro_batches} does not fit: {shared}raise micro_batches, lower "
            f"batch_size or seq_len, {''.join(f'{label}, ' for label, _ in memory_knob_changes(cfg))}"
            f"or spread the layers over more ranks (expert_ranks, pipeline_groups)"
        ) from None


class MetricsLog:
    """Appends one JSON object per line to `path`, each line in one write(2) of an O_APPEND file,
    so a crash or a full disk never leaves half a record behind a complete one: a short write is
    cut back off and raised as the OSError it is (ENOSPC)."""

    def __init__(self, path: Path, resume_after_step: int | None = None):
        """Start a new file, or, when resuming, keep only the records up to `resume_after_step`
        (cutting the file there; a torn last line, from a run killed mid-write before lines were
        atomic or by a crash of the machine, is dropped with a `RunWarning`)."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        keep = _resume_offset(path, resume_after_step) if resume_after_step is not None and path.exists() else 0
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        os.ftruncate(self._fd, keep)
        if keep and os.pread(self._fd, 1, keep - 1) != b"\n":
            os.write(self._fd, b"\n")  # a whole last record that lost only its line end

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(finite_or_none(record), allow_nan=False) + "\n").encode()  # strict JSON: NaN as null
        size = os.fstat(self._fd).st_size
        try:
            written = os.write(self._fd, line)
        except OSError:
            os.ftruncate(self._fd, size)
            raise
        if written != len(line):  # the disk filled mid-line: leave no torn record
            os.ftruncate(self._fd, size)
            raise OSError(errno.ENOSPC, f"wrote {written} of {len(line)} bytes of a metrics record", str(self.path))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _records(path: Path) -> Iterator[tuple[int, int, dict[str, Any] | None]]:
    """(line number, byte offset after the line, record or None if the line is torn) for every
    non-empty line; a bad line that is not the last raises a ValueError naming the file."""
    data = path.read_bytes()
    lines = data.splitlines(keepends=True)
    offset = 0
    for number, raw in enumerate(lines, 1):
        offset += len(raw)
        if not raw.strip():
            continue
        last = number == len(lines)
        try:
            record = json.loads(raw.decode("utf-8"))
            if not isinstance(record, dict):
                raise ValueError("not a JSON object")
        except (UnicodeDecodeError, ValueError) as err:
            if last:
                yield number, offset, None
                return
            raise ValueError(f"{path}:{number} is not a metrics record ({err}); the file is damaged before its "
                             "last line: move it away (or delete that line) and try again") from None
        yield number, offset, record


def _resume_offset(path: Path, resume_after_step: int) -> int:
    """Bytes of `path` to keep when resuming after `resume_after_step`."""
    keep = 0
    for number, offset, record in _records(path):
        if record is None:
            warnings.warn(f"{path}:{number}: dropped a torn last line (the run ended mid-write); the records "
                          "before it are kept", RunWarning, stacklevel=3)
            break
        if record.get("step", 0) > resume_after_step:
            break
        keep = offset
    return keep


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, in order (a torn last line is skipped; any other bad
    line is a ValueError naming the file and line)."""
    try:
        return [record for _, _, record in _records(path) if record is not None]
    except OSError as err:
        raise ValueError(f"cannot read metrics {path}: {err.strerror or err}") from None
