"""Fixtures of the transport tests: rank processes, spawned one per rank, reporting back."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch.multiprocessing as mp

from disagmoe.runtime.cluster.cluster import free_port


def run_ranks(ctx: Any, target: Callable, args_of: Callable[[int, Any], tuple], world: int, timeout_s: float,
              join_s: float = 10.0) -> tuple[dict[int, dict], list]:
    """Start `target(*args_of(rank, results))` for every rank (`ctx`: a spawn context); gather the
    `(rank, report)` pairs they put on `results` until all came or `timeout_s` passed; join (kill
    after `join_s`). Returns (reports by rank, the processes)."""
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=args_of(rank, results)) for rank in range(world)]
    for proc in procs:
        proc.start()
    got: dict[int, dict] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < world:
            rank, report = results.get(timeout=max(deadline - time.monotonic(), 0.1))
            got[rank] = report
    except queue.Empty:
        pass
    finally:
        for proc in procs:
            proc.join(timeout=join_s)
            if proc.is_alive():
                proc.kill()
    return got, procs


@pytest.fixture(scope="session")
def ranks() -> SimpleNamespace:
    """`ranks.free_port()`, `ranks.run(target, args_of, world, timeout_s, join_s)` (a spawn context's
    processes; `run_ranks`) and `ranks.ctx` for the barriers they share."""
    ctx = mp.get_context("spawn")
    return SimpleNamespace(ctx=ctx, free_port=free_port,
                           run=lambda *args, **kwargs: run_ranks(ctx, *args, **kwargs))
