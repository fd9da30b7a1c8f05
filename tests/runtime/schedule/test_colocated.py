"""The colocated schedule (disagmoe/runtime/schedule/colocated.py): every receive has its sends before it."""

import itertools
from collections import Counter

import pytest

from disagmoe.runtime.schedule.colocated import build_colocated_schedule, rank_pairs
from disagmoe.wire import message_key, Payload, Recv, Send
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


def _one_group_program(ranks, num_layers, num_dense_layers, micro_batches):
    """The colocated op list as `build_colocated_schedule` wrote it before pipeline groups (commit
    6a8402e, one list for every rank), kept as the reference its p = 1 output must match op for op."""
    everyone = tuple(range(ranks))
    moe = [layer >= num_dense_layers for layer in range(num_layers)]
    ops = []
    for layer in range(num_layers):
        for mb in range(micro_batches):
            if layer > 0 and moe[layer - 1]:
                ops.append(Recv(Payload.COMBINE, layer - 1, mb, everyone))
            ops.append(AttentionForward(layer, mb))
            if moe[layer]:
                ops += [Send(Payload.DISPATCH, layer, mb, everyone), Recv(Payload.DISPATCH, layer, mb, everyone),
                        ExpertForward(layer, mb), Send(Payload.COMBINE, layer, mb, everyone)]
    last = num_layers - 1
    for mb in range(micro_batches):
        if moe[last]:
            ops.append(Recv(Payload.COMBINE, last, mb, everyone))
        ops.append(Loss(mb))
        if moe[last]:
            ops.append(Send(Payload.COMBINE_GRAD, last, mb, everyone))
    for layer in reversed(range(num_layers)):
        for mb in range(micro_batches):
            if moe[layer]:
                ops += [Recv(Payload.COMBINE_GRAD, layer, mb, everyone), ExpertBackward(layer, mb),
                        Send(Payload.DISPATCH_GRAD, layer, mb, everyone), Recv(Payload.DISPATCH_GRAD, layer, mb, everyone)]
            ops.append(AttentionBackward(layer, mb))
            if layer > 0 and moe[layer - 1]:
                ops.append(Send(Payload.COMBINE_GRAD, layer - 1, mb, everyone))
    ops.append(OptimizerStep(everyone))
    return tuple(ops)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_one_group_is_the_schedule_of_before_pipeline_groups_op_for_op(ranks):
    for layers, micro_batches in itertools.product(range(1, 5), range(1, 4)):
        for dense in range(layers + 1):
            expected = _one_group_program(ranks, layers, dense, micro_batches)
            assert build_colocated_schedule(ranks, layers, dense, micro_batches) == (expected,) * ranks
