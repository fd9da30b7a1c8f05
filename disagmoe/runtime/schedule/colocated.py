"""The colocated schedule: every rank runs attention (data-parallel) and holds a share of the experts.

The conventional expert-parallel layout, our baseline. For each layer and micro-batch every rank
runs its attention, sends each rank (itself included) the rows routed to that rank's experts
(all-to-all DISPATCH), runs its experts on what it received and sends the outputs back
(all-to-all COMBINE); the backward pass mirrors it. It uses the op types of
`disagmoe.runtime.schedule.schedule`; a message to oneself is delivered locally by the worker.

Order per rank: forward in (layer, micro-batch) order, the losses, backward in (reversed layer,
micro-batch) order. Every rank runs the same list, and each receive follows the matching send of
every peer in that list, so nothing deadlocks. The data-parallel gradient sum stays in the
`OptimizerStep`: every point of the backward has a send in flight to a peer that receives it only
later, so a collective there could wait on a peer's GPU held by that very transfer
(`runtime.stages.nccl_order` finds the deadlock; the disaggregated schedule overlaps it instead).
"""

from __future__ import annotations

from disagmoe.runtime.schedule.schedule import (
    AttentionBackward,
    AttentionForward,
    ExpertBackward,
    ExpertForward,
    Loss,
    Op,
    OptimizerStep,
)
from disagmoe.wire import Payload, Recv, Send


def build_colocated_schedule(
    ranks: int, num_layers: int, num_dense_layers: int, micro_batches: int
) -> tuple[tuple[Op, ...], ...]:
    """Every rank's ordered op list for one training step (all ranks run the same list)."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be at least 1")
    everyone = tuple(range(ranks))

    def is_moe(layer: int) -> bool:
        return layer >= num_dense_layers

    ops: list[Op] = []
    for layer in range(num_layers):
        for mb in range(micro_batches):
            if layer > 0 and is_moe(layer - 1):
                ops.append(Recv(Payload.COMBINE, layer - 1, mb, everyone))
            ops.append(AttentionForward(layer, mb))
            if is_moe(layer):
                ops += [
                    Send(Payload.DISPATCH, layer, mb, everyone),
                    Recv(Payload.DISPATCH, layer, mb, everyone),
                    ExpertForward(layer, mb),
                    Send(Payload.COMBINE, layer, mb, everyone),
                ]
    last = num_layers - 1
    for mb in range(micro_batches):
        if is_moe(last):
            ops.append(Recv(Payload.COMBINE, last, mb, everyone))
        ops.append(Loss(mb))
        if is_moe(last):
            ops.append(Send(Payload.COMBINE_GRAD, last, mb, everyone))
    for layer in reversed(range(num_layers)):
        for mb in range(micro_batches):
            if is_moe(layer):
                ops += [
                    Recv(Payload.COMBINE_GRAD, layer, mb, everyone),
                    ExpertBackward(layer, mb),
                    Send(Payload.DISPATCH_GRAD, layer, mb, everyone),
                    Recv(Payload.DISPATCH_GRAD, layer, mb, everyone),
                ]
            ops.append(AttentionBackward(layer, mb))
            if layer > 0 and is_moe(layer - 1):
                ops.append(Send(Payload.COMBINE_GRAD, layer - 1, mb, everyone))
    ops.append(OptimizerStep(everyone))
    program = tuple(ops)
    return tuple(program for _ in range(ranks))


def rank_pairs(programs: tuple[tuple[Op, ...], ...]) -> list[tuple[int, int]]:
    """The (src, dst) pairs of distinct ranks that exchange messages."""
    return sorted(
        {(rank, peer) for rank, program in enumerate(programs)
         for op in program if isinstance(op, Send) for peer in op.peers if peer != rank}
    )
