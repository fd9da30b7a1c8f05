"""Per-step training metrics and the JSONL file they go to (one JSON object per line).

Every record has `step` (1-based: the number of optimizer steps taken) and, for training steps,
loss, ce, aux_loss, z_loss, lr, grad_norm, tokens, step_time_s, tokens_per_s, flops, mfu (null
without a hardware peak), `expert_load` (per MoE layer, per expert: token-expert assignments in
the step, summed over micro-batches) and `load_imbalance` (per MoE layer: max / mean of that
layer's loads). Steps with a validation pass also carry `val_loss`. Distributed modes add
`busy` (per group of ranks, e.g. A0 / E0 / colocated: compute time over the step's wall time).
`disagmoe plan --load-histogram metrics.jsonl` reads `expert_load`.

Legend: L MoE layers, E experts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch


def load_imbalance(load_LE: torch.Tensor) -> list[float]:
    """Per layer: the busiest expert's load over the mean load (1.0 is perfectly balanced)."""
    load = load_LE.double()
    mean = load.mean(dim=1)
    ratio = torch.where(mean > 0, load.max(dim=1).values / mean.clamp_min(1e-30), torch.ones_like(mean))
    return [float(r) for r in ratio]


def mfu(flops: float, seconds: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over the hardware peak; None without a peak."""
    if peak_flops is None or seconds <= 0:
        return None
    return flops / seconds / peak_flops


class MetricsLog:
    """Appends one JSON object per line to `path`, flushing each so a crash loses nothing."""

    def __init__(self, path: Path, resume_after_step: int | None = None):
        """Start a new file, or, when resuming, keep only the records up to `resume_after_step`."""
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if resume_after_step is not None and path.exists():
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_after_step]
        self._file = path.open("w")
        for record in kept:
            self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(record, allow_nan=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> MetricsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """All records of a metrics JSONL file, in order."""
    with path.open() as f:
        return [json.loads(line) for line in f if line.strip()]
