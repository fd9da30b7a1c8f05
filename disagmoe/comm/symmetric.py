"""Receive arenas of the one-sided (NVSHMEM) transport: where each incoming message of a rank lands
and how its arrival is signalled (issue 11, the part that needs no GPU to test).

One arena per rank, the same size on every rank (NVSHMEM allocates symmetric memory collectively,
so the size is the largest any rank needs): a flag region of int64 words, one per segment, then
the payload region. A segment per incoming message slot of the rank's program, (source rank,
payload, layer, micro-batch), read off the schedule's `Recv` ops; its tensors sit at 256-byte
aligned offsets, sized from the run's fixed message specs (`runtime.messages.MessageShapes`),
their rows scaled by `capacity_factor` if one is given (None: the plan's worst case, exactly).

Signals carry the step's sequence number (step + 1): the sender writes the payload into the
peer's segment, then stores seq into the segment's flag with a release at system scope; the
receiver's wait (acquire loads, on the stream: `kernels.signal`) passes once the flag holds seq,
so nothing is reset between steps and a step stays capturable as a CUDA graph. A message whose
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


@dataclass(frozen=True)
class Segment:
    slot: Slot
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


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class ArenaLayout:
    """Every segment of one rank's arena (module docstring)."""

    segments: tuple[Segment, ...]
    flag_words: int  # W: the flag region's int64 words (the same on every rank)
    nbytes: int  # B: the whole arena, flags included

    @classmethod
    def of_program(cls, program: Sequence[Op], specs_of, rank: int, capacity_factor: float | None = None,
                   flag_words: int | None = None) -> ArenaLayout:
        """The segments of `program`'s receives (peers other than `rank`); `specs_of(payload, layer)`
        gives a message's specs; `flag_words`: the flag region's size if set by the largest rank."""
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"capacity_factor={capacity_factor} must be > 0 (None sizes buffers for the worst case)")
        slots = [(peer, op.payload, op.layer, op.micro_batch) for op in program if isinstance(op, Recv)
                 for peer in op.peers if peer != rank]
        words = len(slots) if flag_words is None else flag_words
        if words < len(slots):
            raise ValueError(f"{len(slots)} segments need {len(slots)} flag words, the arena has {words}")
        offset = _align(8 * words)
        segments = []
        for i, slot in enumerate(slots):
            specs = tuple(_capacity(s, capacity_factor) for s in specs_of(slot[1], slot[2]))
            offsets = []
            for spec in specs:
                offsets.append(offset)
                offset = _align(offset + math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size())
            segments.append(Segment(slot, i, tuple(offsets), specs))
        return cls(tuple(segments), words, offset)

    def segment(self, slot: Slot) -> Segment:
        for seg in self.segments:
            if seg.slot == slot:
                return seg
        raise KeyError(f"no receive segment for {slot}: not a message of this rank's program")

    def flags(self, arena_B: torch.Tensor) -> torch.Tensor:
        """The int64 [W] flag words of an arena."""
        return arena_B[: 8 * self.flag_words].view(torch.int64)

    def views(self, arena_B: torch.Tensor, slot: Slot, specs: Sequence[TensorSpec]) -> list[torch.Tensor]:
        """Typed views of a segment holding a message of `specs` (at most its capacity); raises
        `ArenaOverflow` if the message does not fit."""
        seg = self.segment(slot)
        if len(specs) != len(seg.specs):
            raise ValueError(f"{slot}: a message of {len(specs)} tensors for a segment of {len(seg.specs)}")
        views = []
        for spec, cap, offset in zip(specs, seg.specs, seg.offsets, strict=True):
            if spec.dtype != cap.dtype or spec.shape[1:] != cap.shape[1:]:
                raise ValueError(f"{slot}: tensor {spec} does not match the segment's {cap}")
            if spec.shape and spec.shape[0] > cap.shape[0]:
                raise ArenaOverflow(overflow_message(slot, spec.shape[0], cap.shape[0]))
            n = math.prod(spec.shape) * torch.empty((), dtype=spec.dtype).element_size()
            views.append(arena_B[offset:offset + n].view(spec.dtype).view(spec.shape))
        return views


def overflow_message(slot: Slot, rows: int, capacity: int) -> str:
    src, payload, layer, mb = slot
    return (f"a {payload.value} message of layer {layer}, micro-batch {mb} from rank {src} has {rows} rows but "
            f"its receive segment holds {capacity}; raise the transport's capacity_factor (or leave it unset "
            f"to size buffers for the plan's worst case)")


def symmetric_layouts(programs: Sequence[Sequence[Op]], specs_of,
                      capacity_factor: float | None = None) -> list[ArenaLayout]:
    """Every rank's layout with the flag region and the arena size of the largest (symmetric)."""
    first = [ArenaLayout.of_program(p, specs_of, r, capacity_factor) for r, p in enumerate(programs)]
    words = max((layout.flag_words for layout in first), default=0)
    layouts = [ArenaLayout.of_program(p, specs_of, r, capacity_factor, words) for r, p in enumerate(programs)]
    size = max((layout.nbytes for layout in layouts), default=0)
    return [ArenaLayout(layout.segments, words, size) for layout in layouts]
