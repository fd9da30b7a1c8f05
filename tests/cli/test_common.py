"""The CLI's one error path (disagmoe/cli/common.py): literal messages, one line, exit 2 / 1 / 130."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from disagmoe.cli import train_cmd
from disagmoe.cli.app import app
from disagmoe.runtime.failures import TrainingFailed, TrainingInterrupted

REPO = Path(__file__).resolve().parents[2]
# What a SIGKILLed peer's gloo error looks like inside a failure report.
GLOO = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:41234: "
        "Connection reset by peer")


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def config(tmp_path: Path, **fields) -> str:
    data = yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())
    data.update(out_dir=str(tmp_path / "run[/x]"), **fields)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def assert_one_clean_line(result, code: int, *needles: str) -> None:
    assert result.exit_code == code, result.output
    assert "Traceback" not in result.output and "MarkupError" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def fake_run(monkeypatch, error: BaseException, mode: str = "single") -> None:
    def prepare(cfg):
        def run(on_step):
            raise error
        return run
    monkeypatch.setitem(train_cmd.PREPARE, mode, prepare)


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_a_dead_rank_report_with_gloo_brackets_is_printed_literally_exit_1(tmp_path, monkeypatch, as_json):
    report = f"rank 1 (E0.0) failed during train_step of step 3: its actor died; then rank 0: {GLOO}"
    fake_run(monkeypatch, TrainingFailed(1, report))
    result = invoke("train", "--config", config(tmp_path), "mode=single", *(["--json"] if as_json else []))
    assert_one_clean_line(result, 1, "training failed:", report)


def test_ctrl_c_with_brackets_in_the_checkpoint_path_still_exits_130(tmp_path, monkeypatch):
    checkpoint = tmp_path / "run[/x]" / "checkpoints" / "step-00000007"
    fake_run(monkeypatch, TrainingInterrupted("SIGINT", 7, checkpoint))
    result = invoke("train", "--config", config(tmp_path), "mode=single")
    assert_one_clean_line(result, 130, "SIGINT after step 7", str(checkpoint), "resume=true")


def test_a_second_ctrl_c_exits_130_with_a_line(tmp_path, monkeypatch):
    fake_run(monkeypatch, KeyboardInterrupt())
    assert_one_clean_line(invoke("train", "--config", config(tmp_path), "mode=single"), 130, "interrupted")


def test_an_os_error_mid_run_is_a_run_failure_naming_the_file(tmp_path, monkeypatch):
    fake_run(monkeypatch, OSError(28, "No space left on device", str(tmp_path / "run[/x]" / "metrics.jsonl")))
    result = invoke("train", "--config", config(tmp_path), "mode=single")
    assert_one_clean_line(result, 1, "No space left on device", "run[/x]/metrics.jsonl")


@pytest.mark.parametrize("args, needles", [
    (["train", "--config", "no/such[/x]/train.yaml"], ["no/such[/x]/train.yaml"]),
    (["plan", "--model", "m[/x].yaml", "--hardware", "h200-sxm", "--gpus", "2"], ["m[/x].yaml"]),
    (["plan", "--model", "tiny", "--hardware", "[/bold]", "--gpus", "2"], ["'[/bold]'", "valid names"]),
], ids=["config-path", "model-path", "hardware-name"])
def test_brackets_in_input_errors_exit_2(args, needles):
    assert_one_clean_line(invoke(*args), 2, "error:", *needles)


def test_an_unknown_yaml_key_with_brackets_exits_2_naming_it(tmp_path):
    result = invoke("train", "--config", config(tmp_path), "[/x]=1")
    assert_one_clean_line(result, 2, "[/x]", "unknown key")


def test_config_check_prints_bracketed_values_verbatim(tmp_path):
    result = invoke("config", "check", config(tmp_path))
    assert result.exit_code == 0, result.output
    assert "run[/x]" in result.stdout


@pytest.mark.parametrize("args, needles", [
    (["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "x"], ["--gpus", "'disagmoe plan --help'"]),
    (["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "0"], ["--gpus", "greater than or equal to 1"]),
    (["plan", "--bogus"], ["--bogus"]),
    (["trian"], ["trian"]),
    (["config", "schema", "a", "b"], ["unexpected extra argument", "'disagmoe config schema --help'"]),
    (["train", "--config"], ["--config", "requires an argument"]),
], ids=["not-an-int", "below-min", "unknown-option", "unknown-command", "extra-argument", "missing-value"])
def test_a_usage_error_is_one_line_exit_2(args, needles):
    result = invoke(*args)
    assert_one_clean_line(result, 2, "error:", *needles)
    assert "Usage:" not in result.output


def test_help_and_a_bare_group_still_print_usage():
    assert "Usage:" in invoke("plan", "--help").output
    assert "Usage:" in invoke("config").output


HUGE = str(10**30)


def huge_model(tmp_path: Path, **fields) -> str:
    data = yaml.safe_load((REPO / "disagmoe/presets/models/tiny.yaml").read_text()) | fields
    path = tmp_path / "model.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def huge_plan(tmp_path: Path) -> str:
    path = tmp_path / "plan.yaml"
    assert invoke("plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "2", "--seq-len", "64",
                  "--global-batch-tokens", "512", "--out", str(path)).exit_code == 0
    text = path.read_text().replace("layout: single", "layout: disaggregated")  # the tiny model plans one GPU
    path.write_text(text.replace("attention_gpus: 0", f"attention_gpus: {HUGE}").replace(
        "attention_gpus: 1", f"attention_gpus: {HUGE}"))
    return str(path)


SIZES = {
    "plan-gpus": lambda t: ["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", HUGE],
    "plan-hidden": lambda t: ["plan", "--model", huge_model(t, hidden_size=10**30), "--hardware", "h200-sxm",
                              "--gpus", "2"],
    "plan-experts": lambda t: ["plan", "--model", huge_model(t, num_experts=10**30), "--hardware", "h200-sxm",
                               "--gpus", "2"],
    "train-attention-ranks": lambda t: ["train", "--config", config(t), f"attention_ranks={HUGE}"],
    "train-colocated-ranks": lambda t: ["train", "--config", config(t), "mode=colocated", f"colocated_ranks={HUGE}"],
    "train-plan-attention-gpus": lambda t: ["train", "--config", config(t), "--plan", huge_plan(t)],
    "train-steps-flag": lambda t: ["train", "--config", config(t), "--steps", HUGE],
    "roofline-micro-batches": lambda t: ["roofline", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "4",
                                         "--layout", "disaggregated", "--attention-gpus", "2", "--micro-batches", HUGE],
}


@pytest.mark.parametrize("case", list(SIZES))
def test_a_huge_size_exits_2_in_one_line_before_anything_starts(tmp_path, case):
    import time

    start = time.monotonic()
    result = invoke(*SIZES[case](tmp_path))
    assert_one_clean_line(result, 2, "error:", "too large")
    assert time.monotonic() - start < 10
    assert not (tmp_path / "run[/x]").exists()  # nothing written, no actor started


def test_a_model_larger_than_this_host_is_refused_before_allocating(tmp_path):
    model = huge_model(tmp_path, vocab_size=1 << 24, hidden_size=1 << 16)
    result = invoke("train", "--config", config(tmp_path, model=model), "mode=single")
    assert_one_clean_line(result, 2, "parameters", "GiB", "this host has")


def bad_out_dir(tmp_path: Path, case: str) -> str:
    (tmp_path / "file").write_text("x")
    return {"a-file": str(tmp_path / "file"), "under-a-file": str(tmp_path / "file" / "run"),
            "read-only": "/proc/disagmoe-run"}[case]


@pytest.mark.parametrize("mode", ["single", "disaggregated"])
@pytest.mark.parametrize("case", ["a-file", "under-a-file", "read-only"])
def test_an_unwritable_out_dir_exits_2_before_anything_starts(tmp_path, monkeypatch, case, mode):
    def must_not_start(cfg):
        raise AssertionError("the run was set up although out_dir is unwritable")

    monkeypatch.setitem(train_cmd.PREPARE, mode, must_not_start)
    result = invoke("train", "--config", config(tmp_path), f"mode={mode}", "--out-dir", bad_out_dir(tmp_path, case))
    assert_one_clean_line(result, 2, "error: out_dir", "choose another out_dir")


@pytest.mark.parametrize("case", ["directory", "missing-folder", "read-only"])
def test_plan_out_that_cannot_be_written_exits_2_and_leaves_no_tmp(tmp_path, case):
    out = {"directory": tmp_path / "plan.yaml", "missing-folder": tmp_path / "no" / "plan.yaml",
           "read-only": Path("/proc/plan.yaml")}[case]
    if case == "directory":
        out.mkdir()
    result = invoke("plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "2", "--out", str(out))
    assert_one_clean_line(result, 2, f"error: --out {out}")
    assert not list(tmp_path.rglob("*.tmp"))


@pytest.mark.parametrize("load", ["NaN", "Infinity", "-1"])
def test_plan_refuses_a_histogram_with_non_finite_or_negative_loads(tmp_path, load):
    histogram = tmp_path / "metrics.jsonl"
    histogram.write_text(f'{{"step": 1, "expert_load": [[1, {load}, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]]}}\n')
    result = invoke("plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "4", "--seq-len", "128",
                    "--load-histogram", str(histogram))
    assert_one_clean_line(result, 2, "MoE layer 0, expert 1 has load", "--load-histogram")


def test_a_duplicate_key_in_a_train_config_exits_2_naming_it(tmp_path):
    path = tmp_path / "train.yaml"
    path.write_text(Path(config(tmp_path)).read_text() + "steps: 7\n")
    assert_one_clean_line(invoke("train", "--config", str(path)), 2, str(path), "key 'steps' appears twice")
