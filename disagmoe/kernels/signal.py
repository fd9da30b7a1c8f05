"""Sequence-numbered arrival flags of the one-sided transport (`comm.symmetric`), as Triton kernels
beside their plain-torch reference.

Contract: `raise_flag(flags_W, i, seq, overflow)` stores seq (or -seq for a message that did not fit)
into flag word i with a release at system scope, after everything the stream did before (the
payload's copy into the peer's segment); `wait_flag(flags_W, i, seq, status_2, timeout_s)` spins
with acquire loads at system scope until flag i holds seq or more, or -seq or less, so work queued
after it on the stream sees the payload. A flag word only grows in magnitude: a segment that several
keys share (`comm.symmetric`) carries its messages' count, so a later key's reader, waiting for a
larger number, does not pass on an earlier key's flag. The status, two int32 words, records what went wrong: word 0 ORs
OVERFLOW for -seq and TIMED_OUT for a flag still unset after `timeout_s` (a peer that died or
never sends; the wait then gives up, so the stream and the step finish and the host learns it),
word 1 holds the index of a flag that timed out. The host reads the status once, at the step's
end (`check_status`). Nothing is reset between steps: the n-th message of a slot carries n.
`flag_value` is that number for every sender (the transport's count, the kernels' `seq`).

Flags live in another GPU's memory on the fast path (NVSHMEM peer tensors over NVLink); the
interpreter (CPU tests) runs them on CPU tensors standing for peer buffers, where a wait whose
flag is raised later in the same launch would spin forever: tests raise first.

Shape legend: W flag words.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from disagmoe.wire import ArenaOverflow

OVERFLOW, TIMED_OUT = 1, 2  # bits of the status's word 0
# Kernel arguments that change from message to message (sequence numbers, flag indices, timeouts)
# are not specialised on: Triton would compile a new variant for a value of 1 or a multiple of 16,
# and a variant's first launch loads its module, which waits for the kernels running on the GPU,
# so a new variant launched while a wait of this process spins would block the host until that
# wait ends (on the H200 a combine then timed out: the expert launch stood queued behind the load).
MESSAGE_VALUES = ("index", "value", "seq", "timeout_ns", "flag_base")
DEFAULT_TIMEOUT_S = 120.0


@triton.jit(do_not_specialize=["index", "value"])  # MESSAGE_VALUES
def _raise_flag_kernel(flags_ptr, index, value):
    tl.atomic_xchg(flags_ptr + index, value, sem="release", scope="sys")


@triton.jit
def _now_ns(TIMED: tl.constexpr):
    """The GPU's nanosecond clock (int64) when TIMED, else 0 (the interpreter has no clock)."""
    now = tl.full((), 0, tl.int64)  # one return type for both branches (the compiler checks)
    if TIMED:
        now = tl.extra.cuda.globaltimer()
    return now


@triton.jit
def spin_until(flag_ptr, seq, timeout_ns, ACCEPT_NEGATIVE: tl.constexpr, TIMED: tl.constexpr):
    """Acquire-load the flag until it holds seq or more (or -seq or less with ACCEPT_NEGATIVE) or, on a GPU
    (TIMED), `timeout_ns` passed; returns the last value seen. A timeout of 0 looks once. The
    interpreter has no clock and otherwise spins without a bound (its tests raise every flag
    before waiting)."""
    start = _now_ns(TIMED)
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    done = _arrived(seen, seq, ACCEPT_NEGATIVE) | (timeout_ns <= 0)  # no time left: one look (`remaining_timeout`)
    while done == 0:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        done = _arrived(seen, seq, ACCEPT_NEGATIVE) | (_now_ns(TIMED) - start > timeout_ns)
    return seen


@triton.jit
def _arrived(seen, seq, ACCEPT_NEGATIVE: tl.constexpr):
    if ACCEPT_NEGATIVE:
        return (seen >= seq) | (seen <= -seq)
    return seen >= seq


@triton.jit
def remaining_timeout(status_ptr, timeout_ns):
    """`timeout_ns`, or 0 once a wait recorded in this status timed out: one missing peer costs
    the step one timeout, not one per wait queued after it."""
    gave_up = (tl.load(status_ptr, volatile=True) & 2) != 0
    return tl.where(gave_up, 0, timeout_ns)


@triton.jit
def report(status_ptr, seen, seq, index):
    """Record in the status what a wait that returned `seen` found (module docstring)."""
    late = (seen < seq) & (seen > -seq)
    tl.atomic_or(status_ptr, (seen <= -seq).to(tl.int32) * 1 + late.to(tl.int32) * 2)
    if late:
        tl.atomic_xchg(status_ptr + 1, index)


@triton.jit(do_not_specialize=["index", "seq", "timeout_ns"])
def _wait_flag_kernel(flags_ptr, status_ptr, index, seq, timeout_ns, TIMED: tl.constexpr):
    seen = spin_until(flags_ptr + index, seq, remaining_timeout(status_ptr, timeout_ns), True, TIMED)
    report(status_ptr, seen, seq, index)


def flag_value(counts: dict, peer: int, slot: object) -> int:
    """The flag value of the next message of `slot` with `peer`, counted in `counts` (1, 2, ...):
    both ends count every message of a slot, whichever of the keys sharing it it carries, so the
    n-th carries n on both (`comm.nvshmem`)."""
    n = counts[(peer, slot)] = counts.get((peer, slot), 0) + 1
    return n


def raise_flag(flags_W: torch.Tensor, index: int, seq: int, overflow: bool = False) -> None:
    """Publish message `index` of sequence number `seq` (module docstring)."""
    _check(flags_W, index, seq)
    _raise_flag_kernel[(1,)](flags_W, index, -seq if overflow else seq)


def new_status(device: torch.device | str) -> torch.Tensor:
    """A zeroed status (two int32 words) for `wait_flag`."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def wait_flag(flags_W: torch.Tensor, index: int, seq: int, status_2: torch.Tensor,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Queue a wait for message `index` of `seq` on the stream (module docstring)."""
    _check(flags_W, index, seq)
    if status_2.dtype != torch.int32 or status_2.numel() != 2:
        raise ValueError("status must be two int32 words (`new_status`)")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    _wait_flag_kernel[(1,)](flags_W, status_2, index, seq, int(timeout_s * 1e9), TIMED=timed(flags_W))


def timed(t: torch.Tensor) -> bool:
    """Whether waits on `t` can read the GPU's clock (compiled on CUDA, not the interpreter)."""
    return t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"


def check_status(status: list[int], what: str) -> None:
    """At the step's one read of the status words: `ArenaOverflow` if a wait saw a message that
    did not fit, `TimeoutError` naming the flag if one never came."""
    if status[0] & OVERFLOW:
        raise ArenaOverflow(f"{what}: a message did not fit its receive segment (its sender names it); "
                            "raise transport_capacity_factor or leave it unset for the worst case")
    if status[0] & TIMED_OUT:
        raise TimeoutError(f"{what}: the wait for flag {status[1]} timed out (its sender is hung, slow or died)")


def wait_reference(flags_W: torch.Tensor, index: int, seq: int, status_2: torch.Tensor) -> None:
    """Plain torch, for a flag already raised: the status a wait leaves."""
    value = int(flags_W[index])
    if -seq < value < seq:
        raise AssertionError(f"flag {index} holds {value}, not {seq} or more: the reference cannot wait")
    status_2[0] |= int(value <= -seq)


def _check(flags_W: torch.Tensor, index: int, seq: int) -> None:
    if flags_W.dtype != torch.int64 or flags_W.dim() != 1:
        raise ValueError("flags must be a 1-D int64 tensor (an arena's flag region)")
    if not 0 <= index < flags_W.numel():
        raise ValueError(f"flag {index} is outside the arena's {flags_W.numel()} flag words")
    if seq < 1:
        raise ValueError(f"sequence number {seq} must be >= 1 (the slot's message count): 0 is an arena's initial state")
