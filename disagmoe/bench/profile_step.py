"""`disagmoe bench profile`: where a single-GPU training step's GPU time goes, by kernel.

Runs `warmup` steps of `mode: single` (where its step is captured, at least through its capture steps:
`timing.warmup_past_capture`), then `steps` steps under `torch.profiler`, and reports the
GPU kernels by total time, each also counted into a category (GEMM, attention, optimizer, copy /
cast, other elementwise, NCCL) by its name, the ops that launched them by their kernels' GPU time
(`kernel_ops`, from the profile's Chrome trace: in a captured step every kernel is the graph's, so
cuda_graphs=off names the ops), and the share of the profiled steps' wall time the GPU was busy: the union of
the kernels' intervals (kernels on two streams at once count once). Where it was idle between two
kernels, the gaps are summed by the pair of kernels around them (`idle_gaps`): in a captured step
no launch gap is left, so what remains there names what the GPU waited on. Each profiled step is
also split as `bench train` times it (`step_split`: from the trainer's sync before the step to its
sync after the read): before its first GPU activity (the launch), the activities' union (kernels,
and copies such as the batch's),
the idle between them, and after its last kernel (the read back), with the host's CUDA runtime calls
in that window by total time (`runtime_calls`: a slow cudaGraphLaunch shows there). Named kernel
families are set against their roofline bound (`bench.kernel_bounds`: the expert weight gradients, bf16 and FP8,
issue 20 item 2). A Chrome trace of the profiled steps can be written for Perfetto.
"""

from __future__ import annotations

import gzip
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from disagmoe.bench.gpu_clocks import GpuClockSampler
from disagmoe.bench.kernel_bounds import kernel_bounds
from disagmoe.bench.timing import capture_steps, device_intervals, host_events, warmup_past_capture
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
        trace: Path | None = None, top: int = 25, shapes: bool = False) -> dict[str, Any]:
    """Profile `steps` single-GPU steps after `warmup`; `shapes`: the ops table names each op with
    its inputs' dtypes, shapes and non-contiguous strides (`op_signature`)."""
    if cfg.device != "cuda" or not torch.cuda.is_available():
        raise ValueError("bench profile times GPU kernels; run it with device=cuda on a GPU host")
    from torch.profiler import ProfilerActivity, profile

    from disagmoe.runtime.training.trainer import TIMED_STEP_RANGE, SingleProcessTrainer

    asked = warmup
    warmup, why = profiled_warmup(cfg.model_copy(update={"mode": "single"}), warmup, steps)
    if why:
        log(f"warming up {warmup} steps, not {asked}: {why}, and the profiled steps are replays")
    # configured a step past the profiled ones: the run's last step, which counts its FP8 numerics
    # (`trainer.counts_fp8`), never runs, so no capture of the counting graph waits for it
    trainer = SingleProcessTrainer(cfg.model_copy(update={"mode": "single", "steps": warmup + steps + 1,
                                                          "trace": False, "checkpoint_minutes": 0}))
    if trainer.tiles_note:  # the bounds table below reads its expert GEMMs against these launches' tiles
        log(trainer.tiles_note)
    clocks = GpuClockSampler.for_devices([0])  # the profiled steps' clocks, to set beside bench train's
    with clocks:
        clocks.mark(0)  # the start of the first step (warmup 0: the profiled steps' clocks start here)
        for _ in range(warmup):
            trainer._train_one_step()
            clocks.mark()
        log(f"profiling {steps} steps after {warmup} warm-up steps" + counted_steps_note(trainer.cfg, warmup, steps))
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=shapes) as prof:
            began = time.perf_counter()
            for _ in range(steps):
                trainer._train_one_step()
                clocks.mark()
            torch.cuda.synchronize()
            wall_s = time.perf_counter() - began
    with tempfile.TemporaryDirectory() as tmp:
        trace_path = trace if trace is not None else Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace_path))  # gzip where the name ends in .gz
        opener = gzip.open if trace_path.suffix == ".gz" else open
        with opener(trace_path, "rt") as f:
            launched_by = kernel_ops(json.load(f)["traceEvents"], shapes)
    intervals = device_intervals(prof)
    host = host_events(prof)
    windows = [(start, end) for start, end, name, user in host if user and name == TIMED_STEP_RANGE]
    kernels: dict[str, float] = {}
    for start, end, name in intervals:
        kernels[name] = kernels.get(name, 0.0) + end - start
    ops = sorted(launched_by.items(), key=lambda kv: -kv[1])[:top]
    kernel_s = sum(kernels.values())
    busy_s, gaps = idle_gaps(intervals)
    by_category: dict[str, float] = {}
    for name, seconds in kernels.items():
        by_category[category(name)] = by_category.get(category(name), 0.0) + seconds
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1])[:top]
    per = max(len(windows), 1)
    return {"steps": steps, "warmup": warmup, "wall_s_per_step": wall_s / steps, "gpu_busy": busy_s / wall_s,
            "kernel_ms_per_step": kernel_s * 1e3 / steps,
            "categories": {c: s / kernel_s for c, s in sorted(by_category.items(), key=lambda kv: -kv[1])},
            "kernels": [{"name": n[:400], "ms_per_step": s * 1e3 / steps, "share": s / kernel_s,
                         "category": category(n)} for n, s in ranked],
            "ops": [{"name": n[:240], "ms_per_step": s * 1e3 / steps, "share": s / kernel_s} for n, s in ops],
            "idle_gaps": [{"before": before[:120], "after": after[:120], "per_step": count / steps,
                           "ms_per_step": s * 1e3 / steps} for (before, after), (count, s) in gaps[:top]],
            "step_split_ms": {part: s * 1e3 for part, s in step_split(windows, intervals).items()},
            "runtime_calls": [{"name": n[:120], "ms_per_step": s * 1e3 / per, "calls": c / per}
                              for n, (c, s) in runtime_calls(host, windows)[:8]],
            "bounds": kernel_bounds(trainer.cfg, trainer.model_cfg,
                                    {n: s * 1e3 / steps for n, s in kernels.items()}),
            "gpu_clocks": clocks.timed_summary(warmup), "gpu_clocks_note": clocks.timed_note(warmup),
            "expert_tiles_note": trainer.tiles_note}


def profiled_warmup(cfg: TrainConfig, warmup: int, steps: int) -> tuple[int, str | None]:
    """(the warm-up steps before `steps` profiled ones, why more than `warmup` or None): past the run's
    first CUDA-graph capture, so the profiled steps are replays, and through every other capture made
    before the profiled steps end (`timing.warmup_past_capture`), the run configured a step longer than it
    runs (its last, counted step never reached). So a precision-fp8 run counting its numerics every Nth
    step (`fp8_counters_every`) warms up through the counting graph's capture only where a multiple of N
    falls in its steps, not through step N whatever N is."""
    chosen = max([warmup, *capture_steps(cfg)[:1]])  # an unbounded run's first capture: none where it runs eagerly
    while True:  # a longer warm-up moves the profiled steps later: a capture may fall in them again
        captures = capture_steps(cfg, chosen + steps, chosen + steps + 1)
        if not captures or chosen >= captures[-1]:
            return warmup_past_capture(cfg, warmup, chosen + steps, chosen + steps + 1)
        chosen = captures[-1]


def counted_steps_note(cfg: TrainConfig, warmup: int, steps: int) -> str:
    """', of which K count their FP8 numerics (...)' where a precision-fp8 run counts on some steps only
    (`TrainConfig.fp8_counters_every`: the profiled steps' kernels then mix both kinds); '' elsewhere."""
    from disagmoe.runtime.training.trainer import counts_fp8

    every = cfg.counters_every
    if every == 1:
        return ""
    counted = sum(counts_fp8(s, every, 1, warmup + steps + 1) for s in range(warmup + 1, warmup + steps + 1))
    if counted == 0:
        return f", none of which counts its FP8 numerics (every {every}th step does)"
    return (f", of which {counted} count their FP8 numerics (every {every}th step: the kernels below mix both "
            "kinds; fp8_counters_every=1 profiles the counting step alone)")


def step_split(windows: list[tuple[float, float]], intervals: list[tuple[float, float, str]]) -> dict[str, float]:
    """Seconds per step, averaged over the step `windows` (host start, end, as the trainer times a
    step: between its syncs): "step" the window; "before first kernel" from its start to the first
    GPU activity inside it; "kernels" the union of the activities clipped to it; "idle between
    kernels" the rest between its first and last activity; "after last kernel" from the last one's
    end to the window's end. A window without activity counts whole before its (absent) first
    kernel. Also "between steps": the host's time from one window's end to the next one's start (the
    loop's own work, outside what `bench train` times: the next batch, the step's record), averaged
    over the pairs. Empty `windows`: every part zero."""
    parts = dict.fromkeys(("step", "before first kernel", "kernels", "idle between kernels", "after last kernel"), 0.0)
    ordered = sorted(windows)
    between = [b[0] - a[1] for a, b in zip(ordered, ordered[1:])]
    for start, end in windows:
        inside = sorted((max(s, start), min(e, end)) for s, e, _ in intervals if e > start and s < end)
        parts["step"] += end - start
        if not inside:
            parts["before first kernel"] += end - start
            continue
        busy, reach = 0.0, inside[0][0]
        for s, e in inside:
            busy += max(0.0, e - max(s, reach))
            reach = max(reach, e)
        parts["before first kernel"] += inside[0][0] - start
        parts["kernels"] += busy
        parts["idle between kernels"] += reach - inside[0][0] - busy
        parts["after last kernel"] += end - reach
    if windows:
        parts = {part: total / len(windows) for part, total in parts.items()}
    return {**parts, "between steps": sum(between) / len(between) if between else 0.0}


def runtime_calls(host: list[tuple[float, float, str, bool]], windows: list[tuple[float, float]],
                  ) -> list[tuple[str, tuple[int, float]]]:
    """The host's CUDA runtime and driver calls (names starting "cuda" or "cu") that began inside a
    step window: (name, (calls, seconds)), the longest total first."""
    totals: dict[str, tuple[int, float]] = {}
    for start, end, name, user in host:
        if user or not name.startswith("cu") or not any(w0 <= start < w1 for w0, w1 in windows):
            continue
        count, seconds = totals.get(name, (0, 0.0))
        totals[name] = (count + 1, seconds + end - start)
    return sorted(totals.items(), key=lambda kv: -kv[1][1])


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


GRAPH_REPLAY = "(a CUDA graph replay: cuda_graphs=off names the ops)"
TRACE_GPU_CATS = ("kernel", "gpu_memset", "gpu_memcpy")  # a Chrome trace's "cat" of GPU activities
TRACE_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")  # ... of the calls that launched them
TRACE_RANGE_CATS = ("cpu_op", "user_annotation")  # ... of the host ranges a launch lies in


def kernel_ops(events: list[dict], shapes: bool = False) -> dict[str, float]:
    """GPU seconds by the op that launched them, from a Chrome trace's events (`torch.profiler`'s
    export: each GPU activity's `correlation` is its launch call's, and the launch lies inside the
    host ranges that made it, on its thread: CPU ops and `record_function` ranges). An op reads
    `innermost range in nearest caller`: the innermost range around the launch and the nearest
    enclosing one that is neither an aten op nor the autograd engine (an autograd Function such as
    `FusedMoEFunctionBackward`, a `record_function` range such as `FlatAdamW.step`), e.g. `aten::mul
    in FusedMoEFunctionBackward`, or the range alone (`FlatAdamW.step` for the Triton update's
    kernel); a kernel launched in no range reads as the launch call (`cuLaunchKernelEx`). Kernels of
    a replayed CUDA graph were launched by the replay: they read as GRAPH_REPLAY. `shapes` (a trace
    recorded with `record_shapes`): the innermost op reads with its inputs (`op_signature`), so
    two copies of different tensors are two rows. Read H200 traces in session 16."""
    launches = {e["args"]["correlation"]: e for e in events if e.get("ph") == "X"
                and e.get("cat") in TRACE_LAUNCH_CATS and "correlation" in e.get("args", {})}
    ops_by_thread: dict[Any, list[dict]] = {}
    for e in events:
        if (e.get("ph") == "X" and e.get("cat") in TRACE_RANGE_CATS
                and not str(e.get("name", "")).startswith("ProfilerStep")):
            ops_by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    labels = _launch_labels(ops_by_thread, list(launches.values()), shapes)
    seconds: dict[str, float] = {}
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in TRACE_GPU_CATS:
            continue
        launch = launches.get(e.get("args", {}).get("correlation"))
        label = "(no launch recorded)" if launch is None else labels[id(launch)]
        seconds[label] = seconds.get(label, 0.0) + e.get("dur", 0.0) / 1e6
    return seconds


def _launch_labels(ops_by_thread: dict[Any, list[dict]], launches: list[dict], shapes: bool) -> dict[int, str]:
    """id(launch) -> its op label (`kernel_ops`), by one sweep per thread over op starts and
    launches in time order with the stack of ops still open."""
    labels: dict[int, str] = {}
    launches_by_thread: dict[Any, list[dict]] = {}
    for launch in launches:
        launches_by_thread.setdefault((launch.get("pid"), launch.get("tid")), []).append(launch)
    for thread, thread_launches in launches_by_thread.items():
        # outer before inner where two start together: the longer first, then a caller before an aten op
        ops = sorted(ops_by_thread.get(thread, []),
                     key=lambda o: (o["ts"], -o.get("dur", 0.0), o["name"].startswith("aten::")))
        stack: list[dict] = []
        i = 0
        for launch in sorted(thread_launches, key=lambda e: e["ts"]):
            while i < len(ops) and ops[i]["ts"] <= launch["ts"]:
                while stack and stack[-1]["ts"] + stack[-1].get("dur", 0.0) <= ops[i]["ts"]:  # ended
                    stack.pop()
                stack.append(ops[i])
                i += 1
            while stack and stack[-1]["ts"] + stack[-1].get("dur", 0.0) < launch["ts"]:
                stack.pop()
            labels[id(launch)] = _label(launch, stack, shapes)
    return labels


def _label(launch: dict, open_ops: list[dict], shapes: bool = False) -> str:
    if "GraphLaunch" in launch.get("name", ""):
        return GRAPH_REPLAY
    if not open_ops:
        return launch.get("name", "?")
    innermost = open_ops[-1]["name"] + (op_signature(open_ops[-1]) if shapes else "")
    caller = next((o["name"] for o in reversed(open_ops[:-1])
                   if not o["name"].startswith(("aten::", "autograd::engine"))), None)
    return innermost if caller is None else f"{innermost} in {caller}"


DTYPES = {"c10::BFloat16": "bf16", "float": "f32", "c10::Half": "f16", "double": "f64", "long int": "i64",
          "int": "i32", "bool": "bool", "c10::Float8_e4m3fn": "e4m3", "unsigned char": "u8"}


def op_signature(op: dict) -> str:
    """An op's tensor inputs as a record_shapes trace gives them (`Input Dims`, `Input type`,
    `Input Strides`), e.g. `(bf16[8,4096,32,128]{..}, bf16[8,32,4096,128])`: dtype, shape, and the
    strides where they are not the shape's contiguous ones; '' for an op with no tensor input."""
    args = op.get("args", {})
    dims, types, strides = args.get("Input Dims", []), args.get("Input type", []), args.get("Input Strides", [])
    parts = []
    for i, shape in enumerate(dims):
        if not isinstance(shape, list) or not shape or not all(isinstance(d, int) for d in shape):
            continue  # a scalar, a list of tensors, or an absent input
        dtype = types[i] if i < len(types) else "?"
        text = f"{DTYPES.get(dtype, dtype)}[{','.join(map(str, shape))}]"
        stride = strides[i] if i < len(strides) else None
        if isinstance(stride, list) and stride and stride != _contiguous_strides(shape):
            text += "{" + ",".join(map(str, stride)) + "}"
        parts.append(text)
    return f"({', '.join(parts)})" if parts else ""


def _contiguous_strides(shape: list[int]) -> list[int]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return strides[::-1]
