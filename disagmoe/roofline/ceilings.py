"""Turn `Work` into time: each resource's achievable rate, and which one binds.

A stage's time is the largest of its times under each ceiling (compute, HBM, NVLink, scale-out),
plus the latency of the messages on its critical path and any measured fixed cost (`Work.fixed_s`):
the roofline assumption that a well-built kernel overlaps its loads, math and stores. A calibrated
stage gets its own `Ceilings` (`roofline.calibration`): a rate from a measured curve, a transport's
measured latency and bandwidth.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from disagmoe.config import HardwareConfig
from disagmoe.roofline.stages import Num, Work

@dataclass(frozen=True)
class Ceilings:
    """Achievable rates of one GPU: FLOP/s and B/s after the efficiency factors."""

    flops_per_s: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    scaleout_bytes_per_s: float
    nvlink_latency_s: float
    scaleout_latency_s: float
    collective_latency_s: float
    peak_flops_per_s: float = 0.0  # the datasheet bf16 peak (calibrated rates are fractions of it)
    host_link_bytes_per_s: float = 0.0  # GPU <-> host, per direction (datasheet; 0: none given)

    @classmethod
    def of(cls, hw: HardwareConfig) -> Ceilings:
        e = hw.efficiency
        return cls(
            flops_per_s=hw.bf16_tflops * 1e12 * e.matmul,
            hbm_bytes_per_s=hw.hbm_gbps * 1e9 * e.hbm,
            nvlink_bytes_per_s=hw.nvlink_gbps * 1e9 * e.nvlink,
            scaleout_bytes_per_s=hw.scaleout_gbps * 1e9 * e.scaleout,
            nvlink_latency_s=hw.nvlink_latency_us * 1e-6,
            scaleout_latency_s=hw.scaleout_latency_us * 1e-6,
            collective_latency_s=hw.collective_latency_us * 1e-6,
            peak_flops_per_s=hw.bf16_tflops * 1e12,
            host_link_bytes_per_s=(hw.host_link_gbps or 0.0) * 1e9,
        )

    def first(self) -> Ceilings:
        """The first candidate's ceilings as plain floats (a calibrated rate may be an array)."""
        return Ceilings(*(float(np.asarray(getattr(self, f.name)).ravel()[0]) for f in fields(self)))

    def times(self, w: Work) -> dict[str, Num]:
        """Time of `w` under each ceiling alone (seconds)."""
        latency = np.where(np.asarray(w.scaleout_bytes) > 0, self.scaleout_latency_s, self.nvlink_latency_s)
        return {
            "compute": w.flops / self.flops_per_s,
            "hbm": w.hbm_bytes / self.hbm_bytes_per_s,
            "nvlink": w.nvlink_bytes / self.nvlink_bytes_per_s,
            "scale-out": w.scaleout_bytes / self.scaleout_bytes_per_s,
            # no host link given: unpriced (PlanConfig refuses offload without one)
            "host link": w.host_bytes / self.host_link_bytes_per_s if self.host_link_bytes_per_s else 0.0 * w.host_bytes,
            "latency": w.transfers * latency + w.collectives * self.collective_latency_s + w.fixed_s,
        }

    def time(self, w: Work) -> Num:
        """Roofline time: the slowest ceiling, plus message latency."""
        t = self.times(w)
        slowest = np.maximum(np.maximum(t["compute"], t["hbm"]), np.maximum(t["nvlink"], t["scale-out"]))
        return np.maximum(slowest, t["host link"]) + t["latency"]

    def bound(self, w: Work) -> str:
        """The ceiling that binds a scalar `Work` (latency binds when it exceeds every other term)."""
        t = {k: float(v) for k, v in self.times(w).items()}
        if not any(t.values()):
            return "none"
        return max(t, key=t.__getitem__)

    def ridge(self, link: str) -> float:
        """Arithmetic intensity (FLOP/byte) where the compute roof meets a memory or link roof."""
        rate = {"hbm": self.hbm_bytes_per_s, "nvlink": self.nvlink_bytes_per_s,
                "scale-out": self.scaleout_bytes_per_s}[link]
        return self.flops_per_s / rate
