"""`disagmoe bench first-step`: the loss on the second batch after the config's first AdamW step,
at several learning rates, is what training's second step reads; the weights are put back between
trials; the parameter families cover every parameter once."""

import json

import pytest
from typer.testing import CliRunner

from disagmoe.bench import first_step
from disagmoe.cli.app import app
from disagmoe.config import OptimConfig, TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.runtime.observe.metrics import read_metrics
from disagmoe.runtime.training.loop import METRICS_FILE

runner = CliRunner()


def tiny_run(tmp_path, **overrides) -> TrainConfig:
    base = dict(model=load_model("tiny"), mode="single", device="cpu", experts_backend="loop", steps=2,
                batch_size=4, seq_len=32, micro_batches=2, eval_every=0, cpu_threads=1, checkpoint_every=0,
                checkpoint_at_end=False, out_dir=str(tmp_path / "run"),
                optim=OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.1))
    return TrainConfig(**{**base, **overrides})


def test_the_loss_after_the_first_step_is_training_second_steps_loss(tmp_path):
    """At the warm-up's first learning rate, the probe's loss on batch 2 is the loss the trainer
    logs for step 2 (the same initialisation, batches, micro-batches, clip and AdamW step)."""
    from disagmoe.runtime.training.trainer import train_single

    cfg = tiny_run(tmp_path)
    record = first_step.run(cfg, [1e-4, cfg.optim.lr], by_group=False, group_lr=None, log=lambda _: None)
    train_single(cfg)
    logged = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert logged[0]["loss"] == pytest.approx(record["first_batch"]["loss"], rel=1e-5)
    at_peak = next(r for r in record["rows"] if r["lr"] == cfg.optim.lr)
    assert at_peak["warmup_first"] and record["warmup_first_lr"] == cfg.optim.lr
    assert logged[1]["loss"] == pytest.approx(at_peak["loss"], rel=1e-5)
    assert logged[1]["ce"] == pytest.approx(at_peak["ce"], rel=1e-5)
    assert at_peak["change"] == pytest.approx(at_peak["loss"] - record["before"]["loss"])


def test_trials_put_the_weights_back_and_the_families_cover_every_parameter(tmp_path):
    cfg = tiny_run(tmp_path, batch_size=2, seq_len=16, micro_batches=1)
    record = first_step.run(cfg, [1e-3, 1e-3, 1e-12], by_group=True, group_lr=1e-3, log=lambda _: None)
    assert [r["lr"] for r in record["rows"]] == [1e-12, 1e-3]  # sorted, once each
    tiny = record["rows"][0]
    assert abs(tiny["change"]) < 1e-6  # a vanishing step leaves the loss where it was
    again = first_step.run(cfg, [1e-3], by_group=False, group_lr=None, log=lambda _: None)
    assert again["rows"][0]["loss"] == record["rows"][1]["loss"]  # deterministic, and nothing left stepped
    from disagmoe.model.transformer import MoETransformer

    total = sum(p.numel() for p in MoETransformer(load_model("tiny")).parameters())
    assert sum(g["params"] for g in record["groups"]) == total
    names = {g["group"] for g in record["groups"]}
    assert {"embed", "lm_head", "norm"} <= names or {"embed", "norm"} <= names
    assert all("layers." not in n for n in names)


def test_parameter_families_strip_the_layer_index_and_the_weight_suffix():
    assert first_step.parameter_group("layers.3.attention.wq.weight") == "attention.wq"
    assert first_step.parameter_group("layers.0.moe.experts.w13_EH2F") == "moe.experts.w13_EH2F"
    assert first_step.parameter_group("lm_head.weight") == "lm_head"
    assert first_step.parameter_group("embed.weight") == "embed"


def test_advice_names_a_warmup_that_starts_at_the_best_learning_rate(tmp_path):
    cfg = tiny_run(tmp_path, optim=OptimConfig(lr=1e-3, warmup_steps=10))
    rows = [{"lr": 1e-5, "change": -0.5, "loss": 8.0, "warmup_first": False},
            {"lr": 3e-5, "change": -1.0, "loss": 7.5, "warmup_first": False},
            {"lr": 1e-4, "change": 2.0, "loss": 10.5, "warmup_first": True}]
    line = first_step.advice(cfg, 1e-4, rows)
    assert "raises" in line and "optim.warmup_steps=34" in line
    smaller = first_step.advice(cfg, 3e-5, [dict(rows[0], change=-1.5, loss=7.0), dict(rows[1], warmup_first=True)])
    assert "lowers less than a smaller one" in smaller and "optim.warmup_steps=100" in smaller
    good = first_step.advice(cfg, 3e-5, [rows[0], dict(rows[1], warmup_first=True)])
    assert good.startswith("the warm-up's first step (lr 3e-05) lowers the loss")
    flat = first_step.advice(cfg, 1e-4, [dict(r, change=abs(r["change"])) for r in rows])
    assert "no learning rate tried lowered" in flat


def test_the_command_prints_the_table_and_writes_its_record(tmp_path):
    out = tmp_path / "first.json"
    cfg = "configs/tiny-cpu.yaml"
    r = runner.invoke(app, ["bench", "first-step", "-c", cfg, "mode=single", "micro_batches=1", "batch_size=2",
                            "seq_len=16", "--lr", "1e-3", "--lr", "3e-3", "--by-group", "-o", str(out)])
    assert r.exit_code == 0, r.output
    assert "batch 2's loss after one AdamW step" in r.output and "each parameter family stepped alone" in r.output
    record = json.loads(out.read_text())
    assert [row["lr"] for row in record["rows"]] == [1e-3, 3e-3] and record["groups"]
    assert record["command"]["overrides"][0] == "mode=single"
    bad = runner.invoke(app, ["bench", "first-step", "-c", cfg, "mode=single", "--lr", "-1"])
    assert bad.exit_code != 0 and "positive and finite" in bad.output and "Traceback" not in bad.output
    zero = runner.invoke(app, ["bench", "first-step", "-c", cfg, "mode=single", "--by-group", "--group-lr", "0"])
    assert zero.exit_code != 0 and "give a positive learning rate" in zero.output and "Traceback" not in zero.output


@pytest.mark.gpu
@pytest.mark.slow
def test_gpu_first_step_runs_the_triton_experts_in_fp32(tmp_path):
    """On a GPU with the triton experts (the Qwen3 config's backend): fp32 weights, a vanishing
    step leaves the loss where it was, and the sweep ends in a line of advice."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    cfg = tiny_run(tmp_path, model=model, device="cuda", experts_backend="triton", batch_size=4, seq_len=128)
    record = first_step.run(cfg, [1e-12, 1e-3], by_group=True, group_lr=None, log=lambda _: None)
    assert record["device"].startswith("cuda") and abs(record["rows"][0]["change"]) < 1e-4
    assert record["groups"] and record["advice"]
