"""The error a distributed run raises when a rank fails (light: the CLI imports it without torch)."""

from __future__ import annotations


class TrainingFailed(RuntimeError):
    """A rank failed mid-run; the message names it, says what happened and where to resume."""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(message)
        self.rank = rank
