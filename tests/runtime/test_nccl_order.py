"""The NCCL-order replay (disagmoe/runtime/nccl_order.py): the runtime's schedules with its
collectives cannot deadlock, and the old placement of the aux loss's all-reduce inside
AttentionForward does (the colocated Qwen3-shaped run hung there at commit 550a3bb)."""

import itertools

import pytest

from disagmoe.runtime.nccl_order import replay, step_collectives
from disagmoe.runtime.roles import Layout
from disagmoe.runtime.schedule import AttentionForward, Op, Recv, ReduceGradients, Send
from disagmoe.runtime.schedule_sim import ScheduleError
from disagmoe.runtime.topology import Topology


def _layouts():
    for a, e, p, m in itertools.product((1, 2), (1, 2, 3), (1, 2), (1, 2, 3)):
        if a % p == 0 and e % p == 0 and (e // p) <= 8:
            yield f"A{a}-E{e}-p{p}-m{m}", Topology.disaggregated(Layout(a, e, p, 4, 0), 8), m
    for n, m in itertools.product((2, 3), (1, 2, 4)):
        yield f"colocated{n}-m{m}", Topology.colocated_ranks(n, 4, 0, 8), m


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
    crossed = [(Send(None, 0, 0, (1,)), Recv(None, 0, 1, (1,))), (Send(None, 0, 1, (0,)), Recv(None, 0, 0, (0,)))]
    replay(crossed, lambda rank, op: [])  # sends on separate communicators: both rendezvous
    reversed_ = [(Recv(None, 0, 1, (1,)), Send(None, 0, 0, (1,))), (Recv(None, 0, 0, (0,)), Send(None, 0, 1, (0,)))]
    with pytest.raises(ScheduleError, match="rank 0 at its recv"):
        replay(reversed_, lambda rank, op: [])  # each waits to receive before it sends


def test_a_gradient_sum_inside_the_colocated_backward_would_deadlock():
    """Why the colocated schedule sums gradients only in OptimizerStep: after the losses every rank
    has COMBINE_GRAD sends in flight that its peers receive only in the next backward op."""
    from disagmoe.runtime.schedule import Loss

    topology = Topology.colocated_ranks(2, 4, 0, 8)
    programs = [list(p) for p in topology.programs(2)]
    for program in programs:
        last_loss = max(i for i, op in enumerate(program) if isinstance(op, Loss))
        program.insert(last_loss + 2, ReduceGradients(4, (0, 1)))  # after the loss's send
    with pytest.raises(ScheduleError, match="NCCL deadlock"):
        replay(programs, step_collectives(topology))
