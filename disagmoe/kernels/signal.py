"""Arrival flags of the one-sided transport (`comm.symmetric`) that count messages, as Triton
kernels beside their plain-torch reference.

Contract: a flag word counts the messages that landed in its segment (it only grows: nothing is
reset between steps). A sender adds 1 after the payload (`raise_flag`, the Triton senders' atomic
add of 1, NVSHMEM's SIGNAL_ADD of 1), with a release at system scope. The receiver keeps, on its own
GPU, a consumed word per flag word (`consumed_W`, the same indexing): how many of that word's
messages its waits have claimed. `wait_flag(flags_W, consumed_W, i, status_2, timeout_s)` claims
message k = consumed[i] + 1, advances consumed[i] on the device and spins (acquire loads, system
scope) until flag i holds k or more, so work queued after it sees the payload. No host value enters
the comparison, so a CUDA graph that captured the wait waits for the next message on each replay.

A send that failed (it did not fit, or was not on this GPU) sets the flag to FAILED, a value no
count reaches: the wait passes at once and records OVERFLOW, never a hang. The status, two int32
words, records what went wrong: word 0 ORs OVERFLOW and TIMED_OUT (a flag still short after
`timeout_s`: a peer that died or never sends; the wait gives up, so the stream and the step finish
and the host learns it), word 1 the index of a flag that timed out. The host reads it once, at the
step's end (`check_status`). A wait claims its message when it starts, arrived or not (a timeout
stops the run at that read).

Several programs of one launch may wait for the same message (`fused_return.combine_landed`: one
item per column block of a segment): `claim` counts them in the consumed word's high half and moves
the count on once all of them claimed, so every one compares against the same k and the word holds
the messages consumed between launches.

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
FAILED = 1 << 62  # a flag set to this (or more) says its message's send failed; counts never reach it
CLAIMED = 1 << 32  # one claim in a consumed word's high half (`claim`)
# Kernel arguments that change from message to message (flag indices, timeouts) are not
# specialised on: Triton would compile a new variant for a value of 1 or a multiple of 16, and a
# variant's first launch loads its module, which waits for the kernels running on the GPU, so a
# new variant launched while a wait of this process spins would block the host until that wait
# ends (on the H200 a combine then timed out: the expert launch stood queued behind the load).
MESSAGE_VALUES = ("index", "timeout_ns", "flag_base")
DEFAULT_TIMEOUT_S = 120.0


@triton.jit(do_not_specialize=["index"])  # MESSAGE_VALUES
def _raise_flag_kernel(flags_ptr, index, FAIL: tl.constexpr):
    if FAIL:
        tl.atomic_xchg(flags_ptr + index, tl.full((), 4611686018427387904, tl.int64), sem="release", scope="sys")
    else:
        tl.atomic_add(flags_ptr + index, tl.full((), 1, tl.int64), sem="release", scope="sys")


@triton.jit
def _now_ns(TIMED: tl.constexpr):
    """The GPU's nanosecond clock (int64) when TIMED, else 0 (the interpreter has no clock)."""
    now = tl.full((), 0, tl.int64)  # one return type for both branches (the compiler checks)
    if TIMED:
        now = tl.extra.cuda.globaltimer()
    return now


@triton.jit
def claim(consumed_ptr, items):
    """The number k (1, 2, ...) of the message that this wait, one of the `items` waits of one
    launch for it, is for: consumed + 1. Each claim adds CLAIMED (the high half counts them); the
    last of the `items` moves the low half on by one and clears the high half, so the others,
    which all claimed before it, read the same k. Relaxed atomics at GPU scope: only this GPU's
    waits touch the word, and launches run in stream order."""
    old = tl.atomic_add(consumed_ptr, tl.full((), 4294967296, tl.int64), sem="relaxed", scope="gpu")  # CLAIMED
    if (old >> 32) == items - 1:
        tl.atomic_add(consumed_ptr, 1 - items * tl.full((), 4294967296, tl.int64), sem="relaxed", scope="gpu")
    return (old & tl.full((), 4294967295, tl.int64)) + 1


@triton.jit
def spin_until(flag_ptr, want, timeout_ns, TIMED: tl.constexpr):
    """Acquire-load the flag until it holds `want` or more or, on a GPU (TIMED), `timeout_ns`
    passed; returns the last value seen. A timeout of 0 looks once. The interpreter has no clock
    and otherwise spins without a bound (its tests raise every flag before waiting)."""
    start = _now_ns(TIMED)
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    done = (seen >= want) | (timeout_ns <= 0)  # no time left: one look (`remaining_timeout`)
    while done == 0:
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        done = (seen >= want) | (_now_ns(TIMED) - start > timeout_ns)
    return seen


@triton.jit
def remaining_timeout(status_ptr, timeout_ns):
    """`timeout_ns`, or 0 once a wait recorded in this status timed out: one missing peer costs
    the step one timeout, not one per wait queued after it."""
    gave_up = (tl.load(status_ptr, volatile=True) & 2) != 0
    return tl.where(gave_up, 0, timeout_ns)


@triton.jit
def report(status_ptr, seen, want, index):
    """Record in the status what a wait for `want` that returned `seen` found (module docstring)."""
    late = seen < want
    failed = seen >= 4611686018427387904  # FAILED
    tl.atomic_or(status_ptr, failed.to(tl.int32) * 1 + late.to(tl.int32) * 2)
    if late:
        tl.atomic_xchg(status_ptr + 1, index)


@triton.jit
def wait_claimed(flags_ptr, consumed_ptr, status_ptr, index, items, timeout_ns, status_index, TIMED: tl.constexpr):
    """Claim the next message of flag word `index` (one of `items` waits for it), spin until it
    landed and report into the status (a timed-out flag under `status_index`)."""
    want = claim(consumed_ptr + index, items)
    seen = spin_until(flags_ptr + index, want, remaining_timeout(status_ptr, timeout_ns), TIMED)
    report(status_ptr, seen, want, status_index)


@triton.jit(do_not_specialize=["index", "timeout_ns"])
def _wait_flag_kernel(flags_ptr, consumed_ptr, status_ptr, index, timeout_ns, TIMED: tl.constexpr):
    wait_claimed(flags_ptr, consumed_ptr, status_ptr, index, 1, timeout_ns, index, TIMED)


def raise_flag(flags_W: torch.Tensor, index: int, failed: bool = False) -> None:
    """Count one more message into flag word `index`, or (`failed`) set it to FAILED (module
    docstring); on the stream, after everything it did before."""
    _check_flags(flags_W, index)
    _raise_flag_kernel[(1,)](flags_W, index, FAIL=failed)


def new_status(device: torch.device | str) -> torch.Tensor:
    """A zeroed status (two int32 words) for `wait_flag`."""
    return torch.zeros(2, dtype=torch.int32, device=device)


def new_consumed(flags: torch.Tensor) -> torch.Tensor:
    """Zeroed consumed words for `flags` (int64, the same shape, on the same device): nothing
    consumed yet, as a zeroed arena's flags say nothing landed yet."""
    return torch.zeros(flags.shape, dtype=torch.int64, device=flags.device)


def wait_flag(flags_W: torch.Tensor, consumed_W: torch.Tensor, index: int, status_2: torch.Tensor,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
    """Queue the wait for the next message of flag word `index` on the stream (module docstring)."""
    _check_flags(flags_W, index)
    check_consumed(consumed_W, flags_W)
    check_status_words(status_2)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s} must be > 0")
    _wait_flag_kernel[(1,)](flags_W, consumed_W, status_2, index, int(timeout_s * 1e9), TIMED=timed(flags_W))


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


def wait_reference(flags_W: torch.Tensor, consumed_W: torch.Tensor, index: int, status_2: torch.Tensor) -> None:
    """Plain torch, for a message already landed: the consumed word and the status a wait leaves."""
    value, want = int(flags_W[index]), int(consumed_W[index]) + 1
    if value < want:
        raise AssertionError(f"flag {index} counts {value} messages, not {want} or more: the reference cannot wait")
    consumed_W[index] += 1
    status_2[0] |= int(value >= FAILED) * OVERFLOW


def check_consumed(consumed: torch.Tensor, flags: torch.Tensor) -> None:
    """ValueError unless `consumed` is contiguous int64 of `flags`' shape on its device (`new_consumed`)."""
    if (consumed.dtype != torch.int64 or consumed.shape != flags.shape or consumed.device != flags.device
            or not consumed.is_contiguous()):
        raise ValueError(f"consumed words must be int64 {tuple(flags.shape)} on {flags.device} (one per flag word, "
                         f"`new_consumed`), got {consumed.dtype} {tuple(consumed.shape)} on {consumed.device}")


def check_status_words(status_2: torch.Tensor) -> None:
    if status_2.dtype != torch.int32 or status_2.numel() != 2:
        raise ValueError("status must be two int32 words (`new_status`)")


def _check_flags(flags_W: torch.Tensor, index: int) -> None:
    if flags_W.dtype != torch.int64 or flags_W.dim() != 1:
        raise ValueError("flags must be a 1-D int64 tensor (an arena's flag region)")
    if not 0 <= index < flags_W.numel():
        raise ValueError(f"flag {index} is outside the arena's {flags_W.numel()} flag words")
