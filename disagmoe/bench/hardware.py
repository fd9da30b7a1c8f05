"""`disagmoe bench hardware`: measure this machine's ceilings and write a calibrated preset.

The roofline prices every stage from datasheet peaks times achievable fractions. This measures
the fractions on the GPUs at hand (dense bf16 matmul, HBM copy, GPU-to-GPU copy over NVLink and
the fixed cost of a small GPU-to-GPU copy) and writes a hardware YAML that `--hardware` accepts.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch
import yaml

from disagmoe.bench.timing import environment, hbm_copy_gbps, matmul_ceiling_tflops, median_ms
from disagmoe.config import HardwareConfig


@dataclass(frozen=True)
class Measured:
    """Rates measured on one machine (None: not measurable here, e.g. a single GPU)."""

    matmul_tflops: float
    hbm_gbps: float  # bytes read + written per second
    nvlink_gbps: float | None  # one direction, GPU 0 -> GPU 1
    nvlink_latency_us: float | None  # a 64 KiB GPU 0 -> GPU 1 copy


def measure(warmup: int = 5, iters: int = 20) -> Measured:
    """Time the four probes on cuda:0 (and cuda:1 when present)."""
    if not torch.cuda.is_available():
        raise ValueError("`disagmoe bench hardware` measures GPUs and needs a CUDA device; none is visible")
    dev0 = torch.device("cuda", 0)
    matmul = matmul_ceiling_tflops(dev0, warmup=warmup, iters=iters)
    hbm = hbm_copy_gbps(dev0, warmup, iters)  # 2 GiB
    nvlink = latency = None
    if torch.cuda.device_count() > 1:
        dev1 = torch.device("cuda", 1)
        far = torch.empty(256 * 2**20, device=dev1)  # 1 GiB
        near = torch.randn(far.numel(), device=dev0)
        nvlink = far.numel() * 4 / median_ms(lambda _: far.copy_(near, non_blocking=True), warmup, iters) / 1e6
        small_far, small_near = far[: 16 * 1024], near[: 16 * 1024]  # 64 KiB
        latency = median_ms(lambda _: small_far.copy_(small_near, non_blocking=True), warmup, iters * 5) * 1e3
    return Measured(matmul, hbm, nvlink, latency)


def calibrated(hw: HardwareConfig, m: Measured) -> HardwareConfig:
    """`hw` with its achievable fractions (and NVLink latency) taken from the measurements."""
    frac = lambda got, peak: min(1.0, max(1e-3, got / peak))  # noqa: E731
    eff = hw.efficiency.model_copy(update={"matmul": frac(m.matmul_tflops, hw.bf16_tflops),
                                           "hbm": frac(m.hbm_gbps, hw.hbm_gbps)})
    update: dict = {}
    if m.nvlink_gbps is not None:
        eff = eff.model_copy(update={"nvlink": frac(m.nvlink_gbps, hw.nvlink_gbps)})
    if m.nvlink_latency_us is not None:
        update["nvlink_latency_us"] = m.nvlink_latency_us
    source = f"`disagmoe bench hardware` {time.strftime('%Y-%m-%d')} (efficiencies measured) over {hw.source or hw.name}"
    return hw.model_copy(update={**update, "efficiency": eff, "name": f"{hw.name}-measured", "source": source})


def preset_yaml(hw: HardwareConfig, m: Measured, env: dict[str, str], command: str) -> str:
    """The calibrated preset as YAML, its provenance in a comment on top."""
    lines = [f"# Calibrated by `{command}` on {time.strftime('%Y-%m-%d')}:",
             "# " + ", ".join(f"{k} {v}" for k, v in env.items()),
             "# measured: " + ", ".join(f"{k} {v:.4g}" for k, v in asdict(m).items() if v is not None)]
    return "\n".join(lines) + "\n" + yaml.safe_dump(hw.model_dump(mode="json"), sort_keys=False)


def run(preset: HardwareConfig, command: str) -> tuple[Measured, HardwareConfig, str]:
    m = measure()
    hw = calibrated(preset, m)
    return m, hw, preset_yaml(hw, m, environment(torch.device("cuda", 0)), command)
