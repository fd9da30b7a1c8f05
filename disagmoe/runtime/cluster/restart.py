"""Automatic restart's pieces: the fault a test injects, and the line a restart prints.

`DistributedTrainer.run` restarts a run whose rank died or hung (`TrainingFailed`) up to
`TrainConfig.max_restarts` times: it tears the actor group down (the actors are killed, and
their process groups, NCCL communicators and transport buffers die with their processes),
starts new actors and resumes from the newest complete checkpoint (from step 0 without one).

`fault_injection: {rank: r, step: s}` makes the driver SIGKILL rank r's actor process just after
it has handed every rank step s: a real process death in the middle of a step, which the peers
notice through their transport and the driver through Ray. It fires once per run: the driver
writes `<out_dir>/fault_injection.json` before killing, and a restart or a `resume=true` run of
the same out_dir finds it there and does not fire again (a fresh run, `resume=false`, removes it).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from disagmoe.config import FaultInjection
from disagmoe.runtime.failures import TrainingFailed

FAULT_RECORD = "fault_injection.json"


def restart_line(attempt: int, limit: int, failure: TrainingFailed, checkpoint: Path | None) -> str:
    """What a restart prints (one line): which attempt, where it resumes, what failed."""
    where = f"from {checkpoint}" if checkpoint is not None else "from step 0 (no complete checkpoint yet)"
    return f"restart {attempt} of {limit} (max_restarts={limit}) {where}, with new actors, after: {failure.report}"


class Fault:
    """A configured `FaultInjection` and its record in out_dir."""

    def __init__(self, spec: FaultInjection | None, out_dir: Path, fresh_run: bool) -> None:
        self.spec = spec
        self.record = Path(out_dir) / FAULT_RECORD
        if fresh_run:
            self.record.unlink(missing_ok=True)

    def due(self, step: int) -> bool:
        """Whether the 1-based `step` about to run is the one to fail (and it has not fired yet)."""
        return self.spec is not None and self.spec.step == step and not self.record.exists()

    def arm(self, actor: Any) -> Callable[[], None]:
        """Record that the fault fires, then return what kills `actor`'s process (SIGKILL: the
        driver calls it once the step is handed out to every rank)."""
        assert self.spec is not None
        info = ray.get(actor.info.remote())
        pid, node_id = info["pid"], ray.get(actor.run.remote(_node_id))
        tmp = self.record.with_name(f".{self.record.name}.tmp")
        tmp.write_text(json.dumps({"rank": self.spec.rank, "step": self.spec.step, "pid": pid,
                                   "node_ip": info["node_ip"], "time": time.time()}) + "\n")
        os.replace(tmp, self.record)
        return lambda: sigkill_on(node_id, pid)


def sigkill_on(node_id: str, pid: int) -> None:
    """SIGKILL process `pid` of Ray node `node_id`: directly on the driver's node, else by a task there."""
    if node_id == ray.get_runtime_context().get_node_id():
        os.kill(pid, signal.SIGKILL)
        return
    strategy = NodeAffinitySchedulingStrategy(node_id, soft=False)
    ray.get(ray.remote(num_cpus=0, scheduling_strategy=strategy)(_sigkill).remote(pid))


def _node_id(worker: Any) -> str:
    return ray.get_runtime_context().get_node_id()


def _sigkill(pid: int) -> None:
    os.kill(pid, signal.SIGKILL)
