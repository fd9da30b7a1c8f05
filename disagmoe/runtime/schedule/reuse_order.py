"""Replay a run's passes and check that the one-sided transport may reuse a receive segment.

The nvshmem transport (`comm.nvshmem`, arena in `comm.symmetric`) writes the n-th message of a
slot (source, payload, layer, micro-batch) into copy (n - 1) mod `copies` of the receiver's
segment with no handshake. That is safe only if, in every schedule, the sender's send of message
n + copies happens-after the receiver finished with message n. `unordered_reuses` replays the
programs over a sequence of passes ("train": the whole program; "eval": the forward ops
`TrainWorker.evaluate` runs) and returns every reuse where it does not. Happens-before is the
transitive closure of:

- program order per rank (pass after pass, each pass the rank's program in order);
- a `Send` before the `Recv` of the same message (the receiver's wait passes on the flag the
  sender's stream sets after the data; a message to oneself uses no segment and is skipped);
- in a training pass the `OptimizerStep`'s all-ranks gradient-norm all-reduce
  (`TrainWorker._global_sums`): every rank's `OptimizerStep` happens-after every rank's ops
  before its own. Evaluation passes have no collective. Nothing else counts (not the driver's
  round trips, not the step's host read), so the model only ever misses orderings.

Finished with message n means: after the receiver's last op of that pass that can read a receive
segment. In an evaluation pass that is its last op. In a training pass it is the last op before
its `OptimizerStep`: the segments' views are read by compute ops and by the autograd state they
save for the backward, and the deferred weight gradients (`kernels.deferral.deferred_weight_grads`)
run right after a backward op's sends, before the next op that is not a send, so before the
`OptimizerStep` (`TrainWorker._run_held_back`), which reads only gradients and weights. This is
conservative (the real last read of a message is usually much earlier) and needs no model of which
op reads which payload; since knowledge of a rank's progress leaves it only through its sends and
the all-reduce, it is the same as asking for the receiver's next sending op after the pass's last
read. Vector clocks over the replay decide each happens-before. It imports no torch.

Shared rings (what the runtime allocates, `one_sided_slots`): the keys of a pool (source, payload,
MoE layer) share a ring of N segments, the pool's n-th message in segment (n - 1) mod N. Finished
with a message is then precise: past the first op after its lifetime that is not a send
(`recv_slots.live_ends`: its consumer and the backward op freeing what the consumer saved, then
the deferred weight gradients, which run after that op's sends). `ring_sizes` finds the fewest
N for which every write of message n + N happens-after the finish of message n and
`one_sided_slots` gives a ring the larger of that and what the planner prices (`ring_segments`:
a forward pool a segment per key and one more, a gradient pool m + 1, EXPERT_LOAD's at least 3).
Both ends count a pool's
messages, so the sender must send them in the receiver's order; a pool where it does not
(`Misordered`) gives each of its keys a ring of its own. Replayed over `CHECKED_PASSES`, in
which every sequence of three pass kinds occurs.

    unordered_reuses(programs, passes, copies)                      per-key segments' unordered reuses
    unordered_shared_reuses(programs, passes, slot_of, L, ring_of)  the same for shared rings
    one_sided_slots(programs, is_moe, L, skip)                      every rank's key -> (ring, N)

Step-aligned rings (`step_aligned`, what a run whose rank steps are captured in CUDA graphs
allocates): each ring rounded up to the fewest segments N that divide twice the pool's messages per
training step, so that two steps bring every count back to the same segment and a captured step
replays in at most two phases (`comm.counts`; one where N divides the step's messages). One is not
reachable for a forward pool: the next step's message n + k (k its messages a step) lands before
its reader is done with message n (the replay above), so it cannot take n's segment, which is what
a phase repeating every step would give it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from disagmoe.runtime.schedule.schedule import AttentionForward, ExpertForward, Loss, Op, OptimizerStep
from disagmoe.wire import Payload, Recv, Send
from disagmoe.runtime.schedule.schedule_sim import ScheduleError
from disagmoe.runtime.schedule.recv_slots import live_ends

PASSES = ("train", "eval")


@dataclass(frozen=True)
class Reuse:
    """Message `n` of a slot, sent in pass `send_pass`, may land before its receiver finished with
    message n - copies (received in pass `earlier_pass`)."""

    src: int
    dst: int
    slot: tuple  # (payload, layer, micro-batch)
    n: int
    send_pass: int
    earlier_pass: int


def pass_program(program: Sequence[Op], kind: str) -> tuple[Op, ...]:
    """The ops a rank runs in one pass of `kind` (the filter of `TrainWorker.evaluate` for "eval")."""
    if kind == "train":
        return tuple(program)
    if kind == "eval":
        return tuple(op for op in program if isinstance(op, (AttentionForward, ExpertForward, Loss))
                     or (isinstance(op, (Send, Recv)) and not op.payload.backward))
    raise ValueError(f"pass kind {kind!r}: one of {PASSES}")


def unordered_reuses(programs: Sequence[Sequence[Op]], passes: Sequence[str], copies: int = 2) -> list[Reuse]:
    """Every segment reuse of `copies`-copy arenas not ordered after the receiver's finish (module
    docstring), over `passes` run in order; raises `ScheduleError` if the replay deadlocks."""
    replay = _replay(programs, passes)
    history: dict[tuple, list[int]] = {}  # (src, dst, slot) -> the passes carrying its messages 1, 2, ...
    for src, dst, k, slot in replay.sends:
        history.setdefault((src, dst, slot), []).append(k)
    found = []
    for (src, dst, slot), ks in sorted(history.items(), key=lambda item: repr(item[0])):
        ks.sort()
        for n in range(copies + 1, len(ks) + 1):
            earlier, now = ks[n - 1 - copies], ks[n - 1]
            if replay.sends[(src, dst, now, slot)][dst] < replay.finish[(dst, earlier)]:
                found.append(Reuse(src, dst, slot, n, now, earlier))
    return found


# --- segments shared by several keys (`recv_slots`' assignment on the one-sided transport) ---------

SlotOf = Callable[[int, int, tuple], Hashable]  # (dst, src, (payload, layer, micro-batch)) -> dst's slot


@dataclass(frozen=True)
class Misordered:
    """`src` sends the messages of `dst`'s shared slot in another order than `dst` receives them:
    both count the slot's messages, so the n-th would carry another key's sequence number."""

    src: int
    dst: int
    slot: Hashable
    sent: tuple  # ((pass, (payload, layer, micro-batch)), ...) in the sender's order
    received: tuple  # the same, in the receiver's order


def unordered_shared_reuses(programs: Sequence[Sequence[Op]], passes: Sequence[str], slot_of: SlotOf,
                            num_layers: int, ring_of: Callable[[int, int, Hashable], int]) -> list[Reuse | Misordered]:
    """`unordered_reuses` for segments that several keys share: `slot_of` gives each message's slot
    on its receiver, `ring_of(src, dst, slot)` its N segments, which the slot's messages, counted
    over every key it holds, fill in turn (the n-th in (n - 1) mod N). A message's finish is its
    last read: the end of its lifetime in the pass (`recv_slots.live_ends`, on the pass's own ops),
    and the sends right after it (the deferred weight gradients run after them, `recv_slots`'
    docstring). Also every slot whose messages the sender sends in another order than the
    receiver receives them (`Misordered`: both count them, so the n-th would carry another key)."""
    replay = _replay(programs, passes, slot_of)
    ends = {(r, k): live_ends(ops, r, num_layers) for r, runs in enumerate(replay.runs) for k, ops in enumerate(runs)}
    found: list[Reuse | Misordered] = []
    for (src, dst, slot), received in sorted(replay.received.items(), key=lambda item: repr(item[0])):
        sent = replay.sent.get((src, dst, slot), [])
        if sent != received:
            found.append(Misordered(src, dst, slot, tuple(sent), tuple(received)))
            continue
        ring = ring_of(src, dst, slot)
        for n in range(ring + 1, len(received) + 1):
            (earlier, old), (now, new) = received[n - 1 - ring], received[n - 1]
            finish = replay.offset[dst][earlier] + ends[(dst, earlier)][(src, *old)] + 1
            if replay.sends[(src, dst, now, new)][dst] < finish:
                found.append(Reuse(src, dst, slot, n, now, earlier))
    return found


@dataclass
class _Replay:
    runs: list[list[tuple[Op, ...]]]  # rank -> pass -> its ops
    offset: list[list[int]]  # rank -> pass -> its ops in the passes before
    sends: dict[tuple, list[int]]  # (src, dst, pass, (payload, layer, mb)) -> the sender's clock at the send
    finish: dict[tuple[int, int], int]  # (rank, pass) -> its op count once it finished reading (module docstring)
    sent: dict[tuple, list]  # (src, dst, dst's slot) -> [(pass, (payload, layer, mb))] in send order
    received: dict[tuple, list]  # the same, in receive order


def _replay(programs: Sequence[Sequence[Op]], passes: Sequence[str], slot_of: SlotOf | None = None) -> _Replay:
    """Run every rank's passes with vector clocks (module docstring), recording each shared slot's
    messages in send and receive order when given `slot_of`; raises `ScheduleError` on a deadlock."""
    world = len(programs)
    runs = [[pass_program(p, kind) for kind in passes] for p in programs]
    offset = [[sum(len(ops) for ops in rank_runs[:k]) for k in range(len(passes))] for rank_runs in runs]
    clock = [[0] * world for _ in range(world)]  # clock[r][q]: how many of q's ops happen-before r's now
    pos = [(0, 0)] * world  # (pass, op index) of each rank's next op
    sends: dict[tuple, list[int]] = {}
    finish: dict[tuple[int, int], int] = {}
    arrived: dict[int, dict[int, list[int]]] = {}  # pass -> rank -> clock on reaching OptimizerStep
    sent: dict[tuple, list] = {}
    received: dict[tuple, list] = {}

    def advance(r: int) -> bool:
        k, i = pos[r]
        op = runs[r][k][i]
        if isinstance(op, Recv):
            keys = [(q, r, k, (op.payload, op.layer, op.micro_batch)) for q in op.peers if q != r]
            if any(key not in sends for key in keys):
                return False
            for key in keys:
                clock[r] = list(map(max, clock[r], sends[key]))
                if slot_of is not None:
                    q, _, _, message = key
                    received.setdefault((q, r, slot_of(r, q, message)), []).append((k, message))
        elif isinstance(op, OptimizerStep):  # the gradient-norm all-reduce over every rank
            finish[(r, k)] = clock[r][r]
            arrived.setdefault(k, {}).setdefault(r, list(clock[r]))
            if len(arrived[k]) < world:
                return False
            clock[r] = [max(column) for column in zip(*arrived[k].values(), strict=True)]
        clock[r][r] += 1
        if isinstance(op, Send):
            for q in op.peers:
                if q != r:
                    message = (op.payload, op.layer, op.micro_batch)
                    sends[(r, q, k, message)] = list(clock[r])
                    if slot_of is not None:
                        sent.setdefault((r, q, slot_of(q, r, message)), []).append((k, message))
        i += 1
        if i == len(runs[r][k]):
            finish.setdefault((r, k), clock[r][r])
            k, i = k + 1, 0
            while k < len(passes) and not runs[r][k]:
                k += 1
        pos[r] = (k, i)
        return True

    for r in range(world):
        if not any(runs[r]):
            pos[r] = (len(passes), 0)
        elif not runs[r][0]:
            pos[r] = (next(k for k, ops in enumerate(runs[r]) if ops), 0)
    progress = True
    while progress:
        progress = False
        for r in range(world):
            while pos[r][0] < len(passes) and advance(r):
                progress = True
    stuck = [r for r in range(world) if pos[r][0] < len(passes)]
    if stuck:
        raise ScheduleError("reuse replay deadlocked: " + "; ".join(
            f"rank {r} in pass {pos[r][0]} at {runs[r][pos[r][0]][pos[r][1]]}" for r in stuck))
    return _Replay(runs, offset, sends, finish, sent, received)


# every sequence of three pass kinds occurs in it (a de Bruijn sequence), so every pattern of
# passes a message's ring can see recurs with followers before the replay ends
CHECKED_PASSES = ("train", "train", "train", "eval", "train", "eval", "eval", "eval", "train", "train")


def ring_sizes(programs: Sequence[Sequence[Op]], passes: Sequence[str], slot_of: SlotOf,
               num_layers: int) -> tuple[dict[tuple, int], list[Misordered]]:
    """(src, dst, slot) -> the fewest segments N of a ring holding the slot's messages (the n-th,
    counted over every key of the slot, in segment (n - 1) mod N) such that the sender's send of
    message n + N happens-after the receiver is done with message n (`unordered_shared_reuses`'
    finish), over the replay of `passes`; and every slot whose sender sends its messages in
    another order than the receiver receives them (no ring: the counts would disagree)."""
    replay = _replay(programs, passes, slot_of)
    ends = {(r, k): live_ends(ops, r, num_layers) for r, runs in enumerate(replay.runs) for k, ops in enumerate(runs)}
    sizes, bad = {}, []
    for (src, dst, slot), received in replay.received.items():
        if replay.sent.get((src, dst, slot), []) != received:
            bad.append(Misordered(src, dst, slot, tuple(replay.sent.get((src, dst, slot), [])), tuple(received)))
            continue
        sent_at = [replay.sends[(src, dst, k, message)][dst] for k, message in received]  # nondecreasing
        need, j = 1, 0
        for n, (k, message) in enumerate(received):
            finish = replay.offset[dst][k] + ends[(dst, k)][(src, *message)] + 1
            j = max(j, n + 1)
            while j < len(received) and sent_at[j] < finish:
                j += 1
            need = max(need, j - n)  # messages n + 1 .. j - 1 may land before the receiver is done with n
        sizes[(src, dst, slot)] = need
    return sizes, bad


def one_sided_slots(programs: Sequence[Sequence[Op]], is_moe: Callable[[int], bool], num_layers: int,
                    skip: Callable[[Recv], bool] | None = None, passes: Sequence[str] = CHECKED_PASSES,
                    step_aligned: bool = False) -> list[dict[tuple, tuple[Hashable, int]]]:
    """Every rank's receive keys (peer, payload value, layer, micro-batch) -> (its slot, the slot's
    ring size N) on the one-sided transport. A slot per `recv_slots` pool (peer, payload value,
    MoE layer): a ring of N segments that the pool's messages fill in turn, N from `ring_sizes`;
    where the sender sends a pool's messages in another order than the receiver receives them,
    each key a ring of its own (the key itself). Skipped receives (pair rows) are not in it.
    `step_aligned`: every ring rounded up by `step_ring` to a step's messages (module docstring)."""
    def recv_keys(r: int, program: Sequence[Op]) -> list[tuple]:
        return [(peer, op.payload.value, op.layer, op.micro_batch) for op in program
                if isinstance(op, Recv) and not (skip is not None and skip(op)) for peer in op.peers if peer != r]

    keys = [recv_keys(r, p) for r, p in enumerate(programs)]
    name = [{key: (key[0], key[1], is_moe(key[2])) for key in ks} for ks in keys]

    @functools.cache
    def slot_of(dst: int, src: int, message: tuple) -> Hashable:
        payload, layer, mb = message
        key = (src, payload.value, layer, mb)
        return name[dst].get(key, key)

    sizes, bad = ring_sizes(programs, passes, slot_of, num_layers)
    if bad:
        for f in bad:
            for key, s in name[f.dst].items():
                if s == f.slot:
                    name[f.dst][key] = key
        slot_of.cache_clear()
        sizes, still = ring_sizes(programs, passes, slot_of, num_layers)
        if still:
            raise ScheduleError(f"messages of one key sent out of the receiver's order: {still[:3]}")
    micro_batches = 1 + max((op.micro_batch for p in programs for op in p if isinstance(op, Recv)), default=0)
    out = []
    for r in range(len(programs)):
        held: dict[Hashable, int] = {}
        for s in name[r].values():
            held[s] = held.get(s, 0) + 1
        out.append({key: (s, _ring(max(ring_segments(s[1], held[s], micro_batches), sizes.get((key[0], r, s), 1)),
                                   held[s], step_aligned)) for key, s in name[r].items()})
    return out


def _ring(size: int, per_step: int, step_aligned: bool) -> int:
    return step_ring(size, per_step) if step_aligned else size


def step_ring(size: int, per_step: int) -> int:
    """The fewest segments, at least `size`, of a ring that takes `per_step` messages a training step
    and returns to the same segment every two steps: the smallest divisor of 2 `per_step` that is at
    least `size` (a divisor of `per_step` itself: every step). Past 2 `per_step`, the next multiple of
    it (a longer period; no schedule the replay covers asks for that many). What
    `roofline.transport_memory` prices with `reuse=RING_STEP`."""
    if per_step < 1 or size < 1:
        raise ValueError(f"a ring of {size} segments taking {per_step} messages a step: both must be >= 1")
    twice = 2 * per_step
    if size > twice:
        return -(-size // twice) * twice
    return next(n for n in range(size, twice + 1) if twice % n == 0)


def ring_segments(payload: str, keys: int, micro_batches: int) -> int:
    """The segments a ring of `keys` keys of `payload` gets (what `roofline.transport_memory` prices,
    `reuse=RING`), unless the replay asks for more: a forward payload one per key and one more
    (its messages live until the backward; the next pass's first lands before the last is done),
    a gradient payload m + 1 (each is read by the backward op right after it arrives, while the
    micro-batches' next ones are on their way), at most two per key; EXPERT_LOAD m + 1 and at least
    three (up to its keys): its sender sends before it waits for its own backward's inputs, so at
    m = 1 it runs a layer further ahead of the reader than a gradient's sender."""
    if payload == Payload.EXPERT_LOAD.value:
        return max(micro_batches + 1, min(3, keys))
    if not Payload(payload).backward:
        return keys + 1
    return min(micro_batches + 1, 2 * keys)
