"""One run per output folder: `<out_dir>/run.lock`, held for the life of a run.

    with run_lock(out_dir):      # RunLocked (a ValueError) if another live run holds it
        ...                      # the run; the lock file goes when the block ends

The lock is an exclusive `flock` on the file (released by the kernel when the holder dies, however
it dies) and, inside it, the holder's pid, host, process start time and the lock's time. The
content decides what a free flock does not: a lock file naming another host is refused (its
flock may not reach across a network file system; the message says which file to delete once
that run is gone), one naming a live process of this host whose start time matches is refused,
one naming a dead process (or a reused pid: another start time) is taken over with a warning.
Holding is reentrant within a process (the CLI holds the lock from before start-up, the step
loop holds it again).

Light (no torch): the CLI imports it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from disagmoe.runtime.failures import RunWarning

LOCK_FILE = "run.lock"
_held: dict[Path, tuple[int, int]] = {}  # resolved lock path -> (fd, depth) held by this process
_guard = threading.Lock()


class RunLocked(ValueError):
    """Another run holds the out_dir (the message names it and what to do)."""


def describe_holder(info: dict[str, Any]) -> str:
    """'pid 123 on host h (started 2026-12-01 20:15:00 UTC)' from a lock file's content."""
    started = info.get("time")
    when = (time.strftime(" (started %Y-%m-%d %H:%M:%S UTC)", time.gmtime(started))
            if isinstance(started, (int, float)) else "")
    return f"pid {info.get('pid', '?')} on host {info.get('host', '?')}{when}"


def _read_info(fd: int) -> dict[str, Any] | None:
    """The lock file's content (None: empty, never written or left half-written)."""
    raw = os.pread(fd, 4096, 0)
    try:
        info = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _process_started(pid: int) -> int | None:
    """The start time of process `pid` on this host (clock ticks after boot, /proc/<pid>/stat's
    field 22), None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[19])  # fields after the command name start at 3


def holder_alive(info: dict[str, Any]) -> bool:
    """Whether the lock's holder (on this host) still runs: its pid exists with the start time the
    lock recorded (another start time: the pid was reused by an unrelated process)."""
    pid, started = info.get("pid"), info.get("pid_started")
    if not isinstance(pid, int) or not isinstance(started, int):
        return False
    return _process_started(pid) == started


def _refuse_or_take_over(info: dict[str, Any] | None, path: Path, fix: str) -> None:
    """With the flock ours: RunLocked if the content names a run that may still hold the folder,
    a RunWarning if it names a dead one (taken over), nothing for an empty file."""
    if info is None:
        return
    holder = describe_holder(info)
    if info.get("host") != socket.gethostname():
        raise RunLocked(f"out_dir {path.parent} is locked by {holder}, another host ({path}); "
                        f"if that run has ended, delete {path}; else {fix}")
    if info.get("pid") != os.getpid() and holder_alive(info):
        raise RunLocked(f"out_dir {path.parent} is in use by the run of {holder}; {fix}")
    warnings.warn(f"out_dir {path.parent}: took over the lock of {holder}, which is no longer running",
                  RunWarning, stacklevel=4)


def _open_locked(path: Path, fix: str) -> int:
    """An fd of `path` with its exclusive flock, the file being the one at `path` (a releaser
    unlinks it while still holding it: an fd of the old file retries)."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            info = _read_info(fd)
            os.close(fd)
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            holder = describe_holder(info) if info else "another process"
            raise RunLocked(f"out_dir {path.parent} is in use by the run of {holder}; {fix}") from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)


def acquire(out_dir: Path) -> None:
    """Take `out_dir`'s lock (creating the folder), or raise RunLocked; reentrant in a process."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = (out_dir / LOCK_FILE).resolve()
    with _guard:
        if path in _held:
            fd, depth = _held[path]
            _held[path] = (fd, depth + 1)
            return
        fix = "wait for it to finish or choose another out_dir (or --out-dir)"
        fd = _open_locked(path, fix)
        try:
            _refuse_or_take_over(_read_info(fd), path, fix)
            me = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time(),
                  "pid_started": _process_started(os.getpid())}
            os.ftruncate(fd, 0)
            os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            raise
        _held[path] = (fd, 1)


def release(out_dir: Path) -> None:
    """Undo one `acquire`; the last one deletes the lock file (still holding its flock) and closes it."""
    path = (Path(out_dir) / LOCK_FILE).resolve()
    with _guard:
        fd, depth = _held[path]
        if depth > 1:
            _held[path] = (fd, depth - 1)
            return
        del _held[path]
        try:
            path.unlink(missing_ok=True)
        finally:
            os.close(fd)


@contextmanager
def run_lock(out_dir: Path) -> Iterator[None]:
    """Hold `out_dir`'s lock inside the block (module docstring)."""
    acquire(out_dir)
    try:
        yield
    finally:
        release(out_dir)
