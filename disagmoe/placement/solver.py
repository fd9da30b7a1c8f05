"""Search the placement space and return the best `Plan`.

The space: pipeline groups p; per group, R expert replica sets of s expert GPUs each (s up to
the number of experts, R from 1, 2, 3, 4, 6, 8, ...), the rest of the group's GPUs attention
GPUs; micro-batches m; sequences per attention GPU per micro-batch. Every candidate is priced at once by
`cost.evaluate` (numpy arrays), so a 1,152-GPU search takes well under a second. The colocated
expert-parallel layout is priced on the same cluster; whichever is faster becomes the plan, and
the other's time is reported beside it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from disagmoe.config import MemoryEstimate, Plan, PlanConfig, StageTime
from disagmoe.placement.cost import (
    BYTES_PER_PARAM,
    GIB,
    GRAD_BYTES,
    OPTIMIZER_BYTES,
    WEIGHT_BYTES,
    Candidates,
    Cost,
    Problem,
    colocated_ep,
    evaluate,
    sharded_state_bytes,
)
from disagmoe.placement.experts import imbalance, map_layer
from disagmoe.roofline import report
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.flops import step_flops
from disagmoe.roofline.params import count_params, params_text

MAX_SEQS_PER_GPU = 64


def problem_of(cfg: PlanConfig, gpus: int | None = None) -> Problem:
    hw = cfg.cluster.hardware
    peak = 1.0
    if cfg.load_histogram:
        peak = max((max(row) * len(row) / sum(row) for row in cfg.load_histogram if sum(row) > 0), default=1.0)
    return Problem(
        model=cfg.model, ceilings=Ceilings.of(hw), gpus=gpus or cfg.cluster.num_gpus,
        nvlink_domain=hw.nvlink_domain, seq_len=cfg.seq_len,
        global_batch_tokens=cfg.global_batch_tokens,
        capacity_bytes=hw.hbm_gib * GIB * cfg.memory_headroom, load_peak_ratio=peak,
        replica_slots=1 if cfg.max_expert_replicas > 0 else 0,
        shard_optimizer=cfg.shard_optimizer_states,
    )


def _seq_choices() -> np.ndarray:
    return 2 ** np.arange(int(math.log2(MAX_SEQS_PER_GPU)) + 1)


def _smooth_numbers(limit: int) -> list[int]:
    """1, 2, 3, 4, 6, 8, 9, 12, ... (2^a 3^b) up to `limit`: the replica-set counts tried."""
    out = sorted({2**a * 3**b for a in range(21) for b in range(14) if 2**a * 3**b <= limit})
    return out


def disaggregated_candidates(cfg: PlanConfig, gpus: int) -> Candidates:
    """Every (p, replica sets R, expert GPUs per set s, m, seqs) with the rest as attention GPUs.

    Per pipeline group of gpus // p GPUs: R sets of s expert GPUs (s up to the expert count),
    and at least one attention GPU per set.
    """
    n = cfg.model.num_experts
    triples = []  # (p, sets, gpus per set)
    for p in range(1, min(cfg.max_pipeline_groups, cfg.model.num_layers) + 1):
        per_group = gpus // p
        for per_set in range(1, min(n, per_group - 1) + 1):
            for sets in _smooth_numbers(per_group // (per_set + 1)):
                triples.append((p, sets, per_set))
    if not triples:
        return _as_candidates(np.zeros((0, 6), dtype=np.int64), colocated=False)
    t = np.array(triples, dtype=np.int64)
    p, sets, per_set = t[:, 0], t[:, 1], t[:, 2]
    per_group = gpus // p
    attn_pg = per_group - sets * per_set
    return _with_batching(cfg, np.stack([attn_pg * p, sets * per_set * p, p, sets], 1), attn_pg,
                          colocated=False)


def colocated_candidates(cfg: PlanConfig, gpus: int) -> Candidates:
    """Expert parallel within each pipeline group of gpus // p GPUs (Megatron's EP x PP x DP)."""
    p = np.arange(1, min(cfg.max_pipeline_groups, cfg.model.num_layers, gpus) + 1, dtype=np.int64)
    per_group = gpus // p
    return _with_batching(cfg, np.stack([0 * p, per_group * p, p, 0 * p + 1], 1), per_group,
                          colocated=True)


def _with_batching(cfg: PlanConfig, layout: np.ndarray, dp: np.ndarray, colocated: bool) -> Candidates:
    """Cross each layout (attn, expert, p, sets) with every (m, seqs) whose round fits the batch."""
    mb = np.array(cfg.micro_batch_choices, dtype=np.int64)
    seqs = _seq_choices()
    grid_m, grid_s = np.meshgrid(mb, seqs, indexing="ij")
    grid_m, grid_s = grid_m.ravel(), grid_s.ravel()
    rows = np.repeat(layout, len(grid_m), axis=0)
    dp_r = np.repeat(dp, len(grid_m))
    m_r, s_r = np.tile(grid_m, len(layout)), np.tile(grid_s, len(layout))
    keep = m_r * dp_r * s_r * cfg.seq_len <= cfg.global_batch_tokens
    full = np.concatenate([rows[:, :3], m_r[:, None], s_r[:, None], rows[:, 3:4]], 1)[keep]
    return _as_candidates(full, colocated)


def _as_candidates(arr: np.ndarray, colocated: bool) -> Candidates:
    arr = np.asarray(arr, dtype=np.int64).reshape(-1, 6)
    return Candidates(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4], arr[:, 5], colocated)


def best_index(cost: Cost, c: Candidates) -> int | None:
    """Fastest candidate that fits. Ties go to the higher MFU (more of the batch's tokens done in
    the same time when rounds do not divide it evenly), then fewer pipeline groups, micro-batches."""
    if not cost.fits.any():
        return None
    step = np.where(cost.fits, cost.step_s, np.inf)
    tokens_done = cost.rounds * cost.tokens_per_round
    order = np.lexsort((c.seqs, c.m, c.p, -tokens_done, np.round(step / step[np.isfinite(step)].min(), 9)))
    return int(order[0])


def fewest_gpus(cfg: PlanConfig) -> int | None:
    """Smallest GPU count on which some layout fits in memory (None beyond 2^20 GPUs)."""
    def fits(g: int) -> bool:
        prob = problem_of(cfg, g)
        for cands in (disaggregated_candidates(cfg, g), colocated_candidates(cfg, g)):
            if len(cands) and evaluate(prob, cands).fits.any():
                return True
        return False

    lo, hi = cfg.cluster.num_gpus, cfg.cluster.num_gpus * 2
    while not fits(hi):
        lo, hi = hi, hi * 2
        if hi > 2**20:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


@dataclass
class Choice:
    """A priced layout: the plan, and the candidate and cost behind it (for reports)."""

    plan: Plan
    candidate: Candidates | None
    cost: Cost | None
    problem: Problem


def solve(cfg: PlanConfig) -> Plan:
    """The best plan for `cfg`, or an infeasible plan that says why and what would fit."""
    return choose(cfg).plan


def choose(cfg: PlanConfig) -> Choice:
    """Search both layouts; return the faster one that fits (ties go to disaggregated)."""
    gpus = cfg.cluster.num_gpus
    prob = problem_of(cfg)
    best: dict[bool, tuple[float, Candidates | None]] = {}
    for colocated in (False, True):
        cands = colocated_candidates(cfg, gpus) if colocated else disaggregated_candidates(cfg, gpus)
        cost = evaluate(prob, cands) if len(cands) else None
        i = best_index(cost, cands) if cost is not None else None
        best[colocated] = (float(cost.step_s[i]), cands.take(i)) if i is not None else (math.inf, None)
    (dis_time, dis), (col_time, col) = best[False], best[True]
    if dis is None and col is None:
        return Choice(_infeasible(cfg, prob), None, None, prob)
    chosen = dis if dis_time <= col_time else col
    return price(cfg, chosen, col_time, dis_time)


def price(cfg: PlanConfig, chosen: Candidates, colocated_step_s: float | None = None,
          disaggregated_step_s: float | None = None) -> Choice:
    """Build the `Plan` of one layout (feasible or not: `plan.feasible` says).

    `colocated_step_s` / `disaggregated_step_s`: the best layout of that kind's step time, inf
    when none fits, None when it was not priced (a layout fixed by the caller). The plan's
    `colocated_step_time_s` and `speedup_vs_colocated` are None unless a colocated layout was
    priced and fits."""
    gpus, model, prob = cfg.cluster.num_gpus, cfg.model, problem_of(cfg)
    use_dis = not chosen.colocated
    cost = evaluate(prob, chosen)
    expert_map, real_imb = _expert_map(cfg, chosen) if use_dis else _colocated_map(cfg, chosen)
    notes: list[str] = []
    single = not use_dis and int(chosen.expert[0]) == 1
    if colocated_step_s == math.inf and use_dis:
        notes.append("the colocated baseline does not fit in memory on this cluster")
    col = math.inf if colocated_step_s is None or single else colocated_step_s
    p, m, seqs = int(chosen.p[0]), int(chosen.m[0]), int(chosen.seqs[0])
    attn, exp = int(chosen.attn[0]), int(chosen.expert[0])
    idle = gpus - attn - exp
    if idle:
        notes.append(f"{idle} GPU(s) left idle: the GPU count is not a multiple of p={p}")
    dp = int(cost.dp[0])
    tokens_per_round = int(cost.tokens_per_round[0])
    rounds = int(cost.rounds[0])
    if rounds * tokens_per_round != cfg.global_batch_tokens:
        notes.append(f"the batch is {rounds} rounds of {tokens_per_round} tokens = "
                     f"{rounds * tokens_per_round} tokens (asked {cfg.global_batch_tokens})")
    fits = bool(cost.fits[0])
    if not fits:
        notes.append("this layout does not fit in memory (see memory_per_gpu)")
    notes.append("memory assumes AdamW with fp32 master weights and moments, "
                 + ("the attention side's moments split over each data-parallel group (ZeRO-1)"
                    if cfg.shard_optimizer_states else "on every replica (no optimizer sharding)")
                 + ", and no activation recomputation")
    step = float(cost.step_s[0])
    counts = count_params(model)
    mfu = step_flops(model, rounds * tokens_per_round, cfg.seq_len) / (
        step * gpus * cfg.cluster.hardware.bf16_tflops * 1e12)
    stage_times = _stage_times(cost, prob, chosen)
    plan = Plan(
        model=model.name, hardware=cfg.cluster.hardware.name, gpus=gpus, seq_len=cfg.seq_len,
        global_batch_tokens=cfg.global_batch_tokens,
        layout="disaggregated" if use_dis else "single" if single else "colocated",
        attention_gpus=attn, expert_gpus=exp, pipeline_groups=p, micro_batches=m,
        expert_replica_sets=int(chosen.sets[0]) if use_dis else exp // p // int(colocated_ep(model.num_experts, exp // p)),
        sequences_per_micro_batch=seqs * dp, accumulation_rounds=rounds,
        expert_map=expert_map, total_params=counts.total, active_params=counts.active,
        memory_per_gpu=_memory(cost, prob, use_dis, "single" if single else "colocated"), stage_times=stage_times,
        step_time_s=step, colocated_step_time_s=col if math.isfinite(col) else None,
        speedup_vs_colocated=col / step if math.isfinite(col) else None,
        expert_imbalance=real_imb, mfu=mfu, feasible=fits,
        reason=_reason(stage_times, chosen, use_dis, step, fits, colocated_step_s, disaggregated_step_s, single),
        notes=notes,
    )
    return Choice(plan, chosen, cost, prob)


def _colocated_map(cfg: PlanConfig, c: Candidates) -> tuple[list[list[list[int]]], float]:
    """Colocated: within group g, EP blocks of `ep` GPUs; expert e lives on GPU e // (E/ep) of each."""
    model = cfg.model
    p = int(c.p[0])
    per_group = int(c.expert[0]) // p
    ep = int(colocated_ep(model.num_experts, per_group))
    per_gpu = model.num_experts // ep
    out = []
    for j in range(model.num_moe_layers):
        g = (model.num_dense_layers + j) % p
        out.append([[g * per_group + b * ep + e // per_gpu for b in range(per_group // ep)]
                    for e in range(model.num_experts)])
    return out, 1.0


def _expert_map(cfg: PlanConfig, c: Candidates) -> tuple[list[list[list[int]]], float]:
    """Per MoE layer: expert -> expert-pool ranks. Group g's expert GPUs are ranks g*e..(g+1)*e-1."""
    model = cfg.model
    p, sets = int(c.p[0]), int(c.sets[0])
    per_group = int(c.expert[0]) // p
    per_set = per_group // sets
    worst = 1.0
    out = []
    mapped: dict[tuple[float, ...], list[list[int]]] = {}  # layers with equal loads map alike
    for j in range(model.num_moe_layers):
        layer = model.num_dense_layers + j
        g = layer % p
        loads = tuple(cfg.load_histogram[j]) if cfg.load_histogram else (1.0,) * model.num_experts
        if loads not in mapped:
            mapped[loads] = map_layer(list(loads), per_set, cfg.max_expert_replicas)
            worst = max(worst, imbalance(list(loads), mapped[loads], per_set))
        out.append([[g * per_group + r * per_set + i for r in range(sets) for i in gpus_of]
                    for gpus_of in mapped[loads]])
    return out, worst


def _memory(cost: Cost, prob: Problem, disaggregated: bool, kind: str = "colocated") -> dict[str, MemoryEstimate]:
    """Per GPU kind (attention and expert, or `kind` for a layout where every GPU runs both)."""
    attn_state = float(sharded_state_bytes(float(cost.dp[0]), prob.shard_optimizer))

    def estimate(attn_params: float, exp_params: float, act: float) -> MemoryEstimate:
        params = attn_params + exp_params
        w, g = (params * b / GIB for b in (WEIGHT_BYTES, GRAD_BYTES))
        o = (attn_params * attn_state + exp_params * OPTIMIZER_BYTES) / GIB
        return MemoryEstimate(weights_gib=w, grads_gib=g, optimizer_gib=o, activations_gib=act / GIB,
                              total_gib=w + g + o + act / GIB, capacity_gib=prob.capacity_bytes / GIB)

    a_p, e_p = float(cost.attn_params[0]), float(cost.expert_params[0])
    a_act, e_act = float(cost.attn_act_bytes[0]), float(cost.expert_act_bytes[0])
    if not disaggregated:
        return {kind: estimate(a_p, e_p, a_act + e_act)}
    return {"attention": estimate(a_p, 0.0, a_act), "expert": estimate(0.0, e_p, e_act)}


def roofline_rows(cost: Cost, prob: Problem, c: Candidates) -> tuple[list[dict], list[dict]]:
    """Report rows (see `roofline.report.stage_row`) of one layout: per layer and micro-batch,
    and per step (each stage times how often it runs on the busiest GPU of its group)."""
    per_step = float(cost.rounds[0]) * int(c.m[0])
    layer_rows, step_rows = [], []
    for name, stage in cost.stages.items():
        repeat = stage.repeats(prob.model, int(c.p[0]), per_step)
        for tag, w in (("fwd", stage.fwd), ("bwd", stage.bwd)):
            label = "step" if stage.runs == "step" else tag
            row = report.stage_row(name, stage.group, label, w, prob.ceilings)
            if row["time_s"] == 0:
                continue
            if stage.runs != "step":
                layer_rows.append(row)
            step_rows.append(report.stage_row(name, stage.group, label, w, prob.ceilings, repeat=repeat))
    return layer_rows, step_rows


def _stage_times(cost: Cost, prob: Problem, c: Candidates) -> list[StageTime]:
    """Each stage's time for one step on the GPUs that run it, and its binding ceiling."""
    _, rows = roofline_rows(cost, prob, c)
    return [StageTime(name=f"{r['stage']} ({r['pass']})", time_s=r["time_s"], group=r["group"], bound=r["bound"])
            for r in rows]


def _versus(kind: str, other: float | None, step: float) -> str:
    """How this layout compares with the best layout of the other `kind` (step time or None/inf)."""
    if other is None:
        return f"a fixed layout (the {kind} was not priced)"
    if not math.isfinite(other):
        return f"the {kind} does not fit"
    if other >= step:
        return f"{other / step:.2f}x faster than the {kind} ({other:.3g} s per step)"
    return f"{step / other:.2f}x slower than the {kind} ({other:.3g} s per step)"


def _reason(stage_times: list[StageTime], c: Candidates, disaggregated: bool, step: float, fits: bool,
            col: float | None, dis: float | None, single: bool = False) -> str:
    """One line: the layout, how it compares with the other kind, and the top stage of the table
    (once-per-step stages included). Claims only what was priced."""
    top = max(stage_times, key=lambda s: s.time_s)
    if single:
        layout = f"one GPU runs attention and every expert (m={int(c.m[0])})"
        vs = "no dispatch, combine or all-reduce"
    elif disaggregated:
        layout = (f"{int(c.attn[0])} attention + {int(c.expert[0])} expert GPUs, "
                  f"p={int(c.p[0])}, m={int(c.m[0])}, {int(c.sets[0])} expert replica set(s)")
        vs = _versus("colocated baseline", col, step)
    else:
        layout = f"colocated expert parallel on {int(c.expert[0])} GPUs (p={int(c.p[0])}, m={int(c.m[0])})"
        vs = _versus("best disaggregated split", dis, step)
    fit = "" if fits else "does not fit in memory: "
    return f"{fit}{layout}: {vs}; heaviest stage {top.name}, {top.bound}-bound"


LEANEST_DP = 4096  # data-parallel group size standing in for "as many attention GPUs as it takes" (ZeRO-1)


def _leanest(prob: Problem, p: int) -> tuple[float, float]:
    """GiB on the fullest attention and expert GPU of the leanest layout with `p` groups: one
    sequence, one expert per GPU and, with ZeRO-1, a data-parallel group large enough that the
    sharded moments all but vanish (a larger GPU count gets there)."""
    n = prob.model.num_experts
    dp = LEANEST_DP if prob.shard_optimizer else 1
    leanest = evaluate(prob, Candidates.one(p * dp, p * n, p, 1, 1))
    return float(leanest.attn_mem_bytes[0]) / GIB, float(leanest.expert_mem_bytes[0]) / GIB


def _blocker(cfg: PlanConfig, prob: Problem) -> str | None:
    """A limit no GPU count can lift: one sequence too big for an attention GPU, or one expert
    too big for an expert GPU (both need features we do not have yet). The text names optimizer
    sharding only as a remedy, and only when `--shard-optimizer-states` is off and would fit."""
    p = min(cfg.max_pipeline_groups, cfg.model.num_layers)
    cap = prob.capacity_bytes / GIB
    attn, exp = _leanest(prob, p)
    if attn > cap:
        if prob.shard_optimizer:
            also = "even with the attention side's AdamW moments sharded (ZeRO-1)"
            fix = ""
        else:
            also = "with unsharded AdamW state"
            sharded_attn, _ = _leanest(replace(prob, shard_optimizer=True), p)
            fix = ", or --shard-optimizer-states (ZeRO-1)" if sharded_attn <= cap else ""
        return (f"one attention GPU needs {attn:.0f} GiB (> {cap:.0f}) even for a single {cfg.seq_len}-token "
                f"sequence with p={p} pipeline groups, {also}: this needs tensor or context parallelism, "
                f"which disagmoe does not have yet; try a shorter --seq-len or a larger --max-pipeline-groups{fix}")
    if exp > cap:
        return (f"one expert GPU needs {exp:.0f} GiB (> {cap:.0f}) for a single expert of every MoE layer of its "
                f"group with p={p}: this needs expert tensor parallelism, which disagmoe does not have yet")
    return None


def _infeasible(cfg: PlanConfig, prob: Problem) -> Plan:
    blocker = _blocker(cfg, prob)
    need = None if blocker else fewest_gpus(cfg)
    counts = count_params(cfg.model)
    gpus = cfg.cluster.num_gpus
    costs = [evaluate(prob, c) for c in (disaggregated_candidates(cfg, gpus), colocated_candidates(cfg, gpus)) if len(c)]
    notes = [] if costs else [f"the global batch ({cfg.global_batch_tokens} tokens) is smaller than one sequence per GPU"]
    smallest = min((float(np.min(np.maximum(k.attn_mem_bytes, k.expert_mem_bytes))) for k in costs), default=0.0)
    state = ("the attention side's AdamW moments sharded over data parallel (ZeRO-1)" if cfg.shard_optimizer_states
             else "AdamW state unsharded (--shard-optimizer-states splits the attention side's moments)")
    why = (f"no layout fits in {prob.capacity_bytes / GIB:.0f} GiB per GPU on {cfg.cluster.num_gpus} GPUs "
           f"(the leanest needs {smallest / GIB:.0f} GiB on its fullest GPU; {params_text(counts.total)} parameters "
           f"at up to {BYTES_PER_PARAM} bytes each, {state})")
    why += f"; the fewest {cfg.cluster.hardware.name} GPUs that fit: {need}" if need else ""
    why += f"; {blocker}" if blocker else ""
    return Plan(
        model=cfg.model.name, hardware=cfg.cluster.hardware.name, gpus=cfg.cluster.num_gpus,
        seq_len=cfg.seq_len, global_batch_tokens=cfg.global_batch_tokens, layout=None,
        attention_gpus=0, expert_gpus=0, pipeline_groups=1, micro_batches=1,
        expert_replica_sets=0, sequences_per_micro_batch=0, accumulation_rounds=0, expert_map=[],
        total_params=counts.total, active_params=counts.active, memory_per_gpu={}, stage_times=[],
        step_time_s=None, colocated_step_time_s=None, speedup_vs_colocated=None, expert_imbalance=0.0,
        mfu=None, feasible=False, reason=why, notes=notes, min_gpus=need,
    )
