"""The colocated schedule (disagmoe/runtime/schedule/colocated.py): every receive has its sends before it."""

from collections import Counter

import pytest

from disagmoe.runtime.schedule.colocated import build_colocated_schedule, rank_pairs
from disagmoe.wire import message_key, Recv, Send
from disagmoe.runtime.schedule.schedule import (
    AttentionBackward,
    AttentionForward,
    ExpertBackward,
    ExpertForward,
    Loss,
    OptimizerStep,
)


@pytest.mark.parametrize(("ranks", "layers", "dense", "micro_batches"), [(2, 3, 1, 2), (3, 4, 0, 3), (1, 2, 2, 1)])
def test_every_receive_follows_the_matching_sends(ranks, layers, dense, micro_batches):
    programs = build_colocated_schedule(ranks, layers, dense, micro_batches)
    assert len(programs) == ranks and len(set(programs)) == 1  # every rank runs the same list
    program = programs[0]
    sent_at = {(op.payload, op.layer, op.micro_batch): i for i, op in enumerate(program) if isinstance(op, Send)}
    received = [(i, op) for i, op in enumerate(program) if isinstance(op, Recv)]
    assert len(received) == len(sent_at)
    for index, op in received:
        assert sent_at[(op.payload, op.layer, op.micro_batch)] < index
        assert op.peers == tuple(range(ranks))


def test_each_layer_and_micro_batch_is_computed_once():
    program = build_colocated_schedule(2, 3, 1, 2)[0]
    counts = Counter(type(op) for op in program)
    assert counts[AttentionForward] == counts[AttentionBackward] == 3 * 2
    assert counts[ExpertForward] == counts[ExpertBackward] == 2 * 2  # layer 0 is dense
    assert counts[Loss] == 2 and program[-1] == OptimizerStep((0, 1))


def test_message_keys_are_unique_per_rank_pair():
    """DISPATCH and COMBINE of one (layer, micro-batch) share a rank pair: their keys differ."""
    program = build_colocated_schedule(3, 3, 1, 2)[0]
    keys = [message_key(0, op.payload, op.layer, op.micro_batch) for op in program if isinstance(op, Send)]
    assert len(keys) == len(set(keys))


def test_rank_pairs_leave_out_messages_to_oneself():
    assert rank_pairs(build_colocated_schedule(3, 2, 0, 1)) == [(a, b) for a in range(3) for b in range(3) if a != b]
