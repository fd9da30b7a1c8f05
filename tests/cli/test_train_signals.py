"""`disagmoe train` stopped by SIGTERM while Ray starts, and joining an address that does not answer
(issue 23): bounded, one line, nothing left running. Subprocesses: signals and processes are the point."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagmoe.cli.app import app

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/tiny-cpu.yaml")


def descendants(pid: int) -> dict[int, str]:
    """{pid: command name} of every process below `pid` (read from /proc)."""
    children: dict[int, list[int]] = {}
    names = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        child = int(stat.parent.name)
        names[child] = text[text.index("(") + 1:text.rindex(")")]
        children.setdefault(int(text.rpartition(")")[2].split()[1]), []).append(child)
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = names[child]
            todo.append(child)
    return found


def running(pid: int) -> bool:
    """Whether `pid` is a process that has not exited (a zombie has)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except OSError:
        return False


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_address_that_refuses_fails_in_one_line_within_its_bound(tmp_path):
    start = time.monotonic()
    result = CliRunner().invoke(app, ["train", "--config", CONFIG, "--out-dir", str(tmp_path), "steps=2",
                                      f"ray_address=127.0.0.1:{closed_port()}", "ray_connect_timeout_s=3"])
    assert result.exit_code == 2, result.output
    assert time.monotonic() - start < 15
    assert result.stderr.count("\n") == 1 and "cannot reach it within ray_connect_timeout_s=3" in result.stderr


def ray_folders(pids) -> set[str]:
    """The run's own Ray temp folders (`/tmp/disagmoe-ray-*`), named on its processes' command lines
    (other runs on the machine make theirs meanwhile: a glob of /tmp would count them)."""
    folders = set()
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        folders.update(re.findall(r"/tmp/disagmoe-ray-[A-Za-z0-9_]+", cmdline))
    return folders


@pytest.mark.slow
def test_sigterm_during_start_up_exits_130_with_nothing_left_running(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "disagmoe", "train", "--config", CONFIG, "--out-dir",
                             str(tmp_path), "steps=50", "eval_every=0"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    seen: dict[int, str] = {}
    deadline = time.monotonic() + 120
    while not any(name in ("raylet", "gcs_server") for name in seen.values()):  # Ray is starting
        assert proc.poll() is None and time.monotonic() < deadline, "Ray never started"
        seen.update(descendants(proc.pid))
        time.sleep(0.05)
    folders = ray_folders(seen)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    assert proc.returncode == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("stopped: interrupted (SIGTERM")
    deadline = time.monotonic() + 15
    while [p for p in seen if running(p)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not {p: seen[p] for p in seen if running(p)}, "processes of the run outlived it"
    assert folders and not [f for f in folders if Path(f).exists()], f"its Ray folder is left ({folders})"


@pytest.mark.slow
def test_a_second_train_on_the_folder_of_a_running_one_is_refused(tmp_path):
    """Two real `train` runs on one out_dir: while the first trains, the second exits 2 in one line
    naming the first's pid; the first, stopped by SIGTERM afterwards, kept its folder to itself."""
    first = subprocess.Popen([sys.executable, "-m", "disagmoe", "train", "--config", CONFIG, "--out-dir",
                              str(tmp_path), "steps=100000", "mode=single", "eval_every=0"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "metrics.jsonl").exists():  # the first holds the lock and trains
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        second = subprocess.run([sys.executable, "-m", "disagmoe", "train", "--config", CONFIG, "--out-dir",
                                 str(tmp_path), "steps=30", "mode=single", "eval_every=0", "seed=1"],
                                capture_output=True, text=True, timeout=120)
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert second.returncode == 2, second.stderr
    assert len(second.stderr.strip().splitlines()) == 1
    assert f"is in use by the run of pid {first.pid}" in second.stderr
    assert first.returncode == 130, err
    assert not (tmp_path / "earlier").exists() and not (tmp_path / "run.lock").exists()
