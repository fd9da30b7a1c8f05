"""Every two-rank gloo case of a test module in one pair of spawned processes: a spawned process
costs an interpreter and torch's import (seconds of CPU on 2 cores), more than a case's own work.
A module-scoped fixture runs the pair once (`run_pair`) and each test reads its case's outcome."""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp

Case = tuple[str, Callable[..., Any], tuple]  # (name, fn(rank, *args) at module level, args)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, cases: list[Case], results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        for name, fn, args in cases:
            try:
                results[(name, rank)] = ("ok", fn(rank, *args))
            except BaseException:
                results[(name, rank)] = ("error", traceback.format_exc())
                raise  # the pair stops here: the other rank would wait in this case's collectives
    finally:
        dist.destroy_process_group()


class Outcomes:
    def __init__(self, results: dict, failure: str | None) -> None:
        self.results, self.failure = results, failure

    def of(self, name: str, rank: int) -> Any:
        """Case `name`'s return value on `rank`; the case's failure (its traceback) fails the test."""
        if (name, rank) not in self.results:
            pytest.fail(f"case {name} did not run on rank {rank}: the pair stopped before it ({self.failure})")
        kind, value = self.results[(name, rank)]
        if kind == "error":
            pytest.fail(f"case {name} failed on rank {rank}:\n{value}")
        return value


def run_pair(cases: list[Case]) -> Outcomes:
    """Run every case, in order, on both ranks of one gloo group (two spawned processes)."""
    results = mp.Manager().dict()
    try:
        mp.spawn(_worker, args=(_free_port(), cases, results), nprocs=2)
        failure = None
    except Exception as err:  # a case raised (its traceback is in results) or a process died
        failure = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return Outcomes(dict(results), failure)
