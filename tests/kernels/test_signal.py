"""Counting arrival flags (disagmoe/kernels/signal.py) under the interpreter, on CPU tensors
standing for peer buffers (flags raised before the waits: see the module docstring)."""

import pytest
import torch

from disagmoe.wire import ArenaOverflow

_claim = None  # `signal.claim` of the interpreted build, for the test kernel below


@pytest.fixture
def signal(interpreted):
    return interpreted("disagmoe.kernels.signal")


def _look_once(signal, flags_W, consumed_W, index):
    """A wait that looks once (timeout 0) and the status it leaves."""
    status = signal.new_status("cpu")
    signal._wait_flag_kernel[(1,)](flags_W, consumed_W, status, index, 0, TIMED=False)
    return status.tolist()


def test_two_messages_to_one_flag_word_are_consumed_in_order(signal):
    flags, status = torch.zeros(4, dtype=torch.int64), signal.new_status("cpu")
    consumed = signal.new_consumed(flags)
    signal.raise_flag(flags, 2)
    signal.raise_flag(flags, 2)
    signal.wait_flag(flags, consumed, 2, status)
    assert consumed.tolist() == [0, 0, 1, 0] and status.tolist() == [0, 0]
    signal.wait_flag(flags, consumed, 2, status)
    assert flags.tolist() == [0, 0, 2, 0] and consumed.tolist() == [0, 0, 2, 0] and status.tolist() == [0, 0]
    assert _look_once(signal, flags, consumed, 2) == [signal.TIMED_OUT, 2]  # a third never came
    assert consumed.tolist() == [0, 0, 3, 0]  # a wait claims its message when it starts


def test_a_replayed_wait_with_the_same_host_arguments_needs_the_next_arrival(signal):
    """What a CUDA graph replay does: the same launch, the same host arguments. The wait compares
    against the consumed word it advances itself, so the second pass waits for the second
    message, never passes on the first's flag."""
    flags, status = torch.zeros(3, dtype=torch.int64), signal.new_status("cpu")
    consumed = signal.new_consumed(flags)

    def receive():  # the captured wait: nothing here changes between passes
        signal.wait_flag(flags, consumed, 1, status, timeout_s=30.0)

    signal.raise_flag(flags, 1)
    receive()
    assert (int(flags[1]), int(consumed[1]), status.tolist()) == (1, 1, [0, 0])
    assert _look_once(signal, flags, consumed.clone(), 1) == [signal.TIMED_OUT, 1]  # before the second arrival
    signal.raise_flag(flags, 1)
    receive()
    assert (int(flags[1]), int(consumed[1]), status.tolist()) == (2, 2, [0, 0])
    reference_flags, reference_consumed = torch.tensor([0, 2, 0]), torch.tensor([0, 1, 0])
    reference = signal.new_status("cpu")
    signal.wait_reference(reference_flags, reference_consumed, 1, reference)
    assert reference_consumed.tolist() == [0, 2, 0] and reference.tolist() == [0, 0]
    with pytest.raises(AssertionError, match="counts 2 messages, not 3 or more"):
        signal.wait_reference(reference_flags, reference_consumed, 1, reference)


def test_a_failed_send_wakes_the_wait_with_an_overflow(signal):
    """The sender of a message that did not fit sets its flag to FAILED: the wait passes at once
    and records OVERFLOW, whatever it had consumed, and later counts keep it failed."""
    flags, status = torch.zeros(2, dtype=torch.int64), signal.new_status("cpu")
    consumed = torch.tensor([0, 7], dtype=torch.int64)
    signal.raise_flag(flags, 1, failed=True)
    signal.raise_flag(flags, 1)  # a count after the failure: still failed
    assert int(flags[1]) == signal.FAILED + 1
    signal.wait_flag(flags, consumed, 1, status)
    assert status.tolist() == [signal.OVERFLOW, 0] and consumed.tolist() == [0, 8]
    reference = signal.new_status("cpu")
    signal.wait_reference(flags, torch.tensor([0, 7]), 1, reference)
    assert reference.tolist() == status.tolist()
    with pytest.raises(ArenaOverflow, match="rank 1: a message did not fit"):
        signal.check_status(status.tolist(), "rank 1")


def test_arguments_are_checked(signal):
    flags = torch.zeros(4, dtype=torch.int64)
    consumed = signal.new_consumed(flags)
    with pytest.raises(ValueError, match="two int32 words"):
        signal.wait_flag(flags, consumed, 0, torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"consumed words must be int64 \(4,\)"):
        signal.wait_flag(flags, consumed[:3], 0, signal.new_status("cpu"))
    with pytest.raises(ValueError, match="outside the arena's 4 flag words"):
        signal.raise_flag(flags, 4)
    with pytest.raises(ValueError, match="timeout_s=0 must be > 0"):
        signal.wait_flag(flags, consumed, 0, signal.new_status("cpu"), timeout_s=0)


def test_the_waits_of_one_launch_for_one_message_claim_the_same_number(signal, interpreted):
    """`claim` with `items` waits per message (a combine's column blocks of one segment): every
    program of a launch gets the same k, and the consumed word counts messages between launches."""
    import triton
    import triton.language as tl

    global _claim  # the interpreter runs the kernel's source again with this module's globals (no closures)
    _claim = signal.claim

    @triton.jit
    def claim_kernel(consumed_ptr, out_ptr, items):
        tl.store(out_ptr + tl.program_id(0), _claim(consumed_ptr + 1, items))

    consumed, out = torch.zeros(3, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)
    for k in (1, 2, 3):
        claim_kernel[(5,)](consumed, out, 5)
        assert out.tolist() == [k] * 5 and consumed.tolist() == [0, k, 0]


def test_a_timed_out_status_names_the_flag(signal):
    with pytest.raises(TimeoutError, match="rank 0: the wait for flag 3 timed out"):
        signal.check_status([signal.TIMED_OUT, 3], "rank 0")


def test_after_one_wait_timed_out_later_waits_give_up_at_once(signal):
    """One missing peer costs a step one timeout: a wait queued after a timed-out one looks once
    and records its own flag, instead of spinning for its whole timeout (here: for ever)."""
    flags = torch.zeros(4, dtype=torch.int64)
    status = torch.tensor([signal.TIMED_OUT, 1], dtype=torch.int32)  # an earlier wait gave up on flag 1
    signal.wait_flag(flags, signal.new_consumed(flags), 3, status, timeout_s=60.0)  # flag 3 never rises
    assert status.tolist() == [signal.TIMED_OUT, 3]


@pytest.mark.gpu
def test_gpu_flags_pass_in_stream_order():
    from disagmoe.kernels import signal

    flags = torch.zeros(3, dtype=torch.int64, device="cuda")
    consumed, status = signal.new_consumed(flags), signal.new_status("cuda")
    for _ in range(2):
        signal.raise_flag(flags, 1)
        signal.wait_flag(flags, consumed, 1, status)  # queued behind the raise: passes
    torch.cuda.synchronize()
    assert flags.tolist() == [0, 2, 0] and consumed.tolist() == [0, 2, 0] and status.tolist() == [0, 0]
    signal.wait_flag(flags, consumed, 2, status, timeout_s=0.05)  # never raised: gives up and says which
    torch.cuda.synchronize()
    assert status.tolist() == [signal.TIMED_OUT, 2]


@pytest.mark.gpu
def test_gpu_a_captured_wait_replays_for_the_next_message():
    """A raise and a wait captured in one CUDA graph, replayed: each replay counts one more
    message and waits for it (the graph holds no message number)."""
    from disagmoe.kernels import signal

    flags = torch.zeros(2, dtype=torch.int64, device="cuda")
    consumed, status = signal.new_consumed(flags), signal.new_status("cuda")
    signal.raise_flag(flags, 1)
    signal.wait_flag(flags, consumed, 1, status, timeout_s=5.0)  # compiled and loaded before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        signal.raise_flag(flags, 1)
        signal.wait_flag(flags, consumed, 1, status, timeout_s=5.0)
    for replay in (2, 3, 4):
        graph.replay()
        torch.cuda.synchronize()
        assert flags.tolist() == [0, replay] and consumed.tolist() == [0, replay] and status.tolist() == [0, 0]
    signal.wait_flag(flags, consumed, 1, status, timeout_s=0.05)  # past the last replay's message: gives up
    torch.cuda.synchronize()
    assert status.tolist() == [signal.TIMED_OUT, 1]
