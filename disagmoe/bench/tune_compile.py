"""Compile a tune's candidate tiles in worker processes before the tuner times them.

A candidate's first launch compiles its kernel (Triton or Gluon: seconds of one CPU core each), and a first
`tune-experts` spends most of its minutes there, one candidate after another (session 47 on an H200: the Qwen3
config's six GEMMs took 50 s with every kernel in Triton's cache; four of them had not finished in 165 s without
it). Here worker processes launch every candidate once, each its own share, so the compiled kernels land in
Triton's on-disk cache (keyed by source, specialisation and target: the workers launch on operands of the tuner's
shapes, so their keys are the tuner's); the tuner's own first launch of a candidate then loads it. Nothing a
worker runs is timed or kept: the timing stays in the one process, on a GPU no worker is using any more.
"""

from __future__ import annotations

import collections
import multiprocessing
import multiprocessing.queues
import os
import signal
import time
from collections.abc import Callable

import torch

from disagmoe.kernels.tile_configs import TileConfig

# a worker's CUDA context (about 0.5 GiB) and the new outputs some launches allocate (the library's, the plain row
# GEMMs': up to a GiB at the lease's shapes), beside the peak its operands' build reached (`tune` measures it)
WORKER_OVERHEAD_BYTES = 3 << 30
MAX_WORKERS = 8  # compiles are one core each; more workers than this mostly queue on the GPU's memory
# how long the workers may take in all before the tuner stops them and compiles the rest as it times them (a first
# tune's compiles take minutes one at a time; a worker that hangs must not hold the tune)
DEADLINE_S = 900.0


def compile_jobs(candidates: dict[str, list[TileConfig]]) -> list[tuple[str, TileConfig]]:
    """The (role, tile) launches that compile something: every role's distinct tiles but the library's
    (`torch._grouped_mm` compiles nothing), the roles interleaved so each worker's share mixes them."""
    per_role = [list(dict.fromkeys(c for c in configs if not c.library)) for configs in candidates.values()]
    roles = list(candidates)
    jobs = []
    for i in range(max((len(c) for c in per_role), default=0)):
        jobs += [(role, configs[i]) for role, configs in zip(roles, per_role, strict=True) if i < len(configs)]
    return jobs


def check_requested(requested: int | None) -> None:
    """ValueError with the choices unless `requested` is None (the default count) or a count of 0 or more."""
    if requested is not None and requested < 0:
        raise ValueError(f"--compile-workers {requested}: give 0 (compile as each candidate is first timed) or more, "
                         "or leave it out for one a CPU core")


def worker_count(requested: int | None, jobs: int, operand_bytes: int, free_bytes: int,
                 cpus: int | None = None) -> int:
    """How many workers to start: `requested` (None: one a CPU core but the tuner's own, at most `MAX_WORKERS`),
    no more than there are jobs, and only as many as the GPU's free memory holds, each with its own copy of the
    launches' operands (`operand_bytes`) and a context. 0 or 1 job: none (the tuner compiles as it goes)."""
    check_requested(requested)
    wanted = min(MAX_WORKERS, max((cpus or len(os.sched_getaffinity(0))) - 1, 0)) if requested is None else requested
    fits = free_bytes // (operand_bytes + WORKER_OVERHEAD_BYTES)
    count = min(wanted, jobs, fits)
    return count if count > 1 or (count == 1 and requested is not None) else 0


def _launch_share(build_launches: Callable[[], dict], share: list[tuple[str, TileConfig]],
                  done: multiprocessing.queues.SimpleQueue) -> None:
    """A worker: build the launches (its own operands), launch each of its share's tiles once, and tell `done` as
    each one ends: "" where it ran, else its error's type. A tile that does not fit (shared memory, registers) fails
    here as it would in the search, which then skips it. Stops early where the tuner is gone (killed alone): its
    operands are no GPU memory for the next command to find taken."""
    launches = build_launches()
    parent = multiprocessing.parent_process()
    for role, config in share:
        if parent is not None and not parent.is_alive():
            return
        error = ""
        try:
            launches[role](config)
        except Exception as err:  # the search meets the same failure and logs it
            error = type(err).__name__
        finally:
            done.put(error)
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def precompile(build_launches: Callable[[], dict], jobs: list[tuple[str, TileConfig]], workers: int,
               progress: Callable[[int, int], None] = lambda done, total: None,
               log: Callable[[str], None] = print, deadline_s: float = DEADLINE_S) -> int:
    """Launch every job once, spread over `workers` spawned processes, each calling the picklable
    `build_launches()` for its own operands; `progress` (jobs done, in all) as each ends, and a line at the end: how
    many compiled in how long, the launches that failed by their error (a tile that does not fit, where the search
    will skip it too), the workers that died. Returns how many ended. Jobs a worker left (it died, or the workers
    ran past `deadline_s` and were stopped) are the search's to compile, as without workers."""
    if workers < 1 or not jobs:
        return 0
    context = multiprocessing.get_context("spawn")  # a fresh CUDA context each; a forked one cannot
    done = context.SimpleQueue()  # written through at each put: a worker that dies has told every launch it ended
    processes = [context.Process(target=_launch_share, args=(build_launches, jobs[i::workers], done), daemon=True)
                 for i in range(workers)]
    try:
        for process in processes:
            process.start()
    except Exception as err:  # e.g. a builder that does not pickle: the search compiles as it goes, as without workers
        _stop([p for p in processes if p.pid is not None], 0)
        log(f"  compile workers did not start ({type(err).__name__}: {err}); the search compiles each candidate as it "
            "times it")
        return 0
    start, ended, errors = time.monotonic(), 0, collections.Counter()
    progress(0, len(jobs))
    try:
        while ended < len(jobs) and time.monotonic() - start < deadline_s:
            if not done.empty():
                error = done.get()
                ended += 1
                if error:
                    errors[error] += 1
                progress(ended, len(jobs))
            elif any(p.is_alive() for p in processes):
                time.sleep(0.05)
            elif done.empty():  # every worker has ended and all they told is read
                break
    finally:
        _stop(processes, 30.0 if ended == len(jobs) else 5.0)
    failed = sorted(errors.items(), key=lambda item: -item[1])
    died = [p.exitcode for p in processes if p.exitcode not in (0, -signal.SIGTERM)]
    log(f"  ran {ended} of {len(jobs)} candidate launches in {workers} processes in {time.monotonic() - start:.0f} s"
        + (f"; {sum(errors.values())} failed there ({', '.join(f'{name} x{n}' for name, n in failed)}), as they will "
           "in the search" if failed else "")
        + (f"; {len(died)} workers exited with codes {died}" if died else "")
        + (f"; the search compiles the {len(jobs) - ended} left as it times them" if ended < len(jobs) else ""))
    return ended


def _stop(processes: list[multiprocessing.process.BaseProcess], grace_s: float) -> None:
    """Join the processes within `grace_s` in all (a worker ends after its last launch's synchronise), then terminate
    what is left: a worker that hangs never holds the tune."""
    end = time.monotonic() + grace_s
    for process in processes:
        process.join(timeout=max(end - time.monotonic(), 0.0))
        if process.is_alive():
            process.terminate()
            process.join()
