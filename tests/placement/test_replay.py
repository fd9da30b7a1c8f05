"""The replayed step time: the schedule's own bubbles, equal to the closed form where it is exact."""

import subprocess
import sys

import pytest

from disagmoe.config import Calibration, ClusterConfig, LinkCost, PlanConfig, RatePoint, load_hardware
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import Candidates, _pass_time, evaluate
from disagmoe.placement.replay import OpTimes, op_times, replay_round, replayed_step_s
from disagmoe.placement.solver import choose, price, problem_of
from disagmoe.runtime.schedule.roles import RoleKind
from disagmoe.wire import Payload

CASES = [(1, 1, 4), (1, 4, 4), (2, 2, 6), (2, 8, 6), (3, 4, 9), (1, 8, 3)]


def _equal(fwd: float, bwd: float) -> OpTimes:
    """Every forward op and forward message `fwd` seconds, every backward one `bwd`; no loss or optimizer."""
    return OpTimes({True: fwd, False: fwd}, {True: bwd, False: bwd}, fwd, bwd, 0.0,
                   {RoleKind.ATTENTION: 0.0, RoleKind.EXPERT: 0.0},
                   {Payload.DISPATCH: fwd, Payload.COMBINE: fwd, Payload.DISPATCH_GRAD: bwd,
                    Payload.COMBINE_GRAD: bwd, Payload.RESIDUAL: 0.0, Payload.RESIDUAL_GRAD: 0.0})


@pytest.mark.parametrize("p, m, layers", CASES)
@pytest.mark.parametrize("which", ["forward", "backward"])
def test_each_pass_replays_to_the_closed_form_for_equal_stages(p, m, layers, which):
    s = 0.5
    times = _equal(s, 0.0) if which == "forward" else _equal(0.0, s)
    got = replay_round(times, p, m, layers, 0).step_time
    assert got == pytest.approx(float(_pass_time(s, s, s, s, p, m, layers)), rel=1e-12)


@pytest.mark.parametrize("p, m, layers", CASES)
def test_a_whole_round_overlaps_the_forward_drain_with_the_backward_fill(p, m, layers):
    s = 1.0
    closed = 2 * float(_pass_time(s, s, s, s, p, m, layers))
    got = replay_round(_equal(s, s), p, m, layers, 0).step_time
    ring = 4 * p * s
    assert closed - (ring - s) <= got <= closed


def _request(calibration, gpus=8):
    hw = load_hardware("h200-sxm").model_copy(update={"calibration": calibration})
    return PlanConfig(model=load_model("qwen3-30b-a3b"), cluster=ClusterConfig(hardware=hw, num_gpus=gpus),
                      seq_len=4096, global_batch_tokens=64 * 4096)


CALIBRATION = Calibration(expert_gemm=[RatePoint(at=64, fwd=0.3, bwd=0.25), RatePoint(at=4096, fwd=0.6, bwd=0.5)],
                          p2p=LinkCost(latency_us=30, gbps=300), all_reduce=LinkCost(latency_us=100, gbps=250),
                          op_fixed_us={"AttentionForward": 200.0, "ExpertForward": 80.0})


def test_op_times_add_up_the_stages_of_each_op():
    prob = problem_of(_request(CALIBRATION))
    c = Candidates.one(4, 4, 1, 4, 2)
    cost = evaluate(prob, c)
    times = op_times(cost, prob)
    experts = cost.stages["routed experts"].time(False, prob.ceilings) + 80e-6
    assert times.expert_forward == pytest.approx(float(experts[0]))
    assert times.transit[Payload.DISPATCH] == pytest.approx(float(cost.stages["dispatch"].time(False, prob.ceilings)[0]))
    assert times.attention_forward[True] > 200e-6


@pytest.mark.parametrize("p", [1, 2])
def test_a_calibrated_plan_reports_the_replayed_step(p):
    req = _request(CALIBRATION)
    c = Candidates.one(4, 4, p, 4, 2)
    choice = price(req, c)
    prob = choice.problem
    want = replayed_step_s(evaluate(prob, c), prob, c)
    assert choice.plan.step_time_s == pytest.approx(want)
    assert any("replaying the schedule" in n for n in choice.plan.notes)
    # Rounds: r - 1 rounds to the last backward plus one whole round.
    assert want <= float(evaluate(prob, c).rounds[0]) * replay_round(
        op_times(evaluate(prob, c), prob), p, 4, prob.model.num_layers, 0).step_time + 1e-12


def test_without_calibration_the_plan_keeps_the_closed_form():
    req = _request(None)
    plan = choose(req).plan
    assert not any("replaying" in n for n in plan.notes)


def test_the_replay_imports_no_torch():
    code = ("import sys; from disagmoe.placement.solver import choose; import disagmoe.placement.replay; "
            "print(','.join(m for m in ('torch', 'ray', 'matplotlib') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


@pytest.mark.parametrize("p", [1, 2])
def test_a_colocated_hop_to_the_next_group_is_priced_at_the_measured_p2p_link(p):
    """Colocated: the dispatch is an all-to-all within the EP block (the measured all-to-all); the
    partial sums go back within it at p = 1, but as one-sided messages to the next group's block at
    p > 1, priced at the measured P2P link, its bandwidth and its per-message latency."""
    a2a, p2p = LinkCost(latency_us=50, gbps=150), LinkCost(latency_us=30, gbps=300)
    prob = problem_of(_request(CALIBRATION.model_copy(update={"all_to_all": a2a, "p2p": p2p})))
    cost = evaluate(prob, Candidates.one(0, 8, p, 4, 2, colocated=True))

    def priced(work, link, collective):
        latency = link.latency_us * 1e-6 * (work.collectives if collective else work.transfers)
        return work.nvlink_bytes / (link.gbps * 1e9) + latency

    for name, bwd, is_partial_sums in (("dispatch", False, False), ("dispatch", True, True),
                                       ("combine", False, True), ("combine", True, False)):
        stage = cost.stages[name]
        work = stage.bwd if bwd else stage.fwd
        crosses = is_partial_sums and p > 1
        want = priced(work, p2p if crosses else a2a, collective=not crosses)
        assert float(stage.time(bwd, prob.ceilings)[0]) == pytest.approx(float(want[0]), rel=1e-9), (name, bwd)
