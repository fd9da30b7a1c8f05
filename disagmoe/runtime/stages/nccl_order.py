"""Replay a step's NCCL operations on a model of one GPU per rank and prove they cannot deadlock.

DESIGN 3c: NCCL kernels of different communicators on one GPU can deadlock when ranks issue them
in different orders: a point-to-point transfer waiting for its peer while the peer's GPU sits in
a collective of another communicator. `replay` models that conservatively:

- every rank's NCCL operations run in the order its program issues them: point-to-point sends
  and receives (one communicator per ordered rank pair, as the nccl transport has) and the
  collectives each op issues (`Collectives`, what the worker does);
- operations of one communicator run in issue order on each rank;
- a collective is a barrier on its rank's GPU: it starts once everything issued before it on that
  rank finished, and nothing issued after it starts before it finishes (work queued behind it on
  the compute stream consumes its result);
- nothing starts before every receive issued before it finished (a receive is waited on the
  compute stream, which every later NCCL operation follows);
- point-to-point transfers travel on one channel per (ordered pair, lane) as the nccl transport
  does (`wire.lane_of`), matched in order: a send and the receive it meets must name the
  same message, or the replay fails (an in-order transport would deliver the wrong one);
- a transfer finishes once both ends have started (large messages rendezvous), a collective once
  every member has started it.

It raises `ScheduleError` naming each stuck rank's first waiting operation, or returns the number
of operations replayed. `step_collectives` lists what `TrainWorker._optimizer_step` issues, in its
order; keep the two in step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from disagmoe.wire import lane_of, message_key, Recv, Send
from disagmoe.runtime.schedule.schedule import Op, OptimizerStep, ReduceGradients
from disagmoe.runtime.schedule.schedule_sim import ScheduleError
from disagmoe.runtime.topology import Topology

Collectives = Callable[[int, Op], Sequence[tuple[int, ...]]]
"""(rank, op) -> the rank groups of the collectives the op issues, in order."""


@dataclass(frozen=True)
class _NcclOp:
    kind: str  # "send" | "recv" | "collective"
    comm: tuple  # ("p2p", src, dst, lane) or ("collective", ranks)
    seq: int  # index among this rank's operations on `comm`
    origin: Op
    key: tuple | None = None  # a transfer's message (payload, layer, micro-batch): both ends must agree


def step_collectives(topology: Topology, zero: bool = False) -> Collectives:
    """The collectives of the runtime: `ReduceGradients(l)` issues a layer's data-parallel
    gradient sum (all-reduce or ZeRO reduce-scatter) in the backward, and `OptimizerStep` the
    replicated experts' gradient sums, the expert-load sum, the global-norm sum and (`zero`) the
    all-gather of the stepped slices (one per bucket; the model counts one)."""

    def collectives(rank: int, op: Op) -> list[tuple[int, ...]]:
        if isinstance(op, ReduceGradients):
            return [op.peers]
        if not isinstance(op, OptimizerStep):
            return []
        groups: list[tuple[int, ...]] = []
        attention = topology.attention_role(rank)
        dp_group = topology.attention_groups[attention[0]] if attention is not None else ()
        if attention is not None and topology.data_parallel > 1 and topology.colocated:
            groups.append(tuple(dp_group))  # colocated: the gradients here (no ReduceGradients)
        groups += [ranks for ranks in topology.replica_groups() if rank in ranks]
        if attention is not None and topology.data_parallel > 1:
            groups.append(tuple(dp_group))  # the step's expert loads
        groups.append(tuple(range(topology.world_size)))  # the global gradient norm
        if zero and attention is not None and topology.data_parallel > 1:
            groups.append(tuple(dp_group))  # ZeRO-1: the stepped slices all-gathered (one per bucket)
        return groups

    return collectives


def _expand(rank: int, program: Sequence[Op], collectives: Collectives) -> list[_NcclOp]:
    ops: list[_NcclOp] = []
    seq: dict[tuple, int] = {}

    def add(kind: str, comm: tuple, origin: Op, key: tuple | None = None) -> None:
        ops.append(_NcclOp(kind, comm, seq.get(comm, 0), origin, key))
        seq[comm] = seq.get(comm, 0) + 1

    for op in program:
        if isinstance(op, (Send, Recv)):
            key = (op.payload, op.layer, op.micro_batch)
            lane = lane_of(message_key(0, op.payload, op.layer, op.micro_batch))
            for peer in op.peers:
                if peer != rank:
                    src, dst = (rank, peer) if isinstance(op, Send) else (peer, rank)
                    add("send" if isinstance(op, Send) else "recv", ("p2p", src, dst, lane), op, key)
        for ranks in collectives(rank, op):
            add("collective", ("collective", tuple(sorted(ranks))), op)
    return ops


def replay(programs: Sequence[Sequence[Op]], collectives: Collectives) -> int:
    """Run every rank's NCCL operations under the module docstring's model; the count replayed."""
    ranks = [_expand(r, program, collectives) for r, program in enumerate(programs)]
    started = [[False] * len(ops) for ops in ranks]
    done = [[False] * len(ops) for ops in ranks]
    where = {(r, op.comm, op.seq, op.kind): i for r, ops in enumerate(ranks) for i, op in enumerate(ops)}

    def may_start(r: int, i: int) -> bool:
        op = ranks[r][i]
        for j in range(i):
            before = ranks[r][j]
            if done[r][j]:
                continue
            if op.kind == "collective" or before.kind == "collective" or before.comm == op.comm:
                return False
            if before.kind == "recv":  # waited on the compute stream, which every later NCCL op follows
                return False
        return True

    def peers_started(r: int, i: int) -> bool:
        op = ranks[r][i]
        if op.kind == "collective":
            members = op.comm[1]
            others = [where.get((m, op.comm, op.seq, "collective")) for m in members]
            return all(k is not None and started[m][k] for m, k in zip(members, others, strict=True))
        _, src, dst, _ = op.comm
        peer, kind = (dst, "recv") if op.kind == "send" else (src, "send")
        k = where.get((peer, op.comm, op.seq, kind))
        if k is not None and ranks[peer][k].key != op.key:
            raise ScheduleError(f"rank {src} sends {ranks[src][where[(src, op.comm, op.seq, 'send')]].key} "
                                f"where rank {dst} receives {ranks[dst][where[(dst, op.comm, op.seq, 'recv')]].key} "
                                f"on channel {op.comm}: an in-order transport would mix them up")
        return k is not None and started[peer][k]

    progress = True
    while progress:
        progress = False
        for r, ops in enumerate(ranks):
            for i in range(len(ops)):
                if not started[r][i] and may_start(r, i):
                    started[r][i] = progress = True
        for r, ops in enumerate(ranks):
            for i in range(len(ops)):
                if started[r][i] and not done[r][i] and peers_started(r, i):
                    done[r][i] = progress = True
    stuck = []
    for r, ops in enumerate(ranks):
        waiting = next((i for i in range(len(ops)) if not done[r][i]), None)
        if waiting is not None:
            op = ranks[r][waiting]
            stuck.append(f"rank {r} at its {op.kind} on {op.comm} (#{op.seq}, from {op.origin})")
    if stuck:
        raise ScheduleError("NCCL deadlock: " + "; ".join(stuck))
    return sum(len(ops) for ops in ranks)
