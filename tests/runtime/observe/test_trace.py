"""Trace spans, Chrome trace files and busy fractions (disagmoe/runtime/observe/trace.py)."""

import json
import time

import pytest

from disagmoe.runtime.observe.trace import SpanRecorder, busy_fractions, wait_fractions, write_chrome_trace


def test_recorder_times_spans_and_counts_compute():
    recorder = SpanRecorder()
    with recorder.span("AttentionForward L0 mb0", "compute"):
        time.sleep(0.02)
    with recorder.span("Recv dispatch L0 mb0", "wait"):
        pass
    spans, compute_s = recorder.drain()
    assert [(name, cat) for name, cat, _, _ in spans] == [("AttentionForward L0 mb0", "compute"),
                                                          ("Recv dispatch L0 mb0", "wait")]
    assert compute_s == pytest.approx(spans[0][3] / 1e6) and compute_s >= 0.02
    assert spans[1][2] >= spans[0][2] + spans[0][3]  # the second starts after the first ends
    assert recorder.drain() == ([], 0.0)


def test_disabled_recorder_still_counts_compute():
    recorder = SpanRecorder(enabled=False)
    with recorder.span("Loss mb0", "compute"):
        time.sleep(0.01)
    spans, compute_s = recorder.drain()
    assert spans == [] and compute_s >= 0.01


def test_busy_fractions_average_each_group():
    busy = busy_fractions([0.5, 0.3, 0.2, 1.5], step_s=1.0, group_of_rank=["A0", "A0", "E0", "E0"])
    assert busy == pytest.approx({"A0": 0.4, "E0": 0.6})  # a rank never counts above 1


def test_gpu_waits_count_per_payload_apart_from_compute():
    recorder = SpanRecorder()
    recorder.add("Recv combine L0 mb0", "gpu-wait", 0.0, 3_000.0)
    recorder.add("Recv combine L1 mb1", "gpu-wait", 5_000.0, 1_000.0)
    recorder.add("Recv dispatch_grad L0 mb0", "gpu-wait", 9_000.0, 500.0)
    recorder.add("AttentionForward L0 mb0", "compute", 3_000.0, 2_000.0)
    spans, compute_s = recorder.drain()
    assert compute_s == pytest.approx(0.002) and len(spans) == 4
    assert recorder.drain_waits() == pytest.approx({"combine": 0.004, "dispatch_grad": 0.0005})
    assert recorder.drain_waits() == {}
    waits = wait_fractions([{"combine": 0.004}, {}, {"dispatch": 0.01}], step_s=0.1,
                           group_of_rank=["A0", "A0", "E0"])
    assert set(waits) == {"A0", "E0"}  # a rank without waits counts as 0 in its group's mean
    assert waits["A0"] == pytest.approx({"combine": 0.02}) and waits["E0"] == pytest.approx({"dispatch": 0.1})


def test_chrome_trace_names_ranks_and_spans(tmp_path):
    spans = {0: [("Loss mb0", "compute", 10.0, 5.0)], 1: [("Send combine L1 mb0", "send", 12.0, 1.0)]}
    path = write_chrome_trace(tmp_path / "trace.json", spans, {0: "A0.0", 1: "E0.0"})
    events = json.loads(path.read_text())["traceEvents"]
    complete = [e for e in events if e["ph"] == "X"]
    assert {(e["pid"], e["tid"], e["name"], e["cat"], e["ts"], e["dur"]) for e in complete} == {
        (0, 1, "Loss mb0", "compute", 10.0, 5.0), (1, 0, "Send combine L1 mb0", "send", 12.0, 1.0)}
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0 (A0.0)", 1: "rank 1 (E0.0)"}
    tracks = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert tracks[(0, 0)] == tracks[(1, 0)] == "messages (host)" and tracks[(0, 1)] == "compute"


def test_a_failed_trace_write_leaves_no_temporary_file(tmp_path):
    from disagmoe.runtime.observe.trace import write_chrome_trace

    (tmp_path / "trace.json").mkdir()
    (tmp_path / "trace.json" / "keep").write_text("")  # the rename onto it fails
    with pytest.raises(OSError):
        write_chrome_trace(tmp_path / "trace.json", {0: []}, {0: "A0.0"})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]


def test_a_gpu_wait_inside_an_op_is_not_its_busy_time():
    """Pair rows: the combine waits inside AttentionForward; its wait span ends before the op's."""
    recorder = SpanRecorder()
    recorder.add_gpu_spans([
        ("Recv combine L0 mb0", "gpu-wait", 0.0, 1_000.0),  # a receive before the op: not inside it
        ("Recv combine L1 mb0", "gpu-wait", 2_500.0, 1_500.0),  # inside the op below
        ("AttentionForward L2 mb0", "compute", 2_000.0, 4_000.0),
        ("AttentionForward L3 mb0", "compute", 7_000.0, 1_000.0),
    ])
    spans, compute_s = recorder.drain()
    assert len(spans) == 4 and compute_s == pytest.approx((4_000 - 1_500 + 1_000) / 1e6)
    assert recorder.drain_waits() == pytest.approx({"combine": 0.0025})
