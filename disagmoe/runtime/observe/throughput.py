"""The one definition of a run's tokens/s: the tokens of the training steps this process ran
over those steps' own time (`step_time_s` of each metrics record; validation, checkpoints and
start-up excluded). The progress bar shows it as the run goes and the summary reports its final
value, so the two agree at the end. Torch-free (the CLI imports it before training starts)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class Throughput:
    """Running tokens/s over the metrics records `add` has seen."""

    def __init__(self) -> None:
        self.tokens = 0
        self.seconds = 0.0

    def add(self, record: Mapping[str, Any]) -> None:
        """Count one training step's record (its `tokens` and `step_time_s`)."""
        self.tokens += record["tokens"]
        self.seconds += record["step_time_s"]

    @property
    def tokens_per_s(self) -> float | None:
        """None before a step with a measured time."""
        return self.tokens / self.seconds if self.seconds > 0 else None
