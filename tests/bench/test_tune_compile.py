"""`tune-experts`' compile workers (`bench.tune_compile`): which launches they compile, how many start, that
spawned workers launch every job once between them, and that `tune` hands them each shape's candidates. On a CPU
the launches are fakes that write down what they were asked to run; the compiles themselves need a GPU."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagmoe.bench import tune_compile
from disagmoe.bench import tune_experts as tuner
from disagmoe.cli.app import app
from disagmoe.kernels.tile_configs import TileConfig

GIB = 1 << 30


def _tile(block_m: int, **fields) -> TileConfig:
    return TileConfig(block_m=block_m, block_n=128, block_k=64, **fields)


def test_the_jobs_are_each_roles_distinct_tiles_but_the_librarys_interleaved_by_role():
    a, b, c = _tile(64), _tile(128), _tile(256)
    library = dataclasses.replace(a, library=True)
    jobs = tune_compile.compile_jobs({"down": [a, b, a, library], "gate_up": [c]})
    assert jobs == [("down", a), ("gate_up", c), ("down", b)]  # a once; the library's tile compiles nothing
    assert tune_compile.compile_jobs({}) == []


@pytest.mark.parametrize("requested, jobs, operand_gib, free_gib, cpus, count", [
    (None, 100, 4, 140, 16, 8),   # a core each but the tuner's, at most MAX_WORKERS
    (None, 100, 4, 140, 4, 3),
    (None, 100, 30, 140, 16, 4),  # as many as the free memory holds, each with its operands and a context
    (None, 100, 200, 140, 16, 0),  # none fits: the tuner compiles as it goes
    (None, 1, 4, 140, 16, 0),     # one job is no work to spread
    (None, 100, 4, 140, 2, 0),    # one spare core: a single worker would only wait beside the tuner
    (1, 100, 4, 140, 16, 1),      # asked for one: one
    (12, 5, 4, 140, 16, 5),       # no more than the jobs
    (0, 100, 4, 140, 16, 0),
])
def test_the_worker_count_is_the_cores_the_jobs_and_the_gpu_memory_allow(requested, jobs, operand_gib, free_gib,
                                                                         cpus, count):
    assert tune_compile.worker_count(requested, jobs, operand_gib * GIB, free_gib * GIB, cpus=cpus) == count


def test_a_negative_worker_count_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="give 0"):
        tune_compile.worker_count(-1, 10, GIB, 100 * GIB)
    result = CliRunner().invoke(app, ["bench", "tune-experts", "--compile-workers", "-2"])
    assert result.exit_code != 0 and "give 0" in result.output and "Traceback" not in result.output


def fake_launches(log_dir: str, fail: str = "", die: str = "", hang: str = "") -> dict:
    """Launches that append what they run to a file of this process's own; `fail`'s raise (a tile that does not
    fit), `die`'s end the process, `hang`'s never return."""
    def launch(role: str, config: TileConfig) -> None:
        with open(Path(log_dir) / f"{os.getpid()}.log", "a") as f:
            f.write(f"{role} {config.block_m}\n")
        if role == die:
            os._exit(3)
        if role == hang:
            time.sleep(3600)
        if role == fail:
            raise RuntimeError("out of shared memory")

    return {role: functools.partial(launch, role) for role in ("down", "gate_up", "wgrad_w2")}


def _launched(log_dir: Path) -> tuple[list[str], int]:
    files = list(log_dir.glob("*.log"))
    return sorted(line for f in files for line in f.read_text().splitlines()), len(files)


@pytest.mark.slow
def test_spawned_workers_launch_every_job_once_between_them_and_tell_each_end(tmp_path):
    jobs = [(role, _tile(m)) for m in (16, 32, 64, 128) for role in ("down", "gate_up", "wgrad_w2")]
    told, lines = [], []
    ended = tune_compile.precompile(functools.partial(fake_launches, str(tmp_path), fail="gate_up"), jobs, 3,
                                    progress=lambda done, total: told.append((done, total)), log=lines.append)
    launched, processes = _launched(tmp_path)
    assert ended == len(jobs) and processes == 3  # a failing launch is the search's to skip, not the worker's
    assert launched == sorted(f"{role} {tile.block_m}" for role, tile in jobs)
    assert told[0] == (0, 12) and told[-1] == (12, 12) and len(told) == 13
    assert len(lines) == 1 and lines[0].startswith("  ran 12 of 12 candidate launches in 3 processes in ")
    assert "4 failed there (RuntimeError x4), as they will in the search" in lines[0] and "left" not in lines[0]


@pytest.mark.slow
def test_a_worker_that_dies_leaves_its_jobs_to_the_search_and_says_so(tmp_path):
    jobs = [("down", _tile(16)), ("down", _tile(32)), ("wgrad_w2", _tile(64)), ("wgrad_w2", _tile(128))]
    lines = []
    ended = tune_compile.precompile(functools.partial(fake_launches, str(tmp_path), die="wgrad_w2"), jobs, 2,
                                    log=lines.append)
    assert ended == 2  # each worker's down launch; both die at their wgrad_w2 one
    assert len(lines) == 1 and "ran 2 of 4" in lines[0] and "2 workers exited with codes [3, 3]" in lines[0]
    assert "the search compiles the 2 left as it times them" in lines[0]
    assert tune_compile.precompile(functools.partial(fake_launches, str(tmp_path)), [], 4) == 0


@pytest.mark.slow
def test_workers_past_the_deadline_are_stopped_and_leave_the_rest_to_the_search(tmp_path):
    jobs = [("down", _tile(16)), ("wgrad_w2", _tile(32)), ("down", _tile(64))]
    lines = []
    start = time.monotonic()
    ended = tune_compile.precompile(functools.partial(fake_launches, str(tmp_path), hang="wgrad_w2"), jobs, 2,
                                    log=lines.append, deadline_s=8.0)
    assert time.monotonic() - start < 30  # the hung worker was terminated, not waited for
    assert ended == 2 and "ran 2 of 3" in lines[0] and "the search compiles the 1 left" in lines[0]
    assert "exited" not in lines[0]  # stopped by the tuner is no death to report


def test_workers_that_cannot_start_leave_every_job_to_the_search(tmp_path):
    """A builder that does not pickle (a local function) fails at the first start: nothing is left running, the
    tuner is told, and the search compiles as it goes."""
    lines = []
    ended = tune_compile.precompile(lambda: fake_launches(str(tmp_path)), [("down", _tile(16)), ("down", _tile(32))], 2,
                                    log=lines.append)
    assert ended == 0 and len(lines) == 1 and "did not start" in lines[0] and not list(tmp_path.glob("*.log"))


def test_tune_hands_the_workers_each_shapes_candidates_and_a_builder_of_its_launches(monkeypatch):
    """With compile workers, `tune` measures its operands' memory, asks `worker_count`, and hands `precompile`
    every searched role's default and candidates and a picklable builder of the same launches; then it searches."""
    import pickle

    from disagmoe.bench.experts import SHAPES

    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner.torch.cuda, "memory_allocated", lambda device: GIB)  # before the launches' operands
    monkeypatch.setattr(tuner.torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(tuner.torch.cuda, "max_memory_allocated", lambda device: 5 * GIB)  # the build's peak
    monkeypatch.setattr(tuner.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(tuner.torch.cuda, "mem_get_info", lambda device: (100 * GIB, 141 * GIB))
    monkeypatch.setattr(tuner, "environment", lambda device: {"gpu": "test"})
    monkeypatch.setattr(tuner, "device_architecture", lambda device: "sm_90x132")
    monkeypatch.setattr(tuner, "_hopper", lambda: False)
    monkeypatch.setattr(tuner, "role_launches", lambda shape, device: {role: None for role in tuner.ROLES})
    asked, handed, order = [], [], []
    monkeypatch.setattr(tuner, "worker_count", lambda *args: asked.append(args) or 4)
    monkeypatch.setattr(tuner, "precompile", lambda build, jobs, workers, **kw: handed.append((build, jobs, workers))
                        or order.append("compile"))
    monkeypatch.setattr(tuner, "tune_roles", lambda launches, *a, **k: order.append("search") or {})
    lines = []
    tuner.tune([SHAPES["qwen3-30b-a3b"]], 0, 1, log=lines.append, roles=["down", "wgrad_w2"], compile_workers=None)
    (build, jobs, workers), = handed
    assert order == ["compile", "search"] and workers == 4
    assert {role for role, _ in jobs} == {"down", "wgrad_w2"}
    assert len(jobs) == len(tune_compile.compile_jobs(
        {role: [tuner.default_config(role), *tuner.candidates(role)] for role in ("down", "wgrad_w2")}))
    assert asked == [(None, len(jobs), 4 * GIB, 100 * GIB)]
    assert sorted(pickle.loads(pickle.dumps(build))()) == ["down", "wgrad_w2"]  # a worker's own launches
    assert any("compiling" in line and "4 processes" in line for line in lines)
    handed.clear()
    tuner.tune([SHAPES["qwen3-30b-a3b"]], 0, 1, log=lines.append, roles=["down"])  # the default: none
    assert handed == []
