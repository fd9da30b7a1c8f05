"""Receive arenas of the one-sided transport (disagmoe/comm/symmetric.py): every receive of a
program has an aligned segment of its message's specs, the arena is the same size on every rank,
and a message over its capacity is refused with the fix."""

import pytest
import torch

from disagmoe.comm.base import TensorSpec
from disagmoe.comm.symmetric import ALIGN, COPIES, symmetric_layouts
from disagmoe.wire import ArenaOverflow, Payload, Recv
from disagmoe.runtime.stages.messages import MessageShapes
from disagmoe.runtime.schedule.roles import Layout
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


# --- pair-row messages (hop mode pair_rows) ---------------------------------------------------------

SEGMENTS = 3


def _pair_of(payload, layer):
    """COMBINE as pair rows [T K, H] in SEGMENTS segments; every other message as segments."""
    if payload is not Payload.COMBINE:
        return None
    return TensorSpec((SHAPES.tokens * SHAPES.top_k, SHAPES.hidden), SHAPES.dtype), SEGMENTS


# odd sizes on purpose: an int64 [E] expert load, 6 bytes of bf16, an int32 scalar, an empty one
EXTRAS = (TensorSpec((SHAPES.num_experts,), torch.int64), TensorSpec((3,), torch.bfloat16),
          TensorSpec((), torch.int32), TensorSpec((0,), torch.int64))


def _pair_of_with_extras(payload, layer):
    """As `_pair_of`, with EXTRAS (the 3-tuple form)."""
    got = _pair_of(payload, layer)
    return None if got is None else (*got, EXTRAS)


def _nbytes(spec):
    return torch.empty(spec.shape, dtype=spec.dtype).nbytes


def _spans(layout):
    """(start, end) of every tensor in the arena: the segments', the pair regions' rows and extras."""
    spans = [(o, o + _nbytes(spec)) for s in layout.segments for o, spec in zip(s.offsets, s.specs, strict=True)]
    spans += [(r.offset, r.offset + _nbytes(r.spec)) for r in layout.pairs]
    spans += [(o, o + _nbytes(spec)) for r in layout.pairs for o, spec in r.extras]
    return sorted(spans)


@pytest.mark.parametrize("pair_of", [_pair_of, _pair_of_with_extras], ids=["rows", "rows+extras"])
@pytest.mark.parametrize("topology", [Topology.disaggregated(Layout(2, 2, 2, 4, 0), 8),
                                      Topology.colocated_ranks(3, 2, 0, 8)], ids=["A2-E2-p2", "colocated3"])
def test_pair_row_receives_get_one_region_per_copy_beside_the_segments(topology, pair_of):
    programs = topology.programs(2)

    def specs_of(payload, layer):
        return SHAPES.specs(payload, topology.is_moe(layer))

    plain = symmetric_layouts(programs, specs_of)
    layouts = symmetric_layouts(programs, specs_of, pair_of=pair_of)
    assert all(layout.pairs == () for layout in plain)
    assert len({(layout.nbytes, layout.flag_words) for layout in layouts}) == 1
    needed = []
    for rank, (program, layout) in enumerate(zip(programs, layouts, strict=True)):
        combines = [op for op in program if isinstance(op, Recv) and op.payload is Payload.COMBINE]
        slots = [(p, op.payload, op.layer, op.micro_batch) for op in program if isinstance(op, Recv)
                 and op.payload is not Payload.COMBINE for p in op.peers if p != rank]
        assert [(s.slot, s.copy) for s in layout.segments] == [(slot, c) for slot in slots for c in range(COPIES)]
        assert [(r.slot, r.copy, r.sources) for r in layout.pairs] == [
            ((op.payload, op.layer, op.micro_batch), c, op.peers) for op in combines for c in range(COPIES)]
        # flags: the segments' first (as without pairs), then one contiguous [Q, S] block per region,
        # each starting at an even word (16-byte aligned: one compiled variant of the kernels)
        assert [s.flag for s in layout.segments] == list(range(len(layout.segments)))
        end = len(layout.segments)
        for region in layout.pairs:
            end += end % 2
            assert region.flag == end and region.flag_words == len(region.sources) * SEGMENTS
            end += region.flag_words
        end += end % 2 if layout.pairs else 0  # the last block padded too
        assert end <= layout.flag_words
        needed.append(end)
        # bytes: aligned, after the flag region, no overlap, inside the arena
        spans = _spans(layout)
        assert spans[0][0] >= 8 * layout.flag_words and all(o % ALIGN == 0 for o, _ in spans)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])) and spans[-1][1] <= layout.nbytes
        assert all(r.spec == _pair_of(Payload.COMBINE, 0)[0] and r.segments == SEGMENTS for r in layout.pairs)
        want_extras = EXTRAS if pair_of is _pair_of_with_extras else ()
        for region in layout.pairs:
            assert region.extra_specs == want_extras
            # the extras follow the region's own rows, and the region's bytes cover them
            assert all(o >= region.offset + _nbytes(region.spec) for o, _ in region.extras)
            assert [o for o, _ in region.extras] == sorted(o for o, _ in region.extras)
            end = max([region.offset + _nbytes(region.spec)] + [o + _nbytes(spec) for o, spec in region.extras])
            assert region.offset + region.nbytes == end
    assert layouts[0].flag_words == max(needed)  # the largest rank's flags, on every rank
    assert any(layout.pairs for layout in layouts)


def test_extras_cost_arena_bytes_not_flags_and_a_two_tuple_carries_none():
    topology = Topology.colocated_ranks(3, 2, 0, 8)
    programs = topology.programs(2)

    def specs_of(payload, layer):
        return SHAPES.specs(payload, True)

    rows = symmetric_layouts(programs, specs_of, pair_of=_pair_of)
    extras = symmetric_layouts(programs, specs_of, pair_of=_pair_of_with_extras)
    assert all(r.extras == () and r.nbytes == _nbytes(r.spec) for layout in rows for r in layout.pairs)
    assert rows[0].flag_words == extras[0].flag_words
    # every region grew by its extras, each padded to ALIGN after the rows (the empty one too)
    per_region = sum(-(-_nbytes(spec) // ALIGN) * ALIGN for spec in EXTRAS)
    assert extras[0].nbytes - rows[0].nbytes == max(len(layout.pairs) for layout in extras) * per_region
    for plain, more in zip(rows, extras, strict=True):
        assert [s.offsets for s in plain.segments] == [s.offsets for s in more.segments]  # segments first, untouched
        assert [(r.slot, r.copy, r.flag) for r in plain.pairs] == [(r.slot, r.copy, r.flag) for r in more.pairs]
    # an explicitly empty extras tuple is the 2-tuple's layout
    empty = symmetric_layouts(programs, specs_of, pair_of=lambda p, l: None if _pair_of(p, l) is None
                              else (*_pair_of(p, l), ()))
    assert empty == rows


def test_extras_are_viewed_in_any_arena_at_their_offsets():
    topology = Topology.disaggregated(Layout(1, 1, 1, 2, 0), 8)
    attention = symmetric_layouts(topology.programs(2), lambda p, l: SHAPES.specs(p, True),
                                  pair_of=_pair_of_with_extras)[0]
    regions = [attention.pair_region((Payload.COMBINE, 0, 0), n) for n in range(2)]
    assert regions[0].extras != regions[1].extras  # each copy has its own
    local = torch.zeros(attention.nbytes, dtype=torch.uint8)
    peer = torch.zeros(attention.nbytes, dtype=torch.uint8)  # stands for a peer's view of that arena
    for arena in (local, peer):
        for n, region in enumerate(regions):
            views = region.extra_views(arena)
            assert [TensorSpec.of(v) for v in views] == list(EXTRAS)
            assert [v.data_ptr() - arena.data_ptr() for v in views if v.numel()] == [
                o for o, spec in region.extras if _nbytes(spec)]  # an empty view has no address
            assert all(v.is_contiguous() for v in views)
            load = views[0]
            load.copy_(torch.arange(SHAPES.num_experts) + 100 * n)
            views[2].fill_(-7 - n)
    assert torch.equal(local, peer)
    for n, region in enumerate(regions):
        load, _, scalar, _ = region.extra_views(local)
        assert torch.equal(load, torch.arange(SHAPES.num_experts) + 100 * n) and scalar.item() == -7 - n
        rows, flags = region.rows(local), region.flags(local)
        assert (rows == 0).all() and (flags == 0).all()  # writing the extras touched neither
    assert (attention.flags(local) == 0).all()


def test_colocated_pair_regions_count_the_rank_itself_as_a_source():
    topology = Topology.colocated_ranks(3, 2, 0, 8)
    layouts = symmetric_layouts(topology.programs(2), lambda p, l: SHAPES.specs(p, True), pair_of=_pair_of)
    for rank, layout in enumerate(layouts):
        assert layout.pairs and all(r.sources == (0, 1, 2) and rank in r.sources for r in layout.pairs)
        # COMBINE has no segment at all, not even from the peers
        assert not [s for s in layout.segments if s.slot[1] is Payload.COMBINE]


def test_pair_regions_alternate_copies_and_view_rows_and_flags_in_any_arena():
    topology = Topology.disaggregated(Layout(1, 1, 1, 2, 0), 8)
    layouts = symmetric_layouts(topology.programs(2), lambda p, l: SHAPES.specs(p, True), pair_of=_pair_of)
    attention, expert = layouts
    assert expert.pairs == ()  # the expert rank receives no COMBINE
    slot = attention.pairs[0].slot
    assert slot == (Payload.COMBINE, 0, 0)
    regions = [attention.pair_region(slot, n) for n in range(5)]
    assert regions[0] == regions[2] == regions[4] and regions[1] == regions[3] and regions[0] != regions[1]
    assert (regions[0].copy, regions[1].copy) == (0, 1)
    assert regions[0].offset != regions[1].offset and regions[0].flag != regions[1].flag
    local = torch.zeros(attention.nbytes, dtype=torch.uint8)
    peer = torch.zeros(attention.nbytes, dtype=torch.uint8)  # stands for a peer's view of that arena
    for arena in (local, peer):
        for n, region in enumerate(regions[:2]):
            rows, flags = attention.pair_views(arena, slot, n)
            assert (rows.shape, rows.dtype) == ((SHAPES.tokens * SHAPES.top_k, SHAPES.hidden), SHAPES.dtype)
            assert (flags.shape, flags.dtype) == ((1, SEGMENTS), torch.int64) and flags.is_contiguous()
            assert rows.data_ptr() == arena.data_ptr() + region.offset
            assert flags.data_ptr() == arena.data_ptr() + 8 * region.flag
            rows.fill_(n + 1)
            flags[0, SEGMENTS - 1] = 10 + n
    assert torch.equal(local, peer)
    flags_W = attention.flags(local)  # the block's words are the flag region's
    assert flags_W[regions[0].flag + SEGMENTS - 1] == 10 and flags_W[regions[1].flag + SEGMENTS - 1] == 11
    assert (flags_W[:len(attention.segments)] == 0).all()  # no segment flag was touched
    assert (attention.pair_views(local, slot, 0)[0] == 1).all() and (attention.pair_views(local, slot, 1)[0] == 2).all()


def test_a_slot_that_is_not_a_pair_region_is_a_clear_key_error():
    topology = Topology.disaggregated(Layout(1, 1, 1, 2, 0), 8)
    attention, expert = symmetric_layouts(topology.programs(2), lambda p, l: SHAPES.specs(p, True), pair_of=_pair_of)
    with pytest.raises(KeyError, match="no pair-row region for the dispatch message of layer 0, micro-batch 0"):
        attention.pair_region((Payload.DISPATCH, 0, 0))
    with pytest.raises(KeyError, match="not a pair-row receive of this rank's program"):
        expert.pair_region((Payload.COMBINE, 0, 0), 1)
    with pytest.raises(KeyError, match="micro-batch 7"):
        attention.pair_views(torch.zeros(attention.nbytes, dtype=torch.uint8), (Payload.COMBINE, 0, 7))


def test_flag_owner_names_segments_and_pair_blocks():
    topology = Topology.colocated_ranks(3, 2, 0, 8)
    layout = symmetric_layouts(topology.programs(2), lambda p, l: SHAPES.specs(p, True), pair_of=_pair_of)[1]
    for seg in layout.segments:
        assert layout.flag_owner(seg.flag) is seg
    for region in layout.pairs:
        for q in range(len(region.sources)):
            for s in range(SEGMENTS):
                assert layout.flag_owner(region.flag + q * SEGMENTS + s) == (region, q, s)
    used = layout.pairs[-1].flag + layout.pairs[-1].flag_words
    assert layout.flag_owner(used) is None and layout.flag_owner(-1) is None


@pytest.mark.parametrize("world", [2, 3, 5])
def test_the_sum_region_follows_everything_and_is_the_same_on_every_rank(world):
    topology = Topology.colocated_ranks(world, 2, 0, 8)
    specs_of, programs = (lambda p, l: SHAPES.specs(p, True)), topology.programs(2)
    plain = symmetric_layouts(programs, specs_of, pair_of=_pair_of)
    layouts = symmetric_layouts(programs, specs_of, pair_of=_pair_of, sum_width=3)
    assert plain[0].sums is None
    region = layouts[0].sums
    assert all(layout.sums == region for layout in layouts) and (region.ranks, region.width) == (world, 3)
    message_words = plain[0].flag_words
    assert region.flag == message_words and region.flag % 2 == 0  # after every message's flags, 16-byte aligned
    assert layouts[0].flag_words == message_words + region.flag_words + region.flag_words % 2
    ends = [offset + torch.empty(spec.shape, dtype=spec.dtype).nbytes for layout in layouts
            for seg in layout.segments for offset, spec in zip(seg.offsets, seg.specs)] + [
        pair.offset + pair.nbytes for layout in layouts for pair in layout.pairs]
    assert region.offset % ALIGN == 0 and region.offset >= max(ends)
    assert layouts[0].nbytes == region.offset + 8 * 3 * 2 * world
    arena_B = torch.zeros(layouts[0].nbytes, dtype=torch.uint8)
    words = set()
    for copy in range(2):
        for rank in range(world):
            shares = region.shares(arena_B, copy)
            offset = region.share_offset(copy, rank)
            arena_B[offset:offset + 24].view(torch.float64).fill_(10 * copy + rank)
            assert shares.shape == (world, 3) and shares[rank].tolist() == [10 * copy + rank] * 3
            flag = region.flag_of(copy, rank)
            assert layouts[rank].flag_owner(flag) == (region, copy, rank)
            words.add(flag)
    assert len(words) == 2 * world and max(words) < layouts[0].flag_words
    with pytest.raises(ValueError, match="sum_width=-1 must be >= 0"):
        symmetric_layouts(programs, specs_of, sum_width=-1)


def test_pair_of_must_give_rows_and_segments():
    topology = Topology.disaggregated(Layout(1, 1, 1, 2, 0), 8)
    programs = topology.programs(1)
    bad_rows = lambda p, l: (TensorSpec((16,), torch.bfloat16), 2) if p is Payload.COMBINE else None  # noqa: E731
    no_segments = lambda p, l: (TensorSpec((4, 16), torch.bfloat16), 0) if p is Payload.COMBINE else None  # noqa: E731
    for pair_of in (bad_rows, no_segments):
        with pytest.raises(ValueError, match=r"expected rows \[P, H\] and at least one segment"):
            symmetric_layouts(programs, lambda p, l: SHAPES.specs(p, True), pair_of=pair_of)
    rows = TensorSpec((4, 16), torch.bfloat16)
    bad_extras = [(rows, 2, (torch.int64,)), (rows, 2, TensorSpec((8,), torch.int64)), (rows, 2, None)]
    for got in bad_extras:
        with pytest.raises(ValueError, match="expected a tuple of TensorSpecs"):
            symmetric_layouts(programs, lambda p, l: SHAPES.specs(p, True),
                              pair_of=lambda p, l, got=got: got if p is Payload.COMBINE else None)
    for got in [(rows,), (rows, 2, (), ()), rows]:
        with pytest.raises(ValueError, match=r"expected \(rows \[P, H\], segments\) or \(rows \[P, H\], segments, "
                                             r"extras\)"):
            symmetric_layouts(programs, lambda p, l: SHAPES.specs(p, True),
                              pair_of=lambda p, l, got=got: got if p is Payload.COMBINE else None)


def test_a_capacity_factor_scales_segments_not_pair_rows():
    topology = Topology.disaggregated(Layout(1, 1, 1, 2, 0), 8)
    layouts = symmetric_layouts(topology.programs(1), lambda p, l: SHAPES.specs(p, True), capacity_factor=0.5,
                                pair_of=_pair_of)
    attention = layouts[0]
    assert all(r.spec.shape == (SHAPES.tokens * SHAPES.top_k, SHAPES.hidden) for r in attention.pairs)
    assert all(s.specs[0].shape[0] == SHAPES.tokens // 2 for s in layouts[1].segments if s.slot[1] is Payload.DISPATCH)
