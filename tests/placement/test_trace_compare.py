"""`roofline --compare`: a run's trace against the cost model, per schedule-op kind.

data/tiny-cpu-trace.json is the trace of `disagmoe train --config configs/tiny-cpu.yaml --steps 3`
(CPU, gloo, 1 attention + 1 expert rank; regenerate with that command, out_dir/trace.json)."""

import json
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagmoe.cli.app import app
from disagmoe.config import load_hardware, load_train_config
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import evaluate
from disagmoe.placement.replay import op_times
from disagmoe.placement.solver import problem_of
from disagmoe.placement.trace_compare import compare, measured_by_kind, op_kind, read_trace, run_request
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.schedule.schedule import build_schedule
from disagmoe.wire import Send
from disagmoe.runtime.observe.trace import chrome_trace

TRACE = Path(__file__).parent / "data" / "tiny-cpu-trace.json"
CONFIG = Path(__file__).parents[2] / "configs" / "tiny-cpu.yaml"
runner = CliRunner()


def _expected_ops_per_step(cfg, model) -> Counter:
    """Op kinds per step as the schedule has them (a message counted at each receiving rank)."""
    layout = Layout.from_config(cfg, model)
    counts = Counter()
    for program in build_schedule(layout, cfg.micro_batches).programs:
        for op in program:
            if isinstance(op, Send):
                counts[f"Send {op.payload.value}"] += len(op.peers)
            elif type(op).__name__ != "Recv":
                name = type(op).__name__
                dense = name.startswith("Attention") and not layout.is_moe(op.layer)
                counts[name + (" (dense)" if dense else "")] += 1
    return counts


def test_every_op_of_the_schedule_is_measured_and_predicted():
    cfg, hw = load_train_config(CONFIG), load_hardware("h200-sxm")
    model = load_model(cfg.model)
    result = compare(TRACE, cfg, hw)
    got = {r["kind"]: r["ops_per_step"] for r in result["rows"]}
    assert got == dict(_expected_ops_per_step(cfg, model))
    req, cand = run_request(cfg, model, hw)
    prob = problem_of(req)
    want = op_times(evaluate(prob, cand), prob).by_kind()
    for r in result["rows"]:
        assert r["measured_s"] > 0
        if r["kind"] in want:
            assert r["predicted_s"] == pytest.approx(want[r["kind"]])
            assert r["error"] == pytest.approx(r["predicted_s"] / r["measured_s"] - 1)
        assert r["communication"] == r["kind"].startswith("Send ")
    assert result["steps_measured"] == 2 and result["step"]["measured_s"] > 0


def test_the_request_prices_the_runs_precision_and_recomputation_as_bench_placement_does():
    """An FP8 run with fp8_dense: false is priced with bf16 dense projections (it priced them in
    FP8), its experts in FP8 and its selective modules; the same fields as `bench placement`'s
    request for that run."""
    from disagmoe.bench.placement import plan_request
    from disagmoe.config import TrainConfig

    hw = load_hardware("h200-sxm")
    fp8 = TrainConfig(model="tiny", batch_size=8, seq_len=64, hardware="h200-sxm", device="cuda", precision="fp8",
                      experts_backend="triton", fp8_dense=False, recompute="selective",
                      recompute_modules=["expert_input", "expert_swiglu"], mode="single", micro_batches=1)
    fields = ("expert_precision", "fp8_dense", "recompute", "recompute_modules", "experts_backend")
    for cfg in (fp8, fp8.model_copy(update={"fp8_dense": None}), TrainConfig(model="tiny", batch_size=8, seq_len=64)):
        req, _ = run_request(cfg, load_model("tiny"), hw)
        assert [getattr(req, f) for f in fields] == [getattr(plan_request(cfg.model_copy(
            update={"hardware": "h200-sxm"}), 1), f) for f in fields]
    req, _ = run_request(fp8, load_model("tiny"), hw)
    assert (req.expert_precision, req.fp8_dense, req.recompute_modules) == (
        "fp8", "off", ["expert_input", "expert_swiglu"])
    assert run_request(fp8.model_copy(update={"fp8_dense": None}), load_model("tiny"), hw)[0].fp8_dense == "on"
    assert run_request(fp8.model_copy(update={"fp8_dense": True}), load_model("tiny"), hw)[0].fp8_dense == "on"


def test_a_message_is_timed_from_its_latest_posting_to_its_receipt(tmp_path):
    spans = {0: [("AttentionForward L0 mb0", "compute", 0.0, 10.0), ("Send dispatch L0 mb0", "send", 10.0, 1.0),
                 ("OptimizerStep", "compute", 60.0, 5.0)],
             1: [("Recv dispatch L0 mb0", "wait", 4.0, 26.0), ("ExpertForward L0 mb0", "compute", 30.0, 20.0),
                 ("OptimizerStep", "compute", 55.0, 5.0)]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(chrome_trace(spans, {0: "A0.0", 1: "E0.0"})))
    trace = read_trace(path)
    measured = measured_by_kind(trace, num_dense_layers=0)
    assert measured["Send dispatch"] == [pytest.approx(20e-6)]  # posted at 10 us, received at 30 us
    assert measured["ExpertForward"] == [pytest.approx(20e-6)] and "Send" not in measured
    assert op_kind("wait for sends", 0) is None and op_kind("AttentionForward L0 mb0", 1) == "AttentionForward (dense)"


def _labelled(tmp_path, device):
    """The CPU trace's spans under another device label (what `train` records in otherData)."""
    data = json.loads(TRACE.read_text())
    path = tmp_path / f"trace-{device}.json"
    path.write_text(json.dumps({**data, "otherData": {"device": device}}))
    return path


def test_the_command_prints_a_table_json_and_a_png(tmp_path):
    args = ["roofline", "--compare", str(_labelled(tmp_path, "cuda")), "--config", str(CONFIG), "--hardware", "h200-sxm"]
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "ExpertForward" in r.stdout and "Send dispatch" in r.stdout and "step" in r.stdout
    ops = sum(_expected_ops_per_step(load_train_config(CONFIG), load_model("tiny")).values())
    assert f"matched {ops} of {ops} ops per step to a predicted op time, over 2 measured step(s)" in r.stdout
    r = runner.invoke(app, [*args, "--json", "--plot", str(tmp_path / "cmp.png")])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert {row["kind"] for row in data["rows"]} >= {"ExpertForward", "Send combine"}
    assert data["ops_matched_per_step"] == data["ops_per_step"] == ops and data["unmatched_kinds"] == []
    assert (tmp_path / "cmp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("args, message", [
    (["--compare", str(TRACE), "--hardware", "h200-sxm"], "needs --config"),
    (["--compare", str(TRACE), "--config", str(CONFIG)], "names no hardware"),
    (["--compare", str(CONFIG), "--config", str(CONFIG), "--hardware", "h200-sxm"], "not a trace.json"),
    (["--model", "tiny"], "needs --hardware, --gpus"),
])
def test_user_errors_name_the_fix(args, message):
    r = runner.invoke(app, ["roofline", *args])
    assert r.exit_code == 2 and message in r.output


def test_a_cpu_trace_is_refused_in_one_line_against_gpu_hardware(tmp_path):
    """The README's old example compared a CPU trace with H200 prices: -100% in every row. The
    trace's own record says cpu (or, in a trace older than that record, its config's device)."""
    for trace, told in ((_labelled(tmp_path, "cpu"), "as the trace records"), (TRACE, "the device of")):
        r = runner.invoke(app, ["roofline", "--compare", str(trace), "--config", str(CONFIG), "--hardware", "h200-sxm"])
        assert r.exit_code == 2, r.output
        assert len(r.output.strip().splitlines()) == 1 and "Traceback" not in r.output
        assert "the trace ran on cpu" in r.output and told in r.output and "device: cuda" in r.output
    assert read_trace(_labelled(tmp_path, "cuda")).device == "cuda" and read_trace(TRACE).device is None


def test_a_trace_records_its_device():
    assert chrome_trace({}, {0: "A0.0"}, "cuda")["otherData"] == {"device": "cuda"}
