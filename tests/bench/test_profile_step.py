"""`bench profile`'s arithmetic on a CPU: busy time as the union of kernel intervals, and the idle
gaps between kernels summed by the pair around them."""

from __future__ import annotations

import random

import pytest

from disagmoe.bench.profile_step import category, idle_gaps


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
