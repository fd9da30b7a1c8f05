"""A layout's step time by replaying its schedule with the cost model's time of every op.

The solver's closed form (`cost._pass_time`) prices each pass of a round as a ring pipeline; the
replay runs the runtime's own op lists (`runtime.schedule.schedule.build_schedule`) through the replay of
`runtime.schedule.schedule_sim` with each op's predicted seconds (`op_times`) and each message's transit on
its sender's link, so the bubbles are the schedule's: the forward's drain overlapping the
backward's fill, the losses between them, the optimizer after the last backward (the runtime
all-reduces there, the closed form hides it under the backward).

Symmetry keeps it small: every attention rank of a group runs the same ops at the same predicted
times, and so does every expert rank (the cost model prices the busiest), so the replay runs one
attention and one expert rank per pipeline group, whatever the GPU count. A step of r rounds is
r - 1 rounds up to the last backward op plus one whole round (the optimizer once). Disaggregated
layouts only: a colocated rank runs its ops back to back, which the closed form already prices.
Imports no torch (`runtime.schedule.schedule` and `runtime.schedule.schedule_sim` are pure).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from disagmoe.placement.cost import DENSE_OP, EXPERT_OP, HEAD_OP, MOE_OP, Candidates, Cost, Problem, group_time
from disagmoe.runtime.schedule.roles import Layout, Role, RoleKind
from disagmoe.runtime.schedule.schedule import (
    AttentionBackward,
    AttentionForward,
    ExpertBackward,
    ExpertForward,
    Loss,
    Op,
    OptimizerStep,
    build_schedule,
)
from disagmoe.wire import Payload
from disagmoe.runtime.schedule.schedule_sim import SimulationResult, simulate



@dataclass(frozen=True)
class OpTimes:
    """Predicted seconds of one op of each kind on the busiest GPU of its group (one layer, one
    micro-batch), and of each message payload on its sender's link."""

    attention_forward: dict[bool, float]  # by is_moe(layer)
    attention_backward: dict[bool, float]
    expert_forward: float
    expert_backward: float
    loss: float
    optimizer: dict[RoleKind, float]  # gradient all-reduce + AdamW
    transit: dict[Payload, float]

    def compute(self, role: Role, op: Op, moe: bool) -> float:
        """Seconds `op` keeps a rank of `role` busy (messages: 0, they travel on the link)."""
        if isinstance(op, AttentionForward):
            return self.attention_forward[moe]
        if isinstance(op, AttentionBackward):
            return self.attention_backward[moe]
        if isinstance(op, ExpertForward):
            return self.expert_forward
        if isinstance(op, ExpertBackward):
            return self.expert_backward
        if isinstance(op, Loss):
            return self.loss
        if isinstance(op, OptimizerStep):
            return self.optimizer[role.kind]
        return 0.0

    def by_kind(self) -> dict[str, float]:
        """Per schedule-op kind (an attention op of a MoE layer) and per message payload."""
        out = {"AttentionForward": self.attention_forward[True], "ExpertForward": self.expert_forward,
               "Loss": self.loss, "ExpertBackward": self.expert_backward,
               "AttentionBackward": self.attention_backward[True],
               "OptimizerStep": max(self.optimizer.values())}
        out.update({f"Send {p.value}": t for p, t in self.transit.items()})
        return out


def _scalar(x) -> float:
    return float(np.asarray(x, dtype=float).ravel()[0])


def op_times(cost: Cost, prob: Problem) -> OpTimes:
    """Each op kind's predicted seconds from the stages of `cost` (its first candidate), as the
    closed form counts them (`cost.group_time`): an attention op is every attention-side stage of
    its layer kind, an expert op every expert-side stage of a MoE layer (the GEMMs, the weight
    gradients, the fixed cost), the loss the head's forward and backward, the optimizer step the
    gradient all-reduce and AdamW of its side; dispatch and combine their link stages, forward and
    backward (the residual hand-off's bytes ride in the dispatch stage, so it travels in no time)."""
    stages = cost.stages

    def t(name: str, bwd: bool) -> float:
        stage = stages.get(name)
        return 0.0 if stage is None else _scalar(stage.time(bwd, prob.ceilings))

    def op(group: str, runs: tuple[str, ...], bwd: bool) -> float:
        return _scalar(group_time(stages, group, runs, bwd, prob.ceilings))

    def attention(bwd: bool, moe: bool) -> float:
        return op("attention", MOE_OP if moe else DENSE_OP, bwd)

    return OpTimes(
        attention_forward={moe: attention(False, moe) for moe in (False, True)},
        attention_backward={moe: attention(True, moe) for moe in (False, True)},
        expert_forward=op("expert", EXPERT_OP, False), expert_backward=op("expert", EXPERT_OP, True),
        loss=op("attention", HEAD_OP, False) + op("attention", HEAD_OP, True),
        optimizer={RoleKind.ATTENTION: t("grad all-reduce (attention)", True) + t("optimizer (attention)", True)
                   + t("param all-gather (attention)", True),  # ZeRO-1's, after the update
                   RoleKind.EXPERT: t("grad all-reduce (experts)", True) + t("optimizer (experts)", True)},
        transit={Payload.DISPATCH: t("dispatch", False), Payload.COMBINE: t("combine", False),
                 Payload.DISPATCH_GRAD: t("dispatch", True), Payload.COMBINE_GRAD: t("combine", True),
                 Payload.RESIDUAL: 0.0, Payload.RESIDUAL_GRAD: 0.0},
    )


def replay_round(times: OpTimes, p: int, m: int, num_layers: int, num_dense_layers: int) -> SimulationResult:
    """One round of m micro-batches on one attention and one expert rank per pipeline group."""
    layout = Layout(p, p, p, num_layers, num_dense_layers)
    return simulate(build_schedule(layout, m),
                    costs=lambda role, op: times.compute(role, op, _moe(layout, op)),
                    transit=lambda _role, op: times.transit[op.payload])


def _moe(layout: Layout, op: Op) -> bool:
    return layout.is_moe(op.layer) if isinstance(op, (AttentionForward, AttentionBackward)) else True


def replayed_step_s(cost: Cost, prob: Problem, c: Candidates) -> float:
    """The step time of the first candidate of `c` (disaggregated) by replay (module docstring)."""
    if c.colocated:
        raise ValueError("the replay prices disaggregated layouts; a colocated rank's ops run back to back")
    result = replay_round(op_times(cost, prob), int(c.p[0]), int(c.m[0]),
                          prob.model.num_layers, prob.model.num_dense_layers)
    until_backward = max([e.end for e in result.events if not isinstance(e.op, OptimizerStep)]
                         + [e.end for e in result.transfers], default=0.0)
    return (_scalar(cost.rounds) - 1) * until_backward + result.step_time
