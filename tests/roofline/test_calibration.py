"""Calibrated pricing: curves interpolate as documented, each measured term reaches the stages it
names, and an empty calibration prices exactly like none."""

import time

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from disagmoe.config import (
    FP8_EXPERT_BACKWARDS,
    Calibration,
    ClusterConfig,
    Fp8RatePoint,
    HardwareConfig,
    LinkCost,
    PlanConfig,
    RatePoint,
    load_hardware,
)
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import ATTENTION_FIXED, EXPERT_FIXED, Candidates, evaluate
from disagmoe.placement.solver import choose, problem_of
from disagmoe.roofline.calibration import curve_fraction
from disagmoe.roofline.stages import Work

CURVE = [RatePoint(at=16, fwd=0.2, bwd=0.1), RatePoint(at=1024, fwd=0.6, bwd=0.5)]


def _hw(calibration: Calibration | None) -> HardwareConfig:
    return load_hardware("h200-sxm").model_copy(update={"calibration": calibration})


def _request(calibration: Calibration | None, gpus: int = 8, model: str = "qwen3-30b-a3b") -> PlanConfig:
    return PlanConfig(model=load_model(model), cluster=ClusterConfig(hardware=_hw(calibration), num_gpus=gpus),
                      seq_len=4096, global_batch_tokens=8 * 4096)


def test_curve_interpolates_in_log_rows_and_clamps_at_the_ends():
    at = np.array([1.0, 16.0, 128.0, 1024.0, 1e6])
    got = curve_fraction(CURVE, at, bwd=False)
    middle = 0.2 + 0.4 * np.log(128 / 16) / np.log(1024 / 16)
    np.testing.assert_allclose(got, [0.2, 0.2, middle, 0.6, 0.6])
    assert curve_fraction(CURVE, 16.0, bwd=True) == pytest.approx(0.1)


def test_a_calibration_section_round_trips_and_refuses_unknown_keys_and_repeated_points():
    hw = _hw(Calibration(source="test", expert_gemm=CURVE, p2p=LinkCost(latency_us=20, gbps=300),
                         op_fixed_us={"ExpertForward": 30.0}))
    assert HardwareConfig.model_validate(yaml.safe_load(hw.to_yaml())) == hw
    data = yaml.safe_load(hw.to_yaml())
    data["calibration"]["gemm"] = []
    with pytest.raises(ValidationError, match="gemm"):
        HardwareConfig.model_validate(data)
    with pytest.raises(ValidationError, match="distinct"):
        Calibration(expert_gemm=[CURVE[0], CURVE[0]])
    with pytest.raises(ValidationError):
        Calibration(op_fixed_us={"Send": 1.0})  # messages are priced by their transport, not here


@pytest.mark.parametrize("colocated", [False, True])
def test_an_empty_calibration_prices_like_none(colocated):
    c = Candidates.one(0, 8, 1, 4, 1, colocated=True) if colocated else Candidates.one(4, 4, 1, 4, 1)
    plain = evaluate(problem_of(_request(None)), c)
    empty = evaluate(problem_of(_request(Calibration())), c)
    assert float(empty.step_s[0]) == float(plain.step_s[0])


def test_the_expert_gemm_runs_at_the_measured_rate_for_its_rows_per_expert():
    c = Candidates.one(4, 4, 1, 4, 1)
    prob = problem_of(_request(Calibration(expert_gemm=CURVE)))
    cost = evaluate(prob, c)
    m = prob.model
    rows_per_expert = 4 * 4096 * m.top_k / 4 / (m.num_experts / 4)  # 4 attention GPUs' tokens over 4 expert GPUs
    stage = cost.stages["routed experts"]
    for bwd in (False, True):
        rate = prob.ceilings.peak_flops_per_s * curve_fraction(CURVE, rows_per_expert, bwd)
        want = (stage.work(bwd).flops / rate).item()
        assert stage.time(bwd, prob.ceilings).item() == pytest.approx(want, rel=1e-9)


def test_the_weight_gradients_run_at_their_own_rate_where_measured_and_an_older_files_backward_rate_otherwise():
    """Probe version 3 measures `wgrad` (with the fp32 main-gradient traffic); a version 2 file has
    only the joint backward rate, which then prices both expert backward stages as it did."""
    c = Candidates.one(4, 4, 1, 4, 1)
    with_wgrad = [p.model_copy(update={"wgrad": p.bwd / 4}) for p in CURVE]
    for curve, field in ((CURVE, "bwd"), (with_wgrad, "wgrad")):
        prob = problem_of(_request(Calibration(expert_gemm=curve)))
        stage = evaluate(prob, c).stages["expert weight grads"]
        m = prob.model
        rows_per_expert = 4 * 4096 * m.top_k / 4 / (m.num_experts / 4)
        rate = prob.ceilings.peak_flops_per_s * curve_fraction(curve, rows_per_expert, True, field)
        assert np.asarray(stage.ceilings(True, prob.ceilings).flops_per_s).item() == pytest.approx(rate.item())


def test_memory_bound_stages_run_at_their_measured_hbm_rate():
    prob = problem_of(_request(Calibration(hbm_fraction={"optimizer": 0.5, "permute": 0.25})))
    cost = evaluate(prob, Candidates.one(4, 4, 1, 4, 1))
    for name, f in (("optimizer (attention)", 0.5), ("optimizer (experts)", 0.5), ("permute / combine sum", 0.25)):
        stage = cost.stages[name]
        nbytes = np.asarray(stage.bwd.hbm_bytes).item()
        assert np.asarray(stage.time(True, prob.ceilings)).item() == pytest.approx(
            nbytes / (f * prob.ceilings.hbm_bytes_per_s), rel=1e-9), name


def test_dispatch_pays_the_measured_p2p_latency_and_bandwidth():
    link = LinkCost(latency_us=40.0, gbps=100.0)
    prob = problem_of(_request(Calibration(p2p=link)))
    stage = evaluate(prob, Candidates.one(4, 4, 1, 4, 1)).stages["dispatch"]
    nbytes = np.asarray(stage.fwd.nvlink_bytes).item()
    assert np.asarray(stage.time(False, prob.ceilings)).item() == pytest.approx(40e-6 + nbytes / 100e9, rel=1e-9)


def test_fixed_costs_per_op_add_once_per_op():
    fixed = {"AttentionForward": 100.0, "AttentionBackward": 200.0, "ExpertForward": 50.0, "ExpertBackward": 70.0}
    prob = problem_of(_request(Calibration(op_fixed_us=fixed)))
    cost = evaluate(prob, Candidates.one(4, 4, 1, 4, 1))
    assert np.asarray(cost.stages[ATTENTION_FIXED].time(True, prob.ceilings)).item() == pytest.approx(200e-6)
    assert np.asarray(cost.stages[EXPERT_FIXED].time(False, prob.ceilings)).item() == pytest.approx(50e-6)
    plain = evaluate(problem_of(_request(None)), Candidates.one(4, 4, 1, 4, 1))
    layers, m = prob.model.num_layers, 4
    # Every attention op lies on the attention GPU's path: the step grows by at least their sum.
    assert (cost.step_s[0] - plain.step_s[0]).item() >= layers * m * 300e-6 * (1 - 1e-9)


def test_a_calibrated_plan_on_1152_gpus_answers_in_under_two_seconds():
    calib = Calibration(expert_gemm=CURVE, attention=CURVE, p2p=LinkCost(latency_us=20, gbps=300),
                        all_reduce=LinkCost(latency_us=100, gbps=200), all_to_all=LinkCost(latency_us=120, gbps=200),
                        op_fixed_us={"AttentionForward": 100.0, "ExpertForward": 50.0})
    cfg = PlanConfig(model=load_model("deepseek-v3"),
                     cluster=ClusterConfig(hardware=load_hardware("gb200-nvl72").model_copy(
                         update={"calibration": calib}), num_gpus=1152), seq_len=4096)
    choose(cfg)  # warm caches (imports, presets)
    start = time.process_time()  # the search's own CPU time: other processes on the machine do not count
    plan = choose(cfg).plan
    assert time.process_time() - start < 2.0
    assert plan.feasible


# the FP8 expert curve (`Calibration.expert_gemm_fp8`, probe version 5): forward and whole-backward rates
FP8_CURVE = [Fp8RatePoint(at=16, fwd=0.15, bwd=0.08), Fp8RatePoint(at=1024, fwd=0.5, bwd=0.35)]


def test_an_fp8_curve_round_trips_and_an_older_file_without_one_still_loads():
    hw = _hw(Calibration(source="test", expert_gemm=CURVE, expert_gemm_fp8=FP8_CURVE))
    back = HardwareConfig.model_validate(yaml.safe_load(hw.to_yaml()))
    assert back == hw and back.calibration.expert_gemm_fp8 == FP8_CURVE
    committed = load_hardware("h200-sxm-calibrated")  # probe version 9: both curves measured
    assert committed.calibration.expert_gemm and committed.calibration.expert_gemm_fp8
    data = yaml.safe_load(hw.to_yaml())
    del data["calibration"]["expert_gemm_fp8"]
    assert HardwareConfig.model_validate(data).calibration.expert_gemm_fp8 == []


def test_an_fp8_point_has_no_wgrad_and_no_rate_past_the_fp8_peak():
    """The FP8 backward is measured whole: a point with a weight-gradient rate is refused (unknown
    key); a rate may pass the bf16 peak (FP8 beating it) but not fp8_tflops / bf16_tflops of it."""
    data = yaml.safe_load(_hw(Calibration(expert_gemm_fp8=FP8_CURVE)).to_yaml())
    data["calibration"]["expert_gemm_fp8"][0]["wgrad"] = 0.1
    with pytest.raises(ValidationError, match="wgrad"):
        HardwareConfig.model_validate(data)
    hw = load_hardware("h200-sxm")
    most = hw.fp8_tflops / hw.bf16_tflops
    fast = yaml.safe_load(_hw(Calibration(expert_gemm_fp8=[Fp8RatePoint(at=64, fwd=most, bwd=1.5)])).to_yaml())
    assert HardwareConfig.model_validate(fast).calibration.expert_gemm_fp8[0].fwd == most
    fast["calibration"]["expert_gemm_fp8"][0]["fwd"] = most * 1.01
    with pytest.raises(ValidationError, match="faster than the FP8 datasheet peak"):
        HardwareConfig.model_validate(fast)
    with pytest.raises(ValidationError, match="distinct"):
        Calibration(expert_gemm_fp8=[FP8_CURVE[0], FP8_CURVE[0]])


def test_fp8_experts_run_at_the_measured_fp8_rate_for_their_rows_per_expert():
    """With an FP8 curve (and every backward GEMM in FP8, fp8_expert_backward fp8) the routed experts'
    forward runs at its forward rate and both backward stages at its whole-backward rate, at the
    layout's rows per expert; no quantisation stage (its passes are in the measured times); the
    weights' e4m3 copies stay in the optimizer's pass. With the default bf16-wgrad the weight
    gradients keep the bf16 curve's rate."""
    c = Candidates.one(4, 4, 1, 4, 1)
    fp8 = {"expert_precision": "fp8", "fp8_expert_backward": "fp8", "fp8_expert_forward": "both"}
    measured = problem_of(_request(Calibration(expert_gemm=CURVE, expert_gemm_fp8=FP8_CURVE)).model_copy(update=fp8))
    datasheet = problem_of(_request(Calibration(expert_gemm=CURVE)).model_copy(update=fp8))
    default = problem_of(_request(Calibration(expert_gemm=CURVE, expert_gemm_fp8=FP8_CURVE)).model_copy(
        update={"expert_precision": "fp8"}))
    bf16 = problem_of(_request(Calibration(expert_gemm=CURVE, expert_gemm_fp8=FP8_CURVE)))
    wgrad = lambda prob: np.asarray(evaluate(prob, c).stages["expert weight grads"].ceilings(  # noqa: E731
        True, prob.ceilings).flops_per_s).item()
    assert wgrad(default) == pytest.approx(wgrad(bf16), rel=1e-12) and wgrad(default) != wgrad(measured)
    cost, plain = evaluate(measured, c), evaluate(datasheet, c)
    m = measured.model
    rows_per_expert = 4 * 4096 * m.top_k / 4 / (m.num_experts / 4)
    for name, bwd in (("routed experts", False), ("routed experts", True), ("expert weight grads", True)):
        rate = measured.ceilings.peak_flops_per_s * curve_fraction(FP8_CURVE, rows_per_expert, bwd)
        got = np.asarray(cost.stages[name].ceilings(bwd, measured.ceilings).flops_per_s).item()
        assert got == pytest.approx(rate.item(), rel=1e-12), (name, bwd)
    assert "fp8 quantise" not in cost.stages and "fp8 quantise" in plain.stages
    opt = lambda of: np.asarray(of.stages["optimizer (experts)"].bwd.hbm_bytes).item()  # noqa: E731
    assert opt(cost) == pytest.approx(opt(plain))  # the e4m3 copies, either way
    assert cost.expert_mem_bytes[0] == plain.expert_mem_bytes[0]  # the FP8 memory whatever the rate


@pytest.mark.parametrize("version", [None, 5, 6])
def test_each_fp8_backward_is_priced_against_the_recipe_the_curve_was_measured_under(version):
    """The FP8 curve's one backward rate was fitted on both backward stages under the backward its
    probe ran (`Calibration.fp8_curve_backward`: fp8 up to version 5 and in a file without a version,
    bf16-wgrad from version 6): that recipe prices both stages at it, the time measured;
    bf16-wgrad from an fp8 curve its weight gradients at the bf16 curve's rate (as before version 6);
    fp8 from a bf16-wgrad curve both at it, plus the token-group quantisers the curve did not run
    (what the datasheet pricing adds for fp8 over bf16-wgrad), in the backward alone; bf16 the
    whole backward at the bf16 rates, whatever the curve."""
    calib = Calibration(probe_version=version, expert_gemm=CURVE, expert_gemm_fp8=FP8_CURVE)
    measured = {None: "fp8", 5: "fp8", 6: "bf16-wgrad"}[version]
    assert calib.fp8_curve_backward == measured
    c = Candidates.one(4, 4, 1, 4, 1)

    def priced(calibration, **update):
        prob = problem_of(_request(calibration).model_copy(update=update))
        return prob, evaluate(prob, c)

    prob, bf16 = priced(calib)
    m = prob.model
    rows_per_expert = 4 * 4096 * m.top_k / 4 / (m.num_experts / 4)
    curve = prob.ceilings.peak_flops_per_s * curve_fraction(FP8_CURVE, rows_per_expert, True).item()
    rate = lambda cost, name: np.asarray(cost.stages[name].ceilings(  # noqa: E731
        True, prob.ceilings).flops_per_s).item()
    for backward in FP8_EXPERT_BACKWARDS:
        _, fp8 = priced(calib, expert_precision="fp8", fp8_expert_backward=backward)
        at_curve = {"routed experts": backward != "bf16",
                    "expert weight grads": backward != "bf16" and backward in (measured, "fp8")}
        for name, on_curve in at_curve.items():
            assert rate(fp8, name) == pytest.approx(curve if on_curve else rate(bf16, name), rel=1e-12), (
                backward, name)
        if backward == "fp8" and measured == "bf16-wgrad":
            sheet = {b: priced(Calibration(expert_gemm=CURVE), expert_precision="fp8", fp8_expert_backward=b)[1]
                     for b in ("fp8", "bf16-wgrad")}
            extra = [np.asarray(sheet[b].stages["fp8 quantise"].bwd.hbm_bytes).item() for b in sheet]
            quantise = fp8.stages["fp8 quantise"]
            assert quantise.fwd == Work() and quantise.bwd.flops == 0
            assert np.asarray(quantise.bwd.hbm_bytes).item() == pytest.approx(extra[0] - extra[1], rel=1e-12)
            assert extra[0] > extra[1] > 0
        else:
            assert "fp8 quantise" not in fp8.stages, backward


@pytest.mark.parametrize("version", [8, 9])
def test_each_fp8_forward_is_priced_from_the_forward_the_curve_was_measured_under(version):
    """The FP8 curve's forward rate is the FP8 GEMMs' own where its probe ran both in FP8 (to version 8,
    `Calibration.fp8_curve_forward` "both": a run's one-GEMM forward is then the harmonic blend with the bf16
    rate), and the blend it measured where it ran a run's default, the down GEMM alone (version 9): that forward
    is priced at the curve's rate as measured, and another recovers the FP8 GEMMs' rate from it
    (`cost._unblend`), so every forward is priced the same way from either curve when they agree."""
    measured = {8: "both", 9: "down"}[version]
    calib = Calibration(probe_version=version, expert_gemm=CURVE, expert_gemm_fp8=FP8_CURVE)
    assert calib.fp8_curve_forward == measured
    c = Candidates.one(4, 4, 1, 4, 1)

    def forward_rate(forward):
        prob = problem_of(_request(calib).model_copy(update={"expert_precision": "fp8",
                                                             "fp8_expert_forward": forward}))
        stages = evaluate(prob, c).stages
        return np.asarray(stages["routed experts"].ceilings(False, prob.ceilings).flops_per_s).item(), prob

    prob = problem_of(_request(calib))
    bf16 = np.asarray(evaluate(prob, c).stages["routed experts"].ceilings(False, prob.ceilings).flops_per_s).item()
    m = prob.model
    rows_per_expert = 4 * 4096 * m.top_k / 4 / (m.num_experts / 4)
    curve = prob.ceilings.peak_flops_per_s * curve_fraction(FP8_CURVE, rows_per_expert, False).item()
    rates = {forward: forward_rate(forward)[0] for forward in ("both", "gate-up", "down")}
    assert rates[measured] == pytest.approx(curve, rel=1e-12)  # the forward the curve measured: as measured
    share = {"both": 1.0, "gate-up": 2 / 3, "down": 1 / 3}
    fp8 = curve if measured == "both" else share["down"] / (1 / curve - (1 - share["down"]) / bf16)
    for forward, s in share.items():  # every forward the blend of the one FP8 rate with the bf16 one
        assert rates[forward] == pytest.approx(1 / (s / fp8 + (1 - s) / bf16), rel=1e-9), forward


# the MLA curves (`Calibration.attention_mla`, `projections_mla`, probe version 6): MLA models' attention block
MLA_CURVE = [RatePoint(at=512, fwd=0.3, bwd=0.2), RatePoint(at=8192, fwd=0.5, bwd=0.4)]
PROJECTIONS = [RatePoint(at=4096, fwd=0.7, bwd=0.65), RatePoint(at=32768, fwd=0.8, bwd=0.75)]
MLA_PROJECTIONS = [RatePoint(at=4096, fwd=0.5, bwd=0.45), RatePoint(at=32768, fwd=0.6, bwd=0.55)]


def _attention_rates(calibration: Calibration, model: str) -> dict[str, list[float]]:
    """The attention core's and projections' [forward, backward] compute rates, fractions of peak,
    for `model` on 4 + 4 GPUs (4 sequences of 4,096 tokens per micro-batch: 4,096 per attention GPU)."""
    prob = problem_of(_request(calibration, model=model))
    stages = evaluate(prob, Candidates.one(4, 4, 1, 4, 1)).stages
    return {name: [np.asarray(stages[name].ceilings(bwd, prob.ceilings).flops_per_s).item()
                   / prob.ceilings.peak_flops_per_s for bwd in (False, True)]
            for name in ("attention core", "attention projections")}


def _rates(curve: list[RatePoint], at: float) -> list[float]:
    return [curve_fraction(curve, at, bwd).item() for bwd in (False, True)]


def test_an_mla_model_prices_its_attention_block_at_the_mla_curves_and_a_gqa_model_at_the_models_own():
    calib = Calibration(attention=CURVE, projections=PROJECTIONS, attention_mla=MLA_CURVE,
                        projections_mla=MLA_PROJECTIONS)
    assert _attention_rates(calib, "deepseek-v3") == {
        "attention core": pytest.approx(_rates(MLA_CURVE, 4096.0), rel=1e-12),
        "attention projections": pytest.approx(_rates(MLA_PROJECTIONS, 4096.0), rel=1e-12)}
    for gqa in ("qwen3-30b-a3b", "mixtral-8x7b"):
        assert _attention_rates(calib, gqa) == {
            "attention core": pytest.approx(_rates(CURVE, 4096.0), rel=1e-12),
            "attention projections": pytest.approx(_rates(PROJECTIONS, 4096.0), rel=1e-12)}, gqa
    # each MLA curve on its own: the other stage keeps the calibration model's
    only_core = calib.model_copy(update={"projections_mla": []})
    assert _attention_rates(only_core, "deepseek-v3")["attention projections"] == pytest.approx(
        _rates(PROJECTIONS, 4096.0), rel=1e-12)


def test_a_file_without_mla_curves_prices_mla_models_at_the_models_curves_as_before():
    """A probe version 5 file (no `attention_mla`, `projections_mla`) loads, and prices DeepSeek's
    attention block (and the whole step) exactly as before: at `attention` and `projections`."""
    v5 = Calibration(probe_version=5, attention=CURVE, projections=PROJECTIONS, expert_gemm=CURVE)
    data = yaml.safe_load(_hw(v5).to_yaml())
    del data["calibration"]["attention_mla"], data["calibration"]["projections_mla"]
    loaded = HardwareConfig.model_validate(data).calibration
    assert loaded.attention_mla == loaded.projections_mla == [] and loaded == v5
    assert _attention_rates(loaded, "deepseek-v3") == {
        "attention core": pytest.approx(_rates(CURVE, 4096.0), rel=1e-12),
        "attention projections": pytest.approx(_rates(PROJECTIONS, 4096.0), rel=1e-12)}
    c = Candidates.one(4, 4, 1, 4, 1)
    step = lambda calib: evaluate(problem_of(_request(calib, model="deepseek-v3")), c).step_s[0].item()  # noqa: E731
    with_mla = v5.model_copy(update={"attention_mla": MLA_CURVE, "projections_mla": MLA_PROJECTIONS})
    assert step(with_mla) > step(v5)  # the MLA curves are the slower ones here
    for name in ("attention_mla", "projections_mla"):
        with pytest.raises(ValidationError, match="distinct"):
            Calibration(**{name: [MLA_CURVE[0], MLA_CURVE[0]]})
