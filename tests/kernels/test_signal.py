"""Sequence-numbered arrival flags (disagmoe/kernels/signal.py) under the interpreter, on CPU
tensors standing for peer buffers (flags raised before the waits: see the module docstring)."""

import pytest
import torch

from disagmoe.comm.symmetric import ArenaOverflow


@pytest.fixture
def signal(interpreted):
    return interpreted("disagmoe.kernels.signal")


def test_flags_carry_the_steps_sequence_number_and_overflow(signal):
    flags = torch.zeros(4, dtype=torch.int64)
    status = torch.zeros(1, dtype=torch.int32)
    for seq in (1, 2, 3):  # nothing reset between steps
        signal.raise_flag(flags, 2, seq)
        signal.wait_flag(flags, 2, seq, status)
        assert int(flags[2]) == seq and int(status) == 0
    signal.check_status(status, "rank 1")
    signal.raise_flag(flags, 0, 4, overflow=True)
    signal.wait_flag(flags, 0, 4, status)
    reference = torch.zeros(1, dtype=torch.int32)
    signal.wait_reference(flags, 0, 4, reference)
    assert int(flags[0]) == -4 and int(status) == 1 == int(reference)
    with pytest.raises(ArenaOverflow, match="rank 1: a message did not fit"):
        signal.check_status(status, "rank 1")
    with pytest.raises(ValueError, match=">= 1"):
        signal.raise_flag(flags, 0, 0)


@pytest.mark.gpu
def test_gpu_flags_pass_in_stream_order():
    from disagmoe.kernels import signal

    flags = torch.zeros(3, dtype=torch.int64, device="cuda")
    status = torch.zeros(1, dtype=torch.int32, device="cuda")
    for seq in (1, 2):
        signal.raise_flag(flags, 1, seq)
        signal.wait_flag(flags, 1, seq, status)  # queued behind the raise: passes
    torch.cuda.synchronize()
    assert flags.tolist() == [0, 2, 0] and int(status) == 0
