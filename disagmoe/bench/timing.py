"""Shared GPU timing for the benchmarks: event-timed medians, matmul ceiling, environment, and the
warm-up that keeps a captured training step's capture steps out of what `bench train` and `bench
profile` time (`warmup_past_capture`)."""

from __future__ import annotations

import itertools
import platform
import shutil
import statistics
import subprocess
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from disagmoe.config import TrainConfig


def median_ms(fn: Callable[[int], object], warmup: int, iters: int) -> float:
    """Median over `iters` event-timed calls of fn(i) after `warmup` untimed ones.

    fn receives the call's index, so it can rotate among input copies (to keep data that would fit
    in L2 from being served out of it)."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0; got iters={iters}, warmup={warmup}")
    for i in range(warmup):
        fn(i)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for i in range(iters):
        starts[i].record()
        fn(warmup + i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def kernel_ms(fn: Callable[[int], object], warmup: int, iters: int) -> float:
    """Mean GPU kernel time per call of fn(i), ms, over `iters` calls after `warmup` untimed ones:
    the durations of the CUDA kernels (and device copies / fills) the calls launched, as the
    profiler (CUPTI) records them, summed and divided by `iters`.

    The host's launch overhead and the gaps between kernels are not in it, only what the GPU
    itself spends: the op's cost in a step where the host runs ahead of the GPU (`bench.calibrate`
    says why that is the cost model's unit). `median_ms` times the wall between two events
    instead, which for a tiny op is the host's time to launch it."""
    from torch.profiler import ProfilerActivity, profile

    if iters < 1 or warmup < 0:
        raise ValueError(f"need iters >= 1 and warmup >= 0; got iters={iters}, warmup={warmup}")
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(iters):
            fn(warmup + i)
        torch.cuda.synchronize()
    return sum(end - start for start, end, _ in device_intervals(prof)) * 1e3 / iters


def capture_steps(cfg: TrainConfig, steps: int | None = None, last: int | None = None) -> list[int]:
    """The steps (1-based) on which a run of `cfg` of `steps` steps (None: one long enough to capture
    every graph) captures its CUDA graphs, by the trainer's rule (`graphed_step.first_captures`), the
    run configured for `last` steps (None: `steps`; more: the run stops before its last, counted step); []
    where its step runs eagerly (`graphed_step.resolve_cuda_graphs`, whose ValueError a refused `on`
    raises). Mode single: the first step of each kind after `graphed_step.WARMUP_STEPS` eager ones: one
    kind, or two under precision fp8 counting its numerics every Nth step (`trainer.counts_fp8`: the
    first uncounted step and the first counted one, the last step in a run shorter than N). The
    distributed modes: a graph per phase of the transport's message counts, which repeat every step or
    alternate (`graphed_step.PhasedGraphs`); which of the two, the ranks' rings decide
    (`reuse_order.step_ring`), so this gives the alternating case's steps (`WARMUP_STEPS` + 1 and + 2):
    the latest the run captures."""
    from disagmoe.runtime.training.graphed_step import MAX_PHASE_GRAPHS, first_captures, resolve_cuda_graphs
    from disagmoe.runtime.training.trainer import counts_fp8

    captured, _ = resolve_cuda_graphs(cfg)
    if not captured:
        return []
    numbers = itertools.count(1) if steps is None else range(1, steps + 1)
    if cfg.mode != "single":
        return first_captures((step % 2 for step in numbers), MAX_PHASE_GRAPHS)
    every = cfg.counters_every
    last = (steps or 0) if last is None else last
    return first_captures((counts_fp8(step, every, 1, last) for step in numbers), 1 if every == 1 else 2)


def warmup_past_capture(cfg: TrainConfig, warmup: int, steps: int | None = None,
                        last: int | None = None) -> tuple[int, str | None]:
    """(the warm-up steps to leave untimed, why more than `warmup` or None): `warmup`, or where a run of
    `cfg` (`steps` steps, configured for `last`: `capture_steps`; None: as many as it takes) captures
    its step in CUDA graphs, at least through
    its capture steps (`capture_steps`), so that every timed step is a replay: a capture's
    host work (allocations, instantiation) leaves the GPU idle for a step's worth of time, which no
    replay has (session 21's Qwen3 profile read 120 ms of idle a step from it; an H100's `bench train`
    of the Mixtral config timed FP8 captures at 642 ms a step where `bench profile` read 488 ms of
    replays). A refused `cuda_graphs: on` raises `resolve_cuda_graphs`' ValueError."""
    captures = capture_steps(cfg, steps, last)
    if not captures or warmup >= captures[-1]:
        return warmup, None
    if cfg.mode != "single":
        on = (f"the rank steps are captured on step {captures[0]}" if len(captures) == 1 else
              f"the rank steps are captured on step {captures[0]}, and on step {captures[1]} where the transport's "
              "message counts alternate between two phases (a graph per phase)")
    elif len(captures) == 1:
        on = f"the step is captured on step {captures[0]}"
    else:
        on = (f"the step is captured on steps {captures[0]} and {captures[1]} (one graph for the steps without "
              "FP8 counters, one for those with)")
    return captures[-1], on


def device_intervals(prof: Any) -> list[tuple[float, float, str]]:
    """(start s, end s, name) of every GPU activity (kernels, copies, fills) a finished
    `torch.profiler.profile` recorded, from its raw kineto events, user ranges left out (their time
    is their kernels'). Not from `prof.events()`: on an H200 (torch 2.11, 2026-12-04) those held
    436 ms of a training step's kernels where its Chrome trace held 505 ms, missing among others a
    41 ms elementwise kernel of the backward (`bench profile` then showed 3 ms idle gaps where the
    trace showed the GPU never idle)."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(a.start_ns() / 1e9, (a.start_ns() + a.duration_ns()) / 1e9, a.name())
            for a in prof.profiler.kineto_results.events()
            if a.device_type() == cuda and not a.is_user_annotation() and not a.name().startswith("ProfilerStep")]


def hbm_copy_gbps(device: torch.device, warmup: int, iters: int, nbytes: int = 1 << 31) -> float:
    """GB/s of a device-to-device copy of `nbytes` (read + written, so 2 x nbytes a copy), the median
    of `iters` after `warmup`: the HBM rate a memory-bound pass can reach (`bench hardware`'s hbm)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_ms(lambda _: dst.copy_(src), warmup, iters) / 1e6


def host_events(prof: Any) -> list[tuple[float, float, str, bool]]:
    """(start s, end s, name, user range) of every host-side event a finished `torch.profiler.profile`
    recorded (ops, CUDA runtime calls such as cudaGraphLaunch or cudaStreamSynchronize, and the
    `record_function` ranges), on the clock of `device_intervals`."""
    cpu = torch.autograd.DeviceType.CPU
    return [(a.start_ns() / 1e9, (a.start_ns() + a.duration_ns()) / 1e9, a.name(), a.is_user_annotation())
            for a in prof.profiler.kineto_results.events() if a.device_type() == cpu]


def copies_to_defeat_l2(bytes_per_set: int, device: torch.device) -> int:
    """How many input copies to rotate among so that one pass over them exceeds twice the L2."""
    l2_bytes = torch.cuda.get_device_properties(device).L2_cache_size
    return max(1, -(-2 * l2_bytes // max(1, bytes_per_set)))


def rotating(copies: Sequence[object]) -> Callable[[int], object]:
    """Index -> one of the copies, round robin."""
    return lambda i: copies[i % len(copies)]


def matmul_ceiling_tflops(device: torch.device, size: int = 8192, warmup: int = 5,
                          iters: int = 20) -> float:
    """Dense bf16 torch.matmul rate on random size^3 operands (the practical ceiling)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    ms = median_ms(lambda _: a @ b, warmup, iters)
    return 2 * size**3 / ms / 1e9


def _driver_version() -> str:
    if shutil.which("nvidia-smi") is None:
        return "unknown (no nvidia-smi)"
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False)
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout else "unknown"


def environment(device: torch.device) -> dict[str, str]:
    """What produced the numbers: GPU, driver, CUDA, torch, triton, python."""
    import triton

    return {
        "gpu": torch.cuda.get_device_name(device),
        "driver": _driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
    }
