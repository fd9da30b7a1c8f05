"""The one-sided transport's segment reuse (disagmoe/runtime/schedule/reuse_order.py): with two copies per
slot every reuse of every schedule the schedule tests cover is ordered after the receiver
finished with the message two back, over training and evaluation passes interleaved; one copy
is not enough once evaluation passes run (`comm.symmetric`'s "Why two copies")."""

import itertools
import re

import pytest

from disagmoe.comm.counts import RingCounts
from disagmoe.runtime.schedule.reuse_order import (
    CHECKED_PASSES,
    Reuse,
    one_sided_slots,
    pass_program,
    ring_segments,
    step_ring,
    unordered_reuses,
    unordered_shared_reuses,
)
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.schedule.schedule import AttentionForward, ExpertForward, build_schedule
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
    for per_group, p in itertools.product((1, 2, 3), (2, 3)):
        for layers, m in ((p, 1), (p, 3), (2 * p + 1, 2)):
            topology = Topology.colocated_ranks(per_group * p, layers, 0, 8, pipeline_groups=p)
            yield f"colocated{per_group * p}-p{p}-L{layers}-m{m}", topology.programs(m)
    for (n, p, sets), m in itertools.product(((4, 1, 2), (4, 2, 2), (6, 1, 3), (6, 2, 2)), (1, 3)):  # EP blocks
        topology = Topology.colocated_ranks(n * p, 2 * p + 1, 1, 8, pipeline_groups=p, sets=sets)
        yield f"colocated{n * p}-p{p}-L{2 * p + 1}-blocks{sets}-m{m}", topology.programs(m)
    for (a, e, p, sets), m in itertools.product(((2, 2, 1, 2), (4, 4, 2, 2), (3, 6, 1, 3)), (1, 3)):  # replica sets
        topology = Topology.disaggregated(Layout(a, e, p, 2 * p + 1, 1), 8, sets=sets)
        yield f"A{a}-E{e}-p{p}-L{2 * p + 1}-sets{sets}-m{m}", topology.programs(m)
    for n, p, sets in ((4, 1, 2), (4, 2, 2), (6, 1, 3)):  # EP blocks swapping their loads (EXPERT_LOAD)
        topology = Topology.colocated_ranks(n * p, 2 * p + 1, 1, 8, pipeline_groups=p, sets=sets, global_load=True)
        yield f"colocated{n * p}-p{p}-L{2 * p + 1}-blocks{sets}-load-m3", topology.programs(3)
    for a, e, p, sets in ((2, 2, 1, 2), (4, 4, 2, 2), (3, 6, 1, 3)):  # replica sets swapping theirs
        topology = Topology.disaggregated(Layout(a, e, p, 2 * p + 1, 1), 8, sets=sets, global_load=True)
        yield f"A{a}-E{e}-p{p}-L{2 * p + 1}-sets{sets}-load-m3", topology.programs(3)
    topology = Topology.disaggregated(Layout(2, 2, 1, 5, 1), 8, sets=2, global_load=True)  # m = 1: rings of 3
    yield "A2-E2-p1-L5-sets2-load-m1", topology.programs(1)


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
    # groups of more than one rank (every rank of the head group ends with its own losses, and
    # group 0's ranks dispatch to each other first), and pipelines whose loss is not on group 0
    # (num_layers not a multiple of p; with p = 1 the experts' answers close the chain every pass)
    assert unsafe == {name for name in one if _shared_colocated_group(name) or _layers(name) % _groups(name)}
    assert "colocated2-m1" in unsafe and "A2-E2-p2-L5-d0-m1" in unsafe
    residual = [r for r in one["A2-E2-p2-L5-d0-m1"] if r.slot == (Payload.RESIDUAL, 0, 0)]
    # A0's first send of an evaluation batch, before A1's loss of the batch before is known to it
    assert [(r.src, r.dst, r.n, r.send_pass, r.earlier_pass) for r in residual] == [(0, 1, 4, 3, 2), (0, 1, 5, 4, 3)]


def _groups(name: str) -> int:
    found = re.search(r"-p(\d+)-", name)
    return int(found.group(1)) if found else 1


def _layers(name: str) -> int:
    found = re.search(r"-L(\d+)-", name)
    return int(found.group(1)) if found else 4


def _shared_colocated_group(name: str) -> bool:
    """A colocated layout with more than one rank a pipeline group."""
    found = re.match(r"colocated(\d+)", name)
    return found is not None and int(found.group(1)) > _groups(name)


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


# --- rings shared by the keys of a pool (`one_sided_slots`) ------------------------------------------


def _num_layers(programs) -> int:
    return 1 + max(op.layer for p in programs for op in p if isinstance(op, (AttentionForward, ExpertForward)))


def _is_moe(programs):
    moe = {op.layer for p in programs for op in p if isinstance(op, ExpertForward)}
    return lambda layer: layer in moe


def _ring_check(name, programs):
    """The rings `one_sided_slots` gives: the priced size (`ring_segments`) everywhere, one ring per
    pool, every write ordered after the reader is done with the message a ring back; a sender's
    multi-destination DISPATCH (one sparse launch, one seq) counts the same in every ring."""
    layers, is_moe = _num_layers(programs), _is_moe(programs)
    rings = one_sided_slots(programs, is_moe, layers)
    micro_batches = 1 + max((op.micro_batch for p in programs for op in p if isinstance(op, Recv)), default=0)
    for rank, keys in enumerate(rings):
        for (peer, payload, layer, mb), (slot, n) in keys.items():
            assert slot == (peer, payload, is_moe(layer)), (name, rank, slot)  # nothing fell back to its own
            held = sum(1 for s, _ in keys.values() if s == slot)
            assert n == ring_segments(payload, held, micro_batches), (name, rank, slot)

    def slot_of(dst, src, message):
        payload, layer, mb = message
        return rings[dst][(src, payload.value, layer, mb)][0]

    def ring_of(src, dst, slot):
        return next(n for s, n in rings[dst].values() if s == slot)

    assert unordered_shared_reuses(programs, CHECKED_PASSES, slot_of, layers, ring_of) == [], name
    for src, program in enumerate(programs):
        counts: dict = {}
        for op in program:
            if isinstance(op, Send):
                seqs = set()
                for dst in op.peers:
                    if dst != src:
                        at = (dst, slot_of(dst, src, (op.payload, op.layer, op.micro_batch)))
                        counts[at] = counts.get(at, 0) + 1
                        seqs.add(counts[at])
                assert op.payload is not Payload.DISPATCH or len(seqs) <= 1, (name, src, op)


QUICK = [(name, programs) for name, programs in LAYOUTS
         if name in ("A1-E1-p1-L3-d1-m3", "A2-E3-p1-L3-d0-m2", "A2-E2-p2-L5-d0-m2", "A3-E4-p3-L7-d1-m4",
                     "topology-A2-E2-p2-L4-m3", "colocated2-m4", "colocated3-m2", "colocated4-p2-L5-m2",
                     "colocated6-p3-L3-m3", "colocated8-p2-L5-blocks2-m3", "A4-E4-p2-L5-sets2-m3",
                     "colocated8-p2-L5-blocks2-load-m3", "A4-E4-p2-L5-sets2-load-m3", "A2-E2-p1-L5-sets2-load-m1")]


@pytest.mark.parametrize("name,programs", QUICK, ids=[name for name, _ in QUICK])
def test_rings_order_every_write_after_the_reader(name, programs):
    _ring_check(name, programs)


@pytest.mark.slow
def test_rings_order_every_write_after_the_reader_in_every_layout():
    for name, programs in LAYOUTS:
        _ring_check(name, programs)


def test_a_ring_a_message_short_is_caught():
    """One segment fewer than priced: the sender's next message may land in the segment of one
    its receiver still reads (a gradient: the deferred weight gradients read it after the sends
    that follow its backward op, so m segments are one short)."""
    programs = build_schedule(Layout(1, 1, 1, 2), 2).programs
    rings = one_sided_slots(programs, _is_moe(programs), 2)

    def slot_of(dst, src, message):
        return rings[dst][(src, message[0].value, message[1], message[2])][0]

    short = unordered_shared_reuses(programs, CHECKED_PASSES, slot_of, 2,
                                    lambda src, dst, slot: next(n for s, n in rings[dst].values() if s == slot) - 1)
    assert {r.slot[1] for r in short} >= {"combine_grad", "dispatch_grad", "dispatch"}
    assert all(isinstance(r, Reuse) for r in short)


def test_a_sender_out_of_the_receivers_order_gets_rings_of_its_own():
    """A sender whose messages of one pool go out in another order than they are received: each
    key gets its own ring (the counts would otherwise give a message another key's number)."""
    programs = [(Send(Payload.DISPATCH, 0, 1, (1,)), Send(Payload.DISPATCH, 0, 0, (1,))),
                (Recv(Payload.DISPATCH, 0, 0, (0,)), Recv(Payload.DISPATCH, 0, 1, (0,)))]
    rings = one_sided_slots(programs, lambda layer: True, 1, passes=("eval",))
    assert rings[1] == {(0, "dispatch", 0, 0): ((0, "dispatch", 0, 0), 2), (0, "dispatch", 0, 1): ((0, "dispatch", 0, 1), 2)}


# --- rings rounded up to a step's messages (captured rank steps, `step_ring`) -----------------------


@pytest.mark.parametrize("size, per_step, ring", [
    (3, 4, 4), (5, 4, 8), (2, 4, 2), (9, 32, 16), (5, 12, 6), (9, 8, 16), (1, 1, 1), (2, 1, 2), (5, 2, 8)])
def test_step_ring_is_the_fewest_segments_dividing_two_steps(size, per_step, ring):
    assert step_ring(size, per_step) == ring
    assert ring >= size and (2 * per_step % ring == 0 or ring % (2 * per_step) == 0)


def test_step_ring_refuses_an_empty_ring():
    with pytest.raises(ValueError, match="must be >= 1"):
        step_ring(0, 3)


def _step_counts(rings, programs, steps):
    """Every rank's receive counts (`comm.counts.RingCounts`) after each of `steps` training steps:
    each key of a rank's program one message a step, counted in its slot."""
    phases = []
    counts = [RingCounts(lambda key, r=r: next(n for s, n in rings[r].values() if s == key[2]))
              for r in range(len(programs))]
    for _ in range(steps):
        for r, keys in enumerate(rings):
            for (peer, payload, layer, mb), (slot, _) in keys.items():
                counts[r].next(("received", peer, slot))
        phases.append([c.phase() for c in counts])
    return phases


@pytest.mark.parametrize("name,programs", QUICK, ids=[name for name, _ in QUICK])
def test_step_aligned_rings_return_every_slot_to_its_phase_every_two_steps(name, programs):
    """Rounded up (`step_aligned`), every ring still orders each write after its reader, and a
    training step leaves every slot in one of two phases: the phase after step s + 2 is the phase
    after step s (the first step's after every step where a ring divides its step's messages)."""
    layers, is_moe = _num_layers(programs), _is_moe(programs)
    plain = one_sided_slots(programs, is_moe, layers)
    rings = one_sided_slots(programs, is_moe, layers, step_aligned=True)
    for rank, keys in enumerate(rings):
        for key, (slot, n) in keys.items():
            held = sum(1 for s, _ in keys.values() if s == slot)
            assert n == step_ring(plain[rank][key][1], held) and (2 * held) % n == 0, (name, rank, slot)

    def slot_of(dst, src, message):
        return rings[dst][(src, message[0].value, message[1], message[2])][0]

    def ring_of(src, dst, slot):
        return next(n for s, n in rings[dst].values() if s == slot)

    assert unordered_shared_reuses(programs, CHECKED_PASSES, slot_of, layers, ring_of) == [], name
    phases = _step_counts(rings, programs, 6)
    assert phases[2] == phases[4] == phases[0] and phases[3] == phases[5] == phases[1], name
    for rank, keys in enumerate(rings):
        if all(sum(1 for s, _ in keys.values() if s == slot) % n == 0 for slot, n in keys.values()):
            assert all(p[rank] == phases[0][rank] for p in phases), (name, rank)


def test_the_unaligned_rings_of_one_attention_and_one_expert_rank_repeat_only_after_15_steps():
    """Why the rounding: 2 layers, 2 micro-batches, rings of 5 (forward) and 3 (gradients) taking 4
    messages a step come back to their phase after lcm(5, 3) = 15 steps; rounded up to 8 and 4, after 2."""
    programs = build_schedule(Layout(1, 1, 1, 2), 2).programs
    plain = one_sided_slots(programs, _is_moe(programs), 2)
    assert sorted({n for keys in plain for _, n in keys.values()}) == [3, 5]
    phases = _step_counts(plain, programs, 15)
    assert phases[14] == _step_counts(plain, programs, 30)[29] and phases[13] != phases[14]
    assert all(phases[s] != phases[14] for s in range(14))
    aligned = one_sided_slots(programs, _is_moe(programs), 2, step_aligned=True)
    assert sorted({n for keys in aligned for _, n in keys.values()}) == [4, 8]
