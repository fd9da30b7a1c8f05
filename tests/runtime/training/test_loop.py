"""The shared step loop (disagmoe/runtime/training/loop.py): checkpoints by step and time, retention, and a
graceful stop on SIGINT / SIGTERM, with the single-process trainer."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from disagmoe.config import OptimConfig, TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.runtime.training import loop as loop_mod
from disagmoe.runtime.state.checkpoint import checkpoint_dir, latest_checkpoint
from disagmoe.runtime.failures import RunWarning, TrainingInterrupted
from disagmoe.runtime.training.loop import METRICS_FILE
from disagmoe.runtime.observe.metrics import read_metrics
from disagmoe.runtime.training.trainer import CHECKPOINTS_DIR, SingleProcessTrainer, train_single


def run_config(tmp_path, **overrides) -> TrainConfig:
    base = dict(model=load_model("tiny"), mode="single", steps=6, batch_size=4, seq_len=32, micro_batches=2,
                eval_every=0, cpu_threads=1, out_dir=str(tmp_path / "run"), optim=OptimConfig(lr=3e-3, warmup_steps=2))
    return TrainConfig(**{**base, **overrides})


def tmp_root(cfg: TrainConfig) -> Path:
    return Path(cfg.out_dir) / CHECKPOINTS_DIR


def steps_saved(cfg: TrainConfig) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in tmp_root(cfg).glob("step-*"))


def test_only_the_newest_checkpoints_are_kept(tmp_path):
    cfg = run_config(tmp_path, checkpoint_every=1, keep_checkpoints=2)
    train_single(cfg)
    assert steps_saved(cfg) == [5, 6]
    keep_all = run_config(tmp_path / "all", checkpoint_every=2, keep_checkpoints=0)
    train_single(keep_all)
    assert steps_saved(keep_all) == [2, 4, 6]


def test_a_fresh_run_in_a_reused_out_dir_keeps_its_own_checkpoints(tmp_path):
    old = run_config(tmp_path, steps=6, checkpoint_every=1, keep_checkpoints=0)
    train_single(old)  # steps 1..6 saved
    summary = train_single(run_config(tmp_path, steps=2, checkpoint_every=1, keep_checkpoints=1))
    assert Path(summary.checkpoint_path).is_dir() and Path(summary.checkpoint_path).name == "step-00000002"
    assert steps_saved(old) == [2, 3, 4, 5, 6]  # the old run's later steps are not this run's to delete


def test_checkpoints_come_when_the_minutes_have_passed(tmp_path, monkeypatch):
    clock = iter(float(60 * t) for t in (0, 1, 2, 4, 5, 7, 8, 9, 10, 11))  # minutes, read once per step
    monkeypatch.setattr(loop_mod, "_clock", lambda: next(clock))
    cfg = run_config(tmp_path, checkpoint_minutes=2.5, keep_checkpoints=0)
    train_single(cfg)
    # start 0; after steps 1..6 the clock reads 1, 2, 4 (>= 2.5: save, reads 5), 7 (2 since 5),
    # 8 (3: save, reads 9), 10 (end: save)
    assert steps_saved(cfg) == [3, 5, 6]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_after_the_step_with_a_checkpoint_and_the_run_resumes(tmp_path, sig):
    cfg = run_config(tmp_path, steps=5)
    before = signal.getsignal(sig)

    def interrupt_at_step_2(record):
        if record["step"] == 2:
            signal.raise_signal(sig)

    trainer = SingleProcessTrainer(cfg)
    with pytest.raises(TrainingInterrupted, match=f"{sig.name} after step 2") as stopped:
        trainer.run(interrupt_at_step_2)
    assert stopped.value.checkpoint == checkpoint_dir(tmp_root(cfg), 2) == latest_checkpoint(tmp_root(cfg))
    assert signal.getsignal(sig) is before  # the loop's handler is gone again
    assert [r["step"] for r in read_metrics(tmp_path / "run" / METRICS_FILE)] == [1, 2]
    train_single(cfg.model_copy(update={"resume": True}))
    assert [r["step"] for r in read_metrics(tmp_path / "run" / METRICS_FILE)] == [1, 2, 3, 4, 5]


def test_a_second_signal_aborts_at_once(tmp_path):
    cfg = run_config(tmp_path, steps=5)

    def interrupt_twice(record):
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)

    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a process started in the background (nohup)
    with pytest.raises(KeyboardInterrupt):
        SingleProcessTrainer(cfg).run(interrupt_twice)
    assert signal.getsignal(signal.SIGINT) is before


def test_a_run_starts_by_sweeping_what_a_killed_run_left(tmp_path):
    """A staged checkpoint (killed before its rename), a half-deleted one (both marked as a run's)
    and a half-written trace go; a step folder no run marked stays (with a warning); the earlier
    complete checkpoint stays and the resume continues from it."""
    from disagmoe.runtime.out_dir import mark_writing

    cfg = run_config(tmp_path, steps=2, checkpoint_every=1, keep_checkpoints=0)
    train_single(cfg)
    root, out = tmp_root(cfg), Path(cfg.out_dir)
    mark_writing(root / ".staging-step-00000003")
    (root / ".staging-step-00000003" / "rank-00000.pt").write_bytes(b"torn")
    mark_writing(root / ".step-00000001.deleting")
    (root / "step-00000009").mkdir()
    (root / "step-00000009" / "rank-00000.pt").write_bytes(b"whose?")
    (out / ".trace.json.tmp").write_text("{")
    with pytest.warns(RunWarning, match="step-00000009 alone"):
        train_single(cfg.model_copy(update={"steps": 3, "resume": True}))
    assert sorted(p.name for p in root.iterdir()) == ["step-00000001", "step-00000002", "step-00000003",
                                                      "step-00000009"]
    assert not (out / ".trace.json.tmp").exists()


def test_signals_are_held_while_the_cluster_shuts_down(capsys):
    import os
    import signal

    from disagmoe.runtime.training.loop import signals_held

    before = signal.getsignal(signal.SIGINT)
    with signals_held("shutting down"):
        os.kill(os.getpid(), signal.SIGINT)  # would raise KeyboardInterrupt outside
        os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGINT) is before
    assert capsys.readouterr().err.count("shutting down") == 1


def test_a_signal_during_a_long_evaluation_stops_it_at_once_with_the_steps_checkpoint(tmp_path, monkeypatch):
    """SIGTERM while validation runs (here it would take a minute): the evaluation is abandoned,
    the step is checkpointed and the run stops within seconds."""
    import os
    import time

    cfg = run_config(tmp_path, steps=4, eval_every=2)

    def long_evaluation(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        return 0.0

    monkeypatch.setattr(SingleProcessTrainer, "validate", long_evaluation)
    start = time.monotonic()
    with pytest.raises(TrainingInterrupted) as stopped:
        SingleProcessTrainer(cfg).run()
    assert time.monotonic() - start < 30
    assert stopped.value.step == 2 and stopped.value.signal_name == "SIGTERM"
    assert stopped.value.checkpoint == checkpoint_dir(tmp_root(cfg), 2)
    assert [r["step"] for r in read_metrics(Path(cfg.out_dir) / METRICS_FILE)] == [1, 2]


def test_a_non_finite_fp8_scale_stops_the_run_naming_the_step_and_the_kind(tmp_path):
    """A step record whose FP8 counters saw an inf or NaN (`fp8_nonfinite`, written by the fp8
    trainer) stops the run as a divergence does: its record is written, it is not checkpointed, and
    the message names the step, the tensor kind and the fix."""
    from disagmoe.runtime.failures import TrainingDiverged

    cfg = run_config(tmp_path, steps=4, checkpoint_every=1)
    trainer = SingleProcessTrainer(cfg)
    step_once = trainer._train_one_step

    def step_with_fp8_fields():
        record = step_once()
        bad = ["gradients"] if record["step"] == 3 else []
        return record | {"fp8_amax": 448.0, "fp8_saturated_share": 0.0, "fp8_underflow_share": 0.0,
                         "fp8_nonfinite": bad}

    trainer._train_one_step = step_with_fp8_fields
    with pytest.raises(TrainingDiverged, match=r"FP8 scale non-finite at step 3 in gradients: the loss or gradients "
                                               r"overflowed; lower the learning rate \(optim.lr=0.003\) or run "
                                               r"precision: bf16; found when the step was read, after its optimizer "
                                               r"update, which is not checkpointed; the last good checkpoint is "
                                               r".*step-00000002"):
        trainer.run()
    records = read_metrics(Path(cfg.out_dir) / METRICS_FILE)
    assert [r["step"] for r in records] == [1, 2, 3] and records[-1]["fp8_nonfinite"] == ["gradients"]
    assert steps_saved(cfg) == [1, 2]


def test_a_skipped_fp8_update_is_said_so(tmp_path):
    from disagmoe.runtime.training.loop import fp8_report

    record = {"step": 7, "loss": float("nan"), "grad_norm": 1.0, "fp8_nonfinite": ["activations", "gradients"],
              "fp8_update_skipped": True}
    message = fp8_report(run_config(tmp_path), record)
    assert message.startswith("FP8 scale non-finite at step 7 in activations and gradients: the loss or gradients "
                              "overflowed (loss nan); lower the learning rate")
    assert message.endswith("the optimizer skipped its update on the GPU (the weights are the previous step's)")
