"""Sequence-numbered arrival flags (disagmoe/kernels/signal.py) under the interpreter, on CPU
tensors standing for peer buffers (flags raised before the waits: see the module docstring)."""

import pytest
import torch

from disagmoe.wire import ArenaOverflow


@pytest.fixture
def signal(interpreted):
    return interpreted("disagmoe.kernels.signal")


def test_flags_carry_the_steps_sequence_number_and_overflow(signal):
    flags = torch.zeros(4, dtype=torch.int64)
    status = signal.new_status("cpu")
    for seq in (1, 2, 3):  # nothing reset between steps
        signal.raise_flag(flags, 2, seq)
        signal.wait_flag(flags, 2, seq, status)
        assert int(flags[2]) == seq and status.tolist() == [0, 0]
    signal.check_status(status.tolist(), "rank 1")
    signal.raise_flag(flags, 0, 4, overflow=True)
    signal.wait_flag(flags, 0, 4, status)
    reference = signal.new_status("cpu")
    signal.wait_reference(flags, 0, 4, reference)
    assert int(flags[0]) == -4 and status.tolist() == [signal.OVERFLOW, 0] == reference.tolist()
    with pytest.raises(ArenaOverflow, match="rank 1: a message did not fit"):
        signal.check_status(status.tolist(), "rank 1")
    with pytest.raises(ValueError, match=">= 1"):
        signal.raise_flag(flags, 0, 0)
    with pytest.raises(ValueError, match="two int32 words"):
        signal.wait_flag(flags, 0, 4, torch.zeros(1, dtype=torch.int32))


def test_a_wait_passes_on_its_number_or_a_later_one_never_an_earlier(signal):
    """A segment shared by several keys carries its messages' count: a wait for n passes once the
    flag holds n or more (or -n or less: an overflow), never on a smaller number (an earlier key's);
    one look (timeout 0) reports that as timed out. `flag_value` counts per (peer, slot)."""
    flags = torch.tensor([0, 3, 5, -6], dtype=torch.int64)
    for index, seq, want in ((1, 3, [0, 0]), (2, 3, [0, 0]), (1, 4, [signal.TIMED_OUT, 1]),
                             (3, 5, [signal.OVERFLOW, 0]), (0, 1, [signal.TIMED_OUT, 0])):
        status = signal.new_status("cpu")
        signal._wait_flag_kernel[(1,)](flags, status, index, seq, 0, TIMED=False)
        assert status.tolist() == want, (index, seq)
    reference = signal.new_status("cpu")
    signal.wait_reference(flags, 2, 3, reference)
    assert reference.tolist() == [0, 0]
    with pytest.raises(AssertionError, match="not 4 or more"):
        signal.wait_reference(flags, 1, 4, reference)
    counts: dict = {}
    assert [signal.flag_value(counts, peer, "slot") for peer in (1, 1, 2, 1)] == [1, 2, 1, 3]


def test_a_timed_out_status_names_the_flag(signal):
    with pytest.raises(TimeoutError, match="rank 0: the wait for flag 3 timed out"):
        signal.check_status([signal.TIMED_OUT, 3], "rank 0")


def test_after_one_wait_timed_out_later_waits_give_up_at_once(signal):
    """One missing peer costs a step one timeout: a wait queued after a timed-out one looks once
    and records its own flag, instead of spinning for its whole timeout (here: for ever)."""
    flags = torch.zeros(4, dtype=torch.int64)
    status = torch.tensor([signal.TIMED_OUT, 1], dtype=torch.int32)  # an earlier wait gave up on flag 1
    signal.wait_flag(flags, 3, 5, status, timeout_s=60.0)  # flag 3 never rises
    assert status.tolist() == [signal.TIMED_OUT, 3]


@pytest.mark.gpu
def test_gpu_flags_pass_in_stream_order():
    from disagmoe.kernels import signal

    flags = torch.zeros(3, dtype=torch.int64, device="cuda")
    status = signal.new_status("cuda")
    for seq in (1, 2):
        signal.raise_flag(flags, 1, seq)
        signal.wait_flag(flags, 1, seq, status)  # queued behind the raise: passes
    torch.cuda.synchronize()
    assert flags.tolist() == [0, 2, 0] and status.tolist() == [0, 0]
    signal.wait_flag(flags, 2, 1, status, timeout_s=0.05)  # never raised: gives up and says which
    torch.cuda.synchronize()
    assert status.tolist() == [signal.TIMED_OUT, 2]
