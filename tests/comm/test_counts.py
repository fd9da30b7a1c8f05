"""The one-sided transport's host message counts (disagmoe/comm/counts.py): a phase is every
count mod its ring, equal exactly when every count moved on by a multiple of its ring; `advance`
moves the counts as a replayed step's calls would have; `realigned` skips each count to the
smallest one at or past it in a target phase (sender and receiver alike); the transports that count
nothing have one phase."""

import pytest

from disagmoe.comm.counts import RingCounts, counts_between, realigned

RINGS = {("sent", 1, "a"): 2, ("received", 1, "b"): 3, ("sums", 0, None): 2}


def test_a_phase_comes_back_once_every_count_went_round_its_ring():
    counts = RingCounts(RINGS.__getitem__)
    start = counts.phase()
    assert start == frozenset()
    before = counts.snapshot()
    for key in (("sent", 1, "a"), ("received", 1, "b"), ("received", 1, "b"), ("sums", 0, None)):
        counts.next(key)
    step = counts_between(before, counts.snapshot())
    assert step == {("sent", 1, "a"): 1, ("received", 1, "b"): 2, ("sums", 0, None): 1}
    phases = [counts.phase()]
    for _ in range(5):  # rings 2, 3, 2 with 1, 2, 1 messages a step: back after lcm(2, 3) = 6 steps
        counts.advance(step)
        phases.append(counts.phase())
    assert start not in phases[:-1] and phases[-1] == start == frozenset()
    assert phases[0] == frozenset({(("sent", 1, "a"), 1), (("received", 1, "b"), 2), (("sums", 0, None), 1)})
    assert len(set(phases)) == 6
    assert counts.snapshot() == {key: 6 * n for key, n in step.items()}
    assert counts.next(("sent", 1, "a")) == 7, "counting goes on from the advanced count"


def test_advance_asks_each_new_key_its_ring_once_and_refuses_negative_steps():
    asked = []
    counts = RingCounts(lambda key: asked.append(key) or 4)
    counts.advance({("pair_sent", 2, "p"): 3})
    counts.next(("pair_sent", 2, "p"))
    assert asked == [("pair_sent", 2, "p")] and counts.phase() == frozenset()
    with pytest.raises(ValueError, match="no negative number of messages"):
        counts.advance({("pair_sent", 2, "p"): -1})
    assert counts_between({"k": 2, "j": 1}, {"k": 2, "j": 3, "new": 1}) == {"j": 2, "new": 1}


def test_a_transport_that_counts_nothing_has_one_phase():
    from disagmoe.comm.local import LocalTransport

    transport = object.__new__(LocalTransport)
    assert transport.phase() == () and transport.message_counts() == {}
    transport.advance({})
    assert transport.realign(transport.phase()) == {}
    with pytest.raises(ValueError, match="counts no messages on the host"):
        transport.realign(frozenset({(("sent", 1, "a"), 1)}))
    with pytest.raises(ValueError, match="counts no messages on the host"):
        transport.advance({("sent", 1, "a"): 1})


def _phase_of(counts, rings):
    return frozenset((key, n % rings[key]) for key, n in counts.items() if n % rings[key])


@pytest.mark.parametrize("seed", range(5))
def test_realigned_counts_are_the_smallest_at_or_past_each_count_in_the_target_phase(seed):
    import random

    rng = random.Random(seed)
    rings = {("sent", 1, s): rng.randint(1, 7) for s in range(6)}
    for _ in range(50):
        counts = {key: rng.randint(0, 30) for key in rings if rng.random() < 0.8}
        target = _phase_of({key: rng.randint(0, 30) for key in rings}, rings)
        moved = realigned(counts, rings, target)
        assert _phase_of(moved, rings) == target, "congruent to the target phase"
        for key, n in moved.items():
            assert n >= counts.get(key, 0), "never moves back"
            assert all(m % rings[key] != n % rings[key] for m in range(counts.get(key, 0), n)), "the smallest such"
        assert set(moved) >= set(counts)


def test_realigned_counts_a_key_never_counted_from_zero_and_refuses_a_value_past_its_ring():
    rings = {"a": 4, "b": 3}
    assert realigned({"a": 5}, rings, frozenset({("b", 2)})) == {"a": 8, "b": 2}
    assert realigned({"a": 5, "b": 3}, rings, frozenset({("a", 1)})) == {"a": 5, "b": 3}, "already there: no skip"
    with pytest.raises(ValueError, match=r"in \[0, N\)"):
        realigned({"a": 5}, rings, frozenset({("a", 4)}))


def test_a_sender_and_a_receiver_that_realign_on_their_own_agree():
    """Both ends count a slot's messages under their own keys (sent to / received from the peer)
    with one ring: each realigns to the phase its last training step left, and both land on the
    same count, in the phase a step with no evaluation before it would have started in."""
    ring = 4
    sender = RingCounts(lambda key: ring)
    receiver = RingCounts(lambda key: ring)
    sent, received = ("sent", 1, "slot"), ("received", 0, "slot")
    for _ in range(3):  # a training step: 3 messages
        sender.next(sent)
        receiver.next(received)
    sender_expected, receiver_expected = sender.phase(), receiver.phase()
    for _ in range(2):  # an evaluation: 2 forward messages of the slot
        sender.next(sent)
        receiver.next(received)
    assert sender.realign(sender_expected) == {sent: 2} and receiver.realign(receiver_expected) == {received: 2}
    assert sender.snapshot()[sent] == receiver.snapshot()[received] == 7  # 5 -> 7 = 3 mod 4
    assert sender.phase() == sender_expected and sender.realign(sender_expected) == {}, "twice: nothing more"
    assert sender.next(sent) == 8
