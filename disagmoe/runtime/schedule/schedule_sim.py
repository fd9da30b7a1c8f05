"""Replay a pipeline schedule on a model of the transport and prove it sound, or say why not.

The replay gives every rank a program counter and runs ops under these rules:

- `Send` is non-blocking; it needs its payload on the rank and posts one message per peer,
  named by the transport key (`wire.message_key`) of the ordered rank pair.
- `Recv` blocks until every peer's message is there; it then makes the payload available.
- A compute op needs its inputs (below) and the right role (a colocated rank has two: attention
  and expert of its group); it produces its outputs.
- `OptimizerStep` is a collective: it completes when all its peers reach it with the same peers;
  so is `ReduceGradients(l)` (a data-parallel group's gradient sum of one layer).

Data dependencies (the model of what each op consumes, written independently of the builder):

    AttentionForward(l)   needs RESIDUAL(l-1) [+ COMBINE(l-1) if l-1 is MoE]; makes RESIDUAL(l)
                          [+ DISPATCH(l) if l is MoE]
    ExpertForward(l)      needs DISPATCH(l); makes COMBINE(l) and EXPERT_LOAD(l) (its block's load)
    Loss                  needs the last layer's output; makes its grads
    ExpertBackward(l)     needs ExpertForward(l) here and COMBINE_GRAD(l) [+ the other blocks'
                          EXPERT_LOAD(l) received, where the rank's program receives them];
                          makes DISPATCH_GRAD(l)
    AttentionBackward(l)  needs AttentionForward(l) here, RESIDUAL_GRAD(l) [+ DISPATCH_GRAD(l)];
                          makes RESIDUAL_GRAD(l-1) [+ COMBINE_GRAD(l-1)]
    OptimizerStep         needs the backward of every forward this rank ran

Failures raise `ScheduleError`: deadlock (with what each stuck rank waits for), an op whose input
is missing, a key sent twice, a payload arriving under another payload's key, a message never
received, or a layer / micro-batch not computed exactly once by every rank that owns it.
Ops have unit-ish costs so the replay also yields a timeline (`render_timeline`); given real
costs (a function of the rank's role and the op) and message transit times it is the step time
of a layout, bubbles included (`disagmoe.placement.replay`). A message's transit occupies its
sender's outgoing link (one FIFO per rank, beside the rank's compute): it leaves when the link is
free and arrives `transit` seconds later. The replay also counts receives that overtake an older
pending message from the same peer on the same lane: zero means an in-order transport (NCCL: one
FIFO per rank pair and `wire.lane_of` lane) never has to buffer a message. It imports no torch
(the planner replays plans with it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from disagmoe.runtime.schedule.roles import Role, RoleKind
from disagmoe.runtime.schedule.schedule import (
    AttentionBackward,
    AttentionForward,
    ExpertBackward,
    ExpertForward,
    Loss,
    Op,
    OptimizerStep,
    ReduceGradients,
    Schedule,
)
from disagmoe.wire import MessageKey, Payload, Recv, Send, lane_of, message_key

DEFAULT_COSTS: dict[type, float] = {
    AttentionForward: 1.0,
    ExpertForward: 1.0,
    Loss: 1.0,
    ExpertBackward: 2.0,
    AttentionBackward: 2.0,
    OptimizerStep: 1.0,
    ReduceGradients: 0.0,
    Send: 0.0,
    Recv: 0.0,
}

Value = tuple[Payload, int, int]  # (payload, layer, micro_batch) held by a rank
Channel = tuple[int, int, MessageKey]  # (src, dst, the transport key, step 0)
CostFn = Callable[[Role, Op], float]  # seconds (or units) a rank of this role spends running the op
TransitFn = Callable[[Role, Send], float]  # seconds a Send occupies its sender's link until it arrives


class ScheduleError(RuntimeError):
    """The schedule is unsound; the message says where and why."""


@dataclass(frozen=True)
class Event:
    rank: int
    op: Op
    start: float
    end: float


@dataclass
class SimulationResult:
    events: list[Event]
    messages: int
    step_time: float
    out_of_order_recvs: int  # recvs that took a message while an older one from that peer's lane waited
    transfers: list[Event] = field(default_factory=list)  # each Send's time on its sender's link

    def busy_fraction(self, rank: int) -> float:
        busy = sum(e.end - e.start for e in self.events if e.rank == rank)
        return busy / self.step_time if self.step_time else 0.0


@dataclass
class _Rank:
    role: Role  # the first of `roles`: what costs and messages name it by
    roles: tuple[Role, ...]
    program: tuple[Op, ...]
    pc: int = 0
    clock: float = 0.0
    values: set[Value] = field(default_factory=set)
    received: set[Value] = field(default_factory=set)
    done: Counter = field(default_factory=Counter)
    swapped: frozenset[tuple[int, int]] = field(init=False)  # (layer, mb) whose other blocks' loads it receives

    def __post_init__(self) -> None:
        self.swapped = frozenset((op.layer, op.micro_batch) for op in self.program
                                 if isinstance(op, Recv) and op.payload is Payload.EXPERT_LOAD)

    def finished(self) -> bool:
        return self.pc == len(self.program)


class _Replay:
    def __init__(self, schedule: Schedule, cost: CostFn, transit: TransitFn | None) -> None:
        self.layout = schedule.layout
        self.micro_batches = schedule.micro_batches
        self.cost, self.transit = cost, transit
        self.ranks = [
            _Rank(self.layout.role(r), self.layout.roles(r), program)
            for r, program in enumerate(schedule.programs)
        ]
        if len(self.ranks) != self.layout.world_size:
            raise ScheduleError(
                f"schedule has {len(self.ranks)} programs for a {self.layout.world_size}-rank layout"
            )
        self.mailbox: dict[Channel, tuple[Send, float]] = {}  # insertion order = send order
        self.arrivals: dict[tuple[int, ...], dict[int, float]] = {}
        self.events: list[Event] = []
        self.transfers: list[Event] = []
        self.link_free = [0.0] * len(self.ranks)  # when each rank's outgoing link is next free
        self.messages = 0
        self.out_of_order_recvs = 0

    def run(self) -> SimulationResult:
        progress = True
        while progress:
            progress = False
            for rank_id, rank in enumerate(self.ranks):
                while not rank.finished() and self._step(rank_id, rank):
                    progress = True
        stuck = [r for r, rank in enumerate(self.ranks) if not rank.finished()]
        if stuck:
            raise ScheduleError("deadlock: " + "; ".join(self._waiting_for(r) for r in stuck))
        if self.mailbox:
            (src, dst, _), (sent, _) = next(iter(self.mailbox.items()))
            raise ScheduleError(
                f"{len(self.mailbox)} message(s) never received, e.g. {sent.payload.value} layer {sent.layer} "
                f"micro-batch {sent.micro_batch} from rank {src} to rank {dst}"
            )
        self._check_coverage()
        step_time = max([e.end for e in self.events] + [r.clock for r in self.ranks], default=0.0)
        return SimulationResult(self.events, self.messages, step_time, self.out_of_order_recvs, self.transfers)

    # -- one op ----------------------------------------------------------------------------

    def _step(self, rank_id: int, rank: _Rank) -> bool:
        """Run the rank's next op if it can run now; False if it blocks."""
        op = rank.program[rank.pc]
        start = rank.clock
        if isinstance(op, Recv):
            channels = [self._channel(peer, rank_id, op) for peer in op.peers]
            if any(c not in self.mailbox for c in channels):
                return False
            for channel in channels:
                oldest = next(c for c in self.mailbox if c[:2] == channel[:2] and lane_of(c[2]) == lane_of(channel[2]))
                self.out_of_order_recvs += oldest != channel
                sent, sent_at = self.mailbox.pop(channel)
                if sent.payload is not op.payload:
                    raise ScheduleError(
                        f"rank {rank_id} ({rank.role}) expected {op.payload.value} but the key of "
                        f"{op} carries {sent.payload.value} from rank {channel[0]}: keys collide"
                    )
                start = max(start, sent_at)
            rank.values.add((op.payload, op.layer, op.micro_batch))
            rank.received.add((op.payload, op.layer, op.micro_batch))
        elif isinstance(op, Send):
            self._require(rank_id, rank, op, (op.payload, op.layer, op.micro_batch))
            arrival = self._transmit(rank_id, rank, op)
            for peer in op.peers:
                channel = self._channel(rank_id, peer, op)
                if channel in self.mailbox:
                    raise ScheduleError(
                        f"rank {rank_id} sends the key of {op.payload.value} layer {op.layer} micro-batch "
                        f"{op.micro_batch} to rank {peer} twice ({op})"
                    )
                self.mailbox[channel] = (op, arrival)
                self.messages += 1
        elif isinstance(op, ReduceGradients):
            arrived = self.arrivals.setdefault(op, {})
            if rank_id not in op.peers or not self._has_role(rank, RoleKind.ATTENTION):
                raise ScheduleError(f"rank {rank_id} ({rank.role}): {op} belongs on the attention ranks it names")
            arrived.setdefault(rank_id, rank.clock)
            if len(arrived) < len(op.peers):
                return False
            start = max(arrived.values())
        elif isinstance(op, OptimizerStep):
            arrived = self.arrivals.setdefault(op.peers, {})
            if rank_id not in op.peers:
                raise ScheduleError(f"rank {rank_id}: {op} does not include the rank itself")
            arrived.setdefault(rank_id, rank.clock)
            if len(arrived) < len(op.peers):
                return False
            self._require_backward_done(rank_id, rank)
            start = max(arrived.values())
        else:
            self._compute(rank_id, rank, op)
        end = start + self.cost(rank.role, op)
        if end > start:
            self.events.append(Event(rank_id, op, start, end))
        rank.clock = end
        rank.done[op] += 1
        rank.pc += 1
        return True

    def _transmit(self, rank_id: int, rank: _Rank, op: Send) -> float:
        """When `op`'s messages arrive: after the sender's link carried it (FIFO per sender)."""
        if self.transit is None:
            return rank.clock
        leave = max(rank.clock, self.link_free[rank_id])
        arrival = leave + self.transit(rank.role, op)
        self.link_free[rank_id] = arrival
        if arrival > leave:
            self.transfers.append(Event(rank_id, op, leave, arrival))
        return arrival

    def _compute(self, rank_id: int, rank: _Rank, op: Op) -> None:
        layout = self.layout
        if isinstance(op, Loss):
            last = layout.num_layers - 1
            self._require_role(rank_id, rank, op, RoleKind.ATTENTION, layout.head_group)
            self._require_layer_output(rank_id, rank, op, last, op.micro_batch)
            self._produce_layer_grads(rank, last, op.micro_batch)
            return
        layer, mb = op.layer, op.micro_batch
        if not 0 <= layer < layout.num_layers or not 0 <= mb < self.micro_batches:
            raise ScheduleError(f"rank {rank_id}: {op} names a layer or micro-batch out of range")
        group = layout.group_of_layer(layer)
        if isinstance(op, AttentionForward):
            self._require_role(rank_id, rank, op, RoleKind.ATTENTION, group)
            if layer > 0:
                self._require_layer_output(rank_id, rank, op, layer - 1, mb)
            rank.values.add((Payload.RESIDUAL, layer, mb))
            if layout.is_moe(layer):
                rank.values.add((Payload.DISPATCH, layer, mb))
        elif isinstance(op, ExpertForward):
            self._require_role(rank_id, rank, op, RoleKind.EXPERT, group)
            self._require(rank_id, rank, op, (Payload.DISPATCH, layer, mb))
            rank.values.update({(Payload.COMBINE, layer, mb), (Payload.EXPERT_LOAD, layer, mb)})
        elif isinstance(op, ExpertBackward):
            self._require_role(rank_id, rank, op, RoleKind.EXPERT, group)
            self._require_done(rank_id, rank, op, ExpertForward(layer, mb))
            self._require(rank_id, rank, op, (Payload.COMBINE_GRAD, layer, mb))
            if (layer, mb) in rank.swapped and (Payload.EXPERT_LOAD, layer, mb) not in rank.received:
                raise ScheduleError(f"rank {rank_id} ({rank.role}) runs {op} before the other blocks' "
                                    f"{Payload.EXPERT_LOAD.value} (layer {layer}, micro-batch {mb}) is received")
            rank.values.add((Payload.DISPATCH_GRAD, layer, mb))
        elif isinstance(op, AttentionBackward):
            self._require_role(rank_id, rank, op, RoleKind.ATTENTION, group)
            self._require_done(rank_id, rank, op, AttentionForward(layer, mb))
            self._require(rank_id, rank, op, (Payload.RESIDUAL_GRAD, layer, mb))
            if layout.is_moe(layer):
                self._require(rank_id, rank, op, (Payload.DISPATCH_GRAD, layer, mb))
            if layer > 0:
                self._produce_layer_grads(rank, layer - 1, mb)
        else:
            raise ScheduleError(f"rank {rank_id}: unknown op {op!r}")

    # -- dependency rules ------------------------------------------------------------------

    def _require_layer_output(self, rank_id: int, rank: _Rank, op: Op, layer: int, mb: int) -> None:
        self._require(rank_id, rank, op, (Payload.RESIDUAL, layer, mb))
        if self.layout.is_moe(layer):
            self._require(rank_id, rank, op, (Payload.COMBINE, layer, mb))

    def _produce_layer_grads(self, rank: _Rank, layer: int, mb: int) -> None:
        rank.values.add((Payload.RESIDUAL_GRAD, layer, mb))
        if self.layout.is_moe(layer):
            rank.values.add((Payload.COMBINE_GRAD, layer, mb))

    def _require(self, rank_id: int, rank: _Rank, op: Op, value: Value) -> None:
        if value not in rank.values:
            payload, layer, mb = value
            raise ScheduleError(
                f"rank {rank_id} ({rank.role}) runs {op} before its input {payload.value} "
                f"(layer {layer}, micro-batch {mb}) is produced or received"
            )

    def _require_done(self, rank_id: int, rank: _Rank, op: Op, forward: Op) -> None:
        if not rank.done[forward]:
            raise ScheduleError(f"rank {rank_id} ({rank.role}) runs {op} before {forward}")

    @staticmethod
    def _has_role(rank: _Rank, kind: RoleKind, group: int | None = None) -> bool:
        """Whether one of the rank's roles is `kind` (of `group`, unless None)."""
        return any(role.kind is kind and group in (None, role.group) for role in rank.roles)

    def _require_role(self, rank_id: int, rank: _Rank, op: Op, kind: RoleKind, group: int) -> None:
        if not self._has_role(rank, kind, group):
            raise ScheduleError(
                f"rank {rank_id} is {rank.role} but {op} belongs on a {kind.value} rank of group {group}"
            )

    def _require_backward_done(self, rank_id: int, rank: _Rank) -> None:
        pairs = {AttentionForward: AttentionBackward, ExpertForward: ExpertBackward}
        for op, count in rank.done.items():
            if type(op) in pairs and rank.done[pairs[type(op)](op.layer, op.micro_batch)] != count:
                raise ScheduleError(
                    f"rank {rank_id} ({rank.role}) steps the optimizer before the backward of {op}"
                )

    # -- bookkeeping -----------------------------------------------------------------------

    @staticmethod
    def _channel(src: int, dst: int, op: Send | Recv) -> Channel:
        return (src, dst, message_key(0, op.payload, op.layer, op.micro_batch))

    def _waiting_for(self, rank_id: int) -> str:
        rank = self.ranks[rank_id]
        op = rank.program[rank.pc]
        if isinstance(op, Recv):
            missing = [p for p in op.peers if self._channel(p, rank_id, op) not in self.mailbox]
            return f"rank {rank_id} ({rank.role}) blocks in {op} waiting for rank(s) {missing}"
        if isinstance(op, (OptimizerStep, ReduceGradients)):
            key = op if isinstance(op, ReduceGradients) else op.peers
            missing = [p for p in op.peers if p not in self.arrivals.get(key, {})]
            return f"rank {rank_id} ({rank.role}) blocks in {op} waiting for rank(s) {missing}"
        return f"rank {rank_id} ({rank.role}) blocks at {op}"

    def _check_coverage(self) -> None:
        """Every owner rank ran each layer/micro-batch exactly once, and the loss for each."""
        layout = self.layout
        for layer in range(layout.num_layers):
            group = layout.group_of_layer(layer)
            owners = [(r, AttentionForward, AttentionBackward) for r in layout.attention_group(group)]
            if layout.is_moe(layer):
                owners += [(r, ExpertForward, ExpertBackward) for r in layout.expert_group(group)]
            for mb in range(self.micro_batches):
                for rank_id, *kinds in owners:
                    for kind in kinds:
                        self._expect_once(rank_id, kind(layer, mb))
        for rank_id in layout.attention_group(layout.head_group):
            for mb in range(self.micro_batches):
                self._expect_once(rank_id, Loss(mb))
        for rank_id, rank in enumerate(self.ranks):
            steps = [op for op in rank.program if isinstance(op, OptimizerStep)]
            if len(steps) != 1 or not isinstance(rank.program[-1], OptimizerStep):
                raise ScheduleError(f"rank {rank_id} must end with exactly one OptimizerStep")

    def _expect_once(self, rank_id: int, op: Op) -> None:
        count = self.ranks[rank_id].done[op]
        if count != 1:
            raise ScheduleError(f"rank {rank_id} ran {op} {count} times; it must run exactly once")


def simulate(schedule: Schedule, costs: dict[type, float] | CostFn | None = None,
             transit: TransitFn | None = None) -> SimulationResult:
    """Replay `schedule`; raises ScheduleError unless it is sound. Returns the timeline.

    `costs`: per op type (default `DEFAULT_COSTS`), or a function of (role, op); `transit`: each
    Send's time on its sender's link (None: messages arrive when sent)."""
    table = DEFAULT_COSTS if costs is None else costs
    cost = table if callable(table) else (lambda _role, op: table[type(op)])
    return _Replay(schedule, cost, transit).run()


_LETTERS = {
    AttentionForward: "a",
    ExpertForward: "e",
    Loss: "L",
    ExpertBackward: "E",
    AttentionBackward: "A",
    OptimizerStep: "O",
    ReduceGradients: "R",
}


def render_timeline(schedule: Schedule, result: SimulationResult) -> str:
    """One text row per rank; each cell is one time unit: `a3:1` = attention forward, layer 3,
    micro-batch 1 (e/E expert fwd/bwd, A attention bwd, L loss of micro-batch, O optimizer)."""

    def label(op: Op) -> str:
        letter = _LETTERS[type(op)]
        if isinstance(op, Loss):
            return f"{letter}:{op.micro_batch}"
        if isinstance(op, OptimizerStep):
            return letter
        if isinstance(op, ReduceGradients):
            return f"{letter}{op.layer}"
        return f"{letter}{op.layer}:{op.micro_batch}"

    width = max((len(label(e.op)) for e in result.events), default=1) + 1
    cells = int(round(result.step_time))
    rows = []
    for rank_id in range(schedule.layout.world_size):
        row = [".".ljust(width)] * cells
        for event in result.events:
            if event.rank == rank_id:
                for t in range(int(round(event.start)), int(round(event.end))):
                    row[t] = label(event.op).ljust(width)
        rows.append(f"{str(schedule.layout.role(rank_id)):>6} |{''.join(row).rstrip()}")
    return "\n".join(rows)
