import itertools

import pytest
import torch

from disagmoe.comm.base import Direction, MessageKey
from disagmoe.comm.header import DTYPES, HEADER_LEN, MAX_TENSORS, decode_header, encode_header, message_tag


def test_header_round_trips_shapes_dtypes_and_key():
    gen = torch.Generator().manual_seed(0)
    tensors = []
    for i, dtype in enumerate(DTYPES):
        ndim = int(torch.randint(0, 5, (), generator=gen))
        shape = tuple(int(s) for s in torch.randint(0, 7, (ndim,), generator=gen))
        tensors.append(torch.zeros(shape, dtype=dtype))
    key = MessageKey(step=12, micro_batch=3, layer=40, direction=Direction.BACKWARD)
    header = encode_header(key, tensors)
    assert header.shape == (HEADER_LEN,) and header.dtype == torch.int64
    got_key, specs = decode_header(header)
    assert got_key == key
    assert [(s.shape, s.dtype) for s in specs] == [(tuple(t.shape), t.dtype) for t in tensors]


def test_header_rejects_what_it_cannot_describe():
    key = MessageKey(0, 0, 0, Direction.FORWARD)
    with pytest.raises(ValueError, match="at most"):
        encode_header(key, [torch.zeros(1)] * (MAX_TENSORS + 1))
    with pytest.raises(ValueError, match="dims"):
        encode_header(key, [torch.zeros((1,) * 7)])
    with pytest.raises(ValueError, match="dtype"):
        encode_header(key, [torch.zeros(1, dtype=torch.complex64)])


def test_tags_are_distinct_per_key_and_part_and_fit_31_bits():
    keys = [
        MessageKey(step, mb, layer, direction)
        for step, mb, layer, direction in itertools.product(range(3), (0, 1, 1023), (0, 5, 511), Direction)
    ]
    tags = [message_tag(key, part) for key in keys for part in range(MAX_TENSORS + 1)]
    assert len(set(tags)) == len(tags)
    assert max(tags) < 2**31 and min(tags) >= 0
    with pytest.raises(ValueError, match="layers <"):
        message_tag(MessageKey(0, 0, 512, Direction.FORWARD), 0)
