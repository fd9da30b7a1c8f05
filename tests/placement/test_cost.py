"""The cost model against independent references: a discrete-event pipeline simulation, the
real expert mapping, and the memory an expert map implies."""

import itertools
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from disagmoe.config import ClusterConfig, PlanConfig, load_hardware
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import Candidates, _pass_time, evaluate, expert_layout
from disagmoe.placement.experts import imbalance, map_layer
from disagmoe.placement.solver import price, problem_of, solve
from disagmoe.roofline.params import expert_params

# the H200 calibration of probe version 6 (the committed preset until session 47), for the FP8 pricing of that version
H200_CALIBRATED_V6 = Path(__file__).parent / "data" / "h200-sxm-calibrated-v6.yaml"


def simulate_ring(a, d, e, c, p, m, layers):
    """Event simulation of m micro-batches through `layers` hops of A -> d -> E -> c; group
    g = layer mod p owns an A, an E and two one-way links, each busy with one item at a time."""
    free = {}  # resource -> time it is next free
    ready = [0.0] * m  # when each micro-batch may enter its next stage
    finish = 0.0
    for layer in range(layers):
        g = layer % p
        for kind, dur in (("A", a), ("d", d), ("E", e), ("c", c)):
            order = sorted(range(m), key=lambda i: (ready[i], i))  # first come, first served
            for i in order:
                start = max(ready[i], free.get((kind, g), 0.0))
                ready[i] = start + dur
                free[(kind, g)] = ready[i]
                finish = max(finish, ready[i])
    return finish


@pytest.mark.parametrize("p, m, layers", [(1, 1, 4), (1, 4, 4), (2, 2, 6), (2, 8, 6), (3, 4, 9), (1, 8, 3)])
def test_pass_time_matches_an_event_simulation_for_equal_stages(p, m, layers):
    s = 1.0
    want = simulate_ring(s, s, s, s, p, m, layers)
    got = float(_pass_time(s, s, s, s, p, m, layers))
    assert got == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("seed", range(6))
def test_pass_time_bounds_an_event_simulation_for_unequal_stages(seed):
    rng = np.random.default_rng(seed)
    a, d, e, c = rng.uniform(0.2, 2.0, 4)
    p, m = int(rng.integers(1, 4)), int(rng.integers(1, 9))
    layers = p * int(rng.integers(1, 4))
    want = simulate_ring(a, d, e, c, p, m, layers)
    got = float(_pass_time(a, d, e, c, p, m, layers))
    # A closed form: exact for equal stages, within 25% of the simulated makespan otherwise.
    assert abs(got - want) <= 0.25 * want


@pytest.mark.parametrize("name", ["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("peak", [1.0, 1.7, 4.0])
def test_expert_layout_equals_the_real_mapping(name, peak):
    model = load_model(name)
    n = model.num_experts
    loads = [peak] + [(n - peak) / (n - 1)] * (n - 1)
    gpus = np.array(sorted({1, 2, 3, 5, n // 2, n - 1, n, n + 1, n + n // 2, 2 * n, 2 * n + 3} - {0}))
    slots, modelled = expert_layout(model, gpus, peak)
    for g, slot, imb in zip(gpus, slots, modelled):
        owners = map_layer(loads, int(g))
        assert imb == pytest.approx(imbalance(loads, owners, int(g)), rel=1e-9)
        per_gpu = np.bincount([x for xs in owners for x in xs], minlength=int(g))
        assert per_gpu.max() == slot


def test_replica_slots_are_priced_as_memory():
    def cfg(replicas):
        m = load_model("qwen3-30b-a3b")
        return PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=16),
                          seq_len=4096, max_expert_replicas=replicas)

    one = Candidates.one(8, 8, 1, 1, 1)
    plain, spare = evaluate(problem_of(cfg(0)), one), evaluate(problem_of(cfg(2)), one)
    m = load_model("qwen3-30b-a3b")
    owners = map_layer([1.0] * m.num_experts, 8, max_replicas=2)
    slots = np.bincount([g for gs in owners for g in gs], minlength=8)
    assert slots.max() <= 128 // 8 + 1
    extra = float(spare.expert_params[0] - plain.expert_params[0])
    assert extra == m.num_moe_layers * expert_params(m)


@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_sharded_optimizer_states_divide_the_attention_sides_state_over_data_parallel(colocated, state_dtype):
    """ZeRO-1 keeps a 1/dp share of each replicated parameter's fp32 master (4 bytes) and moments
    (8, or 4 in bf16), plus the slice's reduced gradient (4 / dp), as FlatAdamW holds them: it
    saves 12 - 16 / dp bytes (fp32 moments) or 8 - 12 / dp (bf16). The expert side's memory does
    not change; the plan's report says the same."""
    m = load_model("qwen3-30b-a3b")

    def cfg(shard):
        return PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=16),
                          seq_len=4096, shard_optimizer_states=shard, optimizer_state_dtype=state_dtype)

    one = Candidates.one(0, 16, 1, 2, 1, colocated=True) if colocated else Candidates.one(8, 8, 1, 2, 1)
    plain, sharded = evaluate(problem_of(cfg(False)), one), evaluate(problem_of(cfg(True)), one)
    dp = float(plain.dp[0])
    master_and_moments = 12 if state_dtype == "fp32" else 8
    saved = float(plain.attn_params[0]) * (master_and_moments - (master_and_moments + 4) / dp)
    assert float(plain.attn_mem_bytes[0] - sharded.attn_mem_bytes[0]) == pytest.approx(saved, rel=1e-9)
    if not colocated:
        assert float(sharded.expert_mem_bytes[0]) == float(plain.expert_mem_bytes[0])
    plan = price(cfg(True), one).plan
    group = "colocated" if colocated else "attention"
    report = plan.memory_per_gpu[group]
    assert report.total_gib * 2**30 == pytest.approx(float(sharded.attn_mem_bytes[0]), rel=1e-9)
    assert "ZeRO-1" in " ".join(plan.notes)


@pytest.mark.parametrize("update_kernel", ["torch", "triton"])
def test_sharded_optimizer_states_price_the_slices_update_and_the_reduce_scatter_and_all_gather(update_kernel):
    """ZeRO-1 in time as FlatAdamW runs it: every main gradient zeroed, the norm and update over
    the GPU's 1 / dp slice, the slice cast to the compute dtype (the Triton update reads its master
    once more for it), the all-gather reading that and writing the whole compute buffer; on the
    links a reduce-scatter of the fp32 gradients ((dp - 1) / dp of them, overlapped with the
    backward like the all-reduce it replaces) and, after the update, an all-gather of the bf16
    parameters ((dp - 1) / dp), which the step pays in full."""
    from disagmoe.roofline import stages as st

    m = load_model("qwen3-30b-a3b")

    def cfg(shard):
        return PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=16),
                          seq_len=4096, shard_optimizer_states=shard, optimizer_update_kernel=update_kernel)

    one = Candidates.one(8, 8, 1, 2, 1)
    prob = problem_of(cfg(True))
    plain, sharded = evaluate(problem_of(cfg(False)), one), evaluate(prob, one)
    dp, params = float(sharded.dp[0]), float(sharded.attn_params[0])
    assert dp == 8
    read, written = st.adamw_update_bytes("fp32", update_kernel, True)
    recast = st.MASTER if update_kernel == "triton" else 0
    want = (params * st.MAIN_GRAD + params / dp * (st.MAIN_GRAD + read + written + recast + st.BF16)
            + params * st.BF16)
    assert _first(sharded.stages["optimizer (attention)"].bwd.hbm_bytes) == pytest.approx(want, rel=1e-12)
    assert _first(plain.stages["optimizer (attention)"].bwd.hbm_bytes) == pytest.approx(
        params * (2 * st.MAIN_GRAD + read + written), rel=1e-12)
    moved = lambda w: _first(w.nvlink_bytes) + _first(w.scaleout_bytes)  # noqa: E731
    scatter, all_reduce = (c.stages["grad all-reduce (attention)"].bwd for c in (sharded, plain))
    gather = sharded.stages["param all-gather (attention)"].bwd
    assert moved(scatter) == pytest.approx((dp - 1) / dp * params * st.FP32, rel=1e-12)
    assert moved(gather) == pytest.approx((dp - 1) / dp * params * st.BF16, rel=1e-12)
    assert moved(all_reduce) == pytest.approx(2 * (dp - 1) / dp * params * st.FP32, rel=1e-12)
    assert "param all-gather (attention)" not in plain.stages
    assert _first(sharded.stages["optimizer (experts)"].bwd.hbm_bytes) == _first(
        plain.stages["optimizer (experts)"].bwd.hbm_bytes)  # experts are never sharded
    # the gather is paid after the update: the step grows by its time over an unsharded step's parts
    t = lambda c, name: _first(c.stages[name].time(True, prob.ceilings))  # noqa: E731
    assert t(sharded, "param all-gather (attention)") > 0


def test_stages_repeat_over_the_layers_they_run_in():
    m = load_model("deepseek-v3")  # 61 layers, 3 dense
    cfg = PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("gb200-nvl72"), num_gpus=144),
                     seq_len=4096)
    cost = evaluate(problem_of(cfg), Candidates.one(48, 96, 4, 2, 1))
    assert cost.stages["attention core"].repeats(m, 4, 10) == 16 * 10  # ceil(61 / 4) layers
    assert cost.stages["router"].repeats(m, 4, 10) == 15 * 10  # ceil(58 / 4) MoE layers
    assert cost.stages["dense ffn"].repeats(m, 4, 10) == 1 * 10
    assert cost.stages["lm head + embedding"].repeats(m, 4, 10) == 10
    assert cost.stages["optimizer (attention)"].repeats(m, 4, 10) == 1


def test_the_head_is_priced_as_the_run_computes_its_loss():
    """`fused_loss` (a run's, through `priced_as_trained`): the fused kernel's head moves about a quarter of the
    bytes of torch's ops on Qwen3-30B's vocabulary (12 a logit against 50, no [V, H] product a chunk), at the
    same FLOPs, and its memory holds less."""
    from disagmoe.config import TrainConfig, priced_as_trained

    m = load_model("qwen3-30b-a3b")
    run = TrainConfig(model=m, device="cuda", fused_loss=False, out_dir="unused")
    assert priced_as_trained(run)["fused_loss"] is False
    assert priced_as_trained(run.model_copy(update={"fused_loss": True}))["fused_loss"] is True
    costs = {}
    for fused in (True, False):
        req = PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=8), seq_len=4096,
                         global_batch_tokens=4096 * 64, fused_loss=fused)
        assert problem_of(req).fused_loss is fused
        costs[fused] = evaluate(problem_of(req), Candidates.one(4, 4, 1, 4, 2))
    head = {f: c.stages["lm head + embedding"] for f, c in costs.items()}
    assert _first(head[True].fwd.flops) == _first(head[False].fwd.flops)
    assert 0.2 < _first(head[True].fwd.hbm_bytes) / _first(head[False].fwd.hbm_bytes) < 0.3
    assert _first(costs[True].attn_act_bytes) < _first(costs[False].attn_act_bytes)


def test_attention_stages_fit_inside_the_step():
    plan = solve(PlanConfig(model=load_model("qwen3-235b-a22b"),
                            cluster=ClusterConfig(hardware=load_hardware("gb200-nvl72"), num_gpus=72), seq_len=4096))
    attention_busy = sum(s.time_s for s in plan.stage_times if s.group == "attention")
    # (a lower bound of half the step held until the transport's buffers were counted: they cap this
    # plan's micro-batches in flight, and its step is now bound by the dispatch and combine links)
    assert 0.2 * plan.step_time_s < attention_busy <= plan.step_time_s * 1.001


@pytest.mark.parametrize("gpus", [1, 7])
def test_colocated_without_expert_parallelism_prices_no_all_to_all(gpus):
    """tiny has 8 experts: on 1 or 7 GPUs the colocated EP degree is 1, every GPU holds every
    expert, and no dispatch or combine (not even a collective's fixed cost) is priced."""
    cfg = PlanConfig(model=load_model("tiny"), cluster=ClusterConfig(hardware=load_hardware("h200-sxm"),
                     num_gpus=gpus), seq_len=128)
    cost = evaluate(problem_of(cfg), Candidates.one(0, gpus, 1, 2, 1, colocated=True))
    ceil = problem_of(cfg).ceilings
    for name in ("dispatch", "combine"):
        stage = cost.stages[name]
        assert np.all(ceil.time(stage.fwd) == 0) and np.all(ceil.time(stage.bwd) == 0)


@pytest.mark.parametrize("colocated", [False, True])
def test_a_layout_costs_the_same_on_any_cluster_that_holds_it(colocated):
    """Idle GPUs of a larger cluster never enter a price: 28 + 44 GPUs with p=4 fit in one NVL72
    rack, so their ring hop stays on NVLink whether the job has 72 GPUs or 1,152."""
    cfg = PlanConfig(model=load_model("qwen3-235b-a22b"), cluster=ClusterConfig(
        hardware=load_hardware("gb200-nvl72"), num_gpus=72), seq_len=4096)
    cand = Candidates.one(0, 64, 4, 8, 1, colocated=True) if colocated else Candidates.one(28, 44, 4, 8, 1)
    alone, in_big = (evaluate(problem_of(cfg, g), cand) for g in (72, 1152))
    assert float(in_big.step_s[0]) == pytest.approx(float(alone.step_s[0]), rel=1e-12)
    assert float(np.ravel(in_big.stages["combine"].fwd.scaleout_bytes)[0]) == 0


def test_replica_sets_keep_the_ring_in_a_domain_when_one_slice_fits():
    """2 replica sets of 144 GPUs with p=4: each slice (a set of every group, 72 GPUs) fits a rack,
    so the hop to the next group is NVLink; one set over all 144 GPUs is priced scale-out."""
    cfg = PlanConfig(model=load_model("qwen3-235b-a22b"), cluster=ClusterConfig(
        hardware=load_hardware("gb200-nvl72"), num_gpus=144), seq_len=4096)
    two = evaluate(problem_of(cfg), Candidates.one(56, 88, 4, 8, 1, sets=2))
    one = evaluate(problem_of(cfg), Candidates.one(56, 88, 4, 8, 1, sets=1))
    assert float(np.ravel(two.stages["combine"].fwd.scaleout_bytes)[0]) == 0
    assert float(np.ravel(one.stages["combine"].fwd.scaleout_bytes)[0]) > 0


def _first(x) -> float:
    return float(np.asarray(x, dtype=float).ravel()[0])


def _single_gpu(model: str = "qwen3-30b-a3b", hardware: str = "h200-sxm"):
    """One GPU, 2 x 4,096 tokens per micro-batch, 8 micro-batches (configs/h200x2-qwen3-30b.yaml)."""
    m = load_model(model)
    req = PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware(hardware), num_gpus=1), seq_len=4096,
                     global_batch_tokens=16 * 4096)
    prob = problem_of(req)
    return m, prob, evaluate(prob, Candidates.one(0, 1, 1, 8, 2, colocated=True))


def test_expert_weight_grads_are_their_own_launch_with_the_fp32_main_gradient_traffic():
    m, prob, cost = _single_gpu()
    local_params = m.num_experts * expert_params(m)
    wgrad = cost.stages["expert weight grads"]
    assert wgrad.group == "expert" and wgrad.runs == "moe" and wgrad.fwd.flops == 0
    assert wgrad.bwd.flops == pytest.approx(cost.stages["routed experts"].fwd.flops)
    # paired micro-batches (`expert_wgrad_pairs` on): a read and write every other micro-batch
    one_gpu = Candidates.one(0, 1, 1, 8, 2, colocated=True)
    paired = evaluate(replace(prob, wgrad_pairs_budget=float("inf")), one_gpu).stages["expert weight grads"]
    assert prob.wgrad_pairs and 4 * local_params <= _first(paired.bwd.hbm_bytes) < 8 * local_params
    # auto (the request's default) settles them off here, as the trainer would: the whole model's state alone
    # is past 85% of the H200 (`cost._pairs_fit`)
    assert not cost.wgrad_pairs[0] and np.array_equal(wgrad.bwd.hbm_bytes, evaluate(
        replace(prob, wgrad_pairs=False), one_gpu).stages["expert weight grads"].bwd.hbm_bytes)
    assert _first(wgrad.bwd.hbm_bytes) >= 8 * local_params  # read + write the fp32 main gradient each
    # at 512 rows per expert that traffic binds (the profile's memory-bound weight gradients)
    times = {k: _first(v) for k, v in prob.ceilings.times(wgrad.bwd).items()}
    assert max(times, key=times.__getitem__) == "hbm"
    data = cost.stages["routed experts"].time(True, prob.ceilings)
    assert wgrad.time(True, prob.ceilings) + data > 2 * cost.stages["routed experts"].time(False, prob.ceilings)


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_an_odd_micro_batch_count_prices_its_last_weight_gradient_launch_at_one_micro_batchs_rows(precision):
    """Paired weight gradients (`kernels.wgrad_pairs`) over 3 micro-batches, priced from a measured curve (bf16's
    weight-gradient rate; fp8 bf16-wgrad: the FP8 curve's backward): one launch over two micro-batches' rows at
    the curve's rate for twice the rows per expert, and the odd one alone at its rate for one's, each with one
    main-gradient pass, so the stage's step equals those two launches priced on their own (not three
    micro-batches at the paired launch's rate). The blend prices the launches' sum where each launch is priced by
    its measured rate (the committed H100 curve's FP8 paired launch is HBM-bound there: halved here)."""
    from disagmoe.roofline import calibration as cal
    from disagmoe.roofline import stages as st

    hw = load_hardware("h100-sxm-calibrated")
    if precision == "fp8":  # the measured FP8 backward rates halved: each launch priced by its rate, not by HBM
        slower = [point.model_copy(update={"bwd": point.bwd / 2}) for point in hw.calibration.expert_gemm_fp8]
        hw = hw.model_copy(update={"calibration": hw.calibration.model_copy(update={"expert_gemm_fp8": slower})})
    m = load_model("qwen3-30b-a3b")
    req = PlanConfig(model=m, cluster=ClusterConfig(hardware=hw, num_gpus=1), seq_len=4096,
                     global_batch_tokens=3 * 2 * 4096, expert_wgrad_pairs="on", expert_precision=precision)
    prob = replace(problem_of(req), first_touch=False)  # every launch reads its main gradient: the same work each
    cost = evaluate(prob, Candidates.one(0, 1, 1, 3, 2, colocated=True))
    assert cost.wgrad_pairs[0]
    step = 3 * _first(cost.stages["expert weight grads"].time(True, prob.ceilings))  # per MoE layer
    curve, field = ((hw.calibration.expert_gemm, "wgrad") if precision == "bf16"
                    else (hw.calibration.expert_gemm_fp8, "bwd"))
    assert all(getattr(point, field) is not None for point in curve)

    def launch(rows: int, rows_per_expert: float) -> float:
        rate = cal.compute_ceilings(prob.ceilings, cal.curve_fraction(curve, rows_per_expert, True, field))
        return _first(rate.time(st.expert_weight_grads(m, rows, m.num_experts)))

    rows = 2 * 4096 * m.top_k  # one micro-batch's (token, expert) rows
    per_expert = rows / m.num_experts
    assert step == pytest.approx(launch(2 * rows, 2 * per_expert) + launch(rows, per_expert), rel=1e-12)
    assert step > 1.01 * 1.5 * launch(2 * rows, 2 * per_expert)  # the lone launch runs at the smaller size's rate


@pytest.mark.parametrize("precision", ["bf16", "fp8"])
@pytest.mark.parametrize("step_micro_batches", [3, 4])
def test_a_one_gpu_splits_pairs_count_the_steps_micro_batches_whatever_its_rounds(precision, step_micro_batches):
    """One GPU trains its rounds as more micro-batches of one accumulation (`plan_layout.planned_micro_batches`)
    and the single trainer pairs weight gradients over the whole step's: 1 micro-batch x n rounds is priced as
    n micro-batches x 1 round of the same sequences (paired on, the launches' passes, their calibrated rates,
    an odd count's lone launch, the step), with one micro-batch's waiting rows in its memory either way; auto
    settles both alike against the device (`cost._pairs_fit`)."""
    m = load_model("qwen3-30b-a3b")
    n = step_micro_batches
    for pairs in ("on", "auto"):
        req = PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h100-sxm-calibrated"), num_gpus=1),
                         seq_len=4096, global_batch_tokens=n * 2 * 4096, expert_wgrad_pairs=pairs,
                         expert_precision=precision)
        prob = problem_of(req)
        rounds, one_round = (evaluate(prob, Candidates.one(0, 1, 1, mb, 2, colocated=True)) for mb in (1, n))
        assert (_first(rounds.rounds), _first(one_round.rounds)) == (n, 1)
        assert rounds.wgrad_pairs[0] == one_round.wgrad_pairs[0] == (pairs == "on")
        wgrad, wgrad_one = rounds.stages["expert weight grads"], one_round.stages["expert weight grads"]
        assert _first(wgrad.bwd.hbm_bytes) == pytest.approx(_first(wgrad_one.bwd.hbm_bytes), rel=1e-12)
        assert _first(wgrad.time(True, prob.ceilings)) == pytest.approx(
            _first(wgrad_one.time(True, prob.ceilings)), rel=1e-12)
        assert _first(rounds.step_s) == pytest.approx(_first(one_round.step_s), rel=1e-12)
        assert _first(rounds.attn_mem_bytes) == pytest.approx(_first(one_round.attn_mem_bytes), rel=1e-12)
        unpaired = evaluate(replace(prob, wgrad_pairs=False), Candidates.one(0, 1, 1, 1, 2, colocated=True))
        fewer = _first(wgrad.bwd.hbm_bytes) < _first(unpaired.stages["expert weight grads"].bwd.hbm_bytes)
        assert fewer == (pairs == "on")  # paired: half the main-gradient passes (auto: off, as unpaired)


def _optimizer_bytes(cost) -> float:
    """HBM bytes of the optimizer's stages (attention and experts) of the first candidate."""
    return _first(cost.stages["optimizer (attention)"].bwd.hbm_bytes + cost.stages["optimizer (experts)"].bwd.hbm_bytes)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("update_kernel", ["torch", "triton"])
@pytest.mark.parametrize("clip", [True, False])
def test_the_optimizer_prices_every_pass_flat_adamw_makes_and_the_main_grad_adds(state_dtype, update_kernel, clip):
    """The plan's moments' dtype, update kernel and clip reach the optimizer's stages: every held
    parameter at `stages.optimizer_step`'s bytes for those settings (zero, norm, the update with the
    bf16 parameters written: tests/roofline/test_stages.py checks them pass by pass), less the
    zeroing of the routed experts' main gradients (first touch: the Triton experts in bf16 store
    them at the step's first launch)."""
    from disagmoe.roofline import stages as st

    m = load_model("qwen3-30b-a3b")
    req = PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=1), seq_len=4096,
                     global_batch_tokens=16 * 4096, optimizer_state_dtype=state_dtype,
                     optimizer_update_kernel=update_kernel, clip_gradients=clip)
    prob = problem_of(req)
    assert (prob.optimizer_state_dtype, prob.optimizer_update_kernel, prob.clip_gradients) == (
        state_dtype, update_kernel, clip)
    cost = evaluate(prob, Candidates.one(0, 1, 1, 8, 2, colocated=True))
    held = float(cost.attn_params[0] + cost.expert_params[0])
    per_param = st.optimizer_step(1.0, state_dtype, update_kernel, clip).hbm_bytes
    assert prob.first_touch
    assert _optimizer_bytes(cost) == pytest.approx(per_param * held - st.MAIN_GRAD * float(cost.expert_params[0]))
    adds = cost.stages["main-grad adds"]
    assert adds.group == "attention" and adds.runs == "moe" and _first(adds.bwd.hbm_bytes) > 0


def test_bf16_moments_in_the_triton_update_price_a_cheaper_optimizer_than_torchs_fp32_step():
    """The same layout, and only the optimizer's stages move: bf16 moments stepped by the Triton
    kernel read and write fewer bytes than torch's fused AdamW over fp32 moments and its copy pass."""
    m, hw = load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    one = Candidates.one(1, 1, 1, 8, 2)

    def priced(state_dtype, update_kernel):
        req = PlanConfig(model=m, cluster=ClusterConfig(hardware=hw, num_gpus=2), seq_len=4096,
                         global_batch_tokens=16 * 4096, optimizer_state_dtype=state_dtype,
                         optimizer_update_kernel=update_kernel)
        prob = problem_of(req)
        return prob, evaluate(prob, one)

    (prob, lean), (_, torch_fp32) = priced("bf16", "triton"), priced("fp32", "torch")
    for name in ("optimizer (attention)", "optimizer (experts)"):
        assert lean.stages[name].time(True, prob.ceilings) < torch_fp32.stages[name].time(True, prob.ceilings)
    assert _optimizer_bytes(lean) < _optimizer_bytes(torch_fp32)
    assert float(lean.step_s[0]) < float(torch_fp32.step_s[0])
    for name, stage in lean.stages.items():
        if not name.startswith("optimizer"):
            for bwd in (False, True):
                assert stage.time(bwd, prob.ceilings) == torch_fp32.stages[name].time(bwd, prob.ceilings), name


def test_an_optimizer_steps_fixed_cost_is_paid_once_per_rank():
    from disagmoe.config import Calibration

    fixed = Calibration(op_fixed_us={"OptimizerStep": 1000.0})
    m = load_model("qwen3-30b-a3b")
    for c in (Candidates.one(0, 1, 1, 8, 2, colocated=True), Candidates.one(1, 1, 1, 8, 2)):
        steps = []
        for calib in (None, fixed):
            hw = load_hardware("h200-sxm").model_copy(update={"calibration": calib})
            req = PlanConfig(model=m, cluster=ClusterConfig(hardware=hw, num_gpus=2), seq_len=4096,
                             global_batch_tokens=16 * 4096)
            steps.append(float(evaluate(problem_of(req), c).step_s[0]))
        assert steps[1] - steps[0] == pytest.approx(1e-3, rel=1e-6)


def test_the_elementwise_kernels_around_the_gemms_are_priced_per_layer_by_their_bytes():
    m, prob, cost = _single_gpu()
    stage = cost.stages["norms, RoPE, residual adds"]
    assert stage.group == "attention" and stage.runs == "layer" and stage.fwd.flops == 0
    from disagmoe.roofline.stages import norms_and_residuals

    one, two = norms_and_residuals(m, 1.0), norms_and_residuals(m, 2.0)
    assert two[0].hbm_bytes == 2 * one[0].hbm_bytes and two[1].hbm_bytes == 2 * one[1].hbm_bytes
    assert one[0].hbm_bytes >= 2 * 2 * 2 * m.hidden_size  # at least the two norms read and write H in bf16
    assert _first(stage.work(False).hbm_bytes) == pytest.approx(one[0].hbm_bytes * 2 * 4096)


@pytest.mark.parametrize("name", ["tiny", "qwen3-30b-a3b", "deepseek-v3"])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
def test_the_planners_activations_are_roofline_memorys(name, recompute):
    """One GPU (mode single: one micro-batch in flight) prices exactly `roofline.memory.activation_bytes`,
    with the recomputation's dropped terms when asked; in a split the expert GPU keeps the
    combine's rows beside its own (the compact hop), for every pair its sources dispatch (the
    runtime's buffers span them all, not its experts' share), and under full each received
    token's row and partial sum. Unpaired: what paired weight gradients' waiting rows add is
    tests/placement/test_waiting_rows.py's."""
    from disagmoe.roofline import memory as mem

    model = load_model(name)
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=8),
                     seq_len=512, global_batch_tokens=512 * 64, recompute=recompute, expert_wgrad_pairs="off")
    prob = problem_of(req)
    dropped = {"none": mem.NOTHING_DROPPED, "selective": mem.SELECTIVE, "full": mem.FULL}[recompute]
    one = evaluate(prob, Candidates.one(0, 1, 1, 4, 2, colocated=True))
    assert one.attn_act_bytes[0] + one.expert_act_bytes[0] == mem.activation_bytes(model, 2 * 512, 2, dropped=dropped,
                                                                                    fused_loss=True)
    rows = 2 * 2 * 512 * model.top_k  # every pair of both attention GPUs, on each expert GPU however many
    row = mem.expert_row_bytes(model, 2, dropped) + mem.combine_bytes(model, 2, dropped) // model.top_k
    received = 2 * 2 * 512 * mem.expert_token_bytes(model, 2, dropped)  # full: every source token's row and sum
    for expert_gpus in (1, 2):
        split = evaluate(prob, Candidates.one(2, expert_gpus, 1, 4, 2))
        assert split.expert_act_bytes[0] == (4 * model.num_moe_layers * (rows * row + received)
                                             + rows * mem.expert_row_grad_bytes(model, 2, dropped))


@pytest.mark.parametrize("colocated", [False, True])
def test_full_recomputation_prices_every_layers_forward_again_in_its_backward(colocated):
    """recompute: full keeps the least on both sides (`memory.FULL`) and adds to the backward of
    every attention and expert stage that runs per layer its own forward (at its forward's rates);
    the forward pass, the transfers, the head and the optimizer are priced as without it."""
    from disagmoe.placement.cost import FULL_RECOMPUTED
    from disagmoe.roofline import memory as mem

    model = load_model("qwen3-30b-a3b")
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=8),
                     seq_len=1024, global_batch_tokens=1024 * 64)
    cand = Candidates.one(0, 8, 1, 4, 2, colocated=True) if colocated else Candidates.one(4, 4, 1, 4, 2)
    none, full = (evaluate(replace(problem_of(req), recompute=r, recompute_modules=d), cand)
                  for r, d in (("none", mem.NOTHING_DROPPED), ("full", mem.FULL)))
    assert full.dropped() == mem.FULL and none.dropped() == mem.NOTHING_DROPPED
    assert not full.selective[0] and not full.recompute_attention[0]
    again = {name[:-len(FULL_RECOMPUTED)] for name in full.stages if name.endswith(FULL_RECOMPUTED)}
    assert again == {name for name, s in none.stages.items() if s.group in ("attention", "expert")
                     and s.runs in ("layer", "moe", "dense") and np.any(np.asarray(s.fwd.flops) + s.fwd.hbm_bytes)}
    assert {"attention projections", "attention core", "router", "routed experts"} <= again
    for name in again:
        stage, source = full.stages[name + FULL_RECOMPUTED], none.stages[name]
        assert (stage.group, stage.runs) == (source.group, source.runs)
        assert np.all(stage.bwd.flops == source.fwd.flops) and np.all(stage.bwd.hbm_bytes == source.fwd.hbm_bytes)
        assert not np.any(stage.fwd.flops) and not np.any(stage.fwd.hbm_bytes)
    assert full.fwd_round_s[0] == none.fwd_round_s[0] and full.bwd_round_s[0] > none.bwd_round_s[0]
    assert full.attn_act_bytes[0] < none.attn_act_bytes[0]
    if not colocated:
        assert full.expert_act_bytes[0] < none.expert_act_bytes[0]


def test_full_recomputation_is_not_priced_with_fp8_experts():
    with pytest.raises(ValueError, match="recompute: full is not built with FP8 experts"):
        PlanConfig(model=load_model("tiny"), cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=2),
                   seq_len=512, global_batch_tokens=512 * 8, recompute="full", expert_precision="fp8")


@pytest.mark.parametrize("backward", ["fp8", "bf16-wgrad", "bf16"])
@pytest.mark.parametrize("fp8_tflops", [989.0, 700.0])  # the H200's bf16 peak, and below it
def test_fp8_experts_hold_their_memory_whatever_the_hardwares_fp8_rate(fp8_tflops, backward):
    """expert_precision fp8 on an H200 copy whose fp8_tflops is no more than its bf16_tflops: the
    e4m3 weight copies and the FP8 rows' activations are held as on the H200 itself (the setting,
    not the speedup, decides memory); the FP8 GEMMs run at fp8_tflops / bf16_tflops the bf16 rate
    (the forward always, the data gradients unless the backward is bf16, the weight gradients only
    with fp8_expert_backward fp8), the others at the bf16 rate, and the quantisation passes are
    still paid: the backward's dy and dh13 both ways and x and act along tokens (fp8), dy and dh13
    once (bf16-wgrad), none (bf16)."""
    h200 = load_hardware("h200-sxm")
    slow = h200.model_copy(update={"fp8_tflops": fp8_tflops})
    layout = Candidates.one(4, 4, 1, 4, 2)

    def cost(hw, precision):
        req = PlanConfig(model=load_model("qwen3-30b-a3b"), cluster=ClusterConfig(hardware=hw, num_gpus=8),
                         seq_len=4096, global_batch_tokens=1 << 20, recompute="none", expert_precision=precision,
                         fp8_expert_backward=backward, fp8_expert_forward="both")
        return problem_of(req), evaluate(problem_of(req), layout)

    (prob, bf16), (_, fp8), (_, fast) = cost(slow, "bf16"), cost(slow, "fp8"), cost(h200, "fp8")
    # the copies forward both reads (w13's and w2's) and, unless the backward is bf16, their transposes
    copies = (2 if backward != "bf16" else 1) * fp8.expert_params[0] * (1 + 4 / 128**2)  # a fp32 scale a block
    acts = fp8.expert_act_bytes[0] - bf16.expert_act_bytes[0]
    assert acts < 0 and fp8.expert_mem_bytes[0] - bf16.expert_mem_bytes[0] == pytest.approx(copies + acts)
    assert fp8.expert_mem_bytes[0] == fast.expert_mem_bytes[0] and fp8.attn_mem_bytes[0] == fast.attn_mem_bytes[0]
    in_fp8 = {("routed experts", True): backward != "bf16", ("expert weight grads", True): backward == "fp8"}
    for name in ("routed experts", "expert weight grads"):
        for bwd in (False, True):
            ratio = fp8_tflops / h200.bf16_tflops if in_fp8.get((name, bwd), True) else 1.0
            assert fp8.stages[name].ceilings(bwd, prob.ceilings).flops_per_s == pytest.approx(
                bf16.stages[name].ceilings(bwd, prob.ceilings).flops_per_s * ratio)
    assert "fp8 quantise" in fp8.stages and "fp8 quantise" not in bf16.stages
    m = load_model("qwen3-30b-a3b")
    H, F = m.hidden_size, m.expert_ffn_size
    quantise = fp8.stages["fp8 quantise"]
    per_row = {"fp8": 2 * H + 4 * F + F + H, "bf16-wgrad": H + 2 * F, "bf16": 0}[backward]
    assert quantise.bwd.hbm_bytes[0] == pytest.approx(quantise.fwd.hbm_bytes[0] * per_row / H)


# e4m3 bytes per routed-expert parameter of the weight copies each recipe reads (w13 2/3 of the
# parameters, w2 1/3; tests/model/test_fp8_experts.py's COPY_BYTES_PER_PARAM), and the share of the
# parameters quantised (read in bf16) to make them.
RECIPE_COPIES = {("both", "bf16-wgrad"): (2, 1), ("both", "bf16"): (1, 1), ("gate-up", "fp8"): (5 / 3, 1),
                 ("gate-up", "bf16"): (2 / 3, 2 / 3), ("down", "bf16-wgrad"): (4 / 3, 1), ("down", "bf16"): (1 / 3, 1 / 3)}


@pytest.mark.parametrize("forward, backward", list(RECIPE_COPIES))
def test_the_planner_holds_and_makes_the_fp8_weight_copies_the_recipe_reads(forward, backward):
    """`Problem.fp8_forward` / `fp8_backward`: the expert GPU holds the e4m3 copies the recipe reads
    (`roofline.memory.fp8_weight_copy_bytes`) beside bf16's state, and its optimizer pass reads the
    weights quantised in bf16 and writes those copies, on one fixed disaggregated layout; the plan's
    note says so."""
    from disagmoe.placement.solver import fp8_note

    layout = Candidates.one(4, 4, 1, 4, 2)

    def cost(precision, **recipe):
        req = PlanConfig(model=load_model("qwen3-30b-a3b"),
                         cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=8), seq_len=4096,
                         global_batch_tokens=1 << 20, recompute="none", expert_precision=precision, **recipe)
        return problem_of(req), evaluate(problem_of(req), layout)

    (_, bf16), (prob, fp8) = cost("bf16"), cost("fp8", fp8_expert_forward=forward, fp8_expert_backward=backward)
    held, quantised = RECIPE_COPIES[forward, backward]
    params = fp8.expert_params[0]
    state = (fp8.expert_mem_bytes[0] - fp8.expert_act_bytes[0]) - (bf16.expert_mem_bytes[0] - bf16.expert_act_bytes[0])
    assert state == pytest.approx(held * params * (1 + 4 / 128**2))
    optimizer = fp8.stages["optimizer (experts)"].bwd.hbm_bytes[0] - bf16.stages["optimizer (experts)"].bwd.hbm_bytes[0]
    assert optimizer == pytest.approx(params * (2 * quantised + held * (1 + 4 / 128**2)))  # bf16 read, e4m3 + scales
    said = {2: "two e4m3 weight copies per expert parameter each step", 1: "reads, 1 byte per expert parameter",
            2 / 3: "reads, 0.67 byte per expert", 1 / 3: "reads, 0.33 byte per expert",
            5 / 3: "reads, 1.7 bytes per expert", 4 / 3: "reads, 1.3 bytes per expert"}[held]
    assert said in fp8_note(prob, fp8)


@pytest.mark.parametrize("calibrated", [False, True])
def test_one_fp8_forward_gemm_prices_the_forward_at_the_blend_of_its_share(calibrated):
    """fp8_expert_forward gate-up / down (backward bf16): the routed experts' forward at the harmonic
    blend of the FP8 and bf16 rates by the FP8 GEMM's share of the forward FLOPs (2/3, 1/3), the
    backward at the bf16 rate as with both; its one quantiser reads x (gate-up) or, on a distributed rank
    (which counts its numerics every step), the SwiGLU output (down), while on one GPU down's e4m3 input is
    written by the gate/up GEMM's SwiGLU epilogue (no pass of its own); with the datasheet ratio and with a
    measured FP8 curve alike."""
    hw = load_hardware("h200-sxm-calibrated" if calibrated else "h200-sxm")
    layout = Candidates.one(4, 4, 1, 4, 2)
    m = load_model("qwen3-30b-a3b")

    def cost(forward, precision="fp8", candidates=layout):
        req = PlanConfig(model=m, cluster=ClusterConfig(hardware=hw, num_gpus=8), seq_len=4096,
                         global_batch_tokens=1 << 20, recompute="none", expert_precision=precision,
                         fp8_expert_backward="bf16", fp8_expert_forward=forward)
        return problem_of(req), evaluate(problem_of(req), candidates)

    (prob, both), (_, bf16) = cost("both"), cost("both", "bf16")
    rate = lambda c, bwd: c.stages["routed experts"].ceilings(bwd, prob.ceilings).flops_per_s  # noqa: E731
    for forward, share in (("gate-up", 2 / 3), ("down", 1 / 3)):
        _, one = cost(forward)
        want = 1 / (share / rate(both, False) + (1 - share) / rate(bf16, False))
        assert rate(one, False) == pytest.approx(want)
        assert rate(one, True) == pytest.approx(rate(bf16, True))
    if not calibrated:
        H, F = m.hidden_size, m.expert_ffn_size
        fwd_bytes = lambda c: np.asarray(c.stages["fp8 quantise"].fwd.hbm_bytes).ravel()[0]  # noqa: E731
        assert fwd_bytes(cost("down")[1]) == pytest.approx(fwd_bytes(both) * F / H)
        one_gpu = Candidates.one(0, 1, 1, 4, 2, colocated=True)
        assert fwd_bytes(cost("down", candidates=one_gpu)[1]) == 0 < fwd_bytes(cost("both", candidates=one_gpu)[1])
        assert fwd_bytes(cost("gate-up")[1]) == pytest.approx(fwd_bytes(both))


def test_which_backward_stages_a_measured_fp8_curve_prices_by_the_recipe_it_was_measured_under():
    from disagmoe.placement.cost import fp8_measured_backward

    both, data = ("routed experts", "expert weight grads"), ("routed experts",)
    assert {(run, curve): fp8_measured_backward(run, curve) for run in ("fp8", "bf16-wgrad", "bf16")
            for curve in ("fp8", "bf16-wgrad")} == {
        ("fp8", "fp8"): both, ("fp8", "bf16-wgrad"): both, ("bf16-wgrad", "fp8"): data,
        ("bf16-wgrad", "bf16-wgrad"): both, ("bf16", "fp8"): (), ("bf16", "bf16-wgrad"): ()}


@pytest.mark.parametrize("forward", ["both", "gate-up", "down"])
def test_the_committed_fp8_curve_prices_the_default_backward_as_its_probe_version_measured_it(forward):
    """h200-sxm-calibrated as of probe version 6 (its FP8 curve measured under the default bf16-wgrad) and
    the same file read as version 5 (measured under the all-FP8 backward), the default backward
    with each forward: under 6 the weight gradients at the data gradients' rate (the curve's
    whole-backward rate, both stages as it was fitted); under 5 at the bf16 curve's weight-gradient
    rate, as before; the forward (its blend by share) and the data gradients the same either way. The weight
    gradients unpaired in all three (a paired launch's rate is the curve's at two micro-batches' rows:
    test_an_odd_micro_batch_count_prices_its_last_weight_gradient_launch_at_one_micro_batchs_rows)."""
    hw = load_hardware(str(H200_CALIBRATED_V6))
    assert hw.calibration.probe_version == 6 and hw.calibration.fp8_curve_backward == "bf16-wgrad"
    layout, m = Candidates.one(4, 4, 1, 4, 2), load_model("qwen3-30b-a3b")

    def cost(version, precision="fp8"):
        calib = hw.calibration.model_copy(update={"probe_version": version})
        req = PlanConfig(model=m, cluster=ClusterConfig(hardware=hw.model_copy(update={"calibration": calib}),
                                                        num_gpus=8),
                         seq_len=4096, global_batch_tokens=1 << 20, recompute="none", expert_precision=precision,
                         expert_wgrad_pairs="off", **({"fp8_expert_forward": forward} if precision == "fp8" else {}))
        return problem_of(req), evaluate(problem_of(req), layout)

    (prob, v6), (_, v5), (_, bf16) = cost(6), cost(5), cost(6, "bf16")
    rate = lambda c, name, bwd: c.stages[name].ceilings(bwd, prob.ceilings).flops_per_s[0]  # noqa: E731
    data = rate(v6, "routed experts", True)
    assert rate(v6, "expert weight grads", True) == pytest.approx(data, rel=1e-12)
    assert rate(v5, "expert weight grads", True) == pytest.approx(rate(bf16, "expert weight grads", True), rel=1e-12)
    assert rate(v5, "routed experts", True) == pytest.approx(data, rel=1e-12)
    assert rate(v5, "routed experts", False) == pytest.approx(rate(v6, "routed experts", False), rel=1e-12)
    assert data != pytest.approx(rate(bf16, "expert weight grads", True))
    assert (v6.step_s[0] < v5.step_s[0]) == (data > rate(bf16, "expert weight grads", True))
    assert "fp8 quantise" not in v6.stages and "fp8 quantise" not in v5.stages


@pytest.mark.parametrize("colocated", [False, True])
def test_selective_recomputation_frees_exactly_the_dropped_terms_and_pays_their_bytes(colocated):
    """Selective lowers the predicted memory by the dropped rows (input, SwiGLU, combine) of every
    pair the GPU's buffers span less the backward's recomputed transient, and adds the regather and
    SwiGLU write to the expert backward of the rows it computes."""
    from disagmoe.roofline import memory as mem

    model = load_model("qwen3-30b-a3b")
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=8),
                     seq_len=1024, global_batch_tokens=1024 * 64)
    cand = Candidates.one(0, 8, 1, 4, 2, colocated=True) if colocated else Candidates.one(4, 4, 1, 4, 2)
    none, sel = (evaluate(replace(problem_of(req), recompute=r, recompute_modules=mem.SELECTIVE), cand)
                 for r in ("none", "selective"))
    rows = 2 * 1024 * model.top_k if colocated else 4 * 2 * 1024 * model.top_k / 4  # computed per GPU
    pairs = 8 * 2 * 1024 * model.top_k if colocated else 4 * 2 * 1024 * model.top_k  # spanned: every source's
    H, F = model.hidden_size, model.expert_ffn_size
    kept = 4 * pairs * model.num_moe_layers * 2 * (H + F + H)  # input row, SwiGLU output, combine row
    freed = (none.attn_mem_bytes - sel.attn_mem_bytes) if colocated else (none.expert_mem_bytes - sel.expert_mem_bytes)
    recomputed = pairs * 2 * (H + F)  # the backward's regathered row and SwiGLU output
    if colocated:  # the layer backward is the held transient here only if it beats the head
        held_none, held_sel = (max(mem.head_bytes(model, 2048, 2, fused=True), 2048 * mem.attention_grad_bytes(model, True, 2)
                                   + pairs * mem.expert_row_grad_bytes(model, 2, d))
                               for d in (mem.NOTHING_DROPPED, mem.SELECTIVE))
        recomputed = held_sel - held_none
    assert freed[0] == pytest.approx(kept - recomputed, rel=1e-12)
    assert not none.selective[0] and sel.selective[0] and "selective recompute" not in none.stages
    extra = sel.stages["selective recompute"].bwd
    assert extra.flops == 0 and extra.hbm_bytes[0] == pytest.approx(2 * rows * (2 * H + F))
    assert sel.step_s[0] > none.step_s[0]


@pytest.mark.parametrize("colocated", [False, True])
def test_selective_recomputation_pays_only_for_the_expert_modules_it_drops(colocated):
    """`recompute_modules` names which expert modules selective drops: expert_input's regather
    (read and write [rows, H] bf16), expert_swiglu's second write of the SwiGLU output ([rows, F]),
    expert_output nothing; a module kept costs nothing in the backward, where every module had been
    priced as dropped."""
    model = load_model("qwen3-30b-a3b")
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=8),
                     seq_len=1024, global_batch_tokens=1024 * 64)
    cand = Candidates.one(0, 8, 1, 4, 2, colocated=True) if colocated else Candidates.one(4, 4, 1, 4, 2)
    rows = 2 * 1024 * model.top_k if colocated else 4 * 2 * 1024 * model.top_k / 4  # computed per GPU
    H, F = model.hidden_size, model.expert_ffn_size
    for modules, row_bytes in (({"expert_input"}, 2 * H), ({"expert_swiglu"}, F), ({"expert_output"}, 0),
                               ({"expert_input", "expert_swiglu", "expert_output"}, 2 * H + F)):
        cost = evaluate(replace(problem_of(req), recompute="selective", recompute_modules=frozenset(modules)), cand)
        assert cost.selective[0]
        assert cost.stages["selective recompute"].bwd.hbm_bytes[0] == pytest.approx(2 * rows * row_bytes), modules


@pytest.mark.parametrize("colocated", [False, True])
def test_fp8_backwards_that_gather_the_input_rows_again_pay_for_them(colocated):
    """FP8 experts recomputing expert_input: the bf16-wgrad (default) and bf16 backwards gather the
    input rows again in bf16 for their w13 gradient (`RowSource.rows`), so their selective
    recompute stage costs the fp8 backward's (each row's token index) plus exactly that gather
    (read and write [rows, H] bf16: `stages.permute_rows`); an expert GPU holds each recipe's own
    backward transient (`memory.expert_row_grad_bytes`), the rest of its activations the same. With
    H = 8F (Qwen3-30B's experts at F 256) bf16-wgrad's peak is the w13 gradient's, the regathered
    rows beside d y and d h13; at Qwen3-30B's own F it is the d h13 GEMM's."""
    from disagmoe.roofline import memory as mem
    from disagmoe.roofline import stages as st

    cand = Candidates.one(0, 8, 1, 4, 2, colocated=True) if colocated else Candidates.one(4, 4, 1, 4, 2)
    for model in (load_model("qwen3-30b-a3b"), load_model("qwen3-30b-a3b").model_copy(update={"expert_ffn_size": 256})):
        req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=8),
                         seq_len=1024, global_batch_tokens=1024 * 64, recompute="selective", expert_precision="fp8")
        # unpaired: the waiting rows of paired weight gradients differ by recipe too (e4m3 token-group copies
        # under fp8: test_the_all_fp8_backwards_waiting_copies_are_priced_as_its_token_group_copies)
        costs = {b: evaluate(replace(problem_of(req), fp8_backward=b, wgrad_pairs=False), cand)
                 for b in ("fp8", "bf16-wgrad", "bf16")}
        assert all(cost.selective[0] for cost in costs.values())
        rows = 2 * 1024 * model.top_k if colocated else 4 * 2 * 1024 * model.top_k / 4  # computed per GPU
        recompute = {b: cost.stages["selective recompute"].bwd.hbm_bytes[0] for b, cost in costs.items()}
        gather = st.permute_rows(model, rows).hbm_bytes
        assert gather == 2 * 2 * rows * model.hidden_size
        assert recompute["fp8"] == pytest.approx(8 * rows)
        assert recompute["bf16-wgrad"] == pytest.approx(recompute["fp8"] + gather) == recompute["bf16"]
        if colocated:
            continue
        pairs = 4 * 2 * 1024 * model.top_k  # spanned: every source's
        dropped = problem_of(req).recompute_modules
        # a distributed expert GPU counts its FP8 numerics every step: no fused e4m3 copies
        held = {b: mem.expert_row_grad_bytes(model, 2, dropped, fp8=True, fp8_backward=b, fused_copies=False)
                for b in costs}
        for b, cost in costs.items():
            assert cost.expert_act_bytes[0] - costs["fp8"].expert_act_bytes[0] == pairs * (held[b] - held["fp8"])
        H, F = model.hidden_size, model.expert_ffn_size
        regathered = 2 * (H + 2 * F + H)  # d y, d h13 and the rows gathered again
        assert (held["bf16-wgrad"] == regathered) == (H == 8 * F)


def test_auto_recomputes_only_where_nothing_else_fits():
    """A candidate whose expert GPU overflows without recomputation but fits with it: auto picks
    selective; with memory to spare it picks none; selective is never the faster of the two."""
    model = load_model("qwen3-30b-a3b")
    cand = Candidates.one(4, 4, 1, 8, 4)
    hw = load_hardware("h200-sxm")

    def cost(recompute, hbm):
        req = PlanConfig(model=model, cluster=ClusterConfig(hardware=hw.model_copy(update={"hbm_gib": hbm}),
                                                            num_gpus=8), seq_len=4096,
                         global_batch_tokens=4096 * 128, recompute=recompute, memory_headroom=1.0)
        return evaluate(problem_of(req), cand)

    none, sel = cost("none", 1e6), cost("selective", 1e6)
    need_none, need_sel = (float(max(c.attn_mem_bytes[0], c.expert_mem_bytes[0])) / 2**30 for c in (none, sel))
    assert need_sel < need_none
    tight = (need_sel + need_none) / 2
    assert not cost("none", tight).fits[0] and cost("selective", tight).fits[0]
    squeezed = cost("auto", tight)
    assert squeezed.fits[0] and squeezed.selective[0] and squeezed.step_s[0] == sel.step_s[0]
    plenty = cost("auto", 1e6)
    assert not plenty.selective[0] and plenty.step_s[0] == none.step_s[0] < sel.step_s[0]


@pytest.mark.parametrize("micro_batches", ["auto", "8"])
def test_the_qwen3_configs_weight_gradient_stage_reads_and_writes_every_fp32_main_gradient_per_micro_batch(
        micro_batches, tmp_path):
    """`roofline -c configs/h200x2-qwen3-30b.yaml --layout single`, whole step: the expert weight
    gradients' HBM bytes are their rows' bf16 reads plus (launches x 8 - 4) B x the expert
    parameters (the Triton weight-gradient GEMM reads and writes each expert weight's fp32 main
    gradient once per launch, but for the step's first, which stores it: first touch; a launch per
    micro-batch under expert_wgrad_pairs: off, per two by default), whatever hardware file prices them."""
    import json
    from pathlib import Path

    import yaml
    from typer.testing import CliRunner

    from disagmoe.cli.app import app
    from disagmoe.config import load_train_config
    from disagmoe.roofline.params import count_params
    from disagmoe.roofline.stages import BF16

    source = Path(__file__).resolve().parents[2] / "configs" / "h200x2-qwen3-30b.yaml"
    cfg = yaml.safe_load(source.read_text())
    cfg["micro_batches"] = micro_batches if micro_batches == "auto" else int(micro_batches)
    config = tmp_path / "qwen3.yaml"
    config.write_text(yaml.safe_dump(cfg))
    m = load_model(load_train_config(config).model)
    for hardware, pairs in itertools.product(("h200-sxm", "h200-sxm-calibrated"), ("off", "auto")):
        r = CliRunner().invoke(app, ["roofline", "-c", str(config), "--layout", "single", "--hardware", hardware, "--json",
                                     f"expert_wgrad_pairs={pairs}"])
        assert r.exit_code == 0, r.output
        out = json.loads(r.stdout)
        mb = out["plan"]["micro_batches"]
        assert mb == (2 if micro_batches == "auto" else 8)  # auto: the memory model's choice on one H200
        (row,) = [s for s in out["step"] if s["stage"] == "expert weight grads" and s["pass"] == "bwd"]
        rows_per_step = cfg["batch_size"] * cfg["seq_len"] * m.top_k * m.num_moe_layers  # every pair once
        row_bytes = BF16 * rows_per_step * (2 * m.hidden_size + 3 * m.expert_ffn_size)
        launches = mb if pairs == "off" else (mb + 1) // 2
        main_grad_bytes = (launches * 8 - 4) * count_params(m).routed_experts
        assert row["hbm_bytes"] == pytest.approx(row_bytes + main_grad_bytes, rel=1e-12), (hardware, pairs)


@pytest.mark.parametrize("colocated", [False, True])
@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_an_offloaded_optimizer_holds_two_buckets_on_the_gpu_and_pays_the_host_link(colocated, state_dtype):
    """offload_optimizer: each GPU's fp32 masters and moments (12 bytes per parameter, 8 with bf16
    moments) leave its memory for the host's, two 256 MiB staging buckets (plus one bucket's fp32
    scratch with bf16 moments) come in, and the optimizer step takes at least those bytes over the
    preset's host link, one way (both directions at once); the plan says where the state went."""
    m = load_model("qwen3-30b-a3b")
    hw = load_hardware("h200-sxm")

    def cfg(offload):
        return PlanConfig(model=m, cluster=ClusterConfig(hardware=hw, num_gpus=16), seq_len=4096,
                          optimizer_state_dtype=state_dtype, offload_optimizer=offload)

    one = Candidates.one(0, 16, 1, 2, 1, colocated=True) if colocated else Candidates.one(8, 8, 1, 2, 1)
    plain, off = evaluate(problem_of(cfg(False)), one), evaluate(problem_of(cfg(True)), one)
    moved = 12 if state_dtype == "fp32" else 8
    staging = 2 * 2**28 + (2**28 if state_dtype == "bf16" else 0)  # two slots (+ the fp32 scratch)
    params = float(plain.attn_params[0]) + (float(plain.expert_params[0]) if colocated else 0.0)
    assert float(plain.attn_mem_bytes[0] - off.attn_mem_bytes[0]) == pytest.approx(params * moved - staging, rel=1e-6)
    group = "colocated" if colocated else "attention"
    optimizer = off.stages["optimizer (attention)"]
    link_s = float(plain.attn_params[0]) * moved / (hw.host_link_gbps * 1e9)
    assert float(np.ravel(optimizer.time(True, problem_of(cfg(True)).ceilings))[0]) >= link_s
    assert float(off.step_s[0]) > float(plain.step_s[0])  # PCIe is slower than the HBM pass it replaces
    plan = price(cfg(True), one).plan
    report = plan.memory_per_gpu[group]
    assert report.host_gib * 2**30 == pytest.approx(params * moved, rel=1e-9)
    assert report.total_gib * 2**30 == pytest.approx(float(off.attn_mem_bytes[0]), rel=1e-9)
    assert any("offloaded" in n and "64 GB/s per direction" in n for n in plan.notes)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_an_offloaded_optimizer_is_torchs_update_whatever_the_update_kernel(state_dtype):
    """Offloaded buckets take torch's path (`FlatAdamW._step_offloaded`): the update kernel moves no
    offloaded price, and each optimizer stage is torch's passes plus the staging copies, its host-link
    bytes `host_link_bytes` per parameter each way (the attention side's ZeRO-1 share here: none)."""
    from disagmoe.roofline import stages as st
    from disagmoe.roofline.optimizer_state import host_link_bytes

    m, hw = load_model("qwen3-30b-a3b"), load_hardware("h200-sxm")
    one = Candidates.one(8, 8, 1, 2, 1)

    def offloaded(update_kernel):
        req = PlanConfig(model=m, cluster=ClusterConfig(hardware=hw, num_gpus=16), seq_len=4096,
                         optimizer_state_dtype=state_dtype, optimizer_update_kernel=update_kernel,
                         offload_optimizer=True)
        return evaluate(problem_of(req), one)

    triton, torch_update = offloaded("triton"), offloaded("torch")
    link = host_link_bytes(state_dtype)
    for name, params in (("optimizer (attention)", triton.attn_params), ("optimizer (experts)", triton.expert_params)):
        assert triton.stages[name].bwd == torch_update.stages[name].bwd
        work, held = triton.stages[name].bwd, _first(params)
        touched = held if name == "optimizer (experts)" else 0  # first touch: the experts' not zeroed
        torch_step = st.optimizer_step(held, state_dtype, "torch", True, touched)
        assert _first(work.hbm_bytes) == pytest.approx(torch_step.hbm_bytes + 2 * held * link)
        assert _first(work.host_bytes) == pytest.approx(held * link)


def test_offload_is_refused_on_hardware_without_a_host_link():
    hw = load_hardware("h200-sxm").model_copy(update={"host_link_gbps": None})
    with pytest.raises(ValueError, match="has no host_link_gbps: add it"):
        PlanConfig(model=load_model("qwen3-30b-a3b"), cluster=ClusterConfig(hardware=hw, num_gpus=8), seq_len=4096,
                   offload_optimizer=True)
    for name in ("h100-sxm", "h200-sxm", "h200-sxm-calibrated", "h800", "b200"):  # PCIe Gen5 x16
        assert load_hardware(name).host_link_gbps == 64
    for name in ("gb200-nvl72", "gb300-nvl72"):  # NVLink-C2C to Grace
        assert load_hardware(name).host_link_gbps == 450


ARENA_LAYOUTS = [(1, 1, 1, 2, 2), (2, 4, 1, 2, 1), (4, 4, 2, 1, 1), (3, 3, 3, 2, 1)]  # attn, expert, p, m, seqs


def _priced_and_built(attn: int, expert: int, p: int, m: int, seqs: int, graphs: str):
    """(the planner's cost of a split under `cuda_graphs: graphs`, the nvshmem arena the runtime
    builds for the same run from every rank's program (`receive_layouts`, what the transport
    allocates), `layout_transport_bytes` of the split by `step_aligned`)."""
    from disagmoe.config import TrainConfig
    from disagmoe.roofline import transport_memory as tm
    from disagmoe.runtime.stages.messages import MessageShapes, receive_layouts
    from disagmoe.runtime.topology import Topology

    model, seq = load_model("tiny"), 64
    cfg = TrainConfig.model_validate(dict(
        model="tiny", mode="disaggregated", attention_ranks=attn, expert_ranks=expert, pipeline_groups=p,
        transport="nvshmem", device="cuda", experts_backend="triton", hop="partial_sums", precision="bf16",
        micro_batches=m, batch_size=seqs * m * attn // p, seq_len=seq, cuda_graphs=graphs))
    topology = Topology.from_config(cfg, model)
    arena = receive_layouts(cfg, MessageShapes.of_run(cfg, model, topology), topology)[0].nbytes
    prob = problem_of(PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=8),
                                 seq_len=seq, cuda_graphs=graphs))
    per_set = expert // p
    shape = tm.HopShape(seqs, seq, model.hidden_size, model.top_k, model.num_experts, "bf16",
                        model.shared_ffn_size > 0, False, per_set > 1)
    laid = {aligned: int(tm.layout_transport_bytes(model.num_layers, model.num_dense_layers, shape, np.array([p]),
                                                   np.array([attn // p]), np.array([per_set]), np.array([1]), m,
                                                   colocated=False, step_aligned=aligned)[0][0])
            for aligned in (False, True)}
    return evaluate(prob, Candidates.one(attn, expert, p, m, seqs)), arena, laid


@pytest.mark.parametrize(("attn", "expert", "p", "m", "seqs", "graphs"),
                         [(*layout, graphs) for layout in ARENA_LAYOUTS for graphs in ("off", "auto")]
                         + [(*layout, "on") for layout in ARENA_LAYOUTS if layout[0] == layout[2]])
def test_the_priced_transport_buffers_are_the_runtime_arena(attn, expert, p, m, seqs, graphs):
    """The planner's transport term for a layout is the nvshmem arena the runtime builds for the
    same layout, on every GPU: symmetric memory is as large as the largest rank's. A layout whose
    rank steps are captured (`cuda_graphs: on`, one attention GPU per pipeline group) has its rings
    rounded up to a step's messages (`layout_transport_bytes(step_aligned=True)`), one run eagerly
    (off; auto where the layout keeps the step eager) the plain rings."""
    cost, arena, laid = _priced_and_built(attn, expert, p, m, seqs, graphs)
    captured = graphs == "on" or (graphs == "auto" and attn == p)
    assert bool(cost.rank_steps.captured[0]) is captured and not cost.rank_steps.refused[0]
    assert cost.attn_transport_bytes[0] == cost.expert_transport_bytes[0] == arena == laid[captured] > 0
    plan_memory = cost.expert_mem_bytes[0] - cost.expert_transport_bytes[0]
    assert cost.expert_mem_bytes[0] == pytest.approx(plan_memory + arena)
    assert laid[True] > laid[False] or m == 1  # a pool's ring of one message a step is rounded already


COLOCATED_ARENA_LAYOUTS = [(2, 1, 2, 2, 1), (4, 2, 2, 1, 1), (6, 3, 1, 2, 1), (8, 2, 3, 1, 1),  # GPUs, p, m, seqs,
                           (4, 1, 2, 2, 2), (8, 2, 2, 1, 2), (8, 1, 3, 1, 4), (12, 3, 2, 1, 2)]  # EP blocks a group


def no_aux_tiny():
    """The tiny preset without its auxiliary loss (its EP blocks then dispatch within the block)."""
    m = load_model("tiny")
    return m.model_copy(update={"router": m.router.model_copy(update={"aux_loss_coef": 0.0})})


@pytest.mark.parametrize(("gpus", "p", "m", "seqs", "blocks"), COLOCATED_ARENA_LAYOUTS)
def test_the_priced_colocated_transport_buffers_are_the_runtime_arena(gpus, p, m, seqs, blocks):
    """A colocated layout with p pipeline groups, each in `blocks` EP blocks of its GPUs (tiny's 8
    experts once per block), is priced with the nvshmem arena the runtime builds for it: DISPATCH from
    its block's other ranks, COMBINE from the previous group's same block
    (`transport_memory.colocated_receives`), and under tiny's auxiliary loss EXPERT_LOAD from the
    other blocks' ranks at its position (without it none); the planner's plan is what the run builds."""
    for model in (load_model("tiny"), no_aux_tiny()):
        _check_colocated_arena(model, gpus, p, m, seqs, blocks)


def _check_colocated_arena(model, gpus: int, p: int, m: int, seqs: int, blocks: int) -> None:
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.plan_layout import apply_plan
    from disagmoe.runtime.stages.messages import MessageShapes, receive_layouts
    from disagmoe.runtime.topology import Topology

    seq = 64
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=16),
                     seq_len=seq, cuda_graphs="off")
    chosen = Candidates.one(0, gpus, p, m, seqs, sets=blocks, colocated=True)
    plan = price(req, chosen).plan
    cfg = apply_plan(TrainConfig.model_validate(dict(
        model=model, plan=plan, transport="nvshmem", device="cuda", experts_backend="triton", hop="partial_sums",
        precision="bf16", batch_size=seqs * m * gpus // p, seq_len=seq, cuda_graphs="off")), model)
    assert (cfg.colocated_ranks, cfg.pipeline_groups, cfg.expert_replica_sets) == (gpus, p, blocks)
    topology = Topology.from_config(cfg, model)
    assert topology.dispatch_width == gpus // p // blocks  # the block, not the group
    swapped = {len(topology.load_peers(layer, rank)) for rank in range(gpus) for layer in topology.experts_of(rank)}
    assert swapped == {blocks - 1 if model.router.needs_every_source_load else 0}
    arena = receive_layouts(cfg, MessageShapes.of_run(cfg, model, topology), topology)[0].nbytes
    cost = evaluate(problem_of(req), chosen)
    assert cost.attn_transport_bytes[0] == cost.expert_transport_bytes[0] == arena > 0


@pytest.mark.parametrize(("attn", "expert", "p", "m", "seqs"), ARENA_LAYOUTS)
def test_auto_prices_the_rounded_rings_once_a_gpu_checked_the_captured_step(monkeypatch, attn, expert, p, m, seqs):
    """`cuda_graphs: auto` with the captured rank step checked on a GPU (`step_capture.CHECKED_ON_GPU`)
    captures one attention GPU per pipeline group and runs more eagerly: the planner prices the
    rounded rings for the first and the plain ones for the others, each the arena the run builds."""
    from disagmoe.runtime.schedule import step_capture

    monkeypatch.setattr(step_capture, "CHECKED_ON_GPU", True)
    cost, arena, laid = _priced_and_built(attn, expert, p, m, seqs, "auto")
    one_per_group = attn == p
    assert bool(cost.rank_steps.captured[0]) is one_per_group
    assert cost.attn_transport_bytes[0] == arena == laid[one_per_group]
    note = cost.rank_steps.lines[0]
    assert note.startswith("cuda_graphs: auto -> on" if one_per_group else
                           f"cuda_graphs: auto -> eager: the {attn // p} attention replicas per pipeline group")


@pytest.mark.parametrize(("attn", "expert", "sets", "replicas"), [
    (1, 2, 1, 0), (1, 2, 1, 1), (1, 8, 1, 1), (1, 10, 1, 0), (2, 4, 2, 0), (0, 4, 1, 0), (0, 16, 1, 0)])
def test_the_replicated_experts_priced_are_the_plans_replica_groups(attn, expert, sets, replicas):
    """`cost.replicates_experts`, the layout fact `rank_steps` asks besides data parallel, is whether
    the topology of the plan priced for the layout has replica groups (`Topology.replica_groups`):
    tiny's 8 experts on 2 expert GPUs (once each; with a spare slot, hot replicas), on 8 (once each,
    spare slots or not), on 10, in 2 replica sets; colocated on 4 GPUs (one EP block) and 16 (two)."""
    from disagmoe.config import TrainConfig
    from disagmoe.placement.cost import colocated_ep, replicates_experts
    from disagmoe.runtime.topology import Topology

    model, colocated = load_model("tiny"), attn == 0
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=attn + expert),
                     seq_len=64, max_expert_replicas=replicas)
    cand = Candidates.one(attn, expert, 1, 2, 1, sets, colocated=colocated)
    plan = price(req, cand).plan
    assert plan.feasible and plan.layout == ("colocated" if colocated else "disaggregated")
    cfg = TrainConfig(model="tiny", device="cuda", transport="nvshmem", experts_backend="triton", seq_len=64,
                      batch_size=plan.micro_batches * plan.sequences_per_micro_batch, plan=plan)  # one round a step
    ranks = colocated_ep(model.num_experts, expert) if colocated else np.array([expert // sets])
    replicated = bool(replicates_experts(problem_of(req), cand, ranks)[0])
    assert replicated == bool(Topology.from_config(cfg, model).replica_groups())
    assert replicated == ((attn, expert, sets, replicas) in {(1, 2, 1, 1), (1, 10, 1, 0), (2, 4, 2, 0), (0, 16, 1, 0)})


@pytest.mark.parametrize(("attn", "expert", "replicas", "why"), [
    (2, 2, 0, "the 2 attention replicas per pipeline group sum gradients"),
    (1, 2, 1, "replicated experts sum their gradients"),
    (0, 4, 0, "the 4 attention replicas per pipeline group sum gradients")])
def test_a_layout_cuda_graphs_on_cannot_capture_is_refused_with_trains_reason(attn, expert, replicas, why):
    """Under `cuda_graphs: on` a layout whose rank steps cannot be captured never fits (`train`
    refuses it: `resolve_rank_graphs` raises); priced as a fixed layout, its plan says so in its
    reason, its notes and `rank_steps_note` (the refusal, word for word), whatever its memory."""
    colocated = attn == 0
    req = PlanConfig(model=load_model("tiny"), cluster=ClusterConfig(hardware=load_hardware("h200-sxm"),
                     num_gpus=attn + expert), seq_len=64, max_expert_replicas=replicas, cuda_graphs="on")
    choice = price(req, Candidates.one(attn, expert, 1, 2, 1, colocated=colocated))
    plan, steps = choice.plan, choice.cost.rank_steps
    assert steps.refused[0] and not steps.captured[0] and not choice.cost.fits[0]
    assert not plan.feasible and plan.rank_steps_captured is False
    mode = "colocated" if colocated else "disaggregated"
    assert plan.rank_steps_note.startswith(f"cuda_graphs: on cannot capture mode {mode}'s rank steps here: ")
    assert why in plan.rank_steps_note and plan.rank_steps_note.endswith("; or set cuda_graphs: off")
    assert plan.reason.startswith("refused by cuda_graphs: on: ")
    assert f"train refuses this layout: {plan.rank_steps_note}" in plan.notes
    assert all(e.total_gib <= e.capacity_gib for e in plan.memory_per_gpu.values())  # it fits in memory


def test_a_layout_that_fits_only_without_the_transport_buffers_is_refused():
    """DeepSeek-V3 on 256 GB200s: the plan chosen before the buffers were counted (48 attention +
    208 expert GPUs, p=8, 8 micro-batches of one sequence per attention GPU) fits only without
    them: its nvshmem arena (a [T, H] segment per expert rank, layer and micro-batch: the forward
    messages live until the backward, so their rings share nothing) is over 100 GiB. The plan now
    chosen reports its buffers and fits with them."""
    cfg = PlanConfig(model=load_model("deepseek-v3"), cluster=ClusterConfig(hardware=load_hardware("gb200-nvl72"),
                     num_gpus=256), seq_len=4096, global_batch_tokens=33554432)
    prob = problem_of(cfg)
    before = evaluate(prob, Candidates.one(48, 208, 8, 8, 1))
    without = before.lean_expert_mem_bytes[0] - before.expert_transport_bytes[0]
    assert without <= prob.capacity_bytes < before.lean_expert_mem_bytes[0] and not before.fits[0]
    assert before.expert_transport_bytes[0] > 100 * 2**30
    plan = solve(cfg)
    assert plan.feasible and (plan.attention_gpus, plan.micro_batches) != (48, 8)
    for e in plan.memory_per_gpu.values():
        assert 0 < e.transport_gib < e.total_gib <= e.capacity_gib
        assert e.total_gib == pytest.approx(e.weights_gib + e.grads_gib + e.optimizer_gib + e.activations_gib
                                            + e.transport_gib)


@pytest.mark.parametrize("colocated", [False, True])
def test_attention_recomputation_frees_exactly_the_attention_terms_and_pays_its_work(colocated):
    """recompute_modules: [attention] lowers the attention side's kept bytes by
    `memory.attention_recomputed_bytes` per token of every layer in flight, less the recomputed
    transient the backward holds on top, leaves the expert side alone, and adds
    `stages.attention_recompute` to every layer's attention backward."""
    from disagmoe.placement.cost import ATTENTION
    from disagmoe.roofline import memory as mem
    from disagmoe.roofline.stages import attention_recompute

    model = load_model("qwen3-30b-a3b")
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=8),
                     seq_len=1024, global_batch_tokens=1024 * 64)
    cand = Candidates.one(0, 8, 1, 4, 2, colocated=True) if colocated else Candidates.one(4, 4, 1, 4, 2)
    none, att = (evaluate(replace(problem_of(req), recompute=r, recompute_modules=ATTENTION), cand)
                 for r in ("none", "selective"))
    tokens, L = 2 * 1024, model.num_layers
    dropped = mem.attention_recomputed_bytes(model, 2)
    pairs = 8 * tokens * model.top_k if colocated else 4 * tokens * model.top_k

    def held(d):  # the transient on top of what is kept: the head, or one layer's backward
        rows = pairs * mem.expert_row_grad_bytes(model, 2) if colocated else 0
        return max(mem.head_bytes(model, tokens, 2), tokens * mem.attention_grad_bytes(model, True, 2, d) + rows)

    freed = none.attn_act_bytes[0] - att.attn_act_bytes[0]
    assert freed == pytest.approx(4 * tokens * L * dropped - (held(ATTENTION) - held(mem.NOTHING_DROPPED)), rel=1e-12)
    assert none.expert_act_bytes[0] == att.expert_act_bytes[0]
    assert att.recompute_attention[0] and not att.selective[0] and att.dropped() == ATTENTION
    assert not none.recompute_attention[0] and "attention recompute" not in none.stages
    stage = att.stages["attention recompute"]
    assert (stage.group, stage.runs, stage.fwd.flops) == ("attention", "layer", 0)
    want = attention_recompute(model, tokens)
    assert stage.bwd.flops[0] == pytest.approx(want.flops) and stage.bwd.hbm_bytes[0] == pytest.approx(want.hbm_bytes)
    assert att.step_s[0] > none.step_s[0]


def test_auto_recomputes_each_side_of_a_split_only_where_it_overflows():
    """In a split each GPU's memory depends on its own modules only: auto drops the expert modules
    where only they let the expert GPU fit and attention where only it lets the attention GPU fit,
    and prices the candidate exactly as that fixed choice; with room, nothing."""
    from disagmoe.placement.cost import ATTENTION
    from disagmoe.roofline import memory as mem

    model = load_model("qwen3-30b-a3b")
    cand = Candidates.one(1, 32, 1, 4, 2)
    hw = load_hardware("h200-sxm")

    def cost(hbm, recompute="auto", modules=None):
        req = PlanConfig(model=model, cluster=ClusterConfig(hardware=hw.model_copy(update={"hbm_gib": hbm}),
                                                            num_gpus=64), seq_len=4096, global_batch_tokens=1 << 22,
                         recompute=recompute, recompute_modules=modules, memory_headroom=1.0)
        return evaluate(problem_of(req), cand)

    fixed = {d: cost(1e6, "selective", sorted(d)) for d in (ATTENTION, mem.SELECTIVE, mem.SELECTIVE | ATTENTION)}
    plain = cost(1e6, "none")
    attn_plain, attn_lean = (float(c.attn_mem_bytes[0]) / 2**30 for c in (plain, fixed[ATTENTION]))
    exp_plain, exp_lean = (float(c.expert_mem_bytes[0]) / 2**30 for c in (plain, fixed[mem.SELECTIVE]))
    assert attn_lean < attn_plain and exp_lean < exp_plain
    both = cost(max(attn_lean, exp_lean) + 1e-3)  # tight on both sides (this layout: expert GPUs fuller)
    assert attn_plain > max(attn_lean, exp_lean) and both.fits[0]
    assert both.dropped() == mem.SELECTIVE | ATTENTION and both.step_s[0] == fixed[mem.SELECTIVE | ATTENTION].step_s[0]
    experts_only = cost(max(attn_plain, exp_lean) + 1e-3)
    assert experts_only.fits[0] and experts_only.dropped() == mem.SELECTIVE
    assert experts_only.step_s[0] == fixed[mem.SELECTIVE].step_s[0]
    roomy = cost(1e6)
    assert roomy.dropped() == mem.NOTHING_DROPPED and roomy.step_s[0] == plain.step_s[0]
    assert roomy.step_s[0] < fixed[ATTENTION].step_s[0] < fixed[mem.SELECTIVE | ATTENTION].step_s[0]
    # without the expert modules (not triton) the expert GPU cannot fit where it needed them
    grouped = evaluate(problem_of(PlanConfig(
        model=model, cluster=ClusterConfig(hardware=hw.model_copy(update={"hbm_gib": max(attn_lean, exp_lean) + 1e-3}),
                                           num_gpus=64), seq_len=4096, global_batch_tokens=1 << 22,
        experts_backend="grouped_mm", memory_headroom=1.0)), cand)
    assert not grouped.fits[0] and not grouped.selective[0]


def test_a_colocated_gpu_takes_the_cheapest_recomputation_that_fits():
    """One GPU holds both sides: auto takes none where it fits, the expert modules (a few HBM bytes)
    before attention (about one more attention forward) where either fits, both where only both do. Unpaired
    weight gradients (their waiting rows, which auto settles against the device too: test_waiting_rows.py)."""
    from disagmoe.placement.cost import ATTENTION
    from disagmoe.roofline import memory as mem

    model = load_model("qwen3-30b-a3b")
    cand = Candidates.one(0, 8, 1, 4, 2, colocated=True)
    hw = load_hardware("h200-sxm")

    def cost(hbm, recompute="auto", modules=None):
        req = PlanConfig(model=model, cluster=ClusterConfig(hardware=hw.model_copy(update={"hbm_gib": hbm}),
                                                            num_gpus=8), seq_len=4096, global_batch_tokens=1 << 22,
                         recompute=recompute, recompute_modules=modules, memory_headroom=1.0,
                         expert_wgrad_pairs="off")
        return evaluate(problem_of(req), cand)

    need = {d: float(cost(1e6, "selective", sorted(d)).attn_mem_bytes[0]) / 2**30
            for d in (ATTENTION, mem.SELECTIVE, mem.SELECTIVE | ATTENTION)}
    need[mem.NOTHING_DROPPED] = float(cost(1e6, "none").attn_mem_bytes[0]) / 2**30
    assert need[mem.SELECTIVE | ATTENTION] < min(need[ATTENTION], need[mem.SELECTIVE])
    assert max(need[ATTENTION], need[mem.SELECTIVE]) < need[mem.NOTHING_DROPPED]
    assert cost(need[mem.SELECTIVE | ATTENTION] + 1e-3).dropped() == mem.SELECTIVE | ATTENTION
    either = cost(max(need[ATTENTION], need[mem.SELECTIVE]) + 1e-3)
    assert either.fits[0] and either.dropped() == mem.SELECTIVE
    assert cost(need[mem.NOTHING_DROPPED] + 1e-3).dropped() == mem.NOTHING_DROPPED
    tight = cost(need[mem.SELECTIVE | ATTENTION] - 1e-3)
    assert not tight.fits[0] and tight.dropped() == mem.NOTHING_DROPPED and not tight.lean_fits[0]


def test_the_hook_adds_only_what_no_gemm_added_into_the_main_gradients():
    """The projections' weight-gradient GEMMs (bf16, under fp8_dense too: `kernels.fp8_dense.RECIPE`)
    add into the fp32 main gradients themselves (`layers.add_weight_grad_into_main`), so FlatAdamW's
    hook adds per micro-batch and MoE layer only the norm gains and the router
    (`stages.main_grad_add` of those), whatever the precision."""
    from disagmoe.roofline import stages as st
    from disagmoe.roofline.params import attention_norm_params, router_params

    m = load_model("qwen3-30b-a3b")
    one = Candidates.one(0, 1, 1, 8, 2, colocated=True)

    def adds(**kwargs):
        req = PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=1),
                         seq_len=4096, global_batch_tokens=16 * 4096, **kwargs)
        return _first(evaluate(problem_of(req), one).stages["main-grad adds"].bwd.hbm_bytes)

    want = st.main_grad_add(attention_norm_params(m) + m.hidden_size + router_params(m)).hbm_bytes
    assert adds() == pytest.approx(want)
    assert adds(expert_precision="fp8", fp8_dense=True) == adds(expert_precision="fp8", fp8_dense=False) == adds()


def test_the_all_fp8_backwards_waiting_copies_are_priced_as_its_token_group_copies():
    """Paired expert weight gradients under FP8 experts: with the all-FP8 backward what waits for the next
    micro-batch is its e4m3 token-group copies (`memory.paired_wgrad_waiting_bytes(..., fp8_token_groups=True)`:
    each local expert's rows padded to 128, one scale per 128 rows of a column), under the default recipe the
    bf16 rows, as the single trainer and the runtime's replay count them: on one GPU held beside every
    micro-batch (`attn_mem_bytes`); on a distributed expert GPU its replay's waits (`paired_waits`), which add
    to no peak here (every forward runs before the first backward)."""
    import numpy as np

    from disagmoe.placement.cost import paired_waits
    from disagmoe.roofline import memory as mem

    model = load_model("qwen3-30b-a3b").model_copy(update={"num_layers": 6})  # the one-GPU config's slice
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=1),
                     seq_len=1024, global_batch_tokens=1024 * 64, expert_precision="fp8")
    prob, cand = problem_of(req), Candidates.one(0, 1, 1, 4, 8, colocated=True)  # 4 micro-batches of 8,192 tokens

    def held(backward):
        on, off = (evaluate(replace(prob, fp8_backward=backward, wgrad_pairs=p, wgrad_pairs_budget=float("inf")), cand)
                   for p in (True, False))  # on as asked
        assert on.wgrad_pairs[0] and not off.wgrad_pairs[0]
        return on.attn_mem_bytes[0] - off.attn_mem_bytes[0]

    rows, groups, layers = 8 * 1024 * model.top_k, model.num_experts, model.num_moe_layers
    fp8_copies = layers * mem.paired_wgrad_waiting_bytes(model, rows, groups, 2, True)
    bf16_rows = layers * mem.paired_wgrad_waiting_bytes(model, rows, groups, 2)
    assert held("fp8") == pytest.approx(fp8_copies) and held("bf16-wgrad") == pytest.approx(bf16_rows)
    # 512 rows an expert and up to 127 padding rows each (81,792 padded rows), a byte a value and 4 per 128 rows
    assert fp8_copies == pytest.approx(bf16_rows * 81792 * (1 + 4 / 128) / (2 * rows))  # 0.64x the bf16 rows
    # an eighth of the tokens, 64 rows an expert and up to 127 padding rows each: past the bf16 rows
    assert (mem.paired_wgrad_waiting_bytes(model, rows // 8, groups, 2, True)
            > mem.paired_wgrad_waiting_bytes(model, rows // 8, groups, 2))
    # a distributed rank's: its rows in its local experts, per candidate
    pairs, local = np.array([4096.0, 65536.0]), np.array([32.0, 16.0])
    waits = paired_waits(model, pairs, np.array([True, False]), local, True)
    assert waits[0] == mem.paired_wgrad_waiting_bytes(model, 4096, 32, 2, True) and waits[1] == 0


def test_one_gpu_prices_the_fused_e4m3_copies_and_a_distributed_gpu_does_not(monkeypatch):
    """The planner's FP8 expert backward holds d h13's fused e4m3 rows (`memory.fp8_expert_row_grad_bytes`'
    fused_copies) on one GPU, whose steps mostly do not count their numerics, and not on a colocated GPU of
    several, which counts every step (as `runtime.activation_memory.rank_activations` replays it: their agreement,
    tests/runtime/test_activation_memory.py): the two counts differ by exactly those rows' bytes, and the one-GPU
    candidate's activations are the fused count."""
    from disagmoe.placement.cost import activations
    from disagmoe.roofline import memory as mem

    m = load_model("mixtral-8x7b")
    req = PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=1), seq_len=4096,
                     global_batch_tokens=8 * 4096, expert_precision="fp8", recompute="none")
    prob = replace(problem_of(req), wgrad_pairs=False)
    cost = evaluate(prob, Candidates.one(0, 1, 1, 4, 2, colocated=True))
    tokens = 2 * 4096  # a micro-batch's: 8 sequences in 4
    pairs = tokens * m.top_k
    by_fused = {f: _first(activations(m, tokens, pairs, 1, np.array([1]), True, fp8=True,
                                      fp8_backward=prob.fp8_backward, fused=f)[0]) for f in (True, False)}
    rows = {f: mem.expert_row_grad_bytes(m, 2, fp8=True, fp8_backward=prob.fp8_backward, fused_copies=f)
            for f in (True, False)}
    assert rows[True] > rows[False]
    assert by_fused[True] - by_fused[False] == pytest.approx(pairs * (rows[True] - rows[False]))
    assert _first(cost.attn_act_bytes) == pytest.approx(by_fused[True])  # one GPU: the fused copies counted
    # which count each candidate's backward takes: one GPU the fused, two colocated GPUs and a split not
    from disagmoe.placement import cost as cost_module

    asked = []
    plain = cost_module._row_grad_bytes
    monkeypatch.setattr(cost_module, "_row_grad_bytes", lambda *a, **k: asked.append(np.asarray(a[-1], dtype=bool))
                        or plain(*a, **k))
    two = replace(problem_of(req.model_copy(update={"cluster": ClusterConfig(hardware=load_hardware("h200-sxm"),
                                                                                num_gpus=2)})), wgrad_pairs=False)
    for gpus, cand, fused in ((1, Candidates.one(0, 1, 1, 4, 2, colocated=True), True),
                              (2, Candidates.one(0, 2, 1, 4, 2, colocated=True), False),
                              (2, Candidates.one(1, 1, 1, 4, 2), False)):
        asked.clear()
        evaluate(prob if gpus == 1 else two, cand)
        assert asked and all(np.all(a == fused) for a in asked), (gpus, asked)
