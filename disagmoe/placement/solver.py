"""Search the placement space and return the best `Plan`.

The space: pipeline groups p; per group, R expert replica sets of s expert GPUs each (s up to
the number of experts, R from 1, 2, 3, 4, 6, 8, ...) and dp attention GPUs, the rest of the
group's GPUs or fewer; micro-batches m; sequences per attention GPU per micro-batch. The
colocated expert-parallel layout: per group, dp GPUs in blocks of an EP degree dividing the
expert count. Both search every layout on at most the job's GPUs (`_data_parallel_degrees`
says why pricing a few dp per layout is enough), so a plan never gets slower with more GPUs; one
that leaves GPUs idle says so (`Plan.idle_gpus`). Candidates are priced at once by
`cost.evaluate` (numpy arrays), in two passes (`_pruning`), so a 1,152-GPU search takes well
under a second. The plan is the fastest layout, disaggregated or colocated in EP blocks, both run
by `train --plan` as priced; the best colocated layout is the baseline reported beside it.
With a calibrated hardware profile the chosen disaggregated layout's step time is then priced by
replaying its schedule (`placement.replay`), once, after the search.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import lru_cache

import numpy as np

from disagmoe.config import DEFAULT_FP8_EXPERT_BACKWARD, Calibration, MemoryEstimate, Plan, PlanConfig, StageTime
from disagmoe.placement.cost import (
    ATTENTION,
    GIB,
    Candidates,
    Cost,
    Problem,
    attention_state_bytes,
    colocated_ep,
    evaluate,
    expert_state_bytes,
    fp8_pricing,
    fp8_dense_pricing,
    offload_staging_bytes,
    other_fp8_dense_curve,
    paired_micro_batches,
)
from disagmoe.placement.experts import imbalance, map_layer
from disagmoe.placement.replay import replayed_step_s
from disagmoe.roofline import memory as mem, report
from disagmoe.roofline import stages as st
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.optimizer_state import host_link_bytes
from disagmoe.roofline.flops import step_flops
from disagmoe.roofline.params import count_params, dense_linears, params_text

MAX_SEQS_PER_GPU = 64


def _offload_note(cfg: PlanConfig, cost: Cost, dp: int, disaggregated: bool) -> str:
    """What the offloaded optimizer costs the chosen layout: host memory and host-link time per GPU."""
    zero1 = dp if cfg.shard_optimizer_states and dp > 1 else 1
    attn, exp = float(cost.attn_params[0]), float(cost.expert_params[0])
    per_gpu = ([attn * host_link_bytes(cfg.optimizer_state_dtype, "bf16", zero1),
                exp * host_link_bytes(cfg.optimizer_state_dtype, "bf16")] if disaggregated
               else [attn * host_link_bytes(cfg.optimizer_state_dtype, "bf16", zero1)
                     + exp * host_link_bytes(cfg.optimizer_state_dtype, "bf16")])
    most = max(per_gpu)
    gbps = cfg.cluster.hardware.host_link_gbps
    return (f"optimizer state offloaded (train with offload_optimizer: true): up to {most / 2**30:.1f} GiB of fp32 "
            f"masters and {cfg.optimizer_state_dtype} moments per GPU in host memory, copied in and out each step "
            f"over the host link ({gbps:g} GB/s per direction): at least {most / (gbps * 1e9) * 1e3:.1f} ms of "
            "optimizer step per GPU, overlapped with the update; two 256 MiB staging buckets on each GPU instead")


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
        shard_optimizer=cfg.shard_optimizer_states, optimizer_state_dtype=cfg.optimizer_state_dtype,
        optimizer_update_kernel=cfg.optimizer_update_kernel, clip_gradients=cfg.clip_gradients,
        offload_optimizer=cfg.offload_optimizer == "on", calibration=hw.calibration,
        host_capacity_bytes=math.inf if hw.host_memory_gib is None else hw.host_memory_gib * GIB,
        **_recompute_of(cfg), expert_precision=cfg.expert_precision,
        fp8_speedup=hw.fp8_tflops / hw.bf16_tflops if cfg.expert_precision == "fp8" else 1.0,
        fp8_dense=cfg.expert_precision == "fp8" and cfg.fp8_dense != "off",  # auto: `choose` / `price` try both
        fp8_dense_scaling=cfg.fp8_dense_scaling,
        fp8_backward=cfg.fp8_expert_backward,
        fp8_forward=cfg.fp8_expert_forward,
        first_touch=cfg.experts_backend == "triton",  # RoutedExperts.first_touch_weights
        experts_backend=cfg.experts_backend, cuda_graphs=cfg.cuda_graphs, fused_loss=cfg.fused_loss,
        # every recipe pairs, the all-FP8 backward its token-group copies (`kernels.wgrad_pairs`), counted as the
        # bf16 rows they replace, as the runtime's memory check counts them
        wgrad_pairs=cfg.expert_wgrad_pairs != "off" and cfg.experts_backend == "triton",
        # auto: on per candidate where its peak with the waiting rows fits, as the single trainer settles it
        wgrad_pairs_budget=hw.hbm_gib * GIB * mem.MEMORY_HEADROOM if cfg.expert_wgrad_pairs == "auto" else math.inf,
    )


def _fp8_backward_note(backward: str) -> str:
    """Which expert backward GEMMs a plan priced in FP8 (`Problem.fp8_backward`), for `fp8_note`."""
    return {"fp8": "; every backward GEMM in FP8 (fp8_expert_backward: fp8)",
            "bf16-wgrad": "; the weight gradients at the bf16 rate (fp8_expert_backward: bf16-wgrad, the default)",
            "bf16": "; the whole backward at the bf16 rate (fp8_expert_backward: bf16)"}[backward]


def _fp8_measured_backward_note(backward: str, measured: str) -> str:
    """How a plan priced the expert backward from an FP8 curve measured under `measured`
    (`Calibration.fp8_curve_backward`) for the run's `backward` (`cost.fp8_measured_backward`), for `fp8_note`."""
    if backward == "bf16":
        return _fp8_backward_note(backward)
    head = f"; the curve was measured under fp8_expert_backward {measured}"
    if backward == measured:
        default = ", the default" if backward == DEFAULT_FP8_EXPERT_BACKWARD else ""
        return (f"{head}, as this run trains: both backward stages at its whole-backward rate "
                f"(fp8_expert_backward: {backward}{default})")
    if backward == "bf16-wgrad":
        return (f"{head}: bf16-wgrad's data gradients priced at its whole-backward rate, the weight gradients at the "
                "bf16 rate (fp8_expert_backward: bf16-wgrad, the default)")
    return (f"{head}: fp8's weight gradients priced at its whole-backward rate too, plus the token-group quantisers "
            "it did not run by their HBM bytes (optimistic: the FP8 weight-gradient kernel unmeasured; "
            "fp8_expert_backward: fp8)")


def _fp8_forward_note(forward: str, measured: str = "both") -> str:
    """Which expert forward GEMMs a plan priced in FP8 (`Problem.fp8_forward`), for `fp8_note`; `measured`:
    the forward a measured FP8 curve ran (`Calibration.fp8_curve_forward`; "both": the FP8 GEMMs' own rate)."""
    if forward == measured != "both":
        other = "down" if forward == "gate-up" else "gate/up"
        return f"; the forward as the curve measured it (fp8_expert_forward: {forward}, its {other} GEMM bf16)"
    recovered = "" if measured == "both" else (f", the FP8 GEMMs' rate recovered from the curve's {measured}-only "
                                               "forward")
    if forward == "both":
        return recovered and f"; both forward GEMMs in FP8{recovered}"
    other = "down" if forward == "gate-up" else "gate/up"
    return f"; the forward's {other} GEMM at the bf16 rate (fp8_expert_forward: {forward}){recovered}"


def _fp8_copies_note(forward: str, backward: str) -> str:
    """The routed experts' e4m3 weight copies a plan priced (`roofline.memory.fp8_weight_copy_shares`
    of its recipe), for `fp8_note`: 'two e4m3 weight copies per expert parameter each step' where
    it reads all four (backward fp8 or bf16-wgrad under forward both), else the bytes."""
    held = mem.fp8_weight_copy_shares(forward, backward)[1]
    if held == 2:
        return "two e4m3 weight copies per expert parameter each step"
    return (f"the e4m3 weight copies the recipe reads, {held:.2g} {'byte' if held <= 1 else 'bytes'} per expert "
            "parameter, made each step")


def _fp8_dense_loses_note(prob: Problem, chosen, cost: Cost) -> list[str]:
    """Where the dense projections' FP8 was priced from a measured curve (`cost.fp8_dense_speedups`)
    and makes this layout's step slower than the same layout with them in bf16: one note with the
    difference and the fix (fp8_dense: false); else none."""
    if not (prob.fp8_dense and fp8_dense_pricing(prob.calibration, prob.fp8_dense_scaling) == "measured"):
        return []
    bf16 = evaluate(replace(_fixed_recompute(prob, cost.dropped(0)), fp8_dense=False), chosen)
    step, without = float(cost.step_s[0]), float(bf16.step_s[0])
    if not without < step:
        return []
    return [f"the dense projections in FP8 make this step {(step - without) * 1e3:.1f} ms slower than in bf16 "
            f"(the closed-form step, {step * 1e3:.1f} against {without * 1e3:.1f} ms: the measured FP8 projection "
            "curve, its quantisers inside, under the bf16 one at these tokens per micro-batch): train with "
            "fp8_dense: false"]


RECOMPUTE_ORDER = ("expert_input", "expert_output", "expert_swiglu", "attention")  # TrainConfig.recompute_modules'


def fp8_note(prob: Problem, cost: Cost) -> str:
    """What a plan with FP8 experts was priced with (`cost.fp8_stages`): the FP8 expert curve the
    hardware's calibration measured (its source, and the rates it gave this layout's expert
    stages, and the backward recipe it was measured under against the run's), or plainly the
    datasheet ratio, unmeasured; the dense projections, where FP8 too, in their recipe
    (`Problem.fp8_dense_scaling`), from the measured FP8 projection curve where the calibration
    holds one of that recipe (`cost.fp8_dense_speedups`), else at the datasheet ratio, saying why
    (`_fp8_dense_unmeasured`: no curve, or the other recipe's)."""
    calib = prob.calibration
    copies = _fp8_copies_note(prob.fp8_forward, prob.fp8_backward)
    if fp8_pricing(calib) == "measured":
        experts, peak = cost.stages["routed experts"], prob.ceilings.peak_flops_per_s
        rate = lambda bwd: experts.ceilings(bwd, prob.ceilings).first().flops_per_s / peak  # noqa: E731
        head = (f"routed experts priced in FP8 (train with precision: fp8) from the measured FP8 expert curve "
                f"(calibration.expert_gemm_fp8, {calib.source or 'no source recorded'}, probe version "
                f"{calib.probe_version}): at this layout's rows per expert {rate(False):.2f} of the bf16 peak forward, "
                f"{rate(True):.2f} backward (data and weight gradients with their quantisers, measured whole)"
                f"{_fp8_measured_backward_note(prob.fp8_backward, calib.fp8_curve_backward)}"
                f"{_fp8_forward_note(prob.fp8_forward, calib.fp8_curve_forward)}, plus {copies}")
    else:
        head = (f"routed experts priced in FP8 (train with precision: fp8) at the datasheet ratio, unmeasured: their "
                f"GEMMs at {prob.fp8_speedup:.2f}x the bf16 rate (fp8_tflops / bf16_tflops; the hardware's calibration "
                "holds no FP8 expert curve, which `disagmoe bench calibrate --experts-backend triton` measures on an "
                "sm_89+ GPU: on an H200 our FP8 experts measured about the bf16 rate, not this), plus the quantisation "
                f"passes' HBM traffic{_fp8_backward_note(prob.fp8_backward)}{_fp8_forward_note(prob.fp8_forward)} and "
                f"{copies}")
    dense = ""
    scaling = prob.fp8_dense_scaling
    recipe = (f"the dense projections (attention, shared experts, dense FFN layers) in FP8 too, scaled {scaling} "
              f"(fp8_dense_scaling: {scaling}; torch._scaled_mm){_fp8_dense_kept_bf16(prob)}")
    if prob.fp8_dense and fp8_dense_pricing(calib, scaling) == "measured":
        dense = (f"; {recipe}, from the measured FP8 projection curve over the bf16 one (calibration.projections_fp8, "
                 f"measured {scaling}, probe version {calib.probe_version}): their rate at this layout's tokens per "
                 "micro-batch, quantisers inside (below the bf16 rate where the quantisers cost more than the FP8 "
                 "GEMMs save; measured at the attention projections, so pessimistic for wider shared-expert and "
                 "dense FFN GEMMs), their weight gradients bf16")
    elif prob.fp8_dense:
        dense = (f"; {recipe}, with their quantisation passes, at the datasheet ratio {prob.fp8_speedup:.2f}x "
                 f"({_fp8_dense_unmeasured(calib, scaling)}) in the forward and data gradient, their weight "
                 "gradients bf16")
    return (head + "; their selective recomputation drops expert_input and expert_swiglu only (no fused FP8 "
            "combine for expert_output)" + dense)


def _fp8_dense_unmeasured(calib: Calibration | None, scaling: str) -> str:
    """Why a plan priced the dense projections' FP8 of recipe `scaling` at the datasheet ratio
    (`cost.fp8_dense_pricing`), for `fp8_note`: the calibration's FP8 projection curve is of the
    other recipe (`cost.other_fp8_dense_curve`: left out, and how to price with it or re-measure), or
    there is none."""
    other = other_fp8_dense_curve(calib, scaling)
    measures = ("`bench calibrate` measures them on an sm_89+ GPU, from probe version 8 under blockwise on a Hopper "
                "GPU and rowwise elsewhere")
    if other is None:
        return f"unmeasured: {measures}"
    return (f"unmeasured for {scaling}: the calibration's FP8 projection curve, calibration.projections_fp8 of probe "
            f"version {calib.probe_version}, measured the {other} recipe, another's GEMMs and quantisers, and is left "
            f"out; fp8_dense_scaling: {other} prices with it; {measures}")


def _fp8_dense_kept_bf16(prob: Problem) -> str:
    """The dense linears the plan's recipe keeps in bf16 (blockwise: off its 512 grid,
    `stages.dense_fp8_linears`), priced at the bf16 rate, for `fp8_note`; '' where there are none."""
    m = prob.model
    parts = ["attention"] + (["shared experts"] if m.shared_ffn_size else []) + (
        ["dense ffn"] if m.num_dense_layers else [])
    kept = [f"{part}'s {lin.name}" for part in parts for lin in dense_linears(m, part)
            if lin not in st.dense_fp8_linears(m, part, prob.fp8_dense_scaling)]
    if not kept:
        return ""
    return (f", but {', '.join(kept)}, off the recipe's {st.BLOCKWISE_MULTIPLE} grid, at the bf16 rate (the run keeps "
            f"{'them' if len(kept) > 1 else 'it'} in bf16)")


def _recompute_of(cfg: PlanConfig) -> dict:
    """`Problem.recompute` and `recompute_modules` of `cfg`: the modules asked (selective: the three
    expert modules unless `recompute_modules` names others; auto: those and attention), less the
    expert modules where the run's experts cannot drop them (they need experts_backend: triton;
    the FP8 experts drop expert_input and expert_swiglu, not expert_output: train refuses it with
    precision: fp8, there being no fused FP8 combine); full: the whole block (`memory.FULL`, any
    experts backend)."""
    if cfg.recompute == "none":
        return {"recompute": "none"}
    if cfg.recompute == "full":
        return {"recompute": "full", "recompute_modules": mem.FULL}
    asked = (frozenset(cfg.recompute_modules) if cfg.recompute_modules is not None else
             mem.SELECTIVE if cfg.recompute == "selective" else mem.SELECTIVE | ATTENTION)
    if cfg.experts_backend != "triton":
        asked = asked - mem.SELECTIVE
    elif cfg.expert_precision == "fp8":
        asked = asked - {"expert_output"}
    return {"recompute": cfg.recompute, "recompute_modules": asked} if asked else {"recompute": "none"}


def _fixed_recompute(prob: Problem, dropped: frozenset[str]) -> Problem:
    """`prob` priced with exactly `dropped` recomputed on every candidate (none when empty)."""
    return replace(prob, recompute=_recompute_name(dropped), recompute_modules=dropped)


def _recompute_name(dropped: frozenset[str]) -> str:
    """`recompute` of what a plan drops: full (the whole block), selective (modules) or none."""
    return "full" if mem.BLOCK in dropped else "selective" if dropped else "none"


def _seq_choices() -> np.ndarray:
    return 2 ** np.arange(int(math.log2(MAX_SEQS_PER_GPU)) + 1)


@lru_cache(maxsize=None)
def _smooth_numbers(limit: int) -> tuple[int, ...]:
    """1, 2, 3, 4, 6, 8, 9, 12, ... (2^a 3^b) up to `limit`: the replica-set counts tried."""
    return tuple(sorted({2**a * 3**b for a in range(21) for b in range(14) if 2**a * 3**b <= limit}))


Least = Callable[[np.ndarray, int, int], np.ndarray]  # (layout code per row, m, seqs) -> smallest dp worth pricing
CODE = 1 << 20  # layout codes: (p * CODE + sets) * CODE + expert GPUs per set (colocated: sets = 0, ep)


def layout_code(c: Candidates, num_experts: int) -> np.ndarray:
    """The layout row a candidate belongs to, whatever its dp: (p, sets, expert GPUs per set),
    colocated (p, 0, EP degree)."""
    if c.colocated:
        ep = colocated_ep(num_experts, c.expert // (c.p * c.sets))
        return c.p * CODE * CODE + ep
    return (c.p * CODE + c.sets) * CODE + c.expert // (c.p * c.sets)


def disaggregated_candidates(cfg: PlanConfig, gpus: int, least: Least | None = None) -> Candidates:
    """Every (p, replica sets R, expert GPUs per set s, m, seqs, dp) on at most `gpus` GPUs.

    Per pipeline group of at most gpus // p GPUs: R sets of s expert GPUs (s up to the expert
    count) and dp attention GPUs, at least one per set: all the group's other GPUs, or fewer
    (`_data_parallel_degrees`), so that every layout on fewer GPUs is searched too.
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
    code = (p * CODE + sets) * CODE + per_set
    row, m, seqs, dp = _data_parallel_degrees(cfg, code, sets, gpus // p - sets * per_set, np.ones_like(p), least)
    p, sets, per_set = p[row], sets[row], per_set[row]
    return _as_candidates(np.stack([dp * p, sets * per_set * p, p, m, seqs, sets], 1), colocated=False)


def colocated_candidates(cfg: PlanConfig, gpus: int, least: Least | None = None) -> Candidates:
    """Expert parallel within each pipeline group (Megatron's EP x PP x DP): per group of at
    most gpus // p GPUs, dp GPUs in blocks of ep (ep dividing the expert count, each block
    holding every expert once), dp all the group's GPUs that whole blocks fill, or fewer. The
    runtime runs each as priced: each GPU dispatches within its block
    (`runtime.topology.Topology.served`), and under a router's auxiliary loss the blocks swap their
    loads (`Topology.load_peers`), whose receive slots the arena counts (`cost.transport_buffers`)."""
    pairs = [(p, ep) for p in range(1, min(cfg.max_pipeline_groups, cfg.model.num_layers, gpus) + 1)
             for ep in _divisors(cfg.model.num_experts) if ep <= gpus // p]
    p, ep = (np.array(v, dtype=np.int64) for v in zip(*pairs, strict=True))
    most = ep * (gpus // p // ep)
    row, m, seqs, dp = _data_parallel_degrees(cfg, p * CODE * CODE + ep, ep, most, ep, least)
    p, ep = p[row], ep[row]
    return _as_candidates(np.stack([0 * p, dp * p, p, m, seqs, dp // ep], 1), colocated=True)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _data_parallel_degrees(cfg: PlanConfig, code: np.ndarray, lo: np.ndarray, hi: np.ndarray, step: np.ndarray,
                           least: Least | None):
    """(row, m, seqs, dp): for each layout row (`code`, see `layout_code`) and each (m, seqs) whose
    round fits the batch, the data-parallel degrees dp (multiples of `step`, lo <= dp <= hi)
    worth pricing; `least` (None: only lo and hi) lifts the lower end where smaller dp cannot win.

    Those are hi (the whole group) and, below it, the smallest dp of each round count
    r = ceil(batch / (m * dp * seqs * seq_len)). Contract (why this loses nothing): with the
    layout, m and seqs fixed, every stage time, the expert memory and hence the step time grow
    with dp while r stays put, so any dp is matched or beaten by the smallest dp of its r.
    Pricing those makes the search cover every layout on fewer GPUs, and a plan on more GPUs is
    never slower than one on fewer. (ZeRO-1 attention memory shrinks with dp; there a smaller
    dp of the same r may not fit where a larger one would.)"""
    out = []
    batch = cfg.global_batch_tokens
    for m in cfg.micro_batch_choices:
        for seqs in _seq_choices().tolist():
            unit = m * seqs * cfg.seq_len  # tokens of one round per unit of dp
            most = batch // unit  # the largest dp whose round fits the batch
            top = np.minimum(hi, most)
            ok = top >= lo
            low = lo if least is None else np.maximum(lo, least(code, m, seqs))
            whole, leanest = np.flatnonzero(ok & (hi <= most) & (hi >= low)), np.flatnonzero(ok & (lo >= low))
            rows, dps = [whole, leanest], [hi[whole], lo[leanest]]
            if least is not None:
                rounds = np.arange(1, -(-batch // unit) + 1)
                edges = np.unique(-(-batch // (rounds * unit)))  # the smallest dp of each round count
                for s in np.unique(step).tolist():
                    mine = np.flatnonzero(ok & (step == s))
                    e = np.unique(s * -(-edges // s))
                    first = np.searchsorted(e, low[mine], "left")
                    counts = np.maximum(np.searchsorted(e, top[mine], "right") - first, 0)
                    offsets = np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts, counts)
                    rows.append(np.repeat(mine, counts))
                    dps.append(e[np.repeat(first, counts) + offsets])
            row, dp = np.concatenate(rows), np.concatenate(dps)
            key = np.unique(row * (int(hi.max()) + 1) + dp)
            row, dp = key // (int(hi.max()) + 1), key % (int(hi.max()) + 1)
            out.append((row, np.full(len(row), m), np.full(len(row), seqs), dp))
    return tuple(np.concatenate(parts).astype(np.int64) for parts in zip(*out, strict=True))


def _as_candidates(arr: np.ndarray, colocated: bool) -> Candidates:
    arr = np.asarray(arr, dtype=np.int64).reshape(-1, 6)
    return Candidates(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3], arr[:, 4], arr[:, 5], colocated)


def best_index(cost: Cost, c: Candidates) -> int | None:
    """Fastest candidate that fits. Ties go to the higher MFU (more of the batch's tokens done in
    the same time when rounds do not divide it evenly), then more GPUs used, then fewer pipeline
    groups, micro-batches."""
    if not cost.fits.any():
        return None
    step = np.where(cost.fits, cost.step_s, np.inf)
    tokens_done = cost.rounds * cost.tokens_per_round
    used = c.attn + c.expert
    order = np.lexsort((c.seqs, c.m, c.p, -used, -tokens_done, np.round(step / step[np.isfinite(step)].min(), 9)))
    return int(order[0])


def fewest_gpus(cfg: PlanConfig) -> int | None:
    """Smallest GPU count on which some layout the runtime runs fits in memory (None beyond 2^20
    GPUs)."""
    def fits(g: int) -> bool:
        prob = problem_of(cfg, g)
        for cands in (disaggregated_candidates(cfg, g), colocated_candidates(cfg, g)):
            if len(cands) and evaluate(prob, cands, misfits_exact=False).fits.any():
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


def _pruning(cfg: PlanConfig, prob: Problem, cands: Candidates) -> Least:
    """`least` for the full search of one kind. `cands`, every layout row of that kind priced at
    its two ends (dp = its whole group and dp = its leanest): the leanest end's round time bounds
    every dp's round time from below (it grows with dp), so a dp whose round count r times that
    bound exceeds the best step of the kind found so far cannot win: skip it."""
    if not len(cands):
        return lambda code, m, seqs: np.ones_like(code)
    # A split's ends priced without attention recomputation: its round times only fall (a floor
    # stays a floor), a layout that fits so fits with it at the same step (the best stays an upper
    # bound), and what prunes for memory is the expert GPU's, which attention leaves alone; so the
    # pass keeps its answer and skips the recompute stage over every row.
    lean = prob
    if not cands.colocated and prob.recompute == "auto" and "attention" in prob.recompute_modules:
        rest = prob.recompute_modules - ATTENTION
        lean = replace(prob, recompute="auto" if rest else "none", recompute_modules=rest)
    cost = evaluate(lean, cands, misfits_exact=False)  # a misfit's memory understated: it prunes less, never more
    best = float(np.min(np.where(cost.fits, cost.step_s, np.inf)))
    # Memory: a disaggregated expert GPU's bytes grow with dp (its activations span every pair of
    # the group's dp attention GPUs, `cost.activations`), a colocated GPU's do not change with it
    # (one GPU, which keeps one micro-batch, is the leanest end); so a key whose leanest end does
    # not fit there with the leanest recomputation allowed fits at no dp. Colocated under ZeRO-1
    # the state shrinks with dp, and nothing is pruned for memory.
    if cands.colocated:
        short = ~cost.lean_fits if not prob.shard_optimizer else np.zeros(len(cands), dtype=bool)
    else:
        short = cost.lean_expert_mem_bytes > prob.capacity_bytes
    ms = np.unique(cfg.micro_batch_choices)
    combos = len(ms) * len(_seq_choices())

    def combo(m, seqs):  # (m, seqs) -> 0 .. combos - 1
        return np.searchsorted(ms, m) * len(_seq_choices()) + np.round(np.log2(seqs)).astype(np.int64)

    key = layout_code(cands, cfg.model.num_experts) * combos + combo(cands.m, cands.seqs)
    floor = cost.fwd_round_s + cost.bwd_round_s
    order = np.lexsort((floor, key))  # per key, the smallest round time first
    key, floor, short = key[order], floor[order], short[order]
    first = np.r_[True, key[1:] != key[:-1]]
    dead = np.logical_and.reduceat(short, np.flatnonzero(first)) if len(key) else short  # no end of the key fits
    key, floor = key[first], floor[first]

    def least(code: np.ndarray, m: int, seqs: int) -> np.ndarray:
        want = code * combos + combo(m, seqs)
        at = np.minimum(np.searchsorted(key, want), len(key) - 1)
        bound = np.where(key[at] == want, floor[at], 0.0)
        rounds = np.floor(best * (1 + 1e-9) / np.maximum(bound, 1e-30))  # the most rounds that could still win
        unit = m * seqs * cfg.seq_len
        ok = np.isfinite(rounds) & (rounds >= 1)
        dp = np.where(ok, -(-cfg.global_batch_tokens // (np.where(ok, rounds, 1) * unit)), 1)
        gone = (rounds < 1) | ((key[at] == want) & dead[at])  # < 1 round, or no dp fits: no dp of this row can win
        return np.where(gone, CODE, dp).astype(np.int64)

    return least


def choose(cfg: PlanConfig) -> Choice:
    """Search both layouts on up to the job's GPUs; return the faster one that fits (ties go to
    disaggregated). A layout on fewer GPUs wins only when it is faster than every layout on all
    of them; the plan then says so (`idle_gpus`, notes, reason).

    `offload_optimizer: auto` searches every layout both ways, without and with the optimizer
    state in host memory, and keeps the faster plan that fits (ties go to no offload), as
    `recompute: auto` does per candidate in `cost.evaluate`; a note says which it chose and why.
    `fp8_dense: auto` (under expert_precision fp8) does the same with the dense projections in FP8
    and in bf16 (`_fp8_dense_auto`)."""
    if _fp8_dense_undecided(cfg):
        return _fp8_dense_auto(*(choose(_fp8_dense(cfg, mode)) for mode in ("on", "off")))
    if cfg.offload_optimizer != "auto":
        choice = _choose(cfg)
        if choice.problem.offload_optimizer:
            choice.plan.notes.extend(_host_limit_note(cfg, choice))
        return choice
    off = _choose(_offload(cfg, "off"))
    if cfg.cluster.hardware.host_link_gbps is None:
        off.plan.notes.append(f"offload auto chose off: hardware {cfg.cluster.hardware.name!r} has no "
                              "host_link_gbps to price the optimizer's copies over")
        return off
    on = _choose(_offload(cfg, "on"))
    limit = _host_limit_note(_offload(cfg, "on"), on)
    if on.plan.feasible and (not off.plan.feasible or on.plan.step_time_s < off.plan.step_time_s):
        on.plan.notes.append(_offload_on_note(cfg, on, off))
        on.plan.notes.extend(limit)
        return on
    if not off.plan.feasible:  # neither fits: the leaner search's plan (its min_gpus counts offload)
        on.plan.notes.append("offload auto: no layout fits with or without the optimizer state in host memory")
        on.plan.notes.extend(limit)
        return on
    off.plan.notes.append(_offload_off_note(off, on))
    off.plan.notes.extend(limit)
    return off


def _offload(cfg: PlanConfig, mode: str) -> PlanConfig:
    return cfg.model_copy(update={"offload_optimizer": mode})


def _fp8_dense_undecided(cfg: PlanConfig) -> bool:
    """Whether the plan chooses the dense projections' precision (`fp8_dense: auto` under fp8 experts)."""
    return cfg.fp8_dense == "auto" and cfg.expert_precision == "fp8"


def _fp8_dense(cfg: PlanConfig, mode: str) -> PlanConfig:
    return cfg.model_copy(update={"fp8_dense": mode})


def _fp8_dense_auto(on: Choice, off: Choice) -> Choice:
    """`fp8_dense: auto`'s pick of the plans with the dense projections in FP8 (`on`) and in bf16
    (`off`): the faster that fits (ties: on, the trainer's default); where neither fits, off (the
    leaner: no e4m3 copies of the dense weights), as offload auto keeps its leaner search's plan;
    with a note of both step times and what priced the FP8 projections."""
    if not (on.plan.feasible or off.plan.feasible):
        off.plan.notes.append("fp8_dense auto: no layout fits with the dense projections in FP8 or in bf16 (the bf16 "
                              "search's plan, the leaner, is shown)")
        return off
    keep_off = off.plan.feasible and (not on.plan.feasible or off.plan.step_time_s < on.plan.step_time_s)
    kept, other = (off, on) if keep_off else (on, off)
    kept_in, other_in = ("bf16", "FP8") if keep_off else ("FP8", "bf16")
    scaling = on.problem.fp8_dense_scaling
    priced = (f"the measured FP8 projection curve of their {scaling} recipe, quantisers inside" if fp8_dense_pricing(
        on.problem.calibration, scaling) == "measured" else
        f"the datasheet ratio, {_fp8_dense_unmeasured(on.problem.calibration, scaling)}")
    against = (f"{report.seconds(kept.plan.step_time_s)} a step against {report.seconds(other.plan.step_time_s)} "
               f"with them in {other_in} (each way's best layout)" if other.plan.feasible else
               f"the only way that fits (in {other_in} no layout fits)")
    kept.plan.notes.append(f"fp8_dense auto chose {'off' if keep_off else 'on'}: the dense projections (attention, "
                           f"shared experts, dense FFN layers) in {kept_in}, {against}; the FP8 projections priced "
                           f"from {priced} (train with fp8_dense: {'false' if keep_off else 'true'}, which `train "
                           "--plan` sets)")
    return kept


def _state_freed_gib(choice: Choice) -> tuple[float, float, bool]:
    """(GiB of device memory offload frees on the fuller GPU of `choice`'s layout, seconds its host
    link adds per step, whether the layout fits without it): the same candidate priced without
    offload, against `choice`."""
    cost = choice.cost  # the same recomputation as the plan's, so only the state moves
    kept = evaluate(replace(_fixed_recompute(choice.problem, cost.dropped(0)), offload_optimizer=False),
                    choice.candidate)
    freed = max(float(kept.attn_mem_bytes[0] - cost.attn_mem_bytes[0]),
                float(kept.expert_mem_bytes[0] - cost.expert_mem_bytes[0]))
    return freed / GIB, float(cost.step_s[0] - kept.step_s[0]), bool(kept.fits[0])


def _offload_on_note(cfg: PlanConfig, on: Choice, off: Choice, fixed: bool = False) -> str:
    """One line: why auto chose offload (what it frees, what that buys, what the host link costs)."""
    freed, extra, fits_without = _state_freed_gib(on)
    p = on.plan
    host = float(on.cost.host_state_bytes[0]) / GIB
    cap = cfg.cluster.hardware.host_memory_gib
    where = f"m={p.micro_batches} with this {p.layout} layout (p={p.pipeline_groups})"
    if off.plan.feasible:
        ratio = off.plan.step_time_s / p.step_time_s
        gain = f"{(ratio - 1) * 100:.0f}% faster" + (f" ({ratio:.2f}x)" if ratio >= 2 else "")
        what = (f"which lets {where} fit, {gain} than the fastest layout without it "
                f"({report.seconds(off.plan.step_time_s)} per step)" if not fits_without else
                f"and this layout is {gain} than the fastest without it "
                f"({report.seconds(off.plan.step_time_s)} per step)")
    elif fixed:
        what = f"which lets {where} fit; it does not fit without it"
    else:
        what = f"which lets {where} fit; no layout fits without it"
    of = f" of the hardware's host_memory_gib {cap:g}" if cap is not None else ""
    return (f"offload auto chose on: the state leaves {freed:.1f} GiB per GPU, {what}; the host link costs "
            f"{report.seconds(extra)} per step ({host:.1f} GiB of masters and moments in host memory per GPU{of})")


def _offload_off_note(off: Choice, on: Choice) -> str:
    """One line: why auto left the optimizer state on the GPU."""
    if not on.plan.feasible:
        tail = "no layout fits with it"
    elif on.plan.step_time_s == off.plan.step_time_s:
        tail = f"with it the fastest layout is no faster ({report.seconds(on.plan.step_time_s)} per step)"
    else:
        tail = (f"with it the fastest layout would take {report.seconds(on.plan.step_time_s)} per step "
                f"({(on.plan.step_time_s / off.plan.step_time_s - 1) * 100:.0f}% slower: the host link)")
    return f"offload auto chose off: the fastest layout fits without it; {tail}"


def _host_limit_note(cfg: PlanConfig, choice: Choice) -> list[str]:
    """A note when the hardware's host memory per GPU (`host_memory_gib`) skipped an offloaded
    layout that would otherwise be faster (or fit where none does)."""
    hw = cfg.cluster.hardware
    if hw.host_memory_gib is None:
        return []
    free = _choose(cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={
        "hardware": hw.model_copy(update={"host_memory_gib": None})})}))
    if not free.plan.feasible or (choice.plan.feasible and free.plan.step_time_s >= choice.plan.step_time_s):
        return []
    host = float(free.cost.host_state_bytes[0]) / GIB
    now = f"{report.seconds(choice.plan.step_time_s)} per step" if choice.plan.feasible else "no layout that fits"
    return [f"offloaded layouts skipped by host memory: {hw.name}'s host_memory_gib is {hw.host_memory_gib:g} GiB "
            f"per GPU; {free.plan.layout} with m={free.plan.micro_batches} would keep {host:.1f} GiB there for "
            f"{report.seconds(free.plan.step_time_s)} per step (now {now})"]


def _choose(cfg: PlanConfig) -> Choice:
    """`choose` with the offload fixed (on or off). The colocated baseline (what the plan's speedup
    is measured against: Megatron's EP x PP x DP) is the best colocated layout of any pipeline
    depth and EP blocking, which the runtime runs as priced (`colocated_candidates`), so the plan
    is the faster of it and the best disaggregated split."""
    prob = problem_of(cfg)
    dis_time, dis, dis_whole = _best_of_kind(cfg, prob, disaggregated_candidates)
    col_time, col, col_whole = _best_of_kind(cfg, prob, colocated_candidates)
    whole = min(dis_whole, col_whole)  # the best plan that leaves no GPU idle (but for gpus mod p)
    if dis is not None and prob.calibration is not None:  # the pick compares what the plan will report
        dis_time = replayed_step_s(evaluate(prob, dis), prob, dis)
    if dis is None and col is None:
        choice = Choice(_infeasible(cfg, prob), None, None, prob)
    else:
        chosen = dis if dis_time <= col_time else col
        choice = price(cfg, chosen, col_time, dis_time, whole)
    choice.plan.notes.extend(_untaken_recompute(cfg, choice.plan))
    return choice


def _best_of_kind(cfg: PlanConfig, prob: Problem,
                  kind: Callable[..., Candidates]) -> tuple[float, Candidates | None, float]:
    """(step, layout) of the fastest layout of one kind (its candidates' function) that fits
    ((inf, None) where none does), and the fastest of that kind leaving no GPU idle (but for
    gpus mod p)."""
    gpus = cfg.cluster.num_gpus
    cands = kind(cfg, gpus, _pruning(cfg, prob, kind(cfg, gpus)))
    if not len(cands):
        return math.inf, None, math.inf
    cost = evaluate(prob, cands, misfits_exact=False)  # fits and steps exact
    full = (cands.attn + cands.expert) == cands.p * (gpus // cands.p)
    whole = float(np.min(np.where(cost.fits & full, cost.step_s, np.inf)))
    i = best_index(cost, cands)
    return (float(cost.step_s[i]), cands.take(i), whole) if i is not None else (math.inf, None, whole)


def _untaken_recompute(cfg: PlanConfig, plan: Plan) -> list[str]:
    """A note when auto would have recomputed the expert modules but the run's experts_backend
    cannot (they need triton): the plan prices none of them."""
    if cfg.recompute != "auto" or cfg.experts_backend == "triton":
        return []
    other = choose(cfg.model_copy(update={"experts_backend": "triton"})).plan
    if not set(other.recompute_modules) & mem.SELECTIVE or not other.feasible:
        return []
    now = f"{report.seconds(plan.step_time_s)} per step" if plan.feasible else "no layout that fits"
    return [f"selective recomputation was not considered: it needs experts_backend: triton (this run's is "
            f"{cfg.experts_backend}); with it the plan would be {other.reason.split(':')[0]} at "
            f"{report.seconds(other.step_time_s)} per step (now {now})"]


def price(cfg: PlanConfig, chosen: Candidates, colocated_step_s: float | None = None,
          disaggregated_step_s: float | None = None, whole_step_s: float | None = None) -> Choice:
    """Build the `Plan` of one layout (feasible or not: `plan.feasible` says).

    `colocated_step_s` / `disaggregated_step_s`: the best layout of that kind's step time, inf
    when none fits, None when it was not priced (a layout fixed by the caller). The plan's
    `colocated_step_time_s` and `speedup_vs_colocated` are None unless a colocated layout was
    priced and fits. `whole_step_s`: the best layout on all the GPUs (but for gpus mod p), inf
    when none fits, for the note when `chosen` leaves more GPUs idle. `offload_optimizer: auto`
    prices `chosen` both ways: with offload only when it fits only so. `fp8_dense: auto` prices
    `chosen` with the dense projections in FP8 and in bf16 and keeps the faster (`_fp8_dense_auto`)."""
    if _fp8_dense_undecided(cfg):
        return _fp8_dense_auto(*(price(_fp8_dense(cfg, mode), chosen, colocated_step_s, disaggregated_step_s,
                                       whole_step_s) for mode in ("on", "off")))
    if cfg.offload_optimizer == "auto":
        off = price(_offload(cfg, "off"), chosen, colocated_step_s, disaggregated_step_s, whole_step_s)
        if off.plan.feasible or cfg.cluster.hardware.host_link_gbps is None:
            off.plan.notes.append("offload auto chose off: " + ("this layout fits without it" if off.plan.feasible
                                  else "the hardware has no host_link_gbps"))
            return off
        on = price(_offload(cfg, "on"), chosen, colocated_step_s, disaggregated_step_s, whole_step_s)
        if not on.plan.feasible:
            return off
        on.plan.notes.append(_offload_on_note(cfg, on, off, fixed=True))
        return on
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
    fewer = attn + exp < p * (gpus // p)  # idle by choice, not only gpus mod p
    if fewer:
        than = ("no layout on all of them fits" if whole_step_s in (None, math.inf) else
                f"the best layout on all of them predicts {report.seconds(whole_step_s)} per step")
        notes.append(f"{idle} of {gpus} GPUs left idle: this layout on {attn + exp} is faster ({than}); "
                     "give the rest another job, e.g. a second run")
    elif idle:
        notes.append(f"{idle} GPU(s) left idle: the GPU count is not a multiple of p={p}")
    dp = int(cost.dp[0])
    tokens_per_round = int(cost.tokens_per_round[0])
    rounds = int(cost.rounds[0])
    if rounds * tokens_per_round != cfg.global_batch_tokens:
        notes.append(f"the batch is {rounds} rounds of {tokens_per_round} tokens = "
                     f"{rounds * tokens_per_round} tokens (asked {cfg.global_batch_tokens})")
    fits, refused = bool(cost.fits[0]), bool(cost.rank_steps.refused[0])
    if refused:
        notes.append(f"train refuses this layout: {cost.rank_steps.lines[0]}")
    elif not fits:
        notes.append("this layout does not fit in memory (see memory_per_gpu)")
    elif use_dis:
        notes.extend(_memory_bound(cost, prob))
    transport = float(cost.expert_transport_bytes[0] if use_dis else cost.attn_transport_bytes[0])
    if transport > 0.05 * prob.capacity_bytes:
        notes.append(f"the transport's buffers take {transport / GIB:.1f} GiB per GPU (train with transport: nvshmem: "
                     "one symmetric arena, as large on every GPU as the largest rank's: per peer and payload a "
                     "ring of segments, for a forward payload one per layer and micro-batch (live until its "
                     "backward) and one more, for a gradient m + 1, each sized for all its source's tokens"
                     + ("; its rank steps captured, each ring rounded up to a divisor of twice its messages a step"
                        if cost.rank_steps.captured[0] else "") + "; counted in memory_per_gpu and the fit)")
    dropped = cost.dropped(0)
    modules = [name for name in RECOMPUTE_ORDER if name in dropped]
    notes.append(f"memory assumes AdamW with fp32 master weights and {cfg.optimizer_state_dtype} moments, "
                 + ("the attention side's moments split over each data-parallel group (ZeRO-1)"
                    if cfg.shard_optimizer_states else "on every replica (no optimizer sharding)")
                 + _recompute_text(dropped))
    if prob.offload_optimizer:
        notes.append(_offload_note(cfg, cost, dp, use_dis))
    if prob.expert_precision == "fp8":
        notes.append(fp8_note(prob, cost))
        notes.extend(_fp8_dense_loses_note(prob, chosen, cost))
    if dropped & mem.SELECTIVE:
        notes.append(_recompute_note(cfg, prob, chosen, cost))
    if "attention" in dropped:
        notes.append(_attention_recompute_note(prob, chosen, cost))
    if mem.BLOCK in dropped:
        notes.append(_full_recompute_note(prob, chosen, cost))
    if not dropped and prob.recompute == "auto" and fits:
        notes.append(_no_recompute_note(prob, chosen, cost))
    step = float(cost.step_s[0])
    if prob.calibration is not None and use_dis:
        closed = step
        step = replayed_step_s(cost, prob, chosen)
        notes.append(f"step time from replaying the schedule with the calibrated op times ({report.seconds(step)}); "
                     f"the search's closed-form pipeline gives {report.seconds(closed)}")
    counts = count_params(model)
    flops_per_gpu_s = step_flops(model, rounds * tokens_per_round, cfg.seq_len) / (step * gpus)
    mfu = flops_per_gpu_s / (cfg.cluster.hardware.bf16_tflops * 1e12)
    stage_times = _stage_times(cost, prob, chosen)
    notes.extend(_hop_note(stage_times, step, model.top_k))
    notes.extend(_wgrad_pairs_note(prob, chosen, cost))
    if not single:
        ranks = (exp // (p * int(chosen.sets[0])) if use_dis else
                 int(colocated_ep(model.num_experts, exp // p // int(chosen.sets[0]))))
        notes.append(_dispatch_note(model, ranks, prob.load_peak_ratio if use_dis else 1.0, use_dis))
    plan = Plan(
        model=model.name, hardware=cfg.cluster.hardware.name, gpus=gpus, seq_len=cfg.seq_len,
        global_batch_tokens=cfg.global_batch_tokens,
        layout="disaggregated" if use_dis else "single" if single else "colocated",
        attention_gpus=attn, expert_gpus=exp, pipeline_groups=p, micro_batches=m,
        expert_replica_sets=int(chosen.sets[0]) if use_dis else exp // p // int(colocated_ep(
            model.num_experts, exp // p // int(chosen.sets[0]))),
        sequences_per_micro_batch=seqs * dp, accumulation_rounds=rounds,
        expert_map=expert_map, total_params=counts.total, active_params=counts.active,
        memory_per_gpu=_memory(cost, prob, use_dis, "single" if single else "colocated"), stage_times=stage_times,
        recompute=_recompute_name(dropped), recompute_modules=modules,
        offload_optimizer=prob.offload_optimizer, optimizer_state_dtype=prob.optimizer_state_dtype,
        optimizer_update_kernel=prob.optimizer_update_kernel, shard_optimizer_states=prob.shard_optimizer,
        expert_precision=prob.expert_precision, fp8_dense=prob.fp8_dense,
        fp8_dense_scaling=prob.fp8_dense_scaling if prob.fp8_dense else None,
        fp8_expert_backward=prob.fp8_backward if prob.expert_precision == "fp8" else None,
        fp8_expert_forward=prob.fp8_forward if prob.expert_precision == "fp8" else None,
        cuda_graphs=None if single else prob.cuda_graphs, fused_loss=prob.fused_loss,
        expert_wgrad_pairs="on" if cost.wgrad_pairs[0] else "off",
        step_time_s=step, colocated_step_time_s=col if math.isfinite(col) else None,
        speedup_vs_colocated=col / step if math.isfinite(col) else None,
        expert_imbalance=real_imb, mfu=mfu, tflops_per_gpu=flops_per_gpu_s / 1e12, feasible=fits,
        idle_gpus=idle, rank_steps_captured=None if single else bool(cost.rank_steps.captured[0]),
        rank_steps_note=cost.rank_steps.lines[0],
        reason=(f"uses {attn + exp} of {gpus} GPUs ({idle} idle): " if fewer else "")
        + _reason(stage_times, chosen, use_dis, step, fits, colocated_step_s, disaggregated_step_s, single, refused),
        notes=notes,
    )
    return Choice(plan, chosen, cost, prob)


def _recompute_text(dropped: frozenset[str]) -> str:
    """The memory note's tail: which recomputation the plan's memory assumes."""
    if mem.BLOCK in dropped:
        return (", and full recomputation (every block keeps its input and routing and runs again in its backward; "
                "train --plan sets recompute: full)")
    experts, attention = bool(dropped & mem.SELECTIVE), "attention" in dropped
    if not experts and not attention:
        return ", and no activation recomputation"
    rows = [part for name, part in (("expert_input", "input"), ("expert_output", "output"),
                                    ("expert_swiglu", "SwiGLU")) if name in dropped]
    listed = " and ".join([", ".join(rows[:-1]), rows[-1]] if len(rows) > 1 else rows)
    expert_rows = f"the expert FFN's {listed} rows"
    what = " and ".join(part for part, on in ((expert_rows, experts), ("the attention block", attention)) if on)
    modules = ", ".join(name for name in RECOMPUTE_ORDER if name in dropped)
    return (f", and selective recomputation of {what} (train --plan sets recompute: selective, recompute_modules: "
            f"[{modules}]" + ("; the expert modules need experts_backend: triton)" if experts else ")"))


def _attention_recompute_note(prob: Problem, chosen: Candidates, cost: Cost) -> str:
    """One line: what attention recomputation frees on the GPU it relieves, and what it costs."""
    dropped = cost.dropped(0)
    kept = evaluate(_fixed_recompute(prob, dropped - ATTENTION), chosen)
    side = "attention" if not chosen.colocated else "colocated"
    before, after = (float(c.attn_act_bytes[0]) / GIB for c in (kept, cost))
    extra = float(cost.step_s[0] - kept.step_s[0])
    why = (f"lets m={int(chosen.m[0])} with this layout fit" if not bool(kept.fits[0]) else
           "as asked (recompute_modules names attention)")
    return (f"attention recomputation: activations {before:.1f} -> {after:.1f} GiB per {side} GPU {why} (the block "
            "keeps its input and the core's output; the norm, q/k/v projections and RoPE run again in the "
            f"backward, not the attention core); its recompute adds {report.seconds(extra)} "
            "per step")


def _full_recompute_note(prob: Problem, chosen: Candidates, cost: Cost) -> str:
    """One line: what full recomputation frees on each side, and what it costs."""
    kept = evaluate(_fixed_recompute(prob, mem.NOTHING_DROPPED), chosen)
    sides = [("attention", "attn_act_bytes")] if chosen.colocated else [("attention", "attn_act_bytes"),
                                                                        ("expert", "expert_act_bytes")]
    freed = "; ".join(f"{float(getattr(kept, key)[0]) / GIB:.1f} -> {float(getattr(cost, key)[0]) / GIB:.1f} GiB per "
                      f"{'colocated' if chosen.colocated else side} GPU" for side, key in sides)
    extra = float(cost.step_s[0] - kept.step_s[0])
    return (f"full recomputation as asked (--recompute full): activations {freed}; every block's forward runs "
            f"again in its backward, adding {report.seconds(extra)} per step")


def _recompute_note(cfg: PlanConfig, prob: Problem, chosen: Candidates, cost: Cost) -> str:
    """One line: what selective recomputation frees on the GPU it relieves, and what it costs."""
    kept = evaluate(_fixed_recompute(prob, cost.dropped(0) - mem.SELECTIVE), chosen)
    side = "expert" if not chosen.colocated else "colocated"
    before = float((kept.expert_act_bytes if side == "expert" else kept.attn_act_bytes)[0]) / GIB
    after = float((cost.expert_act_bytes if side == "expert" else cost.attn_act_bytes)[0]) / GIB
    extra = float(cost.step_s[0] - kept.step_s[0])
    why = (f"lets m={int(chosen.m[0])} with this layout fit" if not bool(kept.fits[0]) else
           "as asked (--recompute selective)")
    return (f"selective recomputation: activations {before:.1f} -> {after:.1f} GiB per {side} GPU {why}; "
            f"its recompute adds {report.seconds(extra)} per step")


def _no_recompute_note(prob: Problem, chosen: Candidates, cost: Cost) -> str:
    """One line: why auto left recomputation out (the plan fits without it and no faster layout
    needed it), with what each recomputation it may choose would free and cost here."""
    parts = []
    for name, modules, side in (("selective", mem.SELECTIVE, "expert"), ("attention recomputation", ATTENTION,
                                                                         "attention")):
        if not modules & prob.recompute_modules:
            continue
        lean = evaluate(_fixed_recompute(prob, modules & prob.recompute_modules), chosen)
        where = side if not chosen.colocated else "colocated"
        before, after = (report.memory(float((c.expert_act_bytes if where == "expert" else c.attn_act_bytes)[0]) / GIB)
                         for c in (cost, lean))
        extra = float(lean.step_s[0] - cost.step_s[0])
        parts.append(f"{name} would take activations {before} -> {after} per {where} GPU for "
                     f"{report.seconds(extra)} more per step")
    return "recompute auto chose none: this layout fits without it and no faster layout needs it; " + "; ".join(parts)


MEMORY_BOUND = 0.95  # a GPU this full of its capacity binds the split


def _memory_bound(cost: Cost, prob: Problem) -> list[str]:
    """A note when memory, not speed, sets the split: the expert GPUs (states plus the
    activations of every pair of their group's tokens in flight, dp * m * seqs * seq_len tokens)
    cannot shrink in number nor take more tokens, and the attention GPUs' activations cap the
    tokens in flight per attention GPU (m * seqs * seq_len, less the head's and one backward's
    transients, which do not scale with the micro-batches)."""
    cap = prob.capacity_bytes
    attn, exp = float(cost.attn_mem_bytes[0]) / cap, float(cost.expert_mem_bytes[0]) / cap
    if max(attn, exp) < MEMORY_BOUND:
        return []
    full = [f"{name} GPUs at {frac:.0%}" for name, frac in (("expert", exp), ("attention", attn))
            if frac >= MEMORY_BOUND]
    relax = "more GPUs relax it" + (", as may --shard-optimizer-states"
                                    if attn >= MEMORY_BOUND and not prob.shard_optimizer else "")
    why = ("more tokens in flight per pipeline group would not fit (an expert GPU keeps every (token, k) pair its "
           "group's attention GPUs dispatch, not only its experts' share: the runtime's buffers span them all), so a "
           "longer --seq-len holds fewer micro-batches or attention GPUs per group" if exp >= MEMORY_BOUND else
           "more tokens in flight per attention GPU would not fit, so a longer --seq-len holds fewer micro-batches in "
           "flight")
    return [f"the split is bound by memory ({', '.join(full)} of capacity): fewer expert GPUs or {why}; {relax}"]


def _colocated_map(cfg: PlanConfig, c: Candidates) -> tuple[list[list[list[int]]], float]:
    """Colocated: within group g, B = GPUs per group / ep EP blocks, block b its GPUs b, b + B, ...;
    expert e lives on the block's GPU e // (E/ep), replica b in block b, so the GPU of data-parallel
    index d dispatches within its own block (replica d mod B: `runtime.plan_layout.fed_replicas`)."""
    model = cfg.model
    p = int(c.p[0])
    per_group = int(c.expert[0]) // p
    ep = int(colocated_ep(model.num_experts, per_group // int(c.sets[0])))
    per_gpu, blocks = model.num_experts // ep, per_group // ep
    out = []
    for j in range(model.num_moe_layers):
        g = (model.num_dense_layers + j) % p
        out.append([[g * per_group + b + blocks * (e // per_gpu) for b in range(blocks)]
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
    attn_state, exp_state = attention_state_bytes(float(cost.dp[0]), prob), expert_state_bytes(prob)

    def estimate(attn_params: float, exp_params: float, act: float, transport: float) -> MemoryEstimate:
        def gib(part: str) -> float:  # "weights", "grads" or "moments" of StateBytes over both sides' parameters
            return (attn_params * float(getattr(attn_state, part)) + exp_params * float(getattr(exp_state, part))) / GIB

        w, g, t = gib("weights"), gib("grads"), transport / GIB
        o = gib("moments") + float(offload_staging_bytes(prob, attn_params + exp_params)) / GIB
        return MemoryEstimate(weights_gib=w, grads_gib=g, optimizer_gib=o, activations_gib=act / GIB,
                              transport_gib=t, total_gib=w + g + o + act / GIB + t,
                              capacity_gib=prob.capacity_bytes / GIB, host_gib=gib("host"))

    a_p, e_p = float(cost.attn_params[0]), float(cost.expert_params[0])
    a_act, e_act = float(cost.attn_act_bytes[0]), float(cost.expert_act_bytes[0])
    a_t, e_t = float(cost.attn_transport_bytes[0]), float(cost.expert_transport_bytes[0])
    if not disaggregated:
        return {kind: estimate(a_p, e_p, a_act + e_act, a_t)}
    return {"attention": estimate(a_p, 0.0, a_act, a_t), "expert": estimate(0.0, e_p, e_act, e_t)}


def roofline_rows(cost: Cost, prob: Problem, c: Candidates) -> tuple[list[dict], list[dict]]:
    """Report rows (see `roofline.report.stage_row`) of one layout: per layer and micro-batch,
    and per step (each stage times how often it runs on the busiest GPU of its group)."""
    per_step = float(cost.rounds[0]) * int(c.m[0])
    layer_rows, step_rows = [], []
    for name, stage in cost.stages.items():
        repeat = stage.repeats(prob.model, int(c.p[0]), per_step)
        for tag, w in (("fwd", stage.fwd), ("bwd", stage.bwd)):
            label = "step" if stage.runs == "step" else tag
            ceil = stage.ceilings(tag == "bwd", prob.ceilings)
            row = report.stage_row(name, stage.group, label, w, ceil)
            if row["time_s"] == 0:
                continue
            if stage.runs != "step":
                layer_rows.append(row)
            step_rows.append(report.stage_row(name, stage.group, label, w, ceil, repeat=repeat))
    return layer_rows, step_rows


def _wgrad_pairs_note(prob: Problem, chosen: Candidates, cost: Cost) -> list[str]:
    """A plan's line on `expert_wgrad_pairs: auto` where its split may pair: on or off, as the run settles it
    (`Plan.expert_wgrad_pairs`, which `train --plan` then sets): one GPU (`_single_wgrad_pairs_note`), or the
    expert GPUs of a distributed layout (`_rank_wgrad_pairs_note`). The pairs span the micro-batches
    `cost.paired_micro_batches` says: one GPU's step, m x rounds; a distributed rank's round, m."""
    single = bool(chosen.colocated and chosen.expert[0] == 1)
    m = int(paired_micro_batches(single, int(chosen.m[0]), int(chosen.m[0]) * int(cost.rounds[0])))
    if math.isinf(prob.wgrad_pairs_budget) or not prob.wgrad_pairs or m < 2:
        return []
    on, budget = bool(cost.wgrad_pairs[0]), prob.wgrad_pairs_budget
    paired = cost if on else evaluate(replace(prob, wgrad_pairs_budget=math.inf), chosen)
    if single:
        return _single_wgrad_pairs_note(on, m, float(paired.attn_mem_bytes[0]), budget)
    unpaired = evaluate(replace(prob, wgrad_pairs=False), chosen)
    return _rank_wgrad_pairs_note(on, m, _fullest(paired), _fullest(unpaired), budget)


def _fullest(cost: Cost) -> float:
    """The fuller GPU's predicted bytes of the first candidate of `cost` (colocated: its one kind)."""
    return max(float(cost.attn_mem_bytes[0]), float(cost.expert_mem_bytes[0]))


def _budget_text(budget: float) -> str:
    """`Problem.wgrad_pairs_budget` said: the share of the device a run may plan for."""
    return (f"the {budget / GIB:.1f} GiB ({mem.MEMORY_HEADROOM:.0%} of the device's "
            f"{budget / mem.MEMORY_HEADROOM / GIB:.1f}) a run may plan for")


def _rank_wgrad_pairs_note(on: bool, m: int, paired: float, unpaired: float, budget: float) -> list[str]:
    """A distributed plan's `_wgrad_pairs_note`, as the driver settles auto
    (`runtime.cluster.driver.resolve_distributed_wgrad_pairs`): off only where the waiting rows raise the fullest
    GPU's predicted peak (`paired` bytes against `unpaired`) and take it past the `budget`."""
    rise = f"{(paired - unpaired) / GIB:+.2f} GiB for the waiting rows"
    if not on:
        return [f"expert_wgrad_pairs: auto -> off: the expert GPUs' waiting rows would take the fullest GPU's "
                f"predicted peak to {paired / GIB:.1f} GiB ({rise}), past {_budget_text(budget)}; each expert weight "
                "gradient priced once per micro-batch (train --plan sets expert_wgrad_pairs: off)"]
    where = (f"within {_budget_text(budget)}" if paired <= budget
             else f"past {_budget_text(budget)} without them too")
    return [f"expert_wgrad_pairs: auto -> on: each expert GPU's expert weight gradients priced {(m + 1) // 2} times "
            f"a step over its {m} micro-batches' rows; the fullest GPU's predicted peak, {paired / GIB:.1f} GiB "
            f"({rise}), is {where} (train --plan sets expert_wgrad_pairs: auto, which its driver settles alike)"]


def _single_wgrad_pairs_note(on: bool, m: int, peak: float, budget: float) -> list[str]:
    """A one-GPU plan's `_wgrad_pairs_note`, as the single trainer settles auto (`cost._pairs_fit`: the predicted
    `peak` with the waiting rows within the `budget`)."""
    budget = _budget_text(budget)
    if on:
        return [f"expert_wgrad_pairs: auto -> on: each expert weight gradient priced {(m + 1) // 2} times a step "
                f"over its {m} micro-batches' rows; the predicted peak with one micro-batch's waiting rows, "
                f"{peak / GIB:.1f} GiB, is within {budget} (train --plan sets expert_wgrad_pairs: on)"]
    return [f"expert_wgrad_pairs: auto -> off: one micro-batch's waiting expert rows would take the predicted peak "
            f"to {peak / GIB:.1f} GiB, past {budget}; each expert weight gradient priced once per micro-batch "
            "(train --plan sets expert_wgrad_pairs: off)"]


HOP_NOTE_SHARE = 0.2  # dispatch + combine above this share of the summed stage times: say why


def _hop_note(stage_times: list[StageTime], step: float, top_k: int) -> list[str]:
    """A note when the hops weigh: they price the runtime's compact hop, which sends every token
    to each expert GPU it routes through whatever top-k (`runtime.stages.messages`)."""
    hops = sum(s.time_s for s in stage_times if s.name.split(" (")[0] in ("dispatch", "combine"))
    total = sum(s.time_s for s in stage_times)
    if total <= 0 or hops / total <= HOP_NOTE_SHARE:
        return []
    return [f"dispatch and combine are {hops / total:.0%} of the stage time: the runtime's hop sends a token once "
            "to each GPU serving one of its experts (sparse dispatch; the expert GPUs of its set, colocated: its "
            f"expert-parallel block) and returns one partial sum per token received, whatever top-k = {top_k}; "
            "across more GPUs than top-k, per-pair rows move less (train with transport: nvshmem and the triton "
            "experts, where hop: auto picks them; the planner prices partial sums)"]


def _dispatch_note(model, ranks: int, load_peak_ratio: float, disaggregated: bool) -> str:
    """Which dispatch the hops are priced with (`roofline.stages.dispatch_rows`, as the runtime's
    `dispatch: auto` picks it on nvshmem)."""
    where = "expert GPUs of its set" if disaggregated else "GPUs of its expert-parallel block"
    if ranks <= 1:
        return f"dispatch priced dense: one {where[:-1].replace('GPUs', 'GPU')} serves every token"
    sent, _, _ = st.dispatch_rows(model, ranks)
    busiest_text = ("; the busiest GPU's share of the tokens from the load histogram's peak, after replicas"
                    if load_peak_ratio > 1 else "")
    r = model.router
    routing = (f"group-limited: top-{r.topk_groups} of {r.num_groups} groups, each giving "
               f"{model.top_k / r.topk_groups:g} experts" if r.num_groups > 1 else "uniform routing")
    return (f"dispatch priced sparse (train with dispatch: auto on nvshmem, or sparse): a token reaches "
            f"{float(sent):.2f} of the {ranks} {where} on average (top-{model.top_k} of {model.num_experts} "
            f"experts, {routing}){busiest_text}; dense dispatch would send it to all {ranks}; only the routed "
            "rows cross the link on nvshmem (one Triton launch of peer stores), nccl and local move the worst-case "
            "buffer")


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
        return f"{other / step:.2f}x faster than the {kind} ({report.seconds(other)} per step)"
    return f"{step / other:.2f}x slower than the {kind} ({report.seconds(other)} per step)"


def _reason(stage_times: list[StageTime], c: Candidates, disaggregated: bool, step: float, fits: bool,
            col: float | None, dis: float | None, single: bool = False, refused: bool = False) -> str:
    """One line: the layout, how it compares with the other kind, and the top stage of the table
    (once-per-step stages included). Claims only what was priced. `refused`: train refuses it
    (`cost.rank_steps`), whatever its memory."""
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
    fit = "" if fits else "refused by cuda_graphs: on: " if refused else "does not fit in memory: "
    return f"{fit}{layout}: {vs}; heaviest stage {top.name}, {top.bound}-bound"


LEANEST_DP = 4096  # data-parallel group size standing in for "as many attention GPUs as it takes" (ZeRO-1)


def _leanest(prob: Problem, p: int) -> tuple[float, float, float]:
    """GiB on the fullest attention and expert GPU of the leanest layout with `p` groups, and of it
    the transport's buffers: one sequence, one micro-batch, the expert GPUs per set (1 to the
    experts) whose fullest GPU is the emptiest (more expert GPUs hold fewer experts each but
    more receive buffers: `cost.transport_buffers`) and, with ZeRO-1, a data-parallel group large
    enough that the sharded moments all but vanish (a larger GPU count gets there; not under
    `cuda_graphs: on`, which plans one attention GPU per group: `cost.rank_steps`)."""
    n = prob.model.num_experts
    dp = LEANEST_DP if prob.shard_optimizer and prob.cuda_graphs != "on" else 1
    if prob.recompute == "auto":  # the leanest is every module auto may recompute
        prob = _fixed_recompute(prob, prob.recompute_modules)
    per_set = np.arange(1, n + 1, dtype=np.int64)
    one = np.ones_like(per_set)
    leanest = evaluate(prob, Candidates(p * dp * one, p * per_set, p * one, one, one, one))
    i = int(np.argmin(np.maximum(leanest.attn_mem_bytes, leanest.expert_mem_bytes)))
    return (float(leanest.attn_mem_bytes[i]) / GIB, float(leanest.expert_mem_bytes[i]) / GIB,
            float(leanest.attn_transport_bytes[i]) / GIB)


def _blocker(cfg: PlanConfig, prob: Problem) -> str | None:
    """A limit no GPU count can lift: one sequence too big for an attention GPU, or one expert
    too big for an expert GPU (both need features we do not have yet). The text names optimizer
    sharding only as a remedy, and only when `--shard-optimizer-states` is off and would fit."""
    p = min(cfg.max_pipeline_groups, cfg.model.num_layers)
    cap = prob.capacity_bytes / GIB
    attn, exp, transport = _leanest(prob, p)
    buffers = (f" ({transport:.0f} GiB of it the transport's receive buffers, sized for every token of every "
               "micro-batch and layer reaching every expert rank)" if transport > 0.1 * cap else "")
    if attn > cap:
        if prob.shard_optimizer and prob.cuda_graphs == "on":
            also = "with one attention GPU per pipeline group (cuda_graphs: on), whose moments ZeRO-1 cannot split"
            fix = ""
        elif prob.shard_optimizer:
            also = "even with the attention side's AdamW moments sharded (ZeRO-1)"
            fix = ""
        else:
            also = "with unsharded AdamW state"
            sharded_attn, _, _ = _leanest(replace(prob, shard_optimizer=True), p)
            fix = ", or --shard-optimizer-states (ZeRO-1)" if sharded_attn <= cap else ""
        return (f"one attention GPU needs {attn:.0f} GiB (> {cap:.0f}){buffers} even for a single {cfg.seq_len}-token "
                f"sequence with p={p} pipeline groups, {also}: this needs tensor or context parallelism, "
                f"which disagmoe does not have yet; try a shorter --seq-len or a larger --max-pipeline-groups{fix}")
    if exp > cap:
        return (f"one expert GPU needs {exp:.0f} GiB (> {cap:.0f}){buffers} at its leanest with p={p} pipeline groups "
                f"(experts spread over the expert GPUs per set that leave the fullest GPU emptiest): this needs expert "
                f"tensor parallelism or smaller receive buffers, which disagmoe does not have yet")
    return None


def _infeasible(cfg: PlanConfig, prob: Problem) -> Plan:
    blocker = _blocker(cfg, prob)
    need = None if blocker else fewest_gpus(cfg)
    counts = count_params(cfg.model)
    gpus = cfg.cluster.num_gpus
    costs = [evaluate(prob, c) for c in (disaggregated_candidates(cfg, gpus),
                                         colocated_candidates(cfg, gpus)) if len(c)]
    notes = [] if costs else [f"the global batch ({cfg.global_batch_tokens} tokens) is smaller than one sequence per GPU"]
    smallest = min((float(np.min(np.where(k.rank_steps.refused, np.inf, np.maximum(k.attn_mem_bytes,
                                                                                     k.expert_mem_bytes))))
                    for k in costs), default=0.0)
    state = ("the attention side's AdamW moments sharded over data parallel (ZeRO-1)" if cfg.shard_optimizer_states
             else "AdamW state unsharded (--shard-optimizer-states splits the attention side's moments)")
    why = (f"no layout fits in {prob.capacity_bytes / GIB:.0f} GiB per GPU on {cfg.cluster.num_gpus} GPUs "
           f"(the leanest needs {smallest / GIB:.0f} GiB on its fullest GPU; {params_text(counts.total)} parameters "
           f"at up to {expert_state_bytes(prob).total:g} bytes each, {state})")
    if any(k.rank_steps.refused.any() for k in costs):
        why += ("; cuda_graphs: on plans only the layouts whose rank steps it captures (one attention GPU per "
                "pipeline group, no replicated experts); cuda_graphs: auto or off plans the others")
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
