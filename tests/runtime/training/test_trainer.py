"""The single-process trainer, the correctness oracle (disagmoe/runtime/training/trainer.py)."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from disagmoe.config import DataConfig, ModelConfig, OptimConfig, TrainConfig, load_hardware, load_train_config
from disagmoe.model_ref import load_model
from disagmoe.data import TokenDataset, synthetic_corpus
from disagmoe.model import MoETransformer
from disagmoe.roofline.flops import step_flops
from disagmoe.runtime.batching import batch_rows, inputs_and_targets
from disagmoe.runtime.state.checkpoint import checkpoint_dir, read_manifest, read_shards
from disagmoe.runtime.failures import RunWarning
from disagmoe.runtime.observe.metrics import load_imbalance, read_metrics
from disagmoe.runtime.state.optim import build_optimizer, lr_at
from disagmoe.runtime.training.loop import METRICS_FILE
from disagmoe.runtime.out_dir import mark_writing
from disagmoe.runtime.training.trainer import (
    CHECKPOINTS_DIR,
    check_single_memory,
    single_peak_bytes,
    train_single,
    train_step,
)


def tiny_model(bias_balancing: bool = False) -> ModelConfig:
    m = load_model("tiny")
    return m.model_copy(update={"router": m.router.model_copy(update={"bias_balancing": bias_balancing,
                                                                       "bias_update_rate": 1e-2})})


def tiny_run(tmp_path, **overrides) -> TrainConfig:
    base = dict(model=load_model("tiny"), mode="single", steps=6, batch_size=4, seq_len=32, micro_batches=2,
                eval_every=0, cpu_threads=1, out_dir=str(tmp_path / "run"), optim=OptimConfig(lr=3e-3, warmup_steps=2))
    return TrainConfig(**{**base, **overrides})


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
def test_loss_at_least_halves_on_the_synthetic_corpus(tmp_path):
    cfg = tiny_run(tmp_path, steps=120, batch_size=8, seq_len=64, eval_every=60,
                   optim=OptimConfig(lr=3e-3, warmup_steps=10))
    summary = train_single(cfg)
    losses = [r["loss"] for r in read_metrics(tmp_path / "run" / METRICS_FILE)]
    assert len(losses) == 120
    assert sum(losses[-10:]) / 10 <= 0.5 * losses[0]
    assert summary.final_val_loss is not None and summary.final_val_loss <= 0.5 * losses[0]


def test_resume_continues_bit_identically(tmp_path):
    model = tiny_model(bias_balancing=True)
    straight = tiny_run(tmp_path / "a", model=model, steps=6, checkpoint_every=3, eval_every=2)
    train_single(straight)
    resumed_dir = tmp_path / "b" / "run"
    shutil.copytree(checkpoint_dir(tmp_path / "a" / "run" / CHECKPOINTS_DIR, 3),
                    checkpoint_dir(resumed_dir / CHECKPOINTS_DIR, 3))
    train_single(straight.model_copy(update={"out_dir": str(resumed_dir), "resume": True}))

    def deterministic(record: dict) -> dict:
        return {k: v for k, v in record.items() if k not in ("step_time_s", "tokens_per_s", "mfu")}

    a = [deterministic(r) for r in read_metrics(tmp_path / "a" / "run" / METRICS_FILE)]
    b = [deterministic(r) for r in read_metrics(resumed_dir / METRICS_FILE)]
    assert [r["step"] for r in b] == [4, 5, 6]
    assert b == a[3:]

    def final_tensors(run_dir):
        directory = checkpoint_dir(run_dir / CHECKPOINTS_DIR, 6)
        shards = read_shards(directory, read_manifest(directory))
        return {(f, part, k): t for f, s in shards.items() if f != "trainer.pt"
                for part in ("model", "optim") for k, t in s[part].items()}

    fa, fb = final_tensors(tmp_path / "a" / "run"), final_tensors(resumed_dir)
    assert fa.keys() == fb.keys()
    for key in fa:
        if isinstance(fa[key], dict):
            assert all(torch.equal(fa[key][s], fb[key][s]) for s in fa[key]), key
        else:
            assert torch.equal(fa[key], fb[key]), key
    assert any(k[2].endswith("expert_bias") and fa[k].abs().sum() > 0 for k in fa)  # the bias moved


def test_step_matches_one_backward_of_the_mean_micro_batch_loss():
    cfg = tiny_model(bias_balancing=True)
    optim = OptimConfig(lr=1e-2, grad_clip=0.5)
    tokens_BS1 = TokenDataset(synthetic_corpus(10_000), seq_len=16, batch_size=4, seed=0, split="train").batch(0)
    ours, ref = MoETransformer(cfg), MoETransformer(cfg)
    ours.init_weights(1)
    ref.load_state_dict(ours.state_dict())
    ours_opt = build_optimizer(ours.named_parameters(), optim)
    ref_opt = build_optimizer(ref.named_parameters(), optim)

    result = train_step(ours, ours_opt, tokens_BS1, micro_batches=2, lr=optim.lr, grad_clip=optim.grad_clip)

    losses, loads = [], []
    for m in range(2):
        inputs_BS, targets_BS = inputs_and_targets(tokens_BS1[batch_rows(4, 2, 1, m, 0)])
        out = ref(inputs_BS)
        ce = torch.nn.functional.cross_entropy(out.logits_BSV.flatten(0, 1), targets_BS.flatten())
        losses.append(ce + out.aux_loss + out.z_loss)
        loads.append(out.expert_load_LE)
    loss = torch.stack(losses).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), optim.grad_clip)
    ref_opt.step()
    ref.update_router_bias(loads[0] + loads[1])

    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-6)
    assert result.grad_norm == pytest.approx(float(norm), rel=1e-5)
    assert torch.equal(result.expert_load_LE, loads[0] + loads[1])
    for (name, a), b in zip(ours.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


def test_metrics_file_has_one_complete_record_per_step(tmp_path):
    cfg = tiny_run(tmp_path, steps=4, eval_every=2, hardware="h200-sxm")
    train_single(cfg)
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    model = load_model("tiny")
    tokens = cfg.batch_size * cfg.seq_len
    peak = load_hardware("h200-sxm").bf16_tflops * 1e12
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert ["val_loss" in r for r in records] == [False, True, False, True]
    for r in records:
        assert r["loss"] == pytest.approx(r["ce"] + r["aux_loss"] + r["z_loss"], rel=1e-6)  # fp32 sum
        assert r["lr"] == pytest.approx(lr_at(r["step"] - 1, cfg.optim, cfg.steps))
        assert r["tokens"] == tokens
        assert r["flops"] == pytest.approx(step_flops(model, tokens, cfg.seq_len))
        assert r["mfu"] == pytest.approx(r["flops"] / r["step_time_s"] / peak, rel=1e-9)
        load = torch.tensor(r["expert_load"])
        assert load.shape == (model.num_moe_layers, model.num_experts)
        assert load.sum(dim=1).tolist() == [tokens * model.top_k] * model.num_moe_layers
        assert r["load_imbalance"] == pytest.approx(load_imbalance(load))
        assert r["grad_norm"] > 0 and r["tokens_per_s"] > 0


def test_mfu_is_null_without_hardware(tmp_path):
    summary = train_single(tiny_run(tmp_path, steps=1))
    assert summary.mfu is None
    assert read_metrics(tmp_path / "run" / METRICS_FILE)[0]["mfu"] is None


def test_resume_without_a_checkpoint_or_past_the_end_is_a_user_error(tmp_path):
    with pytest.raises(ValueError, match="no complete checkpoint"):
        train_single(tiny_run(tmp_path, resume=True))
    train_single(tiny_run(tmp_path, steps=2))
    with pytest.raises(ValueError, match="raise steps"):
        train_single(tiny_run(tmp_path, steps=2, resume=True))


@pytest.mark.gpu
def test_cuda_bf16_compute_tracks_the_fp32_cpu_run(tmp_path):
    cpu = train_single(tiny_run(tmp_path / "cpu", steps=20))
    gpu = train_single(tiny_run(tmp_path / "gpu", steps=20, device="cuda"))
    cpu_losses = [r["loss"] for r in read_metrics(tmp_path / "cpu" / "run" / METRICS_FILE)]
    gpu_losses = [r["loss"] for r in read_metrics(tmp_path / "gpu" / "run" / METRICS_FILE)]
    assert gpu_losses[0] == pytest.approx(cpu_losses[0], rel=2e-2)
    assert gpu.final_loss == pytest.approx(cpu.final_loss, rel=1e-1)
    directory = checkpoint_dir(tmp_path / "gpu" / "run" / CHECKPOINTS_DIR, 20)
    shards = read_shards(directory, read_manifest(directory))
    assert all(t.dtype == torch.float32 for s in shards.values() if "model" in s for t in s["model"].values())


@pytest.mark.gpu
def test_cuda_peak_memory_is_the_runs_own_after_a_larger_run_in_the_process(tmp_path):
    """`bench train` runs its single-mode variants one after another in one process: each run's
    peak_memory_gib is its own (torch's peak reset when a trainer starts), not the largest so far."""
    fields = dict(steps=2, device="cuda", experts_backend="triton", seq_len=256)
    train_single(tiny_run(tmp_path / "large", batch_size=32, micro_batches=1, **fields))
    train_single(tiny_run(tmp_path / "small", batch_size=2, micro_batches=1, **fields))
    large, small = ([r["peak_memory_gib"] for r in read_metrics(tmp_path / d / "run" / METRICS_FILE)]
                    for d in ("large", "small"))
    # without the reset the small run would report at least the large one's peak (the process's
    # largest so far); with it, its own (on the H200: 0.128 against 0.172 GiB, the rest the
    # large run's objects not yet collected)
    assert max(small) < max(large), (small, large)


@pytest.mark.gpu
def test_cuda_selective_recomputation_trains_like_the_plain_run(tmp_path):
    """recompute: selective on one GPU (triton experts): the losses of the plain run within bf16
    rounding (only the down weight's gradient moves, by the SwiGLU output's rounding) and no host
    wait in a step (what it saves: tests/kernels/test_recompute.py; how much: `bench train`)."""
    fields = dict(steps=8, device="cuda", experts_backend="triton", batch_size=8, seq_len=256,
                  model=tiny_model(bias_balancing=True))
    plain = train_single(tiny_run(tmp_path / "plain", **fields))
    lean = train_single(tiny_run(tmp_path / "lean", recompute="selective", forbid_host_syncs=True, **fields))
    plain_losses, lean_losses = ([r["loss"] for r in read_metrics(tmp_path / d / "run" / METRICS_FILE)]
                                 for d in ("plain", "lean"))
    for step, (a, b) in enumerate(zip(lean_losses, plain_losses, strict=True), 1):
        assert a == pytest.approx(b, rel=1e-2), step
    assert lean.steps == plain.steps == 8


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
def test_cuda_full_recomputation_trains_like_the_plain_run_without_host_waits(tmp_path, backend):
    """recompute: full on one GPU: the plain run's losses within bf16 rounding (the same ops on the
    same values, but the fused norms and RoPE compiled again inside the checkpoint), no host wait
    in a step (forbid_host_syncs), and the measured peak below the plain run's."""
    fields = dict(steps=8, device="cuda", experts_backend=backend, batch_size=8, seq_len=256,
                  model=tiny_model(bias_balancing=True))
    plain = train_single(tiny_run(tmp_path / "plain", **fields))
    lean = train_single(tiny_run(tmp_path / "lean", recompute="full", forbid_host_syncs=True, **fields))
    records = {d: read_metrics(tmp_path / d / "run" / METRICS_FILE) for d in ("plain", "lean")}
    for step, (a, b) in enumerate(zip(records["lean"], records["plain"], strict=True), 1):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-2), step
    assert lean.steps == plain.steps == 8
    assert max(r["peak_memory_gib"] for r in records["lean"]) < max(r["peak_memory_gib"] for r in records["plain"])


def test_full_recomputation_takes_the_oracles_steps(tmp_path):
    """recompute: full in mode single on the CPU (fp32, the oracle's plain AdamW): the same losses,
    loads and parameters as the plain run, bit for bit (each block recomputed from its kept input,
    routed by its kept ids), with a dense first layer, a shared expert and bias balancing; and the
    predicted activation peak below selective's."""
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    fields = dict(model=tiny_model(bias_balancing=True), steps=2, seq_len=16, checkpoint_at_end=False)
    runs = {}
    for recompute in ("none", "full"):
        trainer = SingleProcessTrainer(tiny_run(tmp_path / recompute, recompute=recompute, **fields))
        trainer.run()
        volatile = ("step_time_s", "tokens_per_s", "mfu", "predicted_peak_gib")
        records = [{k: v for k, v in r.items() if k not in volatile}
                   for r in read_metrics(tmp_path / recompute / "run" / METRICS_FILE)]
        runs[recompute] = records, trainer.model.state_dict(), trainer.cfg
    (plain, plain_model, _), (lean, lean_model, lean_cfg) = runs["none"], runs["full"]
    assert lean == plain and len(lean) == 2
    for key, tensor in lean_model.items():
        assert torch.equal(tensor, plain_model[key]), key
    selective = lean_cfg.model_copy(update={"recompute": "selective", "recompute_modules": ["attention"]})
    assert single_peak_bytes(lean_cfg, lean_cfg.model)[1] < single_peak_bytes(selective, lean_cfg.model)[1]


@pytest.mark.gpu
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
def test_cuda_steps_make_no_host_waits(tmp_path, backend, offload):
    """Steady-state single-GPU steps under set_sync_debug_mode('error') (forbid_host_syncs): any
    .item()/.tolist()/.cpu() or other host wait inside a step would raise; offload_optimizer's copy
    streams too (event waits only). Offloaded, the losses follow the on-device optimizer's (to the
    kernels' run-to-run rounding; the update itself is compared bit for bit in tests/runtime/state/test_offload.py)."""
    fields = dict(steps=3, device="cuda", experts_backend=backend, forbid_host_syncs=True,
                  model=tiny_model(bias_balancing=True))
    cfg = tiny_run(tmp_path / "a", offload_optimizer=offload, offload_bucket_mib=1, **fields)
    summary = train_single(cfg)
    assert summary.steps == 3 and summary.final_loss is not None
    if offload:
        assert summary.offloaded_host_gib > 0
        train_single(tiny_run(tmp_path / "b", **fields))
        losses = [[r["loss"] for r in read_metrics(tmp_path / d / "run" / METRICS_FILE)] for d in ("a", "b")]
        assert losses[0] == pytest.approx(losses[1], rel=1e-2)


def test_fast_path_in_fp32_equals_the_oracle(tmp_path):
    """`train_step_flat` (FlatAdamW, chunked loss, one read per step) on fp32 parameters takes the
    oracle's steps: same losses, grad norms, router biases and parameters, to rounding."""
    from disagmoe.runtime.state.flat_adamw import FlatAdamW
    from disagmoe.runtime.training.trainer import train_step_flat

    cfg = tiny_model(bias_balancing=True)
    data = TokenDataset(synthetic_corpus(1 << 14), 32, 4, 0, "train")
    optim = OptimConfig(lr=3e-3, warmup_steps=1, weight_decay=0.1, grad_clip=0.5)
    oracle, fast = MoETransformer(cfg), MoETransformer(cfg)
    reference = build_optimizer(oracle.named_parameters(), optim)
    flat = FlatAdamW(fast.named_parameters(), optim, torch.float32)
    for step in range(4):
        a = train_step(oracle, reference, data.batch(step), 2, optim.lr, optim.grad_clip)
        b = train_step_flat(fast, flat, data.batch(step), 2, optim.lr, optim.grad_clip)
        for field in ("loss", "ce", "aux_loss", "z_loss", "grad_norm"):
            assert getattr(b, field) == pytest.approx(getattr(a, field), rel=1e-5), field
        assert torch.equal(a.expert_load_LE, b.expert_load_LE)
    for (name, p), q in zip(oracle.state_dict().items(), fast.state_dict().values(), strict=True):
        assert float((q - p).norm() / p.norm().clamp_min(1e-12)) < 1e-5, name  # AdamW amplifies ulps of tiny grads


def test_bf16_single_mode_trains_and_checkpoints_fp32_masters(tmp_path):
    cfg = tiny_run(tmp_path, precision="bf16", steps=8, checkpoint_every=4,
                   optim=OptimConfig(lr=3e-3, warmup_steps=2))
    summary = train_single(cfg)
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert records[-1]["loss"] < records[0]["loss"] and records[0]["precision"] == "bf16"
    shards = read_shards(checkpoint_dir(tmp_path / "run" / CHECKPOINTS_DIR, 8),
                         read_manifest(checkpoint_dir(tmp_path / "run" / CHECKPOINTS_DIR, 8)))
    weights = [t for name, shard in shards.items() if name != "trainer.pt" for t in shard["model"].values()]
    assert weights and all(t.dtype == torch.float32 for t in weights)
    resumed = train_single(cfg.model_copy(update={"steps": 10, "resume": True}))
    assert resumed.steps == 10 and summary.steps == 8


def test_balanced_routing_gives_every_expert_the_same_load(tmp_path):
    """... and its expert launches read the tiles tuned for even loads (`tile_configs.LOADS`), a learned run's the
    routed ones."""
    from disagmoe.kernels import tile_configs as tc

    before = tc.expert_loads()
    try:
        cfg = tiny_run(tmp_path, routing="balanced", steps=2)
        train_single(cfg)
        assert tc.expert_loads() == "even"
        records = read_metrics(tmp_path / "run" / METRICS_FILE)
        assert all(r["routing"] == "balanced" for r in records)
        assert all(ratio == 1.0 for r in records for ratio in r["load_imbalance"])
        train_single(tiny_run(tmp_path / "learned", steps=1))
        assert tc.expert_loads() == "routed"
    finally:
        tc.set_expert_loads(before)


def test_no_checkpoint_at_the_end_when_asked(tmp_path):
    summary = train_single(tiny_run(tmp_path, steps=2, checkpoint_at_end=False))
    assert summary.checkpoint_path is None and not (tmp_path / "run" / CHECKPOINTS_DIR).exists()


def test_resume_skips_a_truncated_newest_shard_for_the_previous_checkpoint(tmp_path):
    """Steps 1-6 with checkpoints at 3 and 6; step 6's layer shard cut short, and a step-7 folder
    a killed writer left (marked) without its manifest: the resume warns naming the shard, continues from
    step 3 exactly as the straight run did, and the manifest-less folder is gone."""
    straight = tiny_run(tmp_path / "a", steps=6, checkpoint_every=3)
    train_single(straight)
    resumed_dir = tmp_path / "b" / "run"
    shutil.copytree(tmp_path / "a" / "run" / CHECKPOINTS_DIR, resumed_dir / CHECKPOINTS_DIR)
    shard = checkpoint_dir(resumed_dir / CHECKPOINTS_DIR, 6) / "layer-001.pt"
    shard.write_bytes(shard.read_bytes()[:100])
    partial = checkpoint_dir(resumed_dir / CHECKPOINTS_DIR, 7)
    mark_writing(partial)  # as the writer does before its first shard
    (partial / "global.pt").write_bytes(b"half")
    with pytest.warns(RunWarning) as warned:
        train_single(straight.model_copy(update={"out_dir": str(resumed_dir), "resume": True}))
    assert len(warned) == 1
    assert str(warned[0].message).startswith(f"skipped checkpoint step-00000006: checkpoint shard {shard} fails "
                                             "its sha256 check (100 of ")
    assert str(warned[0].message).endswith("resuming from step-00000003 instead")
    a, b = (read_metrics(d / METRICS_FILE) for d in (tmp_path / "a" / "run", resumed_dir))
    assert [r["step"] for r in b] == [4, 5, 6]
    assert [r["loss"] for r in b] == [r["loss"] for r in a[3:]]
    assert not partial.exists()


def test_resume_with_another_seed_or_learning_rate_warns_naming_them(tmp_path):
    first = tiny_run(tmp_path, steps=2)
    train_single(first)
    changed = first.model_copy(update={"steps": 3, "resume": True, "seed": 5,
                                       "optim": first.optim.model_copy(update={"lr": 1e-3})})
    with pytest.warns(RunWarning, match=r"changed training settings \(seed: 0 -> 5, optim.lr: 0.003 -> 0.001\)"):
        assert train_single(changed).steps == 3


@pytest.mark.slow  # two 50-step runs: more than a few seconds on 2 cores
def test_bf16_moments_train_to_the_fp32_moment_loss(tmp_path):
    """50 steps of the tiny model: bf16 moments (FlatAdamW over fp32 parameters) against the oracle's
    fp32 ones. The step-50 loss agrees within 0.5% relative (measured: 2.5723 vs 2.5712, 0.04%)."""
    losses = {}
    for dtype in ("fp32", "bf16"):
        cfg = tiny_run(tmp_path / dtype, steps=50, checkpoint_at_end=False,
                       optim=OptimConfig(lr=3e-3, warmup_steps=5, state_dtype=dtype))
        train_single(cfg)
        losses[dtype] = [r["loss"] for r in read_metrics(tmp_path / dtype / "run" / METRICS_FILE)]
    assert losses["bf16"][0] == losses["fp32"][0]  # the same first forward
    assert losses["bf16"][-1] == pytest.approx(losses["fp32"][-1], rel=5e-3)
    assert losses["bf16"][-1] < 0.6 * losses["bf16"][0]


@pytest.mark.parametrize(("first", "then"), [("bf16", "fp32"), ("fp32", "bf16")])
def test_a_run_resumes_with_the_other_moment_dtype(tmp_path, first, then):
    """Checkpoints hold fp32 moments whatever the run kept, so a bf16-moment run resumes as an
    fp32-moment one (the oracle) and back. The resume warns that the setting changed, and the
    resumed steps' losses stay within 0.1% of the straight run's."""
    straight = tiny_run(tmp_path / "a", steps=6, checkpoint_every=3,
                        optim=OptimConfig(lr=3e-3, warmup_steps=2, state_dtype=first))
    train_single(straight)
    saved = checkpoint_dir(tmp_path / "a" / "run" / CHECKPOINTS_DIR, 3)
    moments = [t for name, shard in read_shards(saved, read_manifest(saved)).items() if name != "trainer.pt"
               for state in shard["optim"].values() for k, t in state.items() if k != "step"]
    assert moments and all(t.dtype == torch.float32 for t in moments)
    resumed_dir = tmp_path / "b" / "run"
    shutil.copytree(saved, checkpoint_dir(resumed_dir / CHECKPOINTS_DIR, 3))
    other = straight.model_copy(update={"out_dir": str(resumed_dir), "resume": True,
                                        "optim": straight.optim.model_copy(update={"state_dtype": then})})
    with pytest.warns(RunWarning, match=f"optim.state_dtype: '{first}' -> '{then}'"):
        train_single(other)
    a, b = (read_metrics(d / METRICS_FILE) for d in (tmp_path / "a" / "run", resumed_dir))
    assert [r["step"] for r in b] == [4, 5, 6]
    assert [r["loss"] for r in b] == pytest.approx([r["loss"] for r in a[3:]], rel=1e-3)
def recorded_single_peak_gib() -> float:
    """The measured peak of configs/h200x2-qwen3-30b.yaml in mode single, 8 micro-batches of
    2 x 4,096 tokens, routing=balanced: docs/benchmarks.md's a3ee5cb row (peak GiB column)."""
    from pathlib import Path

    docs = Path(__file__).parents[3] / "docs" / "benchmarks.md"
    header = "| build | mode | ms/step (median of steps 5-10) |"
    lines = docs.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    columns = [c.strip() for c in lines[start].strip("|").split("|")]
    row = next(line for line in lines[start:] if line.startswith("| a3ee5cb (this session's step) | single (ours)"))
    return float(row.strip("|").split("|")[columns.index("peak GiB")])


def test_the_predicted_single_gpu_peak_matches_the_recorded_qwen3_measurement():
    """Within 3% of the measured peak (torch's max_memory_allocated) of the Qwen3-30B-shaped
    config on an H200: the state of 3.76 B parameters and one micro-batch's activations (measured with the
    expert weight gradients a micro-batch at a time)."""
    from pathlib import Path

    cfg = load_train_config(str(Path(__file__).parents[3] / "configs" / "h200x2-qwen3-30b.yaml"),
                            ["mode=single", "micro_batches=8", "expert_wgrad_pairs=off"])
    state, acts = single_peak_bytes(cfg, load_model(cfg.model))
    assert (state + acts) / 2**30 == pytest.approx(recorded_single_peak_gib(), rel=0.03)


def test_a_single_gpu_run_that_cannot_fit_is_refused_with_the_numbers_and_the_fix(tmp_path):
    cfg = tiny_run(tmp_path)
    state, acts = single_peak_bytes(cfg, cfg.model)
    check_single_memory(cfg, cfg.model, capacity_bytes=state + acts)
    with pytest.raises(ValueError, match=r"mode single needs [\d.]+ GiB on a [\d.]+ GiB device: [\d,]+ parameters "
                                         r"hold .* a micro-batch of 64 tokens \(batch_size=4 / micro_batches=2 x "
                                         r"seq_len=32\) .* use recompute: full \([\d.]+ GiB, \d+% of the device\), "
                                         r"optim.state_dtype: bf16 .* micro_batches: 4 .*`disagmoe plan`"):
        check_single_memory(cfg, cfg.model, capacity_bytes=state + acts - 1)
    # gradient accumulation: more micro-batches of the same step keep fewer activations
    finer = cfg.model_copy(update={"micro_batches": 4})
    assert single_peak_bytes(finer, cfg.model)[1] < acts


def test_the_memory_refusal_names_each_unused_knob_with_its_predicted_peak():
    """Twice the Qwen3 config's layers at 4 micro-batches (153.7 GiB) on a 140 GiB device: each knob
    alone, with the peak the memory model predicts for it and whether that fits; knobs in use or
    refused with the run's settings are not offered."""
    from pathlib import Path

    from disagmoe.runtime.training.trainer import memory_knobs

    path = str(Path(__file__).parents[3] / "configs" / "h200x2-qwen3-30b.yaml")
    cfg = load_train_config(path, ["mode=single", "model.num_layers=12", "micro_batches=4"])
    model = load_model(cfg.model)
    knobs = dict(memory_knobs(cfg, model))
    assert list(knobs) == ["recompute: selective", "recompute: full", "optim.state_dtype: bf16",
                           "offload_optimizer: true", "expert_wgrad_pairs: off", "micro_batches: 16"]
    assert knobs["expert_wgrad_pairs: off"] < sum(single_peak_bytes(cfg, model))  # the waiting rows go
    for label, change in (("recompute: full", ["recompute=full"]), ("micro_batches: 16", ["micro_batches=16"])):
        other = load_train_config(path, ["mode=single", "model.num_layers=12", "micro_batches=4", *change])
        assert knobs[label] == sum(single_peak_bytes(other, model))
    assert sum(single_peak_bytes(cfg, model)) > max(knobs.values())
    full = load_train_config(path, ["mode=single", "model.num_layers=12", "micro_batches=4", "recompute=full"])
    full_gib = sum(single_peak_bytes(full, model)) / 2**30
    with pytest.raises(ValueError, match=rf"recompute: full \({full_gib:.1f} GiB, {full_gib / 140:.0%} of the device\)"):
        check_single_memory(cfg, model, capacity_bytes=140 * 2**30)
    used = load_train_config(path, ["mode=single", "model.num_layers=12", "micro_batches=2", "recompute=full",
                                   "optim.state_dtype=bf16"])
    assert [k for k, _ in memory_knobs(used, model)] == ["offload_optimizer: true", "expert_wgrad_pairs: off",
                                                         "micro_batches: 16"]
    fp8 = load_train_config(path, ["mode=single", "model.num_layers=12", "micro_batches=2", "precision=fp8"])
    fp8_knobs = dict(memory_knobs(fp8, model))  # selective with the modules the FP8 experts drop; full refused
    lean = "recompute: selective with recompute_modules: [expert_input, expert_swiglu]"
    assert [k for k in fp8_knobs if k.startswith("recompute")] == [lean]
    assert fp8_knobs[lean] < sum(single_peak_bytes(fp8, model))


def test_every_step_record_and_the_summary_carry_the_predicted_peak(tmp_path):
    cfg = tiny_run(tmp_path, steps=2)
    summary = train_single(cfg)
    predicted = sum(single_peak_bytes(cfg, cfg.model)) / 2**30
    assert summary.predicted_peak_gib == pytest.approx(predicted)
    assert summary.dense_recipe == cfg.dense_recipe == "fp32"  # the dense projections' GEMMs as run
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert [(r["predicted_peak_gib"], r["peak_memory_gib"]) for r in records] == [(summary.predicted_peak_gib, None)] * 2


# --- precision fp8's numerics counters in the step record (kernels/fp8_stats.py)


def test_the_step_read_carries_the_fp8_counters_and_resets_them():
    """`read_step` takes the FP8 counters in its one read, hands them back flattened and zeroes the
    buffer for the next step; `fp8_fields` makes the record's fields of them (none without fp8)."""
    from disagmoe.kernels.fp8_stats import GRADIENTS, Fp8Stats
    from disagmoe.runtime.training.trainer import fp8_fields, read_step

    stats = Fp8Stats("cpu")
    amax = torch.tensor([448.0], dtype=torch.float32).view(torch.int32).item()
    stats.buffer[GRADIENTS] = torch.tensor([amax, 0, 7, 700, 0])
    totals, norm, load = torch.tensor([4.0, 3.0, 0.5, 0.5]), torch.tensor(2.0), torch.arange(6).view(2, 3)
    result = read_step(totals, norm, load, 2, stats)
    assert (result.loss, result.grad_norm) == (2.0, 2.0) and torch.equal(result.expert_load_LE, load)
    assert stats.buffer.eq(0).all()
    fields = fp8_fields(result, torch.device("cpu"))
    assert fields["fp8_amax"] == 448.0 and fields["fp8_underflow_share"] == 0.01
    assert fields["fp8_saturated_share"] == 0.0 and fields["fp8_nonfinite"] == []
    assert fp8_fields(read_step(totals, norm, load, 2), torch.device("cpu")) == {}
    stats.buffer[GRADIENTS, 4] = 1  # NONFINITE: the fields say whether the device skipped the update
    bad = read_step(totals, norm, load, 2, stats)
    assert fp8_fields(bad, torch.device("cuda"))["fp8_update_skipped"] is True
    assert fp8_fields(bad, torch.device("cpu"))["fp8_nonfinite"] == ["gradients"]
    assert fp8_fields(bad, torch.device("cpu"))["fp8_update_skipped"] is False


@pytest.mark.slow  # the FP8 expert kernels in Triton's interpreter
@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # NumPy on the planted inf's group
def test_an_fp8_step_on_the_interpreter_records_its_numerics_and_flags_an_inf(interpreted):
    """The fast path's step with FP8 experts on CPU (Triton's interpreter, fp32 parameters; the
    config refuses precision fp8 off a GPU, so the model is set up by hand as the trainer does):
    the step's counters reach its result by kind, and an inf planted in one expert's weight is
    named as a non-finite weights scale."""
    from disagmoe.kernels.fp8_stats import Fp8Stats
    from disagmoe.runtime.state.flat_adamw import FlatAdamW
    from disagmoe.runtime.training.trainer import fp8_fields, train_step_flat

    interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.fp8_ffn",
                "disagmoe.kernels.permute")
    data = TokenDataset(synthetic_corpus(1 << 12), 16, 2, 0, "train")
    optim = OptimConfig(lr=1e-3, warmup_steps=0)
    model = MoETransformer(load_model("tiny"), experts_backend="triton")
    model.init_weights(0)
    model.set_expert_precision("fp8")
    stats = Fp8Stats("cpu")
    model.set_fp8_stats(stats)
    flat = FlatAdamW(model.named_parameters(), optim, torch.float32)
    cpu = torch.device("cpu")
    fields = fp8_fields(train_step_flat(model, flat, data.batch(0), 1, optim.lr, 0.0, fp8_stats=stats), cpu)
    by_kind = fields["fp8_by_kind"]
    assert all(by_kind[kind]["elements"] > 0 for kind in ("activations", "weights", "gradients"))
    assert fields["fp8_nonfinite"] == [] and fields["fp8_saturated_share"] == 0.0
    assert fields["fp8_amax"] == pytest.approx(448.0, rel=1e-6) and 0.0 <= fields["fp8_underflow_share"] < 0.5
    assert stats.buffer.eq(0).all()  # reset by the read
    experts = next(m for m in model.modules() if hasattr(m, "w13_EH2F"))
    with torch.no_grad():
        experts.w13_EH2F[0, 0, 0] = float("inf")
    fields = fp8_fields(train_step_flat(model, flat, data.batch(1), 1, optim.lr, 0.0, fp8_stats=stats), cpu)
    assert "weights" in fields["fp8_nonfinite"] and fields["fp8_update_skipped"] is False  # CPU: applied
    assert fields["fp8_by_kind"]["weights"]["nonfinite"] == 1


def test_a_step_without_the_fp8_counters_runs_the_plain_quantisers_and_guards_its_update_by_the_norm():
    """`MoETransformer.set_fp8_counting`: with None the experts and the FP8 dense projections get no
    stats (their kernels' STATS off) and the FP8 weight copies stay; the update's skip is then the
    gradient norm's non-finiteness (`fp8_update_skip`), with the stats their NONFINITE flag; outside
    FP8 none. The record says which (`fp8_guard_fields`)."""
    from disagmoe.kernels.fp8_stats import DENSE, NONFINITE, Fp8Stats
    from disagmoe.model.experts import RoutedExperts
    from disagmoe.model.layers import DeferrableLinear
    from disagmoe.runtime.training.trainer import fp8_guard_fields, fp8_update_skip

    model = MoETransformer(load_model("tiny"), experts_backend="triton")
    norm = torch.tensor(float("nan"))
    assert fp8_update_skip(model, norm) is None  # bf16
    model.set_expert_precision("fp8")
    stats = Fp8Stats("cpu")
    model.set_fp8_stats(stats)
    model.set_dense_fp8(True, stats, emulate=True)
    dense = [m for m in model.modules() if isinstance(m, DeferrableLinear)]
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    sentinel = object()
    for m in dense:
        m.fp8_copies = sentinel  # as `prepare_fp8` left them: a captured step reads these
    stats.buffer[0, NONFINITE] = 1
    assert float(fp8_update_skip(model, torch.tensor(1.0))) == 1.0  # counting: the quantisers' flag
    stats.buffer.zero_()
    assert float(fp8_update_skip(model, torch.tensor(1.0))) == 0.0
    assert float(fp8_update_skip(model, norm)) == 1.0  # and the norm's, as on a step without counters
    model.set_fp8_counting(None)
    assert model.fp8_stats is None and all(m.fp8_stats is None for m in experts)
    assert all(m.fp8_stats_row is None and m.fp8 and m.fp8_copies is sentinel for m in dense)
    assert float(fp8_update_skip(model, norm)) == 1.0 and float(fp8_update_skip(model, torch.tensor(2.0))) == 0.0
    assert float(fp8_update_skip(model, torch.tensor(float("inf")))) == 1.0
    model.set_fp8_counting(stats)
    assert model.fp8_stats is stats and not model.fp8_uncounted and all(m.fp8_stats is stats for m in experts)
    assert all(m.fp8_stats_row.data_ptr() == stats.row(DENSE).data_ptr() for m in dense)
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fp8_guard_fields(True, float("nan"), cuda) == {"fp8_counted": True, "fp8_update_skipped": True}
    assert fp8_guard_fields(False, 1.5, cuda) == {"fp8_counted": False}
    assert fp8_guard_fields(False, float("nan"), cuda) == {"fp8_counted": False, "fp8_update_skipped": True}
    assert fp8_guard_fields(False, float("inf"), cpu)["fp8_update_skipped"] is False


def test_fp8_counters_every_is_refused_where_it_does_not_apply():
    with pytest.raises(ValueError, match="fp8_counters_every=10 .* precision: bf16: set precision: fp8"):
        TrainConfig(model="tiny", precision="bf16", fp8_counters_every=10)
    with pytest.raises(ValueError, match="fp8_counters_every=4 is built for mode: single .* set fp8_counters_every: 1"):
        TrainConfig(model="tiny", mode="disaggregated", device="cuda", experts_backend="triton", precision="fp8",
                    hop="partial_sums", fp8_counters_every=4)
    with pytest.raises(ValueError, match="greater than 0"):
        TrainConfig(model="tiny", fp8_counters_every=0)
    cfg = TrainConfig(model="tiny", mode="single", device="cuda", experts_backend="triton", precision="fp8",
                      fp8_counters_every=10)
    assert cfg.counters_every == 10 and TrainConfig(model="tiny").fp8_counters_every is None
    unset = dict(model="tiny", device="cuda", experts_backend="triton", precision="fp8", hop="partial_sums")
    assert TrainConfig(**unset, mode="single").counters_every == 10  # FP8_COUNTERS_EVERY
    assert TrainConfig(**unset, mode="disaggregated").counters_every == 1  # the ranks count every step
    assert TrainConfig(**unset, mode="single", fp8_counters_every=1).counters_every == 1
    # without FP8 every step is of one kind: one captured graph (61c6b38's bf16 runs captured a second)
    assert TrainConfig(model="tiny", mode="single", device="cuda", precision="bf16").counters_every == 1


def test_a_diverged_step_without_the_fp8_counters_says_its_update_was_skipped():
    from disagmoe.runtime.training.loop import diverged_report

    cfg = TrainConfig(model="tiny")
    record = {"step": 7, "loss": float("nan"), "grad_norm": float("nan"), "fp8_counted": False,
              "fp8_update_skipped": True}
    report = diverged_report(cfg, record, None)
    assert report.startswith("step 7: loss nan, grad_norm nan (not finite); the optimizer skipped its update "
                             "on the GPU")
    assert "skipped" not in diverged_report(cfg, {**record, "fp8_update_skipped": False}, None)


@pytest.mark.slow  # the FP8 expert kernels in Triton's interpreter
def test_an_fp8_step_without_the_counters_computes_what_a_counting_one_does(interpreted):
    """The same FP8 step (Triton's interpreter, fp32 parameters, the model set up by hand as the
    trainer does) with the counters and without: the same loss, gradient norm and updated weights
    to the bit (the counters only count), and only the counting step fills the buffer."""
    from disagmoe.kernels.fp8_stats import Fp8Stats
    from disagmoe.runtime.state.flat_adamw import FlatAdamW
    from disagmoe.runtime.training.trainer import fp8_fields, train_step_flat

    interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.fp8_ffn",
                "disagmoe.kernels.permute")
    data = TokenDataset(synthetic_corpus(1 << 12), 16, 2, 0, "train")
    optim = OptimConfig(lr=1e-3, warmup_steps=0)
    results = []
    for counting in (True, False):
        model = MoETransformer(load_model("tiny"), experts_backend="triton")
        model.init_weights(0)
        model.set_expert_precision("fp8")
        stats = Fp8Stats("cpu")
        model.set_fp8_stats(stats)
        model.set_fp8_counting(stats if counting else None)
        flat = FlatAdamW(model.named_parameters(), optim, torch.float32)
        result = train_step_flat(model, flat, data.batch(0), 1, optim.lr, 0.0,
                                 fp8_stats=stats if counting else None)
        assert bool(fp8_fields(result, torch.device("cpu"))) == counting
        assert stats.buffer.eq(0).all()  # counting: reset by the read; not: never written
        results.append((result.loss, result.grad_norm, [p.detach().clone() for p in model.parameters()]))
    (loss, norm, params), (loss_2, norm_2, params_2) = results
    assert (loss, norm) == (loss_2, norm_2)
    assert all(torch.equal(a, b) for a, b in zip(params, params_2, strict=True))


@pytest.mark.gpu
def test_cuda_fp8_steps_record_their_numerics_without_a_host_sync(tmp_path):
    """precision fp8 under set_sync_debug_mode('error') (forbid_host_syncs), eager and captured:
    every record has the FP8 fields, nothing saturated, the amax at 448 by construction."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    for graphs in ("off", "on"):
        cfg = tiny_run(tmp_path / graphs, model=model, steps=6, device="cuda", experts_backend="triton",
                       precision="fp8", forbid_host_syncs=True, cuda_graphs=graphs, batch_size=8, seq_len=128,
                       checkpoint_at_end=False, fp8_counters_every=1)
        train_single(cfg)
        records = read_metrics(tmp_path / graphs / "run" / METRICS_FILE)
        assert len(records) == 6
        for r in records:
            assert r["fp8_nonfinite"] == [] and r["fp8_saturated_share"] == 0.0, r
            assert r["fp8_amax"] == pytest.approx(448.0, rel=1e-6) and r["fp8_underflow_share"] < 0.1
            assert all(r["fp8_by_kind"][k]["elements"] > 0 for k in ("activations", "weights", "gradients"))
        elements = {tuple(r["fp8_by_kind"][k]["elements"] for k in ("activations", "weights", "gradients"))
                    for r in records}
        assert len(elements) == 1  # the same shapes every step: each record counts its own step (reset)
        assert any(r["cuda_graph"] for r in records) == (graphs == "on")


@pytest.mark.gpu
@pytest.mark.slow  # 25 s on an H100 (2026-12-06)
def test_cuda_fp8_steps_counting_every_other_step_train_as_counting_ones_eager_and_captured(tmp_path):
    """fp8_counters_every: 2 over 8 steps against every step counting, eager and captured (a graph for
    each kind of step, `GraphedStep`): the same losses and gradient norms (the counters only count;
    to 1e-6, the weight gradients' atomics may order sums differently between runs), the counters in
    the records of steps 1, 2, 4, 6 and 8 alone, every step after the warm-up replayed."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    runs = {}
    for graphs in ("off", "on"):
        for every in (1, 2):
            name = f"{graphs}-{every}"
            train_single(tiny_run(tmp_path / name, model=model, steps=8, device="cuda", experts_backend="triton",
                                  precision="fp8", cuda_graphs=graphs, fp8_counters_every=every, batch_size=8,
                                  seq_len=128, checkpoint_at_end=False))
            runs[name] = read_metrics(tmp_path / name / "run" / METRICS_FILE)
    for graphs in ("off", "on"):
        every_step, every_other = runs[f"{graphs}-1"], runs[f"{graphs}-2"]
        for a, b in zip(every_step, every_other, strict=True):
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-6)
            assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-6)
        assert [r["fp8_counted"] for r in every_other] == [True, True, False, True, False, True, False, True]
        assert [("fp8_amax" in r) for r in every_other] == [r["fp8_counted"] for r in every_other]
        assert all(r["fp8_counted"] for r in every_step)
        assert [r["cuda_graph"] for r in every_other] == [graphs == "on" and i >= 3 for i in range(8)]


@pytest.mark.gpu
def test_cuda_the_fp8_forward_and_backward_recipes_reach_the_trainers_experts(tmp_path):
    """fp8_expert_forward / fp8_expert_backward set on the run reach every routed-expert module of the
    single trainer, and a captured step with the down GEMM alone in FP8 trains (finite losses, the
    activations counted: the SwiGLU output's quantisation, not x's)."""
    from disagmoe.model.experts import RoutedExperts
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    cfg = tiny_run(tmp_path, model=model, steps=5, device="cuda", experts_backend="triton", precision="fp8",
                   fp8_expert_forward="down", fp8_expert_backward="bf16", cuda_graphs="on", batch_size=8,
                   seq_len=128, checkpoint_at_end=False)
    trainer = SingleProcessTrainer(cfg)
    experts = [m for m in trainer.model.modules() if isinstance(m, RoutedExperts)]
    assert experts and all((e.fp8_forward, e.fp8_backward) == ("down", "bf16") for e in experts)
    trainer.run()
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert len(records) == 5 and all(math.isfinite(r["loss"]) for r in records)
    assert records[-1]["fp8_by_kind"]["activations"]["elements"] > 0


@pytest.mark.gpu
def test_cuda_fp8_emulate_reaches_the_trainers_experts_and_projections_and_trains(tmp_path):
    """fp8_emulate on the single trainer: every routed-expert module and dense projection runs its FP8
    GEMMs emulated (quantise-dequantise into the bf16 GEMMs), and the run trains with the quantisers
    still counting (the activations' and the dense projections')."""
    from disagmoe.model.experts import RoutedExperts
    from disagmoe.model.layers import DeferrableLinear
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    cfg = tiny_run(tmp_path, model=model, steps=3, device="cuda", experts_backend="triton", precision="fp8",
                   fp8_expert_forward="gate-up", fp8_expert_backward="bf16", fp8_emulate=True, fp8_dense=True,
                   batch_size=8, seq_len=128, checkpoint_at_end=False)
    trainer = SingleProcessTrainer(cfg)
    experts = [m for m in trainer.model.modules() if isinstance(m, RoutedExperts)]
    linears = [m for m in trainer.model.modules() if isinstance(m, DeferrableLinear)]
    assert experts and all(e.fp8_emulate and e.fp8_forward == "gate-up" for e in experts)
    assert linears and all(m.fp8 and m.fp8_emulate for m in linears)
    trainer.run()
    records = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert len(records) == 3 and all(math.isfinite(r["loss"]) for r in records)
    assert all(records[-1]["fp8_by_kind"][kind]["elements"] > 0 for kind in ("activations", "dense"))


@pytest.mark.gpu
def test_cuda_fp8_gluon_reaches_the_ffns_kernel_choice(tmp_path):
    """fp8_gluon on the single trainer sets the FFN's Gluon row, SwiGLU and weight-gradient paths (process-wide,
    `fp8_ffn.set_gluon`) as the run asks, each FP8 run setting it whatever the last one left."""
    from disagmoe.kernels import fp8_ffn
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    try:
        for gluon in (True, False):
            SingleProcessTrainer(tiny_run(tmp_path, model=model, device="cuda", experts_backend="triton",
                                          precision="fp8", fp8_gluon=gluon, checkpoint_at_end=False))
            assert (fp8_ffn._gluon.rows, fp8_ffn._gluon.swiglu, fp8_ffn._gluon.wgrad) == (gluon, gluon, gluon)
    finally:
        fp8_ffn.set_gluon(False)


@pytest.mark.gpu
def test_cuda_a_non_finite_fp8_scale_skips_the_update_on_the_device():
    """An inf planted in one expert's compute weight (bf16; its fp32 master stays finite): the step's
    weight quantiser meets it, the optimizer skips its update on the GPU under the host-sync check,
    so the masters are the previous step's and the compute copy is rewritten from them (finite)."""
    from disagmoe.kernels.fp8_stats import Fp8Stats
    from disagmoe.runtime.state.flat_adamw import FlatAdamW
    from disagmoe.runtime.training.trainer import fp8_fields, train_step_flat

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")
    cuda = torch.device("cuda")
    data = TokenDataset(synthetic_corpus(1 << 14), 128, 8, 0, "train")
    optim = OptimConfig(lr=1e-3, warmup_steps=0)
    model_cfg = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    model = MoETransformer(model_cfg, experts_backend="triton")
    model.init_weights(0)
    model.to(cuda)
    model.set_expert_precision("fp8")
    stats = Fp8Stats(cuda)
    model.set_fp8_stats(stats)
    flat = FlatAdamW(model.named_parameters(), optim, torch.bfloat16)
    first = fp8_fields(train_step_flat(model, flat, data.batch(0), 2, optim.lr, 1.0, True, stats), cuda)
    assert first["fp8_nonfinite"] == []
    masters = [b.master_S.clone() for b in flat.buckets]
    experts = next(m for m in model.modules() if hasattr(m, "w13_EH2F"))
    with torch.no_grad():
        experts.w13_EH2F[0, 0, 0] = float("inf")
    fields = fp8_fields(train_step_flat(model, flat, data.batch(1), 2, optim.lr, 1.0, True, stats), cuda)
    assert "weights" in fields["fp8_nonfinite"] and fields["fp8_update_skipped"] is True
    for b, before in zip(flat.buckets, masters, strict=True):
        assert torch.equal(b.master_S, before), b.name
    assert torch.isfinite(experts.w13_EH2F).all()


@pytest.mark.slow  # four short runs: more than a few seconds on 2 cores
def test_offloaded_optimizer_takes_the_same_steps_and_resumes_across_offload(tmp_path):
    """offload_optimizer on the CPU runs the bucketed path (1 MiB slots, several per bucket of the tiny
    model): the same losses bit for bit as the on-device FlatAdamW, and a checkpoint written with
    offload resumes without it and the other way round, continuing bit for bit."""
    runs = {}
    for offload in (False, True):
        cfg = tiny_run(tmp_path / str(offload), steps=6, checkpoint_every=3, precision="bf16",
                       offload_optimizer=offload, offload_bucket_mib=1)
        train_single(cfg)
        runs[offload] = cfg
    losses = {o: [r["loss"] for r in read_metrics(tmp_path / str(o) / "run" / METRICS_FILE)] for o in runs}
    assert losses[True] == losses[False]
    for saved in (False, True):
        resumed_dir = tmp_path / f"resumed-{saved}" / "run"
        shutil.copytree(checkpoint_dir(tmp_path / str(saved) / "run" / CHECKPOINTS_DIR, 3),
                        checkpoint_dir(resumed_dir / CHECKPOINTS_DIR, 3))
        train_single(runs[not saved].model_copy(update={"out_dir": str(resumed_dir), "resume": True}))
        assert [r["loss"] for r in read_metrics(resumed_dir / METRICS_FILE)] == losses[saved][3:]


def test_the_single_trainer_builds_on_meta_and_initialises_as_the_model_does(tmp_path):
    """The trainer allocates its model where it runs and draws each tensor once: the parameters and
    buffers equal a model built and initialised on the CPU with the run's seed, bit for bit."""
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    cfg = tiny_run(tmp_path, seed=7, model=load_model("tiny").model_copy(
        update={"router": load_model("tiny").router.model_copy(update={"bias_balancing": True})}))
    trainer = SingleProcessTrainer(cfg)
    reference = MoETransformer(cfg.model)
    reference.init_weights(7)
    got, want = dict(trainer.model.state_dict()), dict(reference.state_dict())
    assert got.keys() == want.keys() and any("expert_bias" in k for k in got)
    for name, tensor in want.items():
        assert torch.equal(got[name].float(), tensor.float()), name


def _first_touch_runs(cfg: TrainConfig, tmp_path, monkeypatch, steps: int, poison: bool):
    """(records, main gradients after each step, final masters) of `cfg` trained by the single trainer
    with the experts' first-touch main gradients (`kernels.first_touch`) and with every main gradient
    zeroed (first touch switched off); `poison`: NaN into the first-touch gradients before each step
    (zero_grad must not need them zero)."""
    from disagmoe.model.experts import RoutedExperts
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    runs = {}
    for first_touch in (False, True):
        with monkeypatch.context() as patch:
            if not first_touch:
                patch.setattr(RoutedExperts, "first_touch_weights", lambda self: ())
            trainer = SingleProcessTrainer(cfg.model_copy(update={"out_dir": str(tmp_path / str(first_touch))}))
        opted = [main for b in trainer.optimizer.buckets for main in b.first_touch]
        assert len(opted) == (2 * trainer.model_cfg.num_moe_layers if first_touch else 0)  # w13 and w2 per layer
        records, grads = [], []
        for _ in range(steps):
            if poison:
                for main in opted:
                    main.fill_(float("nan"))
            record = trainer._train_one_step()
            records.append((record["loss"], record["grad_norm"], record["expert_load"]))
            grads.append([b.grad_N.clone() for b in trainer.optimizer.buckets])
        runs[first_touch] = records, grads, [b.master_S.clone() for b in trainer.optimizer.buckets]
    return runs[False], runs[True]


@pytest.mark.slow  # six steps of the Triton experts in the interpreter: about 40 s on 2 cores
def test_first_touch_steps_equal_zeroing_steps_bit_for_bit(interpreted, tmp_path, monkeypatch):
    """The fast path's step (FlatAdamW over fp32 parameters with bf16 moments: the interpreter runs
    fp32) with the triton experts on CPU, three micro-batches, three steps: the experts' main
    gradients left to their first weight-gradient launch (NaN before each step) give the same losses,
    grad norms, main gradients and parameters, to the bit, as zeroing every main gradient."""
    interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.moe_ffn")
    cfg = tiny_run(tmp_path, steps=3, batch_size=6, micro_batches=3, seq_len=12, precision="fp32",
                   experts_backend="triton", checkpoint_at_end=False,
                   optim=OptimConfig(lr=3e-3, warmup_steps=1, grad_clip=0.5, state_dtype="bf16"))
    (records_a, grads_a, masters_a), (records_b, grads_b, masters_b) = _first_touch_runs(
        cfg, tmp_path, monkeypatch, 3, poison=True)
    assert records_b == records_a
    for step_a, step_b in zip(grads_a, grads_b, strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.isfinite(b).all() and torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(masters_a, masters_b, strict=True))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("graphs", ["off", "on"])
def test_cuda_first_touch_steps_equal_zeroing_steps_bit_for_bit(tmp_path, monkeypatch, graphs, precision):
    """The same on a GPU (bf16 parameters, the triton experts with the permute kernels, bf16 or FP8,
    eager and captured: the stores and adds decided by call order replay as captured), six steps."""
    if precision == "fp8" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores (sm_89+)")
    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    cfg = tiny_run(tmp_path, model=model, steps=6, device="cuda", experts_backend="triton", batch_size=8, seq_len=128,
                   cuda_graphs=graphs, checkpoint_at_end=False, precision=precision,
                   optim=OptimConfig(lr=3e-3, warmup_steps=2, grad_clip=0.5))
    zeroing, first_touch = _first_touch_runs(cfg, tmp_path, monkeypatch, 6, poison=False)
    if zeroing[0] != first_touch[0]:
        again, _ = _first_touch_runs(cfg, tmp_path / "again", monkeypatch, 6, poison=False)
        if again[0] != zeroing[0]:  # a kernel with atomics: two zeroing runs differ too
            pytest.fail("two zeroing runs differ: bit-for-bit equality cannot be judged with these kernels")
    assert first_touch[0] == zeroing[0]
    for step_a, step_b in zip(zeroing[1], first_touch[1], strict=True):
        for a, b in zip(step_a, step_b, strict=True):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
    assert all(torch.equal(a, b) for a, b in zip(zeroing[2], first_touch[2], strict=True))


def test_a_pinned_data_seed_varies_the_initialisation_alone(tmp_path):
    """data.seed pins the batches: runs of seed 0 and 1 with data.seed 0 see the same batches and start
    from different weights; without it the seed moves both (`TrainConfig.data_seed`)."""
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    def trainer(seed: int, data_seed: int | None) -> SingleProcessTrainer:
        return SingleProcessTrainer(tiny_run(tmp_path / f"{seed}-{data_seed}", seed=seed,
                                             data=DataConfig(seed=data_seed)))

    base, other_init, other_both = trainer(0, None), trainer(1, 0), trainer(1, None)
    assert (base.cfg.data_seed, other_init.cfg.data_seed, other_both.cfg.data_seed) == (0, 0, 1)
    for step in range(3):
        assert torch.equal(base.train_data.batch(step), other_init.train_data.batch(step))
        assert not torch.equal(base.train_data.batch(step), other_both.train_data.batch(step))
    weights = [next(t.model.parameters()).detach() for t in (base, other_init)]
    assert not torch.equal(*weights)


def test_a_run_that_left_the_dense_recipe_unset_keeps_it_bf16_where_blockwise_cannot_run(monkeypatch):
    """`resolve_dense_fp8`: precision fp8 with fp8_dense and fp8_dense_scaling unset on a device that
    cannot scale blockwise (an Ada GPU here) trains its dense projections in bf16 (`fp8_dense: false`,
    so the memory model, records and checkpoints say so) and says why in one RunWarning; on Hopper,
    or where the run asked for a recipe (refused later with the fix) or emulates, nothing changes."""
    import warnings

    from disagmoe.kernels import fp8_dense
    from disagmoe.runtime.training.trainer import resolve_dense_fp8

    fp8 = dict(model="tiny", device="cuda", experts_backend="triton", precision="fp8")
    unset = TrainConfig(**fp8)
    gpu = torch.device("cuda")
    monkeypatch.setattr(fp8_dense, "blockwise_unavailable", lambda device: "this is compute capability (8, 9)")
    with pytest.warns(RunWarning, match=r"keeps the dense projections in bf16 here: their default FP8 recipe is "
                                        r"blockwise, and this is compute capability \(8, 9\); set fp8_dense: true "
                                        "with fp8_dense_scaling: rowwise") as warned:
        kept = resolve_dense_fp8(unset, gpu)
    assert len(warned) == 1
    assert (kept.fp8_dense, kept.dense_precision, kept.dense_fp8_scaling) == (False, "bf16", None)
    asked = [TrainConfig(**fp8, fp8_dense=True), TrainConfig(**fp8, fp8_dense_scaling="blockwise"),
             TrainConfig(**fp8, fp8_dense_scaling="rowwise"), TrainConfig(**fp8, fp8_dense=False),
             TrainConfig(**fp8, fp8_emulate=True, fp8_expert_backward="bf16"),
             TrainConfig(**{**fp8, "precision": "bf16"})]
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunWarning)
        assert all(resolve_dense_fp8(cfg, gpu) is cfg for cfg in asked)
        monkeypatch.setattr(fp8_dense, "blockwise_unavailable", lambda device: None)  # Hopper
        assert resolve_dense_fp8(unset, gpu) is unset


def test_set_dense_fp8_names_the_linears_blockwise_keeps_in_bf16_and_refuses_the_cpu_unless_emulated():
    """The trainer's and the workers' `set_dense_fp8`: blockwise off Hopper is refused with the fixes
    unless emulated; emulated, the linears off the 512 grid (tiny's are all off it) stay bf16 and one
    RunWarning counts them by role; rowwise warns nothing."""
    import warnings

    from disagmoe.kernels.fp8_stats import Fp8Stats
    from disagmoe.model.layers import DeferrableLinear
    from disagmoe.runtime.failures import RunWarning
    from disagmoe.runtime.training.trainer import set_dense_fp8

    model = MoETransformer(load_model("tiny"))
    cpu = torch.device("cpu")
    with pytest.raises(ValueError, match="Hopper GPUs.*fp8_dense_scaling: rowwise"):
        set_dense_fp8(model, Fp8Stats("cpu"), "blockwise", False, cpu)
    with pytest.warns(RunWarning, match=r"keeps 21 dense linear\(s\) in bf16.*attention\.wq x3.*moe\.shared_experts\.w1 x2"):
        kept = set_dense_fp8(model, Fp8Stats("cpu"), "blockwise", True, cpu)
    linears = [m for m in model.modules() if isinstance(m, DeferrableLinear)]
    assert len(kept) == len(linears) and not any(m.fp8 for m in linears)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RunWarning)
        assert set_dense_fp8(model, Fp8Stats("cpu"), "rowwise", True, cpu) == []
    assert all(m.fp8 and m.fp8_scaling == "rowwise" for m in linears)


def test_a_run_sets_whether_its_loss_runs_the_fused_kernel(tmp_path, monkeypatch):
    """`fused_loss` (default true) is the process's default for a CUDA chunk's softmax (`model.loss.set_fused_loss`,
    as `fuse_elementwise` sets the compiled norms'): false runs torch's ops, the A/B `bench train --variant` reads."""
    from disagmoe.model import loss
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    monkeypatch.setattr(loss._Fused, "enabled", True)  # restored after the test
    assert TrainConfig.model_fields["fused_loss"].default is True
    SingleProcessTrainer(tiny_run(tmp_path, fused_loss=False))
    assert loss._Fused.enabled is False
    SingleProcessTrainer(tiny_run(tmp_path))
    assert loss._Fused.enabled is True
