"""`disagmoe bench profile`: where a single-GPU training step's GPU time goes, by kernel.

Runs `warmup` steps of `mode: single`, then `steps` steps under `torch.profiler`, and reports the
GPU kernels by total time, each also counted into a category (GEMM, attention, optimizer, copy /
cast, other elementwise, NCCL) by its name, the torch ops by the GPU time of the kernels they
launched themselves, and the share of the profiled steps' wall time the GPU was busy: the union of
the kernels' intervals (kernels on two streams at once count once). Where it was idle between two
kernels, the gaps are summed by the pair of kernels around them (`idle_gaps`): in a captured step
no launch gap is left, so what remains there names what the GPU waited on. A Chrome trace of the
profiled steps can be written for Perfetto.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disagmoe.bench.timing import device_intervals
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
    intervals = device_intervals(prof)
    kernels: dict[str, float] = {}
    for start, end, name in intervals:
        kernels[name] = kernels.get(name, 0.0) + end - start
    ops = sorted(((a.key, _self_device_s(a)) for a in prof.key_averages()
                  if a.device_type == torch.autograd.DeviceType.CPU and _self_device_s(a) > 0),
                 key=lambda kv: -kv[1])[:top]
    kernel_s = sum(kernels.values())
    busy_s, gaps = idle_gaps(intervals)
    by_category: dict[str, float] = {}
    for name, seconds in kernels.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + seconds
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    return {"steps": steps, "wall_s_per_step": wall_s / steps, "gpu_busy": busy_s / wall_s,
            "kernel_ms_per_step": kernel_s * 1e3 / steps,
            "categories": {c: s / kernel_s for c, s in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "kernels": [{"name": n[:120], "ms_per_step": s * 1e3 / steps, "share": s / kernel_s,
                         "category": category(n)} for n, s in ranked],
            "ops": [{"name": n[:120], "ms_per_step": s * 1e3 / steps, "share": s / kernel_s} for n, s in ops],
            "idle_gaps": [{"before": before[:120], "after": after[:120], "per_step": count / steps,
                           "ms_per_step": s * 1e3 / steps} for (before, after), (count, s) in gaps[:top]]}


def idle_gaps(intervals: list[tuple[float, float, str]],
              min_gap_s: float = 2e-6) -> tuple[float, list[tuple[tuple[str, str], tuple[int, float]]]]:
    """(busy seconds, idle gaps): the union of the kernels' (start, end, name) intervals, and the
    gaps of at least `min_gap_s` between them (a captured graph's own launch latency, about a
    microsecond a kernel, is below it), summed by (the kernel that ended last before the gap, the
    kernel after it), largest first as ((before, after), (count, seconds)). Kernels overlapping on
    two streams count once; time before the first and after the last kernel is in no gap."""
    busy_s, gaps = 0.0, {}
    span_start = span_end = None
    last = ""
    for start, end, name in sorted(intervals):
        if span_end is None:
            span_start, span_end, last = start, end, name
            continue
        if start > span_end:
            busy_s += span_end - span_start
            if start - span_end >= min_gap_s:
                count, total = gaps.get((last, name), (0, 0.0))
                gaps[(last, name)] = (count + 1, total + start - span_end)
            span_start, span_end, last = start, end, name
        elif end >= span_end:
            span_end, last = end, name
    if span_end is not None:
        busy_s += span_end - span_start
    return busy_s, sorted(gaps.items(), key=lambda kv: -kv[1][1])


def _self_device_s(avg: Any) -> float:
    """GPU seconds of the kernels an op launched itself (not its children's)."""
    value = getattr(avg, "self_device_time_total", None)
    if value is None:
        value = getattr(avg, "self_cuda_time_total", 0.0)
    return value / 1e6
