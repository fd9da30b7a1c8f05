"""`disagmoe bench placement`: the layouts it sweeps, its statistics, and a CPU sweep end to end."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagmoe.bench.placement import Layout, layouts, plan_request, predict, ranks_of, spearman, summarise
from disagmoe.cli.app import app
from disagmoe.config import TrainConfig


def test_layouts_are_every_split_and_colocated_that_divide_the_batch():
    cfg = TrainConfig(model="tiny", batch_size=12)  # tiny has 8 experts
    assert [str(x) for x in layouts(cfg, 4, [2])] == ["1A+3E m=2", "2A+2E m=2", "3A+1E m=2"]  # 12 % (2*4) != 0
    assert [str(x) for x in layouts(cfg, 3, [1, 4])] == ["1A+2E m=1", "2A+1E m=1", "colocated 3 m=1", "1A+2E m=4",
                                                           "colocated 3 m=4"]
    assert all(x.attention + x.experts == 10 for x in layouts(TrainConfig(model="tiny", batch_size=180), 10, [1]))
    assert "9A+1E m=1" in [str(x) for x in layouts(TrainConfig(model="tiny", batch_size=180), 10, [1])]
    assert "1A+9E m=1" not in [str(x) for x in layouts(TrainConfig(model="tiny", batch_size=180), 10, [1])]
    with pytest.raises(ValueError, match="no layout of 4 devices divides batch_size=7"):
        layouts(TrainConfig(model="tiny", batch_size=7), 4, [2])
    with pytest.raises(ValueError, match="at least 2 devices"):
        layouts(cfg, 1, [1])


def test_a_layout_configures_the_run():
    cfg = TrainConfig(model="tiny", batch_size=8, plan=None)
    run = Layout(1, 3, 2).config(cfg, 5, Path("/tmp/x"))
    assert (run.mode, run.attention_ranks, run.expert_ranks, run.micro_batches, run.steps) == (
        "disaggregated", 1, 3, 2, 5)
    colocated = Layout(0, 4, 1).config(cfg, 5, Path("/tmp/x"))
    assert (colocated.mode, colocated.colocated_ranks, colocated.micro_batches) == ("colocated", 4, 1)
    assert run.out_dir != colocated.out_dir and not run.trace and run.eval_every == 0


def test_predictions_come_from_the_planners_cost_model():
    cfg = TrainConfig(model="tiny", batch_size=8, seq_len=64, hardware="h200-sxm")
    request = plan_request(cfg, 3)
    split, fits = predict(request, Layout(1, 2, 2), cfg.batch_size)
    colocated, _ = predict(request, Layout(0, 3, 1), 6)
    assert split > 0 and colocated > 0 and fits
    with pytest.raises(ValueError, match="names no hardware preset"):
        plan_request(TrainConfig(model="tiny", batch_size=8, hardware=None), 3)


def test_the_request_prices_the_runs_precision_and_recomputation():
    """An FP8 run with selective recomputation is priced so (not bf16, not auto's choice), and a
    plain run as bf16 with no recomputation; fp8_dense follows the run's."""
    fp8 = TrainConfig(model="tiny", batch_size=8, seq_len=64, hardware="h200-sxm", device="cuda", precision="fp8",
                      experts_backend="triton", recompute="selective",
                      recompute_modules=["expert_input", "expert_swiglu"])
    request = plan_request(fp8, 3)
    assert (request.expert_precision, request.fp8_dense, request.recompute, request.experts_backend) == (
        "fp8", "on", "selective", "triton")  # fp8_dense unset: on, as the run trains
    assert request.recompute_modules == ["expert_input", "expert_swiglu"]
    assert plan_request(fp8.model_copy(update={"fp8_dense": False}), 3).fp8_dense == "off"
    plain = plan_request(TrainConfig(model="tiny", batch_size=8, seq_len=64, hardware="h200-sxm"), 3)
    assert (plain.expert_precision, plain.fp8_dense, plain.recompute, plain.recompute_modules) == (
        "bf16", "off", "none", None)


def test_a_warmup_that_leaves_nothing_to_time_is_refused_before_any_run():
    from disagmoe.bench.placement import run

    cfg = TrainConfig(model="tiny", batch_size=8, hardware="h200-sxm")
    with pytest.raises(ValueError, match="--warmup 4 leaves no timed step of --steps 4"):
        run(cfg, 2, [2], steps=4, warmup=4, log=print)


def test_ranks_and_rank_correlation():
    assert ranks_of([3.0, 1.0, 2.0]) == [3, 1, 2]
    assert spearman([1, 2, 3, 4], [10, 20, 30, 40]) == 1.0
    assert spearman([1, 2, 3, 4], [40, 30, 20, 10]) == -1.0
    assert spearman([1, 2], [2, 1]) is None


def test_summary_compares_the_planners_pick_with_the_best_measured():
    rows = [{"layout": "1A+3E m=2", "predicted_step_s": 1.0, "fits": True, "measured_step_s": 2.2},
            {"layout": "2A+2E m=2", "predicted_step_s": 2.0, "fits": True, "measured_step_s": 2.0},
            {"layout": "3A+1E m=2", "predicted_step_s": 0.5, "fits": False, "measured_step_s": 3.0},
            {"layout": "colocated 4 m=2", "predicted_step_s": 3.0, "fits": True, "error": "RuntimeError: OOM"}]
    s = summarise(rows)
    assert s["layouts_run"] == 3 and s["planner_pick"] == "1A+3E m=2" and s["best_measured"] == "2A+2E m=2"
    assert s["planner_pick_ran"]
    assert s["pick_vs_best"] == pytest.approx(0.1)
    assert rows[0]["prediction_error"] == pytest.approx(1.0 / 2.2 - 1)
    assert [r.get("predicted_rank") for r in rows] == [2, 3, 1, None]
    assert [r.get("measured_rank") for r in rows] == [2, 1, 3, None]
    assert summarise([rows[3]]) == {"layouts_run": 0}
    failed_pick = [{**rows[1]}, {"layout": "3A+1E m=2", "predicted_step_s": 0.1, "fits": True, "error": "OOM"}]
    s = summarise(failed_pick)
    assert s["planner_pick"] == "3A+1E m=2" and not s["planner_pick_ran"] and s["pick_vs_best"] is None


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
def test_cli_sweeps_the_layouts_of_two_cpu_ranks(tmp_path):
    out = tmp_path / "placement.json"
    r = CliRunner().invoke(app, ["bench", "placement", "--config", "configs/tiny-cpu.yaml", "--gpus", "2", "-m", "2",
                                 "--steps", "3", "--warmup", "1", "--out", str(out), "batch_size=4", "seq_len=32",
                                 "hardware=h200-sxm"])
    assert r.exit_code == 0, r.output
    assert "planner's pick:" in r.stdout and "rank correlation" in r.stdout
    record = json.loads(out.read_text())
    assert [row["layout"] for row in record["layouts"]] == ["1A+1E m=2", "colocated 2 m=2"]
    assert all(row["measured_step_s"] > 0 and row["predicted_step_s"] > 0 for row in record["layouts"])
    assert record["summary"]["layouts_run"] == 2 and record["config"]["gpus"] == 2
