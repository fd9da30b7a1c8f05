"""`disagmoe bench profile`: where a single-GPU training step's GPU time goes, by kernel.

Runs `warmup` steps of `mode: single`, then `steps` steps under `torch.profiler`, and reports the
GPU kernels by total time, each also counted into a category (GEMM, attention, optimizer, copy /
cast, other elementwise, NCCL) by its name, the torch ops by the GPU time of the kernels they
launched themselves, and the share of the profiled steps' wall time the GPU was busy. A Chrome trace of the profiled steps can be written for Perfetto.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disagmoe.bench.timing import is_annotation
from disagmoe.config import TrainConfig

CATEGORIES = (  # first match wins; names are lower-cased kernel names
    ("nccl", ("nccl",)),
    ("optimizer", ("adam", "multi_tensor", "foreach", "fused_adam")),
    ("attention", ("flash", "fmha", "attention", "sdpa", "cudnn")),
    ("gemm", ("gemm", "cutlass", "sm90", "wgmma", "matmul", "_ragged_rows", "_ragged_weight", "nvjet", "xmma")),
    ("copy/cast", ("copy", "cast", "convert", "to_copy", "memcpy", "memset", "fill")),
    ("elementwise", ("elementwise", "vectorized", "reduce", "index", "scatter", "gather", "sort", "softmax")),
)


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in name for k in keys)), "other")


def run(cfg: TrainConfig, steps: int, warmup: int, log: Callable[[str], None],
        trace: Path | None = None, top: int = 25) -> dict[str, Any]:
    if cfg.device != "cuda" or not torch.cuda.is_available():
        raise ValueError("bench profile times GPU kernels; run it with device=cuda on a GPU host")
    from torch.profiler import ProfilerActivity, profile

    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    trainer = SingleProcessTrainer(cfg.model_copy(update={"mode": "single", "steps": warmup + steps,
                                                          "trace": False, "checkpoint_minutes": 0}))
    for _ in range(warmup):
        trainer._train_one_step()
    log(f"profiling {steps} steps after {warmup} warm-up steps")
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            trainer._train_one_step()
        torch.cuda.synchronize()
        wall_s = time.perf_counter() - start
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    kernels: dict[str, float] = {}
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CUDA and not is_annotation(evt):
            kernels[evt.name] = kernels.get(evt.name, 0.0) + evt.device_time / 1e6
    ops = sorted(((a.key, _self_device_s(a)) for a in prof.key_averages()
                  if a.device_type == torch.autograd.DeviceType.CPU and _self_device_s(a) > 0),
                 key=lambda kv: -kv[1])[:top]
    busy_s = sum(kernels.values())
    by_category: dict[str, float] = {}
    for name, seconds in kernels.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + seconds
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {"steps": steps, "wall_s_per_step": wall_s / steps, "gpu_busy": busy_s / wall_s,
            "categories": {c: s / busy_s for c, s in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "kernels": [{"name": n[:120], "ms_per_step": s * 1e3 / steps, "share": s / busy_s,
                         "category": category(n)} for n, s in ranked],
            "ops": [{"name": n[:120], "ms_per_step": s * 1e3 / steps, "share": s / busy_s} for n, s in ops]}


def _self_device_s(avg: Any) -> float:
    """GPU seconds of the kernels an op launched itself (not its children's)."""
    value = getattr(avg, "self_device_time_total", None)
    if value is None:
        value = getattr(avg, "self_cuda_time_total", 0.0)
    return value / 1e6
