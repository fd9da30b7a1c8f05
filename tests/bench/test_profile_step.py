"""`bench profile`'s arithmetic on a CPU: the GPU activities read from the raw kineto events, busy
time as the union of their intervals, and the idle gaps between kernels summed by the pair around
them."""

from __future__ import annotations

import random
import types

import pytest
import torch

from disagmoe.bench.profile_step import GRAPH_REPLAY, category, idle_gaps, kernel_ops
from disagmoe.bench.timing import device_intervals


def test_busy_is_the_union_and_gaps_are_summed_by_the_kernels_around_them() -> None:
    # two steps: a, b (overlapping a on a second stream), a 40 us wait, c; then a 5 us wait, a again
    us = 1e-6
    intervals = [(0 * us, 10 * us, "a"), (5 * us, 20 * us, "b"), (60 * us, 70 * us, "c"),
                 (75 * us, 80 * us, "a"), (80 * us, 90 * us, "b"), (130 * us, 140 * us, "c")]
    random.Random(0).shuffle(intervals)  # the profiler's order is not the GPU's
    busy, gaps = idle_gaps(intervals)
    assert busy == pytest.approx(20 * us + 10 * us + 15 * us + 10 * us)
    assert [pair for pair, _ in gaps] == [("b", "c"), ("c", "a")]
    assert gaps[0][1] == (2, pytest.approx(80 * us)) and gaps[1][1] == (1, pytest.approx(5 * us))


def test_a_kernel_inside_another_leaves_the_outer_one_as_the_gaps_left_side() -> None:
    us = 1e-6
    busy, gaps = idle_gaps([(0.0, 50 * us, "long"), (10 * us, 20 * us, "short"), (80 * us, 90 * us, "next")])
    assert busy == pytest.approx(60 * us)
    assert gaps == [(("long", "next"), (1, pytest.approx(30 * us)))]


def test_gaps_below_the_launch_latency_are_not_idle_time_and_empty_input_is_zero() -> None:
    us = 1e-6
    busy, gaps = idle_gaps([(0.0, 10 * us, "a"), (11 * us, 20 * us, "b")])
    assert busy == pytest.approx(19 * us) and gaps == []
    assert idle_gaps([]) == (0.0, [])


@pytest.mark.parametrize(("kernel", "want"), [
    ("_ragged_weight_grad_kernel", "gemm"), ("void at::native::vectorized_gather_kernel<16, long>", "elementwise"),
    ("multi_tensor_apply_kernel", "optimizer"), ("_adamw_kernel", "optimizer"), ("_combine_kernel", "other")])
def test_kernels_fall_into_their_categories(kernel: str, want: str) -> None:
    assert category(kernel) == want


class _Activity:
    def __init__(self, name: str, device: torch.autograd.DeviceType, start_ns: int, duration_ns: int,
                 annotation: bool = False) -> None:
        self._name, self._device, self._start, self._duration, self._annotation = (
            name, device, start_ns, duration_ns, annotation)

    def name(self) -> str:
        return self._name

    def device_type(self) -> torch.autograd.DeviceType:
        return self._device

    def start_ns(self) -> int:
        return self._start

    def duration_ns(self) -> int:
        return self._duration

    def is_user_annotation(self) -> bool:
        return self._annotation


def test_device_intervals_are_the_gpu_activities_without_user_ranges() -> None:
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
    activities = [_Activity("aten::mul", cpu, 0, 5_000), _Activity("elementwise_kernel", cuda, 1_000, 3_000),
                  _Activity("Optimizer.step#AdamW.step", cuda, 0, 9_000, annotation=True),
                  _Activity("ProfilerStep#1", cuda, 0, 9_000), _Activity("Memset (Device)", cuda, 4_000, 500)]
    prof = types.SimpleNamespace(profiler=types.SimpleNamespace(
        kineto_results=types.SimpleNamespace(events=lambda: activities)))
    assert device_intervals(prof) == [(pytest.approx(1e-6), pytest.approx(4e-6), "elementwise_kernel"),
                                      (pytest.approx(4e-6), pytest.approx(4.5e-6), "Memset (Device)")]


def test_device_intervals_read_a_real_profile() -> None:
    """The raw kineto events carry the methods read (a CPU-only profile: no GPU activity)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.randn(64, 64) @ torch.randn(64, 64)
    assert device_intervals(prof) == []
    mm = next(e for e in prof.profiler.kineto_results.events() if e.name() == "aten::mm")
    assert mm.device_type() == torch.autograd.DeviceType.CPU and not mm.is_user_annotation()
    assert mm.start_ns() > 0 and mm.duration_ns() > 0


def _x(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": tid, "args": args}


def test_kernels_are_charged_to_the_innermost_op_and_its_nearest_caller() -> None:
    """A trace shaped as torch's export: the backward's mul inside an autograd Function inside the
    engine, a forward matmul on another thread, a kernel whose launch no op encloses, a graph replay."""
    events = [
        _x("cpu_op", "autograd::engine::evaluate_function: FusedMoEFunctionBackward", 0, 100, tid=2),
        _x("cpu_op", "FusedMoEFunctionBackward", 1, 98, tid=2),
        _x("cpu_op", "aten::mul", 10, 5, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 11, 1, tid=2, correlation=7),
        _x("cpu_op", "aten::to", 20, 10, tid=2),
        _x("cpu_op", "aten::copy_", 21, 5, tid=2),
        _x("cuda_runtime", "cudaLaunchKernel", 22, 1, tid=2, correlation=8),
        _x("cpu_op", "aten::mm", 0, 5, tid=1),
        _x("cuda_runtime", "cudaLaunchKernel", 1, 1, tid=1, correlation=9),
        _x("cuda_driver", "cuLaunchKernelEx", 50, 1, tid=1, correlation=10),
        _x("cuda_runtime", "cudaGraphLaunch", 60, 1, tid=1, correlation=11),
        _x("kernel", "elementwise_kernel", 200, 2400, correlation=7),
        _x("kernel", "elementwise_kernel", 2700, 100, correlation=7),
        _x("kernel", "vectorized_copy", 2900, 700, correlation=8),
        _x("kernel", "nvjet_gemm", 3700, 300, correlation=9),
        _x("gpu_memset", "Memset (Device)", 4000, 10, correlation=10),
        _x("kernel", "_ragged_rows_gemm_kernel", 4100, 50, correlation=11),
        _x("kernel", "_ragged_rows_gemm_kernel", 4200, 50, correlation=11),
        _x("kernel", "orphan", 4300, 5, correlation=99),
    ]
    seconds = kernel_ops(events)
    us = 1e-6
    assert seconds == {"aten::mul in FusedMoEFunctionBackward": pytest.approx(2500 * us),
                       "aten::copy_ in FusedMoEFunctionBackward": pytest.approx(700 * us),
                       "aten::mm": pytest.approx(300 * us), "cuLaunchKernelEx": pytest.approx(10 * us),
                       GRAPH_REPLAY: pytest.approx(100 * us), "(no launch recorded)": pytest.approx(5 * us)}


def test_user_ranges_are_callers_touching_ops_are_closed_and_equal_starts_nest_caller_first() -> None:
    """A `record_function` range (user_annotation) names its kernels' caller; an op that ends where
    the next starts is closed by then; an aten op starting with its caller at the same instant and
    for as long nests inside it, whichever the trace lists first; ProfilerStep ranges are no caller."""
    events = [
        _x("user_annotation", "ProfilerStep#3", 0, 1000),
        _x("user_annotation", "FlatAdamW.step", 100, 50),
        _x("cuda_driver", "cuLaunchKernelEx", 110, 1, correlation=1),
        _x("cpu_op", "MyFn", 200, 20),
        _x("cpu_op", "aten::add", 220, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 225, 1, correlation=2),
        _x("cpu_op", "aten::mul", 300, 10),
        _x("cpu_op", "OtherFn", 300, 10),
        _x("cuda_runtime", "cudaLaunchKernel", 305, 1, correlation=3),
        _x("kernel", "_adamw_kernel", 400, 30, correlation=1),
        _x("kernel", "add_kernel", 450, 10, correlation=2),
        _x("kernel", "mul_kernel", 470, 10, correlation=3),
    ]
    us = 1e-6
    assert kernel_ops(events) == {"FlatAdamW.step": pytest.approx(30 * us),
                                  "aten::add": pytest.approx(10 * us),
                                  "aten::mul in OtherFn": pytest.approx(10 * us)}


def test_with_shapes_each_op_reads_with_its_inputs() -> None:
    """A record_shapes trace: two copies of different tensors are two rows, each naming its inputs'
    dtype and shape and, where not contiguous, their strides; scalars and tensor lists are left out."""
    dims = {"Input Dims": [[8, 32, 4096, 128], [8, 4096, 32, 128], []],
            "Input type": ["c10::BFloat16", "c10::BFloat16", "Scalar"],
            "Input Strides": [[16777216, 524288, 128, 1], [16777216, 128, 4096, 1], []]}
    events = [
        _x("cpu_op", "ViewBackward0", 0, 100),
        _x("cpu_op", "aten::copy_", 10, 20, **dims),
        _x("cuda_runtime", "cudaLaunchKernel", 11, 1, correlation=1),
        _x("cpu_op", "aten::copy_", 40, 20, **{"Input Dims": [[4, 2]], "Input type": ["float"],
                                               "Input Strides": [[2, 1]]}),
        _x("cuda_runtime", "cudaLaunchKernel", 41, 1, correlation=2),
        _x("kernel", "elementwise_kernel", 200, 30, correlation=1),
        _x("kernel", "elementwise_kernel", 300, 10, correlation=2),
    ]
    us = 1e-6
    assert kernel_ops(events, shapes=True) == {
        "aten::copy_(bf16[8,32,4096,128], bf16[8,4096,32,128]{16777216,128,4096,1}) in ViewBackward0":
            pytest.approx(30 * us),
        "aten::copy_(f32[4,2]) in ViewBackward0": pytest.approx(10 * us)}
    assert kernel_ops(events) == {"aten::copy_ in ViewBackward0": pytest.approx(40 * us)}


def test_a_step_is_split_into_its_lead_kernels_gaps_and_tail() -> None:
    """`step_split`: per window, the time before its first kernel (the launch), the union of its
    kernels clipped to it (overlaps once), the idle between them, and after the last one; averaged
    over the windows; a window without kernels counts whole before its first; none: zeros."""
    from disagmoe.bench.profile_step import step_split

    ms = 1e-3
    windows = [(0.0, 100 * ms), (200 * ms, 260 * ms)]
    intervals = [(5 * ms, 40 * ms, "a"), (30 * ms, 50 * ms, "b"), (60 * ms, 90 * ms, "c"),  # step 1
                 (150 * ms, 210 * ms, "spills in"), (220 * ms, 250 * ms, "d")]  # step 2: one starts before it
    split = step_split(windows, intervals)
    want = {"step": 80, "before first kernel": 2.5, "kernels": (75 + 40) / 2, "idle between kernels": 10,
            "after last kernel": 10, "between steps": 100}
    assert split == pytest.approx({k: v * ms for k, v in want.items()})
    assert sum(v for k, v in split.items() if k not in ("step", "between steps")) == pytest.approx(split["step"])
    assert step_split([(0.0, 1.0)], [])["before first kernel"] == 1.0
    assert set(step_split([], intervals).values()) == {0.0}


def test_runtime_calls_count_the_hosts_cuda_calls_inside_the_steps() -> None:
    from disagmoe.bench.profile_step import runtime_calls

    host = [(0.01, 0.03, "cudaGraphLaunch", False), (0.05, 0.06, "cudaStreamSynchronize", False),
            (0.07, 0.071, "cudaGraphLaunch", False), (0.5, 0.9, "cudaGraphLaunch", False),  # outside the steps
            (0.0, 0.1, "disagmoe timed step", True), (0.02, 0.04, "aten::copy_", False)]
    assert runtime_calls(host, [(0.0, 0.1)]) == [("cudaGraphLaunch", (2, pytest.approx(0.021))),
                                                 ("cudaStreamSynchronize", (1, pytest.approx(0.01)))]


def test_a_profile_of_steps_of_both_kinds_says_how_many_counted():
    from disagmoe.bench.profile_step import counted_steps_note
    from disagmoe.config import load_train_config

    cfg = load_train_config("configs/tiny-cpu.yaml", ["device=cuda", "mode=single", "experts_backend=triton"])
    assert counted_steps_note(cfg, 10, 3) == ""  # bf16
    fp8 = cfg.model_copy(update={"precision": "fp8"})
    # the profiled run stops a step before its configured last (counted) one: only every 10th step counts
    assert counted_steps_note(fp8, 10, 3).startswith(", none of which counts its FP8 numerics")  # 11-13
    assert counted_steps_note(fp8, 8, 4).startswith(", of which 1 count their FP8 numerics")  # 10 of 9-12
    assert counted_steps_note(fp8, 8, 13).startswith(", of which 2 count")  # 10 and 20


def test_a_profile_warms_up_through_the_captures_its_own_steps_reach_only():
    """`profiled_warmup`: through the bf16 graph's capture (step 4); under precision fp8 through the counting
    graph's capture only where a counting step (every Nth) falls before the profiled steps end: a large
    fp8_counters_every warms up 4 steps, not N (the run's configured last step, which counts, never runs)."""
    from disagmoe.bench.profile_step import profiled_warmup
    from disagmoe.config import load_train_config

    cfg = load_train_config("configs/tiny-cpu.yaml", ["device=cuda", "mode=single", "experts_backend=triton"])
    assert profiled_warmup(cfg, 0, 3)[0] == 4 and profiled_warmup(cfg, 6, 3) == (6, None)
    fp8 = cfg.model_copy(update={"precision": "fp8"})  # counting every 10th step
    assert profiled_warmup(fp8, 3, 3)[0] == 4  # steps 5-7: no counting step
    warmup, why = profiled_warmup(fp8, 3, 8)  # steps 5-12 would reach step 10: warmed up through its capture
    assert warmup == 10 and "steps 4 and 10" in why
    assert profiled_warmup(fp8.model_copy(update={"fp8_counters_every": 1000}), 3, 2)[0] == 4


def test_an_eager_profile_warms_up_as_asked():
    """`bench profile ... cuda_graphs=off` (the run captures nothing): the asked warm-up, no reason given
    (it raised TypeError before: `max` of one int, session 44's H100 call)."""
    from disagmoe.bench.profile_step import profiled_warmup
    from disagmoe.config import load_train_config

    cfg = load_train_config("configs/tiny-cpu.yaml", ["device=cuda", "mode=single", "experts_backend=triton",
                                                      "cuda_graphs=off"])
    assert profiled_warmup(cfg, 3, 1) == (3, None) and profiled_warmup(cfg, 0, 2) == (0, None)


@pytest.mark.gpu
def test_cuda_a_profile_reports_its_steps_and_their_clocks():
    """`bench profile` on the tiny config on a GPU: its step split, the profiled steps' GPU clocks
    (or why none were sampled), and the expert weight gradients against their roofline bound."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from disagmoe.bench import profile_step
    from disagmoe.config import load_train_config

    cfg = load_train_config("configs/tiny-cpu.yaml", ["device=cuda", "experts_backend=triton", "hardware=h200-sxm"])
    record = profile_step.run(cfg, steps=2, warmup=1, log=lambda _: None)
    assert record["kernel_ms_per_step"] > 0 and record["step_split_ms"]
    (wgrad,) = record["bounds"]  # the expert weight gradients against their bound
    assert wgrad["ms_per_step"] > 0 and wgrad["ratio"] > 0, wgrad
    assert record["gpu_clocks"] is not None or record["gpu_clocks_note"], record
