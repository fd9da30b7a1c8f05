"""`disagmoe train` on a used, busy or bad out_dir and with a diverging loss (issue 23)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from typer.testing import CliRunner

from disagmoe.cli.app import app

REPO = Path(__file__).resolve().parents[2]
CONFIG = str(REPO / "configs/tiny-cpu.yaml")
FAST = ["steps=3", "batch_size=4", "seq_len=32", "eval_every=0", "mode=single"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["train", *args])


def strict_json(text: str):
    """json.loads refusing NaN and Infinity (as strict parsers do)."""
    def refuse(name: str):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_a_second_run_on_a_busy_out_dir_is_refused_in_one_line(tmp_path):
    hold = textwrap.dedent("""
        import sys, time
        from disagmoe.runtime.run_lock import acquire
        acquire(sys.argv[1]); print("held", flush=True); time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", hold, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        result = invoke("--config", CONFIG, "--out-dir", str(tmp_path), *FAST)
    finally:
        proc.kill()
        proc.wait()
    assert result.exit_code == 2, result.output
    assert result.stderr.count("\n") == 1 and f"is in use by the run of pid {proc.pid}" in result.stderr
    assert not (tmp_path / "metrics.jsonl").exists()


def test_a_fresh_run_into_a_used_out_dir_keeps_the_earlier_run(tmp_path):
    first = invoke("--config", CONFIG, "--out-dir", str(tmp_path), "--json", *FAST)
    assert first.exit_code == 0, first.output
    earlier_metrics = (tmp_path / "metrics.jsonl").read_text()
    second = invoke("--config", CONFIG, "--out-dir", str(tmp_path), "--json", *FAST, "seed=1")
    assert second.exit_code == 0, second.output
    assert "warning: out_dir" in second.stderr and "held an earlier run" in second.stderr
    (aside,) = (tmp_path / "earlier").iterdir()
    assert (aside / "metrics.jsonl").read_text() == earlier_metrics
    assert (aside / "checkpoints" / "step-00000003" / "manifest.json").is_file()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 3  # the new run's only
    assert not (tmp_path / "run.lock").exists()


def test_a_diverging_run_stops_in_one_line_naming_the_step_and_the_setting(tmp_path):
    """Finite but absurd settings (a weight decay of 1000 at lr 10) make the weights overflow within a
    few steps: the run stops there, exit 1, and keeps the checkpoints of the steps before."""
    result = invoke("--config", CONFIG, "--out-dir", str(tmp_path), "--json", *FAST, "steps=10", "optim.lr=10",
                    "optim.weight_decay=1000", "checkpoint_every=1")
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("training failed: step ")
    assert "(not finite)" in lines[0] and "optim.lr=10 is far above" in lines[0]
    records = [strict_json(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    bad = records[-1]
    assert bad["loss"] is None or bad["grad_norm"] is None
    good = [r["step"] for r in records[:-1]]
    assert f"the last good checkpoint is {tmp_path / 'checkpoints' / f'step-{good[-1]:08d}'}" in lines[0] if good \
        else "no checkpoint was written" in lines[0]
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) if good else []
    assert names == [f"step-{s:08d}" for s in good][-3:]  # nothing written after the bad step


def test_json_output_is_strict_with_non_finite_numbers():
    from disagmoe.cli.common import print_json
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_json({"a": float("nan"), "b": [float("inf"), 1.5], "c": {"d": -float("inf")}})
    assert strict_json(out.getvalue()) == {"a": None, "b": [None, 1.5], "c": {"d": None}}


def test_an_optimizer_setting_that_would_overflow_fp32_is_refused_before_start(tmp_path):
    result = invoke("--config", CONFIG, "--out-dir", str(tmp_path), *FAST, "optim.lr=1e308")
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == "error: " + CONFIG + ": optim.lr: Input should be less than or equal to 10"


def test_an_actor_that_never_starts_is_the_runs_one_line_report(tmp_path, monkeypatch):
    from disagmoe.runtime.cluster import driver
    from disagmoe.runtime.cluster.cluster import WorkerFailure

    def never_starts(*args, **kwargs):
        raise WorkerFailure(1, "info did not finish within 120 s (ranks still running: [1])")

    monkeypatch.setattr(driver.WorkerGroup, "start", never_starts)
    result = invoke("--config", CONFIG, "--out-dir", str(tmp_path), "steps=2")
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output
    assert lines[0].startswith("training failed: rank 1 (") and "failed while starting the actors: info did not" \
        in lines[0] and lines[0].endswith("nothing was trained (fix the cause and run again)")
