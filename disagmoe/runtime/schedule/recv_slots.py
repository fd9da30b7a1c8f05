"""Receive slots shared by messages whose lifetimes do not overlap (torch-free).

A rank's program receives one message per (peer, payload, layer, micro-batch) and step. Keeping one
buffer per such key (the transports did, `roofline.transport_memory` priced it) holds every layer's
and micro-batch's message at once, though only those in flight are live. `slot_plan` gives every
receive key a slot of a pool keyed by (peer, payload, MoE layer): the buffers of one pool all have
the same specs, and a pool has as many slots as the program keeps live at once.

Lifetime of a message received by `Recv(payload, l, mb)` at op index i of a pass: from i to the
last op of the pass that may read it, taken as the last compute op on this rank of micro-batch mb
whose layer is l or l + 1 (`Loss(mb)` counts as layer `num_layers`). That covers what reads a
received buffer: the op that consumes it (layer l for DISPATCH, COMBINE_GRAD, DISPATCH_GRAD and
RESIDUAL_GRAD, layer l + 1 or the loss for COMBINE and RESIDUAL), the autograd state that op
saves (freed by its own backward op, also of (l or l + 1, mb)), and the deferred weight gradients,
which run right after a backward op's sends, before the next op that is not a send
(`TrainWorker._run_held_back`), hence before any later `Recv`. A slot is given to a new key only
if every key it held ended strictly before the new key's `Recv`: program order then puts every
read of the old message before the write of the new one (on a GPU the in-order transport's receive
is issued on a stream that waits for the compute queued before it). A tensor sent onwards that
aliases a slot would be read by the send after that, so the transports copy such a tensor before
sending (`comm.base.Transport._detach_from_slots`). An evaluation pass runs a sub-sequence of the
training program's forward ops (`reuse_order.pass_program`), so its lifetimes are within the
training pass's and the same plan holds. Steps follow one another in program order, as before.

    slot_plan(program, rank, is_moe, num_layers) -> SlotPlan   (slot of every receive key, pool sizes)
    SlotPlan.counts(is_moe)                                 slots by (payload, MoE layer): the model's counts
    SlotPlan.overlaps()                                     keys sharing a slot while both live (empty: sound)
    live_ends(program, rank, num_layers)                    the op past which a one-sided transport's
                                                            reader is done with each message

The one-sided transport (nvshmem) cannot rely on program order: its sender writes when it gets
there. It shares a ring per pool instead, sized by replaying every rank's passes
(`reuse_order.one_sided_slots`, from `live_ends`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from disagmoe.runtime.schedule.schedule import (
    AttentionBackward,
    AttentionForward,
    ExpertBackward,
    ExpertForward,
    Loss,
    Op,
)
from disagmoe.wire import Payload, Recv, Send

Pool = tuple[int, str, bool]  # (peer, payload value, MoE layer)
Key = tuple[int, str, int, int]  # (peer, payload value, layer, micro-batch)
_COMPUTE = (AttentionForward, ExpertForward, AttentionBackward, ExpertBackward)


@dataclass
class SlotPlan:
    """Every receive key's slot in its pool, the pools' sizes and each key's live interval."""

    slot: dict[Key, tuple[Pool, int]] = field(default_factory=dict)
    pool_size: dict[Pool, int] = field(default_factory=dict)
    live: dict[Key, tuple[int, int]] = field(default_factory=dict)  # (recv index, last read index)

    def counts(self) -> dict[tuple[str, bool], int]:
        """Slots by (payload, MoE layer), summed over peers (`roofline.transport_memory`'s Counts)."""
        out: dict[tuple[str, bool], int] = defaultdict(int)
        for (_, payload, moe), n in self.pool_size.items():
            out[(payload, moe)] += n
        return dict(out)

    def overlaps(self) -> list[tuple[Key, Key]]:
        """Pairs of keys given one slot whose live intervals intersect (none when the plan is sound)."""
        by_slot: dict[tuple[Pool, int], list[Key]] = defaultdict(list)
        for key, s in self.slot.items():
            by_slot[s].append(key)
        bad = []
        for keys in by_slot.values():
            keys.sort(key=lambda k: self.live[k])
            for a, b in zip(keys, keys[1:]):
                if self.live[b][0] <= self.live[a][1]:
                    bad.append((a, b))
        return bad


def _reads(op: Op, num_layers: int) -> tuple[int, int] | None:
    """(layer, micro-batch) of a compute op (Loss: layer num_layers), else None."""
    if isinstance(op, _COMPUTE):
        return op.layer, op.micro_batch
    if isinstance(op, Loss):
        return num_layers, op.micro_batch
    return None


def slot_plan(program: Sequence[Op], rank: int, is_moe: Callable[[int], bool], num_layers: int,
              skip: Callable[[Recv], bool] | None = None) -> SlotPlan:
    """The slots of `rank`'s receives (module docstring); `skip`: receives that use no slot
    (pair-row messages land in the transport's own buffers)."""
    last: dict[tuple[int, int], int] = {}
    for i, op in enumerate(program):
        at = _reads(op, num_layers)
        if at is not None:
            last[at] = i
    plan = SlotPlan()
    free_at: dict[Pool, list[int]] = defaultdict(list)  # pool -> per slot, the last read of its holder
    for i, op in enumerate(program):
        if not isinstance(op, Recv) or (skip is not None and skip(op)):
            continue
        end = max(last.get((op.layer, op.micro_batch), i), last.get((op.layer + 1, op.micro_batch), i), i)
        for peer in op.peers:
            if peer == rank:
                continue
            pool = (peer, op.payload.value, is_moe(op.layer))
            key = (peer, op.payload.value, op.layer, op.micro_batch)
            slots = free_at[pool]
            s = next((j for j, e in enumerate(slots) if e < i), None)
            if s is None:
                s = len(slots)
                slots.append(end)
            else:
                slots[s] = end
            plan.slot[key] = (pool, s)
            plan.live[key] = (i, end)
    plan.pool_size = {pool: len(slots) for pool, slots in free_at.items()}
    return plan


def live_ends(program: Sequence[Op], rank: int, num_layers: int) -> dict[tuple, int]:
    """(peer, payload, layer, micro-batch) -> the index of the op once past which the rank is done
    with that message on a one-sided transport: the first op after the end of its lifetime (module
    docstring) that is not a send (the deferred weight gradients that still read it run after
    those sends, before that op; `len(program)` if none is left). A message's writer learns that
    the rank got there only from a send of the rank after that op."""
    last: dict[tuple[int, int], int] = {}
    for i, op in enumerate(program):
        at = _reads(op, num_layers)
        if at is not None:
            last[at] = i
    out = {}
    for i, op in enumerate(program):
        if not isinstance(op, Recv):
            continue
        end = max(last.get((op.layer, op.micro_batch), i), last.get((op.layer + 1, op.micro_batch), i), i)
        end += 1
        while end < len(program) and isinstance(program[end], Send):
            end += 1
        for peer in op.peers:
            if peer != rank:
                out[(peer, op.payload, op.layer, op.micro_batch)] = end
    return out


def key_of(peer: int, payload: Payload, layer: int, micro_batch: int) -> Key:
    return peer, payload.value, layer, micro_batch
