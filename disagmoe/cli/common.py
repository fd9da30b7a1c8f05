"""Shared CLI plumbing: the one error path, JSON output, the consoles.

Every user-facing failure is printed literally (never parsed as rich markup: a path, a YAML key or
a worker's report may hold `[/...]`) on stderr and ends with a distinct exit code:

    2    bad input: a config, a flag value, a file that cannot be read or written, a size out of range
    1    the run failed: a rank died or hung, a loss or gradient norm was not finite, an I/O error mid-run
    130  interrupted: Ctrl-C or SIGTERM (the run stops after a step with a checkpoint)

A usage error (a bad flag value, an unknown option) is one line too, not click's usage block, and
a `RunWarning` (the run goes on) is one `warning:` line.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import sys
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import typer
from pydantic import ValidationError
from rich.console import Console
from rich.text import Text
from typer.core import TyperGroup

from disagmoe.config import TrainConfig
from disagmoe.model_ref import load_model

from disagmoe import compact
from disagmoe.config import format_validation_error
from disagmoe.runtime.failures import RunWarning, TrainingDiverged, TrainingFailed, TrainingInterrupted
from disagmoe.safe_io import finite_or_none

# Reports are wide tables: when the output is not a terminal (a pipe, a log file, CI), do not
# squeeze them into rich's default 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

# click's exceptions, from the click typer runs on (recent typer vendors it as typer._click).
UsageError = typer.BadParameter.__mro__[1]
_NoArgsIsHelp = getattr(sys.modules[UsageError.__module__], "NoArgsIsHelpError", ())

EXIT_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130

F = TypeVar("F", bound=Callable[..., Any])


def literal(text: object, style: str | None = None) -> Text:
    """`text` as rich renders it verbatim: no markup, no emoji codes."""
    return Text(str(text), style=style or "")


def print_error(message: object, prefix: str = "error:", style: str = "bold red") -> None:
    """`prefix message` on stderr, printed literally, not wrapped."""
    err_console.print(Text.assemble((prefix, style), " ", str(message)), highlight=False, soft_wrap=True)


def user_errors(fn: F) -> F:
    """The one error path of a command (module docstring): a message line, then the exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings(), sigterm_as_interrupt():
                warnings.showwarning = _run_warnings_as_lines(warnings.showwarning)
                return fn(*args, **kwargs)
        except typer.BadParameter as err:
            print_error(err.format_message())
        except ValidationError as err:  # a config built in code, e.g. from flags: one line, not pydantic's block
            print_error(format_validation_error(err, err.title))
        except (ValueError, FileNotFoundError) as err:
            print_error(err)
        except OverflowError as err:  # a flag no config bound covers (configs bound every size)
            print_error(f"a number given is too large to compute with ({err}); check the sizes")
        except (TrainingFailed, TrainingDiverged) as err:
            print_error(err, "training failed:")
            raise typer.Exit(EXIT_FAILED) from None
        except TrainingInterrupted as err:
            print_error(err, "training stopped:", "bold yellow")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except KeyboardInterrupt as err:  # Ray re-raises a signal inside its waits without the message
            why = str(err) or (_received[-1] if _received else "Ctrl-C")
            _received.clear()
            print_error(f"interrupted ({why}); nothing of this run is left running", "stopped:", "bold yellow")
            raise typer.Exit(EXIT_INTERRUPTED) from None
        except OSError as err:  # mid-run: a full disk, a vanished mount
            where = f"{err.filename}: " if err.filename else ""
            print_error(f"{where}{err.strerror or err}", "I/O error:")
            raise typer.Exit(EXIT_FAILED) from None
        raise typer.Exit(EXIT_INPUT)

    return wrapper  # type: ignore[return-value]


_received: list[str] = []  # the SIGTERMs `sigterm_as_interrupt` turned into KeyboardInterrupt


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Inside the block SIGTERM raises KeyboardInterrupt('SIGTERM') as Ctrl-C does, so a
    scheduler's stop in any phase (start-up included) unwinds through every cleanup and exits 130,
    instead of the default action killing the process mid-start (main thread only; the step loop
    installs its own graceful handler)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: object) -> None:
        _received.append("SIGTERM")
        raise KeyboardInterrupt("SIGTERM")

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_warnings_as_lines(show_other: Callable[..., None]) -> Callable[..., None]:
    """A `warnings.showwarning` printing a `RunWarning` as one literal `warning:` line."""

    def show(message: Warning | str, category: type[Warning], *args: Any, **kwargs: Any) -> None:
        if issubclass(category, RunWarning):
            print_error(message, "warning:", "bold yellow")
        else:
            show_other(message, category, *args, **kwargs)

    return show


class OneLineUsage(UsageError):  # type: ignore[misc, valid-type]
    """A usage error shown as one line: `error: <what>, see '<command> --help'`."""

    def __init__(self, err: Any) -> None:
        super().__init__(err.format_message(), None)
        self.command_path = err.ctx.command_path if err.ctx is not None else None

    def show(self, file: Any = None) -> None:
        hint = f" (see '{self.command_path} --help')" if self.command_path else ""
        print_error(f"{self.format_message()}{hint}")


class OneLineErrors(TyperGroup):
    """The top-level group: click's usage errors (bad flag values, unknown options or commands,
    in any subcommand) become one line; `--help` and a bare command still print the help."""

    def make_context(self, info_name: Any, args: list[str], *rest: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(info_name, bare_flag_values(list(args)), *rest, **kwargs)
        except UsageError as err:
            raise _one_line(err) from None

    def invoke(self, ctx: Any) -> Any:
        try:
            return super().invoke(ctx)
        except UsageError as err:
            raise _one_line(err) from None


# Options that were bare boolean flags and now take a value: the bare flag still means this value.
BARE_FLAG_VALUES = {"--offload-optimizer": "on"}


def bare_flag_values(args: list[str]) -> list[str]:
    """`args` with each bare old-style flag of `BARE_FLAG_VALUES` (last, or another option next)
    given its value: `plan --offload-optimizer --json` still means `--offload-optimizer on --json`."""
    out = []
    for i, arg in enumerate(args):
        out.append(arg)
        if arg in BARE_FLAG_VALUES:
            if i + 1 == len(args) or args[i + 1].startswith("-"):  # another option next: none was given
                out.append(BARE_FLAG_VALUES[arg])
    return out


def _one_line(err: Any) -> Any:
    return err if isinstance(err, (OneLineUsage, _NoArgsIsHelp)) else OneLineUsage(err)


def print_json(data: Any) -> None:
    """Machine output: strict JSON on stdout (NaN and infinities as null; lists of numbers on one
    line: `compact`), nothing else."""
    sys.stdout.write(compact.to_json(finite_or_none(data)))


def auto_split(cfg: TrainConfig, capacity_bytes: float | None = None) -> tuple[TrainConfig, str | None]:
    """`micro_batches: auto` chosen for the config's mode on this host's device (or on
    `capacity_bytes`, a device elsewhere), and the line saying what and why
    (`runtime.training.micro_batches`); a number given stays, with no line."""
    if cfg.micro_batches != "auto":
        return cfg, None
    model_cfg = load_model(cfg.model)
    if cfg.mode == "single":
        from disagmoe.runtime.training.trainer import resolve_device, resolve_single_micro_batches

        device = resolve_device(cfg.device) if capacity_bytes is None else None
        cfg, choice = resolve_single_micro_batches(cfg, model_cfg, device, capacity_bytes)
    else:
        from disagmoe.runtime.cluster.driver import resolve_distributed_micro_batches

        cfg, choice = resolve_distributed_micro_batches(cfg, model_cfg, capacity_bytes)
    return cfg, choice.note()
