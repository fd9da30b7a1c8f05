"""Receive slots shared across layers and micro-batches (disagmoe/runtime/schedule/recv_slots.py):
for every layout of the schedule tests' grid no slot is given to a new message while an op that
reads the previous one (its consumer, and the backward op that frees what the consumer saved) is
still to run; replayed through the transports' slot buffers, every reader still finds its own
message; with every micro-batch's forward in flight the forward payloads get a slot per key."""

from __future__ import annotations

import pytest
import torch

from disagmoe.comm.base import TensorSpec, Transport
from disagmoe.runtime.schedule.recv_slots import slot_plan
from disagmoe.runtime.schedule.schedule import (
    AttentionBackward,
    AttentionForward,
    ExpertBackward,
    ExpertForward,
    Loss,
)
from disagmoe.runtime.topology import Topology
from disagmoe.wire import Payload, Recv, message_key

from tests.runtime.schedule.test_reuse_order import LAYOUTS


def _num_layers(programs) -> int:
    return 1 + max(op.layer for p in programs for op in p if isinstance(op, (AttentionForward, ExpertForward)))


def _readers(payload: Payload, layer: int, mb: int, last: int) -> set:
    """The ops that read a message or hold what its consumer saved (written from the schedule's data
    dependencies, independently of `recv_slots`' rule)."""
    if payload is Payload.DISPATCH:
        return {ExpertForward(layer, mb), ExpertBackward(layer, mb)}
    if payload in (Payload.COMBINE, Payload.RESIDUAL):
        if layer == last:
            return {Loss(mb)}
        return {AttentionForward(layer + 1, mb), AttentionBackward(layer + 1, mb)}
    if payload in (Payload.COMBINE_GRAD, Payload.EXPERT_LOAD):
        return {ExpertBackward(layer, mb)}
    return {AttentionBackward(layer, mb)}  # DISPATCH_GRAD, RESIDUAL_GRAD


def _is_moe(programs):
    moe = {op.layer for p in programs for op in p if isinstance(op, ExpertForward)}
    return lambda layer: layer in moe


@pytest.mark.parametrize("name,programs", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_no_slot_is_reused_while_its_message_is_read(name, programs):
    last = _num_layers(programs) - 1
    for rank, program in enumerate(programs):
        plan = slot_plan(program, rank, _is_moe(programs), last + 1)
        assert plan.overlaps() == []
        index = {op: i for i, op in enumerate(program) if not isinstance(op, Recv)}
        holders: dict = {}  # slot -> (key, its last reader's index)
        for i, op in enumerate(program):
            if not isinstance(op, Recv):
                continue
            for peer in op.peers:
                if peer == rank:
                    continue
                key = (peer, op.payload.value, op.layer, op.micro_batch)
                readers = [index[r] for r in _readers(op.payload, op.layer, op.micro_batch, last) if r in index]
                assert readers and min(readers) > i, (name, rank, key)  # it is read, after it arrived
                slot = plan.slot[key]
                if slot in holders:
                    old, end = holders[slot]
                    assert end < i, f"{name} rank {rank}: {key} lands in {slot} while {old} is read at op {end}"
                holders[slot] = (key, max(readers))
        assert sum(plan.pool_size.values()) <= sum(1 for op in program if isinstance(op, Recv)
                                                    for peer in op.peers if peer != rank)


class _Slots(Transport):
    """The base's slot buffers without a process group: a receive writes a value unique to its key."""

    kind = "slots"

    def __init__(self, rank: int) -> None:
        super().__init__(rank, 1 << 20, 1.0)

    def send(self, dst_rank, key, tensors):
        raise NotImplementedError

    def recv(self, src_rank, key, specs, timeout_s=None):
        buffers = self._slot_buffers(src_rank, key, specs, create=False)
        assert buffers is not None, f"{key} from {src_rank} was not reserved"
        return buffers

    def reserve(self, src_rank, key, specs, slot=None):
        self._slot_buffers(src_rank, key, specs, slot)


def _stamp(peer: int, payload: Payload, layer: int, mb: int) -> float:
    return float(((peer * 8 + list(Payload).index(payload)) * 64 + layer) * 64 + mb + 1)


@pytest.mark.parametrize("name,programs", [c for c in LAYOUTS if c[0].endswith(("m3", "m4"))],
                         ids=[n for n, _ in LAYOUTS if n.endswith(("m3", "m4"))])
def test_replayed_through_the_slot_buffers_every_reader_finds_its_message(name, programs):
    """Two steps of each rank's program through `Transport._slot_buffers` as the worker reserves
    them: each receive stamps its buffer, each reader checks the stamps of what it reads."""
    last = _num_layers(programs) - 1
    spec = [TensorSpec((4,), torch.float32)]
    for rank, program in enumerate(programs):
        plan = slot_plan(program, rank, _is_moe(programs), last + 1)
        transport = _Slots(rank)
        for (peer, payload, layer, mb), (pool, index) in plan.slot.items():
            transport.reserve(peer, message_key(0, Payload(payload), layer, mb), spec, slot=(pool, index))
        held: dict = {}  # op -> [(buffer, stamp)] it must find intact
        for step in range(2):
            for op in program:
                if isinstance(op, Recv):
                    for peer in op.peers:
                        if peer == rank:
                            continue
                        (buf,) = transport.recv(peer, message_key(step, op.payload, op.layer, op.micro_batch), spec)
                        stamp = _stamp(peer, op.payload, op.layer, op.micro_batch) + 1e6 * step
                        buf.fill_(stamp)
                        for reader in _readers(op.payload, op.layer, op.micro_batch, last):
                            held.setdefault(reader, []).append((buf, stamp))
                for buf, stamp in held.pop(op, []):
                    assert float(buf[0]) == stamp, f"{name} rank {rank} step {step}: {op} found another message"
        buffers = getattr(transport, "_buffers", {})
        assert len({id(b) for bs in buffers.values() for b in bs}) == sum(plan.pool_size.values())


@pytest.mark.parametrize("ranks,m", [(2, 4), (3, 2)])
def test_every_forward_in_flight_keeps_a_slot_per_key_and_the_gradients_one_per_peer(ranks, m):
    """Colocated: every micro-batch's forward of every layer is live until the backward, so no forward
    message may share; each gradient is read before the next arrives: one slot per peer."""
    top = Topology.colocated_ranks(ranks, 4, 0, 8)
    program = top.programs(m)[0]
    counts = slot_plan(program, 0, top.is_moe, top.num_layers).counts()
    peers, layers = ranks - 1, top.num_layers
    assert counts[("dispatch", True)] == counts[("combine", True)] == m * layers * peers
    assert counts[("dispatch_grad", True)] == counts[("combine_grad", True)] == peers
