"""`disagmoe train` (disagmoe/cli/train_cmd.py): summaries, outputs, and user errors as exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from disagmoe.cli.app import app
from disagmoe.model_ref import load_model

REPO = Path(__file__).resolve().parents[2]
FAST = ["steps=3", "batch_size=4", "seq_len=32", "eval_every=0", "mode=single"]


def invoke(*args: str):
    return CliRunner().invoke(app, ["train", *args])


def test_json_summary_and_outputs(tmp_path):
    out = tmp_path / "run"
    result = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), "--out-dir", str(out), "--json", *FAST)
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["steps"] == 3
    assert summary["final_loss"] > 0 and summary["tokens_per_s"] > 0 and summary["mfu"] is None
    assert Path(summary["metrics_path"]) == out / "metrics.jsonl"
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert (Path(summary["checkpoint_path"]) / "manifest.json").is_file()


def test_micro_batches_auto_is_chosen_and_said_in_the_summary(tmp_path):
    result = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), *FAST, "micro_batches=auto",
                    "--out-dir", str(tmp_path / "run"), "--json")
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    assert summary["micro_batches"] == 1 and summary["micro_batches_note"].startswith("micro_batches: auto -> 1")


def write_plan(tmp_path: Path, gpus: int, expert_gpus: int, **request) -> Path:
    """The planner's best disaggregated plan for the tiny model on `gpus` H200s with 1 attention
    and `expert_gpus` expert GPUs, written to plan.yaml as `disagmoe plan --out` writes it. (The
    planner's own pick for so small a model is one GPU, `single`, or few GPUs: latency dominates;
    this tests plan -> train, not that choice.)"""
    import numpy as np

    from disagmoe.cli.plan_cmd import build_request
    from disagmoe.cli.plan_cmd import write_plan as write
    from disagmoe.placement.cost import evaluate
    from disagmoe.placement.solver import best_index, disaggregated_candidates, price, problem_of

    cfg = build_request("tiny", "h200-sxm", gpus, 64, 512, **request)
    every = disaggregated_candidates(cfg, gpus)
    candidates = every.take(np.flatnonzero((every.attn == 1) & (every.expert == expert_gpus) & (every.p == 1)))
    plan = price(cfg, candidates.take(best_index(evaluate(problem_of(cfg), candidates), candidates))).plan
    path = tmp_path / "plan.yaml"
    write(plan, path)
    return path


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
def test_train_runs_the_layout_of_a_plan_with_replicated_experts_and_says_its_dispatch(tmp_path):
    """plan -> train: the planner's 1 attention + 2 expert GPUs (plan --max-expert-replicas 1: hot
    experts on both) replace the config's 1 + 1, every rank saves its shard. With dispatch=sparse
    the start says so, and the summary gives the dispatch bytes per step beside the dense figure."""
    plan = write_plan(tmp_path, 3, expert_gpus=2, max_expert_replicas=1)
    assert any(len(ranks) > 1 for owners in yaml.safe_load(plan.read_text())["expert_map"] for ranks in owners)
    out = tmp_path / "run"
    result = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), "--plan", str(plan), "--out-dir", str(out),
                    "steps=1", "batch_size=4", "seq_len=32", "eval_every=0", "dispatch=sparse")
    assert result.exit_code == 0, result.output
    assert "expert_ranks=2 (config: 1)" in result.stdout and "train (disaggregated)" in result.stdout
    manifest = json.loads((out / "checkpoints" / "step-00000001" / "manifest.json").read_text())
    assert {e["file"] for e in manifest["shards"]} == {"rank-00000.pt", "rank-00001.pt", "rank-00002.pt",
                                                       "trainer.pt"}
    text = " ".join(result.stdout.replace("│", " ").split())  # the summary table's cells, one space apart
    assert "tokens dispatch sparse (as configured)" in text and "expert outputs return as partial sums" in text
    assert "dispatch sparse" in text and "expert return partial sums" in text
    assert re.search(r"transport buffers: [\d.]+ GiB per rank \(local receive buffers, the largest rank's; in the "
                     r"memory check\)", text) and re.search(r"transport buffers [\d.]+ GiB per rank at most \(local\)",
                                                            text)
    record = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    for name in ("dispatch", "combine", "combine_grad", "dispatch_grad"):  # every hop message sparse dispatch shrinks
        sent, dense = record["traffic"][name], record["traffic"][f"{name}_dense"]
        assert 0 < sent < dense and f"{name.replace('_', ' ')} bytes/step {sent:,} (dense: {dense:,})" in text


def test_a_stopped_run_exits_130_and_says_how_to_resume(tmp_path, monkeypatch):
    from disagmoe.cli import train_cmd
    from disagmoe.runtime.failures import TrainingInterrupted

    def stopped(cfg):
        def run(on_step):
            raise TrainingInterrupted("SIGTERM", 7, tmp_path / "run" / "checkpoints" / "step-00000007")
        return run

    monkeypatch.setitem(train_cmd.PREPARE, "single", stopped)
    result = invoke("--config", _config(tmp_path), "mode=single")
    assert result.exit_code == 130
    assert "SIGTERM after step 7" in result.stderr and "resume=true" in result.stderr
    assert "Traceback" not in result.output


def test_table_summary_names_where_outputs_went(tmp_path):
    out = tmp_path / "run"
    result = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), "--out-dir", str(out), "--steps", "2", *FAST[1:])
    assert result.exit_code == 0, result.output
    assert "final loss" in result.stdout and "metrics.jsonl" in result.stdout


def _config(tmp_path: Path, **fields) -> str:
    data = yaml.safe_load((REPO / "configs/tiny-cpu.yaml").read_text())
    data.update(out_dir=str(tmp_path / "run"), **fields)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    ("content", "message"),
    [(None, "does not exist"), (b"", "is empty"), (b"abc" * 10, "fewer than one sequence")],
    ids=["missing", "empty", "short"],
)
def test_bad_data_file_exits_2_with_one_line(tmp_path, content, message):
    path = tmp_path / "corpus.txt"
    if content is not None:
        path.write_bytes(content)
    config = _config(tmp_path, data={"kind": "text", "path": str(path), "val_fraction": 0.0})
    result = invoke("--config", config)
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output


def test_checkpoint_of_another_model_exits_2(tmp_path):
    first = invoke("--config", _config(tmp_path), "--json", *FAST)
    assert first.exit_code == 0, first.output
    other = load_model("tiny").model_copy(update={"hidden_size": 32}).model_dump(mode="json")
    result = invoke("--config", _config(tmp_path, model=other), "resume=true", "--json", "steps=6", *FAST[1:])
    assert result.exit_code == 2
    assert "different model config" in result.stderr and "hidden_size" in result.stderr
    assert "Traceback" not in result.output


def test_malformed_override_exits_2(tmp_path):
    result = invoke("--config", _config(tmp_path), "optim.lr")
    assert result.exit_code == 2
    assert "key=value" in result.stderr


def test_a_failed_rank_exits_1_with_the_report(tmp_path, monkeypatch):
    from disagmoe.cli import train_cmd
    from disagmoe.runtime.failures import TrainingFailed

    def failing_run(on_step):
        raise TrainingFailed(1, "rank 1 (E0.0) failed during train_step of step 3: it is hung")

    monkeypatch.setitem(train_cmd.PREPARE, "disaggregated", lambda cfg: failing_run)
    result = invoke("--config", _config(tmp_path), "--json")
    assert result.exit_code == 1
    assert "rank 1 (E0.0)" in result.stderr and "Traceback" not in result.output


def test_resume_past_a_truncated_newest_shard_says_which_file_was_bad(tmp_path):
    first = invoke("--config", _config(tmp_path), "--json", "checkpoint_every=2", "steps=4", *FAST[1:])
    assert first.exit_code == 0, first.output
    shard = tmp_path / "run" / "checkpoints" / "step-00000004" / "layer-001.pt"
    shard.write_bytes(shard.read_bytes()[:-10])
    result = invoke("--config", _config(tmp_path), "resume=true", "steps=5", "--json", *FAST[1:])
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: skipped checkpoint step-00000004: checkpoint shard "
                                                   f"{shard} fails its sha256 check"), result.stderr
    assert lines[0].endswith("resuming from step-00000002 instead")
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5]


def test_resume_repairs_a_torn_metrics_line_with_a_one_line_warning(tmp_path):
    first = invoke("--config", _config(tmp_path), "--json", *FAST)
    assert first.exit_code == 0, first.output
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.write_bytes(metrics.read_bytes()[:-7])  # step 3's record torn, as a full disk leaves it
    result = invoke("--config", _config(tmp_path), "resume=true", "steps=4", "--json", *FAST[1:])
    assert result.exit_code == 0, result.output
    assert result.stderr.count("warning:") == 1 and f"{metrics}:3: dropped a torn last line" in result.stderr
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 4]


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
def test_while_the_demo_trains_nothing_listens_beyond_loopback_and_ctrl_c_exits_130(tmp_path):
    """The main command in a real process: once it has trained a step, every listening socket of
    it and its descendants (Ray's servers, the actors, the rendezvous store, gloo) is on loopback;
    SIGINT then stops it after a step with a checkpoint and exit code 130, and its embedded
    cluster's folders (its Ray temp folder and the session folder in it) go with the cluster (they
    piled up in /tmp/ray, one per run)."""
    import contextlib
    import ipaddress
    import signal
    import subprocess
    import sys
    import time

    import ray  # noqa: F401  (puts Ray's psutil on the path)
    import psutil

    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "disagmoe", "train", "--config", str(REPO / "configs/tiny-cpu.yaml"),
                             "--out-dir", str(out), "steps=100000", "batch_size=4", "seq_len=32", "eval_every=0",
                             "checkpoint_minutes=0", "trace=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text().strip()):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else "slow"
            time.sleep(0.5)
        root = psutil.Process(proc.pid)
        descendants = root.children(recursive=True)
        tree = {root.pid, *(p.pid for p in descendants)}
        folders = set()  # named on Ray's processes' command lines (--temp-dir, --session-dir, ...)
        for process in descendants:
            with contextlib.suppress(psutil.Error):
                folders.update(re.findall(r"/tmp/disagmoe-ray-\w+(?:/session_[\w-]+)?", " ".join(process.cmdline())))
        assert any("/session_" in f for f in folders) and all(Path(f).is_dir() for f in folders), folders
        listening = [(c.laddr.ip, c.laddr.port, c.pid) for c in psutil.net_connections("inet")
                     if c.pid in tree and c.status == psutil.CONN_LISTEN]
        assert len(listening) >= 5  # GCS, raylet, driver and actors, the store, gloo

        def loopback(ip):
            address = ipaddress.ip_address(ip)
            return (address.ipv4_mapped or address).is_loopback if address.version == 6 else address.is_loopback

        assert [entry for entry in listening if not loopback(entry[0])] == []
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 130
        stderr = proc.stderr.read()
        assert "training stopped: SIGINT after step" in stderr
        # Ray's start-up notices stay out of the output, in the run's log (cli/third_party.py)
        assert "Token authentication" not in stderr and "Started a local Ray instance" not in stderr
        assert "Started a local Ray instance" in (out / "ray-driver.log").read_text()
        assert [f for f in folders if Path(f).exists()] == []
    finally:
        if proc.poll() is None:
            proc.kill()


def test_train_runs_a_single_gpu_plan_in_single_mode(tmp_path):
    """`disagmoe plan` puts the tiny model on one of 3 GPUs (layout single); train runs it."""
    path = tmp_path / "plan.yaml"
    planned = CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "3",
                                       "--seq-len", "64", "--global-batch-tokens", "512", "--out", str(path)])
    assert planned.exit_code == 0, planned.output
    assert yaml.safe_load(path.read_text())["layout"] == "single"
    result = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), "--plan", str(path), "--out-dir",
                    str(tmp_path / "run"), "steps=2", "batch_size=4", "seq_len=32", "eval_every=0", "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["final_loss"] > 0


def test_train_runs_a_plans_rounds_as_priced_or_refuses_the_batch_it_cannot(tmp_path):
    """`train --plan`: a one-GPU plan of 1 micro-batch of 2 sequences x 4 rounds trains 4 micro-batches of 2
    (one accumulation), and its start line says so; a colocated plan of 2 rounds is refused (exit 2, before
    any rank starts) for its whole step's batch, naming the one-round batch the distributed runtime runs."""
    from disagmoe.cli.plan_cmd import build_request
    from disagmoe.cli.plan_cmd import write_plan as write
    from disagmoe.placement.cost import Candidates
    from disagmoe.placement.solver import price

    # the config's 8 sequences of 64 tokens; its loop experts pair no weight gradients (`expert_wgrad_pairs`)
    request = build_request("tiny", "h200-sxm", 2, 64, 512, expert_wgrad_pairs="off")
    single, colocated = tmp_path / "single.yaml", tmp_path / "colocated.yaml"
    write(price(request, Candidates.one(0, 1, 1, 1, 2, colocated=True)).plan, single)
    write(price(request, Candidates.one(0, 2, 1, 2, 1, colocated=True)).plan, colocated)
    assert (yaml.safe_load(single.read_text())["accumulation_rounds"],
            yaml.safe_load(colocated.read_text())["accumulation_rounds"]) == (4, 2)
    run = ["steps=1", "eval_every=0", "checkpoint_at_end=false"]
    result = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), "--plan", str(single), "--out-dir",
                    str(tmp_path / "single"), *run)
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "micro_batches=4 (config: 2)" in text and "the plan's 1 x 4 rounds" in text
    assert "priced at 2 sequences each" in text
    refused = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), "--plan", str(colocated), "--out-dir",
                     str(tmp_path / "colocated"), *run)
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert "set batch_size: 4 (one round per step" in " ".join(refused.stderr.split())
    assert not (tmp_path / "colocated").exists()


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
def test_train_on_a_two_node_cluster_places_both_ranks_on_one_node_and_matches_the_embedded_run(tmp_path):
    """`train` (1 attention + 1 expert rank) through `ray_address` on a simulated two-node
    cluster (ray.cluster_utils, every node on 127.0.0.1): the head has 1 CPU, the worker node 2.
    CPU ranks sit in one STRICT_PACK placement group (runtime/cluster/cluster.py), so both actors must run
    on one node, the worker node (the only one with 2 CPUs), away from the driver's head node;
    the losses equal the embedded cluster's."""
    from ray.cluster_utils import Cluster

    from disagmoe.runtime.cluster.cluster import _local_only_ray, loopback_interface

    run = ["steps=3", "batch_size=4", "seq_len=32", "eval_every=0", "trace=false", "--json",
           f"env.GLOO_SOCKET_IFNAME={loopback_interface()}"]
    embedded = invoke("--config", _config(tmp_path), "--out-dir", str(tmp_path / "embedded"), *run)
    assert embedded.exit_code == 0, embedded.output
    with _local_only_ray():  # as `ray start --node-ip-address=127.0.0.1` on each node: loopback only
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            node_ip_address="127.0.0.1", num_cpus=1, include_dashboard=False))
        try:
            worker_node = cluster.add_node(node_ip_address="127.0.0.1", num_cpus=2)
            cluster.wait_for_nodes()
        except BaseException:
            cluster.shutdown()
            raise
    try:
        assert cluster.address.startswith("127.0.0.1:")
        joined = invoke("--config", _config(tmp_path), "--out-dir", str(tmp_path / "joined"), *run,
                        f"ray_address={cluster.address}")
        assert joined.exit_code == 0, joined.output
        actors = [a for a in cluster.global_state.actor_table(None).values() if a["ActorClassName"] == "TrainWorker"]
        nodes = [a["Address"]["NodeID"] for a in actors]
        head, worker = cluster.head_node.node_id, worker_node.node_id
    finally:
        cluster.shutdown()
    assert len(nodes) == 2 and set(nodes) == {worker} and head != worker
    got, want = (json.loads(r.stdout) for r in (joined, embedded))
    assert got["steps"] == want["steps"] == 3 and got["final_loss"] == want["final_loss"]
    losses = [[json.loads(line)["loss"] for line in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
              for d in ("joined", "embedded")]
    assert losses[0] == losses[1]


def test_train_sets_the_optimizer_and_precision_a_plan_was_priced_with_and_says_so(tmp_path):
    """A plan priced with torch's update and bf16 moments: `train --plan` runs them (the checkpoint
    records bf16 moments) and its start line says what it changed from the config. A plan priced in
    FP8 sets precision: fp8: on this CPU config the config's own FP8 refusal (exit 2, before the run),
    and on a GPU config the start line says so."""
    path = tmp_path / "plan.yaml"
    planned = CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "1",
                                       "--seq-len", "64", "--global-batch-tokens", "512", "--out", str(path),
                                       "--optimizer-update-kernel", "torch", "--optimizer-state-dtype", "bf16"])
    assert planned.exit_code == 0, planned.output
    out = tmp_path / "run"
    result = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), "--plan", str(path), "--out-dir", str(out),
                    "steps=1", "batch_size=4", "seq_len=32", "eval_every=0")
    assert result.exit_code == 0, result.output
    text = " ".join(result.stdout.split())
    assert "optim.state_dtype=bf16 (config: fp32)" in text and "optim.update_kernel=torch (config: triton)" in text
    manifest = json.loads((out / "checkpoints" / "step-00000001" / "manifest.json").read_text())
    assert manifest["training"]["optim.state_dtype"] == "bf16"
    fp8 = tmp_path / "fp8.yaml"
    planned = CliRunner().invoke(app, ["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "1",
                                       "--seq-len", "64", "--global-batch-tokens", "512", "--out", str(fp8),
                                       "--expert-precision", "fp8", "--no-fp8-dense"])
    assert planned.exit_code == 0, planned.output
    assert (yaml.safe_load(fp8.read_text())["expert_precision"], yaml.safe_load(fp8.read_text())["fp8_dense"]) == (
        "fp8", False)
    result = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), "--plan", str(fp8), "--out-dir",
                    str(tmp_path / "fp8-run"), "steps=1", "batch_size=4", "seq_len=32", "eval_every=0")
    assert result.exit_code == 2 and "Traceback" not in result.output
    text = " ".join(result.stderr.split())
    assert "priced in FP8" in text and "precision: fp8 needs device: cuda" in text
    assert not (tmp_path / "fp8-run").exists()
    from disagmoe.cli.train_cmd import _plan_note
    from disagmoe.config import load_train_config
    from disagmoe.runtime.plan_layout import apply_plan

    gpu = load_train_config(REPO / "configs/tiny-cpu.yaml", ["device=cuda", "experts_backend=triton", "seq_len=32",
                                                             f"plan={fp8}"])
    note = " ".join(_plan_note(gpu, apply_plan(gpu, load_model("tiny"))).split())
    assert "as it was priced: precision=fp8 (config: auto)" in note and "fp8_dense=False (config: None)" in note


def test_the_progress_bar_and_the_summary_report_one_tokens_per_s(tmp_path, monkeypatch):
    """Both show `Throughput` (the run's tokens over its steps' time): the bar's last value is the
    summary's, not the last step's own rate."""
    from disagmoe.cli import train_cmd

    shown, steps = [], []
    on_step = train_cmd.TrainProgress.on_step

    def spy(self, record):
        on_step(self, record)
        shown.append(self.progress.tasks[0].fields["tps"])
        steps.append(record)

    monkeypatch.setattr(train_cmd.TrainProgress, "on_step", spy)
    result = invoke("--config", str(REPO / "configs/tiny-cpu.yaml"), "--out-dir", str(tmp_path / "run"), *FAST)
    assert result.exit_code == 0, result.output
    row = next(line for line in result.stdout.splitlines() if "tokens/s" in line)
    assert row.split()[-2] == shown[-1]  # '│ tokens/s │ 12,345 │'
    expected = sum(r["tokens"] for r in steps) / sum(r["step_time_s"] for r in steps)
    assert shown[-1] == f"{expected:,.0f}"


def test_an_emulated_fp8_run_says_so_at_start():
    """`fp8_emulate`: the start line says the run is FP8 emulated, which GEMMs, and that it is priced as FP8."""
    from disagmoe.cli.train_cmd import fp8_emulate_note
    from disagmoe.config import TrainConfig

    fields = dict(model="tiny", mode="single", device="cuda", experts_backend="triton", precision="fp8",
                  fp8_emulate=True, fp8_expert_backward="bf16", fp8_expert_forward="gate-up")
    note = fp8_emulate_note(TrainConfig(**fields, fp8_dense=False))
    assert note.startswith("precision: FP8 emulated (quantise-dequantise into the bf16 GEMMs)")
    assert "fp8_expert_forward: gate-up" in note and "dense" not in note and "price it as FP8" in note
    assert "the dense projections' (in fp64)" in fp8_emulate_note(TrainConfig(**fields, fp8_dense=True))
    assert "the dense projections' (in fp64)" in fp8_emulate_note(TrainConfig(**fields))  # fp8_dense unset: on


@pytest.mark.parametrize("as_json", [False, True])
def test_a_single_run_says_at_start_how_its_expert_weight_gradients_and_tiles_run(tmp_path, monkeypatch, as_json):
    """The single trainer's `expert_wgrad_pairs` line (`single_memory.resolve_wgrad_pairs`, decided against the
    device's memory as the trainer is built) and its untuned-tiles line (`tile_coverage.untuned_tiles_note`) are
    printed before the steps; `--json` keeps stdout the summary."""
    from disagmoe.runtime.training import trainer

    note = "expert_wgrad_pairs: auto -> on: each expert weight gradient runs 1 times a step"
    tiles = "expert tiles: 6 of the 6 expert GEMM classes this run launches were never tuned on Test GPU"

    class Trainer:
        def __init__(self, cfg):
            self.wgrad_pairs_note, self.tiles_note = note, tiles

        def run(self, on_step):
            class Summary:
                def to_dict(self):
                    return {"steps": 0, "final_loss": None, "final_val_loss": None, "tokens_per_s": None,
                            "mfu": None, "metrics_path": "-", "checkpoint_path": None}
            return Summary()

    monkeypatch.setattr(trainer, "SingleProcessTrainer", Trainer)
    result = invoke("--config", _config(tmp_path), *FAST, *(["--json"] if as_json else []))
    assert result.exit_code == 0, result.output
    if as_json:
        assert note not in result.stdout and tiles not in result.stdout and json.loads(result.stdout)["steps"] == 0
    else:
        assert note in " ".join(result.stdout.split()) and tiles in " ".join(result.stdout.split())
