"""Optimizer state in host memory (`offload_optimizer`): the staging area and the host-memory check.

`FlatAdamW(offload_bucket_bytes=...)` keeps each bucket's fp32 masters and AdamW moments in pinned
host memory and streams them through a `StagingArea` of two GPU slots per step (`FlatAdamW.step`):

    h2d stream:      load c0 | load c1 | (wait stored[c0]) load c2 | ...
    compute stream:            update c0 | update c1 | update c2 | ...      (wait loaded[ci] each)
    d2h stream:                          store c0 | store c1 | ...          (wait updated[ci] each)

A slot holds `roofline.optimizer_state.slot_elements` elements (the memory model's count too); the
next step's loads wait for this step's last stores (`begin`).

A chunk c is at most one slot's elements of one bucket's slice; its update is `flat_adamw.adamw_chunk`,
the on-device step's (elementwise, so chunking changes no bit), and ends by writing the bf16
parameters of its elements from the updated masters, on the GPU. The gradient never leaves the GPU.
Only stream/event waits order the three streams: nothing in the step waits on the host.

On the CPU there is nothing to move: the same chunks go through the same slots with plain copies
(a test path for the bucket logic; it saves no memory).

Shapes: C a slot's elements.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


def host_empty(n: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A zeroed host tensor, pinned (page-locked) when `pin` (copies to and from it run asynchronously)."""
    return torch.zeros(n, dtype=dtype, pin_memory=pin)


@dataclass
class Slot:
    """One staging bucket on the device: a chunk's masters (None when the parameters are the masters,
    fp32 compute) and moments, in the moments' dtype."""

    master_C: torch.Tensor | None
    exp_avg_C: torch.Tensor
    exp_avg_sq_C: torch.Tensor


class StagingArea:
    """Two slots on `device` (double buffering), fp32 scratch for bf16 moments, and on CUDA the two copy
    streams with one event per slot and stage (loaded, updated, stored)."""

    def __init__(self, device: torch.device, elements: int, moment_dtype: torch.dtype, has_master: bool) -> None:
        self.device, self.elements = device, elements
        self.slots = [Slot(torch.empty(elements, dtype=torch.float32, device=device) if has_master else None,
                           torch.empty(elements, dtype=moment_dtype, device=device),
                           torch.empty(elements, dtype=moment_dtype, device=device)) for _ in range(2)]
        # bf16 moments: the update runs on fp32 copies of a chunk's moments (as the on-device step's chunks)
        self.scratch_2C = (None if moment_dtype == torch.float32
                           else torch.empty((2, elements), dtype=torch.float32, device=device))
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d, self.d2h = torch.cuda.Stream(device), torch.cuda.Stream(device)
            self.loaded = [torch.cuda.Event() for _ in range(2)]
            self.updated = [torch.cuda.Event() for _ in range(2)]
            self.stored = [torch.cuda.Event() for _ in range(2)]

    @property
    def nbytes(self) -> int:
        """Device bytes the area holds: what the memory model counts for offloaded state."""
        tensors = [t for s in self.slots for t in (s.master_C, s.exp_avg_C, s.exp_avg_sq_C) if t is not None]
        if self.scratch_2C is not None:
            tensors.append(self.scratch_2C)
        return sum(t.numel() * t.element_size() for t in tensors)

    def begin(self) -> None:
        """Order this step's loads after the previous step's stores (they read what those wrote, into the
        slots those read out). An event wait, no host wait; the loads need nothing of the compute stream,
        so the first two run while the backward's last kernels do."""
        if self.cuda:
            self.h2d.wait_stream(self.d2h)

    def load(self, i: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Chunk i's host tensors into slot i % 2: `pairs` of (slot view, host view). On CUDA on the h2d
        stream, after the store of chunk i - 2 has read the slot out."""
        s = i % 2
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return
        with torch.cuda.stream(self.h2d):
            if i >= 2:
                self.h2d.wait_event(self.stored[s])
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)  # pinned host -> device: asynchronous
            self.loaded[s].record(self.h2d)

    def wait_loaded(self, i: int) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.loaded[i % 2])

    def store(self, i: int, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Chunk i's updated slot back to the host: `pairs` of (host view, slot view). On CUDA on the d2h
        stream, after the compute stream's update of the chunk."""
        s = i % 2
        if not self.cuda:
            for dst, src in pairs:
                dst.copy_(src)
            return
        self.updated[s].record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(self.updated[s])
            for dst, src in pairs:
                dst.copy_(src, non_blocking=True)  # device -> pinned host: asynchronous
            self.stored[s].record(self.d2h)

    def drain(self) -> None:
        """Host wait for every queued copy (a checkpoint reads or writes the host state; never in a step)."""
        if self.cuda:
            self.h2d.synchronize()
            self.d2h.synchronize()


def available_host_bytes() -> int:
    """Host memory available for new pinned allocations: /proc/meminfo's MemAvailable (Linux), else
    the physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_memory(need_bytes: float, what: str, available: int | None = None) -> None:
    """ValueError, before anything is allocated, when offloaded optimizer state (`need_bytes` on this
    host, `what` says whose) does not fit the host's available memory; the message names the fixes."""
    available = available_host_bytes() if available is None else available
    if need_bytes <= available:
        return
    raise ValueError(
        f"offload_optimizer keeps {need_bytes / 2**30:.1f} GiB of fp32 masters and AdamW moments ({what}) in pinned "
        f"host memory, and this host has {available / 2**30:.1f} GiB available (MemAvailable); set "
        "offload_optimizer: false, or optim.state_dtype: bf16 (4 bytes per parameter fewer), or optim.shard_states "
        "(distributed modes: ZeRO-1 divides the replicated parameters' state), or run on a host with more memory")
