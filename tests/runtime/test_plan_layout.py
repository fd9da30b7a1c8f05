"""A `disagmoe plan` result applied to a run (disagmoe/runtime/plan_layout.py): layout, placement, refusals.

Plans come from the real planner (`disagmoe.placement.solver`) for the tiny model (8 experts,
MoE layers 1 and 2); the refusal cases edit one field of such a plan. No Ray is needed: every
refusal happens before an actor starts.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import ray

from disagmoe.cli.plan_cmd import build_request, write_plan
from disagmoe.config import Plan, TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import Candidates, evaluate
from disagmoe.placement.solver import best_index, colocated_candidates, disaggregated_candidates, price, problem_of, solve
from disagmoe.runtime.cluster.driver import DistributedTrainer
from disagmoe.runtime.batching import batch_rows
from disagmoe.runtime.plan_layout import apply_plan, load_plan, partition_owners, plan_placement, replaced_fields
from disagmoe.runtime.topology import Topology, contiguous_expert_ids

MODEL = load_model("tiny")


def planned(gpus: int, expert_gpus: int | None = None, **request) -> Plan:
    """The planner's best disaggregated plan for the tiny model on `gpus` H200s (64-token
    sequences, 8 per step), with 1 attention and `expert_gpus` expert GPUs if given; on one GPU,
    its plan (single). For so small a model the planner's overall pick is often fewer GPUs
    (latency dominates), so the layout is fixed here."""
    cfg = build_request("tiny", "h200-sxm", gpus, 64, 512, **request)
    if gpus == 1:
        return solve(cfg)
    candidates = disaggregated_candidates(cfg, gpus)
    if expert_gpus is not None:
        candidates = candidates.take(np.flatnonzero((candidates.attn == 1) & (candidates.expert == expert_gpus)
                                                    & (candidates.p == 1)))
    return price(cfg, candidates.take(best_index(evaluate(problem_of(cfg), candidates), candidates))).plan


def colocated_plan(gpus: int, micro_batches: int, p: int = 1, seqs: int = 1) -> Plan:
    """The planner's colocated layout on all `gpus` (`p` pipeline groups, each one EP block,
    `micro_batches` of `seqs` sequences per GPU) priced as a plan."""
    request = build_request("tiny", "h200-sxm", gpus, 64, 512)
    candidates = colocated_candidates(request, gpus)
    index = next(i for i in range(len(candidates))
                 if candidates.p[i] == p and candidates.m[i] == micro_batches and candidates.seqs[i] == seqs
                 and candidates.expert[i] == gpus and candidates.sets[i] == 1)
    return price(request, candidates.take(index)).plan


def holds(plan: Plan, moe_layer: int, pool_rank: int) -> tuple[int, ...]:
    """The experts of `moe_layer` that the plan puts on expert-pool rank `pool_rank`."""
    return tuple(e for e, ranks in enumerate(plan.expert_map[moe_layer]) if ranks == [pool_rank])


def config(plan: Plan | str, **fields) -> TrainConfig:
    return TrainConfig(**{"model": MODEL, "plan": plan, "batch_size": 8, "seq_len": 16, **fields})


def one_gpu_plan(m: int, seqs: int, **request) -> Plan:
    """The one-GPU split of `m` micro-batches of `seqs` sequences priced as a plan (8 sequences a step:
    8 / (m * seqs) rounds, rounded up)."""
    return price(build_request("tiny", "h200-sxm", 1, 64, 512, **request),
                 Candidates.one(0, 1, 1, m, seqs, colocated=True)).plan


def test_a_disaggregated_plan_sets_the_layout_and_its_expert_map_the_placement():
    plan = planned(3)  # 1 attention + 2 expert GPUs; experts dealt round-robin (not contiguous)
    assert (plan.layout, plan.attention_gpus, plan.expert_gpus) == ("disaggregated", 1, 2)
    cfg = apply_plan(config(plan, micro_batches=2, attention_ranks=4), MODEL)
    assert (cfg.mode, cfg.attention_ranks, cfg.expert_ranks, cfg.pipeline_groups, cfg.micro_batches) == (
        "disaggregated", 1, 2, 1, plan.micro_batches)
    placement = plan_placement(plan, MODEL)
    assert placement[1] != partition_owners(contiguous_expert_ids(8, 2), 8)
    for layer in (1, 2):
        assert placement[layer] == partition_owners((holds(plan, layer - 1, 0), holds(plan, layer - 1, 1)), 8)
    topology = Topology.from_config(config(plan), MODEL)
    assert topology.world_size == 3
    assert topology.experts_of(2) == {layer: holds(plan, layer - 1, 1) for layer in (1, 2)}  # expert rank 1


def test_the_plan_wins_over_the_configs_layout_fields_and_says_what_it_replaced():
    plan = planned(3)
    before = config(plan, mode="colocated", colocated_ranks=3, attention_ranks=2, expert_ranks=4, micro_batches=2)
    after = apply_plan(before, MODEL)
    assert plan.micro_batches == 1  # nothing to pair: the plan's expert_wgrad_pairs off replaces the config's auto
    assert replaced_fields(before, after) == {"mode": ("colocated", "disaggregated"), "attention_ranks": (2, 1),
                                              "expert_ranks": (4, 2), "micro_batches": (2, plan.micro_batches),
                                              "expert_wgrad_pairs": ("auto", "off")}
    assert apply_plan(after, MODEL) == after  # idempotent: the driver applies what the CLI applied


def test_a_colocated_plan_sets_the_colocated_ranks():
    plan = colocated_plan(2, micro_batches=2, seqs=2)  # one round: the config's 8 sequences
    cfg = apply_plan(config(plan, attention_ranks=2, pipeline_groups=2), MODEL)
    assert (cfg.mode, cfg.colocated_ranks, cfg.micro_batches, cfg.pipeline_groups) == ("colocated", 2, 2, 1)
    topology = Topology.from_config(cfg, MODEL)
    for rank in (0, 1):
        assert topology.experts_of(rank) == {layer: holds(plan, layer - 1, rank) for layer in (1, 2)}


def test_a_colocated_plan_with_pipeline_groups_places_each_expert_once_on_its_groups_ranks():
    """A colocated plan with p = 2 on 4 GPUs (each group one EP block of 2) sets pipeline_groups,
    and its expert map (global ranks, group g's g*2 .. g*2 + 1) is the topology's owners: each
    expert of a layer once, on the layer's group."""
    plan = colocated_plan(4, micro_batches=2, p=2, seqs=2)  # one round: the config's 8 sequences
    cfg = apply_plan(config(plan), MODEL)
    assert (cfg.mode, cfg.colocated_ranks, cfg.pipeline_groups, cfg.micro_batches) == ("colocated", 4, 2, 2)
    topology = Topology.from_config(cfg, MODEL)
    assert topology.world_size == 4 and topology.pipeline_groups == 2
    for j, owners in enumerate(plan.expert_map):
        group = (MODEL.num_dense_layers + j) % 2
        assert all(len(ranks) == 1 and ranks[0] // 2 == group for ranks in owners)
        assert [list(topology.owner_ranks(MODEL.num_dense_layers + j, e)) for e in range(8)] == owners
    for rank in range(4):
        assert topology.experts_of(rank) == {layer: holds(plan, layer - 1, rank) for layer in (1, 2)
                                             if layer % 2 == rank // 2}


def test_a_colocated_plan_in_ep_blocks_runs_them_in_every_pipeline_group():
    """p = 2 on 8 GPUs, each group two EP blocks of 2 (block b: the group's GPUs b and b + 2): the plan
    sets expert_replica_sets, every expert is held once per block, the blocks sum its gradients, and each
    rank dispatches within its own block; under tiny's auxiliary loss too, where each also swaps its
    block's load with the other block's rank at its position."""
    request = build_request("tiny", "h200-sxm", 8, 64, 512)
    candidates = colocated_candidates(request, 8)
    index = next(i for i in range(len(candidates)) if (candidates.p[i], candidates.m[i], candidates.expert[i],
                                                         candidates.sets[i]) == (2, 2, 8, 2))
    plan = price(request, candidates.take(index)).plan
    cfg = apply_plan(config(plan), MODEL)
    assert (cfg.mode, cfg.colocated_ranks, cfg.pipeline_groups, cfg.expert_replica_sets) == ("colocated", 8, 2, 2)
    no_aux = MODEL.model_copy(update={"router": MODEL.router.model_copy(update={"aux_loss_coef": 0.0})})
    topology = Topology.from_config(cfg, no_aux)
    for j, owners in enumerate(plan.expert_map):
        layer = MODEL.num_dense_layers + j
        first = 4 * (layer % 2)
        assert [list(topology.owner_ranks(layer, e)) for e in range(8)] == owners
        assert all(sorted(r % 2 for r in ranks) == [0, 1] and all(first <= r < first + 4 for r in ranks)
                   for ranks in owners)  # once in each block of the layer's group
        assert [topology.served(layer, d) for d in range(4)] == [(first + d % 2, first + d % 2 + 2) for d in range(4)]
    assert (0, 1) in topology.replica_groups() and (6, 7) in topology.replica_groups()
    aux = Topology.from_config(cfg, MODEL)
    assert aux.served(1, 0) == (4, 6) and aux.load_peers(1, 4) == (5,) and topology.load_peers(1, 4) == ()


def test_a_single_gpu_plan_runs_in_single_mode():
    plan = planned(1)
    assert (plan.layout, plan.attention_gpus, plan.expert_gpus) == ("single", 0, 1)
    before = config(plan, mode="disaggregated", micro_batches=2)
    cfg = apply_plan(before, MODEL)
    assert (cfg.mode, cfg.micro_batches) == ("single", plan.micro_batches * plan.accumulation_rounds)
    assert replaced_fields(before, cfg)["mode"] == ("disaggregated", "single")


@pytest.mark.parametrize("m, seqs", [(1, 2), (2, 1), (1, 8)])
def test_a_single_plans_rounds_are_more_micro_batches_of_the_priced_size(m, seqs):
    """A one-GPU plan of r rounds of m micro-batches: the single trainer accumulates m x r micro-batches
    a step, each the plan's sequences (`batch_rows` cuts the config's batch), and its weight-gradient
    pairs were priced over those m x r (on for 2+, the tiny model's rows fitting)."""
    plan = one_gpu_plan(m, seqs)
    rounds = 8 // (m * seqs)
    assert (plan.layout, plan.micro_batches, plan.sequences_per_micro_batch, plan.accumulation_rounds) == (
        "single", m, seqs, rounds)
    assert plan.expert_wgrad_pairs == ("on" if m * rounds >= 2 else "off")
    cfg = apply_plan(config(plan, micro_batches=2, device="cuda", experts_backend="triton"), MODEL)
    assert (cfg.mode, cfg.micro_batches, cfg.expert_wgrad_pairs) == ("single", m * rounds, plan.expert_wgrad_pairs)
    rows = [batch_rows(cfg.batch_size, cfg.micro_batches, 1, i, 0) for i in range(cfg.micro_batches)]
    assert [r.stop - r.start for r in rows] == [seqs] * (m * rounds)
    assert cfg.pairs_expert_wgrads == (plan.expert_wgrad_pairs == "on")
    assert apply_plan(cfg, MODEL) == cfg  # idempotent


@pytest.mark.parametrize("layout", ["colocated", "disaggregated"])
def test_a_distributed_plan_of_several_rounds_runs_one_round_per_step(layout):
    """The distributed schedule runs one round of m micro-batches per optimizer step (every forward, then
    every backward; no loop over rounds): a plan of 2+ rounds applies to a batch of one round, its
    micro-batches the priced ones, and is refused for its whole step's batch (micro-batches r times the
    priced), naming the batch that runs."""
    request = build_request("tiny", "h200-sxm", 3, 64, 512)

    def two_data_parallel(seqs: int) -> Plan:  # 2 micro-batches of `seqs` sequences on each of 2 attention GPUs
        gpus = (0, 2) if layout == "colocated" else (2, 1)
        return price(request, Candidates.one(*gpus, 1, 2, seqs, colocated=layout == "colocated")).plan

    plan = two_data_parallel(1)
    assert (plan.layout, plan.micro_batches, plan.sequences_per_micro_batch, plan.accumulation_rounds) == (
        layout, 2, 2, 2)
    with pytest.raises(ValueError, match=re.escape("runs one round per optimizer step") + ".*"
                       + re.escape("set batch_size: 4 (one round per step")):
        apply_plan(config(plan), MODEL)
    cfg = apply_plan(config(plan, batch_size=4), MODEL)
    assert (cfg.mode, cfg.micro_batches, cfg.batch_size // cfg.micro_batches) == (layout, 2, 2)
    one_round = two_data_parallel(2)
    assert one_round.accumulation_rounds == 1  # a plan of one round: the config's batch, whatever it is
    assert apply_plan(config(one_round, batch_size=16), MODEL).micro_batches == 2


def test_a_plan_file_written_by_the_planner_loads(tmp_path):
    plan = planned(3)
    for name in ("plan.yaml", "plan.json"):
        write_plan(plan, tmp_path / name)
        assert load_plan(str(tmp_path / name)) == plan
        assert apply_plan(config(str(tmp_path / name)), MODEL).plan == plan  # carried inline from here on
    with pytest.raises(ValueError, match="cannot read"):
        load_plan(str(tmp_path / "missing.yaml"))


def test_a_plan_with_replicated_experts_places_every_replica():
    plan = planned(5, expert_gpus=4, max_expert_replicas=1)  # 1 attention + 4 expert GPUs, hot experts on two ranks
    assert any(len(ranks) > 1 for owners in plan.expert_map for ranks in owners)
    placement = plan_placement(plan, MODEL)
    assert placement[1] == tuple(tuple(ranks) for ranks in plan.expert_map[0])  # pool rank = group index (p = 1)
    topology = Topology.from_config(config(plan), MODEL)
    for pool_rank in range(4):
        held = {layer: tuple(e for e, ranks in enumerate(plan.expert_map[layer - 1]) if pool_rank in ranks)
                for layer in (1, 2)}
        assert topology.experts_of(1 + pool_rank) == held
    assert topology.replica_groups() == sorted({tuple(sorted(1 + r for r in ranks)) for owners in plan.expert_map
                                                for ranks in owners if len(ranks) > 1})


def _edit_map(plan: Plan, layer: int, expert: int, ranks: list[int]) -> Plan:
    expert_map = [[list(r) for r in owners] for owners in plan.expert_map]
    expert_map[layer][expert] = ranks
    return plan.model_copy(update={"expert_map": expert_map})


REFUSED = {
    "another-model": (lambda: planned(3).model_copy(update={"model": "mixtral-8x7b"}),
                      "places model 'mixtral-8x7b' but this run trains 'tiny'"),
    "moe-layers": (lambda: planned(3).model_copy(update={"expert_map": planned(3).expert_map[:1]}),
                   "has 2 MoE layers x 8 experts"),
    "experts": (lambda: planned(3).model_copy(update={"expert_map": [o[:6] for o in planned(3).expert_map]}),
                "expert_map is 2 MoE layers x [6, 6] experts"),
    "infeasible": (lambda: planned(3).model_copy(update={"feasible": False, "reason": "too small"}),
                   "is infeasible (too small)"),
    "same-rank-twice": (lambda: _edit_map(planned(3), 0, 2, [1, 1]), "expert 2 of MoE layer 0 on [1, 1]"),
    "outside-group": (lambda: _edit_map(planned(3).model_copy(update={"attention_gpus": 2, "pipeline_groups": 2}),
                                        0, 0, [0]),
                      "expert 0 of MoE layer 0 on [0], but that layer's experts must each go to one or more "
                      "distinct expert ranks of its pipeline group 1: ranks 1..1"),
    "no-rank": (lambda: _edit_map(planned(3), 1, 3, []), "expert 3 of MoE layer 1 on no rank"),
    "idle-rank": (lambda: planned(3).model_copy(update={"expert_map": [[[0]] * 8, planned(3).expert_map[1]]}),
                  "gives expert ranks [1] no expert of MoE layer 0"),
    "single-on-two": (lambda: planned(1).model_copy(update={"expert_gpus": 2}),
                      "a single plan runs everything on one GPU"),
    "uneven-groups": (lambda: planned(3).model_copy(update={"pipeline_groups": 3}),
                      "expert_gpus=2, not a multiple of pipeline_groups=3"),
    "distributed-rounds": (lambda: colocated_plan(2, micro_batches=2),  # 2 rounds of 4 sequences
                           "prices a step as 2 rounds of 2 micro-batches of 2 sequences"),
    "single-rounds-uneven": (lambda: one_gpu_plan(1, 3),  # 3 micro-batches of 3 for the config's 8
                             "trains 3 micro-batches a step (1 x 3 rounds, priced at 3 sequences each), which "
                             "do not divide batch_size=8"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_plans_the_runtime_cannot_run_are_refused_before_any_actor(case):
    make, message = REFUSED[case]
    cfg = config(make())
    with pytest.raises(ValueError, match=re.escape(message)):
        apply_plan(cfg, MODEL)
    with pytest.raises(ValueError, match=re.escape(message)):
        DistributedTrainer(cfg)
    assert not ray.is_initialized()


def test_a_plans_recomputation_is_set_where_the_experts_can_run_it():
    """A plan that chose selective recomputation sets it (all three modules) on a triton run and
    says so among the replaced fields; a run with other experts is refused with the fix; a plan
    without recomputation sets none."""
    plan = planned(2, 1).model_copy(update={"recompute": "selective"})
    cfg = config(plan, experts_backend="triton")
    run = apply_plan(cfg, MODEL)
    assert run.recompute == "selective" and run.recompute_set == {"expert_input", "expert_output", "expert_swiglu"}
    assert replaced_fields(cfg, run)["recompute"] == ("none", "selective")
    with pytest.raises(ValueError, match="needs experts_backend: triton.*--recompute none"):
        apply_plan(config(plan, experts_backend="grouped_mm"), MODEL)
    plain = planned(2, 1).model_copy(update={"recompute": "none"})
    assert apply_plan(config(plain, experts_backend="triton", recompute="selective"), MODEL).recompute == "none"
    assert apply_plan(config(plain), MODEL).recompute == "none"


def test_a_selective_plan_written_before_recompute_modules_means_the_expert_modules():
    """A plan file from before `recompute_modules` with recompute: selective reads as the three
    expert modules (what the planner then priced); a plan of none names no module."""
    data = planned(2, 1).model_dump(mode="json")
    assert data["recompute_modules"] == [] and data["recompute"] == "none"
    del data["recompute_modules"]
    assert Plan.model_validate(data).recompute_modules == []
    data["recompute"] = "selective"
    old = Plan.model_validate(data)
    assert old.recompute_modules == ["expert_input", "expert_output", "expert_swiglu"]
    run = apply_plan(config(old, experts_backend="triton"), MODEL)
    assert run.recompute_set == {"expert_input", "expert_output", "expert_swiglu"}


def test_a_plan_priced_with_offload_sets_offload_optimizer():
    """`plan --offload-optimizer` records it in the plan and `train --plan` sets offload_optimizer: true
    (among the replaced fields); a plan without it leaves the config's setting."""
    plan = planned(2, 1, offload_optimizer=True)
    assert plan.offload_optimizer and not planned(2, 1).offload_optimizer
    cfg = config(plan)
    run = apply_plan(cfg, MODEL)
    assert run.offload_optimizer and replaced_fields(cfg, run)["offload_optimizer"] == (False, True)
    assert apply_plan(config(planned(2, 1), offload_optimizer=True), MODEL).offload_optimizer


def test_a_plan_sets_the_optimizer_settings_it_was_priced_with():
    """`plan --optimizer-update-kernel --optimizer-state-dtype --shard-optimizer-states` records them
    in the plan and `train --plan` sets optim.update_kernel, optim.state_dtype and optim.shard_states
    to them (among the replaced fields), the rest of optim the config's; a plan of the defaults sets
    the defaults back but leaves the config's sharding; a plan written before it recorded them
    leaves the config's settings."""
    plan = planned(2, 1, optimizer_update_kernel="torch", optimizer_state_dtype="bf16", shard_optimizer_states=True)
    assert (plan.optimizer_update_kernel, plan.optimizer_state_dtype, plan.shard_optimizer_states) == (
        "torch", "bf16", True)
    cfg = config(plan, optim={"lr": 1e-3})
    run = apply_plan(cfg, MODEL)
    assert (run.optim.update_kernel, run.optim.state_dtype, run.optim.shard_states, run.optim.lr) == (
        "torch", "bf16", True, 1e-3)
    changed = replaced_fields(cfg, run)
    assert (changed["optim.update_kernel"], changed["optim.state_dtype"], changed["optim.shard_states"]) == (
        ("triton", "torch"), ("fp32", "bf16"), (False, True))
    assert apply_plan(run, MODEL) == run  # idempotent
    mine = {"update_kernel": "torch", "state_dtype": "bf16", "shard_states": True}
    plain = apply_plan(config(planned(2, 1), optim=mine), MODEL)
    assert (plain.optim.update_kernel, plain.optim.state_dtype, plain.optim.shard_states) == ("triton", "fp32", True)
    data = planned(2, 1).model_dump(mode="json")
    for name in ("optimizer_update_kernel", "optimizer_state_dtype", "shard_optimizer_states"):
        del data[name]
    old = apply_plan(config(Plan.model_validate(data), optim=mine), MODEL)
    assert old.optim == config(planned(2, 1), optim=mine).optim


def test_a_plan_priced_in_fp8_sets_precision_fp8_and_its_fp8_dense():
    """`plan --expert-precision fp8` records the experts' precision and fp8_dense in the plan, and
    `train --plan` sets precision: fp8 and the plan's fp8_dense (among the replaced fields; fp8_dense
    only where it differs from what the config trains, whose None means on under fp8); a bf16 plan, and
    a plan written before it recorded them, leave the config's precision and fp8_dense."""
    fp8, bf16 = planned(2, 1, expert_precision="fp8", fp8_dense=True), planned(2, 1)
    assert (fp8.expert_precision, fp8.fp8_dense, bf16.expert_precision, bf16.fp8_dense) == ("fp8", True, "bf16", False)
    lean = solve(build_request("tiny", "h200-sxm", 1, 64, 512, expert_precision="fp8", fp8_dense=False))
    assert (lean.expert_precision, lean.fp8_dense) == ("fp8", False)
    gpu = {"device": "cuda", "experts_backend": "triton"}
    cfg = config(fp8, **gpu)
    run = apply_plan(cfg, MODEL)
    assert (run.precision, run.fp8_dense, run.expert_precision, run.dense_precision) == ("fp8", None, "fp8", "fp8")
    changed = replaced_fields(cfg, run)  # None: on already under precision fp8
    assert changed["precision"] == ("auto", "fp8") and "fp8_dense" not in changed
    assert apply_plan(run, MODEL) == run  # idempotent
    cfg = config(lean, **gpu)
    run = apply_plan(cfg, MODEL)
    assert (run.precision, run.fp8_dense, run.dense_precision) == ("fp8", False, "bf16")
    assert replaced_fields(cfg, run)["fp8_dense"] == (None, False)
    mine = config(fp8, precision="fp8", fp8_dense=False, **gpu)  # a plan with FP8 dense projections turns them on
    assert replaced_fields(mine, apply_plan(mine, MODEL))["fp8_dense"] == (False, True)
    kept = {"precision": "fp8", "fp8_dense": False, **gpu}
    assert (apply_plan(config(bf16, **kept), MODEL).precision, apply_plan(config(bf16, **kept), MODEL).fp8_dense) == (
        "fp8", False)
    data = fp8.model_dump(mode="json")
    del data["expert_precision"], data["fp8_dense"]
    old = Plan.model_validate(data)
    for fields in ({"precision": "bf16", **gpu}, kept):
        run = apply_plan(config(old, **fields), MODEL)
        assert (run.precision, run.fp8_dense) == (fields["precision"], fields.get("fp8_dense"))


def test_a_plan_sets_the_dense_fp8_scaling_it_priced_where_the_config_trains_another():
    """A plan records the dense projections' FP8 recipe it priced (`plan --fp8-dense-scaling`), None
    where it priced them in bf16; `train --plan` sets fp8_dense_scaling where the config trains
    another (its unset one is blockwise), and drops the config's where the plan keeps the dense
    projections in bf16 (a scaling with nothing to scale is refused)."""
    gpu = {"device": "cuda", "experts_backend": "triton"}
    rowwise, blockwise = (planned(2, 1, expert_precision="fp8", fp8_dense_scaling=s) for s in ("rowwise", "blockwise"))
    lean = planned(2, 1, expert_precision="fp8", fp8_dense=False, fp8_dense_scaling="rowwise")
    assert (rowwise.fp8_dense_scaling, blockwise.fp8_dense_scaling, lean.fp8_dense_scaling) == (
        "rowwise", "blockwise", None)
    cfg = config(rowwise, **gpu)
    run = apply_plan(cfg, MODEL)
    assert (run.fp8_dense_scaling, run.dense_fp8_scaling) == ("rowwise", "rowwise")
    assert replaced_fields(cfg, run)["fp8_dense_scaling"] == (None, "rowwise")
    assert apply_plan(run, MODEL) == run  # idempotent
    cfg = config(blockwise, **gpu)
    unset = apply_plan(cfg, MODEL)  # the config's unset scaling is the plan's
    assert unset.fp8_dense_scaling is None and "fp8_dense_scaling" not in replaced_fields(cfg, unset)
    mine = config(blockwise, precision="fp8", fp8_dense_scaling="rowwise", **gpu)
    assert replaced_fields(mine, apply_plan(mine, MODEL))["fp8_dense_scaling"] == ("rowwise", "blockwise")
    off = apply_plan(config(lean, precision="fp8", fp8_dense_scaling="rowwise", **gpu), MODEL)
    assert (off.fp8_dense, off.fp8_dense_scaling, off.dense_precision) == (False, None, "bf16")


def test_a_plan_sets_the_fp8_recipe_and_the_cuda_graphs_it_was_priced_under():
    """An FP8 plan records the experts' backward and forward recipes it priced, a distributed plan the
    cuda_graphs its rings were priced under; `train --plan` sets them (among the replaced fields). A
    bf16 plan's recipes and a one-GPU plan's cuda_graphs are None: the config's stay."""
    gpu = {"device": "cuda", "experts_backend": "triton", "transport": "nvshmem"}
    fp8 = planned(2, 1, expert_precision="fp8", fp8_expert_backward="bf16", fp8_expert_forward="down",
                  cuda_graphs="off")
    assert (fp8.fp8_expert_backward, fp8.fp8_expert_forward, fp8.cuda_graphs) == ("bf16", "down", "off")
    cfg = config(fp8, **gpu)
    run = apply_plan(cfg, MODEL)
    assert (run.fp8_expert_backward, run.fp8_expert_forward, run.cuda_graphs) == ("bf16", "down", "off")
    changed = replaced_fields(cfg, run)
    assert changed["fp8_expert_backward"] == (None, "bf16") and changed["cuda_graphs"] == ("auto", "off")
    assert apply_plan(run, MODEL) == run  # idempotent
    bf16, single = planned(2, 1), planned(1)
    assert (bf16.fp8_expert_backward, bf16.fp8_expert_forward, bf16.cuda_graphs) == (None, None, "auto")
    assert single.layout == "single" and single.cuda_graphs is None
    mine = config(single, device="cuda", experts_backend="triton", cuda_graphs="off")
    assert apply_plan(mine, MODEL).cuda_graphs == "off"


def test_a_plan_sets_the_loss_it_was_priced_with_on_a_gpu_run():
    """A plan records the LM head's loss it priced (`--no-fused-loss`: torch's ops); `train --plan` sets it on a
    GPU run (among the replaced fields), and leaves a CPU run's (which runs torch's ops whatever it says)."""
    fused, torch_ops = planned(1), planned(1, fused_loss=False)
    assert (fused.fused_loss, torch_ops.fused_loss) == (True, False)
    assert fused.memory_per_gpu != torch_ops.memory_per_gpu or fused.step_time_s < torch_ops.step_time_s
    gpu = config(torch_ops, device="cuda", experts_backend="triton")
    run = apply_plan(gpu, MODEL)
    assert run.fused_loss is False and replaced_fields(gpu, run)["fused_loss"] == (True, False)
    assert apply_plan(config(torch_ops), MODEL).fused_loss is True  # a CPU run's own
    assert apply_plan(config(fused, device="cuda", experts_backend="triton", fused_loss=False), MODEL).fused_loss


@pytest.mark.parametrize("precision", ["auto", "fp32"])
def test_an_fp8_plan_on_a_cpu_run_gets_the_configs_own_fp8_refusal(precision):
    """precision: fp8 set by a plan goes through the config's checks as a config file's would: on
    the CPU (the config's precision auto or fp32) with loop experts it is refused, naming why and
    that the plan set it, before anything runs."""
    with pytest.raises(ValueError, match=r"priced in FP8.*precision: fp8 needs device: cuda"):
        apply_plan(config(planned(2, 1, expert_precision="fp8"), precision=precision), MODEL)


def test_a_one_gpu_plan_sets_the_expert_weight_gradient_pairs_it_was_priced_under():
    """A one-GPU plan records the expert_wgrad_pairs it priced (`plan --expert-wgrad-pairs`): on where its weight
    gradients were priced over pairs of micro-batches (auto settled for its split: the tiny model's rows fit),
    else off (asked so, or one micro-batch: nothing pairs); `train --plan` sets it (among the replaced fields).
    A distributed plan records its ranks' pairs too; train sets its off as off and its on as auto, which the
    driver settles as the planner did (`plan_layout.planned_wgrad_pairs`)."""
    def single(m: int, **request) -> Plan:
        return one_gpu_plan(m, 8 // m, **request)

    paired, off, alone, best = single(2), single(2, expert_wgrad_pairs="off"), single(1), planned(1)
    assert (paired.layout, paired.expert_wgrad_pairs, off.expert_wgrad_pairs) == ("single", "on", "off")
    assert alone.expert_wgrad_pairs == "off"
    assert best.expert_wgrad_pairs == ("on" if best.micro_batches * best.accumulation_rounds >= 2 else "off")
    for plan in (paired, off):
        cfg = config(plan, device="cuda", experts_backend="triton")
        run = apply_plan(cfg, MODEL)
        assert run.expert_wgrad_pairs == plan.expert_wgrad_pairs
        assert replaced_fields(cfg, run)["expert_wgrad_pairs"] == ("auto", plan.expert_wgrad_pairs)
        assert apply_plan(run, MODEL) == run  # idempotent
    request = build_request("tiny", "h200-sxm", 3, 64, 512)
    split, unpaired = (price(request.model_copy(update={"expert_wgrad_pairs": pairs}),
                             Candidates.one(1, 2, 1, 2, 4)).plan for pairs in ("auto", "off"))
    assert (split.layout, split.expert_wgrad_pairs, unpaired.expert_wgrad_pairs) == ("disaggregated", "on", "off")
    for plan, trained in ((split, "auto"), (unpaired, "off")):
        assert apply_plan(config(plan, device="cuda", experts_backend="triton"), MODEL).expert_wgrad_pairs == trained


def test_a_distributed_plans_pairs_run_as_its_driver_settles_them_pair_rows_in_bands_off():
    """A distributed plan priced paired (the planner prices partial sums) trains them on where the run pairs
    (`driver.resolve_distributed_wgrad_pairs` settles the plan's auto on), and off, not refused, where the run
    asks pair rows in bands (`pair_bands` > 1), whose launches run alone."""
    from disagmoe.runtime.cluster.driver import resolve_distributed_wgrad_pairs

    plan = price(build_request("tiny", "h200-sxm", 3, 64, 512), Candidates.one(1, 2, 1, 2, 4)).plan
    assert plan.expert_wgrad_pairs == "on"
    for bands, settled in ((1, "on"), (2, "off")):
        run = apply_plan(config(plan, experts_backend="triton", hop="pair_rows", pair_bands=bands), MODEL)
        assert resolve_distributed_wgrad_pairs(run, MODEL, 2**34)[0].expert_wgrad_pairs == settled
