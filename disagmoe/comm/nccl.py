"""`nccl` transport: torch.distributed point-to-point over NCCL between GPUs.

NCCL ignores tags: a rank pair's sends and receives match in the order they are issued. So:

- Each ordered rank pair (src -> dst) gets its own process groups, hence its own communicators
  and streams: one per lane (`wire.lane_of`: the key's layer field mod 2, which keeps
  COMBINE-kind messages apart from DISPATCH-kind ones). With one stream per pair for both
  directions, A: send d0, send d1, recv c0 against E: recv d0, send c0, recv d1 can deadlock once
  messages outgrow NCCL's buffers (A's recv c0 queues behind send d1, which waits for E's recv
  d1, queued behind send c0); a colocated pair carries dispatch and combine messages
  interleaved, received in another order than sent unless they travel on separate lanes.
- Within a lane messages are FIFO, and every schedule receives each (pair, lane)'s messages in
  send order (tests/runtime/schedule/test_schedule.py checks all layouts), so a receive is simply the next
  message of its channel.
- No header: the receiver knows every message's specs from the plan (`Transport.recv`). The
  receives are stream-ordered: `recv` returns without the host waiting, and work queued on the
  current stream afterwards sees the data. Receive buffers are kept per slot, allocated at set-up (`reserve`,
  from the schedule's receives): keys whose lifetimes do not overlap share one
  (`runtime.schedule.recv_slots`: a pool per (peer, payload) with as many slots as the program
  keeps live), reused step after step, so no step allocates any. A receive into a reused slot is
  issued after the ops that read its previous message were queued, and NCCL's stream waits for
  them; a sent tensor that aliases a slot is copied first (`Transport._detach_from_slots`).

A peer that never sends leaves the GPU waiting; the host finds out at the step's one read (or
NCCL's watchdog after the process group's timeout) and the rank's own watchdog prints where it
is. The communicator is then unusable and the job must stop; the driver learns the cause from Ray.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist

from disagmoe.comm.base import SendHandle, TensorSpec, Transport, TransportTimeout, WorkSendHandle
from disagmoe.wire import LANES, MessageKey, lane_of

_POLL_S = 20e-6


def _poll(work: dist.Work, peer: int, key: MessageKey | None, deadline: float, timeout_s: float,
          what: str) -> None:
    """Block the CPU until `work` finished on the GPU, or raise TransportTimeout at `deadline`."""
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise TransportTimeout(peer, key, timeout_s, what)
        time.sleep(_POLL_S)


def _stream_wait(work: dist.Work, peer: int, key: MessageKey | None, deadline: float, timeout_s: float,
                 what: str) -> None:
    """Order the current stream after `work` (the host does not wait; a hung peer shows at the
    step's read or NCCL's watchdog)."""
    work.wait()


class NcclTransport(Transport):
    """NCCL P2P over the default process group's ranks, one process group per ordered pair.

    `pairs` lists the (src, dst) pairs that will exchange messages (`Schedule.rank_pairs()`);
    None connects every ordered pair. Every rank must pass the same list: creating the groups
    is collective. Communicators are created eagerly, in one global order, so the first message
    of a step never waits on a connection.
    """

    kind = "nccl"

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
        self._send_groups: dict[tuple[int, int], dist.ProcessGroup] = {}  # (dst, lane) -> group
        self._recv_groups: dict[tuple[int, int], dist.ProcessGroup] = {}  # (src, lane) -> group
        for src, dst in pairs:
            for lane in range(LANES):
                group = dist.new_group([src, dst])
                if src == self.rank:
                    self._send_groups[(dst, lane)] = group
                elif dst == self.rank:
                    self._recv_groups[(src, lane)] = group
        self._connect(pairs)

    def _connect(self, pairs: list[tuple[int, int]]) -> None:
        """One tiny message per channel, in the same global order on every rank."""
        token = torch.zeros(1, device=self.device)
        deadline = time.monotonic() + self.default_timeout_s
        for src, dst in pairs:
            for lane in range(LANES):
                if src == self.rank:
                    work = dist.isend(token, dst, group=self._send_groups[(dst, lane)])
                    _poll(work, dst, None, deadline, self.default_timeout_s, "connect to")
                elif dst == self.rank:
                    work = dist.irecv(token, src, group=self._recv_groups[(src, lane)])
                    _poll(work, src, None, deadline, self.default_timeout_s, "connect to")

    def _group(self, groups: dict[tuple[int, int], dist.ProcessGroup], peer: int, key: MessageKey,
               what: str) -> dist.ProcessGroup:
        self._check_peer(peer)
        channel = (peer, lane_of(key))
        if channel not in groups:
            raise ValueError(f"rank {self.rank} cannot {what} rank {peer}: that pair was not in `pairs`")
        return groups[channel]

    def send(self, dst_rank: int, key: MessageKey, tensors: Sequence[torch.Tensor]) -> SendHandle:
        group = self._group(self._send_groups, dst_rank, key, "send to")
        for tensor in tensors:
            if tensor.device != self.device:
                raise ValueError(
                    f"the nccl transport sends tensors on {self.device}, got one on {tensor.device}"
                )
        payload = self._detach_from_slots(tensors)
        works = [dist.isend(t, dst_rank, group=group) for t in payload if t.numel()]
        return WorkSendHandle(works, payload, dst_rank, key, self.default_timeout_s, _stream_wait)

    def reserve(self, src_rank: int, key: MessageKey, specs: Sequence[TensorSpec], slot=None) -> None:
        self._slot_buffers(src_rank, key, specs, slot)

    def recv(self, src_rank: int, key: MessageKey, specs: Sequence[TensorSpec],
             timeout_s: float | None = None) -> list[torch.Tensor]:
        group = self._group(self._recv_groups, src_rank, key, "receive from")
        buffers = self._slot_buffers(src_rank, key, specs)
        for tensor in buffers:
            if tensor.numel():
                dist.irecv(tensor, src_rank, group=group).wait()  # stream-ordered: the host does not wait
        return list(buffers)
