"""The one-sided transport's host message counts, and the phase in which a captured step replays.

Every slot of the nvshmem transport counts its messages on the host, on both ends alike (the
schedule runs every rank's sends and receives of a slot in one order): a receive ring of N
segments (`comm.symmetric`), a pair slot's N copies, the all-ranks sum's copies. Message n of a
slot lands in segment (n - 1) mod N. Arrival flags count on the device (`kernels.signal`), so the
only host values a step takes from these counts are segment choices, i.e. addresses.

A CUDA graph captured when the counts were n_i (ring sizes N_i) is therefore valid for replay
exactly when every n_i has moved on by a multiple of N_i since: when `phase()`, every count
mod its ring, is the same. A replay runs on the device alone, so the caller moves the counts by
the step's messages itself (`advance`), as the captured step's own calls did:

    before = counts.snapshot()
    ... capture the step (the transport's calls count its messages; capture runs nothing) ...
    step = counts_between(before, counts.snapshot())
    graph.replay()                          # the captured step, run once
    later, when counts.phase() is the captured one:  counts.advance(step); graph.replay()

Messages sent outside training steps (an evaluation pass's forward messages) move the counts
into phases no graph was captured in. The runtime then realigns them before the next training
step (`realigned`, `RingCounts.realign`): every key's count skips on to the smallest n' >= n whose
n' mod N is the key's value in the phase the step would have met had nothing else been sent (the
phase the last training step left), so a captured graph replays at once:

    expected = counts.phase()               # after a training step
    ... an evaluation sends and receives eagerly ...
    counts.realign(expected)                # before the next training step: counts.phase() == expected

Skipping needs no message and no device work: the segments skipped get neither a message nor a
wait on either side (a flag counts the messages that landed in its segment, the receiver's
consumed word of it moves only with its own waits, `kernels.signal`), so every segment's flag and
consumed word still agree and the next wait there claims the next message that lands. Sender and
receiver of a slot hold the same count and the same ring, so both compute the same n' without any
exchange. Skipping does shorten the gap, in messages, between a segment's last message and its
next (message n' + 1 lands where n' + 1 - N did, which may be one of the last before the skip):
realign only where every reader of those messages is done, as after an evaluation (each rank reads
its status word on the host after every evaluation batch, which waits for its stream, and the
driver gathers every rank's evaluation before the next step).

A key is (kind, peer, slot): kind says which count ("sent", "received", "pair_sent",
"pair_received", "sums"), peer the other rank (this rank's own for its landings and sums), slot
the transport's slot (`comm.symmetric.Slot`, `PairSlot`; None for the sums).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping

CountKey = tuple[str, int, Hashable]


class RingCounts:
    """Messages per key so far, each key's ring size from `ring_of(key)` (asked once per key)."""

    def __init__(self, ring_of: Callable[[CountKey], int]) -> None:
        self._ring_of = ring_of
        self._counts: dict[CountKey, int] = {}
        self._rings: dict[CountKey, int] = {}

    def next(self, key: CountKey) -> int:
        """Count one more message of `key`; returns its number n (1, 2, ...)."""
        n = self._counts[key] = self._counts.get(key, 0) + 1
        self._ring(key)
        return n

    def snapshot(self) -> dict[CountKey, int]:
        """Every key's count so far (a copy)."""
        return dict(self._counts)

    def phase(self) -> frozenset[tuple[CountKey, int]]:
        """Every key's count mod its ring, keys at 0 left out (a key not used yet and one whose
        count went round its ring are in the same phase): equal phases, equal segment choices."""
        return frozenset((key, n % self._ring(key)) for key, n in self._counts.items() if n % self._ring(key))

    def advance(self, step: Mapping[CountKey, int]) -> None:
        """Move the counts on by `step` (`counts_between` of a step's calls) without sending: what
        a replay of that step did on the device."""
        bad = {key: n for key, n in step.items() if n < 0}
        if bad:
            raise ValueError(f"a step sends no negative number of messages: {bad}; pass counts_between(before, "
                             "after) of the captured step")
        for key, n in step.items():
            self._ring(key)
            self._counts[key] = self._counts.get(key, 0) + n

    def realign(self, target_phase: Iterable[tuple[CountKey, int]]) -> dict[CountKey, int]:
        """Skip every count on to the fewest more messages that put it in `target_phase` (a `phase()`
        of these counts, e.g. the one the last training step left: `realigned`), sending nothing;
        returns the counts skipped per key (keys skipping none left out). Only where every reader of
        the last N messages of each ring is done (module docstring)."""
        target = tuple(target_phase)
        for key, _ in target:
            self._ring(key)
        moved = realigned(self._counts, self._rings, target)
        skipped = counts_between(self._counts, moved)
        self._counts.update(moved)
        return skipped

    def _ring(self, key: CountKey) -> int:
        ring = self._rings.get(key)
        if ring is None:
            ring = self._rings[key] = self._ring_of(key)
        return ring


def counts_between(before: Mapping[CountKey, int], after: Mapping[CountKey, int]) -> dict[CountKey, int]:
    """The messages counted between two snapshots, per key (keys with none left out)."""
    return {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}


def realigned(counts: Mapping[CountKey, int], ring_sizes: Mapping[CountKey, int],
              target_phase: Iterable[tuple[CountKey, int]]) -> dict[CountKey, int]:
    """Every key's count n moved on to the smallest n' >= n with n' mod N equal to the key's value
    in `target_phase` (pairs (key, count mod N) as `RingCounts.phase` gives them; a key it leaves
    out is at 0), N being `ring_sizes[key]`: n' - n < N. Keys of `counts` and of `target_phase`
    (a key never counted is at 0). Pure: the same counts, rings and target give the same n' on the
    sender and the receiver of a slot. A target value outside [0, N) is refused: no count has it."""
    target = dict(target_phase)
    outside = {key: (value, ring_sizes[key]) for key, value in target.items() if not 0 <= value < ring_sizes[key]}
    if outside:
        raise ValueError(f"a phase holds each count mod its ring, in [0, N): got (value, N) {outside}; pass a "
                         "phase() of these counts")
    return {key: n + (target.get(key, 0) - n) % ring_sizes[key]
            for key in counts.keys() | target.keys() for n in (counts.get(key, 0),)}
