"""GPU timing helpers: kernel time is the GPU's own time, event time includes the host's."""

import pytest
import torch

from disagmoe.bench import timing


@pytest.mark.gpu
def test_kernel_time_equals_event_time_for_a_large_kernel_and_drops_the_host_for_tiny_ones():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    big_events, big_kernels = timing.median_ms(lambda _: a @ a, 3, 10), timing.kernel_ms(lambda _: a @ a, 3, 10)
    assert big_kernels == pytest.approx(big_events, rel=0.1)
    x = torch.zeros(16, device="cuda")
    many = lambda _: [x.add_(1.0) for _ in range(50)]  # noqa: E731  50 launches of a 16-element kernel
    assert timing.kernel_ms(many, 3, 10) < timing.median_ms(many, 3, 10)


def test_a_bad_count_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="iters >= 1"):
        timing.kernel_ms(lambda _: None, 0, 0)
