"""Why a run ended early (a rank failed, or the user stopped it) and what went wrong without
ending it (`RunWarning`). Light: the CLI imports it without torch."""

from __future__ import annotations

import warnings


class RunWarning(UserWarning):
    """Something the user should know that does not stop the run (a torn metrics line repaired,
    a trace that could not be written); the CLI prints it as one `warning:` line."""


warnings.filterwarnings("always", category=RunWarning)  # every occurrence, not once per code line


class TrainingFailed(RuntimeError):
    """A rank failed mid-run; the message names it, says what happened and where to resume
    (`report`: the message without where to resume, for an automatic restart's line)."""

    def __init__(self, rank: int, message: str, report: str | None = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.report = message if report is None else report


class TrainingInterrupted(RuntimeError):
    """SIGINT / SIGTERM stopped the run after a step; its checkpoint is where to resume from."""

    def __init__(self, signal_name: str, step: int, checkpoint: object) -> None:
        resume = ("no checkpoint was written yet; start it again" if checkpoint is None
                  else f"checkpoint {checkpoint}; continue with resume=true (same out_dir)")
        super().__init__(f"{signal_name} after step {step}: {resume}")
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint


class TrainingDiverged(RuntimeError):
    """A step's loss or gradient norm was not finite: the run stopped before checkpointing it
    (the message names the step, the setting most likely at fault and the last good checkpoint)."""

    def __init__(self, step: int, message: str) -> None:
        super().__init__(message)
        self.step = step
