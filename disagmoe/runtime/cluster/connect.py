"""Reaching Ray within a bound, and leaving nothing behind when start-up is interrupted.

- `check_ray_address(address, timeout_s)`: a ValueError naming `ray_address` for a malformed
  address, or for a HOST:PORT where nothing accepts a TCP connection within `timeout_s`
  (`ray_connect_timeout_s`): Ray itself would retry for minutes, ignoring SIGTERM meanwhile.
- `embedded_temp_dir()` / `remove_embedded_temp_dir()`: every embedded cluster gets a Ray temp
  folder of its own (sessions, sockets, logs), so removing it at shutdown never touches another
  run's.
- `signals_deferred(cleanup)`: SIGINT / SIGTERM inside the block (Ray starting its processes)
  wait for its end; then `cleanup` runs and KeyboardInterrupt is raised, so half-started Ray
  processes are never orphaned by a signal mid-start.
"""

from __future__ import annotations

import shutil
import signal
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from disagmoe.runtime.training.loop import StopRequest

FIX = "start the cluster (`ray start --head`), fix ray_address, or unset it for an embedded cluster"
_temp_dir: Path | None = None  # the embedded cluster's Ray temp folder, while it runs


def parse_address(address: str) -> tuple[str, int] | None:
    """(host, port) of a `HOST:PORT` (IPv6 in brackets); None for "auto" (Ray finds the cluster);
    a ValueError naming ray_address for anything else."""
    if address == "auto":
        return None
    host, sep, port = address.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"ray_address={address!r} is neither 'auto' nor HOST:PORT with a port in 1-65535 "
                         "(e.g. 10.0.0.1:6379); fix ray_address, or unset it for an embedded cluster")
    if any(c.isspace() for c in host):
        raise ValueError(f"ray_address={address!r}: the host holds a space; fix ray_address")
    return host, int(port)


def check_ray_address(address: str | None, timeout_s: float) -> None:
    """ValueError unless nothing is to be joined (None), "auto", or HOST:PORT accepts a TCP
    connection within `timeout_s` (module docstring)."""
    if address is None:
        return
    parsed = parse_address(address)
    if parsed is None:
        return
    host, port = parsed
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as err:
        why = "no answer" if isinstance(err, TimeoutError) else (err.strerror or str(err) or type(err).__name__)
        raise ValueError(f"ray_address={address}: cannot reach it within ray_connect_timeout_s={timeout_s:g} "
                         f"({why}); {FIX}") from None


def embedded_temp_dir() -> str:
    """A new Ray temp folder for this process's embedded cluster (under /tmp: Ray's socket paths
    must stay short)."""
    global _temp_dir
    _temp_dir = Path(tempfile.mkdtemp(prefix="disagmoe-ray-", dir="/tmp" if Path("/tmp").is_dir() else None))
    return str(_temp_dir)


def remove_embedded_temp_dir() -> None:
    """Delete the embedded cluster's temp folder (call after ray.shutdown)."""
    global _temp_dir
    if _temp_dir is not None:
        shutil.rmtree(_temp_dir, ignore_errors=True)
        _temp_dir = None


@contextmanager
def signals_deferred(cleanup: Callable[[], None]) -> Iterator[None]:
    """Hold SIGINT / SIGTERM during the block; if one came, run `cleanup` and raise
    KeyboardInterrupt after it (main thread only; elsewhere a plain block). ray.init installs a
    SIGTERM handler of its own (sys.exit mid-start): inside the block it is kept from doing so."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = {s: signal.getsignal(s) for s in StopRequest.SIGNALS}
    for s in StopRequest.SIGNALS:
        signal.signal(s, lambda signum, frame: got.append(signum))
    utils = getattr(getattr(sys.modules.get("ray"), "_private", None), "utils", None)
    ray_sets = getattr(utils, "set_sigterm_handler", None)
    if ray_sets is not None:
        utils.set_sigterm_handler = lambda handler: None  # Ray 2.60's hook (private; absent: nothing to keep)
    try:
        yield
    except SystemExit as err:  # a SIGTERM handler of Ray's that the hook did not catch
        if err.code != signal.SIGTERM:
            raise
        got.append(signal.SIGTERM)
    finally:
        if ray_sets is not None:
            utils.set_sigterm_handler = ray_sets
        for s, handler in previous.items():
            signal.signal(s, handler)
    if got:
        cleanup()
        raise KeyboardInterrupt(f"{signal.Signals(got[0]).name} during start-up")
