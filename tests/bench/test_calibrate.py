"""`bench calibrate`: the fits and merges on a CPU, the command's file with injected measurements
(read back by `plan` and `roofline`), and the real measurements on a GPU."""

import json

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

runner = CliRunner()


def test_fit_link_recovers_latency_and_bandwidth_of_a_line():
    latency_s, bytes_per_s = 12e-6, 250e9
    sizes = [2.0**k for k in range(14, 28, 3)]
    link = cal.fit_link(sizes, [latency_s + b / bytes_per_s for b in sizes])
    assert link.latency_us == pytest.approx(12.0, rel=1e-6) and link.gbps == pytest.approx(250.0, rel=1e-6)
    with pytest.raises(ValueError, match="two sizes"):
        cal.fit_link([1.0, 1.0], [1.0, 2.0])


def test_rate_point_splits_forward_and_backward():
    peak = 1e15
    times = cal.PassTimes(fwd_s=1e12 / (0.5 * peak), fwd_bwd_s=1e12 / (0.5 * peak) + 2e12 / (0.25 * peak))
    point = cal.rate_point(256, fwd_flops=1e12, times=times, peak_flops_per_s=peak, bwd_flop_factor=2.0)
    assert (point.at, point.fwd, point.bwd) == (256, pytest.approx(0.5), pytest.approx(0.25))


def test_rate_point_is_net_of_the_fixed_cost_of_the_same_launches():
    peak, flops = 1e15, 1e11
    fixed = cal.PassTimes(fwd_s=30e-6, fwd_bwd_s=30e-6 + 80e-6)
    fwd = fixed.fwd_s + flops / (0.4 * peak)
    times = cal.PassTimes(fwd_s=fwd, fwd_bwd_s=fwd + fixed.bwd_s + 2 * flops / (0.3 * peak))
    point = cal.rate_point(64, flops, times, peak, 2.0, fixed)
    assert (point.fwd, point.bwd) == (pytest.approx(0.4), pytest.approx(0.3))
    # a point no slower than its fixed part reads as the peak, never as a negative or infinite rate
    assert cal.rate_point(64, flops, fixed, peak, 2.0, fixed).fwd == 1.0


def test_the_expert_curve_runs_the_models_experts_up_to_one_ops_rows():
    qwen, deepseek, tiny = load_model("qwen3-30b-a3b"), load_model("deepseek-v3"), load_model("tiny")
    assert [cal.curve_experts(qwen, r) for r in cal.ROWS_PER_EXPERT] == [128, 128, 128, 32, 8]
    assert cal.curve_experts(deepseek, 16) == 256 and cal.curve_experts(deepseek, cal.ROWS_PER_OP * 2) == 1
    assert cal.curve_experts(tiny, 1) == tiny.num_experts


FRACTIONS = {16: (0.05, 0.04), 64: (0.15, 0.12), 256: (0.3, 0.25), 1024: (0.55, 0.45), 4096: (0.7, 0.6)}
EXPERT_FIXED, SDPA_FIXED = cal.PassTimes(25e-6, 25e-6 + 85e-6), cal.PassTimes(8e-6, 8e-6 + 30e-6)
BLOCK_FIXED = cal.PassTimes(60e-6, 60e-6 + 210e-6)


def _timings(model, peak: float) -> cal.Timings:
    """GPU kernel times of a made-up GPU that runs each probe at FRACTIONS of `peak` on top of
    the fixed times above (the shape a real GPU's timings have; no measured figure)."""
    from disagmoe.roofline.stages import ATTN_CORE_BWD, attention_core

    def passes(fixed: cal.PassTimes, flops: float, fracs: tuple[float, float], bwd_factor: float) -> cal.PassTimes:
        fwd = fixed.fwd_s + flops / (fracs[0] * peak)
        return cal.PassTimes(fwd, fwd + fixed.bwd_s + bwd_factor * flops / (fracs[1] * peak))

    gemm = {r: passes(EXPERT_FIXED, cal.expert_ffn_flops(model, r * cal.curve_experts(model, r)), FRACTIONS[r], 2.0)
            for r in cal.ROWS_PER_EXPERT}
    attention = {s: passes(SDPA_FIXED, float(attention_core(model, cal.attention_batch(s) * s, s).flops), (0.5, 0.4),
                           ATTN_CORE_BWD) for s in cal.SEQ_LENS}
    return cal.Timings(gemm, EXPERT_FIXED, attention, SDPA_FIXED, BLOCK_FIXED)


def test_the_terms_come_back_from_the_gpu_kernel_times():
    model, peak = load_model("qwen3-30b-a3b"), 989e12
    calib = cal.calibration_from(_timings(model, peak), model, peak, "made up")
    assert [(p.at, p.fwd, p.bwd) for p in calib.expert_gemm] == [
        (r, pytest.approx(f), pytest.approx(b)) for r, (f, b) in FRACTIONS.items()]
    assert all((p.fwd, p.bwd) == (pytest.approx(0.5), pytest.approx(0.4)) for p in calib.attention)
    assert calib.op_fixed_us == {"ExpertForward": pytest.approx(25.0), "ExpertBackward": pytest.approx(85.0),
                                 "AttentionForward": pytest.approx(60.0), "AttentionBackward": pytest.approx(210.0)}


def test_an_expert_op_of_the_probes_size_is_priced_at_the_probes_gpu_time():
    """The fixed cost is counted once: one GPU, 1 x 4,096 tokens, top-8 of 128 experts is the
    probe's own op (256 rows of each of 128 experts); its forward is priced at exactly the
    probe's forward time, its backward at no less (the runtime also adds into fp32 main grads)."""
    from disagmoe.placement.cost import Candidates, evaluate
    from disagmoe.placement.replay import op_times
    from disagmoe.placement.solver import problem_of
    from disagmoe.config import ClusterConfig, PlanConfig

    model, hw = load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    timings = _timings(model, hw.bf16_tflops * 1e12)
    hw = hw.model_copy(update={"calibration": cal.calibration_from(timings, model, hw.bf16_tflops * 1e12, "made up")})
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=hw, num_gpus=1), seq_len=4096,
                     global_batch_tokens=4096)
    prob = problem_of(req)
    times = op_times(evaluate(prob, Candidates.one(0, 1, 1, 1, 1, colocated=True)), prob)
    assert times.expert_forward == pytest.approx(timings.expert_gemm[256].fwd_s, rel=1e-9)
    assert times.expert_backward >= timings.expert_gemm[256].bwd_s * (1 - 1e-9)


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
    curve = [RatePoint(at=r, fwd=min(1.0, 0.1 * (i + 1)), bwd=min(1.0, 0.08 * (i + 1)))
             for i, r in enumerate(cal.ROWS_PER_EXPERT)]
    sizes = list(cal.MESSAGE_BYTES)
    line = lambda lat, gbps: [lat + b / (gbps * 1e9) for b in sizes]  # noqa: E731
    links = {k: cal.fit_link(sizes, line(20e-6, 0.5 * preset.nvlink_gbps)) for k in ("p2p", "all_reduce", "all_to_all")}
    calib = Calibration(source=f"fake {backend}", expert_gemm=curve, attention=curve,
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
    assert all(0 < p.fwd <= 1 and 0 < p.bwd <= 1 for p in gemm + m.calibration.attention)
    fixed = m.calibration.op_fixed_us
    assert set(fixed) == {"ExpertForward", "ExpertBackward", "AttentionForward", "AttentionBackward"}
    # GPU kernel time at next to no work: a few launches' worth, far below the host's 0.9-2.7 ms
    # that event timing read for the 16-token attention block (the probe before this one)
    assert all(0 < us < 500 for us in fixed.values()), fixed
    if torch.cuda.device_count() > 1:
        assert m.calibration.p2p is not None and m.calibration.p2p.gbps > 10
    HardwareConfig.model_validate(yaml.safe_load(cal.preset_text(cal.calibrated_hardware(hw, m), m, {"gpu": "x"}, "t")))
