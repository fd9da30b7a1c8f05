"""Receive arenas of the one-sided (NVSHMEM) transport: where each incoming message of a rank lands
and how its arrival is signalled (issue 11, the part that needs no GPU to test).

One arena per rank, the same size on every rank (NVSHMEM allocates symmetric memory collectively,
so the size is the largest any rank needs): a flag region of int64 words, one per segment, then
the payload region. A receive slot holds one or more keys (source rank, payload, layer,
micro-batch) of the rank's program, read off the schedule's `Recv` ops: by default each key its
own slot of `copies` segments; with `shared` (`runtime.schedule.reuse_order.one_sided_slots`, what
the runtime builds) the keys of a pool (source, payload, MoE layer) share one ring of N segments.
The n-th message of a slot, counted over all its keys (n = 1, 2, ...), lands in segment
(n - 1) mod N. Its tensors sit at 256-byte aligned offsets, sized from the run's fixed message
specs (`runtime.stages.messages.MessageShapes`), their rows scaled by `capacity_factor` if one is
given (None: the plan's worst case, exactly).

Why a ring and no handshake: a one-sided write lands whenever the sender gets there, not when the
receiver asks (as an NCCL receive does), so message n + N may be written only once the receiver is
done with message n, its deferred weight gradients included. `reuse_order` replays every rank's
passes (training and evaluation interleaved) with vector clocks and sizes each ring so that the
sender's write of message n + N happens-after the receiver's op past message n's last read, along
a chain of messages and the step's all-reduce; no acknowledgement is ever sent. Unshared, two
copies per key suffice (the same replay, tests/runtime/schedule/test_reuse_order.py): one would
not once evaluation runs (colocated, or with the loss off pipeline group 0, a pass's first sends
start before the end of the pass before is known to them).

Flags count a segment's messages (`kernels.signal`): the sender writes the payload into the
peer's segment, then adds 1 to the segment's flag with a release at system scope; the receiver
keeps, on its own GPU, how many of the flag's messages it consumed, and its wait (acquire loads,
on the stream) passes once the flag counts one more. The k-th message into segment c of a ring of
N is the slot's message n = c + 1 + (k - 1) N, so "the flag counts k" says what "the flag holds n"
said when flags held sequence numbers: a later key's reader never passes on an earlier key's
message, nothing is reset between steps, and no host number enters the wait (a step stays
capturable as a CUDA graph, replayed while every count is in the phase it was captured in,
`comm.counts`). A message whose rows exceed its segment's capacity is not written: the sender
sets the flag to `signal.FAILED`, the wait records an overflow in the rank's status word, and the
step's one read of the status raises `ArenaOverflow` naming the segment and the fix (never silent
corruption).

Pair-row messages (hop mode `pair_rows`, `comm.base.PairSpec`): a receive whose (payload, layer)
`pair_of` names is not a segment per peer but one `PairRegion` per copy of its pair slot (payload,
layer, micro-batch): a rows buffer [P, H] that every source of the receive writes its own pair rows
into (the rank itself too, where it is one: a colocated rank writes its own buffer), and a
contiguous flag block [Q, S] beside it, row q for source q (the receive's peers, in their order),
word s its segment s, counting one more message once the source's rows of that segment are
stored (`kernels.fused_return`). The flag region holds the segments' flags first, then every pair region's
block. Rows sit at a pair's index t K + j, so no capacity factor scales them: a region holds the
plan's P rows exactly. A message may also carry extras (`PairSpec.extras`: small whole tensors, e.g.
an int64 [E] expert load, written by its first source only): `pair_of` then gives them as a third
item, and each copy of the region holds them after its rows, each at its own ALIGN-aligned offset.
The message count n picks the copy as for segments.

The all-ranks sum (`SumRegion`, when `symmetric_layouts` is given a `sum_width`): after every
message's buffers, the same region in every rank's arena, R shares of `sum_width` float64 words
per copy (share q: rank q's values) and a flag per share, after the messages' flags. The n-th sum
uses copy (n - 1) mod copies: every rank stores its values into share `rank` of every arena (its
own included), adding 1 to the share's flag, waits for every other share's flag, and sums the R
shares in rank order, so every rank computes the same bits. Two copies suffice for the same
reason as for messages: a rank writes sum n + 2 only after its wait for sum n + 1 passed, which
is after every peer finished reading sum n on its stream.

Shape legend: W flag words (segments' and pair blocks'), B arena bytes, P pair rows, H hidden,
Q sources, S segments, R ranks, N a sum's width.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

import torch

from disagmoe.comm.base import TensorSpec
from disagmoe.wire import ArenaOverflow, Payload, Recv

ALIGN = 256
Slot = tuple[int, Payload, int, int]  # (source rank, payload, layer, micro-batch)
PairSlot = tuple[Payload, int, int]  # (payload, layer, micro-batch): one buffer for every source
# (payload, layer) -> (rows [P, H], S) or (rows [P, H], S, extras), None for a message sent as segments
PairOf = Callable[[Payload, int], tuple[TensorSpec, int] | tuple[TensorSpec, int, Sequence[TensorSpec]] | None]




COPIES = 2  # segments per slot (module docstring)


@dataclass(frozen=True)
class Segment:
    slot: Slot  # the first of the keys it holds (the transport counts its messages under it)
    copy: int  # the slot's messages n with (n - 1) mod N == copy land in it (N: its ring, `ArenaLayout.ring`)
    flag: int  # index of its flag word
    offsets: tuple[int, ...]  # byte offset of each tensor in the arena
    specs: tuple[TensorSpec, ...]  # the capacity of each tensor (rows scaled)
    keys: tuple[Slot, ...] = ()  # every key whose messages land in it (shared slots), `slot` first

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in self.specs)


def _nbytes(spec: TensorSpec) -> int:
    return math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()


@dataclass(frozen=True)
class PairRegion:
    """One copy of a pair slot's receive buffer: rows [P, H] at byte `offset`, flags [Q, S] at
    flag words [flag, flag + Q S), and the message's extras after the rows, each at its own
    ALIGN-aligned byte offset (module docstring)."""

    slot: PairSlot
    copy: int  # the slot's messages n with (n - 1) mod copies == copy land in it
    sources: tuple[int, ...]  # the Q writing ranks (the receive's peers, this rank included), flag rows' order
    flag: int  # index of the block's first flag word (source q, segment s: flag + q S + s)
    offset: int  # byte offset of the rows in the arena (ALIGN-aligned)
    spec: TensorSpec  # the rows [P, H]
    segments: int  # S
    extras: tuple[tuple[int, TensorSpec], ...] = ()  # (byte offset in the arena, spec) of each extra

    @property
    def flag_words(self) -> int:
        """Q S: the flag block's int64 words."""
        return len(self.sources) * self.segments

    @property
    def extra_specs(self) -> tuple[TensorSpec, ...]:
        """The message's extras (`PairSpec.extras`), in order."""
        return tuple(spec for _, spec in self.extras)

    @property
    def nbytes(self) -> int:
        """The region's bytes from `offset`: the rows, then the extras (alignment gaps included)."""
        if self.extras:
            last, spec = self.extras[-1]
            return last + _nbytes(spec) - self.offset
        return _nbytes(self.spec)

    def rows(self, arena_B: torch.Tensor) -> torch.Tensor:
        """The rows [P, H] in an arena (this rank's or a peer view of it: the offsets are the same)."""
        return _view(arena_B, self.offset, self.spec)

    def extra_views(self, arena_B: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The extras in an arena (this rank's or a peer view of it: the offsets are the same)."""
        return tuple(_view(arena_B, offset, spec) for offset, spec in self.extras)

    def flags(self, arena_B: torch.Tensor) -> torch.Tensor:
        """The int64 flag block [Q, S] in an arena (row q: source q's flags)."""
        start = 8 * self.flag
        return arena_B[start:start + 8 * self.flag_words].view(torch.int64).view(len(self.sources), self.segments)

    def block(self, words_W: torch.Tensor) -> torch.Tensor:
        """The block's [Q, S] of words indexed as the flag region (the receiver's consumed words)."""
        return words_W[self.flag:self.flag + self.flag_words].view(len(self.sources), self.segments)


@dataclass(frozen=True)
class SumRegion:
    """The all-ranks sum's shares (module docstring): copy c, rank q's float64 [N] at byte
    offset + 8 N (c R + q), its flag at word flag + c R + q. The same on every rank."""

    ranks: int  # R
    width: int  # N float64 words per share
    offset: int  # byte offset of copy 0's shares (ALIGN-aligned)
    flag: int  # index of copy 0, rank 0's flag word
    copies: int = COPIES

    @property
    def flag_words(self) -> int:
        return self.copies * self.ranks

    @property
    def nbytes(self) -> int:
        return 8 * self.width * self.flag_words

    def share_offset(self, copy: int, rank: int) -> int:
        """The byte offset of rank `rank`'s share in copy `copy` (in every rank's arena)."""
        return self.offset + 8 * self.width * (copy * self.ranks + rank)

    def flag_of(self, copy: int, rank: int) -> int:
        """The flag word raised once rank `rank`'s share of copy `copy` has landed."""
        return self.flag + copy * self.ranks + rank

    def shares(self, arena_B: torch.Tensor, copy: int) -> torch.Tensor:
        """Copy `copy`'s shares, float64 [R, N], in an arena."""
        start = self.share_offset(copy, 0)
        return arena_B[start:start + 8 * self.width * self.ranks].view(torch.float64).view(self.ranks, self.width)


def _view(arena_B: torch.Tensor, offset: int, spec: TensorSpec) -> torch.Tensor:
    return arena_B[offset:offset + _nbytes(spec)].view(spec.dtype).view(spec.shape)


def _pair_spec(pair_of: PairOf | None, payload: Payload,
               layer: int) -> tuple[TensorSpec, int, tuple[TensorSpec, ...]] | None:
    """(rows, segments, extras) of a pair-row message (a 2-tuple from `pair_of`: no extras), else None."""
    got = None if pair_of is None else pair_of(payload, layer)
    if got is None:
        return None
    if not isinstance(got, tuple) or len(got) not in (2, 3):
        raise ValueError(f"pair_of({payload.value}, layer {layer}) gave {got!r}: expected (rows [P, H], segments) "
                         "or (rows [P, H], segments, extras), or None for a message sent as segments")
    spec, segments, *rest = got
    extras = rest[0] if rest else ()
    if len(spec.shape) != 2 or segments < 1:
        raise ValueError(f"pair_of({payload.value}, layer {layer}) gave rows {spec.shape} and {segments} segments: "
                         "expected rows [P, H] and at least one segment")
    if not isinstance(extras, (tuple, list)) or not all(isinstance(extra, TensorSpec) for extra in extras):
        raise ValueError(f"pair_of({payload.value}, layer {layer}) gave extras {extras!r}: expected a tuple of "
                         "TensorSpecs")
    return spec, segments, tuple(extras)


def _shared_slots(keys: Sequence[Slot], shared: Mapping[tuple, tuple[Hashable, int]] | None,
                  copies: int) -> list[tuple[tuple[Slot, ...], int]]:
    """The receive slots of `keys` (in receive order): (the keys it holds, in order, its segments)."""
    held: dict[Hashable, list[Slot]] = {}
    ring: dict[Hashable, int] = {}
    for key in keys:
        name, n = (key, copies) if shared is None else shared.get((key[0], key[1].value, key[2], key[3]), (key, copies))
        held.setdefault(name, []).append(key)
        ring[name] = n
    return [(tuple(h), ring[name]) for name, h in held.items()]


def _capacity(spec: TensorSpec, factor: float | None) -> TensorSpec:
    if factor is None or not spec.shape:
        return spec
    return TensorSpec((max(1, math.ceil(spec.shape[0] * factor)), *spec.shape[1:]), spec.dtype)


def _even(words: int) -> int:
    return words + words % 2


def align(n: int) -> int:
    """`n` bytes rounded up to the next ALIGN boundary."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ArenaLayout:
    """Every segment of one rank's arena (module docstring)."""

    segments: tuple[Segment, ...]
    flag_words: int  # W: the flag region's int64 words (the same on every rank)
    nbytes: int  # B: the whole arena, flags included
    copies: int = COPIES  # segments per slot (and pair regions per pair slot)
    pairs: tuple[PairRegion, ...] = ()  # the pair-row receives' buffers (module docstring)
    sums: SumRegion | None = None  # the all-ranks sum's shares, if the run sums on the stream

    @classmethod
    def of_program(cls, program: Sequence[object], specs_of, rank: int, capacity_factor: float | None = None,
                   flag_words: int | None = None, copies: int = COPIES, pair_of: PairOf | None = None,
                   shared: Mapping[tuple, Hashable] | None = None) -> ArenaLayout:
        """The segments of `program`'s receives (a rank's schedule ops, of which only the `wire.Recv`s
        are read; peers other than `rank`); `specs_of(payload, layer)`
        gives a message's specs; `flag_words`: the flag region's size if set by the largest rank.
        `pair_of(payload, layer)`: (rows [P, H], segments S) or (rows, S, extras) for a pair-row message,
        else None; such a receive gets a `PairRegion` per copy (sources: all its peers, `rank`
        included, its extras after its rows) instead. `shared`: (peer, payload value, layer,
        micro-batch) -> slot, keys of one slot sharing its segments (`reuse_order.one_sided_slots`;
        None or a key not in it: a slot of its own)."""
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (None sizes buffers for the worst case)")
        if copies < 1:
            raise ValueError(f"copies={copies} must be >= 1")
        keys, pair_slots = [], []
        for op in program:
            if not isinstance(op, Recv):
                continue
            pair = _pair_spec(pair_of, op.payload, op.layer)
            if pair is None:
                keys.extend((peer, op.payload, op.layer, op.micro_batch) for peer in op.peers if peer != rank)
            else:
                pair_slots.append(((op.payload, op.layer, op.micro_batch), tuple(op.peers), *pair))
        slots = _shared_slots(keys, shared, copies)
        if len({slot for slot, *_ in pair_slots}) != len(pair_slots):
            raise ValueError(f"rank {rank}'s program receives a pair-row slot more than once: "
                             f"{[slot for slot, *_ in pair_slots]}")
        # every pair block starts at an even word (16-byte aligned, as Triton specialises pointers):
        # one compiled variant of the kernels that take it, whose first launch loads its module
        needed = _even(sum(n for _, n in slots)) + copies * sum(
            _even(len(sources) * segments) for _, sources, _, segments, _ in pair_slots)
        words = needed if flag_words is None else flag_words
        if words < needed:
            raise ValueError(f"{needed} flags (segments and pair-row blocks) need {needed} flag words, "
                             f"the arena has {words}")
        offset = align(8 * words)
        segments = []
        for held, ring in slots:
            specs = tuple(_capacity(s, capacity_factor) for s in specs_of(held[0][1], held[0][2]))
            for key in held[1:]:
                if tuple(_capacity(s, capacity_factor) for s in specs_of(key[1], key[2])) != specs:
                    raise ValueError(f"rank {rank}: keys {held[0]} and {key} share a receive slot but their "
                                     "messages' specs differ (share only keys of one payload and kind of layer)")
            for copy in range(ring):
                offsets = []
                for spec in specs:
                    offsets.append(offset)
                    offset = align(offset + _nbytes(spec))
                segments.append(Segment(held[0], copy, len(segments), tuple(offsets), specs, held))
        pairs, flag = [], _even(len(segments))
        for slot, sources, spec, n_segments, extra_specs in pair_slots:
            for copy in range(copies):
                extras, end = [], offset + _nbytes(spec)
                for extra in extra_specs:
                    extras.append((align(end), extra))
                    end = align(end) + _nbytes(extra)
                region = PairRegion(slot, copy, sources, flag, offset, spec, n_segments, tuple(extras))
                pairs.append(region)
                flag += _even(region.flag_words)
                offset = align(offset + region.nbytes)
        return cls(tuple(segments), words, offset, copies, tuple(pairs))

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_slot", {(seg.slot, seg.copy): seg for seg in self.segments})
        object.__setattr__(self, "_held_by", {key: seg.slot for seg in self.segments for key in seg.keys or (seg.slot,)})
        ring: dict[Slot, int] = {}
        for seg in self.segments:
            ring[seg.slot] = ring.get(seg.slot, 0) + 1
        object.__setattr__(self, "_ring", ring)
        object.__setattr__(self, "_by_pair", {(region.slot, region.copy): region for region in self.pairs})

    def segment(self, slot: Slot, index: int = 0) -> Segment:
        """The segment message `index` (0, 1, ...) of `slot` lands in."""
        seg = self._by_slot.get((slot, index % self._ring.get(slot, self.copies)))
        if seg is None:
            raise KeyError(f"no receive segment for {slot}: not a message of this rank's program")
        return seg

    def ring(self, slot: Slot) -> int:
        """How many segments `slot`'s messages fill in turn (its copies)."""
        return self._ring[slot]

    def held_by(self, key: Slot) -> Slot:
        """The slot (its first key) whose segments `key`'s messages land in; KeyError if none."""
        return self._held_by[key]

    def pair_region(self, slot: PairSlot, index: int = 0) -> PairRegion:
        """The pair region message `index` (0, 1, ...) of pair slot `slot` (payload, layer,
        micro-batch) lands in."""
        region = self._by_pair.get((slot, index % self.copies))
        if region is None:
            payload, layer, mb = slot
            raise KeyError(f"no pair-row region for the {getattr(payload, 'value', payload)} message of layer {layer}, "
                           f"micro-batch {mb}: not a pair-row receive of this rank's program (is it received as "
                           "segments, i.e. was the layout built without pair_of for it?)")
        return region

    def pair_views(self, arena_B: torch.Tensor, slot: PairSlot, index: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows [P, H], flags int64 [Q, S]) of message `index` of `slot` in an arena (this rank's, or
        a peer's view of it: the offsets are the same)."""
        region = self.pair_region(slot, index)
        return region.rows(arena_B), region.flags(arena_B)

    def flag_owner(self, index: int) -> Segment | tuple[PairRegion, int, int] | tuple[SumRegion, int, int] | None:
        """Who flag word `index` belongs to: its segment, (pair region, source row q, segment s) or
        (sum region, copy, rank q whose share it flags); None for a word nothing uses."""
        if self.sums is not None and self.sums.flag <= index < self.sums.flag + self.sums.flag_words:
            copy, rank = divmod(index - self.sums.flag, self.sums.ranks)
            return self.sums, copy, rank
        for seg in self.segments:
            if seg.flag == index:
                return seg
        for region in self.pairs:
            if region.flag <= index < region.flag + region.flag_words:
                q, s = divmod(index - region.flag, region.segments)
                return region, q, s
        return None

    def flags(self, arena_B: torch.Tensor) -> torch.Tensor:
        """The int64 [W] flag words of an arena."""
        return arena_B[: 8 * self.flag_words].view(torch.int64)

    def views(self, arena_B: torch.Tensor, slot: Slot, specs: Sequence[TensorSpec], index: int = 0) -> list[torch.Tensor]:
        """Typed views of the segment of message `index` of `slot` holding a message of `specs` (at
        most its capacity); raises `ArenaOverflow` if the message does not fit."""
        seg = self.segment(slot, index)
        check_fits(seg, specs)
        views = []
        for spec, offset in zip(specs, seg.offsets, strict=True):
            n = math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()
            views.append(arena_B[offset:offset + n].view(spec.dtype).view(spec.shape))
        return views


def check_fits(seg: Segment, specs: Sequence[TensorSpec]) -> None:
    """ValueError unless `specs` are the segment's tensors (rows up to its capacity);
    `ArenaOverflow`, naming the fix, for more rows than it holds."""
    if len(specs) != len(seg.specs):
        raise ValueError(f"{seg.slot}: a message of {len(specs)} tensors for a segment of {len(seg.specs)}")
    for spec, cap in zip(specs, seg.specs, strict=True):
        if spec.dtype != cap.dtype or spec.shape[1:] != cap.shape[1:]:
            raise ValueError(f"{seg.slot}: tensor {spec} does not match the segment's {cap}")
        if spec.shape and spec.shape[0] > cap.shape[0]:
            raise ArenaOverflow(overflow_message(seg.slot, spec.shape[0], cap.shape[0]))


def overflow_message(slot: Slot, rows: int, capacity: int) -> str:
    src, payload, layer, mb = slot
    return (f"a {payload.value} message of layer {layer}, micro-batch {mb} from rank {src} has {rows} rows but "
            f"its receive segment holds {capacity}; raise the transport's capacity_factor (or leave it unset "
            f"to size buffers for the plan's worst case)")


def symmetric_layouts(programs: Sequence[Sequence[object]], specs_of, capacity_factor: float | None = None,
                      copies: int = COPIES, pair_of: PairOf | None = None, sum_width: int = 0,
                      shared: Sequence[Mapping[tuple, Hashable]] | None = None) -> list[ArenaLayout]:
    """Every rank's layout with the flag region and the arena size of the largest (symmetric);
    `pair_of` as in `ArenaLayout.of_program` (the same on every rank); `sum_width` > 0: a
    `SumRegion` of that many float64 words per share after everything else (module docstring);
    `shared`: every rank's shared receive slots (`ArenaLayout.of_program`), None: none shared."""
    if sum_width < 0:
        raise ValueError(f"sum_width={sum_width} must be >= 0 (0: no all-ranks sum region)")
    share = (lambda r: None) if shared is None else (lambda r: shared[r])  # noqa: E731
    first = [ArenaLayout.of_program(p, specs_of, r, capacity_factor, copies=copies, pair_of=pair_of, shared=share(r))
             for r, p in enumerate(programs)]
    message_words = max((layout.flag_words for layout in first), default=0)
    sum_words = _even(copies * len(programs)) if sum_width else 0
    words = message_words + sum_words
    layouts = [ArenaLayout.of_program(p, specs_of, r, capacity_factor, words, copies, pair_of, share(r))
               for r, p in enumerate(programs)]
    size = max((layout.nbytes for layout in layouts), default=0)
    sums = None
    if sum_width:
        sums = SumRegion(len(programs), sum_width, align(size), message_words, copies)
        size = sums.offset + sums.nbytes
    return [ArenaLayout(layout.segments, words, size, copies, layout.pairs, sums) for layout in layouts]
