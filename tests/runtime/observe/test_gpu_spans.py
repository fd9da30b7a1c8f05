"""Compute spans timed with CUDA events (disagmoe/runtime/observe/gpu_spans.py) and how the recorder adds them."""

import time

import pytest
import torch

from disagmoe.runtime.observe.gpu_spans import GpuSpans
from disagmoe.runtime.observe.trace import SpanRecorder


def test_added_spans_count_like_timed_ones():
    recorder = SpanRecorder(enabled=False)
    recorder.add("ExpertForward L1 mb0", "compute", 1_000.0, 2_500.0)
    recorder.add("Recv dispatch L1 mb0", "wait", 4_000.0, 100.0)
    assert recorder.drain() == ([], pytest.approx(0.0025))
    recorder.enabled = True
    recorder.add("ExpertForward L1 mb1", "compute", 5_000.0, 1_000.0)
    assert recorder.drain() == ([("ExpertForward L1 mb1", "compute", 5_000.0, 1_000.0)], pytest.approx(0.001))


def test_gpu_spans_need_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA"):
        GpuSpans(torch.device("cpu"))


@pytest.mark.gpu
def test_gpu_spans_time_the_kernels_without_waiting_for_them():
    device = torch.device("cuda", torch.cuda.current_device())
    spans = GpuSpans(device)
    a = torch.randn(4096, 4096, device=device)
    spans.begin_step()
    host_start_us = time.time_ns() / 1e3
    with spans.span("matmuls"):
        for _ in range(20):
            a = a @ a / 64
    with spans.span("nothing"):
        pass
    queued_us = time.time_ns() / 1e3 - host_start_us
    (name, category, start_us, duration_us), (empty, _, empty_start_us, empty_us) = spans.collect()
    assert category == "compute"
    assert (name, empty) == ("matmuls", "nothing")
    assert duration_us > queued_us  # the span is the GPU's time, longer than queueing the kernels took
    assert abs(start_us - host_start_us) < 5_000  # placed on the host's timeline
    assert empty_start_us >= start_us + duration_us - 1 and empty_us < 1_000
    assert spans.collect() == []
