"""Measured terms on top of the roofline: efficiency curves and per-transport costs.

A `HardwareConfig.calibration` (written by `disagmoe bench calibrate`) holds
- curves of (size, fraction of the bf16 peak) points: the expert GEMMs against rows per expert,
  the attention core against sequence length. `curve_fraction` interpolates linearly in log(size)
  and clamps at the end points (no extrapolation: outside the measured range the nearest
  measurement holds);
- transports as latency + bytes / bandwidth (`LinkCost`): NCCL send/recv, all-reduce, all-to-all;
- fixed seconds per schedule op (`op_fixed_s`).

Each turns into a `Ceilings` for one stage (`compute_ceilings`, `link_ceilings`): the stage's
`Work` stays the same FLOPs and bytes, only its rates change. numpy only (no torch): the planner
imports this.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from disagmoe.config import Calibration, LinkCost, RatePoint
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.stages import Num


def curve_fraction(points: list[RatePoint], at: Num, bwd: bool) -> np.ndarray:
    """The fraction of peak at `at` (array-broadcastable): interpolated in log(at) between the
    measured points, the end points' value outside them. `points` must be non-empty."""
    if not points:
        raise ValueError("an efficiency curve needs at least one measured point")
    xs = np.log([p.at for p in points])
    ys = np.array([p.bwd if bwd else p.fwd for p in points])
    return np.interp(np.log(np.maximum(np.asarray(at, dtype=float), 1e-30)), xs, ys)


def compute_ceilings(ceil: Ceilings, fraction: Num) -> Ceilings:
    """`ceil` with its FLOP rate set to `fraction` of the bf16 peak (memory and links unchanged)."""
    return replace(ceil, flops_per_s=ceil.peak_flops_per_s * np.asarray(fraction, dtype=float))


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
