"""A per-rank watchdog: when one schedule op runs past its limit, say what the rank is stuck in.

A rank blocked in a CUDA synchronisation or inside an NCCL call never reaches a transport
timeout and cannot answer Ray, so the driver only learns that the step overran. The watchdog is a
daemon thread that notices an op running longer than `limit_s` (the receive timeout: no single
op should take longer) and writes, once per op, the op's name and every thread's Python stack to
the rank's stderr, which Ray forwards to the driver's console. Blocking torch calls release the
GIL, so the thread can still run.

    watchdog = OpWatchdog("rank 1 (E0.0)", limit_s=120)
    with watchdog.op("ExpertForward L3 mb1"):
        ...
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO


class OpWatchdog:
    """Reports an op that runs longer than `limit_s` (see the module docstring)."""

    def __init__(self, who: str, limit_s: float, out: TextIO | None = None) -> None:
        if limit_s <= 0:
            raise ValueError(f"limit_s must be positive, got {limit_s}")
        self.who, self.limit_s = who, limit_s
        self.out = out
        self.reports: list[str] = []
        self._current: tuple[str, float] | None = None
        self._reported: tuple[str, float] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="disagmoe-op-watchdog", daemon=True)
        self._thread.start()

    @contextmanager
    def op(self, name: str) -> Iterator[None]:
        self._current = (name, time.monotonic())
        try:
            yield
        finally:
            self._current = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        period_s = min(1.0, self.limit_s / 4)
        while not self._stop.wait(period_s):
            current = self._current
            if current is None or current is self._reported:
                continue
            name, started = current
            elapsed_s = time.monotonic() - started
            if elapsed_s > self.limit_s:
                self._reported = current
                self._report(name, elapsed_s)

    def _report(self, name: str, elapsed_s: float) -> None:
        report = (f"[disagmoe watchdog] {self.who}: '{name}' has run {elapsed_s:.1f} s "
                  f"(limit {self.limit_s:g} s, the receive timeout); where every thread is:\n"
                  + stacks_text(skip=threading.get_ident()))
        self.reports.append(report)
        out = self.out if self.out is not None else sys.stderr
        out.write(report)
        out.flush()


def stacks_text(skip: int | None = None) -> str:
    """Every Python thread's stack (except thread `skip`), innermost call last."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == skip:
            continue
        parts.append(f"  thread {names.get(ident, ident)}:\n")
        parts.extend("    " + line.replace("\n", "\n    ").rstrip() + "\n" for line in traceback.format_stack(frame))
    return "".join(parts)
