"""`nccl` transport: torch.distributed point-to-point over NCCL between GPUs (the GPU baseline).

NCCL ignores tags: a rank pair's sends and receives match in the order they are issued. So:

- Each ordered rank pair (src -> dst) gets its own process group, hence its own communicator and
  stream. With one stream per pair for both directions, A: send d0, send d1, recv c0 against
  E: recv d0, send c0, recv d1 can deadlock once messages outgrow NCCL's buffers (A's recv c0
  queues behind send d1, which waits for E's recv d1, queued behind send c0).
- Within a direction messages are FIFO. A `recv` for key B while key A is next from that peer
  receives A into a stash and returns it when asked. Schedules built by `build_schedule`
  receive in send order per pair, so this never buffers there.
- The header (int64, on the GPU) goes first. The receiver waits for it on the CPU, polling,
  bounded by the timeout, because it needs the shapes to allocate the rows. The rows' receives
  are stream-ordered: `recv` returns without waiting for them on the CPU, and work queued on the
  current stream afterwards sees the data.

A timeout raises `TransportTimeout`. The NCCL operation cannot be cancelled: the communicator is
then unusable and the job must stop. A dead peer shows up as a timeout here; the driver learns
the cause from Ray.

Shapes: L = HEADER_LEN (the fixed header length).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from disagmoe.comm.base import MessageKey, SendHandle, Transport, TransportTimeout, WorkSendHandle
from disagmoe.comm.header import HEADER_LEN, decode_header, encode_header

_POLL_S = 20e-6


def _poll(work: dist.Work, peer: int, key: MessageKey | None, deadline: float, timeout_s: float,
          what: str) -> None:
    """Block the CPU until `work` finished on the GPU, or raise TransportTimeout at `deadline`."""
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TransportTimeout(peer, key, timeout_s, what)
        time.sleep(_POLL_S)


class NcclTransport(Transport):
    """NCCL P2P over the default process group's ranks, one process group per ordered pair.

    `pairs` lists the (src, dst) pairs that will exchange messages (`Schedule.rank_pairs()`);
    None connects every ordered pair. Every rank must pass the same list: creating the groups
    is collective. Communicators are created eagerly, in one global order, so the first message
    of a step never waits on a connection.
    """

    def __init__(
        self, pairs: Iterable[tuple[int, int]] | None = None, default_timeout_s: float = 120.0
    ) -> None:
        if not dist.is_initialized() or "nccl" not in str(dist.get_backend()):
            raise ValueError("the nccl transport needs torch.distributed initialised with the nccl backend")
        super().__init__(dist.get_rank(), dist.get_world_size(), default_timeout_s)
        self.device = torch.device("cuda", torch.cuda.current_device())
        n = self.world_size
        every_pair = {(s, d) for s in range(n) for d in range(n) if s != d}
        pairs = sorted(set(pairs) if pairs is not None else every_pair)
        for src, dst in pairs:
            if src == dst or not (0 <= src < n and 0 <= dst < n):
                raise ValueError(f"pair ({src}, {dst}) is not two distinct ranks of this {n}-rank job")
        self._send_groups: dict[int, dist.ProcessGroup] = {}
        self._recv_groups: dict[int, dist.ProcessGroup] = {}
        for src, dst in pairs:
            group = dist.new_group([src, dst])
            if src == self.rank:
                self._send_groups[dst] = group
            elif dst == self.rank:
                self._recv_groups[src] = group
        self._stash: dict[int, dict[MessageKey, list[torch.Tensor]]] = {src: {} for src in self._recv_groups}
        self._connect(pairs)

    def _connect(self, pairs: list[tuple[int, int]]) -> None:
        """One tiny message per pair, in the same global order on every rank."""
        token = torch.zeros(1, device=self.device)
        deadline = time.monotonic() + self.default_timeout_s
        for src, dst in pairs:
            if src == self.rank:
                work = dist.isend(token, dst, group=self._send_groups[dst])
                _poll(work, dst, None, deadline, self.default_timeout_s, "connect to")
            elif dst == self.rank:
                work = dist.irecv(token, src, group=self._recv_groups[src])
                _poll(work, src, None, deadline, self.default_timeout_s, "connect to")

    def _group(self, groups: dict[int, dist.ProcessGroup], peer: int, what: str) -> dist.ProcessGroup:
        self._check_peer(peer)
        if peer not in groups:
            raise ValueError(f"rank {self.rank} cannot {what} rank {peer}: that pair was not in `pairs`")
        return groups[peer]

    def send(self, dst_rank: int, key: MessageKey, tensors: Sequence[torch.Tensor]) -> SendHandle:
        group = self._group(self._send_groups, dst_rank, "send to")
        for tensor in tensors:
            if tensor.device != self.device:
                raise ValueError(
                    f"the nccl transport sends tensors on {self.device}, got one on {tensor.device}"
                )
        header_L = encode_header(key, tensors).to(self.device)
        payload = [t.detach().contiguous() for t in tensors]
        works = [dist.isend(header_L, dst_rank, group=group)]
        works += [dist.isend(t, dst_rank, group=group) for t in payload if t.numel()]
        return WorkSendHandle(works, [header_L, *payload], dst_rank, key, self.default_timeout_s, _poll)

    def recv(self, src_rank: int, key: MessageKey, timeout_s: float | None = None) -> list[torch.Tensor]:
        group = self._group(self._recv_groups, src_rank, "receive from")
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        stash = self._stash[src_rank]
        while key not in stash:
            header_L = torch.empty(HEADER_LEN, dtype=torch.int64, device=self.device)
            work = dist.irecv(header_L, src_rank, group=group)
            _poll(work, src_rank, key, deadline, timeout_s, "receive from")
            work.wait()  # the current stream now orders after the header
            sent_key, specs = decode_header(header_L.cpu())
            tensors = [spec.empty(self.device) for spec in specs]
            for tensor in tensors:
                if tensor.numel():
                    dist.irecv(tensor, src_rank, group=group).wait()  # stream-ordered, no CPU wait
            stash[sent_key] = tensors
        return stash.pop(key)
