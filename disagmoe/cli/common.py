"""Shared CLI plumbing: one-line user errors, JSON output, the console."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

# Reports are wide tables: when the output is not a terminal (a pipe, a log file, CI), do not
# squeeze them into rich's default 80 columns.
console = Console(width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True, width=None if sys.stderr.isatty() else 160)

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Turn user mistakes (ValueError, missing files) into one red line and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError, typer.BadParameter) as err:
            message = err.format_message() if isinstance(err, typer.BadParameter) else str(err)
            err_console.print(f"[bold red]error:[/] {message}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper  # type: ignore[return-value]


def print_json(data: Any) -> None:
    """Machine output: plain JSON on stdout, nothing else."""
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
