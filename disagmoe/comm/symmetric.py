"""Receive arenas of the one-sided (NVSHMEM) transport: where each incoming message of a rank lands
and how its arrival is signalled (issue 11, the part that needs no GPU to test).

One arena per rank, the same size on every rank (NVSHMEM allocates symmetric memory collectively,
so the size is the largest any rank needs): a flag region of int64 words, one per segment, then
the payload region. A segment per incoming message slot of the rank's program, (source rank,
payload, layer, micro-batch), read off the schedule's `Recv` ops, in `copies` copies: the n-th
message of a slot (n = 1, 2, ...) uses copy (n - 1) mod copies. Its tensors sit at 256-byte
aligned offsets, sized from the run's fixed message specs (`runtime.messages.MessageShapes`),
their rows scaled by `capacity_factor` if one is given (None: the plan's worst case, exactly).

Why two copies: a one-sided write lands whenever the sender gets there, not when the receiver asks
(as an NCCL receive does). The sender writes message n + 2 of a slot only after a chain of
messages and collectives that starts after the receiver's stream finished with message n (the
deferred weight gradients that still read its rows included): in training every step ends in an
all-ranks gradient-norm all-reduce, and in forward-only evaluation (no collective) the chain runs
through the pass in between. One copy would not do once evaluation runs: colocated, or with the
loss off pipeline group 0, a pass's first sends start before the end of the pass before is known
to them. `runtime.reuse_order` replays passes and tests/runtime/test_reuse_order.py pins both for
every layout the schedule tests cover, training and evaluation interleaved; with two copies no
handshake is needed.

Signals carry the message's sequence number n (the transport counts each slot's messages, on
both ends alike): the sender writes the payload into the peer's segment, then stores n into the
segment's flag with a release at system scope; the receiver's wait (acquire loads, on the
stream: `kernels.signal`) passes once the flag holds n, so nothing is reset between steps and a
step stays capturable as a CUDA graph. A message whose
rows exceed its segment's capacity is not written: the sender raises the flag to -seq, the wait
records an overflow in the rank's status word, and the step's one read of the status raises
`ArenaOverflow` naming the segment and the fix (never silent corruption).

Shape legend: W flag words (segments), B arena bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagmoe.comm.base import TensorSpec
from disagmoe.runtime.schedule import Op, Payload, Recv

ALIGN = 256
Slot = tuple[int, Payload, int, int]  # (source rank, payload, layer, micro-batch)


class ArenaOverflow(RuntimeError):
    """A message did not fit its receive segment (a capacity factor below its rows)."""


COPIES = 2  # segments per slot (module docstring)


@dataclass(frozen=True)
class Segment:
    slot: Slot
    copy: int  # the slot's messages n with (n - 1) mod copies == copy land in it
    flag: int  # index of its flag word
    offsets: tuple[int, ...]  # byte offset of each tensor in the arena
    specs: tuple[TensorSpec, ...]  # the capacity of each tensor (rows scaled)

    @property
    def nbytes(self) -> int:
        return sum(math.prod(s.shape) * torch.empty((), dtype=s.dtype).element_size() for s in self.specs)


def _capacity(spec: TensorSpec, factor: float | None) -> TensorSpec:
    if factor is None or not spec.shape:
        return spec
    return TensorSpec((max(1, math.ceil(spec.shape[0] * factor)), *spec.shape[1:]), spec.dtype)


def align(n: int) -> int:
    """`n` bytes rounded up to the next ALIGN boundary."""
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ArenaLayout:
    """Every segment of one rank's arena (module docstring)."""

    segments: tuple[Segment, ...]
    flag_words: int  # W: the flag region's int64 words (the same on every rank)
    nbytes: int  # B: the whole arena, flags included
    copies: int = COPIES  # segments per slot

    @classmethod
    def of_program(cls, program: Sequence[Op], specs_of, rank: int, capacity_factor: float | None = None,
                   flag_words: int | None = None, copies: int = COPIES) -> ArenaLayout:
        """The segments of `program`'s receives (peers other than `rank`); `specs_of(payload, layer)`
        gives a message's specs; `flag_words`: the flag region's size if set by the largest rank."""
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (None sizes buffers for the worst case)")
        if copies < 1:
            raise ValueError(f"copies={copies} must be >= 1")
        slots = [(peer, op.payload, op.layer, op.micro_batch) for op in program if isinstance(op, Recv)
                 for peer in op.peers if peer != rank]
        needed = copies * len(slots)
        words = needed if flag_words is None else flag_words
        if words < needed:
            raise ValueError(f"{needed} segments need {needed} flag words, the arena has {words}")
        offset = align(8 * words)
        segments = []
        for slot in slots:
            specs = tuple(_capacity(s, capacity_factor) for s in specs_of(slot[1], slot[2]))
            for copy in range(copies):
                offsets = []
                for spec in specs:
                    offsets.append(offset)
                    offset = align(offset + math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size())
                segments.append(Segment(slot, copy, len(segments), tuple(offsets), specs))
        return cls(tuple(segments), words, offset, copies)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_slot", {(seg.slot, seg.copy): seg for seg in self.segments})

    def segment(self, slot: Slot, index: int = 0) -> Segment:
        """The segment message `index` (0, 1, ...) of `slot` lands in."""
        seg = self._by_slot.get((slot, index % self.copies))
        if seg is None:
            raise KeyError(f"no receive segment for {slot}: not a message of this rank's program")
        return seg

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


def symmetric_layouts(programs: Sequence[Sequence[Op]], specs_of, capacity_factor: float | None = None,
                      copies: int = COPIES) -> list[ArenaLayout]:
    """Every rank's layout with the flag region and the arena size of the largest (symmetric)."""
    first = [ArenaLayout.of_program(p, specs_of, r, capacity_factor, copies=copies) for r, p in enumerate(programs)]
    words = max((layout.flag_words for layout in first), default=0)
    layouts = [ArenaLayout.of_program(p, specs_of, r, capacity_factor, words, copies) for r, p in enumerate(programs)]
    size = max((layout.nbytes for layout in layouts), default=0)
    return [ArenaLayout(layout.segments, words, size, copies) for layout in layouts]
