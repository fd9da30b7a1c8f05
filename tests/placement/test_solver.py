"""Placement solver: exact optimum of its own cost model, memory, speed, and every preset."""

import itertools
import math
import re
import time
from pathlib import Path

import numpy as np
import pytest

from disagmoe.config import ClusterConfig, Fp8RatePoint, Plan, PlanConfig, load_hardware, preset_names
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import Candidates, evaluate
from disagmoe.placement.solver import MAX_SEQS_PER_GPU, MEMORY_BOUND, choose, price, problem_of, solve
from disagmoe.roofline import stages as st

# the H200 calibration of probe version 6 (the committed preset until session 47: its FP8 expert curve measured
# under bf16-wgrad, no FP8 projection curve), for the FP8 pricing tests of that version
H200_CALIBRATED_V6 = Path(__file__).parent / "data" / "h200-sxm-calibrated-v6.yaml"


def request(model, hardware, gpus, seq_len=None, batch=4 * 1024 * 1024, **kw):
    m = load_model(model)
    return PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware(hardware), num_gpus=gpus),
                      seq_len=seq_len or m.seq_len, global_batch_tokens=batch, **kw)


def brute_force_best(cfg):
    """Price every layout on at most the job's GPUs one at a time (no vectorisation, no pruning):
    every attention count, every colocated EP degree and block count."""
    prob = problem_of(cfg)
    n_gpu, n_exp = cfg.cluster.num_gpus, cfg.model.num_experts
    seqs_choices = [2**i for i in range(int(math.log2(MAX_SEQS_PER_GPU)) + 1)]
    best = math.inf
    for p in range(1, min(cfg.max_pipeline_groups, cfg.model.num_layers) + 1):
        per_group = n_gpu // p
        layouts = [(0, ep * blocks * p, blocks, True) for ep in range(1, n_exp + 1) if n_exp % ep == 0
                   for blocks in range(1, per_group // ep + 1)]
        for per_set, sets in itertools.product(range(1, n_exp + 1), range(1, per_group + 1)):
            for attn_pg in range(sets, per_group - sets * per_set + 1):
                layouts.append((attn_pg * p, sets * per_set * p, sets, False))
        for (attn, exp, sets, colocated), m, seqs in itertools.product(layouts, cfg.micro_batch_choices, seqs_choices):
            dp = (exp if colocated else attn) // p
            if m * dp * seqs * cfg.seq_len > cfg.global_batch_tokens:
                continue
            cost = evaluate(prob, Candidates.one(attn, exp, p, m, seqs, sets, colocated=colocated))
            if cost.fits[0]:
                best = min(best, float(cost.step_s[0]))
    return best


@pytest.mark.parametrize("gpus, hardware, graphs", [(4, "h200-sxm", "auto"), (6, "h100-sxm", "auto"),
                                                     (8, "b200", "auto"), (6, "h100-sxm", "on")])
def test_solver_finds_the_true_optimum_of_its_cost_model(gpus, hardware, graphs):
    """Also under `cuda_graphs: on`, where the layouts train refuses never fit: the pruning keeps the best."""
    cfg = request("tiny", hardware, gpus, seq_len=128, batch=128 * 256, max_pipeline_groups=3, cuda_graphs=graphs)
    plan = solve(cfg)
    assert plan.feasible
    assert plan.step_time_s == pytest.approx(brute_force_best(cfg), rel=1e-9)


def _planned_run(model: str, gpus: int, graphs: str, replicas: int = 0):
    """(the plan for `model` on `gpus` H200s, one pipeline group, under `cuda_graphs: graphs`, the
    config `train --plan` runs from it (a config saying `cuda_graphs: on`: the plan's wins), its
    topology)."""
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.plan_layout import apply_plan
    from disagmoe.runtime.topology import Topology

    plan = solve(request(model, "h200-sxm", gpus, seq_len=4096, batch=4096 * 64, max_pipeline_groups=1,
                         max_expert_replicas=replicas, cuda_graphs=graphs))
    assert plan.feasible and plan.layout == "disaggregated", plan.reason
    one_round = plan.micro_batches * plan.sequences_per_micro_batch  # a distributed run's step (`check_rounds`)
    cfg = apply_plan(TrainConfig(model=model, device="cuda", transport="nvshmem", experts_backend="triton",
                                 hop="partial_sums", cuda_graphs="on", seq_len=4096, batch_size=one_round, plan=plan),
                     load_model(model))
    return plan, cfg, Topology.from_config(cfg, load_model(model))


@pytest.mark.parametrize(("model", "gpus", "replicas"), [("qwen3-30b-a3b", 8, 0), ("mixtral-8x7b", 16, 1)])
def test_cuda_graphs_on_plans_a_layout_whose_rank_steps_train_captures(model, gpus, replicas):
    """`cuda_graphs: on` never yields a plan `resolve_rank_graphs` refuses: the planned config's rank
    steps are captured, as the plan says (`rank_steps_note`): one attention GPU per pipeline group,
    every expert once even where hot-expert replicas are allowed."""
    from disagmoe.runtime.rank_graphs import resolve_rank_graphs

    plan, cfg, topology = _planned_run(model, gpus, "on", replicas)
    assert resolve_rank_graphs(cfg, topology) == (True, plan.rank_steps_note) and plan.rank_steps_captured
    assert topology.data_parallel == 1 and not topology.replica_groups()


def test_without_cuda_graphs_on_the_fastest_layout_may_be_one_on_refuses():
    """Off, Qwen3-30B's fastest layout on 8 H200s has two attention GPUs: `on` would refuse it,
    which is what the search under `on` leaves out; `train --plan` takes the plan's off with it."""
    from disagmoe.runtime.rank_graphs import resolve_rank_graphs

    plan, cfg, topology = _planned_run("qwen3-30b-a3b", 8, "off")
    assert (plan.attention_gpus, plan.rank_steps_captured, plan.rank_steps_note) == (2, False, "cuda_graphs: off")
    assert plan.cuda_graphs == cfg.cuda_graphs == "off" and resolve_rank_graphs(cfg, topology) == (False,
                                                                                                  "cuda_graphs: off")
    with pytest.raises(ValueError, match="cuda_graphs: on cannot capture mode disaggregated's rank steps here: the 2 "
                                         "attention replicas"):
        resolve_rank_graphs(cfg.model_copy(update={"cuda_graphs": "on"}), topology)


def test_a_search_cuda_graphs_on_leaves_empty_says_why():
    """Qwen3-30B on 8 H200s with spare slots for hot-expert replicas: every split of one group
    replicates experts and one GPU does not fit, so `cuda_graphs: on` finds no plan; its reason
    says what `on` left out. Off, the same request has one."""
    def plan_of(graphs):
        return solve(request("qwen3-30b-a3b", "h200-sxm", 8, seq_len=4096, batch=4096 * 64, max_pipeline_groups=1,
                             max_expert_replicas=1, cuda_graphs=graphs))

    plan = plan_of("on")
    assert not plan.feasible and plan.reason.startswith("no layout fits") and plan.rank_steps_captured is None
    assert ("cuda_graphs: on plans only the layouts whose rank steps it captures (one attention GPU per pipeline "
            "group, no replicated experts); cuda_graphs: auto or off plans the others") in plan.reason
    assert plan_of("off").feasible


@pytest.mark.parametrize(("fields", "says"), [
    (dict(experts_backend="loop"), "cuda_graphs: on with experts_backend: loop"),
    (dict(offload_optimizer="on"), "offload_optimizer on with cuda_graphs: on"),
    (dict(offload_optimizer="auto"), "offload_optimizer auto with cuda_graphs: on")])
def test_cuda_graphs_on_is_refused_with_settings_no_layout_captures(fields, says):
    """A request `train` would refuse in every layout (as `TrainConfig` does) is refused in one line."""
    with pytest.raises(ValueError, match=says):
        request("tiny", "h200-sxm", 4, cuda_graphs="on", **fields)
    request("tiny", "h200-sxm", 4, cuda_graphs="auto", **fields)


def test_memory_limit_binds_and_is_reported():
    cfg = request("mixtral-8x7b", "h200-sxm", 16)
    plan = solve(cfg)
    assert plan.feasible
    for est in plan.memory_per_gpu.values():
        assert est.total_gib <= est.capacity_gib
    small = solve(request("mixtral-8x7b", "h200-sxm", 4))
    assert not small.feasible and small.min_gpus is not None and small.min_gpus > 4
    assert "fewest" in small.reason
    # the GPU count it names does fit, and one fewer does not
    assert solve(request("mixtral-8x7b", "h200-sxm", small.min_gpus)).feasible
    assert not solve(request("mixtral-8x7b", "h200-sxm", small.min_gpus - 1)).feasible


def test_deepseek_on_1152_nvl72_is_fast():
    cfg = request("deepseek-v3", "gb200-nvl72", 1152)
    start = time.process_time()  # the search's own CPU time: other processes on the machine do not count
    plan = solve(cfg)
    elapsed = time.process_time() - start
    assert plan.feasible and plan.gpus == 1152
    assert elapsed < 2.0


@pytest.mark.parametrize("gpus", [8, 64, 72, 1152])
@pytest.mark.parametrize("model", [n for n in preset_names("models") if n != "tiny"])
def test_every_preset_gets_a_plan_or_a_reason(model, gpus):
    hardware = "gb200-nvl72" if gpus in (72, 1152) else "h200-sxm"
    plan = solve(request(model, hardware, gpus))
    if plan.feasible:
        assert plan.attention_gpus + plan.expert_gpus <= gpus
        assert all(e.total_gib <= e.capacity_gib for e in plan.memory_per_gpu.values())
        assert len(plan.expert_map) == load_model(model).num_moe_layers
        assert plan.step_time_s > 0 and 0 < plan.mfu < 1
    else:
        assert "no layout fits" in plan.reason and plan.min_gpus and plan.min_gpus > gpus


def test_expert_map_covers_every_expert_in_its_group():
    cfg = request("qwen3-235b-a22b", "gb200-nvl72", 72)
    plan = solve(cfg)
    per_group = plan.expert_gpus // plan.pipeline_groups
    m = cfg.model
    for j, layer_map in enumerate(plan.expert_map):
        group = (m.num_dense_layers + j) % plan.pipeline_groups
        assert len(layer_map) == m.num_experts
        ranks = {r for owners in layer_map for r in owners}
        assert ranks <= set(range(group * per_group, (group + 1) * per_group))
        assert all(len(owners) == plan.expert_replica_sets or plan.layout == "colocated" for owners in layer_map)


def test_colocated_baseline_is_priced_on_the_same_cluster():
    plan = solve(request("tiny", "h200-sxm", 2, seq_len=128, batch=128 * 512))
    assert plan.colocated_step_time_s > 0
    assert plan.speedup_vs_colocated == pytest.approx(plan.colocated_step_time_s / plan.step_time_s)
    assert plan.reason


def test_choice_carries_cost_for_reports():
    choice = choose(request("qwen3-30b-a3b", "h200-sxm", 8))
    assert choice.cost is not None and np.all(choice.cost.step_s > 0)
    assert "routed experts" in choice.cost.stages


def test_a_sequence_too_long_for_one_gpu_is_named_not_scaled_out():
    plan = solve(request("qwen3-235b-a22b", "h100-sxm", 64, seq_len=131072))
    assert not plan.feasible and plan.min_gpus is None
    assert "context parallelism" in plan.reason


def test_ties_prefer_more_of_the_batch_done():
    cfg = request("tiny", "h200-sxm", 3, seq_len=128, batch=128 * 100)
    plan = solve(cfg)
    assert plan.feasible
    done = plan.accumulation_rounds * plan.micro_batches * plan.sequences_per_micro_batch * 128
    assert done >= cfg.global_batch_tokens


def test_the_reason_names_the_top_stage_of_the_table_once_per_step_ones_included():
    """One sequence per step: the experts' optimizer step tops the table, and the reason says so."""
    plan = solve(request("qwen3-30b-a3b", "h200-sxm", 8, seq_len=4096, batch=4096))
    top = max(plan.stage_times, key=lambda s: s.time_s)
    assert top.name.startswith("optimizer")
    assert f"heaviest stage {top.name}" in plan.reason


def test_a_fixed_layout_claims_nothing_it_did_not_price():
    cfg = request("qwen3-30b-a3b", "h200-sxm", 8)
    colocated = price(cfg, Candidates.one(0, 8, 1, 4, 1, colocated=True)).plan
    assert "beats" not in colocated.reason and "not priced" in colocated.reason
    assert not colocated.feasible and colocated.reason.startswith("does not fit")
    disaggregated = price(cfg, Candidates.one(3, 5, 1, 2, 1)).plan
    assert disaggregated.colocated_step_time_s is None and disaggregated.speedup_vs_colocated is None
    searched = solve(cfg)  # colocated p = 2, each group one EP block of 4 GPUs: a layout the runtime runs
    assert searched.layout == "colocated" and "faster than the best disaggregated split" in searched.reason
    assert (searched.pipeline_groups, searched.expert_gpus, searched.expert_replica_sets) == (2, 8, 1)
    small = solve(request("tiny", "h200-sxm", 4))  # 4 EP blocks of one GPU, swapping their loads under tiny's aux loss
    assert (small.layout, small.expert_replica_sets) == ("colocated", 4)
    assert small.step_time_s == small.colocated_step_time_s


def test_a_colocated_plan_in_ep_blocks_is_the_baseline_and_trains_as_planned():
    """The runtime runs colocated layouts in EP blocks as priced, under a router's auxiliary loss too
    (the blocks swap their loads: `Topology.load_peers`), so the best colocated layout of any depth
    and EP blocking is both the baseline and a plan: a colocated plan is that baseline, and no plan
    is slower than it. Qwen3-30B on 8 H200s is planned colocated p = 2, Mixtral on 8 colocated
    p = 8 (one GPU a group)."""
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.plan_layout import apply_plan, check_plan
    from disagmoe.runtime.topology import Topology

    for model, gpus in (("qwen3-30b-a3b", 8), ("qwen3-30b-a3b", 16), ("qwen3-30b-a3b", 32), ("mixtral-8x7b", 8),
                        ("mixtral-8x7b", 16), ("tiny", 4)):
        cfg = request(model, "h200-sxm", gpus)
        plan = solve(cfg)
        check_plan(plan, cfg.model, "the plan")  # raises for a plan train cannot run
        assert plan.step_time_s <= plan.colocated_step_time_s, (model, gpus)
        if plan.layout == "colocated":
            assert plan.step_time_s == plan.colocated_step_time_s
        assert not [n for n in plan.notes if "EP block" in n]
    qwen = solve(request("qwen3-30b-a3b", "h200-sxm", 8))
    assert (qwen.layout, qwen.pipeline_groups) == ("colocated", 2)
    run = apply_plan(TrainConfig(model=load_model("qwen3-30b-a3b"), plan=qwen, batch_size=8, seq_len=16,
                                 experts_backend="triton"), load_model("qwen3-30b-a3b"))
    assert (run.mode, run.colocated_ranks, run.pipeline_groups) == ("colocated", 8, 2)
    assert Topology.from_config(run, load_model("qwen3-30b-a3b")).world_size == 8
    mixtral = solve(request("mixtral-8x7b", "h200-sxm", 8))
    assert (mixtral.layout, mixtral.pipeline_groups, mixtral.expert_gpus) == ("colocated", 8, 8)


def test_qwen3_on_16_gpus_is_planned_in_ep_blocks_that_swap_their_loads():
    """Qwen3-30B on 16 H200s: its fastest layout is colocated in EP blocks; with its auxiliary loss it
    is the plan (before the blocks swapped their loads it was only the baseline), `train --plan` takes
    its blocks (expert_replica_sets), each rank's schedule dispatches to its block's ep ranks only and
    swaps its load with the other blocks' ranks at its position. Without the auxiliary loss the plan
    is the same layout, priced without those few receive slots."""
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.plan_layout import apply_plan
    from disagmoe.runtime.topology import Topology

    m = load_model("qwen3-30b-a3b")
    plan = solve(request("qwen3-30b-a3b", "h200-sxm", 16))
    assert plan.layout == "colocated" and plan.expert_replica_sets > 1
    run = apply_plan(TrainConfig(model=m, plan=plan, batch_size=16, seq_len=16, experts_backend="triton"), m)
    assert (run.colocated_ranks, run.expert_replica_sets) == (16, plan.expert_replica_sets)
    topology = Topology.from_config(run, m)
    per_group = 16 // plan.pipeline_groups
    assert topology.dispatch_width == per_group // plan.expert_replica_sets
    layer = m.num_dense_layers
    assert all(len(topology.load_peers(layer, rank)) == plan.expert_replica_sets - 1
               for rank in topology.expert_groups[0])
    no_aux = m.model_copy(update={"router": m.router.model_copy(update={"aux_loss_coef": 0.0})})
    plain = solve(PlanConfig(model=no_aux, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=16),
                             seq_len=m.seq_len, global_batch_tokens=4 * 1024 * 1024))
    assert (plain.layout, plain.pipeline_groups, plain.expert_replica_sets) == (
        "colocated", plan.pipeline_groups, plan.expert_replica_sets)


def test_a_baseline_that_does_not_fit_is_null_not_zero():
    plan = solve(request("deepseek-v3", "h200-sxm", 384))
    assert plan.layout == "disaggregated" and any("baseline does not fit" in n for n in plan.notes)
    assert plan.colocated_step_time_s is None and plan.speedup_vs_colocated is None


def test_an_infeasible_plan_claims_no_layout_and_no_step_time():
    plan = solve(request("deepseek-v3", "h200-sxm", 8))
    assert not plan.feasible
    assert plan.layout is None and plan.step_time_s is None and plan.mfu is None
    assert plan.colocated_step_time_s is None and plan.speedup_vs_colocated is None
    assert Plan.model_validate_json(plan.to_json()) == plan


@pytest.mark.parametrize("shard", [False, True])
def test_infeasibility_names_optimizer_sharding_only_as_a_remedy(shard):
    plan = solve(request("qwen3-235b-a22b", "h100-sxm", 64, seq_len=131072, shard_optimizer_states=shard))
    assert not plan.feasible and "context parallelism" in plan.reason
    assert "optimizer sharding, which disagmoe does not have" not in plan.reason
    assert ("even with the attention side's AdamW moments sharded" in plan.reason) == shard
    assert ("AdamW state unsharded" in plan.reason) != shard


def test_one_gpu_is_a_single_layout_with_no_transfer_stage():
    plan = solve(request("tiny", "h200-sxm", 1))
    assert plan.feasible and plan.layout == "single" and (plan.attention_gpus, plan.expert_gpus) == (0, 1)
    assert not [s.name for s in plan.stage_times if s.group == "link" or s.bound == "latency"]
    assert plan.colocated_step_time_s is None and list(plan.memory_per_gpu) == ["single"]
    assert plan.step_time_s == pytest.approx(sum(s.time_s for s in plan.stage_times), rel=1e-6)


MONOTONE = [  # (model, hardware, GPU counts): on and off powers of two and NVLink domains
    ("tiny", "h200-sxm", list(range(1, 21))),
    ("qwen3-30b-a3b", "h200-sxm", [2, 3, 4, 6, 7, 8, 12, 16, 24, 31, 32]),
    ("mixtral-8x7b", "h800", [16, 20, 24, 64, 72, 76]),
    ("qwen3-235b-a22b", "gb200-nvl72", [64, 72, 100, 128, 144, 256, 288]),
    ("deepseek-v3", "gb200-nvl72", [256, 288, 512, 576, 1152]),
]


@pytest.mark.parametrize("model, hardware, counts", MONOTONE, ids=[m for m, _, _ in MONOTONE])
def test_no_plan_gets_slower_with_more_gpus(model, hardware, counts):
    """A job with more GPUs can always run the smaller job's plan and leave the rest idle."""
    kw = {"seq_len": 128, "batch": 128 * 256} if model == "tiny" else {}
    slowest, seen = math.inf, None
    for gpus in counts:
        plan = solve(request(model, hardware, gpus, **kw))
        step = plan.step_time_s if plan.feasible else math.inf
        assert step <= slowest * (1 + 1e-9), f"{gpus} GPUs: {step:.4g} s, slower than {seen} GPUs: {slowest:.4g} s"
        if plan.feasible:
            assert plan.idle_gpus == gpus - plan.attention_gpus - plan.expert_gpus
        slowest, seen = step, gpus


def test_a_plan_that_leaves_gpus_idle_says_so():
    """DeepSeek-V3 on 610 GB200s: the fastest layout leaves GPUs idle (an expert GPU keeps every
    pair its set's attention GPUs dispatch, so wider groups cost memory), and the plan says so
    and why; it is no slower than the plan on 512. (576 no longer leaves any idle since sparse
    dispatch is priced: cheaper hops let wider groups pay; 600 none since an expert GPU keeps only
    its set's sources' pairs.)"""
    plan = solve(request("deepseek-v3", "gb200-nvl72", 610))
    used = plan.attention_gpus + plan.expert_gpus
    assert plan.feasible and plan.idle_gpus == 610 - used > 0
    assert plan.reason.startswith(f"uses {used} of 610 GPUs ({plan.idle_gpus} idle)")
    assert any(n.startswith(f"{plan.idle_gpus} of 610 GPUs left idle: this layout on {used} is faster (")
               for n in plan.notes)
    assert plan.step_time_s <= solve(request("deepseek-v3", "gb200-nvl72", 512)).step_time_s


def test_a_split_bound_by_memory_says_so_at_every_sequence_length():
    """qwen3-235b-a22b on 72 GB200s without recomputation: the expert GPUs' states and activations
    bind, and an expert GPU keeps every pair of its group's tokens in flight (dp * m * seqs * S
    tokens), so a longer sequence holds no more tokens in flight per group: fewer micro-batches,
    sequences or attention GPUs per group. The plan names the bound wherever a GPU is that full
    (at 4K and 8K; at 16K, with the nvshmem rings' smaller arena, the leanest split leaves its
    expert GPUs at 90%), with and without auto recomputation (at 8K auto's recomputation and the ranks'
    paired weight gradients make a split with room the fastest)."""
    plans = [solve(request("qwen3-235b-a22b", "gb200-nvl72", 72, seq_len=s, recompute="none"))
             for s in (4096, 8192, 16384)]
    in_flight = [p.attention_gpus // p.pipeline_groups * p.micro_batches * p.sequences_per_micro_batch * p.seq_len
                 for p in plans]
    assert in_flight == sorted(in_flight, reverse=True), in_flight
    assert all(p.recompute == "none" for p in plans)
    autos = [solve(request("qwen3-235b-a22b", "gb200-nvl72", 72, seq_len=s)) for s in (4096, 8192, 16384)]
    for plan in (*plans, *autos):
        full = max(m.total_gib / m.capacity_gib for m in plan.memory_per_gpu.values()) >= MEMORY_BOUND
        assert full == any(n.startswith("the split is bound by memory (") for n in plan.notes), plan.seq_len
    assert all(max(m.total_gib / m.capacity_gib for m in p.memory_per_gpu.values()) >= MEMORY_BOUND
               for p in (*plans[:2], autos[0]))


def test_auto_recomputation_is_chosen_recorded_and_said_only_where_it_pays():
    """qwen3-235b-a22b on 72 GB200s: auto recomputes (a faster layout fits only so), the plan
    records it and says what it freed; with memory to spare it does not; for a run whose experts
    are not triton it prices none and says what selective would have given."""
    auto = solve(request("qwen3-235b-a22b", "gb200-nvl72", 72, seq_len=4096))
    none = solve(request("qwen3-235b-a22b", "gb200-nvl72", 72, seq_len=4096, recompute="none"))
    assert auto.recompute == "selective" and auto.step_time_s < none.step_time_s
    assert any(n.startswith("selective recomputation: activations ") and " GiB per expert GPU lets m=" in n
               for n in auto.notes)
    roomy = solve(PlanConfig(model=load_model("qwen3-235b-a22b"), seq_len=4096, cluster=ClusterConfig(
        hardware=load_hardware("gb200-nvl72").model_copy(update={"hbm_gib": 1e5}), num_gpus=72)))
    assert roomy.recompute == "none" and not any("selective recomputation:" in n for n in roomy.notes)
    assert any(n.startswith("recompute auto chose none: this layout fits without it") for n in roomy.notes)
    assert not any(n.startswith("recompute auto chose none") for n in (auto.notes + none.notes))
    grouped = solve(request("qwen3-235b-a22b", "gb200-nvl72", 72, seq_len=4096, experts_backend="grouped_mm"))
    # priced as the same backend without recomputation (not as triton's: no first touch there)
    grouped_none = solve(request("qwen3-235b-a22b", "gb200-nvl72", 72, seq_len=4096, recompute="none",
                                 experts_backend="grouped_mm"))
    assert grouped.recompute == "none" and grouped.step_time_s == grouped_none.step_time_s > none.step_time_s
    assert any(n.startswith("selective recomputation was not considered: it needs experts_backend: triton")
               for n in grouped.notes)
    with pytest.raises(ValueError, match="experts_backend: triton"):
        request("qwen3-235b-a22b", "gb200-nvl72", 72, recompute="selective", experts_backend="loop")


EXPERT_MODULES = ["expert_input", "expert_output", "expert_swiglu"]


def attention_bound_request(hbm_gib=57.5, **kw):
    """A 4-layer Qwen3-30B-shaped model on two 57.5 GiB H200s at 32K tokens per sequence, one pipeline
    group: colocated, one sequence fits only with the attention block recomputed too."""
    hw = load_hardware("h200-sxm").model_copy(update={"hbm_gib": hbm_gib})
    model = load_model("qwen3-30b-a3b").model_copy(update={"num_layers": 4})
    return PlanConfig(model=model, cluster=ClusterConfig(hardware=hw, num_gpus=2), seq_len=32768,
                      global_batch_tokens=1 << 20, max_pipeline_groups=1, **kw)


def test_auto_recomputes_attention_only_where_it_makes_the_step_faster():
    """Where memory binds the attention side, auto also recomputes attention: the plan is faster
    than the best without it (here: the colocated layout fits only so, against the disaggregated
    split the expert modules alone allow), records all four modules and says what attention
    recomputation freed and costs; where the expert modules suffice (qwen3-235b-a22b on 72 GB200s,
    expert-bound) it is not chosen, and with room to spare neither is, the note pricing both."""
    auto = solve(attention_bound_request())
    experts = solve(attention_bound_request(recompute_modules=EXPERT_MODULES))
    assert not solve(attention_bound_request(recompute="none")).feasible
    assert auto.feasible and experts.feasible and auto.step_time_s < experts.step_time_s
    assert auto.layout == "colocated" and experts.layout == "disaggregated"
    assert auto.recompute == "selective" and auto.recompute_modules == EXPERT_MODULES + ["attention"]
    assert "attention" not in experts.recompute_modules
    note = next(n for n in auto.notes if n.startswith("attention recomputation: activations "))
    assert re.search(r"activations [\d.]+ -> [\d.]+ GiB per colocated GPU lets m=1 with this layout fit", note)
    assert "its recompute adds " in note and "not the attention core" in note
    assert any("selective recomputation of the expert FFN's input, output and SwiGLU rows and the attention block"
               " (train --plan sets recompute: selective, recompute_modules: [expert_input, expert_output, "
               "expert_swiglu, attention]" in n for n in auto.notes)
    expert_bound = solve(request("qwen3-235b-a22b", "gb200-nvl72", 72, seq_len=4096))
    assert expert_bound.recompute_modules == EXPERT_MODULES
    assert not any(n.startswith("attention recomputation:") for n in expert_bound.notes + experts.notes)
    roomy = solve(PlanConfig(model=load_model("qwen3-235b-a22b"), seq_len=4096, cluster=ClusterConfig(
        hardware=load_hardware("gb200-nvl72").model_copy(update={"hbm_gib": 1e5}), num_gpus=72)))
    note = next(n for n in roomy.notes if n.startswith("recompute auto chose none"))
    assert "; selective would take activations " in note and "; attention recomputation would take activations " in note
    assert roomy.recompute_modules == []


def test_an_attention_recomputing_plan_round_trips_into_the_runs_config(tmp_path):
    """The plan file keeps `recompute_modules`; `train --plan` sets recompute: selective with exactly
    those modules, which the run's memory model then counts; a run whose experts are not triton
    takes an attention-only plan and is refused one that drops expert modules."""
    from disagmoe.cli.plan_cmd import write_plan
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.plan_layout import apply_plan, load_plan

    cfg = attention_bound_request()
    plan = solve(cfg)
    write_plan(plan, tmp_path / "plan.yaml")
    back = load_plan(str(tmp_path / "plan.yaml"))
    assert back == plan and back.recompute_modules == EXPERT_MODULES + ["attention"]
    one_round = lambda plan: plan.micro_batches * plan.sequences_per_micro_batch  # noqa: E731 (`check_rounds`)
    run = apply_plan(TrainConfig(model=cfg.model, plan=str(tmp_path / "plan.yaml"), experts_backend="triton",
                                 batch_size=one_round(plan), seq_len=32768), cfg.model)
    assert (run.mode, run.colocated_ranks, run.micro_batches) == ("colocated", 2, plan.micro_batches)
    assert run.recompute == "selective" and run.recompute_set == frozenset(EXPERT_MODULES + ["attention"])
    grouped = solve(attention_bound_request(141, experts_backend="grouped_mm", recompute_modules=["attention"],
                                            recompute="selective"))
    assert grouped.recompute_modules == ["attention"]
    loop = apply_plan(TrainConfig(model=cfg.model, plan=grouped, batch_size=one_round(grouped), seq_len=32768),
                      cfg.model)
    assert loop.recompute == "selective" and loop.recompute_set == {"attention"}
    with pytest.raises(ValueError, match="expert_input, expert_output, expert_swiglu, which needs experts_backend"):
        apply_plan(TrainConfig(model=cfg.model, plan=plan, experts_backend="grouped_mm", batch_size=one_round(plan),
                               seq_len=32768), cfg.model)


def test_a_full_recomputation_plan_fits_where_none_does_not_and_round_trips_into_the_run(tmp_path):
    """--recompute full (asked for; auto never picks it): the plan records recompute: full and no
    modules, its notes say what it frees on each side and what its second forward costs, and
    `train --plan` sets recompute: full on any experts backend."""
    from disagmoe.cli.plan_cmd import write_plan
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.plan_layout import apply_plan, load_plan

    cfg = attention_bound_request(recompute="full", experts_backend="grouped_mm")
    plan = solve(cfg)
    assert not solve(attention_bound_request(recompute="none")).feasible
    assert plan.feasible and plan.recompute == "full" and plan.recompute_modules == []
    assert any("and full recomputation (every block keeps its input and routing and runs again in its backward; "
               "train --plan sets recompute: full)" in n for n in plan.notes)
    note = next(n for n in plan.notes if n.startswith("full recomputation as asked (--recompute full): activations "))
    assert re.search(r"[\d.]+ -> [\d.]+ GiB per (colocated|attention) GPU", note) and "adding " in note
    names = [s.name for s in plan.stage_times]
    assert names.index("attention core (recomputed) (bwd)") == names.index("attention core (bwd)") + 1
    write_plan(plan, tmp_path / "plan.yaml")
    assert load_plan(str(tmp_path / "plan.yaml")) == plan
    run = apply_plan(TrainConfig(model=cfg.model, plan=str(tmp_path / "plan.yaml"), experts_backend="loop",
                                 batch_size=2, seq_len=32768), cfg.model)
    assert run.recompute == "full" and run.recompute_set == {"block"}


def test_with_memory_to_spare_attention_gets_more_gpus_at_longer_sequences():
    """Attention's share of the work grows with S (the S^2 term of the core); where memory does
    not bind, the split follows it. Memory is taken out of the question with 10^6 GiB per GPU:
    2,000 GiB binds at 16K, the runtime's own count (the fastest split's expert GPUs keep m = 16
    micro-batches x 32 layers x every pair of 16 attention GPUs' 16K tokens, terabytes;
    tests/runtime/test_activation_memory.py pins the planner to that count)."""
    hw = load_hardware("gb200-nvl72").model_copy(update={"hbm_gib": 1e6})
    share = []
    for seq_len in (4096, 8192, 16384):
        m = load_model("qwen3-235b-a22b")
        plan = solve(PlanConfig(model=m, cluster=ClusterConfig(hardware=hw, num_gpus=72), seq_len=seq_len))
        assert plan.layout == "disaggregated"
        share.append(plan.attention_gpus / (plan.attention_gpus + plan.expert_gpus))
        assert not any("bound by memory" in n for n in plan.notes)
    assert share[0] < share[1] < share[2]


def test_a_plan_whose_hops_weigh_says_what_the_runtime_sends():
    """DeepSeek-V3 on 256 GB200s at 4k tokens (disaggregated, memory-bound: few attention GPUs per
    group, many expert GPUs): the hops are a large share, and the plan says why; one GPU has no
    hops and no such note. (Qwen3-30B on 72 GB200s, this test's case before the planner counted an
    expert GPU's every pair and priced sparse dispatch, now plans colocated with light hops.)"""
    heavy = solve(request("deepseek-v3", "gb200-nvl72", 256, seq_len=4096, batch=8192 * 4096))
    note = next(n for n in heavy.notes if n.startswith("dispatch and combine are"))
    assert "whatever top-k = 8" in note and "sparse dispatch" in note and "per-pair rows" in note
    single = solve(request("tiny", "h200-sxm", 1, seq_len=64, batch=512))
    assert not any(n.startswith("dispatch and combine") or n.startswith("dispatch priced") for n in single.notes)


def test_a_plan_notes_the_sparse_dispatch_it_priced_and_its_hops_shrink():
    """DeepSeek-V3 on 256 GB200s at 4k tokens (issue 25's figure): a token reaches fewer of its
    set's expert GPUs than top-k, and the hop note prices that (sparse), not every GPU of the set."""
    plan = solve(request("deepseek-v3", "gb200-nvl72", 256, seq_len=4096, batch=8192 * 4096))
    note = next(n for n in plan.notes if n.startswith("dispatch priced sparse"))
    reached, ranks = re.search(r"reaches ([\d.]+) of the (\d+) (?:expert )?GPUs", note).groups()
    assert 1 < float(reached) < 8 < int(ranks) and f"dense dispatch would send it to all {ranks}" in note
    hops = next(n for n in plan.notes if n.startswith("dispatch and combine are"))
    assert "to each GPU serving one of its experts (sparse dispatch" in hops


def test_fp8_experts_are_priced_at_the_fp8_rate_with_their_passes_and_copies():
    """`expert_precision: fp8` (fp8_expert_backward fp8: every expert GEMM) on one fixed disaggregated
    layout: the routed experts' GEMM stages at fp8_tflops / bf16_tflops the rate, the quantisation passes as an HBM stage, two e4m3 copies per
    expert parameter in the expert GPU's memory and the optimizer's pass, the FP8 rows' activations
    (no SwiGLU output kept: fewer than bf16's), never expert_output recomputed, a note."""
    layout = Candidates.one(4, 4, 1, 4, 2)
    bf16, fp8 = (evaluate(problem_of(request("qwen3-30b-a3b", "h200-sxm", 8, recompute="none", expert_precision=p,
                                             fp8_expert_backward="fp8", fp8_expert_forward="both")), layout)
                 for p in ("bf16", "fp8"))
    hw = load_hardware("h200-sxm")
    speedup = hw.fp8_tflops / hw.bf16_tflops
    ceil = problem_of(request("qwen3-30b-a3b", "h200-sxm", 8)).ceilings
    for name in ("routed experts", "expert weight grads"):
        for bwd in (False, True):
            assert fp8.stages[name].ceilings(bwd, ceil).flops_per_s == pytest.approx(
                bf16.stages[name].ceilings(bwd, ceil).flops_per_s * speedup)
    assert "fp8 quantise" in fp8.stages and "fp8 quantise" not in bf16.stages
    assert fp8.stages["fp8 quantise"].bwd.hbm_bytes[0] > fp8.stages["fp8 quantise"].fwd.hbm_bytes[0] > 0
    copies = 2 * fp8.expert_params[0] * (1 + 4 / 128**2)
    acts = fp8.expert_act_bytes[0] - bf16.expert_act_bytes[0]
    assert acts < 0 and fp8.expert_mem_bytes[0] - bf16.expert_mem_bytes[0] == pytest.approx(copies + acts)
    assert fp8.stages["optimizer (experts)"].bwd.hbm_bytes > bf16.stages["optimizer (experts)"].bwd.hbm_bytes
    plan = solve(request("qwen3-30b-a3b", "h200-sxm", 8, expert_precision="fp8"))
    assert "expert_output" not in plan.recompute_modules  # no fused FP8 combine
    assert any(n.startswith("routed experts priced in FP8 (train with precision: fp8)") for n in plan.notes)


QWEN3_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "h200x2-qwen3-30b.yaml"


def _qwen3_single(hw, precision: str, fp8_dense: bool = True, *more: str):
    """configs/h200x2-qwen3-30b.yaml in mode single at 2 micro-batches, priced on `hw` as it trains
    in `precision` (fp8: both forward GEMMs in FP8 unless `more` says otherwise; and `more` key=value
    overrides): (its problem, its cost, its plan)."""
    from disagmoe.config import load_train_config
    from disagmoe.placement.trace_compare import run_request

    overrides = ["mode=single", "micro_batches=2", f"precision={precision}", *more]
    fp8 = [f"fp8_dense={str(fp8_dense).lower()}"] + ([] if any(m.startswith("fp8_expert_forward=") for m in more)
                                                      else ["fp8_expert_forward=both"])  # the all-FP8 forward
    cfg = load_train_config(QWEN3_CONFIG, overrides + (fp8 if precision == "fp8" else []))
    req, cand = run_request(cfg, load_model(cfg.model), hw)
    return problem_of(req), evaluate(problem_of(req), cand), price(req, cand).plan


def _without_fp8_curve(hw):
    """`hw` as calibrated before probe version 5 measured the FP8 experts: no FP8 curve."""
    return hw.model_copy(update={"calibration": hw.calibration.model_copy(update={"expert_gemm_fp8": []})})


def _fp8_note(plan) -> str:
    return next(n for n in plan.notes if n.startswith("routed experts priced in FP8"))


@pytest.mark.parametrize("fp8_dense", [False, True])
def test_a_measured_fp8_curve_slower_than_bf16_predicts_a_slower_fp8_step(fp8_dense):
    """The Qwen3 config on one H200 with the H200 bf16 calibration of probe version 6: an FP8 expert curve at 0.8x
    the bf16 rates (our H200's FP8 experts measured 0.39-0.77x bf16's block) predicts a slower FP8
    step than bf16's, where the datasheet ratio (no FP8 curve) promised a faster one; the plan's note
    says which pricing it used, and that the dense projections stay at the datasheet ratio."""
    hw = _without_fp8_curve(load_hardware(str(H200_CALIBRATED_V6)))
    slow = [Fp8RatePoint(at=p.at, fwd=0.8 * p.fwd, bwd=0.8 * min(p.bwd, p.wgrad)) for p in hw.calibration.expert_gemm]
    measured = hw.model_copy(update={"calibration": hw.calibration.model_copy(update={"expert_gemm_fp8": slow})})
    _, bf16, _ = _qwen3_single(measured, "bf16")
    prob, fp8, plan = _qwen3_single(measured, "fp8", fp8_dense)
    _, datasheet, datasheet_plan = _qwen3_single(hw, "fp8", fp8_dense)
    assert fp8.step_s[0] > bf16.step_s[0] > datasheet.step_s[0]
    assert "fp8 quantise" not in fp8.stages and "fp8 quantise" in datasheet.stages
    note = _fp8_note(plan)
    assert "from the measured FP8 expert curve (calibration.expert_gemm_fp8, " + hw.calibration.source in note
    assert ("at the datasheet ratio 2.00x (unmeasured" in note) == fp8_dense  # this file has no FP8 projections
    assert "at the datasheet ratio, unmeasured" in _fp8_note(datasheet_plan)


def test_the_fp8_note_names_the_backward_the_curve_was_measured_under():
    """The H200 calibration of probe version 6 (its FP8 curve measured under bf16-wgrad) and the
    same file read as version 5 (under the all-FP8 backward): the plan's note says which backward
    the curve was measured under and how the run's was priced from it."""
    hw = load_hardware(str(H200_CALIBRATED_V6))
    v5 = hw.model_copy(update={"calibration": hw.calibration.model_copy(update={"probe_version": 5})})
    notes = {(name, backward): _fp8_note(_qwen3_single(of, "fp8", False, f"fp8_expert_backward={backward}")[2])
             for name, of in (("v6", hw), ("v5", v5)) for backward in ("bf16-wgrad", "fp8", "bf16")}
    assert ("the curve was measured under fp8_expert_backward bf16-wgrad, as this run trains: both backward "
            "stages at its whole-backward rate (fp8_expert_backward: bf16-wgrad, the default)") in notes["v6", "bf16-wgrad"]
    assert ("the curve was measured under fp8_expert_backward bf16-wgrad: fp8's weight gradients priced at its "
            "whole-backward rate too, plus the token-group quantisers it did not run") in notes["v6", "fp8"]
    assert ("the curve was measured under fp8_expert_backward fp8: bf16-wgrad's data gradients priced at its "
            "whole-backward rate, the weight gradients at the bf16 rate") in notes["v5", "bf16-wgrad"]
    assert "the curve was measured under fp8_expert_backward fp8, as this run trains" in notes["v5", "fp8"]
    for name in ("v5", "v6"):
        assert "probe version " + name[1] in notes[name, "bf16"]
        assert "the whole backward at the bf16 rate (fp8_expert_backward: bf16)" in notes[name, "bf16"]


@pytest.mark.parametrize(("model", "once"), [("qwen3-30b-a3b", True), ("mixtral-8x7b", False)])
def test_one_gpus_fp8_input_rows_are_priced_as_the_layer_quantises_them(model, once):
    """Datasheet FP8 pricing of the experts' input rows: on one GPU (its experts serve every pair) a
    top-8 layer quantises each token once and copies its e4m3 row and scales to its 8 pairs, fewer
    bytes than quantising each pair's row; at Mixtral's top-2 the pairs' rows are quantised, which is
    fewer; an expert GPU of a disaggregated layout quantises the rows it serves either way. The
    runtime's choice (`kernels.permute.quantises_tokens_once`) is the byte model's at every top-k."""
    from disagmoe.kernels.permute import quantises_tokens_once

    for top_k in range(1, 17):
        assert quantises_tokens_once(top_k) == bool(
            st.fp8_expert_input_bytes(2048, 1, top_k, True) < st.fp8_expert_input_bytes(2048, 1, top_k, False))
    m = load_model(model)
    H, k = m.hidden_size, m.top_k
    assert quantises_tokens_once(k) == once
    single = Candidates.one(1, 1, 1, 2, 4, colocated=True)
    split = Candidates.one(4, 4, 1, 4, 2)
    for layout, tokens_once in ((single, True), (split, False)):
        prob = problem_of(request(model, "h200-sxm", 8 if layout is split else 1, recompute="none",
                                  expert_precision="fp8", fp8_expert_forward="both"))  # uncalibrated: the datasheet
        cost = evaluate(prob, layout)
        fwd = cost.stages["fp8 quantise"].fwd.hbm_bytes[0]
        tokens = layout.seqs[0] * prob.seq_len
        rows = cost.stages["routed experts"].fwd.flops[0] / (6 * H * m.expert_ffn_size)  # 3 GEMMs of 2HF a row
        per_pair = st.fp8_expert_input_bytes(H, rows / k, k, False)
        assert per_pair == pytest.approx(rows * H * (2 + 1 + 4 / 128))
        if tokens_once and once:
            assert fwd == pytest.approx(st.fp8_expert_input_bytes(H, tokens, k, True)) and fwd < per_pair
        else:
            assert fwd == pytest.approx(per_pair)
            if tokens_once:
                assert st.fp8_expert_input_bytes(H, tokens, k, True) > fwd


@pytest.mark.parametrize("backward", ["bf16-wgrad", "fp8", "bf16"])
def test_one_gpus_fp8_backward_quantises_no_dy_rows_it_reads_back(backward):
    """Datasheet FP8 pricing of the backward's quantisers: on one GPU the combine's backward writes dy's
    1 x 128 rows beside dy (`kernels.permute.Fp8RowGradSlot`), so the quantise stage lacks exactly the
    read of dy's bf16 rows an expert GPU of a disaggregated layout pays (it counts every step and
    quantises dy in a pass); a bf16 backward quantises nothing either way."""
    m = load_model("qwen3-30b-a3b")
    H, F = m.hidden_size, m.expert_ffn_size
    quantised = {"fp8": 2 * H + 2 * 2 * F + F + H, "bf16-wgrad": H + 2 * F, "bf16": 0}[backward]
    for layout, single in ((Candidates.one(1, 1, 1, 2, 4, colocated=True), True), (Candidates.one(4, 4, 1, 4, 2), False)):
        prob = problem_of(request("qwen3-30b-a3b", "h200-sxm", 1 if single else 8, recompute="none",
                                  expert_precision="fp8", fp8_expert_backward=backward))  # uncalibrated: the datasheet
        cost = evaluate(prob, layout)
        rows = cost.stages["routed experts"].fwd.flops[0] / (6 * H * F)  # 3 GEMMs of 2HF a row
        bwd = cost.stages["fp8 quantise"].bwd.hbm_bytes[0]
        unread = rows * H * 2 if single and backward != "bf16" else 0.0
        assert bwd == pytest.approx(rows * quantised * (2 + 1 + 4 / 128) - unread)


@pytest.mark.parametrize(("modules", "forward", "top_k", "unwritten"), [
    (["expert_input", "expert_swiglu"], "both", 8, True), (["expert_input"], "gate-up", 8, True),
    (["expert_swiglu"], "both", 8, False), (["expert_input"], "down", 8, False), (["expert_input"], "both", 2, False)])
def test_one_gpus_fp8_permute_is_priced_without_the_bf16_rows_nothing_reads(modules, forward, top_k, unwritten):
    """On one GPU, whose layer quantises each token once (top-k from 3) for a gate/up GEMM in FP8,
    recomputing expert_input leaves the bf16 grouped rows unread: the permute's forward is priced
    without its row copy (`stages.permute_rows` of the GPU's pairs), its backward as before; with
    expert_swiglu alone, a bf16 gate/up GEMM (forward down) or at top-k 2 the rows are written."""
    m = load_model("qwen3-30b-a3b").model_copy(update={"top_k": top_k})
    single = Candidates.one(1, 1, 1, 2, 4, colocated=True)
    stages = {}
    for recompute in ("none", "selective"):
        cfg = PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=1),
                         seq_len=m.seq_len, global_batch_tokens=4 * 1024 * 1024, recompute=recompute,
                         recompute_modules=modules, experts_backend="triton", expert_precision="fp8",
                         fp8_expert_forward=forward)
        prob = problem_of(cfg)
        cost = evaluate(prob, single)
        assert bool(cost.selective[0]) == (recompute == "selective")
        stages[recompute] = cost.stages["permute / combine sum"]
    tokens = single.seqs[0] * prob.seq_len
    saved = st.permute_rows(m, tokens * top_k).hbm_bytes if unwritten else 0.0
    assert stages["selective"].fwd.hbm_bytes[0] == pytest.approx(stages["none"].fwd.hbm_bytes[0] - saved)
    assert stages["selective"].bwd.hbm_bytes[0] == pytest.approx(stages["none"].bwd.hbm_bytes[0])
    assert stages["none"].fwd.hbm_bytes[0] == pytest.approx(st.permute(m, tokens * top_k).hbm_bytes)
    assert 2 * st.permute_rows(m, tokens).hbm_bytes == pytest.approx(st.permute(m, tokens).hbm_bytes)  # the gather's half


def test_without_an_fp8_curve_fp8_experts_keep_the_datasheet_pricing():
    """The Qwen3 config on the committed calibration less its FP8 curve (a file from before probe
    version 5): each FP8 expert GEMM stage (the default backward, bf16-wgrad: all but the weight
    gradients) at the calibrated bf16 rate times fp8_tflops / bf16_tflops, the weight gradients at
    the calibrated bf16 rate, the quantisers' HBM stage, a faster step than bf16's, and a note that
    says so."""
    hw = _without_fp8_curve(load_hardware("h200-sxm-calibrated"))
    prob, bf16, _ = _qwen3_single(hw, "bf16")
    _, fp8, plan = _qwen3_single(hw, "fp8", fp8_dense=False)
    for name in ("routed experts", "expert weight grads"):
        for bwd in (False, True):
            ratio = 1.0 if (name, bwd) == ("expert weight grads", True) else hw.fp8_tflops / hw.bf16_tflops
            assert np.asarray(fp8.stages[name].ceilings(bwd, prob.ceilings).flops_per_s).item() == pytest.approx(
                np.asarray(bf16.stages[name].ceilings(bwd, prob.ceilings).flops_per_s).item() * ratio, rel=1e-12)
    assert fp8.stages["fp8 quantise"].bwd.hbm_bytes[0] > 0 and fp8.step_s[0] < bf16.step_s[0]
    note = _fp8_note(plan)
    assert "at the datasheet ratio, unmeasured: their GEMMs at 2.00x the bf16 rate" in note
    assert "the weight gradients at the bf16 rate (fp8_expert_backward: bf16-wgrad, the default)" in note
    assert "dense projections" not in note


def test_fp8_plans_recompute_the_modules_the_fp8_experts_drop_and_round_trip_into_the_run(tmp_path):
    """Qwen3-235B on 72 GB200s in FP8 (where the plan without recomputation is slowest against
    bf16): auto now recomputes the FP8 experts' input and SwiGLU rows (never expert_output), fits
    a faster layout than recompute none, says so in its notes and prices the recompute at an index
    read and, under the default backward (bf16-wgrad), the input rows' bf16 gather; `train --plan`
    takes the plan with precision fp8; selective without modules prices the two, and naming
    expert_output under fp8 is refused with the reason."""
    from disagmoe.cli.plan_cmd import write_plan
    from disagmoe.config import TrainConfig
    from disagmoe.runtime.plan_layout import apply_plan

    fp8 = dict(seq_len=4096, expert_precision="fp8")
    auto, none = (choose(request("qwen3-235b-a22b", "gb200-nvl72", 72, **fp8, recompute=r)) for r in ("auto", "none"))
    assert auto.plan.recompute == "selective" and auto.plan.step_time_s < none.plan.step_time_s
    assert set(auto.plan.recompute_modules) <= {"expert_input", "expert_swiglu", "attention"}
    assert {"expert_input", "expert_swiglu"} <= set(auto.plan.recompute_modules)
    assert any("selective recomputation of the expert FFN's input and SwiGLU rows" in n for n in auto.plan.notes)
    assert any(n.startswith("selective recomputation: activations ") for n in auto.plan.notes)
    m = auto.problem.model
    assert st.selective_recompute(m, 1000, fp8=True, fp8_backward="fp8").hbm_bytes == 8 * 1000  # the token index only
    assert st.selective_recompute(m, 1000, fp8=True).hbm_bytes == 8 * 1000 + 2 * 2 * 1000 * m.hidden_size  # + the gather
    assert st.selective_recompute(m, 1000).hbm_bytes == 2 * 1000 * (2 * m.hidden_size + m.expert_ffn_size)
    assert "selective recompute" in auto.cost.stages
    write_plan(auto.plan, tmp_path / "plan.yaml")
    model = load_model("qwen3-235b-a22b")
    run = apply_plan(TrainConfig(model=model, plan=str(tmp_path / "plan.yaml"), experts_backend="triton",
                                 precision="fp8", device="cuda", transport="nvshmem", seq_len=4096,
                                 batch_size=auto.plan.sequences_per_micro_batch * auto.plan.micro_batches), model)
    assert run.recompute == "selective" and run.recompute_set == frozenset(auto.plan.recompute_modules)
    assert run.expert_precision == "fp8"
    selective = solve(request("qwen3-235b-a22b", "gb200-nvl72", 72, **fp8, recompute="selective"))
    assert selective.recompute_modules == ["expert_input", "expert_swiglu"]
    with pytest.raises(ValueError, match="names expert_output, which the FP8 experts do not recompute"):
        request("qwen3-235b-a22b", "gb200-nvl72", 72, **fp8, recompute="selective",
                recompute_modules=["expert_input", "expert_output"])


def test_a_plan_records_the_expert_modules_it_priced_not_all_three():
    """Selective with one expert module named: the plan's recompute_modules (what `train --plan`
    sets) is that module, as its memory was priced, not the three expert modules."""
    plan = solve(request("qwen3-235b-a22b", "gb200-nvl72", 72, seq_len=4096, recompute="selective",
                         recompute_modules=["expert_input"]))
    assert plan.recompute == "selective" and plan.recompute_modules == ["expert_input"]


@pytest.mark.parametrize("scaling", ["blockwise", "rowwise"])
def test_fp8_dense_projections_are_priced_at_the_fp8_rate_with_their_quantise_passes(scaling):
    """`expert_precision: fp8` with `fp8_dense` on: the attention projections, shared
    experts and dense FFN layers forward at fp8_tflops / bf16_tflops the rate, backward at 2 s /
    (1 + s) of it (the FP8 data gradient beside the bf16 weight gradient), each with its recipe's
    quantisation passes as an attention stage run as often; blockwise, the FLOPs of a linear off its
    grid (DeepSeek's kv_a) at the bf16 rate, a harmonic blend; fp8_dense: false leaves them bf16."""
    layout = Candidates.one(4, 4, 1, 4, 2)
    hw = load_hardware("h200-sxm")
    speedup = hw.fp8_tflops / hw.bf16_tflops
    for model, names in (("qwen3-30b-a3b", ("attention projections",)),
                         ("deepseek-v3", ("attention projections", "shared experts", "dense ffn"))):
        bf16, dense, experts_only = (
            evaluate(problem_of(request(model, "h200-sxm", 8, recompute="none", expert_precision=p, fp8_dense=d,
                                        fp8_dense_scaling=scaling)), layout)
            for p, d in (("bf16", True), ("fp8", True), ("fp8", False)))
        ceil = problem_of(request(model, "h200-sxm", 8)).ceilings
        for name in names:
            part = "attention" if name == "attention projections" else name
            share = st.dense_fp8_share(load_model(model), part, scaling)
            assert (share < 1) == (scaling == "blockwise" and model == "deepseek-v3" and part == "attention")
            for bwd, faster in ((False, speedup), (True, 2 * speedup / (1 + speedup))):
                rate = bf16.stages[name].ceilings(bwd, ceil).flops_per_s
                blended = 1 / (share / (rate * faster) + (1 - share) / rate)
                assert dense.stages[name].ceilings(bwd, ceil).flops_per_s == pytest.approx(blended)
                assert experts_only.stages[name].ceilings(bwd, ceil).flops_per_s == pytest.approx(rate)
            quant = dense.stages[f"fp8 quantise ({part})"]
            assert quant.group == "attention" and quant.runs == bf16.stages[name].runs
            assert quant.bwd.hbm_bytes[0] > 0 and quant.fwd.hbm_bytes[0] > 0
            assert f"fp8 quantise ({part})" not in experts_only.stages
        assert "fp8 quantise (shared experts)" not in dense.stages or model == "deepseek-v3"
        assert dense.fwd_round_s[0] < experts_only.fwd_round_s[0]
    plan = solve(request("qwen3-30b-a3b", "h200-sxm", 8, expert_precision="fp8", fp8_dense="on"))
    assert any("dense projections (attention, shared experts, dense FFN layers) in FP8 too" in n for n in plan.notes)


def _with_fp8_projections(hw, ratio: float, scaling: str = "blockwise", bwd_ratio: float | None = None):
    """`hw` (a calibrated HardwareConfig) with an FP8 projection curve at `ratio` (backward: `bwd_ratio`,
    default the same) times its bf16 projection curve, measured under `scaling` (probe version 8 on a
    Hopper GPU: blockwise, the run's default)."""
    curve = [Fp8RatePoint(at=p.at, fwd=ratio * p.fwd, bwd=(bwd_ratio or ratio) * p.bwd)
             for p in hw.calibration.projections]
    return hw.model_copy(update={"calibration": hw.calibration.model_copy(update={
        "projections_fp8": curve, "projections_fp8_scaling": scaling})})


def test_measured_fp8_projections_price_the_dense_projections_with_their_quantisers_inside():
    """A calibration holding the FP8 projection curve of the run's recipe (`projections_fp8`, here
    measured blockwise, as probe version 8 on a Hopper GPU): the Qwen3 config's FP8 attention
    projections run at that curve over the bf16 one at their tokens per micro-batch (here 0.9x: the
    quantisers cost more than the FP8 GEMMs save, as an H100 measured rowwise), with no quantise
    stage of their own (inside the curve), so the FP8 step with fp8_dense is slower than without it,
    where the datasheet ratio priced it faster; the notes say which, and that fp8_dense: false is the
    faster plan (not where the curve pays)."""
    from disagmoe.placement.cost import fp8_dense_speedups

    hw = load_hardware(str(H200_CALIBRATED_V6))
    measured = _with_fp8_projections(hw, 0.9)
    fwd, bwd, inside = fp8_dense_speedups(measured.calibration, 8192.0, 2.0, "blockwise")
    assert (float(fwd), float(bwd), inside) == (pytest.approx(0.9), pytest.approx(0.9), True)
    assert fp8_dense_speedups(hw.calibration, 8192.0, 2.0, "blockwise") == (2.0, pytest.approx(4 / 3), False)
    # an MLA model: the FP8 curve read against the bf16 curve of its own (the calibration model's) shape,
    # not the MLA curve its bf16 stage is priced with: an FP8 curve equal to that curve is no speedup
    same = _with_fp8_projections(hw, 1.0).calibration
    tokens = np.array([4096.0, 8192.0, 32768.0])
    assert np.allclose(np.stack(fp8_dense_speedups(same, tokens, 2.0, "blockwise")[:2]), 1.0)
    _, bf16, _ = _qwen3_single(measured, "bf16")
    _, dense, plan = _qwen3_single(measured, "fp8", True)
    _, no_dense, _ = _qwen3_single(measured, "fp8", False)
    _, datasheet, _ = _qwen3_single(hw, "fp8", True)
    _, datasheet_no_dense, _ = _qwen3_single(hw, "fp8", False)
    ceil = _qwen3_single(measured, "bf16")[0].ceilings
    for bwd in (False, True):
        rate = bf16.stages["attention projections"].ceilings(bwd, ceil).flops_per_s
        assert dense.stages["attention projections"].ceilings(bwd, ceil).flops_per_s == pytest.approx(0.9 * rate)
    assert "fp8 quantise (attention)" not in dense.stages and "fp8 quantise (attention)" in datasheet.stages
    assert dense.step_s[0] > no_dense.step_s[0] and datasheet.step_s[0] < datasheet_no_dense.step_s[0]
    assert "from the measured FP8 projection curve over the bf16 one (calibration.projections_fp8" in _fp8_note(plan)
    loses = next(n for n in plan.notes if n.startswith("the dense projections in FP8 make this step"))
    assert loses.endswith("train with fp8_dense: false")
    assert not any(n.startswith("the dense projections in FP8 make") for n in _qwen3_single(hw, "fp8", True)[2].notes)
    paying = _with_fp8_projections(hw, 1.5, bwd_ratio=1.3)
    assert not any(n.startswith("the dense projections in FP8 make") for n in _qwen3_single(paying, "fp8", True)[2].notes)


def test_a_curve_of_the_other_dense_recipe_prices_nothing_and_the_note_says_so():
    """The FP8 projection curve measured rowwise (probe version 7's, as the H100 file held until session 36;
    a file written before `projections_fp8_scaling` reads as rowwise) and a run of the default
    blockwise recipe: the datasheet path prices it (its quantise passes as stages, the ratio
    fp8_tflops / bf16_tflops), not the rowwise curve, and the note names the curve it left out and
    the setting that prices with it; a rowwise run (fp8_dense_scaling: rowwise) prices at the curve,
    and the plan records the scaling it priced."""
    hw = load_hardware(str(H200_CALIBRATED_V6))
    rowwise_curve = _with_fp8_projections(hw, 0.9, scaling="rowwise")
    raw = rowwise_curve.calibration.model_dump()
    del raw["projections_fp8_scaling"]
    assert type(hw.calibration).model_validate(raw).projections_fp8_scaling == "rowwise"  # an older file
    _, blockwise, plan = _qwen3_single(rowwise_curve, "fp8", True)
    _, datasheet, _ = _qwen3_single(hw, "fp8", True)
    _, rowwise, rowwise_plan = _qwen3_single(rowwise_curve, "fp8", True, "fp8_dense_scaling=rowwise")
    _, bf16, _ = _qwen3_single(hw, "bf16")
    ceil = _qwen3_single(hw, "bf16")[0].ceilings
    assert blockwise.step_s[0] == pytest.approx(datasheet.step_s[0])  # the curve left out
    assert "fp8 quantise (attention)" in blockwise.stages and "fp8 quantise (attention)" not in rowwise.stages
    rate = bf16.stages["attention projections"].ceilings(False, ceil).flops_per_s
    assert rowwise.stages["attention projections"].ceilings(False, ceil).flops_per_s == pytest.approx(0.9 * rate)
    note = _fp8_note(plan)
    assert "scaled blockwise (fp8_dense_scaling: blockwise" in note
    assert ("unmeasured for blockwise: the calibration's FP8 projection curve, calibration.projections_fp8 of probe "
            f"version {hw.calibration.probe_version}, measured the rowwise recipe") in note
    assert "fp8_dense_scaling: rowwise prices with it" in note
    assert "from the measured FP8 projection curve over the bf16 one (calibration.projections_fp8, measured rowwise" \
        in _fp8_note(rowwise_plan)
    assert (plan.fp8_dense_scaling, rowwise_plan.fp8_dense_scaling) == ("blockwise", "rowwise")
    assert _qwen3_single(hw, "fp8", False)[2].fp8_dense_scaling is None  # none priced: none recorded


def _qwen3_fp8_request(hw, fp8_dense: str = "auto") -> PlanConfig:
    """Qwen3-30B-A3B on 8 GPUs of `hw` (a HardwareConfig), its experts priced in FP8."""
    m = load_model("qwen3-30b-a3b")
    return PlanConfig(model=m, cluster=ClusterConfig(hardware=hw, num_gpus=8), seq_len=m.seq_len,
                      global_batch_tokens=4 * 1024 * 1024, expert_precision="fp8", fp8_dense=fp8_dense)


@pytest.mark.parametrize("ratio", [0.8, 1.5])
def test_fp8_dense_auto_keeps_the_faster_of_the_dense_projections_in_fp8_and_in_bf16(ratio):
    """`fp8_dense: auto` (the default) plans both ways and keeps the faster: off where the measured
    FP8 projection curve runs below the bf16 one (quantisers costing more than the FP8 GEMMs save),
    on where it runs above; the plan records the choice (`train --plan` sets it) and a note gives
    both step times and what priced the FP8 projections; on / off plan one way, with no such note;
    a fixed layout (`price`) chooses the same way."""
    measured = _with_fp8_projections(load_hardware("h200-sxm-calibrated"), ratio)
    auto, on, off = (choose(_qwen3_fp8_request(measured, mode)) for mode in ("auto", "on", "off"))
    faster = off if ratio < 1 else on
    assert auto.plan.fp8_dense == (ratio > 1) and auto.plan.step_time_s == pytest.approx(faster.plan.step_time_s)
    assert min(on.plan.step_time_s, off.plan.step_time_s) == pytest.approx(auto.plan.step_time_s)
    note = next(n for n in auto.plan.notes if n.startswith("fp8_dense auto chose"))
    assert note.startswith(f"fp8_dense auto chose {'on' if ratio > 1 else 'off'}")
    assert "the measured FP8 projection curve of their blockwise recipe, quantisers inside" in note
    assert not any(n.startswith("fp8_dense auto") for n in on.plan.notes + off.plan.notes)
    fixed = price(_qwen3_fp8_request(measured), auto.candidate)
    assert fixed.plan.fp8_dense == auto.plan.fp8_dense
    assert any(n.startswith("fp8_dense auto chose") for n in fixed.plan.notes)


def test_fp8_dense_auto_without_a_measured_curve_says_the_datasheet_decided_and_reads_true_false():
    datasheet = choose(_qwen3_fp8_request(load_hardware("h200-sxm")))
    note = next(n for n in datasheet.plan.notes if n.startswith("fp8_dense auto chose"))
    assert datasheet.plan.fp8_dense and "the datasheet ratio, unmeasured" in note
    assert _qwen3_fp8_request(load_hardware("h200-sxm"), True).fp8_dense == "on"  # YAML's bare true / false
    assert PlanConfig.model_validate({**_qwen3_fp8_request(load_hardware("h200-sxm")).model_dump(),
                                      "fp8_dense": False}).fp8_dense == "off"
    bf16 = choose(_qwen3_fp8_request(load_hardware("h200-sxm")).model_copy(update={"expert_precision": "bf16"}))
    assert not bf16.plan.fp8_dense and not any(n.startswith("fp8_dense auto") for n in bf16.plan.notes)
    assert re.search(r"[\d.]+ m?s a step against [\d.]+ m?s with them in bf16", note)  # both times, with units


def test_fp8_dense_auto_keeps_the_leaner_plan_when_neither_fits():
    """Neither way fits (Qwen3-235B on one H200): the bf16-projections search's plan, the leaner, with
    a note that neither fits and no `train with` advice."""
    m = load_model("qwen3-235b-a22b")
    choice = choose(PlanConfig(model=m, cluster=ClusterConfig(hardware=load_hardware("h200-sxm"), num_gpus=1),
                               seq_len=m.seq_len, global_batch_tokens=4 * 1024 * 1024, expert_precision="fp8",
                               fp8_dense="auto"))
    assert not choice.plan.feasible
    note = next(n for n in choice.plan.notes if n.startswith("fp8_dense auto"))
    assert "no layout fits with the dense projections in FP8 or in bf16" in note and "train with" not in note


@pytest.mark.parametrize("scaling", ["blockwise", "rowwise"])
def test_fp8_dense_weight_copies_are_made_once_per_step_and_held(scaling):
    """The dense linears' two e4m3 weight copies (`fp8_dense.Fp8WeightCopies`): read and written in
    the attention optimizer's stage once per step, not in the per-call quantise passes, and held
    beside the bf16 weights (1 byte per copy and parameter), of the linears the recipe runs in FP8
    (blockwise: not DeepSeek's kv_a, off its grid). Rowwise makes them in two launches, each reading
    the bf16 weights; blockwise in one, reading them once and writing both copies with their
    128 x 128 block scales: 2 bytes less per parameter."""
    layout = Candidates.one(4, 4, 1, 4, 2)  # p = 1: every layer on each GPU
    m = load_model("deepseek-v3")
    with_copies, without = (evaluate(problem_of(request("deepseek-v3", "h200-sxm", 8, recompute="none",
                                                        expert_precision="fp8", fp8_dense=d,
                                                        fp8_dense_scaling=scaling)), layout)
                            for d in (True, False))
    weights = st.dense_fp8_weights(m, m.num_moe_layers, m.num_dense_layers, scaling)
    kv_a = m.hidden_size * (m.mla.kv_lora_rank + m.mla.qk_rope_head_dim) * m.num_layers
    assert weights == st.dense_fp8_weights(m, m.num_moe_layers, m.num_dense_layers, "rowwise") - (
        kv_a if scaling == "blockwise" else 0)
    step = (with_copies.stages["optimizer (attention)"].bwd.hbm_bytes[0]
            - without.stages["optimizer (attention)"].bwd.hbm_bytes[0])
    per_param = 2 * (st.BF16 + 1) if scaling == "rowwise" else st.BF16 + 2 * (1 + st.FP32 / 128**2)
    assert step == pytest.approx(per_param * weights)
    assert (with_copies.attn_mem_bytes[0] - without.attn_mem_bytes[0]) == pytest.approx(2 * weights)
    per_call = st.dense_fp8_quantise_passes(m, 1024.0, "attention", scaling)
    H, a, n = m.hidden_size, m.mla, m.num_heads
    # x (q_a), q_a's normed output, the latent, the heads' outputs; rowwise also kv_a's x, read again after q_b
    inputs = H + a.q_lora_rank + a.kv_lora_rank + n * a.v_head_dim + (H if scaling == "rowwise" else 0)
    outputs = a.q_lora_rank + n * (a.qk_nope_head_dim + a.qk_rope_head_dim) + n * (
        a.qk_nope_head_dim + a.v_head_dim) + H + (a.kv_lora_rank + a.qk_rope_head_dim if scaling == "rowwise" else 0)
    per_value = st.BF16 + 1 + (st.FP32 / 128 if scaling == "blockwise" else 0)  # blockwise: 1 x 128 scales
    assert per_call[0].hbm_bytes == pytest.approx(per_value * 1024 * inputs)
    assert per_call[1].hbm_bytes == pytest.approx(per_value * 1024 * outputs)


def test_blockwise_dense_quantisers_count_a_shared_input_once_and_the_copies_one_launch():
    """The Qwen3 model (every linear on blockwise's grid): the forward quantises the hidden row once
    for q, k and v (`fp8_dense.quantize_input`) and o's input under either scaling, blockwise with a
    1 x 128 scale per 128 values; the backward quantises each output gradient either way; the weight
    copies cost 2 bytes a parameter less blockwise (one launch for both copies)."""
    m = load_model("qwen3-30b-a3b")
    q, k, v = st.attention_io_per_token(m)
    H, tokens = m.hidden_size, 4096.0
    (row_f, row_b), (blk_f, blk_b) = (st.dense_fp8_quantise_passes(m, tokens, "attention", scaling)
                                      for scaling in ("rowwise", "blockwise"))
    assert row_f.hbm_bytes == pytest.approx((st.BF16 + 1) * tokens * (H + q))
    assert blk_f.hbm_bytes == pytest.approx((st.BF16 + 1 + st.FP32 / 128) * tokens * (H + q))
    outputs = q + k + v + H  # every output gradient, either way
    assert row_b.hbm_bytes == pytest.approx((st.BF16 + 1) * tokens * outputs)
    assert blk_b.hbm_bytes == pytest.approx((st.BF16 + 1 + st.FP32 / 128) * tokens * outputs)
    weights = st.dense_fp8_weights(m, m.num_moe_layers, 0, "blockwise")
    assert weights == st.dense_fp8_weights(m, m.num_moe_layers, 0, "rowwise")
    saved = st.dense_fp8_weight_copies(weights, "rowwise").hbm_bytes - st.dense_fp8_weight_copies(
        weights, "blockwise").hbm_bytes
    assert saved == pytest.approx((2 - 2 * st.FP32 / 128**2) * weights)
    with pytest.raises(ValueError, match="unknown FP8 dense scaling 'tensorwise'; choose one of rowwise, blockwise"):
        st.dense_fp8_weight_copies(weights, "tensorwise")


def offload_request(off="auto", hbm_gib=None, host_memory_gib=None, batch=1 << 20, **kw):
    """qwen3-30b-a3b on 8 H200s, optionally with less HBM or host memory per GPU."""
    update = {k: v for k, v in (("hbm_gib", hbm_gib), ("host_memory_gib", host_memory_gib)) if v is not None}
    hw = load_hardware("h200-sxm").model_copy(update=update)
    return PlanConfig(model=load_model("qwen3-30b-a3b"), cluster=ClusterConfig(hardware=hw, num_gpus=8),
                      seq_len=4096, global_batch_tokens=batch, offload_optimizer=off, **kw)


def test_auto_offload_is_chosen_recorded_and_said_where_only_offloaded_layouts_fit():
    """On 60 GiB GPUs no layout of qwen3-30b-a3b on 8 GPUs fits with the fp32 masters and moments on
    the GPU (about 11 bytes per parameter of 18): auto offloads, the plan records it, and the note
    says what it freed, which m that lets fit and what the host link costs."""
    off, on, auto = (solve(offload_request(mode, hbm_gib=60)) for mode in ("off", "on", "auto"))
    assert not off.feasible and on.feasible and on.offload_optimizer
    assert auto.feasible and auto.offload_optimizer and auto.step_time_s == on.step_time_s
    note = next(n for n in auto.notes if n.startswith("offload auto chose on: "))
    assert re.fullmatch(r"offload auto chose on: the state leaves \d+\.\d GiB per GPU, which lets m=\d+ with this "
                        r"\w+ layout \(p=\d+\) fit; no layout fits without it; the host link costs \S+ m?s per step "
                        r"\(\d+\.\d GiB of masters and moments in host memory per GPU of the hardware's "
                        r"host_memory_gib 256\)", note), note
    assert f"m={auto.micro_batches} " in note
    assert not any("offload auto" in n for n in on.notes + off.notes)  # on and off say nothing of auto


def test_auto_offload_stays_off_where_the_model_fits_and_offload_is_slower():
    """qwen3-30b-a3b on 8 H200s with a 256k-token step: the plan fits without offload, and the
    host link (the whole state in and out every step) would make it slower, so auto keeps it off."""
    off, on, auto = (solve(offload_request(mode, batch=1 << 18)) for mode in ("off", "on", "auto"))
    assert off.feasible and on.feasible and on.step_time_s > off.step_time_s
    assert not auto.offload_optimizer and auto.step_time_s == off.step_time_s
    note = next(n for n in auto.notes if n.startswith("offload auto chose off: "))
    assert note.startswith("offload auto chose off: the fastest layout fits without it; with it the fastest layout "
                           "would take ") and "slower: the host link)" in note, note


def test_auto_offload_is_taken_where_it_pays_on_the_default_batch():
    """qwen3-30b-a3b on 8 H200s at 4M tokens per step: without offload the fastest layout is p=4 with
    m=4; offload frees room for fewer, larger micro-batches, which the model prices faster despite
    the host link, so auto takes it and says by how much."""
    off, auto = (solve(offload_request(mode, batch=4 << 20)) for mode in ("off", "auto"))
    assert auto.offload_optimizer and auto.step_time_s < off.step_time_s
    gain = round((off.step_time_s / auto.step_time_s - 1) * 100)
    assert any(n.startswith("offload auto chose on: ") and f"{gain}% faster than the fastest layout without it" in n
               for n in auto.notes)


def test_offloaded_layouts_must_fit_the_host_memory_per_gpu():
    """host_memory_gib bounds the masters and moments an offloaded GPU keeps on the host: a layout
    above it does not fit (cost.evaluate), and the plan names the limit and what it skipped."""
    prob = problem_of(offload_request("on", hbm_gib=60, host_memory_gib=10))
    assert prob.offload_optimizer and prob.host_capacity_bytes == 10 * 2**30
    cands = Candidates.one(0, 8, 8, 8, 1, colocated=True)
    roomy = evaluate(problem_of(offload_request("on", hbm_gib=60)), cands)
    tight = evaluate(prob, cands)
    assert roomy.fits[0] and not tight.fits[0] and tight.host_state_bytes[0] > 10 * 2**30
    assert evaluate(problem_of(offload_request("off")), cands).host_state_bytes is None
    for mode in ("on", "auto"):
        plan = solve(offload_request(mode, hbm_gib=60, host_memory_gib=10))
        assert not plan.feasible
        assert any(n.startswith("offloaded layouts skipped by host memory: h200-sxm's host_memory_gib is 10 GiB "
                                "per GPU; ") for n in plan.notes), plan.notes
    assert not any("host memory:" in n for n in solve(offload_request("auto", hbm_gib=60)).notes)


def test_host_memory_is_in_the_presets_where_known():
    """DGX H200: 2 TiB for 8 GPUs; GB200 NVL72: 480 GB LPDDR5X per Grace, one Grace per 2 GPUs."""
    assert load_hardware("h200-sxm").host_memory_gib == 256
    assert load_hardware("gb200-nvl72").host_memory_gib == 240


def test_offload_reads_true_and_false_as_on_and_off():
    assert offload_request(True).offload_optimizer == "on" and offload_request(False).offload_optimizer == "off"
    assert solve(offload_request(True, hbm_gib=60)).offload_optimizer


def test_a_fixed_layout_with_auto_offload_offloads_only_when_it_fits_only_so():
    cands = Candidates.one(0, 8, 8, 8, 1, colocated=True)
    assert price(offload_request("auto", hbm_gib=60), cands).plan.offload_optimizer
    roomy = price(offload_request("auto"), cands).plan
    assert not roomy.offload_optimizer and "offload auto chose off: this layout fits without it" in roomy.notes


def test_the_pruning_pass_prices_transport_only_where_it_can_matter():
    """`evaluate(..., misfits_exact=False)` (the search's passes): the same fits, lean fits, steps
    and the expert GPU's lean bytes wherever they fit, as the exact pricing; a misfit's memory may
    only be understated."""
    from disagmoe.placement.solver import colocated_candidates, disaggregated_candidates

    cfg = request("deepseek-v3", "gb200-nvl72", 256)
    prob = problem_of(cfg)
    for kind in (disaggregated_candidates, colocated_candidates):
        cands = kind(cfg, 256)
        exact, lean = evaluate(prob, cands), evaluate(prob, cands, misfits_exact=False)
        assert exact.fits.any() or kind is colocated_candidates
        assert np.array_equal(exact.fits, lean.fits) and np.array_equal(exact.lean_fits, lean.lean_fits)
        assert np.array_equal(exact.step_s, lean.step_s)
        cap = prob.capacity_bytes
        assert np.array_equal(exact.lean_expert_mem_bytes > cap, lean.lean_expert_mem_bytes > cap)
        assert (lean.attn_mem_bytes <= exact.attn_mem_bytes).all()
        assert kind is colocated_candidates or (lean.attn_mem_bytes < exact.attn_mem_bytes).any()  # skipped there
        assert np.array_equal(lean.attn_mem_bytes[exact.fits], exact.attn_mem_bytes[exact.fits])


def test_paired_expert_weight_gradients_price_half_the_single_layouts_main_gradient_passes():
    """`expert_wgrad_pairs` (`kernels.wgrad_pairs`) on the Qwen3 config in mode single at 8 micro-batches:
    4 weight-gradient launches a step, each one read and write of the experts' fp32 main gradients, so the
    stage's HBM bytes fall by 4 of the 8 passes (the FLOPs and the rows' bytes the same), the step is
    predicted faster, and one micro-batch's expert rows per MoE layer are held beside the next."""
    from disagmoe.roofline import memory as mem

    hw = load_hardware("h200-sxm-calibrated")
    off = _qwen3_single(hw, "bf16", True, "micro_batches=8", "expert_wgrad_pairs=off")[1]
    prob, on, _ = _qwen3_single(hw, "bf16", True, "micro_batches=8", "expert_wgrad_pairs=on")
    assert prob.wgrad_pairs
    m = load_model("qwen3-30b-a3b").model_copy(update={"num_layers": 6})
    weights = 128 * 3 * 2048 * 768  # one MoE layer's expert parameters
    stage_on, stage_off = on.stages["expert weight grads"].bwd, off.stages["expert weight grads"].bwd
    first = lambda v: float(np.asarray(v).ravel()[0])  # noqa: E731
    assert first(stage_on.flops) == pytest.approx(first(stage_off.flops))
    per_micro_batch = 4 * weights * 2 * (1 - 4 / 8)  # fp32, read and write, 4 of 8 passes gone
    assert first(stage_off.hbm_bytes) - first(stage_on.hbm_bytes) == pytest.approx(per_micro_batch)
    # calibrated: a paired launch at the curve's rate for its own rows per expert (two micro-batches'): a probe
    # launch bound by its main gradient's traffic fits that time as compute (`calibration.fitted_fraction`)
    assert on.step_s[0] < off.step_s[0]
    sheet = load_hardware("h100-sxm")
    assert (_qwen3_single(sheet, "bf16", True, "micro_batches=8", "expert_wgrad_pairs=on")[1].step_s[0]
            < _qwen3_single(sheet, "bf16", True, "micro_batches=8", "expert_wgrad_pairs=off")[1].step_s[0])
    tokens = 16 // 8 * 4096
    assert on.attn_mem_bytes[0] - off.attn_mem_bytes[0] == pytest.approx(
        m.num_moe_layers * mem.paired_wgrad_waiting_bytes(m, tokens * m.top_k, m.num_experts, 2))


def test_paired_weight_gradients_under_a_measured_fp8_curve_take_its_rate_at_the_paired_launchs_size():
    """precision fp8 (bf16-wgrad) priced from the H100's measured FP8 curve, the Qwen3 config at 8 micro-batches:
    with expert_wgrad_pairs the weight gradients take the curve's rate at two micro-batches' rows per expert
    (`fp8_stages`' `wgrad_paired_share`), so the paired step is predicted faster (measured on that H100:
    543.9 ms unpaired, 496.8 paired, docs/benchmarks.md session 35); the data gradients' stage is unchanged."""
    hw = load_hardware("h100-sxm-calibrated")
    assert hw.calibration.expert_gemm_fp8
    fp8 = ("micro_batches=8", "optim.state_dtype=bf16", "fp8_expert_forward=down")
    _, off, _ = _qwen3_single(hw, "fp8", True, *fp8, "expert_wgrad_pairs=off")
    _, on, _ = _qwen3_single(hw, "fp8", True, *fp8, "expert_wgrad_pairs=on")
    assert on.step_s[0] < off.step_s[0]
    rate = lambda cost, name: float(np.asarray(cost.stages[name].bwd_ceilings.flops_per_s).ravel()[0])  # noqa: E731
    assert rate(on, "routed experts") == rate(off, "routed experts")
    assert rate(on, "expert weight grads") > rate(off, "expert weight grads")
