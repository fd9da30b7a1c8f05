"""The per-rank watchdog names an op that overran and shows where the rank is stuck."""

import io
import threading
import time

import pytest

from disagmoe.runtime.cluster.watchdog import OpWatchdog, stacks_text


def _blocked_in_a_named_call(release: threading.Event) -> None:
    release.wait(5)


def test_an_op_past_its_limit_is_reported_once_with_the_stack():
    out = io.StringIO()
    watchdog = OpWatchdog("rank 1 (E0.0)", limit_s=0.2, out=out)
    try:
        with watchdog.op("step 3: ExpertForward L2 mb1"):
            deadline = time.monotonic() + 5
            while not watchdog.reports and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.6)  # more watch periods: still one report for this op
        assert len(watchdog.reports) == 1
        report = watchdog.reports[0]
        assert report.startswith("[disagmoe watchdog] rank 1 (E0.0): 'step 3: ExpertForward L2 mb1' has run")
        assert "test_an_op_past_its_limit_is_reported_once_with_the_stack" in report  # the stuck thread
        assert "disagmoe-op-watchdog" not in report  # not its own stack
        assert out.getvalue() == report
    finally:
        watchdog.close()


def test_ops_within_the_limit_are_not_reported():
    out = io.StringIO()
    watchdog = OpWatchdog("rank 0 (A0.0)", limit_s=0.4, out=out)
    try:
        for i in range(5):
            with watchdog.op(f"op {i}"):
                time.sleep(0.1)
        time.sleep(0.5)  # idle between steps: no op is running
        assert watchdog.reports == [] and out.getvalue() == ""
    finally:
        watchdog.close()


def test_stacks_text_shows_other_threads():
    release = threading.Event()
    thread = threading.Thread(target=_blocked_in_a_named_call, args=(release,), name="blocked-one")
    thread.start()
    try:
        text = stacks_text()
        assert "thread blocked-one" in text and "_blocked_in_a_named_call" in text
    finally:
        release.set()
        thread.join()


def test_a_non_positive_limit_is_refused():
    with pytest.raises(ValueError, match="limit_s must be positive"):
        OpWatchdog("rank 0", limit_s=0)
