"""Sequence-numbered arrival flags of the one-sided transport (`comm.symmetric`), as Triton kernels
beside their plain-torch reference.

Contract: `raise_flag(flags_W, i, seq, overflow)` stores seq (or -seq for a message that did not fit)
into flag word i with a release at system scope, after everything the stream did before (the
payload's copy into the peer's segment); `wait_flag(flags_W, i, seq, status_1)` spins with
acquire loads at system scope until flag i holds seq or -seq, and ORs 1 into `status_1` for -seq,
so work queued after it on the stream sees the payload; the host reads the status once, at the
step's end (`check_status`). Nothing is reset between steps: step t's flags hold t + 1.

Flags live in another GPU's memory on the fast path (NVSHMEM peer tensors over NVLink); the
interpreter (CPU tests) runs them on CPU tensors standing for peer buffers, where a wait whose
flag is raised later in the same launch would spin forever: tests raise first.

Shape legend: W flag words.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from disagmoe.comm.symmetric import ArenaOverflow


@triton.jit
def _raise_flag_kernel(flags_ptr, index, value):
    tl.atomic_xchg(flags_ptr + index, value, sem="release", scope="sys")


@triton.jit
def _wait_flag_kernel(flags_ptr, status_ptr, index, seq):
    seen = tl.atomic_add(flags_ptr + index, 0, sem="acquire", scope="sys")
    while (seen != seq) & (seen != -seq):
        seen = tl.atomic_add(flags_ptr + index, 0, sem="acquire", scope="sys")
    tl.atomic_or(status_ptr, (seen == -seq).to(tl.int32))


def raise_flag(flags_W: torch.Tensor, index: int, seq: int, overflow: bool = False) -> None:
    """Publish message `index` of step sequence number `seq` (module docstring)."""
    _check(flags_W, index, seq)
    _raise_flag_kernel[(1,)](flags_W, index, -seq if overflow else seq)


def wait_flag(flags_W: torch.Tensor, index: int, seq: int, status_1: torch.Tensor) -> None:
    """Queue a wait for message `index` of `seq` on the stream (module docstring)."""
    _check(flags_W, index, seq)
    if status_1.dtype != torch.int32 or status_1.numel() != 1:
        raise ValueError("status must be one int32 word (zero it at the start of a run)")
    _wait_flag_kernel[(1,)](flags_W, status_1, index, seq)


def check_status(status_1: torch.Tensor, what: str) -> None:
    """At the step's one read: `ArenaOverflow` if any wait saw a message that did not fit."""
    if int(status_1.item()):
        raise ArenaOverflow(f"{what}: a message did not fit its receive segment (its sender names it); "
                            "raise the transport's capacity_factor or leave it unset for the worst case")


def wait_reference(flags_W: torch.Tensor, index: int, seq: int, status_1: torch.Tensor) -> None:
    """Plain torch, for a flag already raised: the status a wait leaves."""
    value = int(flags_W[index])
    if value not in (seq, -seq):
        raise AssertionError(f"flag {index} holds {value}, not {seq}: the reference cannot wait")
    status_1 |= int(value == -seq)


def _check(flags_W: torch.Tensor, index: int, seq: int) -> None:
    if flags_W.dtype != torch.int64 or flags_W.dim() != 1:
        raise ValueError("flags must be a 1-D int64 tensor (an arena's flag region)")
    if not 0 <= index < flags_W.numel():
        raise ValueError(f"flag {index} is outside the arena's {flags_W.numel()} flag words")
    if seq < 1:
        raise ValueError(f"sequence number {seq} must be >= 1 (step + 1): 0 is an arena's initial state")
