"""Measured terms on top of the roofline: efficiency curves and per-transport costs.

A `HardwareConfig.calibration` (written by `disagmoe bench calibrate`) holds
- curves of (size, fraction of the bf16 peak) points: the expert GEMMs against rows per expert
  (forward, data gradients, weight gradients into fp32 main gradients), the attention core
  against sequence length, the attention projections against tokens per micro-batch (at the
  calibration model's shape, and from probe version 6 at an MLA shape too, which prices MLA
  models: `attention_curves`). A point's fraction is the rate at which
  the stage's own work (`roofline.stages.expert_passes`, `attention_core_passes`) takes the measured time
  (`fitted_fraction`, the inverse of the pricing below), so the probe and the planner count one
  stage's traffic the same way. `curve_fraction` interpolates linearly in log(size)
  and clamps at the end points (no extrapolation: outside the measured range the nearest
  measurement holds); the FP8 expert FFN against rows per expert (forward; data and weight
  gradients measured together, `fitted_shared_fraction`), fractions of the same bf16 peak;
- transports as latency + bytes / bandwidth (`LinkCost`): NCCL send/recv, all-reduce, all-to-all;
- fixed seconds per schedule op (`op_fixed_s`).

Each turns into a `Ceilings` for one stage (`compute_ceilings`, `link_ceilings`): the stage's
`Work` stays the same FLOPs and bytes, only its rates change. numpy only (no torch): the planner
imports this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from disagmoe.config import Calibration, LinkCost, ModelConfig, RatePoint
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.stages import Num, Work


def curve_fraction(points: list[RatePoint], at: Num, bwd: bool, field: str | None = None) -> np.ndarray:
    """The fraction of peak at `at` (array-broadcastable): interpolated in log(at) between the
    measured points, the end points' value outside them. `points` must be non-empty. `field`
    names the RatePoint field to read (e.g. "wgrad"); default "bwd" if `bwd` else "fwd"."""
    if not points:
        raise ValueError("an efficiency curve needs at least one measured point")
    name = field or ("bwd" if bwd else "fwd")
    values = [getattr(p, name) for p in points]
    if any(v is None for v in values):
        raise ValueError(f"the curve's points do not all hold `{name}` (measured by an older probe)")
    xs = np.log([p.at for p in points])
    ys = np.array(values, dtype=float)
    return np.interp(np.log(np.maximum(np.asarray(at, dtype=float), 1e-30)), xs, ys)


def attention_curves(calib: Calibration, m: ModelConfig) -> tuple[list[RatePoint], list[RatePoint]]:
    """The (attention core, attention projections) curves that price `m`'s attention block: for an
    MLA model the MLA curves (`attention_mla`, `projections_mla`, probe version 6 on), each where
    the calibration holds it; else, and for other models, `attention` and `projections`, measured
    at the calibration model's shape (GQA for Qwen3: before version 6 DeepSeek-V3's 128 heads of
    q/k 192 and v 128, and its low-rank chains, were priced at Qwen3's rates)."""
    if m.attention != "mla":
        return calib.attention, calib.projections
    return calib.attention_mla or calib.attention, calib.projections_mla or calib.projections


def compute_ceilings(ceil: Ceilings, fraction: Num) -> Ceilings:
    """`ceil` with its FLOP rate set to `fraction` of the bf16 peak (memory and links unchanged)."""
    return replace(ceil, flops_per_s=ceil.peak_flops_per_s * np.asarray(fraction, dtype=float))


def fitted_fraction(work: Work, seconds: float, ceil: Ceilings, most: float = 1.0) -> float:
    """The fraction f of the bf16 peak at which `compute_ceilings(ceil, f).time(work)` is `seconds`:
    the inverse of how a calibrated stage is priced, so that a stage priced at a curve point's own
    size takes the time the probe measured, whatever else (HBM traffic: the fp32 main gradients of
    the expert weight gradients) the stage's work counts. `bench calibrate` fits every curve point
    with it, against the same stage functions the planner prices (`roofline.stages.expert_passes`,
    `attention_core_passes`). Where the other roofs and the latency alone take longer than
    `seconds`, no rate reproduces it: f is the lowest that keeps compute off the critical path
    (the stage is then priced at those roofs). Clipped to [1e-6, `most`] (1: the bf16 peak; an FP8
    rate may reach fp8_tflops / bf16_tflops of it)."""
    t = {k: float(np.asarray(v)) for k, v in ceil.times(work).items()}
    other = max(t["hbm"], t["nvlink"], t["scale-out"])
    compute_s = max(seconds - t["latency"], other, 1e-12)
    return float(min(most, max(1e-6, float(work.flops) / compute_s / ceil.peak_flops_per_s)))


def fitted_shared_fraction(works: Sequence[Work], seconds: float, ceil: Ceilings, most: float = 1.0) -> float:
    """The one fraction f of the bf16 peak at which the stages `works`, each priced on its own
    (`compute_ceilings(ceil, f).time`, as the planner sums separate stages), take `seconds` together:
    a pass measured whole that the planner prices as several stages (the FP8 expert backward: its
    data and weight gradients, `placement.cost.fp8_stages`). Fitting their summed `Work` instead
    would overlap one stage's HBM traffic with the other's FLOPs, which the planner's sum does not.
    Where the other roofs and latencies alone take longer than `seconds`, the lowest f that keeps
    compute off every stage's critical path (`fitted_fraction`'s rule). Clipped to [1e-6, `most`];
    found by bisection in log f (the sum does not grow with f)."""
    def total(f: float) -> float:
        fast = compute_ceilings(ceil, f)
        return sum(float(np.asarray(fast.time(w))) for w in works)

    target = max(seconds, total(most))
    lo, hi = np.log(1e-6), np.log(most)
    if total(1e-6) <= target:
        return 1e-6
    for _ in range(100):  # total(exp(lo)) > target >= total(exp(hi)); 100 halvings of 14: past float precision
        mid = 0.5 * (lo + hi)
        lo, hi = (lo, mid) if total(float(np.exp(mid))) <= target * (1 + 1e-12) else (mid, hi)
    return float(np.exp(hi))


def hbm_ceilings(ceil: Ceilings, fraction: Num) -> Ceilings:
    """`ceil` with its HBM rate times `fraction` (a memory-bound stage's measured share of it)."""
    return replace(ceil, hbm_bytes_per_s=ceil.hbm_bytes_per_s * np.asarray(fraction, dtype=float))


def fitted_hbm_fraction(work: Work, seconds: float, ceil: Ceilings) -> float:
    """The fraction f at which `hbm_ceilings(ceil, f).time(work)` is `seconds` (a memory-bound
    stage: its HBM bytes bind): the inverse of how `placement.cost.calibrated_stages` prices it, so
    the stage priced at the probe's own size takes the probe's measured time. Clipped to [1e-6, 1]
    (faster than the measured copy rate reads as that rate)."""
    t = {k: float(np.asarray(v)) for k, v in ceil.times(work).items()}
    return float(min(1.0, max(1e-6, t["hbm"] / max(seconds - t["latency"], 1e-12))))


def link_ceilings(ceil: Ceilings, link: LinkCost, collective: bool) -> Ceilings:
    """`ceil` with the NVLink-domain bandwidth and fixed cost of a measured transport: per message
    (`collective` False: one-sided / P2P messages) or per collective call. Scale-out traffic keeps
    the datasheet figures (a one-host calibration cannot measure it)."""
    latency = link.latency_us * 1e-6
    ceil = replace(ceil, nvlink_bytes_per_s=link.gbps * 1e9)
    return replace(ceil, collective_latency_s=latency) if collective else replace(ceil, nvlink_latency_s=latency)


def op_fixed_s(cal: Calibration, kind: str) -> float:
    """Measured fixed seconds of one schedule op of `kind` (0 when not measured)."""
    return cal.op_fixed_us.get(kind, 0.0) * 1e-6
