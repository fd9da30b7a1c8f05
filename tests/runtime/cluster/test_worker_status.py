"""A worker reads its transport's status words in evaluation too (disagmoe/runtime/cluster/worker.py):
a message that did not fit or never came must stop the run there, not spoil a validation loss."""

from __future__ import annotations

import pytest

from disagmoe.runtime.observe.trace import SpanRecorder
from disagmoe.runtime.cluster.watchdog import OpWatchdog
from disagmoe.runtime.cluster.worker import TrainWorker


class _FailedTransport:
    """A transport whose GPU waits recorded a time-out (its status word's bit 2)."""

    def status_word(self):
        import torch

        return torch.tensor([2, 7], dtype=torch.int32)

    def check_status(self, status):
        if status[0]:
            raise TimeoutError(f"the wait for flag {status[1]} timed out")


def test_an_evaluation_batch_whose_wait_timed_out_raises():
    worker = TrainWorker.__new__(TrainWorker)  # the state evaluate() reads, without Ray or a model
    worker.rank, worker.program, worker.attention, worker.experts, worker.gpu_spans = 0, [], None, None, None
    worker.fp8_stats = None  # a bf16 rank
    worker.transport, worker.recorder = _FailedTransport(), SpanRecorder()
    worker.watchdog = OpWatchdog("rank 0", 60.0)
    try:
        with pytest.raises(TimeoutError, match="flag 7"):
            worker.evaluate(1)
    finally:
        worker.watchdog.close()
