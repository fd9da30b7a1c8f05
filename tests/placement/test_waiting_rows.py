"""The distributed layouts' paired expert weight gradients as the planner prices them (disagmoe/placement/
waiting_rows.py, placement/cost.py): the waiting rows' closed forms against the runtime's replay, the halved
main-gradient traffic, and auto settled as the driver settles it."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pytest

from disagmoe.config import ClusterConfig, PlanConfig, load_hardware
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import Candidates, evaluate
from disagmoe.placement.solver import price, problem_of
from disagmoe.placement.waiting_rows import colocated_rank_rise, expert_rank_rise
from disagmoe.roofline import stages as st
from disagmoe.roofline.stages import FP32
from disagmoe.runtime.activation_memory import replay_peak
from disagmoe.runtime.schedule.colocated import build_colocated_schedule
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.schedule.schedule import (AttentionBackward, ExpertBackward, ExpertForward, Loss, Op,
                                                build_schedule)

SHAPES = 120  # random (p, layers, dense layers, micro-batches, bytes) draws per form


class Bytes:
    """One draw of a rank's per-op bytes: per layer and micro-batch what an expert forward keeps (K), an expert
    backward holds (G) and leaves waiting (W), an attention forward of a MoE or dense layer keeps (A, Ad), its
    backward holds (Ag, Agd), the loss's head, and what the first expert backward of a pair holds more over its
    span (E, `memory.paired_first_held_bytes`); values from 0 to far apart, so every term can be the peak's."""

    def __init__(self, rng: random.Random) -> None:
        pick = lambda: rng.choice([0, 1, 3, 10, 40, 200, 900]) + rng.random()  # noqa: E731
        self.K, self.G, self.W, self.A, self.Ad, self.Ag, self.Agd, self.head = (pick() for _ in range(8))
        self.E = rng.choice([0.0, pick()])  # 0 for most recipes (bf16 experts, FP8's bf16 backward)

    def kept(self, layout: Layout):
        return lambda op: self.K if isinstance(op, ExpertForward) else (
            self.A if layout.is_moe(op.layer) else self.Ad)

    def held(self, layout: Layout):
        def held(op: Op) -> float:
            if isinstance(op, ExpertBackward):
                return self.G
            if isinstance(op, AttentionBackward):
                return self.Ag if layout.is_moe(op.layer) else self.Agd
            return self.head if isinstance(op, Loss) else 0.0
        return held


def _shapes(seed: int):
    """(p, layers, dense layers, micro-batches, Bytes) draws."""
    rng = random.Random(seed)
    for _ in range(SHAPES):
        p = rng.randint(1, 4)
        layers = rng.randint(p, 10)
        yield p, layers, rng.randint(0, min(3, layers - 1)), rng.randint(1, 7), Bytes(rng)


def test_an_expert_ranks_waiting_rows_add_what_its_replay_says():
    """A disaggregated expert rank: the replay's peak (`activation_memory.replay_peak` with `waits`, the
    runtime's memory check) over the busiest group's expert ranks is n m K + G unpaired and that plus
    `expert_rank_rise` paired, with and without what the first backward of a pair holds more (E), for shapes
    of every kind (odd counts, rows outweighing what they free)."""
    for p, layers, dense, m, b in _shapes(0):
        layout = Layout(p, p, p, layers, dense)
        programs = build_schedule(layout, m).programs[p:]  # the expert ranks, one per group
        n = -(-(layers - dense) // p)
        unpaired = max(replay_peak(pr, b.kept(layout), b.held(layout)).peak_bytes for pr in programs)
        paired = max(replay_peak(pr, b.kept(layout), b.held(layout), lambda op: b.W).peak_bytes for pr in programs)
        assert unpaired == pytest.approx(n * m * b.K + b.G, rel=1e-12)
        assert paired == pytest.approx(unpaired + expert_rank_rise(b.K, b.W, n, m), rel=1e-12), (p, layers, m)
        first = max(replay_peak(pr, b.kept(layout), b.held(layout), lambda op: b.W, lambda op: b.E).peak_bytes
                    for pr in programs)  # the first backward of each pair holding E more over its span
        assert first == pytest.approx(unpaired + expert_rank_rise(b.K, b.W, n, m, b.E), rel=1e-12), (p, layers, m)


def test_what_a_first_backward_holds_more_needs_the_pairs_waits():
    """`replay_peak(first_holds=)` without `waits` (no pairs, so no first backward of a pair) is refused."""
    layout = Layout(1, 1, 1, 2, 0)
    program = build_schedule(layout, 2).programs[1]
    b = Bytes(random.Random(5))
    with pytest.raises(ValueError, match="give the pairs' waits"):
        replay_peak(program, b.kept(layout), b.held(layout), first_holds=lambda op: 1.0)


def test_a_colocated_ranks_waiting_rows_add_what_its_replay_says():
    """A colocated rank (attention and experts of its group, the head on the head group): `colocated_rank_rise`
    is its replay's peak with the waiting rows (and E, the first backward's more) less without, on every group of
    every shape."""
    for p, layers, dense, m, b in _shapes(1):
        layout = Layout(p, p, p, layers, dense)
        programs = build_colocated_schedule(p, layers, dense, m, p, None, None)
        for g, program in enumerate(programs):
            n = sum(layer % p == g for layer in range(dense, layers))
            d = sum(layer % p == g for layer in range(dense))
            if n == 0:
                continue
            rise = colocated_rank_rise(m * (n * (b.A + b.K) + d * b.Ad), b.A, b.K, b.Ag, b.G, m * d * b.Ad + b.Agd,
                                       b.head if layers % p == g else 0.0, n, d, m, b.W)
            paired = replay_peak(program, b.kept(layout), b.held(layout), lambda op: b.W).peak_bytes
            unpaired = replay_peak(program, b.kept(layout), b.held(layout)).peak_bytes
            assert paired - unpaired == pytest.approx(rise, rel=1e-9, abs=1e-9), (p, layers, dense, m, g)
            first = replay_peak(program, b.kept(layout), b.held(layout), lambda op: b.W, lambda op: b.E).peak_bytes
            rise = colocated_rank_rise(m * (n * (b.A + b.K) + d * b.Ad), b.A, b.K, b.Ag, b.G, m * d * b.Ad + b.Agd,
                                       b.head if layers % p == g else 0.0, n, d, m, b.W, b.E)
            assert first - unpaired == pytest.approx(rise, rel=1e-9, abs=1e-9), (p, layers, dense, m, g, b.E)


def _problem(recompute: str = "selective", **request):
    req = PlanConfig(model=load_model("qwen3-30b-a3b"), cluster=ClusterConfig(hardware=load_hardware("h200-sxm"),
                     num_gpus=8), seq_len=4096, global_batch_tokens=1 << 22, recompute=recompute, **request)
    return problem_of(req)


LAYOUTS = [Candidates.one(4, 2, 1, 4, 2), Candidates.one(4, 4, 2, 3, 1),
           Candidates.one(0, 8, 1, 4, 2, colocated=True), Candidates.one(0, 8, 2, 3, 1, colocated=True)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=["split-m4", "split-p2-m3", "colocated-m4", "colocated-p2-m3"])
def test_an_expert_gpus_main_gradient_traffic_halves_where_its_micro_batches_pair(layout):
    """A distributed expert GPU pairs its round's m micro-batches (`cost.paired_micro_batches`): ceil(m / 2)
    launches read and write its fp32 main gradient, not m (m = 3: one paired launch, the last alone), so
    the weight gradients' HBM bytes over a step fall by that share of the m reads and writes."""
    prob = _problem("none", expert_wgrad_pairs="on")
    on, off = evaluate(prob, layout), evaluate(replace(prob, wgrad_pairs=False), layout)
    assert on.wgrad_pairs[0] and not off.wgrad_pairs[0]
    m = int(layout.m[0])
    moe_layers = -(-prob.model.num_moe_layers // int(layout.p[0]))
    per_layer = (off.stages["expert weight grads"].bwd.hbm_bytes - on.stages["expert weight grads"].bwd.hbm_bytes)
    main_gradient = 2 * FP32 * off.expert_params[0] / moe_layers  # one read and write of a layer's main gradient
    saved = 1 - st.main_grad_passes(m, True)
    assert float(np.ravel(per_layer)[0]) == pytest.approx(saved * main_gradient, rel=1e-12)
    assert saved == 1 - math.ceil(m / 2) / m
    assert on.stages["expert weight grads"].time(True, prob.ceilings) <= off.stages["expert weight grads"].time(
        True, prob.ceilings)


def _fullest(cost) -> float:
    return max(float(cost.attn_mem_bytes[0]), float(cost.expert_mem_bytes[0]))


@pytest.mark.parametrize("layout", LAYOUTS[:3], ids=["split-m4", "split-p2-m3", "colocated-m4"])
def test_auto_settles_the_pairs_off_where_the_rows_take_the_fullest_gpu_past_the_budget(layout):
    """`expert_wgrad_pairs: auto` per candidate as the driver settles it (`resolve_distributed_wgrad_pairs`):
    on where the fullest GPU's peak with the waiting rows is within the budget, off one byte below it, and
    then priced as unpaired (memory and step)."""
    prob = _problem()
    on, off = evaluate(replace(prob, wgrad_pairs_budget=math.inf), layout), evaluate(
        replace(prob, wgrad_pairs=False), layout)
    assert _fullest(on) > _fullest(off)  # selective: the rows outweigh what a backward frees
    at = evaluate(replace(prob, wgrad_pairs_budget=_fullest(on)), layout)
    assert at.wgrad_pairs[0] and _fullest(at) == _fullest(on) and at.step_s[0] == on.step_s[0]
    below = evaluate(replace(prob, wgrad_pairs_budget=np.nextafter(_fullest(on), 0)), layout)
    assert not below.wgrad_pairs[0]
    assert (_fullest(below), below.step_s[0], below.expert_act_bytes[0]) == (
        _fullest(off), off.step_s[0], off.expert_act_bytes[0])


def test_auto_keeps_the_pairs_where_the_rows_raise_no_peak_whatever_the_budget():
    """Without recomputation a Qwen3 expert GPU's rows free more than the waiting rows hold, so its peak stays
    at the first backward: auto pairs however tight the budget (the driver's `waiting > 0` rule)."""
    prob = _problem("none")
    layout = LAYOUTS[0]
    off = evaluate(replace(prob, wgrad_pairs=False), layout)
    tight = evaluate(replace(prob, wgrad_pairs_budget=1.0), layout)
    assert tight.wgrad_pairs[0] and _fullest(tight) == _fullest(off) > 1.0


def test_one_micro_batch_leaves_nothing_to_pair_and_the_plan_says_how_each_gpu_was_priced():
    """m = 1: off whatever is asked; the plan records the setting its split was priced under, with the note
    the driver's line mirrors (`solver._rank_wgrad_pairs_note`)."""
    prob = _problem("none", expert_wgrad_pairs="on")
    assert not evaluate(prob, Candidates.one(4, 2, 1, 1, 2)).wgrad_pairs[0]
    request = PlanConfig(model=load_model("qwen3-30b-a3b"), cluster=ClusterConfig(
        hardware=load_hardware("h200-sxm"), num_gpus=8), seq_len=4096, global_batch_tokens=1 << 22)
    for layout, setting in ((Candidates.one(4, 2, 1, 4, 2), "on"), (Candidates.one(4, 2, 1, 1, 2), "off")):
        plan = price(request, layout).plan
        assert plan.expert_wgrad_pairs == setting
    plan = price(request.model_copy(update={"recompute": "selective"}), Candidates.one(4, 4, 2, 3, 1)).plan
    assert plan.expert_wgrad_pairs == "off"
    assert any(n.startswith("expert_wgrad_pairs: auto -> off: the expert GPUs' waiting rows would take the "
                            "fullest GPU's predicted peak to ") for n in plan.notes), plan.notes
