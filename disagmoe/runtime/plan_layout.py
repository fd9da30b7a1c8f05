"""A `disagmoe plan` result applied to a training run: its layout and its expert placement.

`apply_plan(cfg, model_cfg)` returns the run's config with the plan's layout: `mode` = the plan's
layout, `attention_ranks` / `expert_ranks` (colocated: `colocated_ranks`) = its GPU counts,
`pipeline_groups` and `micro_batches`. The plan wins over these fields of the config: the config
file is the base a plan is applied to (`replaced_fields` says what changed, for the CLI to show).
Everything else (batch_size, seq_len, data, optimizer, transport) stays the config's.

`plan_placement(plan, model_cfg)` turns the plan's `expert_map` (per MoE layer j, per expert: the
expert-pool ranks holding it; MoE layer j is layer num_dense_layers + j, of pipeline group
layer mod p, whose expert GPUs are pool ranks g*n .. (g+1)*n - 1 with n = expert_gpus / p) into
MoE layer -> for each expert rank of the layer's group, its ascending expert ids.

A plan the runtime cannot run is refused with a ValueError before any actor starts: a plan for
another model, an infeasible plan, replicated experts (not supported yet), a colocated plan with
pipeline groups, a map that is not a partition of each layer's experts over its group's ranks.
"""

from __future__ import annotations

from pathlib import Path

from disagmoe.config import ModelConfig, Plan, TrainConfig, read_mapping, validate

ExpertIds = tuple[int, ...]  # one rank's experts of one layer, ascending
LAYOUT_FIELDS = ("mode", "attention_ranks", "expert_ranks", "pipeline_groups", "micro_batches", "colocated_ranks")
REPLAN = "run `disagmoe plan` for this model again and pass its --out file"


def load_plan(ref: str | Plan) -> Plan:
    """A plan file written by `disagmoe plan --out` (.yaml or .json), or a Plan as is."""
    if isinstance(ref, Plan):
        return ref
    return validate(Plan, read_mapping(Path(ref)), ref)


def apply_plan(cfg: TrainConfig, model_cfg: ModelConfig) -> TrainConfig:
    """`cfg` with its plan's layout (module docstring); `cfg` itself when it names no plan.
    The plan travels inline in the result, so the workers never read the file."""
    if cfg.plan is None:
        return cfg
    plan = load_plan(cfg.plan)
    check_plan(plan, model_cfg, cfg.plan if isinstance(cfg.plan, str) else "the plan")
    if plan.layout == "colocated":
        layout = {"mode": "colocated", "colocated_ranks": plan.expert_gpus, "micro_batches": plan.micro_batches}
    else:
        layout = {"mode": "disaggregated", "attention_ranks": plan.attention_gpus, "expert_ranks": plan.expert_gpus,
                  "pipeline_groups": plan.pipeline_groups, "micro_batches": plan.micro_batches}
    return cfg.model_copy(update={**layout, "plan": plan})


def replaced_fields(before: TrainConfig, after: TrainConfig) -> dict[str, tuple[object, object]]:
    """Layout field -> (the config's value, the plan's) for every field the plan changed."""
    return {name: (getattr(before, name), getattr(after, name))
            for name in LAYOUT_FIELDS if getattr(before, name) != getattr(after, name)}


def check_plan(plan: Plan, model_cfg: ModelConfig, source: str) -> None:
    """ValueError, with the fix, for a plan this run cannot use (module docstring)."""
    if plan.model != model_cfg.name:
        raise ValueError(f"{source} places model {plan.model!r} but this run trains {model_cfg.name!r}; {REPLAN}")
    if not plan.feasible:
        raise ValueError(f"{source} is infeasible ({plan.reason}); plan for more GPUs or a smaller batch")
    moe_layers, experts = model_cfg.num_moe_layers, model_cfg.num_experts
    if len(plan.expert_map) != moe_layers or any(len(owners) != experts for owners in plan.expert_map):
        shape = f"{len(plan.expert_map)} MoE layers x {[len(o) for o in plan.expert_map]} experts"
        raise ValueError(f"{source}'s expert_map is {shape} but {model_cfg.name!r} has {moe_layers} MoE layers "
                         f"x {experts} experts; {REPLAN}")
    p = plan.pipeline_groups
    if plan.layout == "colocated" and p > 1:
        raise ValueError(f"{source} is colocated with pipeline_groups={p}; the colocated runtime runs one "
                         "pipeline group: plan with --max-pipeline-groups 1")
    if plan.expert_gpus % p:
        raise ValueError(f"{source} has expert_gpus={plan.expert_gpus}, not a multiple of pipeline_groups={p}: "
                         f"every group needs the same number of expert GPUs; {REPLAN}")
    for j, owners in enumerate(plan.expert_map):
        for e, ranks in enumerate(owners):
            if len(ranks) > 1:
                raise ValueError(
                    f"{source} replicates expert {e} of MoE layer {j} on expert ranks {ranks}; the runtime "
                    "does not run replicated experts yet: plan without --max-expert-replicas, or with fewer "
                    f"GPUs (at most {experts} expert GPUs per pipeline group)")
    per_group = plan.expert_gpus // p
    for j, owners in enumerate(plan.expert_map):
        group = (model_cfg.num_dense_layers + j) % p
        first = group * per_group
        for e, ranks in enumerate(owners):
            if not ranks or not first <= ranks[0] < first + per_group:
                raise ValueError(
                    f"{source}'s expert_map puts expert {e} of MoE layer {j} on {ranks or 'no rank'}, but that "
                    f"layer's experts must each go to one expert rank of its pipeline group {group}: "
                    f"ranks {first}..{first + per_group - 1}")
        idle = sorted(set(range(first, first + per_group)) - {ranks[0] for ranks in owners})
        if idle:
            raise ValueError(f"{source}'s expert_map gives expert ranks {idle} no expert of MoE layer {j}; every "
                             f"expert rank of pipeline group {group} needs at least one; {REPLAN}")


def plan_placement(plan: Plan, model_cfg: ModelConfig) -> dict[int, tuple[ExpertIds, ...]]:
    """MoE layer -> per expert rank of its group (in group order), the ascending ids it holds.
    Expects a plan `check_plan` accepted."""
    p = plan.pipeline_groups
    per_group = plan.expert_gpus // p
    placement = {}
    for j, owners in enumerate(plan.expert_map):
        layer = model_cfg.num_dense_layers + j
        first = (layer % p) * per_group
        placement[layer] = tuple(tuple(e for e, ranks in enumerate(owners) if ranks[0] == first + i)
                                 for i in range(per_group))
    return placement
