"""The one-sided transport's host message counts (disagmoe/comm/counts.py): a phase is every
count mod its ring, equal exactly when every count moved on by a multiple of its ring; `advance`
moves the counts as a replayed step's calls would have; the transports that count nothing have
one phase."""

import pytest

from disagmoe.comm.counts import RingCounts, counts_between

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
    with pytest.raises(ValueError, match="counts no messages on the host"):
        transport.advance({("sent", 1, "a"): 1})
