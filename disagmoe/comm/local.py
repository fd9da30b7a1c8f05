"""`local` transport: gloo point-to-point messages between processes on CPU.

Protocol per message: one send per non-empty tensor, each on its own tag derived from (key,
part); the receiver allocates from the specs it expects (`Transport.recv`), or receives into the
buffers of the key's slot once reserved (`reserve`: keys whose lifetimes do not overlap share one,
`runtime.schedule.recv_slots`; a receive completes before `recv` returns, so CPU program order is
the only ordering needed). Gloo matches a
receive to a send by (peer, tag), so a receiver can ask for key B while key A from the same peer
is still pending: out-of-order keys need no buffering of ours; a size that differs from the spec
fails the receive.

Failures: an operation that does not complete within its timeout raises `TransportTimeout`;
gloo then closes every connection of this rank (its process group is unusable), so the job must
stop and the driver reports the rank. A peer whose process dies breaks its connection and raises
`PeerFailure` as soon as gloo notices (seconds), long before the timeout.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from disagmoe.comm.base import (
    PeerFailure,
    SendHandle,
    TensorSpec,
    Transport,
    TransportTimeout,
    WorkSendHandle,
)
from disagmoe.wire import MessageKey

MAX_TENSORS = 16
# Tag layout (low to high bits): part 5 | direction 1 | layer 9 | micro_batch 10 | step mod 64 6.
_PART_BITS, _LAYER_BITS, _MB_BITS, _STEP_BITS = 5, 9, 10, 6


def message_tag(key: MessageKey, part: int) -> int:
    """A tag unique per (key, part) among the messages one rank pair has in flight.

    Steps never overlap (all sends of a step complete before the next), so the step only needs
    a few bits to separate consecutive steps.
    """
    if not 0 <= part < MAX_TENSORS:
        raise ValueError(f"part {part} out of range 0..{MAX_TENSORS - 1}: a message holds at most {MAX_TENSORS} tensors")
    if not 0 <= key.layer < 1 << _LAYER_BITS or not 0 <= key.micro_batch < 1 << _MB_BITS:
        raise ValueError(
            f"key {key}: tags fit layers < {1 << _LAYER_BITS} and micro-batches < {1 << _MB_BITS}"
        )
    tag = key.step % (1 << _STEP_BITS)
    tag = (tag << _MB_BITS) | key.micro_batch
    tag = (tag << _LAYER_BITS) | key.layer
    tag = (tag << 1) | int(key.direction)
    return (tag << _PART_BITS) | part


def _wait(work: dist.Work, peer: int, key: MessageKey, deadline: float, timeout_s: float, what: str) -> None:
    # gloo counts the timeout in whole milliseconds, truncated: rounded up here, so a timeout never
    # fires before `deadline` (0.9999 s of a 1 s timeout came back as a timeout once)
    remaining_ms = max(math.ceil((deadline - time.monotonic()) * 1e3), 1)
    try:
        work.wait(timedelta(milliseconds=remaining_ms))
    except RuntimeError as err:
        text = str(err)
        if "Timed out" in text:  # gloo's wording for a per-operation timeout
            raise TransportTimeout(peer, key, timeout_s, what) from err
        raise PeerFailure(peer, key, text.splitlines()[0]) from err


class LocalTransport(Transport):
    """gloo P2P over the default process group; ranks are global ranks."""

    kind = "local"

    def __init__(self, default_timeout_s: float = 120.0) -> None:
        if not dist.is_initialized():
            raise ValueError("the local transport needs torch.distributed initialised first (backend gloo)")
        if dist.get_backend() != "gloo":
            raise ValueError(
                f"the local transport runs on gloo, but the process group uses {dist.get_backend()!r}"
            )
        super().__init__(dist.get_rank(), dist.get_world_size(), default_timeout_s)

    def send(self, dst_rank: int, key: MessageKey, tensors: Sequence[torch.Tensor]) -> SendHandle:
        self._check_peer(dst_rank)
        payload = self._detach_from_slots(tensors)
        works = [dist.isend(t, dst_rank, tag=message_tag(key, i)) for i, t in enumerate(payload) if t.numel()]
        return WorkSendHandle(works, payload, dst_rank, key, self.default_timeout_s, _wait)

    def reserve(self, src_rank: int, key: MessageKey, specs: Sequence[TensorSpec], slot=None) -> None:
        """Receive `key` into a kept buffer (shared with the keys of `slot`) instead of a new one."""
        self._slot_buffers(src_rank, key, specs, slot)

    def recv(self, src_rank: int, key: MessageKey, specs: Sequence[TensorSpec],
             timeout_s: float | None = None) -> list[torch.Tensor]:
        self._check_peer(src_rank)
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        tensors = self._slot_buffers(src_rank, key, specs, create=False)  # reserved: the slot's buffers
        tensors = [spec.empty() for spec in specs] if tensors is None else list(tensors)
        works = [dist.irecv(t, src_rank, tag=message_tag(key, i)) for i, t in enumerate(tensors) if t.numel()]
        for work in works:
            _wait(work, src_rank, key, deadline, timeout_s, "receive from")
        return tensors
