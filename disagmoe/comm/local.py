"""`local` transport: gloo point-to-point messages between processes on CPU.

Protocol per message: the fixed-size int64 header (key, shapes, dtypes) then one send per
non-empty tensor, each on its own tag derived from (key, part). Gloo matches a receive to a send
by (peer, tag), so a receiver can ask for key B while key A from the same peer is still pending:
out-of-order keys need no buffering of ours.

Failures: an operation that does not complete within its timeout raises `TransportTimeout`;
gloo then closes every connection of this rank (its process group is unusable), so the job must
stop and the driver reports the rank. A peer whose process dies breaks its connection and raises
`PeerFailure` as soon as gloo notices (seconds), long before the timeout.

Shapes: L = HEADER_LEN (the fixed header length).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from disagmoe.comm.base import (
    MessageKey,
    PeerFailure,
    SendHandle,
    WorkSendHandle,
    Transport,
    TransportError,
    TransportTimeout,
)
from disagmoe.comm.header import HEADER_LEN, decode_header, encode_header, message_tag


def _wait(work: dist.Work, peer: int, key: MessageKey, deadline: float, timeout_s: float, what: str) -> None:
    remaining = max(deadline - time.monotonic(), 1e-3)
    try:
        work.wait(timedelta(seconds=remaining))
    except RuntimeError as err:
        text = str(err)
        if "Timed out" in text:  # gloo's wording for a per-operation timeout
            raise TransportTimeout(peer, key, timeout_s, what) from err
        raise PeerFailure(peer, key, text.splitlines()[0]) from err


class LocalTransport(Transport):
    """gloo P2P over the default process group; ranks are global ranks."""

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
        header_L = encode_header(key, tensors)
        payload = [t.detach().contiguous() for t in tensors]
        works = [dist.isend(header_L, dst_rank, tag=message_tag(key, 0))]
        for i, tensor in enumerate(payload):
            if tensor.numel():
                works.append(dist.isend(tensor, dst_rank, tag=message_tag(key, i + 1)))
        return WorkSendHandle(works, [header_L, *payload], dst_rank, key, self.default_timeout_s, _wait)

    def recv(self, src_rank: int, key: MessageKey, timeout_s: float | None = None) -> list[torch.Tensor]:
        self._check_peer(src_rank)
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        header_L = torch.empty(HEADER_LEN, dtype=torch.int64)
        _wait(dist.irecv(header_L, src_rank, tag=message_tag(key, 0)), src_rank, key, deadline, timeout_s,
              "receive from")
        sent_key, specs = decode_header(header_L)
        if sent_key != key:
            raise TransportError(
                f"rank {src_rank} sent key {sent_key} under the tag of key {key}: keys of steps "
                "64 apart overlapped (wait every send handle before the next step)",
                src_rank,
                key,
            )
        tensors = [spec.empty() for spec in specs]
        works = [
            dist.irecv(tensor, src_rank, tag=message_tag(key, i + 1))
            for i, tensor in enumerate(tensors)
            if tensor.numel()
        ]
        for work in works:
            _wait(work, src_rank, key, deadline, timeout_s, "receive from")
        return tensors
