"""One run per out_dir (disagmoe/runtime/run_lock.py): a live holder refuses, a dead one is taken over."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from disagmoe.runtime.failures import RunWarning
from disagmoe.runtime.run_lock import LOCK_FILE, RunLocked, _process_started, acquire, release, run_lock

HOLD = textwrap.dedent("""
    import sys, time
    from disagmoe.runtime.run_lock import acquire
    acquire(sys.argv[1])
    print("held", flush=True)
    time.sleep(60)
""")


@pytest.fixture
def holder(tmp_path):
    """Another process holding tmp_path's lock (killed at the end)."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def write_lock(tmp_path, **info):
    (tmp_path / LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "time": 0.0, **info}))


def test_a_second_run_is_refused_naming_the_holder(tmp_path, holder):
    with pytest.raises(RunLocked, match=rf"out_dir {tmp_path} is in use by the run of pid {holder.pid} on host "
                                        rf"{socket.gethostname()} \(started .* UTC\); wait for it to finish"):
        acquire(tmp_path)


def test_the_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path, holder):
    holder.kill()
    holder.wait()
    assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == holder.pid  # left behind
    with pytest.warns(RunWarning, match=rf"took over the lock of pid {holder.pid} .*no longer running"):
        with run_lock(tmp_path):
            assert json.loads((tmp_path / LOCK_FILE).read_text())["pid"] == os.getpid()
    assert not (tmp_path / LOCK_FILE).exists()


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    """The lock names a live pid (our parent) whose start time is not the recorded one."""
    write_lock(tmp_path, pid=os.getppid(), pid_started=_process_started(os.getppid()) + 1)
    with pytest.warns(RunWarning, match="took over the lock"):
        acquire(tmp_path)
    release(tmp_path)


def test_a_live_holder_recorded_in_the_file_is_refused_even_without_its_flock(tmp_path):
    write_lock(tmp_path, pid=os.getppid(), pid_started=_process_started(os.getppid()))
    with pytest.raises(RunLocked, match=rf"in use by the run of pid {os.getppid()}"):
        acquire(tmp_path)


def test_a_lock_of_another_host_is_never_taken_over(tmp_path):
    write_lock(tmp_path, pid=1, pid_started=1, host="elsewhere.example")
    with pytest.raises(RunLocked, match=rf"locked by pid 1 on host elsewhere.example .*another host .*if that run "
                                        rf"has ended, delete {tmp_path / LOCK_FILE}"):
        acquire(tmp_path)
    assert (tmp_path / LOCK_FILE).exists()


def test_holding_is_reentrant_in_a_process_and_the_last_release_removes_the_file(tmp_path):
    with run_lock(tmp_path):
        with run_lock(tmp_path):
            pass
        assert (tmp_path / LOCK_FILE).exists()
    assert not (tmp_path / LOCK_FILE).exists()
    with run_lock(tmp_path):  # free again
        pass
