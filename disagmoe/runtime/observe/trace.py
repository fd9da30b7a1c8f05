"""Spans of what every rank did, in Chrome trace format (open trace.json in Perfetto or chrome://tracing).

A rank records one span per schedule op: `compute` (forward, backward, loss, optimizer), `send`
(posting a message) or `wait` (a receive blocking, the end-of-step wait for sends); on a GPU also
`gpu-wait`, the time its stream stood still for a received message (CUDA events around the
receive: near zero when the message was there first). Timestamps are
wall-clock microseconds (`time.time_ns`), comparable across processes of one host. On a GPU a
compute span is the op's execution on the GPU, timed with CUDA events (`runtime.observe.gpu_spans`); on a
CPU it is the op's wall time. In the file,
pid = rank (named after its role) and each span's name is its op.

A rank's busy fraction in a step is its compute time over the step's wall time; a group's is the
mean over its ranks. Its wait fractions, per received payload, are its `gpu-wait` time for that
payload over the step's wall time (`wait_fractions`: e.g. the attention GPUs' wait for the
experts' returned rows, `combine`).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CATEGORIES = ("compute", "send", "wait", "gpu-wait")


class SpanRecorder:
    """Collects (name, category, start_us, duration_us) spans of one rank."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.spans: list[tuple[str, str, float, float]] = []
        self.compute_s = 0.0
        self.gpu_wait_s: dict[str, float] = defaultdict(float)  # payload -> seconds (`gpu-wait` spans)

    @contextmanager
    def span(self, name: str, category: str) -> Iterator[None]:
        assert category in CATEGORIES, category
        start = time.time_ns()
        try:
            yield
        finally:
            duration_ns = time.time_ns() - start
            if category == "compute":
                self.compute_s += duration_ns / 1e9
            if self.enabled:
                self.spans.append((name, category, start / 1e3, duration_ns / 1e3))

    def add(self, name: str, category: str, start_us: float, duration_us: float,
            busy_us: float | None = None) -> None:
        """A span timed elsewhere (e.g. on the GPU, `runtime.observe.gpu_spans`), counted like `span`'s;
        `busy_us`: a compute span's time less the GPU waits inside it (default: all of it)."""
        assert category in CATEGORIES, category
        if category == "compute":
            self.compute_s += (duration_us if busy_us is None else busy_us) / 1e6
        elif category == "gpu-wait":  # named 'Recv <payload> L.. mb..'
            self.gpu_wait_s[name.split()[1]] += duration_us / 1e6
        if self.enabled:
            self.spans.append((name, category, start_us, duration_us))

    def add_gpu_spans(self, spans: Sequence[tuple[str, str, float, float]]) -> None:
        """A step's GPU spans in the order they ended (`GpuSpans.collect`). A gpu-wait span that
        started inside the compute span ending next (pair rows' combine waits inside its op) is
        that op's waiting, not its busy time, so it is taken off the op's compute."""
        waits: list[tuple[float, float]] = []  # gpu-wait spans since the last compute span
        for name, category, start_us, duration_us in spans:
            busy_us = duration_us
            if category == "gpu-wait":
                waits.append((start_us, duration_us))
            elif category == "compute":
                busy_us -= sum(d for s, d in waits if s >= start_us)
                waits = []
            self.add(name, category, start_us, duration_us, busy_us=max(busy_us, 0.0))

    def drain(self) -> tuple[list[tuple[str, str, float, float]], float]:
        """The spans and compute seconds since the last drain (then forgets them; `drain_waits`
        for the GPU waits)."""
        spans, compute_s = self.spans, self.compute_s
        self.spans, self.compute_s = [], 0.0
        return spans, compute_s

    def drain_waits(self) -> dict[str, float]:
        """GPU seconds waited per received payload since the last call (then forgets them)."""
        waits, self.gpu_wait_s = dict(self.gpu_wait_s), defaultdict(float)
        return waits


def busy_fractions(compute_s: Sequence[float], step_s: float, group_of_rank: Sequence[str]) -> dict[str, float]:
    """Per group: the mean over its ranks of compute time / step wall time."""
    per_group: dict[str, list[float]] = defaultdict(list)
    for rank, seconds in enumerate(compute_s):
        per_group[group_of_rank[rank]].append(min(seconds / step_s, 1.0) if step_s > 0 else 0.0)
    return {group: sum(values) / len(values) for group, values in sorted(per_group.items())}


def wait_fractions(waits_s: Sequence[Mapping[str, float]], step_s: float,
                   group_of_rank: Sequence[str]) -> dict[str, dict[str, float]]:
    """Per group and received payload: the mean over its ranks of GPU wait time / step wall time
    (ranks that receive no such payload count as 0)."""
    per_group: dict[str, list[Mapping[str, float]]] = defaultdict(list)
    for rank, waits in enumerate(waits_s):
        per_group[group_of_rank[rank]].append(waits)
    out: dict[str, dict[str, float]] = {}
    for group, ranks in sorted(per_group.items()):
        payloads = sorted({p for waits in ranks for p in waits})
        out[group] = {p: sum(min(w.get(p, 0.0) / step_s, 1.0) if step_s > 0 else 0.0 for w in ranks) / len(ranks)
                      for p in payloads}
    return out


TRACK = {"send": 0, "wait": 0, "compute": 1, "gpu-wait": 2}  # tid: the host's messages, compute, GPU waits
TRACK_NAMES = {0: "messages (host)", 1: "compute", 2: "waits (GPU)"}


def chrome_trace(spans_by_rank: Mapping[int, Sequence[tuple[str, str, float, float]]],
                 rank_names: Mapping[int, str], device: str | None = None) -> dict[str, Any]:
    """The Chrome trace-event JSON object: one complete ('X') event per span, pid = rank, three
    tracks per rank (tid 0: sends and waits on the host; tid 1: compute, on a GPU its execution,
    which lags the host and would overlap the host's spans on one track; tid 2: the GPU's waits
    for received messages). `device` (the run's: cpu or cuda) goes in `otherData`, for
    `roofline --compare` to refuse pricing a CPU trace as a GPU."""
    events: list[dict[str, Any]] = []
    for rank in sorted(rank_names):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
                       "args": {"name": f"rank {rank} ({rank_names[rank]})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for tid, track in TRACK_NAMES.items():
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": track}})
    for rank, spans in spans_by_rank.items():
        for name, category, start_us, duration_us in spans:
            events.append({"name": name, "cat": category, "ph": "X", "ts": start_us, "dur": duration_us,
                           "pid": rank, "tid": TRACK[category]})
    return {"traceEvents": events, "displayTimeUnit": "ms", **({"otherData": {"device": device}} if device else {})}


def write_chrome_trace(path: Path, spans_by_rank: Mapping[int, Sequence[tuple[str, str, float, float]]],
                       rank_names: Mapping[int, str], device: str | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(json.dumps(chrome_trace(spans_by_rank, rank_names, device)))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # no half-written trace left behind
        raise
    return path
