"""The README's Quickstart: every CPU example runs, in order, in a fresh folder, and shows the
effect its comment claims (not just exit code 0). GPU examples say so in their comment
("on a GPU", "on GPUs", "on 2 GPUs") and are only checked to be marked."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
GPU = re.compile(r"#.*\bon (a GPU|GPUs|\d+ GPUs)\b")


def quickstart() -> list[str]:
    """The Quickstart block's commands, continuation lines joined, comments kept."""
    text = (REPO / "README.md").read_text()
    block = text.split("## Quickstart\n\n```bash\n", 1)[1].split("```", 1)[0]
    return [c.strip() for c in block.replace("\\\n", " ").splitlines() if c.strip()]


def cpu_examples() -> list[str]:
    return [c for c in quickstart() if not GPU.search(c)]


def argv(command: str) -> list[str]:
    words = shlex.split(command.split("#", 1)[0])
    assert words[0] == "disagmoe", command
    return [sys.executable, "-m", "disagmoe", *words[1:]]


def key_of(command: str) -> str:
    """The checker of `CHECKS` an example belongs to (the first whose pattern it matches)."""
    matches = [key for key, pattern in PATTERNS.items() if re.search(pattern, command)]
    assert matches, f"README example without a check in tests/test_readme.py: {command}"
    return matches[0]


PATTERNS = {
    "presets": r"^disagmoe presets",
    "schema": r"^disagmoe config schema train",
    "plan-deepseek": r"plan --model deepseek-v3",
    "plan-qwen-json": r"plan --model qwen3-235b-a22b .*--json --out plan.yaml",
    "roofline-plot": r"roofline .*--plot roofline.png",
    "train-demo": r"^disagmoe train --config configs/tiny-cpu.yaml +#",
    "plan-tiny-disaggregated": r"plan --model tiny .*--out plan.yaml",
    "train-plan": r"train --config configs/tiny-cpu.yaml --plan plan.yaml",
    "plan-histogram": r"--load-histogram runs/tiny-cpu/metrics.jsonl",
    "bench-plan": r"^disagmoe bench plan",
    "bench-train": r"^disagmoe bench train --config configs/tiny-cpu.yaml",
}


def test_every_cpu_example_has_a_check_and_gpu_examples_are_marked():
    keys = [key_of(c) for c in cpu_examples()]
    assert sorted(keys) == sorted(PATTERNS), "each check covers exactly one README example"
    for command in quickstart():
        if "configs/h200" in command or command.startswith(("disagmoe bench experts", "disagmoe bench hardware",
                                                            "disagmoe bench calibrate", "disagmoe bench layer")):
            assert GPU.search(command), f"a GPU example must say so in its comment: {command}"


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every CPU example in README order in one fresh folder (configs/ linked in), with the
    command's output; the histogram example also without its histogram, for comparison."""
    folder = tmp_path_factory.mktemp("quickstart")
    (folder / "configs").symlink_to(REPO / "configs")
    results = {}
    for command in cpu_examples():
        proc = subprocess.run(argv(command), cwd=folder, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        results[key_of(command)] = proc
        if key_of(command) == "plan-histogram":
            plain = [a for a in argv(command) if a != "--load-histogram" and a != "runs/tiny-cpu/metrics.jsonl"]
            results["plan-histogram-uniform"] = subprocess.run([*plain, "--json"], cwd=folder, capture_output=True,
                                                               text=True, timeout=600)
            results["plan-histogram-json"] = subprocess.run([*argv(command), "--json"], cwd=folder,
                                                            capture_output=True, text=True, timeout=600)
    results["folder"] = folder
    return results


def flat(text: str) -> str:
    return " ".join(text.replace("│", " ").split())


@pytest.mark.slow
def test_presets_schema_and_planner_examples(ran):
    from disagmoe.config import Plan, load_hardware, preset_names

    presets = flat(ran["presets"].stdout)
    assert all(" ".join(load_hardware(n).source.split()[:3]) in presets for n in preset_names("hardware"))
    schema = ran["schema"].stdout
    assert "optim.lr" in schema and "meaning" in schema and "$defs" not in schema
    assert "predicted step" in ran["plan-deepseek"].stdout
    plan_file = ran["folder"] / "plan.yaml"  # the tiny plan overwrote it later; the JSON printed is qwen's
    qwen = Plan.model_validate_json(ran["plan-qwen-json"].stdout)
    assert qwen.gpus == 72 and len(ran["plan-qwen-json"].stdout.splitlines()) < len(qwen.expert_map) + 110
    assert plan_file.exists()
    assert (ran["folder"] / "roofline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_the_demo_trains_its_loss_below_1_with_metrics_and_a_checkpoint(ran):
    """The main command (configs/tiny-cpu.yaml: disaggregated on Ray, 1 attention + 1 expert rank):
    the loss below 1, metrics with the planner's `expert_load`, validation, each group's busy
    fraction, a checkpoint with a shard per rank, and the trace of both ranks."""
    out = ran["folder"] / "runs" / "tiny-cpu"
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 201)) and records[-1]["loss"] < 1.0 < records[0]["loss"]
    assert "val_loss" in records[-1]  # eval_every: 50
    assert len(records[-1]["expert_load"]) == 2 and set(records[-1]["busy"]) == {"A0", "E0"}
    manifest = json.loads((out / "checkpoints" / "step-00000200" / "manifest.json").read_text())
    assert {e["file"] for e in manifest["shards"]} == {"rank-00000.pt", "rank-00001.pt", "trainer.pt"}
    pids = {e["pid"] for e in json.loads((out / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"}
    assert pids == {0, 1}
    stdout = ran["train-demo"].stdout
    assert "train (disaggregated)" in stdout and "busy fraction" in stdout
    assert "runs/tiny-cpu/trace.json" in stdout.replace("\n", "")
    assert "Token authentication" not in ran["train-demo"].stderr  # Ray's notice is in ray-driver.log


@pytest.mark.slow
def test_the_tiny_plan_is_disaggregated_and_train_runs_its_layout(ran):
    plan = yaml.safe_load((ran["folder"] / "plan.yaml").read_text())
    assert (plan["layout"], plan["attention_gpus"], plan["expert_gpus"], plan["idle_gpus"]) == ("disaggregated", 2, 1, 0)
    assert plan["speedup_vs_colocated"] > 1
    out = ran["train-plan"].stdout
    assert "attention_ranks=2 (config: 1)" in out and "train (disaggregated)" in out
    assert "set batch_size and seq_len to match" not in out  # the example trains the plan's batch
    checkpoint = ran["folder"] / "runs" / "tiny-planned" / "checkpoints" / "step-00000005" / "manifest.json"
    shards = {e["file"] for e in json.loads(checkpoint.read_text())["shards"]}
    assert "rank-00002.pt" in shards  # the expert rank of three (the attention replicas save one shard)


@pytest.mark.slow
def test_the_histogram_moves_experts_and_the_plan_says_it_read_the_file(ran):
    assert "expert loads read from runs/tiny-cpu/metrics.jsonl" in flat(ran["plan-histogram"].stdout)
    skewed = json.loads(ran["plan-histogram-json"].stdout)
    uniform = json.loads(ran["plan-histogram-uniform"].stdout)
    assert skewed["layout"] == uniform["layout"] == "disaggregated"
    assert skewed["expert_map"] != uniform["expert_map"]
    assert skewed["expert_imbalance"] >= uniform["expert_imbalance"] == 1.0


@pytest.mark.slow
def test_the_bench_examples_time_the_planner_and_both_layouts(ran):
    assert "wall time" in ran["bench-plan"].stdout and "qwen3-235b-a22b" in ran["bench-plan"].stdout
    out = ran["bench-train"].stdout
    assert "disaggregated" in out and "colocated" in out and " ms " in out
