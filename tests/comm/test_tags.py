"""Message tags of the gloo transport and the specs every transport receives by."""

import itertools

import pytest
import torch

from disagmoe.comm.base import TensorSpec, check_specs
from disagmoe.wire import Direction, MessageKey
from disagmoe.comm.local import MAX_TENSORS, message_tag


def test_tags_are_distinct_per_key_and_part_and_fit_31_bits():
    keys = [
        MessageKey(step, mb, layer, direction)
        for step, mb, layer, direction in itertools.product(range(3), (0, 1, 1023), (0, 5, 511), Direction)
    ]
    tags = [message_tag(key, part) for key in keys for part in range(MAX_TENSORS)]
    assert len(set(tags)) == len(tags)
    assert max(tags) < 2**31 and min(tags) >= 0
    with pytest.raises(ValueError, match="layers <"):
        message_tag(MessageKey(0, 0, 512, Direction.FORWARD), 0)
    with pytest.raises(ValueError, match="at most"):
        message_tag(MessageKey(0, 0, 0, Direction.FORWARD), MAX_TENSORS)


def test_specs_describe_tensors_and_catch_mismatches():
    x = torch.zeros(3, 4, dtype=torch.bfloat16)
    spec = TensorSpec.of(x)
    assert spec == TensorSpec((3, 4), torch.bfloat16) and spec.empty().shape == (3, 4)
    check_specs([x], [spec], "dispatch")
    with pytest.raises(ValueError, match="do not match"):
        check_specs([x.float()], [spec], "dispatch")
