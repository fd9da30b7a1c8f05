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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from disagmoe.runtime.schedule.schedule import AttentionForward, ExpertForward, Loss, Op, OptimizerStep
from disagmoe.wire import Recv, Send
from disagmoe.runtime.schedule.schedule_sim import ScheduleError

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
    world = len(programs)
    runs = [[pass_program(p, kind) for kind in passes] for p in programs]
    clock = [[0] * world for _ in range(world)]  # clock[r][q]: how many of q's ops happen-before r's now
    pos = [(0, 0)] * world  # (pass, op index) of each rank's next op
    sends: dict[tuple, list[int]] = {}  # (src, dst, pass, slot) -> the sender's clock at the send
    finish: dict[tuple[int, int], int] = {}  # (rank, pass) -> its op count once it finished reading
    arrived: dict[int, dict[int, list[int]]] = {}  # pass -> rank -> clock on reaching OptimizerStep

    def advance(r: int) -> bool:
        k, i = pos[r]
        op = runs[r][k][i]
        if isinstance(op, Recv):
            keys = [(q, r, k, (op.payload, op.layer, op.micro_batch)) for q in op.peers if q != r]
            if any(key not in sends for key in keys):
                return False
            for key in keys:
                clock[r] = [max(a, b) for a, b in zip(clock[r], sends[key], strict=True)]
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
                    sends[(r, q, k, (op.payload, op.layer, op.micro_batch))] = list(clock[r])
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

    history: dict[tuple, list[int]] = {}  # (src, dst, slot) -> the passes carrying its messages 1, 2, ...
    for src, dst, k, slot in sends:
        history.setdefault((src, dst, slot), []).append(k)
    found = []
    for (src, dst, slot), ks in sorted(history.items(), key=lambda item: repr(item[0])):
        ks.sort()
        for n in range(copies + 1, len(ks) + 1):
            earlier, now = ks[n - 1 - copies], ks[n - 1]
            if sends[(src, dst, now, slot)][dst] < finish[(dst, earlier)]:
                found.append(Reuse(src, dst, slot, n, now, earlier))
    return found
