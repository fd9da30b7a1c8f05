"""The NCCL-order replay (disagmoe/runtime/stages/nccl_order.py): the runtime's schedules with its
collectives cannot deadlock, and the old placement of the aux loss's all-reduce inside
AttentionForward does (the colocated Qwen3-shaped run hung there at commit 550a3bb)."""

import itertools

import pytest

from disagmoe.runtime.stages.nccl_order import replay, step_collectives
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.schedule.schedule import AttentionForward, Op, ReduceGradients
from disagmoe.wire import Recv, Send
from disagmoe.runtime.schedule.schedule_sim import ScheduleError
from disagmoe.runtime.topology import Topology


def _layouts():
    for a, e, p, m in itertools.product((1, 2), (1, 2, 3), (1, 2), (1, 2, 3)):
        if a % p == 0 and e % p == 0 and (e // p) <= 8:
            yield f"A{a}-E{e}-p{p}-m{m}", Topology.disaggregated(Layout(a, e, p, 4, 0), 8), m
    for n, m in itertools.product((2, 3), (1, 2, 4)):
        yield f"colocated{n}-m{m}", Topology.colocated_ranks(n, 4, 0, 8), m
    for per_group, p, m in itertools.product((1, 2, 3), (2, 3), (1, 2, 3)):
        yield f"colocated{per_group * p}-p{p}-m{m}", Topology.colocated_ranks(per_group * p, 7, 1, 8, pipeline_groups=p), m
    for n, p, sets, m in ((4, 1, 2, 2), (4, 2, 2, 2), (6, 1, 3, 3), (6, 2, 2, 1)):  # EP blocks: their gradient sums too
        yield (f"colocated{n * p}-p{p}-blocks{sets}-m{m}",
               Topology.colocated_ranks(n * p, 7, 1, 8, pipeline_groups=p, sets=sets), m)
    for a, e, p, sets in ((2, 2, 1, 2), (4, 4, 2, 2), (3, 6, 1, 3)):  # replica sets
        yield f"A{a}-E{e}-p{p}-sets{sets}-m2", Topology.disaggregated(Layout(a, e, p, 4, 0), 8, sets=sets), 2
    for n, p, sets, m in ((4, 1, 2, 2), (6, 2, 2, 3)):  # EP blocks swapping their loads (EXPERT_LOAD)
        yield (f"colocated{n * p}-p{p}-blocks{sets}-load-m{m}",
               Topology.colocated_ranks(n * p, 7, 1, 8, pipeline_groups=p, sets=sets, global_load=True), m)
    for a, e, p, sets in ((2, 2, 1, 2), (4, 4, 2, 2)):  # replica sets swapping theirs
        yield (f"A{a}-E{e}-p{p}-sets{sets}-load-m2",
               Topology.disaggregated(Layout(a, e, p, 4, 0), 8, sets=sets, global_load=True), 2)


@pytest.mark.parametrize("name,topology,m", list(_layouts()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_runtimes_nccl_operations_never_deadlock(name, topology, m):
    assert replay(topology.programs(m), step_collectives(topology)) > 0


def _old_collectives(topology: Topology):
    """The runtime at 550a3bb: every AttentionForward of a MoE layer all-reduced the micro-batch's
    expert load over the data-parallel group (for the aux loss) before its dispatch."""
    new = step_collectives(topology)

    def collectives(rank: int, op: Op):
        role = topology.attention_role(rank)
        if isinstance(op, AttentionForward) and role is not None and topology.data_parallel > 1 and topology.is_moe(op.layer):
            return [topology.attention_groups[role[0]]]
        if isinstance(op, ReduceGradients):  # it summed the gradients in OptimizerStep instead
            return []
        return new(rank, op)

    return collectives


@pytest.mark.parametrize("ranks,m", [(2, 2), (3, 2), (2, 4)])
def test_the_old_all_reduce_inside_attention_forward_deadlocks_colocated(ranks, m):
    topology = Topology.colocated_ranks(ranks, 4, 0, 8)
    with pytest.raises(ScheduleError, match="NCCL deadlock"):
        replay(topology.programs(m), _old_collectives(topology))


def test_a_pair_issued_in_crossed_order_deadlocks():
    from disagmoe.wire import Payload

    d = Payload.DISPATCH
    crossed = [(Send(d, 0, 0, (1,)), Recv(d, 0, 1, (1,))), (Send(d, 0, 1, (0,)), Recv(d, 0, 0, (0,)))]
    replay(crossed, lambda rank, op: [])  # sends on separate communicators: both rendezvous
    reversed_ = [(Recv(d, 0, 1, (1,)), Send(d, 0, 0, (1,))), (Recv(d, 0, 0, (0,)), Send(d, 0, 1, (0,)))]
    with pytest.raises(ScheduleError, match="rank 0 at its recv"):
        replay(reversed_, lambda rank, op: [])  # each waits to receive before it sends


@pytest.mark.parametrize("zero", [False, True])
def test_zero1_all_gathers_and_the_stricter_receive_rule_keep_every_layout_sound(zero):
    for name, topology, m in _layouts():
        replay(topology.programs(m), step_collectives(topology, zero=zero))


def test_an_in_order_channel_that_would_mix_messages_up_is_caught():
    from disagmoe.wire import Payload

    mixed = [(Send(Payload.DISPATCH, 0, 0, (1,)), Send(Payload.DISPATCH, 0, 1, (1,))),
             (Recv(Payload.DISPATCH, 0, 1, (0,)), Recv(Payload.DISPATCH, 0, 0, (0,)))]
    with pytest.raises(ScheduleError, match="would mix them up"):
        replay(mixed, lambda rank, op: [])
