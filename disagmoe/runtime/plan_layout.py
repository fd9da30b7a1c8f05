"""A `disagmoe plan` result applied to a training run: its layout and its expert placement.

`apply_plan(cfg, model_cfg)` returns the run's config with the plan's layout: `mode` = the plan's
layout, `attention_ranks` / `expert_ranks` (colocated: `colocated_ranks`) = its GPU counts,
`pipeline_groups`, `expert_replica_sets` (colocated: EP blocks a group) and `micro_batches` (a
`single` plan, one GPU: mode single and micro_batches),
`recompute` and `recompute_modules` where the plan recomputes (selective: the modules it priced;
full: the whole block; a plan of none sets none where experts_backend is triton and leaves another
backend's setting),
`offload_optimizer: true` and `optim.shard_states: true` where the plan priced them (a plan without
them leaves the config's setting), `optim.state_dtype` / `optim.update_kernel` as the plan
priced them (a plan written before it recorded them leaves the config's), `precision: fp8`
with the plan's `fp8_dense`, `fp8_dense_scaling` (where the config's, unset = blockwise, differs;
dropped where the plan keeps the dense projections in bf16), `fp8_expert_backward` and
`fp8_expert_forward` where it priced the experts in FP8 (a bf16 plan, or one written before it
recorded them, leaves the config's), and a
distributed plan's `cuda_graphs` (its rings were priced captured or not under it), and the plan's
`expert_wgrad_pairs` (`planned_wgrad_pairs`: the weight-gradient passes and waiting rows it priced), and on a GPU
its `fused_loss` (the LM head's loss it priced; a plan written before it recorded it leaves the config's).
The plan wins over these fields of the config: the config file is the base a plan is applied to
(`replaced_fields` says what changed, for the CLI to show), and the result goes through the config's
own checks as a config file would (FP8 on a CPU device or without triton experts is refused there,
on a GPU without FP8 tensor cores by the trainer's `check_fp8_device`).
Everything else (batch_size, seq_len, data, the rest of optim, transport) stays the config's.

Rounds (`Plan.accumulation_rounds`: a step priced as r rounds of m micro-batches, one after another,
the optimizer once). The single trainer's micro-batches are its accumulation steps, each forward
and backward before the next (`runtime.training.trainer`), so a single plan's rounds are more of
them: micro_batches = m x r, each of the plan's sequences (`planned_micro_batches`). The distributed
schedule runs one round per optimizer step (`runtime.schedule.schedule`: every micro-batch's
forward, then every backward, all m in flight; no loop over rounds), so m x r there would hold r
times the activations priced: a distributed plan of 2+ rounds is refused unless batch_size is one
round, m x sequences_per_micro_batch (`check_rounds`), and then trains one round per step.

`plan_placement(plan, model_cfg)` turns the plan's `expert_map` (per MoE layer j, per expert: the
expert-pool ranks holding it, in replica order; MoE layer j is layer num_dense_layers + j, of
pipeline group layer mod p, whose expert GPUs are pool ranks g*n .. (g+1)*n - 1 with
n = expert_gpus / p; colocated: the group's ranks, g*n .. (g+1)*n - 1 as `Topology` numbers
them) into MoE layer -> per expert, its owners as indices into the layer's group
(`ExpertOwners`). An expert with n owners is replicated; the attention rank of data-parallel
index d (of D) sends its rows of it to owner d mod n when D >= n (DESIGN: replica r serves the
data-parallel indices d mod n == r, so a replica set serves its share of the attention ranks), and
splits them evenly over owners d, d + D, ... when D < n, so no replica idles (`replica_rows`).

A plan the runtime cannot run is refused with a ValueError before any actor starts: a plan for
another model, an infeasible plan, a plan recomputing expert modules for a run whose experts_backend
is not triton, a single plan on more than one GPU or with pipeline groups, an expert held by no
rank, twice by one rank or by a rank outside its layer's group, an expert rank with no expert, a
distributed plan of 2+ rounds for a batch other than one round, a single plan whose m x r
micro-batches do not divide batch_size, and a planned config the config's checks refuse. A
colocated plan may hold its experts in EP blocks (replicas) in every pipeline group: each source
then dispatches to the block it feeds (`Topology.served`).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from disagmoe.config import FP8_DENSE_SCALING, RUN_FP8_DENSE, ModelConfig, Plan, TrainConfig, read_mapping, validate
from disagmoe.safe_io import MAX_PLAN_BYTES

ExpertIds = tuple[int, ...]  # one rank's experts of one layer, ascending
ExpertOwners = tuple[tuple[int, ...], ...]  # one layer: per expert, the group's ranks holding it (replica order)
LAYOUT_FIELDS = ("mode", "attention_ranks", "expert_ranks", "pipeline_groups", "expert_replica_sets", "micro_batches",
                 "colocated_ranks", "recompute", "recompute_modules", "offload_optimizer", "optim.state_dtype", "optim.update_kernel",
                 "optim.shard_states", "precision", "fp8_dense", "fp8_dense_scaling", "fp8_expert_backward",
                 "fp8_expert_forward",
                 "cuda_graphs", "expert_wgrad_pairs", "fused_loss")  # dotted: a field of a field
SELECTIVE_MODULES = ("expert_input", "expert_output", "expert_swiglu")  # what the planner's selective prices
REPLAN = "run `disagmoe plan` for this model again and pass its --out file"


def load_plan(ref: str | Plan) -> Plan:
    """A plan file written by `disagmoe plan --out` (.yaml or .json), or a Plan as is."""
    if isinstance(ref, Plan):
        return ref
    return validate(Plan, read_mapping(Path(ref), "plan", MAX_PLAN_BYTES), ref)


def apply_plan(cfg: TrainConfig, model_cfg: ModelConfig) -> TrainConfig:
    """`cfg` with its plan's layout (module docstring); `cfg` itself when it names no plan.
    The plan travels inline in the result, so the workers never read the file."""
    if cfg.plan is None:
        return cfg
    plan = load_plan(cfg.plan)
    source = cfg.plan if isinstance(cfg.plan, str) else "the plan"
    check_plan(plan, model_cfg, source, cfg.experts_backend)
    check_rounds(plan, cfg.batch_size, source)
    if plan.layout == "single":
        layout = {"mode": "single", "micro_batches": planned_micro_batches(plan)}
    elif plan.layout == "colocated":
        layout = {"mode": "colocated", "colocated_ranks": plan.expert_gpus, "pipeline_groups": plan.pipeline_groups,
                  "expert_replica_sets": plan.expert_replica_sets, "micro_batches": planned_micro_batches(plan)}
    else:
        layout = {"mode": "disaggregated", "attention_ranks": plan.attention_gpus, "expert_ranks": plan.expert_gpus,
                  "pipeline_groups": plan.pipeline_groups, "expert_replica_sets": plan.expert_replica_sets,
                  "micro_batches": planned_micro_batches(plan)}
    if plan.recompute == "selective":
        layout["recompute"] = "selective"
        layout["recompute_modules"] = planned_modules(plan)
    elif plan.recompute == "full":  # any experts backend
        layout["recompute"] = "full"
    elif cfg.experts_backend == "triton":
        layout["recompute"] = "none"
    if plan.offload_optimizer:  # the plan's memory holds the state in host memory
        layout["offload_optimizer"] = True
    optim = {name: value for name, value in (("state_dtype", plan.optimizer_state_dtype),
                                             ("update_kernel", plan.optimizer_update_kernel),
                                             ("shard_states", plan.shard_optimizer_states or None))
             if value is not None}
    if optim:
        layout["optim"] = cfg.optim.model_copy(update=optim)
    if plan.expert_precision == "fp8":  # the plan's memory and step time are FP8's (a bf16 plan leaves the config's)
        layout["precision"] = "fp8"
        trained = RUN_FP8_DENSE if cfg.fp8_dense is None else cfg.fp8_dense  # under the precision fp8 set here
        if plan.fp8_dense is not None and plan.fp8_dense != trained:
            layout["fp8_dense"] = plan.fp8_dense
        if plan.fp8_dense is False and cfg.fp8_dense_scaling is not None:  # no FP8 dense GEMMs left to scale
            layout["fp8_dense_scaling"] = None
        elif plan.fp8_dense and plan.fp8_dense_scaling not in (None, cfg.fp8_dense_scaling or FP8_DENSE_SCALING):
            layout["fp8_dense_scaling"] = plan.fp8_dense_scaling
        layout.update({name: value for name, value in (("fp8_expert_backward", plan.fp8_expert_backward),
                                                        ("fp8_expert_forward", plan.fp8_expert_forward))
                       if value is not None})
    if plan.cuda_graphs is not None:  # a distributed plan's rings were priced captured or not under it
        layout["cuda_graphs"] = plan.cuda_graphs
    if plan.fused_loss is not None and cfg.device == "cuda":  # the head was priced as this loss runs (a CPU: torch's)
        layout["fused_loss"] = plan.fused_loss
    if plan.expert_wgrad_pairs is not None:  # the weight-gradient passes and waiting rows were priced so
        layout["expert_wgrad_pairs"] = planned_wgrad_pairs(plan)
    planned = cfg.model_copy(update={**layout, "plan": plan})  # a copy skips the config's checks: run them
    priced = " (priced in FP8, it sets precision: fp8; `plan --expert-precision bf16` prices bf16)" if (
        "precision" in layout) else ""
    validate(TrainConfig, {**planned.model_dump(exclude_unset=True, exclude={"plan"}), "plan": plan},
             f"the config with {source}{priced}")
    return planned


def planned_wgrad_pairs(plan: Plan) -> str:
    """The expert_wgrad_pairs a run trains under `plan` (which records it): as priced, but auto for a
    distributed plan priced on. Its driver then settles them as the planner did
    (`driver.resolve_distributed_wgrad_pairs`: on where they apply and the waiting rows fit), while a run the
    plan did not price leaves them off instead of being refused under on: other experts than triton, or pair
    rows in bands (the planner prices partial sums)."""
    if plan.expert_wgrad_pairs == "on" and plan.layout != "single":
        return "auto"
    return plan.expert_wgrad_pairs


def planned_micro_batches(plan: Plan) -> int:
    """The micro-batches a step trains under `plan` (module docstring): a single plan's m x rounds,
    a distributed plan's m (one round)."""
    rounds = max(plan.accumulation_rounds, 1)  # 0 only in an infeasible plan, which check_plan refuses
    return plan.micro_batches * rounds if plan.layout == "single" else plan.micro_batches


def check_rounds(plan: Plan, batch_size: int, source: str) -> None:
    """ValueError, with the fix, where a run of `batch_size` sequences cannot train `plan`'s
    micro-batches as priced (module docstring: rounds)."""
    m, r, seqs = plan.micro_batches, plan.accumulation_rounds, plan.sequences_per_micro_batch
    if plan.layout == "single":
        micro = planned_micro_batches(plan)
        if batch_size % micro:
            raise ValueError(f"{source} trains {micro} micro-batches a step ({m} x {r} rounds, priced at {seqs} "
                             f"sequences each), which do not divide batch_size={batch_size}; set batch_size to a "
                             f"multiple of {micro} ({micro * seqs} is the plan's step), or plan for this batch")
        return
    if r > 1 and batch_size != m * seqs:
        raise ValueError(
            f"{source} prices a step as {r} rounds of {m} micro-batches of {seqs} sequences, but the {plan.layout} "
            f"runtime runs one round per optimizer step (every micro-batch's forward, then every backward: no "
            f"accumulation over rounds), so batch_size={batch_size} would not run what was priced (micro-batches "
            f"of {batch_size / m:g} sequences); set batch_size: {m * seqs} (one round per step: the memory priced, the "
            f"optimizer stepping {r} times as often), or plan on more GPUs, where the batch may take one round")


def planned_modules(plan: Plan) -> list[str]:
    """The modules a plan recomputes ([] under none; a selective plan naming none: the expert three)."""
    if plan.recompute != "selective":
        return []
    return list(plan.recompute_modules) or list(SELECTIVE_MODULES)


def replaced_fields(before: TrainConfig, after: TrainConfig) -> dict[str, tuple[object, object]]:
    """Layout field -> (the config's value, the plan's) for every field the plan changed."""
    def value(cfg: TrainConfig, name: str) -> object:
        field: object = cfg
        for part in name.split("."):
            field = getattr(field, part)
        return field

    return {name: (value(before, name), value(after, name))
            for name in LAYOUT_FIELDS if value(before, name) != value(after, name)}


def check_plan(plan: Plan, model_cfg: ModelConfig, source: str, experts_backend: str = "triton") -> None:
    """ValueError, with the fix, for a plan this run cannot use (module docstring)."""
    if plan.model != model_cfg.name:
        raise ValueError(f"{source} places model {plan.model!r} but this run trains {model_cfg.name!r}; {REPLAN}")
    if not plan.feasible:
        raise ValueError(f"{source} is infeasible ({plan.reason}); plan for more GPUs or a smaller batch")
    experts = [name for name in planned_modules(plan) if name in SELECTIVE_MODULES]
    if experts and experts_backend != "triton":
        raise ValueError(f"{source} fits only with recompute: selective of {', '.join(experts)}, which needs "
                         f"experts_backend: triton (this run's is {experts_backend}); set experts_backend: triton, "
                         "or plan again with --recompute none")
    moe_layers, experts = model_cfg.num_moe_layers, model_cfg.num_experts
    if len(plan.expert_map) != moe_layers or any(len(owners) != experts for owners in plan.expert_map):
        shape = f"{len(plan.expert_map)} MoE layers x {[len(o) for o in plan.expert_map]} experts"
        raise ValueError(f"{source}'s expert_map is {shape} but {model_cfg.name!r} has {moe_layers} MoE layers "
                         f"x {experts} experts; {REPLAN}")
    p = plan.pipeline_groups
    if plan.layout == "single" and (p > 1 or plan.expert_gpus != 1 or plan.attention_gpus):
        raise ValueError(f"{source} is a single-GPU plan with pipeline_groups={p}, attention_gpus="
                         f"{plan.attention_gpus}, expert_gpus={plan.expert_gpus}; a single plan runs everything "
                         f"on one GPU (p=1, expert_gpus=1, attention_gpus=0); {REPLAN}")
    if plan.expert_gpus % p:
        raise ValueError(f"{source} has expert_gpus={plan.expert_gpus}, not a multiple of pipeline_groups={p}: "
                         f"every group needs the same number of expert GPUs; {REPLAN}")
    per_group = plan.expert_gpus // p
    for j, owners in enumerate(plan.expert_map):
        group = (model_cfg.num_dense_layers + j) % p
        first = group * per_group
        for e, ranks in enumerate(owners):
            if not ranks or len(set(ranks)) != len(ranks) or not all(first <= r < first + per_group for r in ranks):
                raise ValueError(
                    f"{source}'s expert_map puts expert {e} of MoE layer {j} on {ranks or 'no rank'}, but that "
                    f"layer's experts must each go to one or more distinct expert ranks of its pipeline group "
                    f"{group}: ranks {first}..{first + per_group - 1}")
        idle = sorted(set(range(first, first + per_group)) - {r for ranks in owners for r in ranks})
        if idle:
            raise ValueError(f"{source}'s expert_map gives expert ranks {idle} no expert of MoE layer {j}; every "
                             f"expert rank of pipeline group {group} needs at least one; {REPLAN}")


def plan_placement(plan: Plan, model_cfg: ModelConfig) -> dict[int, ExpertOwners]:
    """MoE layer -> per expert, its owners as indices into the layer's group of expert ranks.
    Expects a plan `check_plan` accepted."""
    p = plan.pipeline_groups
    per_group = plan.expert_gpus // p
    placement = {}
    for j, owners in enumerate(plan.expert_map):
        layer = model_cfg.num_dense_layers + j
        first = (layer % p) * per_group
        placement[layer] = tuple(tuple(r - first for r in ranks) for ranks in owners)
    return placement


@lru_cache(maxsize=4096)
def held_ids(owners: ExpertOwners, ranks: int) -> tuple[ExpertIds, ...]:
    """Per expert rank of the group: the ids of every expert it holds (replicas included)."""
    return tuple(tuple(e for e, who in enumerate(owners) if i in who) for i in range(ranks))


def replica_shares(rows: int, replicas: int) -> list[int]:
    """`rows` split as evenly as possible over `replicas` (earlier ones one more)."""
    base, extra = divmod(rows, replicas)
    return [base + (r < extra) for r in range(replicas)]


def fed_replicas(replicas: int, dp_index: int, dp: int) -> list[int]:
    """The replicas (owner order) of an expert with `replicas` owners that the attention rank of
    data-parallel index `dp_index` (of `dp`) sends its rows of it to: replica d mod n when
    dp >= n, else d, d + dp, ... (module docstring)."""
    k = min(replicas, dp)
    return [r for r in range(replicas) if r % k == dp_index % k]


def replica_rows(rows: int, replicas: int, dp_index: int, dp: int) -> list[int]:
    """Per owner of an expert with `replicas` owners (owner order): how many of its `rows` the
    attention rank of data-parallel index `dp_index` (of `dp`) sends there (module docstring)."""
    mine = fed_replicas(replicas, dp_index, dp)
    sizes = [0] * replicas
    for r, n in zip(mine, replica_shares(rows, len(mine)), strict=True):
        sizes[r] = n
    return sizes


def partition_owners(per_rank: tuple[ExpertIds, ...], num_experts: int) -> ExpertOwners:
    """The owners of a placement without replicas, given as each rank's ids."""
    owner = {e: i for i, ids in enumerate(per_rank) for e in ids}
    return tuple((owner[e],) for e in range(num_experts))
