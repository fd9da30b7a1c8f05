"""The message header: what travels before the rows, so the receiver can allocate them.

A header is one int64 tensor of fixed length `HEADER_LEN`:

    [step, micro_batch, layer, direction, n_tensors,  (dtype code, ndim, dim_0 .. dim_5) x 16]

Counts are shapes: a tensor with zero rows is announced here and then not sent at all.
`message_tag` derives a deterministic 31-bit tag from (key, part) for tag-matching transports
(part 0 = header, part i = tensor i-1).

Shapes: L = HEADER_LEN (the fixed header length).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from disagmoe.comm.base import Direction, MessageKey

MAX_TENSORS = 16
MAX_NDIM = 6
_KEY_FIELDS = 5  # step, micro_batch, layer, direction, n_tensors
_SPEC_FIELDS = 2 + MAX_NDIM
HEADER_LEN = _KEY_FIELDS + MAX_TENSORS * _SPEC_FIELDS

DTYPES = (
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(DTYPES)}

# Tag layout (low to high bits): part 5 | direction 1 | layer 9 | micro_batch 10 | step mod 64 6.
_PART_BITS, _LAYER_BITS, _MB_BITS, _STEP_BITS = 5, 9, 10, 6


@dataclass(frozen=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: torch.dtype

    def empty(self, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(self.shape, dtype=self.dtype, device=device)


def encode_header(key: MessageKey, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The int64 header announcing `tensors` (shapes and dtypes) under `key`."""
    if len(tensors) > MAX_TENSORS:
        raise ValueError(f"a message holds at most {MAX_TENSORS} tensors, got {len(tensors)}; pack them")
    header_L = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header_L[:_KEY_FIELDS] = torch.tensor([*key[:3], int(key.direction), len(tensors)])
    for i, tensor in enumerate(tensors):
        if tensor.dtype not in _DTYPE_CODE:
            raise ValueError(f"dtype {tensor.dtype} cannot be sent; use one of {[str(d) for d in DTYPES]}")
        if tensor.dim() > MAX_NDIM:
            raise ValueError(
                f"tensors of at most {MAX_NDIM} dims can be sent, got shape {tuple(tensor.shape)}"
            )
        base = _KEY_FIELDS + i * _SPEC_FIELDS
        spec = [_DTYPE_CODE[tensor.dtype], tensor.dim(), *tensor.shape]
        header_L[base : base + len(spec)] = torch.tensor(spec)
    return header_L


def decode_header(header_L: torch.Tensor) -> tuple[MessageKey, list[TensorSpec]]:
    fields = header_L.tolist()
    step, micro_batch, layer, direction, n_tensors = fields[:_KEY_FIELDS]
    specs = []
    for i in range(n_tensors):
        base = _KEY_FIELDS + i * _SPEC_FIELDS
        code, ndim = fields[base], fields[base + 1]
        specs.append(TensorSpec(tuple(fields[base + 2 : base + 2 + ndim]), DTYPES[code]))
    return MessageKey(step, micro_batch, layer, Direction(direction)), specs


def message_tag(key: MessageKey, part: int) -> int:
    """A tag unique per (key, part) among the messages one rank pair has in flight.

    Steps never overlap (all sends of a step complete before the next), so the step only needs
    a few bits to separate consecutive steps.
    """
    if not 0 <= part <= MAX_TENSORS:
        raise ValueError(f"part {part} out of range 0..{MAX_TENSORS}")
    if not 0 <= key.layer < 1 << _LAYER_BITS or not 0 <= key.micro_batch < 1 << _MB_BITS:
        raise ValueError(
            f"key {key}: tags fit layers < {1 << _LAYER_BITS} and micro-batches < {1 << _MB_BITS}"
        )
    tag = key.step % (1 << _STEP_BITS)
    tag = (tag << _MB_BITS) | key.micro_batch
    tag = (tag << _LAYER_BITS) | key.layer
    tag = (tag << 1) | int(key.direction)
    return (tag << _PART_BITS) | part
