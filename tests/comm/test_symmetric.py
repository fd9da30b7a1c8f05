"""Receive arenas of the one-sided transport (disagmoe/comm/symmetric.py): every receive of a
program has an aligned segment of its message's specs, the arena is the same size on every rank,
and a message over its capacity is refused with the fix."""

import pytest
import torch

from disagmoe.comm.base import TensorSpec
from disagmoe.comm.symmetric import ALIGN, COPIES, ArenaOverflow, symmetric_layouts
from disagmoe.runtime.messages import MessageShapes
from disagmoe.runtime.roles import Layout
from disagmoe.runtime.schedule import Payload, Recv
from disagmoe.runtime.topology import Topology

SHAPES = MessageShapes(rows=2, seq_len=8, hidden=16, top_k=2, num_experts=8, dtype=torch.bfloat16,
                       shared_experts=True)


@pytest.mark.parametrize("topology", [Topology.disaggregated(Layout(2, 2, 2, 4, 0), 8),
                                      Topology.colocated_ranks(3, 2, 0, 8)], ids=["A2-E2-p2", "colocated3"])
def test_every_receive_has_an_aligned_segment_of_its_specs(topology):
    programs = topology.programs(2)
    layouts = symmetric_layouts(programs, lambda payload, layer: SHAPES.specs(payload, topology.is_moe(layer)))
    assert len({layout.nbytes for layout in layouts}) == 1 and len({layout.flag_words for layout in layouts}) == 1
    for rank, (program, layout) in enumerate(zip(programs, layouts, strict=True)):
        slots = [(p, op.payload, op.layer, op.micro_batch) for op in program if isinstance(op, Recv)
                 for p in op.peers if p != rank]
        assert [(s.slot, s.copy) for s in layout.segments] == [(slot, c) for slot in slots for c in range(COPIES)]
        assert sorted(s.flag for s in layout.segments) == list(range(len(layout.segments)))
        spans = sorted((o, o + torch.empty(spec.shape, dtype=spec.dtype).nbytes) for s in layout.segments
                       for o, spec in zip(s.offsets, s.specs, strict=True))
        assert spans[0][0] >= 8 * layout.flag_words and all(o % ALIGN == 0 for o, _ in spans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= layout.nbytes
        arena = torch.zeros(layout.nbytes, dtype=torch.uint8)
        for seg in layout.segments:
            views = layout.views(arena, seg.slot, seg.specs, index=seg.copy)
            assert [TensorSpec.of(v) for v in views] == list(seg.specs)


def test_consecutive_messages_alternate_between_the_copies_of_a_slot():
    topology = Topology.disaggregated(Layout(1, 1, 1, 2, 0), 8)
    layout = symmetric_layouts(topology.programs(2), lambda p, l: SHAPES.specs(p, True))[1]
    slot = layout.segments[0].slot
    steps = [layout.segment(slot, step) for step in range(5)]
    assert steps[0] == steps[2] == steps[4] and steps[1] == steps[3] and steps[0] != steps[1]
    assert steps[0].offsets[0] != steps[1].offsets[0] and steps[0].flag != steps[1].flag
    with pytest.raises(KeyError, match="not a message of this rank's program"):
        layout.segment((0, Payload.RESIDUAL, 0, 0), 0)


def test_a_message_over_its_capacity_is_refused_naming_the_fix():
    topology = Topology.disaggregated(Layout(1, 1, 1, 2, 0), 8)
    programs = topology.programs(1)
    layouts = symmetric_layouts(programs, lambda p, l: SHAPES.specs(p, True), capacity_factor=0.5)
    expert = layouts[1]
    seg = expert.segments[0]
    assert seg.slot[1] is Payload.DISPATCH and seg.copy == 0 and seg.specs[0].shape == (8, 16)  # half of 16 token rows
    arena = torch.zeros(expert.nbytes, dtype=torch.uint8)
    with pytest.raises(ArenaOverflow, match="has 16 rows but its receive segment holds 8; raise the transport's capacity_factor"):
        expert.views(arena, seg.slot, SHAPES.specs(Payload.DISPATCH, True))
    with pytest.raises(ValueError, match="capacity_factor"):
        symmetric_layouts(programs, lambda p, l: SHAPES.specs(p, True), capacity_factor=0)
