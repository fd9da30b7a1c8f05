"""The expert side of one rank: its routed experts of every MoE layer of its group.

`ExpertForward(l)` takes, from each attention rank d of the group, the rows routed to this rank's
experts (grouped by expert, in the order of its expert ids) and their per-expert counts, orders
them by (expert, d) - which for every expert is the oracle's token order, because data-parallel
rank d owns the d-th block of the micro-batch's rows; of a replicated expert it gets only the
share each sender gives this replica (`plan_layout.replica_rows`), possibly none - runs the
experts once over all of them, and posts the output rows of data-parallel index d to the
attention rank d of the next group (grouped by expert again).
`ExpertBackward(l)` backpropagates the output gradients that came back and posts each source's
row gradients to it.

Legend: D data-parallel ranks, E local experts, P rows (token-expert pairs), H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from disagmoe.runtime.messages import Mailbox
from disagmoe.runtime.rank_model import RankModel
from disagmoe.runtime.schedule import Payload
from disagmoe.runtime.topology import Topology


@dataclass
class ExpertSegment:
    inputs: list[torch.Tensor]  # leaves: rows from each data-parallel source
    outputs: list[torch.Tensor]  # output rows for each data-parallel index


def expert_major(rows_DPH: list[torch.Tensor], counts_DE: torch.Tensor) -> list[torch.Tensor]:
    """Per source d rows grouped by local expert -> chunks in (expert, source) order, chunk e*D + d."""
    chunks_DE = [rows_PH.split(counts_E.tolist()) for rows_PH, counts_E in zip(rows_DPH, counts_DE, strict=True)]
    D, E = counts_DE.shape
    return [chunks_DE[d][e] for e in range(E) for d in range(D)]


class ExpertStage:
    """Forward and backward of the expert ops of one rank."""

    def __init__(self, model: RankModel, topology: Topology, rank: int) -> None:
        role = topology.expert_role(rank)
        assert role is not None, f"rank {rank} holds no experts"
        self.group = role[0]
        self.model, self.topology, self.rank = model, topology, rank
        self.sources = topology.attention_groups[self.group]
        self.destinations = topology.attention_groups[topology.next_group(self.group)]
        self.segments: dict[tuple[int, int], ExpertSegment] = {}

    def begin_step(self) -> None:
        self.segments = {}  # an evaluation pass leaves its forward segments behind

    def forward(self, layer: int, mb: int, mail: Mailbox) -> None:
        """ExpertForward(layer, mb)."""
        messages = [mail.take(Payload.DISPATCH, layer, mb, src) for src in self.sources]
        inputs = [rows_PH.detach().requires_grad_() for rows_PH, _ in messages]
        counts_DE = torch.stack([counts_E for _, counts_E in messages])
        x_PH = torch.cat(expert_major(inputs, counts_DE))
        offsets_E = torch.cumsum(counts_DE.sum(dim=0), dim=0).to(torch.int32)
        y_PH = self.model.experts(layer)(x_PH, offsets_E)
        chunks = y_PH.split(counts_DE.T.flatten().tolist())  # chunk e*D + d
        D, E = counts_DE.shape
        outputs = []
        for d, dst in enumerate(self.destinations):
            y_d_PH = torch.cat([chunks[e * D + d] for e in range(E)])
            mail.post(Payload.COMBINE, layer, mb, dst, [y_d_PH])
            outputs.append(y_d_PH)
        self.segments[(layer, mb)] = ExpertSegment(inputs, outputs)

    def backward(self, layer: int, mb: int, mail: Mailbox) -> None:
        """ExpertBackward(layer, mb)."""
        segment = self.segments.pop((layer, mb))
        grads = [mail.take(Payload.COMBINE_GRAD, layer, mb, dst)[0] for dst in self.destinations]
        torch.autograd.backward(segment.outputs, grads)
        for src, leaf in zip(self.sources, segment.inputs, strict=True):
            grad = torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
            mail.post(Payload.DISPATCH_GRAD, layer, mb, src, [grad])
