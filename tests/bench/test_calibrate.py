"""`bench calibrate`: the fits and merges on a CPU, the command's file with injected measurements
(read back by `plan` and `roofline`), and the real measurements on a GPU."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from disagmoe.bench import calibrate as cal
from disagmoe.bench.hardware import Measured
from disagmoe.bench.probe import PROBE_FINGERPRINT, PROBE_VERSION
from disagmoe.cli.app import app
from disagmoe.config import Calibration, HardwareConfig, LinkCost, Plan, RatePoint, load_hardware
from disagmoe.model_ref import load_model
from disagmoe.roofline.calibration import compute_ceilings, fitted_fraction
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.stages import Work

runner = CliRunner()
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _ffn_case(hidden: int, ffn: int, experts: int = 2, rows: int = 8):
    """(x, w13, w2 as Parameters, offsets, dy, the generator that drew them, for later draws) of
    `experts` experts with `rows` rows each: the weight-gradient probes' tests' inputs."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(experts * rows, hidden, generator=gen)
    w13 = torch.nn.Parameter(torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5)
    w2 = torch.nn.Parameter(torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5)
    offsets = torch.arange(1, experts + 1, dtype=torch.int32) * rows
    return x, w13, w2, offsets, torch.randn(experts * rows, hidden, generator=gen), gen


def test_fit_link_recovers_latency_and_bandwidth_of_a_line():
    latency_s, bytes_per_s = 12e-6, 250e9
    sizes = [2.0**k for k in range(14, 28, 3)]
    link = cal.fit_link(sizes, [latency_s + b / bytes_per_s for b in sizes])
    assert link.latency_us == pytest.approx(12.0, rel=1e-6) and link.gbps == pytest.approx(250.0, rel=1e-6)
    with pytest.raises(ValueError, match="two sizes"):
        cal.fit_link([1.0, 1.0], [1.0, 2.0])


def _ceil(hw: HardwareConfig | None = None) -> Ceilings:
    return Ceilings.of(hw or load_hardware("h200-sxm"))


def test_a_fitted_fraction_prices_its_work_at_the_measured_time():
    ceil = _ceil()
    compute_bound = Work(flops=1e12, hbm_bytes=1e8)
    seconds = 1e12 / (0.4 * ceil.peak_flops_per_s)
    f = fitted_fraction(compute_bound, seconds, ceil)
    assert f == pytest.approx(0.4) and compute_ceilings(ceil, f).time(compute_bound) == pytest.approx(seconds)
    # memory-heavy work (the weight gradients' fp32 main gradients): still the measured time, where
    # dividing the FLOPs alone by it would price the HBM traffic as overlapped
    memory_heavy = Work(flops=1e11, hbm_bytes=2e10)
    seconds = 3 * memory_heavy.hbm_bytes / ceil.hbm_bytes_per_s
    assert compute_ceilings(ceil, fitted_fraction(memory_heavy, seconds, ceil)).time(memory_heavy) == pytest.approx(seconds)
    # faster than its HBM roof: no rate reproduces it; compute stays off the critical path
    fast = fitted_fraction(memory_heavy, 0.5 * memory_heavy.hbm_bytes / ceil.hbm_bytes_per_s, ceil)
    assert compute_ceilings(ceil, fast).time(memory_heavy) == pytest.approx(memory_heavy.hbm_bytes / ceil.hbm_bytes_per_s)
    assert fitted_fraction(compute_bound, 0.0, ceil) == 1.0  # no slower than its fixed part: the peak, never infinite


def test_the_expert_curve_runs_the_models_experts_up_to_one_ops_rows():
    qwen, deepseek, tiny = load_model("qwen3-30b-a3b"), load_model("deepseek-v3"), load_model("tiny")
    assert [cal.curve_experts(qwen, r) for r in cal.ROWS_PER_EXPERT] == [128, 128, 128, 128, 128, 128, 64]
    assert cal.curve_experts(deepseek, 16) == 256 and cal.curve_experts(deepseek, cal.ROWS_PER_OP * 2) == 1
    assert cal.curve_experts(tiny, 1) == tiny.num_experts


# rows per expert -> (forward, data gradients, weight gradients) fractions of peak of a made-up GPU;
# the weight gradients are timed at this fraction of their FLOPs or their HBM roof, whichever is slower
FRACTIONS = {16: (0.05, 0.04, 0.03), 64: (0.15, 0.12, 0.08), 256: (0.3, 0.25, 0.15), 512: (0.4, 0.35, 0.2),
             1024: (0.55, 0.45, 0.3), 2048: (0.6, 0.5, 0.35), 4096: (0.7, 0.6, 0.45)}
WGRAD_HBM_SLOWDOWN = 1.8  # the made-up kernel's weight gradients take this times their HBM roof, at the least
OPTIMIZER_HBM = 0.65  # the made-up optimizer's passes run at this fraction of the HBM rate
PERMUTE_HBM = 0.55  # the made-up permute and combine kernels, the same
NORMS_HBM = 0.45  # the made-up elementwise kernels, the same
PROJECTIONS = {4096: (0.55, 0.5), 8192: (0.62, 0.58), 32768: (0.7, 0.66)}  # tokens -> made-up GEMM rates
EXPERT_FIXED = cal.ExpertTimes(25e-6, 55e-6, 30e-6)
SDPA_FIXED = cal.PassTimes(8e-6, 8e-6 + 30e-6)
MLA_FIXED = cal.PassTimes(10e-6, 10e-6 + 40e-6)
MLA_ATTENTION = (0.45, 0.3)  # the made-up GPU's forward and backward rates on MLA's heads
MLA_PROJECTIONS = {4096: (0.5, 0.45), 8192: (0.57, 0.52), 32768: (0.66, 0.6)}  # and on MLA's projections
BLOCK_FIXED = cal.PassTimes(60e-6, 60e-6 + 210e-6)


def _attention_timings(model, fractions: tuple[float, float], fixed: cal.PassTimes,
                       ceil: Ceilings) -> dict[int, cal.PassTimes]:
    """The attention probe's times on `model`'s heads of a made-up GPU at `fractions` (forward,
    backward) of the peak on top of `fixed`."""
    from disagmoe.roofline.stages import attention_core_passes

    times = {}
    for s in cal.SEQ_LENS:
        fwd, bwd = attention_core_passes(model, cal.attention_batch(s) * s, s)
        f_s = fixed.fwd_s + fwd.flops / (fractions[0] * ceil.peak_flops_per_s)
        times[s] = cal.PassTimes(f_s, f_s + fixed.bwd_s + bwd.flops / (fractions[1] * ceil.peak_flops_per_s))
    return times


def _timings(model, ceil: Ceilings) -> cal.Timings:
    """GPU kernel times of a made-up GPU that runs each probe at FRACTIONS of the peak on top of
    the fixed times above (the shape a real GPU's timings have; no measured figure)."""
    from disagmoe.roofline import stages
    from disagmoe.roofline.stages import expert_passes

    peak = ceil.peak_flops_per_s
    gemm = {}
    for r, (f, d, w) in FRACTIONS.items():
        experts = cal.curve_experts(model, r)
        passes = expert_passes(model, r * experts, experts)
        fwd, dgrad = passes["routed experts"]
        wgrad = passes["expert weight grads"][1]
        wgrad_s = max(wgrad.flops / (w * peak), WGRAD_HBM_SLOWDOWN * wgrad.hbm_bytes / ceil.hbm_bytes_per_s)
        gemm[r] = cal.ExpertTimes(EXPERT_FIXED.fwd_s + fwd.flops / (f * peak),
                                  EXPERT_FIXED.dgrad_s + dgrad.flops / (d * peak), EXPERT_FIXED.wgrad_s + wgrad_s)
    attention = _attention_timings(model, (0.5, 0.4), SDPA_FIXED, ceil)
    mla = _attention_timings(cal.mla_probe_model(model), MLA_ATTENTION, MLA_FIXED, ceil)
    optimizer_s = cal.optimizer_probe_work().hbm_bytes / (OPTIMIZER_HBM * ceil.hbm_bytes_per_s)  # the probe's passes
    pairs = stages.permute(model, cal.PERMUTE_TOKENS * model.top_k).hbm_bytes / (PERMUTE_HBM * ceil.hbm_bytes_per_s)
    permute = cal.PassTimes(pairs, 2 * pairs)  # forward and backward move the same bytes (the stage's count)
    projections, projections_mla = {}, {}
    for rates, m, out in ((PROJECTIONS, model, projections),
                          (MLA_PROJECTIONS, cal.mla_probe_model(model), projections_mla)):
        for n, (f, b) in rates.items():
            fwd, bwd = stages.attention_projection_passes(m, n)
            out[n] = cal.PassTimes(fwd.flops / (f * peak), fwd.flops / (f * peak) + bwd.flops / (b * peak))
    n_fwd, n_bwd = stages.norms_and_residuals(model, cal.PERMUTE_TOKENS)
    norms = cal.PassTimes(n_fwd.hbm_bytes / (NORMS_HBM * ceil.hbm_bytes_per_s),
                          (n_fwd.hbm_bytes + n_bwd.hbm_bytes) / (NORMS_HBM * ceil.hbm_bytes_per_s))
    return cal.Timings(gemm, EXPERT_FIXED, attention, SDPA_FIXED, BLOCK_FIXED, optimizer_s, permute, projections, norms,
                       attention_mla=mla, attention_mla_fixed=MLA_FIXED, projections_mla=projections_mla)


def test_the_terms_come_back_from_the_gpu_kernel_times():
    model, ceil = load_model("qwen3-30b-a3b"), _ceil()
    calib = cal.calibration_from(_timings(model, ceil), model, ceil, "made up")
    assert [(p.at, p.fwd, p.bwd) for p in calib.expert_gemm] == [
        (r, pytest.approx(f), pytest.approx(d)) for r, (f, d, _) in FRACTIONS.items()]
    assert all(p.wgrad is not None and p.wgrad <= FRACTIONS[p.at][2] * (1 + 1e-9) for p in calib.expert_gemm)
    assert all((p.fwd, p.bwd) == (pytest.approx(0.5), pytest.approx(0.4)) for p in calib.attention)
    assert [(p.at, p.fwd, p.bwd) for p in calib.attention_mla] == [
        (s, pytest.approx(MLA_ATTENTION[0]), pytest.approx(MLA_ATTENTION[1])) for s in cal.SEQ_LENS]
    assert [(p.at, p.fwd, p.bwd) for p in calib.projections] == [
        (n, pytest.approx(f), pytest.approx(b)) for n, (f, b) in PROJECTIONS.items()]
    assert [(p.at, p.fwd, p.bwd) for p in calib.projections_mla] == [
        (n, pytest.approx(f), pytest.approx(b)) for n, (f, b) in MLA_PROJECTIONS.items()]
    assert calib.hbm_fraction == {"optimizer": pytest.approx(OPTIMIZER_HBM), "permute": pytest.approx(PERMUTE_HBM),
                                  "norms": pytest.approx(NORMS_HBM)}
    assert calib.op_fixed_us == {"ExpertForward": pytest.approx(25.0), "ExpertBackward": pytest.approx(85.0),
                                 "AttentionForward": pytest.approx(60.0), "AttentionBackward": pytest.approx(210.0)}


def test_an_expert_op_of_the_probes_size_is_priced_at_the_probes_gpu_time():
    """The fixed cost is counted once and the fp32 main-gradient traffic once: one GPU, 1 x 4,096
    tokens, top-8 of 128 experts is the probe's own op (256 rows of each of 128 experts); its
    forward is priced at exactly the probe's forward time, its backward at exactly the probe's
    data-gradient plus weight-gradient time."""
    from disagmoe.placement.cost import Candidates, evaluate
    from disagmoe.placement.replay import op_times
    from disagmoe.placement.solver import problem_of
    from disagmoe.config import ClusterConfig, PlanConfig

    model, hw = load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    timings = _timings(model, _ceil(hw))
    hw = hw.model_copy(update={"calibration": cal.calibration_from(timings, model, _ceil(hw), "made up")})
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=hw, num_gpus=1), seq_len=4096,
                     global_batch_tokens=4096)
    prob = problem_of(req)
    times = op_times(evaluate(prob, Candidates.one(0, 1, 1, 1, 1, colocated=True)), prob)
    probe = timings.expert_gemm[256]
    assert times.expert_forward == pytest.approx(probe.fwd_s, rel=1e-9)
    assert times.expert_backward == pytest.approx(probe.dgrad_s + probe.wgrad_s, rel=1e-9)


def test_the_qwen3_configs_expert_stages_are_priced_at_the_probes_times_at_its_rows_per_expert():
    """configs/h200x2-qwen3-30b.yaml on one GPU at 2 micro-batches: 8 x 4,096 tokens x top-8 over
    128 experts is 2,048 rows per expert, a curve point the probe ran on all 128 experts: each
    expert stage of the planner is priced at exactly the probe's time of that pass, the weight
    gradients with their fp32 main-gradient traffic included once. The probe's launches all
    accumulate, so that holds with first touch off; on (the run's: the step's first launch stores
    its main gradient, and the optimizer does not zero it) the optimizer costs less, and the weight
    gradients no more (compute binds them here)."""
    from disagmoe.config import load_train_config
    from disagmoe.placement.cost import evaluate
    from disagmoe.placement.solver import problem_of
    from disagmoe.placement.trace_compare import run_request

    cfg = load_train_config(CONFIGS / "h200x2-qwen3-30b.yaml", ["mode=single", "micro_batches=2",
                                                                "expert_wgrad_pairs=off"])  # a launch per micro-batch
    model, hw = load_model(cfg.model), load_hardware("h200-sxm")
    timings = _timings(model, _ceil(hw))
    hw = hw.model_copy(update={"calibration": cal.calibration_from(timings, model, _ceil(hw), "made up")})
    req, cand = run_request(cfg, model, hw)
    run_prob = problem_of(req)
    assert run_prob.first_touch
    prob = dataclasses.replace(run_prob, first_touch=False)
    stages = evaluate(prob, cand).stages
    touched = evaluate(run_prob, cand).stages
    cost = lambda of, name: _first(of[name].time(True, prob.ceilings))  # noqa: E731
    assert cost(touched, "optimizer (experts)") < cost(stages, "optimizer (experts)")
    assert cost(touched, "expert weight grads") <= cost(stages, "expert weight grads")
    assert _first(touched["expert weight grads"].bwd.hbm_bytes) < _first(stages["expert weight grads"].bwd.hbm_bytes)
    probe, fixed = timings.expert_gemm[2048], timings.expert_fixed
    at = lambda name, bwd: float(np.asarray(stages[name].time(bwd, prob.ceilings)).ravel()[0])  # noqa: E731
    assert at("routed experts", False) == pytest.approx(probe.fwd_s - fixed.fwd_s, rel=1e-9)
    assert at("routed experts", True) == pytest.approx(probe.dgrad_s - fixed.dgrad_s, rel=1e-9)
    assert at("expert weight grads", True) == pytest.approx(probe.wgrad_s - fixed.wgrad_s, rel=1e-9)
    # the optimizer at the probe's rate per byte: its measured seconds per parameter, whatever the count
    held = float(np.asarray(evaluate(prob, cand).expert_params).ravel()[0])
    assert at("optimizer (experts)", True) == pytest.approx(timings.optimizer_s * held / cal.OPTIMIZER_PARAMS, rel=1e-9)
    # the permute and combine per token the probe's (8 x 4,096 tokens per micro-batch: the probe's own count)
    assert cfg.batch_size // cfg.micro_batches * cfg.seq_len == cal.PERMUTE_TOKENS
    assert cal.PERMUTE_TOKENS in cal.PROJECTION_TOKENS  # and a point of the projection curve
    assert at("norms, RoPE, residual adds", False) + at("norms, RoPE, residual adds", True) == pytest.approx(
        timings.norms.fwd_bwd_s, rel=1e-9)
    projections = timings.projections[cal.PERMUTE_TOKENS]
    assert at("attention projections", False) == pytest.approx(projections.fwd_s, rel=1e-9)
    assert at("attention projections", True) == pytest.approx(projections.bwd_s, rel=1e-9)
    assert at("permute / combine sum", False) + at("permute / combine sum", True) == pytest.approx(
        timings.permute.fwd_bwd_s, rel=1e-9)


def test_probe_and_planner_price_the_expert_stages_with_one_function(monkeypatch):
    """`bench calibrate` fits against, and `placement.cost.evaluate` prices with, the same
    `roofline.stages.expert_passes`: a change to it reaches both (here: a spy sees both call it)."""
    from disagmoe.placement.cost import Candidates, evaluate
    from disagmoe.placement.solver import problem_of
    from disagmoe.config import ClusterConfig, PlanConfig
    from disagmoe.roofline import stages

    model = load_model("qwen3-30b-a3b")
    timings = _timings(model, _ceil())
    calls = []
    real = stages.expert_passes
    monkeypatch.setattr(stages, "expert_passes", lambda *a: calls.append(a) or real(*a))
    cal.calibration_from(timings, model, _ceil(), "made up")
    fitted = len(calls)
    assert fitted == len(cal.ROWS_PER_EXPERT)
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=1),
                     seq_len=4096, global_batch_tokens=4096)
    evaluate(problem_of(req), Candidates.one(0, 1, 1, 1, 1, colocated=True))
    assert len(calls) > fitted


def test_merge_keeps_the_terms_a_run_could_not_measure():
    old = Calibration(p2p=LinkCost(latency_us=10, gbps=300), op_fixed_us={"Loss": 5.0, "ExpertForward": 9.0},
                      attention=[RatePoint(at=1024, fwd=0.4, bwd=0.3)])
    new = Calibration(source="one GPU", expert_gemm=[RatePoint(at=64, fwd=0.3, bwd=0.2)],
                      op_fixed_us={"ExpertForward": 20.0})
    merged = cal.merge_calibration(old, new)
    assert merged.p2p == old.p2p and merged.attention == old.attention and merged.expert_gemm == new.expert_gemm
    assert merged.op_fixed_us == {"Loss": 5.0, "ExpertForward": 20.0} and merged.source == "one GPU"


def _fake_measure(preset: HardwareConfig, model, backend: str) -> cal.Measurements:
    """Measurements as a GPU run would return them, derived from the preset (none typed in)."""
    peak = preset.bf16_tflops
    curve = [RatePoint(at=r, fwd=min(1.0, 0.1 * (i + 1)), bwd=min(1.0, 0.08 * (i + 1)), wgrad=min(1.0, 0.05 * (i + 1)))
             for i, r in enumerate(cal.ROWS_PER_EXPERT)]
    sizes = list(cal.MESSAGE_BYTES)
    line = lambda lat, gbps: [lat + b / (gbps * 1e9) for b in sizes]  # noqa: E731
    links = {k: cal.fit_link(sizes, line(20e-6, 0.5 * preset.nvlink_gbps)) for k in ("p2p", "all_reduce", "all_to_all")}
    attention = [p.model_copy(update={"wgrad": None}) for p in curve]
    projections = [RatePoint(at=n, fwd=0.6, bwd=0.55) for n in cal.PROJECTION_TOKENS]
    calib = Calibration(source=f"fake {backend}", expert_gemm=curve, attention=attention, projections=projections,
                        hbm_fraction={"optimizer": 0.7, "permute": 0.5},
                        op_fixed_us={"AttentionForward": 100.0, "ExpertForward": 40.0}, **links)
    hw = Measured(matmul_tflops=0.7 * peak, hbm_gbps=0.8 * preset.hbm_gbps, nvlink_gbps=0.8 * preset.nvlink_gbps,
                  nvlink_latency_us=8.0)
    return cal.Measurements(hw, calib)


def test_the_command_writes_a_yaml_that_plan_and_roofline_accept(tmp_path, monkeypatch):
    monkeypatch.setattr(cal, "measure_all", _fake_measure)
    monkeypatch.setattr(cal.hardware, "environment", lambda device: {"gpu": "fake"})
    out = tmp_path / "h200-calibrated.yaml"
    r = runner.invoke(app, ["bench", "calibrate", "--hardware", "h200-sxm", "--out", str(out)])
    assert r.exit_code == 0, r.output
    text = out.read_text()
    assert text.startswith("# Calibrated by `disagmoe bench calibrate --hardware h200-sxm")
    hw = HardwareConfig.model_validate(yaml.safe_load(text))
    assert hw.name == "h200-sxm-calibrated" and hw.calibration.source == "fake grouped_mm"
    assert hw.calibration.hbm_fraction == {"optimizer": 0.7, "permute": 0.5} and len(hw.calibration.projections) == 3
    assert all(p.wgrad is not None for p in hw.calibration.expert_gemm)
    assert (hw.calibration.probe_version, hw.calibration.probe_fingerprint) == (PROBE_VERSION, PROBE_FINGERPRINT)
    printed = r.stdout[: r.stdout.rindex("calibrated hardware written to")]
    assert yaml.safe_load(printed) == yaml.safe_load(text)  # what it prints is the file, never wrapped
    assert hw.efficiency.matmul == pytest.approx(0.7) and hw.bf16_tflops == load_hardware("h200-sxm").bf16_tflops

    r = runner.invoke(app, ["plan", "--model", "qwen3-30b-a3b", "--hardware", str(out), "--gpus", "8",
                            "--seq-len", "4096", "--global-batch-tokens", str(32 * 4096), "--json"])
    assert r.exit_code == 0, r.output
    plan = Plan.model_validate(json.loads(r.stdout))
    plain = Plan.model_validate(json.loads(runner.invoke(app, [
        "plan", "--model", "qwen3-30b-a3b", "--hardware", "h200-sxm", "--gpus", "8", "--seq-len", "4096",
        "--global-batch-tokens", str(32 * 4096), "--json"]).stdout))
    assert plan.feasible and plan.step_time_s != plain.step_time_s
    assert any(s.name.startswith("fixed cost") for s in plan.stage_times)
    r = runner.invoke(app, ["roofline", "--model", "qwen3-30b-a3b", "--hardware", str(out), "--gpus", "8", "--json"])
    assert r.exit_code == 0, r.output


def test_a_refresh_keeps_the_out_files_terms_this_machine_cannot_measure(tmp_path, monkeypatch):
    out = tmp_path / "cal.yaml"
    two_gpus = _fake_measure(load_hardware("h200-sxm"), None, "grouped_mm")
    monkeypatch.setattr(cal.hardware, "environment", lambda device: {"gpu": "fake"})
    monkeypatch.setattr(cal, "measure_all", lambda *a: two_gpus)
    assert runner.invoke(app, ["bench", "calibrate", "--hardware", "h200-sxm", "--out", str(out)]).exit_code == 0
    one_gpu = cal.Measurements(two_gpus.hardware, two_gpus.calibration.model_copy(update={"p2p": None}))
    monkeypatch.setattr(cal, "measure_all", lambda *a: one_gpu)
    assert runner.invoke(app, ["bench", "calibrate", "--hardware", "h200-sxm", "--out", str(out)]).exit_code == 0
    assert load_hardware(str(out)).calibration.p2p == two_gpus.calibration.p2p


def test_a_refresh_keeps_no_term_another_probe_version_measured():
    """Kept terms would be written as measured by this probe: only the same version's are kept."""
    one_gpu = _fake_measure(load_hardware("h200-sxm"), None, "grouped_mm")
    one_gpu = cal.Measurements(one_gpu.hardware, one_gpu.calibration.model_copy(update={"p2p": None}))
    link = LinkCost(latency_us=10, gbps=300)
    for version, kept in ((PROBE_VERSION, link), (PROBE_VERSION - 1, None), (None, None)):
        preset = load_hardware("h200-sxm").model_copy(update={"calibration": Calibration(p2p=link, probe_version=version)})
        written = cal.calibrated_hardware(preset, one_gpu).calibration
        assert written.p2p == kept and written.probe_version == PROBE_VERSION, version


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU message")
def test_no_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="needs a CUDA device"):
        cal.measure_all(load_hardware("h200-sxm"), load_model("qwen3-30b-a3b"), "grouped_mm")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
def test_measure_on_a_gpu(backend):
    hw = load_hardware("h200-sxm")
    m = cal.measure_all(hw, load_model("qwen3-30b-a3b"), backend, warmup=2, iters=5)
    gemm = m.calibration.expert_gemm
    assert [p.at for p in gemm] == list(cal.ROWS_PER_EXPERT) and gemm[-1].fwd > gemm[0].fwd
    assert all(0 < p.fwd <= 1 and 0 < p.bwd <= 1 for p in gemm + m.calibration.attention + m.calibration.attention_mla)
    assert [p.at for p in m.calibration.attention_mla] == [p.at for p in m.calibration.attention] == list(cal.SEQ_LENS)
    assert [p.at for p in m.calibration.projections_mla] == list(cal.PROJECTION_TOKENS)
    assert all(0 < p.fwd <= 1 and 0 < p.bwd <= 1 for p in m.calibration.attention_mla + m.calibration.projections_mla)
    assert all(p.wgrad is not None and 0 < p.wgrad <= 1 for p in gemm)
    fp8 = m.calibration.expert_gemm_fp8  # on sm_89+ under the triton experts only
    if backend == "triton" and torch.cuda.get_device_capability() >= (8, 9):
        ratio = hw.fp8_tflops / hw.bf16_tflops
        assert [p.at for p in fp8] == list(cal.ROWS_PER_EXPERT) and all(0 < p.fwd <= ratio and 0 < p.bwd <= ratio
                                                                        for p in fp8)
    else:
        assert fp8 == []
    if torch.cuda.get_device_capability() >= (8, 9):  # the projections as fp8_dense runs them
        ratio = hw.fp8_tflops / hw.bf16_tflops
        assert [p.at for p in m.calibration.projections_fp8] == list(cal.PROJECTION_TOKENS)
        assert all(0 < p.fwd <= ratio and 0 < p.bwd <= ratio for p in m.calibration.projections_fp8)
        # the run's default recipe where this GPU runs it (blockwise on Hopper), recorded with the curve
        assert m.calibration.projections_fp8_scaling == cal.fp8_projection_scaling(torch.device("cuda", 0))
    assert set(m.calibration.hbm_fraction) == {"optimizer", "permute", "norms"}
    assert all(0 < f <= 1 for f in m.calibration.hbm_fraction.values())
    assert [p.at for p in m.calibration.projections] == list(cal.PROJECTION_TOKENS)
    assert all(0 < p.fwd <= 1 and 0 < p.bwd <= 1 for p in m.calibration.projections)
    fixed = m.calibration.op_fixed_us
    assert set(fixed) == {"ExpertForward", "ExpertBackward", "AttentionForward", "AttentionBackward"}
    # GPU kernel time at next to no work: a few launches' worth, far below the host's 0.9-2.7 ms
    # that event timing read for the 16-token attention block (the probe before this one)
    assert all(0 < us < 500 for us in fixed.values()), fixed
    if torch.cuda.device_count() > 1:
        assert m.calibration.p2p is not None and m.calibration.p2p.gbps > 10
    HardwareConfig.model_validate(yaml.safe_load(cal.preset_text(cal.calibrated_hardware(hw, m), m, {"gpu": "x"}, "t")))


@pytest.mark.parametrize("fused", [True, False], ids=["triton", "autograd-weight-grads"])
def test_the_expert_probes_weight_pass_adds_into_fp32_main_gradients_as_the_step_does(interpreted, fused):
    """`ffn_passes` on the Triton kernels (interpreted, fp32 on a CPU) and on the torch reference
    (a backend whose autograd returns the weight gradients, as grouped_mm's does): the data pass
    leaves the main gradients alone (the Triton weight GEMMs held back, not run), the full pass
    adds d w13 and d w2 into them once per call (read, add, write: the traffic the planner's
    `expert weight grads` stage counts)."""
    import functools

    from disagmoe.kernels.tile_configs import TileConfig

    _, moe_ffn = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.moe_ffn")
    tiles = moe_ffn.FFNTiles.uniform(TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4,
                                                num_stages=1))
    ffn = (functools.partial(moe_ffn.expert_ffn_triton, tiles=tiles, num_programs=2) if fused
           else moe_ffn.expert_ffn_reference)
    x, w13, w2, offsets, dy, _ = _ffn_case(hidden=16, ffn=16)
    want = torch.autograd.grad(moe_ffn.expert_ffn_reference(x, offsets, w13, w2), [w13, w2], dy)

    passes = cal.ffn_passes(ffn, x, offsets, w13, w2, dy, fused)
    main13, main2 = passes.main_grads
    assert main13.dtype == main2.dtype == torch.float32
    passes.data_grads()
    assert not main13.any() and not main2.any()
    for calls in (1, 2):
        passes.all_grads()
        for got, grad in zip((main13, main2), want, strict=True):
            torch.testing.assert_close(got, calls * grad, rtol=1e-4, atol=1e-5)
    y = passes.forward()
    assert y.requires_grad  # built for a backward, as the step's forward is (it saves the pre-activations)
    torch.testing.assert_close(y.detach(), moe_ffn.expert_ffn_reference(x, offsets, w13, w2).detach(),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("update_kernel", ["torch", "triton"])
def test_the_optimizer_rate_is_fitted_against_the_probes_own_settings(monkeypatch, state_dtype, update_kernel):
    """Whatever update kernel and moments the probe's FlatAdamW runs (OPTIMIZER_OPTIM), its time is
    fitted against those settings' bytes: a made-up GPU moving them at OPTIMIZER_HBM of its HBM rate
    gives back OPTIMIZER_HBM, and a run with the probe's settings (the Qwen3 config on one GPU) has
    its experts' optimizer stage priced at the probe's seconds per parameter."""
    from disagmoe.config import OptimConfig, load_train_config
    from disagmoe.placement.cost import evaluate
    from disagmoe.placement.solver import problem_of
    from disagmoe.placement.trace_compare import run_request
    from disagmoe.roofline import stages

    monkeypatch.setattr(cal, "OPTIMIZER_OPTIM", OptimConfig(state_dtype=state_dtype, update_kernel=update_kernel))
    model, hw = load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    ceil = _ceil(hw)
    probe_bytes = stages.optimizer_step(cal.OPTIMIZER_PARAMS, state_dtype, update_kernel, clipped=True).hbm_bytes
    assert cal.optimizer_probe_work().hbm_bytes == probe_bytes  # `optimizer_pass` clips every step
    timings = _timings(model, ceil)
    assert timings.optimizer_s == pytest.approx(probe_bytes / (OPTIMIZER_HBM * ceil.hbm_bytes_per_s))
    calibration = cal.calibration_from(timings, model, ceil, "made up")
    assert calibration.hbm_fraction["optimizer"] == pytest.approx(OPTIMIZER_HBM)
    cfg = load_train_config(CONFIGS / "h200x2-qwen3-30b.yaml", [
        "mode=single", "micro_batches=2", f"optim.state_dtype={state_dtype}", f"optim.update_kernel={update_kernel}"])
    req, cand = run_request(cfg, load_model(cfg.model), hw.model_copy(update={"calibration": calibration}))
    prob = dataclasses.replace(problem_of(req), first_touch=False)  # the probe zeroes every main gradient
    cost = evaluate(prob, cand)
    priced = float(np.asarray(cost.stages["optimizer (experts)"].time(True, prob.ceilings)).ravel()[0])
    held = float(np.asarray(cost.expert_params).ravel()[0])
    assert priced == pytest.approx(timings.optimizer_s * held / cal.OPTIMIZER_PARAMS, rel=1e-9)


def test_the_optimizer_probe_runs_the_trainers_step_on_flat_adamw():
    """`optimizer_pass` on a CPU FlatAdamW (bf16 parameters, fp32 masters): the main gradients
    zeroed, their norm, the clipped step, the masters back in the parameters."""
    from disagmoe.config import OptimConfig
    from disagmoe.runtime.state.flat_adamw import FlatAdamW

    weight = torch.nn.Parameter(torch.randn(64, 32, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(0)))
    optimizer = FlatAdamW([("weight", weight)], OptimConfig(lr=0.5, weight_decay=0.5), torch.bfloat16)
    before = weight.detach().clone()
    weight.main_grad.fill_(1.0)  # gradients a backward left: the step zeroes them first, as the trainer's does
    cal.optimizer_pass(optimizer)
    assert not weight.main_grad.any() and torch.isfinite(weight).all()
    assert not torch.equal(weight.detach(), before)  # decayed by the step
    optimizer.close()


def test_the_permute_probe_runs_the_steps_permute_and_combine(interpreted):
    """`permute_passes` on the Triton kernels (interpreted, fp32 on a CPU): the forward is the
    weighted combine of each token's k copies, the backward gives x and the routing weights
    their gradients (the combine's and the permute's backward kernels)."""
    interpreted("disagmoe.kernels.permute")
    gen = torch.Generator().manual_seed(0)
    T, H, E, K = 40, 24, 6, 2
    x = torch.randn(T, H, generator=gen)
    idx = torch.rand(T, E, generator=gen).topk(K, dim=-1).indices
    w = torch.softmax(torch.randn(T, K, generator=gen), dim=-1)
    dy = torch.randn(T, H, generator=gen)
    forward, forward_backward = cal.permute_passes(x, idx, w, E, dy)
    y = forward()
    assert y.requires_grad
    torch.testing.assert_close(y.detach(), x * w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-5)
    dx, dw = forward_backward()
    torch.testing.assert_close(dx, dy * w.sum(-1, keepdim=True), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dw, (dy * x).sum(-1, keepdim=True).expand(T, K), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_the_attention_probe_runs_the_models_own_heads(name, monkeypatch):
    """q, k, v of the probe have the widths the planner's attention core counts
    (`attention_io_per_token`): Qwen3's 4 KV heads shared by 32 query heads (enable_gqa, not 32
    expanded copies), DeepSeek's MLA q/k of nope + rope width and v of its own."""
    from disagmoe.roofline.stages import attention_io_per_token

    model = load_model(name)
    q, k, v = cal.sdpa_shapes(model, 2, 512)
    assert (q[1] * q[3], k[1] * k[3], v[1] * v[3]) == attention_io_per_token(model)
    assert q[0] == k[0] == v[0] == 2 and q[2] == k[2] == v[2] == 512
    if name == "qwen3-30b-a3b":
        assert (q[1], k[1], v[1]) == (32, 4, 4)
    # the probe's call itself, once each pass, on a CPU (kernel_ms stood in for: no CUDA here)
    from disagmoe.bench import timing

    ran = []
    monkeypatch.setattr(timing, "kernel_ms", lambda fn, warmup, iters: ran.append(fn(0)) or 1.0)
    assert cal._sdpa_times(torch.device("cpu"), model, 16, 2, 0, 1) == cal.PassTimes(1e-3, 1e-3)
    assert ran[0].shape == (2, q[1], 16, v[3])  # the forward's output, heads-first


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_the_attention_probe_passes_tokens_first_tensors_as_the_model_does(name, monkeypatch):
    """SDPA gets q, k, v (and the output's gradient) as heads-first views of tokens-first memory, as
    `rope_heads` / `mla_rope_heads` hand them over; MLA's v is the value columns of the kv
    projection's [k_nope | v] heads, a strided view."""
    import torch.nn.functional as F

    from disagmoe.bench import timing

    model, B, S = load_model(name), 2, 16
    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((q, k, v)) or sdpa(q, k, v, **kw))
    monkeypatch.setattr(timing, "kernel_ms", lambda fn, warmup, iters: [fn(0), 1.0][1])
    cal._sdpa_times(torch.device("cpu"), model, S, B, 0, 1)
    q, k, v = seen[0]
    for t in (q, k):  # [B, n, S, D] over [B, S, n, D]: a step along S skips every head
        assert t.stride(2) == t.shape[1] * t.shape[3] and t.stride(1) == t.shape[3]
    width = model.mla.qk_nope_head_dim + model.mla.v_head_dim if model.mla else v.shape[3]
    assert v.stride(2) == v.shape[1] * width and v.stride(1) == width and v.stride(3) == 1


def test_the_mla_curves_run_on_deepseeks_attention_unless_the_calibration_model_is_mla(monkeypatch):
    """A GQA calibration model (Qwen3) also times SDPA on MLA_MODEL's heads at every sequence length
    and at the fixed-cost size, and MLA_MODEL's projections at every token count (a few seconds of
    the run); an MLA one's own attention and projection timings are its MLA curves (measured once)."""
    _fake_probes(monkeypatch, (9, 0))
    calls = []

    def sdpa(dev, model, seq_len, batch, warmup, iters):
        calls.append(("sdpa", model.name, seq_len))
        return cal.PassTimes(1e-3, 3e-3)

    def projections(dev, model, tokens, warmup, iters):
        calls.append(("projections", model.name, tokens))
        return cal.PassTimes(2e-3, 6e-3)

    monkeypatch.setattr(cal, "_sdpa_times", sdpa)
    monkeypatch.setattr(cal, "_projection_times", projections)
    qwen, deepseek = load_model("qwen3-30b-a3b"), load_model(cal.MLA_MODEL)
    assert cal.mla_probe_model(qwen) == deepseek and cal.mla_probe_model(deepseek) is deepseek
    t = cal.measure_timings(torch.device("cpu"), qwen, "triton", 0, 1)
    lengths = [*cal.SEQ_LENS, cal.FIXED_TOKENS]
    assert sorted(calls) == sorted([("sdpa", m, s) for m in (qwen.name, deepseek.name) for s in lengths]
                                   + [("projections", m, n) for m in (qwen.name, deepseek.name)
                                      for n in cal.PROJECTION_TOKENS])
    assert sorted(t.attention_mla) == list(cal.SEQ_LENS) and t.attention_mla_fixed is not None
    assert sorted(t.projections_mla) == list(cal.PROJECTION_TOKENS)
    calls.clear()
    t = cal.measure_timings(torch.device("cpu"), deepseek, "triton", 0, 1)
    assert sorted(calls) == sorted([("sdpa", deepseek.name, s) for s in lengths]
                                   + [("projections", deepseek.name, n) for n in cal.PROJECTION_TOKENS])
    assert t.attention_mla is t.attention and t.attention_mla_fixed is t.attention_fixed
    assert t.projections_mla is t.projections
    calib = cal.calibration_from(t, deepseek, _ceil(), "fake")
    assert calib.attention_mla == calib.attention and len(calib.attention) == len(cal.SEQ_LENS)
    assert calib.projections_mla == calib.projections and len(calib.projections) == len(cal.PROJECTION_TOKENS)


def test_an_mla_attention_block_of_the_probes_size_is_priced_at_the_probes_gpu_time():
    """The MLA curves are fitted against the planner's attention work of MLA_MODEL's shape: read
    back at a probe point's size, the attention core (DeepSeek's heads, the probe's tokens) takes
    the probe's time net of its fixed part, the projections the probe's time; timings without
    them (an older probe's) give no MLA curves."""
    from disagmoe.roofline.calibration import attention_curves, curve_fraction
    from disagmoe.roofline.stages import attention_core_passes, attention_projection_passes

    qwen, ceil = load_model("qwen3-30b-a3b"), _ceil()
    t = _timings(qwen, ceil)
    calib = cal.calibration_from(t, qwen, ceil, "made up")
    deepseek = load_model(cal.MLA_MODEL)
    assert attention_curves(calib, deepseek) == (calib.attention_mla, calib.projections_mla)
    assert attention_curves(calib, qwen) == (calib.attention, calib.projections)

    def priced(curve, at, passes) -> list[float]:
        return [compute_ceilings(ceil, curve_fraction(curve, at, bwd)).time(w).item()
                for bwd, w in zip((False, True), passes, strict=True)]

    for s in (1024, 4096):
        measured = t.attention_mla[s]
        assert priced(calib.attention_mla, s, attention_core_passes(deepseek, cal.attention_batch(s) * s, s)) == [
            pytest.approx(measured.fwd_s - MLA_FIXED.fwd_s, rel=1e-9),
            pytest.approx(measured.bwd_s - MLA_FIXED.bwd_s, rel=1e-9)]
    for n in cal.PROJECTION_TOKENS:
        measured = t.projections_mla[n]
        assert priced(calib.projections_mla, n, attention_projection_passes(deepseek, n)) == [
            pytest.approx(measured.fwd_s, rel=1e-9), pytest.approx(measured.bwd_s, rel=1e-9)]
    older = dataclasses.replace(t, attention_mla=None, attention_mla_fixed=None, projections_mla=None)
    assert cal.calibration_from(older, qwen, ceil, "made up").attention_mla == []
    assert cal.calibration_from(older, qwen, ceil, "made up").projections_mla == []


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_the_projection_probe_runs_the_models_own_gemms(name):
    """The probe's GEMMs are the model's attention module's nn.Linear layers: their weights are
    the ones the planner's projection stage counts (`attention_params` less the input norm, up
    to the qk / latent norms' gains), and their FLOPs its forward's."""
    from disagmoe.roofline.stages import attention_projection_passes

    model = load_model(name)
    layers = cal.attention_linears(model, torch.device("meta"))
    weights = sum(layer.weight.numel() for layer in layers)
    fwd, bwd = attention_projection_passes(model, 4096)
    assert fwd.flops == pytest.approx(2 * 4096 * weights, rel=1e-3) and bwd.flops == 2 * fwd.flops
    assert all(layer.bias is None for layer in layers)


def test_the_projection_probes_calls_give_x_and_w_their_gradients():
    layers = [torch.nn.Linear(16, 24, bias=False), torch.nn.Linear(24, 8, bias=False)]
    forward, forward_backward = cal.projection_passes(layers, 5, torch.device("cpu"), torch.float32)
    assert [tuple(y.shape) for y in forward()] == [(5, 24), (5, 8)]
    assert [tuple(g.shape) for grads in forward_backward() for g in grads] == [(5, 16), (24, 16), (5, 24), (8, 24)]


def test_the_elementwise_probe_runs_the_models_norms_rope_copies_and_adds():
    """`norms_passes` on a CPU (the fusions run as written there): the outputs a layer's
    elementwise kernels write (normed x, q / k / v heads-first, attention output tokens-first, the
    FFN norm, the layer output), and gradients for the inputs and the norms' gains."""
    model = load_model("qwen3-30b-a3b")
    forward, forward_backward = cal.norms_passes(model, 2, 16, torch.device("cpu"), torch.float32)
    H, n, g, D = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    assert [tuple(t.shape) for t in forward()] == [(2, 16, H), (2, n, 16, D), (2, g, 16, D), (2, g, 16, D),
                                                   (2, 16, n * D), (2, 16, H), (2, 16, H)]
    grads = forward_backward()
    assert all(gr is not None and torch.isfinite(gr).all() for gr in grads[:7])
    assert len(grads) == 7 + 4  # the attention and FFN norms' gains, q-norm's and k-norm's
    with pytest.raises(ValueError, match="MLA"):
        cal.norms_passes(load_model("deepseek-v3"), 1, 16, torch.device("cpu"))


def _first(value) -> float:
    return float(np.asarray(value).ravel()[0])


# --- the FP8 expert curve (probe version 5) ---------------------------------------------------------------------

# rows per expert -> (forward, whole backward) fractions of the bf16 peak of a made-up FP8 kernel: below the
# bf16 FRACTIONS at most points (as our H200's measured), above them (and above 1: up to fp8 / bf16) at the largest
FP8_FRACTIONS = {16: (0.04, 0.03), 64: (0.1, 0.08), 256: (0.2, 0.15), 512: (0.3, 0.2), 1024: (0.4, 0.3),
                 2048: (0.5, 0.35), 4096: (1.3, 0.9)}


def _fp8_timings(model, ceil: Ceilings, fractions=FP8_FRACTIONS) -> dict[int, cal.PassTimes]:
    """GPU kernel times of a made-up FP8 FFN at `fractions` of the bf16 peak over the bf16 stage
    work, on top of the bf16 FFN's fixed times (EXPERT_FIXED): the backward is the planner's two
    backward stages, each priced at the backward fraction on its own, added up."""
    from disagmoe.roofline.stages import expert_passes

    out = {}
    for r, (f, b) in fractions.items():
        experts = cal.curve_experts(model, r)
        passes = expert_passes(model, r * experts, experts)
        fwd, dgrad = passes["routed experts"]
        wgrad = passes["expert weight grads"][1]
        fwd_s = EXPERT_FIXED.fwd_s + float(compute_ceilings(ceil, f).time(fwd))
        bwd_s = (EXPERT_FIXED.dgrad_s + EXPERT_FIXED.wgrad_s + float(compute_ceilings(ceil, b).time(dgrad))
                 + float(compute_ceilings(ceil, b).time(wgrad)))
        out[r] = cal.PassTimes(fwd_s, fwd_s + bwd_s)
    return out


def test_the_fp8_curve_comes_back_from_the_fp8_kernel_times():
    """Each FP8 point's forward and whole-backward rates are the fractions the made-up kernel ran at,
    against the bf16 stage work and net of the bf16 fixed cost; a rate above the bf16 peak is kept up
    to fp8_tflops / bf16_tflops (the FP8 datasheet peak), clipped there; no FP8 timings, no curve."""
    model, hw = load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    ceil, ratio = _ceil(hw), hw.fp8_tflops / hw.bf16_tflops
    timings = dataclasses.replace(_timings(model, ceil), expert_gemm_fp8=_fp8_timings(model, ceil))
    calib = cal.calibration_from(timings, model, ceil, "made up", fp8_peak_ratio=ratio)
    assert [(p.at, p.fwd, p.bwd) for p in calib.expert_gemm_fp8] == [
        (r, pytest.approx(f, rel=1e-6), pytest.approx(b, rel=1e-6)) for r, (f, b) in FP8_FRACTIONS.items()]
    assert calib.expert_gemm == cal.calibration_from(_timings(model, ceil), model, ceil, "made up").expert_gemm
    capped = cal.calibration_from(timings, model, ceil, "made up", fp8_peak_ratio=1.2).expert_gemm_fp8[-1]
    assert capped.fwd == 1.2 and capped.bwd == pytest.approx(0.9, rel=1e-6)
    assert cal.calibration_from(_timings(model, ceil), model, ceil, "made up").expert_gemm_fp8 == []
    HardwareConfig.model_validate(hw.model_copy(update={"calibration": calib}).model_dump())  # within fp8 / bf16


def test_one_shared_rate_prices_two_stages_at_their_time_together():
    """`fitted_shared_fraction`: the FP8 backward measured whole, priced as two stages (data gradients,
    compute-bound; weight gradients, with their HBM traffic) at one rate: at that rate their summed
    roofline times are the measured time, where fitting their summed Work would price one stage's HBM
    traffic as overlapped with the other's FLOPs."""
    from disagmoe.roofline.calibration import fitted_shared_fraction

    ceil = _ceil()
    dgrad, wgrad = Work(flops=4e12, hbm_bytes=1e9), Work(flops=1e11, hbm_bytes=6e10)
    priced = lambda f: float(compute_ceilings(ceil, f).time(dgrad) + compute_ceilings(ceil, f).time(wgrad))  # noqa: E731
    seconds = priced(0.3)
    assert fitted_shared_fraction([dgrad, wgrad], seconds, ceil) == pytest.approx(0.3, rel=1e-9)
    assert priced(fitted_fraction(dgrad + wgrad, seconds, ceil)) > seconds * 1.01  # the sum's fit undercounts
    assert fitted_shared_fraction([dgrad], seconds, ceil) == pytest.approx(fitted_fraction(dgrad, seconds, ceil))
    # faster than the roofs allow: the lowest rate that keeps compute off both stages' critical paths
    # (two memory-bound stages: compute leaves the one with less HBM time last)
    light, heavy = Work(flops=1e11, hbm_bytes=2e10), Work(flops=1e11, hbm_bytes=6e10)
    floor = fitted_shared_fraction([light, heavy], 1e-9, ceil, most=2.0)
    hbm_s = light.hbm_bytes / ceil.hbm_bytes_per_s
    assert floor == pytest.approx(light.flops / hbm_s / ceil.peak_flops_per_s, rel=1e-6)
    assert floor == pytest.approx(fitted_fraction(light, 1e-9, ceil, most=2.0), rel=1e-6)
    assert fitted_shared_fraction([dgrad, wgrad], 1e9, ceil) == 1e-6


def _fake_probes(monkeypatch, capability: tuple[int, int]) -> list[tuple[int, int]]:
    """Every GPU probe of `measure_timings` stood in for by a fixed time (no CUDA here), the device's
    compute capability `capability`; returns the (rows per expert, experts) the FP8 probe was asked for."""
    fp8_calls = []
    ffn = lambda dev, model, backend, rows, experts, warmup, iters: cal.ExpertTimes(3e-3, 4e-3, 5e-3)  # noqa: E731
    passes = lambda *a: cal.PassTimes(1e-3, 3e-3)  # noqa: E731

    def fp8(dev, model, rows, experts, warmup, iters):
        fp8_calls.append((rows, experts))
        return cal.PassTimes(2e-3, 2e-3 + 6e-3 * rows / 4096)

    for name, fake in (("_ffn_times", ffn), ("_sdpa_times", passes), ("_block_times", passes),
                       ("_permute_times", passes), ("_projection_times", passes), ("_norms_times", passes),
                       ("_optimizer_times", lambda *a: 0.1), ("_fp8_ffn_times", fp8),
                       ("_fp8_projection_times", lambda *a: cal.PassTimes(0.8e-3, 2.5e-3))):
        monkeypatch.setattr(cal, name, fake)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    return fp8_calls


@pytest.mark.parametrize("capability", [(9, 0), (8, 9)])
def test_the_probe_times_the_fp8_experts_on_an_fp8_gpu_under_the_triton_experts(monkeypatch, capability):
    """On sm_89+ under the triton experts `measure_timings` times the FP8 FFN at every rows-per-expert
    point of the bf16 curve, on the same experts per op, and `calibration_from` turns those times
    into the `expert_gemm_fp8` curve the calibrated file records."""
    model, hw = load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    calls = _fake_probes(monkeypatch, capability)
    t = cal.measure_timings(torch.device("cpu"), model, "triton", 0, 1)
    assert calls == [(r, cal.curve_experts(model, r)) for r in cal.ROWS_PER_EXPERT]
    assert sorted(t.expert_gemm_fp8) == sorted(t.expert_gemm) == list(cal.ROWS_PER_EXPERT)
    calib = cal.calibration_from(t, model, _ceil(hw), "fake", fp8_peak_ratio=hw.fp8_tflops / hw.bf16_tflops)
    assert [p.at for p in calib.expert_gemm_fp8] == list(cal.ROWS_PER_EXPERT)
    assert all(0 < p.fwd and 0 < p.bwd for p in calib.expert_gemm_fp8)
    assert sorted(t.projections_fp8) == list(cal.PROJECTION_TOKENS)  # the projections in FP8 too
    assert [p.at for p in calib.projections_fp8] == list(cal.PROJECTION_TOKENS)


@pytest.mark.parametrize(("capability", "backend"), [((8, 0), "triton"), ((9, 0), "grouped_mm")])
def test_no_fp8_curve_without_fp8_tensor_cores_or_the_triton_experts(monkeypatch, capability, backend):
    calls = _fake_probes(monkeypatch, capability)
    t = cal.measure_timings(torch.device("cpu"), load_model("qwen3-30b-a3b"), backend, 0, 1)
    assert t.expert_gemm_fp8 is None and calls == []
    assert (t.projections_fp8 is None) == (capability < (8, 9))  # the projections' FP8 needs no triton experts
    assert cal.calibration_from(t, load_model("qwen3-30b-a3b"), _ceil(), "fake").expert_gemm_fp8 == []


def test_the_fp8_curve_is_measured_under_the_recipe_the_planner_reads(monkeypatch):
    """The probe times `expert_ffn_fp8` itself under a run's default recipe (`fp8_probe_recipe`: the forward
    and backward `config.FP8_CURVE_FORWARDS` / `FP8_CURVE_BACKWARDS` record for the current probe version, the
    run's Gluon paths), and the planner reads which recipe a curve was measured under from the probe version
    (`Calibration.fp8_curve_forward`, `fp8_curve_backward`): the current entries are a run's defaults. The
    experts backends are outside the probe's fingerprint, so a new default fails here until the probe version
    moves and the maps record it."""
    import functools
    import inspect

    from disagmoe.config import (FP8_CURVE_BACKWARDS, FP8_CURVE_FORWARDS, FP8_PROBE_BACKWARD, FP8_PROBE_FORWARD,
                                 RUN_FP8_EXPERT_FORWARD, RUN_FP8_GLUON, RUN_FP8_GLUON_STORE, TrainConfig)
    from disagmoe.kernels import fp8_ffn

    assert inspect.signature(fp8_ffn.expert_ffn_fp8).parameters["backward"].default == FP8_PROBE_BACKWARD
    run = TrainConfig(model="tiny", device="cuda", experts_backend="triton", precision="fp8")
    assert (run.expert_forward_precision, run.expert_backward_precision) == (FP8_PROBE_FORWARD, FP8_PROBE_BACKWARD)
    assert FP8_PROBE_FORWARD == RUN_FP8_EXPERT_FORWARD
    assert Calibration(probe_version=PROBE_VERSION).fp8_curve_backward == FP8_PROBE_BACKWARD
    assert Calibration(probe_version=PROBE_VERSION).fp8_curve_forward == FP8_PROBE_FORWARD
    assert Calibration(probe_version=8).fp8_curve_forward == "both" == Calibration().fp8_curve_forward
    assert max(FP8_CURVE_BACKWARDS) <= PROBE_VERSION and FP8_CURVE_BACKWARDS[5] == "fp8"
    assert max(FP8_CURVE_FORWARDS) <= PROBE_VERSION and FP8_CURVE_FORWARDS[5] == "both"
    recipe, gluon = cal.fp8_probe_recipe()
    assert recipe == {"forward": FP8_PROBE_FORWARD, "backward": FP8_PROBE_BACKWARD}
    assert gluon["rows"] == gluon["swiglu"] == RUN_FP8_GLUON == run.expert_gluon
    assert gluon["tma_store"] == (RUN_FP8_GLUON_STORE == "tma") == run.expert_gluon_tma_store
    timed, during = [], []
    monkeypatch.setattr(cal, "_ffn_inputs", lambda *a: (None,) * 5)
    monkeypatch.setattr(cal, "fp8_ffn_passes", lambda ffn, *a: timed.append(ffn) or cal.Fp8FFNPasses(None, None, ()))
    monkeypatch.setattr(cal, "_passes", lambda *a: during.append(dataclasses.replace(fp8_ffn._gluon)))
    cal._fp8_ffn_times(None, load_model("qwen3-30b-a3b"), 16, 8, 0, 1)
    (ffn,) = timed
    assert isinstance(ffn, functools.partial) and ffn.func is fp8_ffn.expert_ffn_fp8 and ffn.keywords == recipe
    assert (during[0].rows, during[0].swiglu, during[0].tma_store) == (gluon["rows"], gluon["swiglu"],
                                                                       gluon["tma_store"])
    assert not fp8_ffn._gluon.tma_store  # restored after the probe
    monkeypatch.undo()
    calls = []
    monkeypatch.setattr(fp8_ffn.Fp8ExpertWeights, "quantize", classmethod(lambda cls, *a, **k: "copies"))
    w13, w2 = torch.nn.Parameter(torch.zeros(2, 4, 8)), torch.nn.Parameter(torch.zeros(2, 4, 4))
    x, dy = torch.zeros(3, 4), torch.zeros(3, 4)
    passes = cal.fp8_ffn_passes(lambda *a, **k: calls.append(k) or a[0] * 1.0, x, torch.tensor([2, 3]), w13, w2, dy)
    passes.forward()
    passes.forward_backward()
    assert calls == [{"weights": "copies"}] * 2  # no backward named: the kernel's default


@pytest.mark.slow  # about 5 s interpreted on one core (`pytest -m 'not slow'` skips it)
def test_the_fp8_probe_makes_the_weight_copies_once_and_adds_the_weight_gradients_into_main_gradients(
        interpreted, monkeypatch):
    """`fp8_ffn_passes` on the FP8 kernels (interpreted, on a CPU): the e4m3 weight copies are made
    once, before any timed call, and every call uses them; the forward saves for a backward; each
    forward + backward gives x the FP8 FFN's gradient and adds the weight gradients into the fp32
    main gradients (none left in .grad), as a step's micro-batch does."""
    import functools

    from disagmoe.kernels.tile_configs import TileConfig

    _, _, ffn8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.fp8_ffn")
    tiles = ffn8.Fp8Tiles(
        rows=TileConfig(block_m=16, block_n=32, block_k=128, group_m=2, num_warps=4, num_stages=1),
        swiglu=TileConfig(block_m=16, block_n=128, block_k=128, group_m=2, num_warps=4, num_stages=1),
        wgrad=TileConfig(block_m=128, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1))
    made = []
    quantize = ffn8.Fp8ExpertWeights.quantize
    monkeypatch.setattr(ffn8.Fp8ExpertWeights, "quantize", lambda *a, **k: made.append(1) or quantize(*a, **k))
    x, w13, w2, offsets, dy, gen = _ffn_case(hidden=128, ffn=64)
    plain = [t.detach().clone().requires_grad_() for t in (x, w13, w2)]
    ffn8.expert_ffn_fp8(plain[0], offsets, plain[1], plain[2], tiles=tiles, num_programs=2).backward(dy)
    made.clear()

    passes = cal.fp8_ffn_passes(functools.partial(ffn8.expert_ffn_fp8, tiles=tiles, num_programs=2),
                                x, offsets, w13, w2, dy)
    assert made == [1]  # the copies, once, outside the calls that are timed
    main13, main2 = passes.main_grads
    assert main13.dtype == main2.dtype == torch.float32 and not main13.any() and not main2.any()
    assert passes.forward().requires_grad
    earlier = [torch.randn(m.shape, generator=gen) for m in (main13, main2)]  # a step's earlier micro-batches
    for m, e in zip((main13, main2), earlier, strict=True):
        m.copy_(e)
    (dx,) = passes.forward_backward()
    torch.testing.assert_close(dx, plain[0].grad, rtol=0, atol=0)
    for got, e, want in zip((main13, main2), earlier, (plain[1].grad, plain[2].grad), strict=True):
        torch.testing.assert_close(got - e, want, rtol=1e-5, atol=1e-5)
    assert made == [1] and w13.grad is None and w2.grad is None


@pytest.mark.gpu
def test_the_fp8_probe_point_on_a_gpu():
    """One FP8 curve point measured on the GPU (sm_89+): the Qwen3 shape at 256 rows per expert on
    128 experts, its rates positive and within the FP8 datasheet peak, the main gradients written."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 experts need compute capability 8.9 or newer")
    dev, model, hw = torch.device("cuda", 0), load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    assert cal.fp8_measured(dev, "triton") and not cal.fp8_measured(dev, "grouped_mm")
    rows = 256
    times = cal._fp8_ffn_times(dev, model, rows, cal.curve_experts(model, rows), 2, 5)
    fixed = cal._ffn_times(dev, model, "triton", 1, 1, 2, 5)
    assert 0 < times.fwd_s < times.fwd_bwd_s
    ratio = hw.fp8_tflops / hw.bf16_tflops
    point = cal.fp8_expert_point(model, rows, times, fixed, _ceil(hw), ratio)
    assert 0 < point.fwd <= ratio and 0 < point.bwd <= ratio, point


# --- the FP8 projection curve (probe version 7) -----------------------------------------------------------------

# tokens -> (forward, backward) fractions of the bf16 peak of made-up FP8 projections (quantisers included)
FP8_PROJECTIONS = {4096: (0.3, 0.25), 8192: (0.45, 0.35), 32768: (1.2, 0.8)}


def test_the_fp8_projection_curve_comes_back_from_the_fp8_projections_times():
    """Each point's rates are the fractions the made-up FP8 projections ran at, against the bf16
    projections' stage work (no fixed part, as the bf16 curve), capped at fp8_tflops / bf16_tflops;
    no FP8 projection timings, no curve; the hardware file takes it within the FP8 peak only."""
    from disagmoe.roofline import stages

    model, hw = load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    ceil, ratio = _ceil(hw), hw.fp8_tflops / hw.bf16_tflops
    times = {}
    for n, (f, b) in FP8_PROJECTIONS.items():
        fwd, bwd = stages.attention_projection_passes(model, n)
        fwd_s = float(compute_ceilings(ceil, f).time(fwd))
        times[n] = cal.PassTimes(fwd_s, fwd_s + float(compute_ceilings(ceil, b).time(bwd)))
    timings = dataclasses.replace(_timings(model, ceil), projections_fp8=times)
    calib = cal.calibration_from(timings, model, ceil, "made up", fp8_peak_ratio=ratio)
    assert [(p.at, p.fwd, p.bwd) for p in calib.projections_fp8] == [
        (n, pytest.approx(f, rel=1e-6), pytest.approx(b, rel=1e-6)) for n, (f, b) in FP8_PROJECTIONS.items()]
    assert cal.calibration_from(timings, model, ceil, "made up", fp8_peak_ratio=1.1).projections_fp8[-1].fwd == 1.1
    assert cal.calibration_from(_timings(model, ceil), model, ceil, "made up").projections_fp8 == []
    HardwareConfig.model_validate(hw.model_copy(update={"calibration": calib}).model_dump())
    too_fast = hw.model_copy(update={"calibration": calib}).model_dump()
    too_fast["calibration"]["projections_fp8"][0]["fwd"] = ratio * 1.01
    with pytest.raises(ValueError, match="calibration.projections_fp8 at tokens"):
        HardwareConfig.model_validate(too_fast)


def test_the_fp8_projections_are_measured_where_fp8_dense_runs_them():
    qwen3 = load_model("qwen3-30b-a3b")
    assert cal.fp8_projections_measured((9, 0), qwen3) and cal.fp8_projections_measured((8, 9), qwen3)
    assert not cal.fp8_projections_measured((8, 0), qwen3)  # no FP8 tensor cores
    odd = qwen3.model_copy(update={"num_heads": 3, "num_kv_heads": 1, "head_dim": 40})  # 2048 -> 120: unaligned
    assert not cal.fp8_projections_measured((9, 0), odd)


@pytest.mark.parametrize("model_name", ["tiny", "deepseek-v3"])
def test_the_fp8_projection_probe_quantises_what_the_model_quantises_once_a_call(model_name):
    """The probe's projections run as `fp8_dense` runs them (on the CPU: the reference quantiser,
    torch._scaled_mm's CPU kernel), in the model's order: the block input quantised once for the
    readers that take it back to back (GQA's q, k, v), each other input and each output gradient
    once, and each
    call quantises again (no input held from the last: a step's micro-batch gets new tensors); the
    weights' copies are made once, before the calls."""
    from disagmoe.kernels.fp8_stats import DENSE, TOTAL

    model = load_model(model_name)
    if model_name == "deepseek-v3":  # its MLA widths, a CPU's size: the chains' shapes, not its 7,168
        model = model.model_copy(update={"hidden_size": 256, "num_heads": 2})
    tokens = 32
    forward, forward_backward, stats = cal.fp8_projection_passes(model, tokens, "cpu", "rowwise")
    from disagmoe.model.attention import build_attention

    with torch.device("meta"):
        named = {name: m for name, m in build_attention(model).named_modules() if isinstance(m, torch.nn.Linear)}
    linears = list(named.values())
    readers = [m for name, m in named.items() if name != "wo" and m.in_features == model.hidden_size]
    assert {name for name, m in named.items() if m in readers} <= cal.BLOCK_INPUT_READERS
    others = [m for m in linears if m not in readers]
    assert len(readers) == (3 if model.attention != "mla" else 1 + (model.mla.q_lora_rank is not None))

    def counted(call) -> int:
        before = int(stats.row(DENSE)[TOTAL])
        call()
        return int(stats.row(DENSE)[TOTAL]) - before

    # the model's order (`model.attention`): q, k, v back to back read x once; MLA's q chain runs wq_b
    # between wq_a and wkv_a, so there x is quantised again, as in the step
    twice = model.attention == "mla" and model.mla.q_lora_rank is not None
    inputs = tokens * ((1 + twice) * model.hidden_size + sum(m.in_features for m in others))
    assert counted(forward) == counted(forward) == inputs  # again each call
    assert counted(forward_backward) == inputs + tokens * sum(m.out_features for m in linears)
    grads = forward_backward()
    assert all(g is not None and torch.isfinite(g.float()).all() for g in grads)


@pytest.mark.parametrize("model_name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_the_blockwise_fp8_projection_probe_quantises_what_the_planner_prices(model_name):
    """Under blockwise (emulated on the CPU) the probe runs the linears the run runs in FP8
    (`model.layers.set_linears_fp8`: those off the 512 grid in bf16) and quantises, per call, the
    elements the planner's blockwise quantise passes count (`roofline.stages.dense_fp8_quantise_passes`,
    its bytes over the recipe's bytes per element): the block input once for FP8 readers back to back,
    each other FP8 input, and each FP8 output gradient."""
    from disagmoe.kernels.fp8_stats import DENSE, TOTAL
    from disagmoe.roofline import stages

    model = load_model(model_name)
    small = ({"hidden_size": 512, "num_heads": 4, "num_kv_heads": 4} if model.attention != "mla"
             else {"hidden_size": 512, "num_heads": 2})  # a CPU's size on the grid; MLA: q_b, kv_a and o off it
    model = model.model_copy(update=small)
    tokens = 8
    forward, forward_backward, stats = cal.fp8_projection_passes(model, tokens, "cpu", "blockwise", emulate=True)
    fp8 = {lin.name for lin in stages.dense_fp8_linears(model, "attention", "blockwise")}
    assert (len(fp8) == 4) == (model.attention != "mla") and fp8 <= {lin.name for lin in stages.dense_linears(
        model, "attention")}

    def counted(call) -> int:
        before = int(stats.row(DENSE)[TOTAL])
        call()
        return int(stats.row(DENSE)[TOTAL]) - before

    per = stages.BF16 + 1 + stages.FP32 / stages.FP8_SCALE_GROUP
    fwd, bwd = (w.hbm_bytes / per for w in stages.dense_fp8_quantise_passes(model, tokens, "attention", "blockwise"))
    assert counted(forward) == pytest.approx(fwd)
    assert counted(forward_backward) == pytest.approx(fwd + bwd)


def test_the_fp8_projection_curve_records_the_recipe_it_measured(monkeypatch):
    """`measure_timings` times the FP8 projections under the run's default recipe, blockwise, where
    the GPU runs it (`fp8_dense.blockwise_unavailable` says none is missing), else rowwise; the
    calibration records it (`projections_fp8_scaling`), a merge keeps it with the curve it came with,
    and a calibration without it (probe version 7's file) reads as rowwise."""
    from disagmoe.config import FP8_DENSE_SCALING
    from disagmoe.kernels import fp8_dense

    model, hw = load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    assert FP8_DENSE_SCALING == "blockwise" and Calibration().projections_fp8_scaling == "rowwise"
    ran = []
    for missing, recipe in ((None, "blockwise"), ("no Hopper here", "rowwise")):
        _fake_probes(monkeypatch, (9, 0))
        monkeypatch.setattr(fp8_dense, "blockwise_unavailable", lambda device, why=missing: why)
        monkeypatch.setattr(cal, "_fp8_projection_times", lambda dev, m, n, scaling, *a: ran.append(scaling)
                            or cal.PassTimes(0.8e-3, 2.5e-3))
        assert cal.fp8_projection_scaling(torch.device("cpu")) == recipe
        t = cal.measure_timings(torch.device("cpu"), model, "triton", 0, 1)
        calib = cal.calibration_from(t, model, _ceil(hw), "fake", fp8_peak_ratio=hw.fp8_tflops / hw.bf16_tflops)
        assert (t.projections_fp8_scaling, calib.projections_fp8_scaling) == (recipe, recipe)
        assert ran == [recipe] * len(cal.PROJECTION_TOKENS)
        ran.clear()
    blockwise = calib.model_copy(update={"projections_fp8_scaling": "blockwise"})
    no_curve = calib.model_copy(update={"projections_fp8": []})
    assert cal.merge_calibration(blockwise, no_curve).projections_fp8_scaling == "blockwise"  # the kept curve's
    assert cal.merge_calibration(blockwise, calib).projections_fp8_scaling == "rowwise"  # the new curve's
    written = yaml.safe_load(yaml.safe_dump(blockwise.model_dump(mode="json")))
    assert Calibration.model_validate(written).projections_fp8_scaling == "blockwise"
    del written["projections_fp8_scaling"]
    assert Calibration.model_validate(written).projections_fp8_scaling == "rowwise"
    with pytest.raises(ValueError, match="projections_fp8_scaling"):
        Calibration.model_validate({**written, "projections_fp8_scaling": "tensorwise"})
