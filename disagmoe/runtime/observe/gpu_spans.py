"""Compute spans timed on the GPU with CUDA events, so a rank never waits for its GPU to time an op.

Synchronising after every op to time it keeps the host from queueing the next op while the GPU
runs this one, and any device-wide wait can deadlock against NCCL sends still waiting for their
peer. Instead each compute op records a start and an end event on the current stream; at the end
of the step (when the GPU has caught up anyway) the events give every op's interval on the GPU,
from its first kernel starting to its last ending (so a wait queued inside the op, e.g. for an
all-reduce on another stream, counts as part of it).
One anchor per step, an event recorded right after a synchronisation at the step's start with
the host's clock read at the same moment, places the intervals on the host's timeline, so they
sit in the same Chrome trace as the host-side send and wait spans.

    spans = GpuSpans(device)
    spans.begin_step()
    with spans.span("AttentionForward L1 mb0"):
        ...                                   # kernels queued, nothing waited for
    with spans.span("Recv combine L0 mb0", "gpu-wait"):
        ...                                   # a stream-ordered receive: the GPU's wait for it
    for name, category, start_us, duration_us in spans.collect():
        ...                                   # waits for the last op's end event
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class GpuSpans:
    """GPU execution intervals of the ops of one step (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"GpuSpans times CUDA streams; got device {device}")
        self.device = device
        self._anchor: torch.cuda.Event | None = None
        self._anchor_us = 0.0
        self._pending: list[tuple[str, str, torch.cuda.Event, torch.cuda.Event]] = []

    def begin_step(self) -> None:
        """Anchor the step: wait for the stream's queued work, then record an event and the time."""
        stream = torch.cuda.current_stream(self.device)
        stream.synchronize()
        self._anchor = torch.cuda.Event(enable_timing=True)
        self._anchor.record(stream)
        self._anchor_us = time.time_ns() / 1e3
        self._pending = []

    @contextmanager
    def span(self, name: str, category: str = "compute") -> Iterator[None]:
        if self._anchor is None:
            raise RuntimeError("GpuSpans.span before begin_step")
        stream = torch.cuda.current_stream(self.device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        try:
            yield
        finally:
            end = torch.cuda.Event(enable_timing=True)
            end.record(stream)
            self._pending.append((name, category, start, end))

    def collect(self) -> list[tuple[str, str, float, float]]:
        """(name, category, start_us on the host clock, GPU duration_us) of every span since
        `begin_step`, in order; waits for the last span's end event. Forgets them."""
        pending, self._pending = self._pending, []
        if not pending:
            return []
        pending[-1][3].synchronize()
        assert self._anchor is not None
        return [(name, category, self._anchor_us + self._anchor.elapsed_time(start) * 1e3,
                 start.elapsed_time(end) * 1e3) for name, category, start, end in pending]
