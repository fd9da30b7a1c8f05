"""The one-sided transport's segment reuse (disagmoe/runtime/schedule/reuse_order.py): with two copies per
slot every reuse of every schedule the schedule tests cover is ordered after the receiver
finished with the message two back, over training and evaluation passes interleaved; one copy
is not enough once evaluation passes run (`comm.symmetric`'s "Why two copies")."""

import itertools
import re

import pytest

from disagmoe.runtime.schedule.reuse_order import pass_program, unordered_reuses
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.schedule.schedule import AttentionForward, build_schedule
from disagmoe.wire import Payload, Recv, Send
from disagmoe.runtime.schedule.schedule_sim import ScheduleError
from disagmoe.runtime.topology import Topology

PASSES = ("train", "train", "eval", "eval", "train")  # evaluation batches reuse the training slots


def _layouts():
    """The schedule tests' grid (tests/runtime/schedule/test_schedule.py) and the NCCL-order replay's
    topologies (tests/runtime/stages/test_nccl_order.py), colocated included: (name, programs)."""
    for a_per_group, p, m in itertools.product(range(1, 4), range(1, 4), range(1, 5)):
        for e, layers, dense in itertools.product(range(p, p + 3), (p, 2 * p + 1), (0, 1)):
            a = a_per_group * p
            yield f"A{a}-E{e}-p{p}-L{layers}-d{dense}-m{m}", build_schedule(Layout(a, e, p, layers, dense), m).programs
    for a, e, p, m in itertools.product((1, 2), (1, 2, 3), (1, 2), (1, 2, 3)):
        if a % p == 0 and e % p == 0:
            yield f"topology-A{a}-E{e}-p{p}-L4-m{m}", Topology.disaggregated(Layout(a, e, p, 4, 0), 8).programs(m)
    for n, m in itertools.product((2, 3), (1, 2, 4)):
        yield f"colocated{n}-m{m}", Topology.colocated_ranks(n, 4, 0, 8).programs(m)


LAYOUTS = list(_layouts())


@pytest.mark.parametrize("name,programs", LAYOUTS, ids=[name for name, _ in LAYOUTS])
def test_two_copies_order_every_reuse(name, programs):
    assert unordered_reuses(programs, PASSES, copies=2) == []


def test_one_copy_leaves_evaluation_reuses_unordered():
    one = {name: unordered_reuses(programs, PASSES, copies=1) for name, programs in LAYOUTS}
    # training alone is safe with one copy: the step's all-ranks all-reduce orders every reuse
    assert not any(unordered_reuses(programs, ("train",) * 3, copies=1) for _, programs in LAYOUTS)
    # after an evaluation pass nothing is collective: the first sends of the next pass (evaluation
    # or training) run before the receiver's end of the evaluation pass is known to the sender
    assert all(PASSES[r.earlier_pass] == "eval" for reuses in one.values() for r in reuses)
    unsafe = {name for name, reuses in one.items() if reuses}
    # unordered exactly where a pass does not end on the ranks that start the next one: colocated
    # (every rank ends with its own losses), and pipelines whose loss is not on group 0
    # (num_layers not a multiple of p; with p = 1 the experts' answers close the chain every pass)
    assert unsafe == {name for name in one if name.startswith("colocated") or _layers(name) % _groups(name)}
    assert "colocated2-m1" in unsafe and "A2-E2-p2-L5-d0-m1" in unsafe
    residual = [r for r in one["A2-E2-p2-L5-d0-m1"] if r.slot == (Payload.RESIDUAL, 0, 0)]
    # A0's first send of an evaluation batch, before A1's loss of the batch before is known to it
    assert [(r.src, r.dst, r.n, r.send_pass, r.earlier_pass) for r in residual] == [(0, 1, 4, 3, 2), (0, 1, 5, 4, 3)]


def _groups(name: str) -> int:
    return int(re.search(r"-p(\d+)-", name).group(1))


def _layers(name: str) -> int:
    return int(re.search(r"-L(\d+)-", name).group(1))


def test_a_sender_that_never_hears_back_is_caught_even_with_two_copies():
    programs = [(Send(Payload.DISPATCH, 0, 0, (1,)),), (Recv(Payload.DISPATCH, 0, 0, (0,)),)]
    reuses = unordered_reuses(programs, ("eval",) * 3, copies=2)
    assert [(r.src, r.dst, r.n, r.send_pass, r.earlier_pass) for r in reuses] == [(0, 1, 3, 2, 0)]


def test_evaluation_runs_the_workers_forward_ops_and_a_deadlock_raises():
    program = build_schedule(Layout(1, 1, 1, 2), 1).programs[0]
    assert all(not op.payload.backward for op in pass_program(program, "eval") if isinstance(op, (Send, Recv)))
    assert AttentionForward(1, 0) in pass_program(program, "eval")
    crossed = [(Recv(Payload.DISPATCH, 0, 0, (1,)),), (Recv(Payload.DISPATCH, 0, 0, (0,)),)]
    with pytest.raises(ScheduleError, match="deadlocked"):
        unordered_reuses(crossed, ("eval",))
    with pytest.raises(ValueError, match="pass kind"):
        pass_program(program, "backward")
