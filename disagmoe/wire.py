"""The names of the messages between ranks, shared by the schedule (`runtime.schedule`) and the
transports (`comm`): what a message carries, the ops that send and receive it, and its key.

Torch-free and importing nothing of the package: the planner replays schedules without torch, and
`comm` and `runtime` both build on these types without importing each other's modules.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import NamedTuple


class Direction(IntEnum):
    """Which pass a message belongs to: activations flow forward, gradients backward."""

    FORWARD = 0
    BACKWARD = 1


class MessageKey(NamedTuple):
    """Names one message between an ordered pair of ranks."""

    step: int
    micro_batch: int
    layer: int
    direction: Direction

    def __str__(self) -> str:
        return (
            f"(step={self.step}, micro_batch={self.micro_batch}, layer={self.layer}, "
            f"{self.direction.name.lower()})"
        )


LANES = 2  # in-order channels per ordered rank pair


def lane_of(key: MessageKey) -> int:
    """The channel of a rank pair a message travels on in an in-order transport: the key's layer
    field mod 2 (`message_key` puts COMBINE-kind messages on lane 1, DISPATCH- and RESIDUAL-kind
    ones on lane 0)."""
    return key.layer % LANES


class Payload(Enum):
    """What a message carries; its direction is part of the transport key."""

    DISPATCH = "dispatch"  # a layer's token rows once, with top-k ids and weights A_g -> E_g
    COMBINE = "combine"  # one weighted partial sum per token E_g -> A_(g+1)
    RESIDUAL = "residual"  # residual stream (+ shared experts' output) A_g -> A_(g+1), p > 1
    DISPATCH_GRAD = "dispatch_grad"  # grads of the rows and weights, + the micro-batch's load E_g -> A_g
    COMBINE_GRAD = "combine_grad"  # grads of the partial sums A_(g+1) -> E_g
    RESIDUAL_GRAD = "residual_grad"  # grads of the residual stream A_(g+1) -> A_g
    EXPERT_LOAD = "expert_load"  # a block's load over its sources [E], E_g,j -> the other blocks' E_g,j

    @property
    def backward(self) -> bool:
        """True for the backward pass's payloads: the gradients', and the load the expert backward
        returns with them (sent and received there; an evaluation pass moves none)."""
        return self.value.endswith("_grad") or self is Payload.EXPERT_LOAD

    @property
    def direction(self) -> Direction:
        return Direction.BACKWARD if self.backward else Direction.FORWARD


def message_key(step: int, payload: Payload, layer: int, micro_batch: int) -> MessageKey:
    """The transport key of a message.

    A colocated rank pair carries both DISPATCH and COMBINE for the same (micro-batch, layer)
    in the same direction, so the key's layer field holds 2 * layer + (1 for COMBINE[_GRAD]). That
    low bit is also the message's lane (`lane_of`): an in-order transport keeps one channel per
    (rank pair, lane), and every schedule receives each channel's messages in the order they were
    sent (tests/runtime/schedule/test_schedule.py checks every layout). EXPERT_LOAD shares
    DISPATCH_GRAD's key: it travels only between expert ranks of different EP blocks or replica
    sets, pairs that carry no other payload (`runtime.topology.Topology.load_peers`).
    """
    slot = 1 if payload in (Payload.COMBINE, Payload.COMBINE_GRAD) else 0
    return MessageKey(step, micro_batch, 2 * layer + slot, payload.direction)


@dataclass(frozen=True)
class _MessageOp:
    payload: Payload
    layer: int
    micro_batch: int
    peers: tuple[int, ...]

    def key(self, step: int) -> MessageKey:
        """The transport key of this op's message in `step` (`message_key`: COMBINE's lane bit too)."""
        return message_key(step, self.payload, self.layer, self.micro_batch)


@dataclass(frozen=True)
class Send(_MessageOp):
    """A schedule op: send `payload` of (layer, micro-batch) to `peers`."""


@dataclass(frozen=True)
class Recv(_MessageOp):
    """A schedule op: receive `payload` of (layer, micro-batch) from every one of `peers`."""


class ArenaOverflow(RuntimeError):
    """A message did not fit its receive segment (a capacity factor below its rows); raised by the
    arena's checks (`comm.symmetric`) and by the step's read of the kernels' status words
    (`kernels.signal`)."""
