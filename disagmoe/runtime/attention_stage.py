"""The attention side of one rank: embedding, its layers' non-expert parts, final norm, head, loss.

Each compute op of the schedule is one *segment* of autograd graph. `AttentionForward(l)` first
rebuilds layer l-1's output from what arrived (the residual stream and routing weights, the
expert outputs), each received tensor a fresh leaf, then runs layer l's attention, router and
shared experts and posts the dispatched rows and the residual stream for the next hop. The
segment keeps its outputs; `AttentionBackward(l)` calls `torch.autograd.backward(outputs,
grads)` with the gradients that came back, and posts its leaves' gradients to where they came from.

The loss matches the oracle (`runtime.trainer`): micro-batch m of M is split over D
data-parallel ranks; each rank backpropagates its share

    CE_local / (D M)  +  (aux_share + z_local / D) / M        per MoE layer for the router terms

where aux_share uses the micro-batch's load summed over the D ranks (one all-reduce per layer),
so the shares of the D ranks add up to the oracle's loss_m / M exactly (up to rounding).

Legend: B batch rows of this rank's piece, S sequence, H hidden, N tokens (B*S), K top-k,
P token-expert pairs, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from disagmoe.data import TokenDataset
from disagmoe.model import MoEBlock, Routing, combine, group_by_expert
from disagmoe.model.dispatch import expert_counts
from disagmoe.model.loss import linear_cross_entropy
from disagmoe.runtime.batching import batch_rows, inputs_and_targets
from disagmoe.runtime.messages import Mailbox
from disagmoe.runtime.plan_layout import ExpertOwners, replica_rows
from disagmoe.runtime.rank_model import RankModel
from disagmoe.runtime.schedule import Payload
from disagmoe.runtime.topology import Topology


def rank_shares(counts: list[int], owners: ExpertOwners, ranks: int, dp_index: int,
                dp: int) -> list[list[tuple[int, int, int]]]:
    """Per expert rank: (expert, replica, rows) for every expert it holds, ascending (its id
    order): the rows of the sender of data-parallel index `dp_index` (of `dp`) it runs; a
    replicated expert's rows go to its owners by `replica_rows` (some may get none)."""
    shares: list[list[tuple[int, int, int]]] = [[] for _ in range(ranks)]
    for e, who in enumerate(owners):
        sizes = [counts[e]] if len(who) == 1 else replica_rows(counts[e], len(who), dp_index, dp)
        for r, (i, rows) in enumerate(zip(who, sizes, strict=True)):
            shares[i].append((e, r, rows))
    return shares


def split_by_rank(x_PH: torch.Tensor, counts_E: torch.Tensor, owners: ExpertOwners, ranks: int,
                  dp_index: int, dp: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Rows grouped by expert (counts_E rows each) from the sender of data-parallel index
    `dp_index` -> per expert rank, the rows it runs in its id order, and one row count per expert
    it holds (what it runs them in)."""
    counts = counts_E.tolist()
    shares = rank_shares(counts, owners, ranks, dp_index, dp)
    sizes = {}
    for mine in shares:
        sizes.update(((e, r), n) for e, r, n in mine)
    flat = [(e, r) for e, who in enumerate(owners) for r in range(len(who))]  # x_PH's order
    pieces = dict(zip(flat, x_PH.split([sizes[key] for key in flat]), strict=True))
    rows = [torch.cat([pieces[e, r] for e, r, _ in mine]) for mine in shares]
    return rows, [[n for _, _, n in mine] for mine in shares]


def merge_ranks(rows_per_rank: list[torch.Tensor], counts_E: torch.Tensor, owners: ExpertOwners,
                dp_index: int, dp: int) -> torch.Tensor:
    """The inverse of `split_by_rank`: every expert rank's rows back in expert order."""
    counts = counts_E.tolist()
    shares = rank_shares(counts, owners, len(rows_per_rank), dp_index, dp)
    pieces = {}
    for rows_PH, mine in zip(rows_per_rank, shares, strict=True):
        parts = rows_PH.split([n for _, _, n in mine])
        pieces.update(((e, r), part) for (e, r, _), part in zip(mine, parts, strict=True))
    return torch.cat([pieces[e, r] for e, who in enumerate(owners) for r in range(len(who))])


def combine_layer_output(
    h_BSH: torch.Tensor, topk_w_NK: torch.Tensor, rows_per_rank: list[torch.Tensor],
    owners: ExpertOwners, topk_idx_NK: torch.Tensor, shared_NH: torch.Tensor | None,
    num_experts: int, dp_index: int, dp: int,
) -> torch.Tensor:
    """A MoE layer's output from its parts (each expert rank's output rows, as `split_by_rank` sent
    their inputs): the arithmetic of `MoEBlock.combine`, in its order."""
    grouping = group_by_expert(topk_idx_NK, num_experts)
    counts_E = expert_counts(topk_idx_NK, num_experts)
    ffn_NH = combine(merge_ranks(rows_per_rank, counts_E, owners, dp_index, dp), grouping, topk_w_NK)
    if shared_NH is not None:
        ffn_NH = ffn_NH + shared_NH
    return h_BSH + ffn_NH.view_as(h_BSH)


@dataclass
class LayerInput:
    """The leaves a segment starts from (layer `prev`'s output parts), for sending gradients back."""

    prev: int  # the layer whose output this is
    carry: list[torch.Tensor] = field(default_factory=list)  # residual-stream parts (float leaves)
    expert_rows: list[torch.Tensor] = field(default_factory=list)  # per expert rank of `prev`, its id order


@dataclass
class Segment:
    """One AttentionForward's graph: its inputs and the outputs whose gradients come back later."""

    inputs: LayerInput | None
    dispatched: list[torch.Tensor]  # rows sent to each expert rank of the group (`split_by_rank`)
    carry: list[torch.Tensor]  # float residual-stream parts sent to the next group
    router_loss: torch.Tensor | None  # this rank's share of (aux + z) / M


class AttentionStage:
    """Forward, loss and backward of the attention ops of one rank for one step at a time."""

    def __init__(self, model: RankModel, topology: Topology, rank: int, data: TokenDataset,
                 micro_batches: int, dp_group: dist.ProcessGroup | None) -> None:
        role = topology.attention_role(rank)
        assert role is not None, f"rank {rank} runs no attention"
        self.group, self.dp_index = role
        self.model, self.topology, self.rank = model, topology, rank
        self.data, self.micro_batches, self.dp_group = data, micro_batches, dp_group
        self.dp = topology.data_parallel
        self.num_experts = model.cfg.num_experts
        self.layers = topology.attention_layers(rank)
        self.begin_step(0)

    def begin_step(self, step: int, data: TokenDataset | None = None) -> None:
        """Start step `step` of `data` (default: the training data); forgets the previous step."""
        self.step = step
        self.batch_data = self.data if data is None else data
        self.segments: dict[tuple[int, int], Segment] = {}
        device = self.model.device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.loss_parts = {"ce": zero, "aux_loss": zero, "z_loss": zero}  # this rank's shares, on the device
        self.load_LE = {layer: torch.zeros(self.num_experts, dtype=torch.int64, device=device)
                        for layer in self.layers if self.topology.is_moe(layer)}

    # -- the data --------------------------------------------------------------------------------

    def _tokens(self, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = batch_rows(self.data.batch_size, self.micro_batches, self.dp, micro_batch, self.dp_index)
        inputs_BS, targets_BS = inputs_and_targets(self.batch_data.rows(self.step, rows))
        return inputs_BS.to(self.model.device), targets_BS.to(self.model.device)

    # -- receiving the previous layer ------------------------------------------------------------

    def _previous_output(self, layer: int, mb: int, mail: Mailbox) -> tuple[torch.Tensor, LayerInput]:
        """Layer `layer - 1`'s output rebuilt from received parts (each a leaf)."""
        topo, prev = self.topology, layer - 1
        source = topo.attention_rank(topo.group_of_layer(prev), self.dp_index)
        received = mail.take(Payload.RESIDUAL, prev, mb, source)
        parts = [t.detach().requires_grad_(t.is_floating_point()) for t in received]
        inputs = LayerInput(prev, carry=[t for t in parts if t.is_floating_point()])
        if not topo.is_moe(prev):
            return parts[0], inputs
        experts = topo.expert_groups[topo.group_of_layer(prev)]
        inputs.expert_rows = [mail.take(Payload.COMBINE, prev, mb, r)[0].detach().requires_grad_() for r in experts]
        h_BSH, topk_w_NK, topk_idx_NK, *shared = parts
        x_BSH = combine_layer_output(h_BSH, topk_w_NK, inputs.expert_rows, topo.expert_owners[prev], topk_idx_NK,
                                     shared[0] if shared else None, self.num_experts, self.dp_index, self.dp)
        return x_BSH, inputs

    def _post_input_grads(self, inputs: LayerInput, mb: int, mail: Mailbox) -> None:
        topo, prev = self.topology, inputs.prev
        if topo.is_moe(prev):
            for rank, leaf in zip(topo.expert_groups[topo.group_of_layer(prev)], inputs.expert_rows, strict=True):
                mail.post(Payload.COMBINE_GRAD, prev, mb, rank, [_grad(leaf)])
        source = topo.attention_rank(topo.group_of_layer(prev), self.dp_index)
        mail.post(Payload.RESIDUAL_GRAD, prev, mb, source, [_grad(leaf) for leaf in inputs.carry])

    # -- the ops ---------------------------------------------------------------------------------

    def forward(self, layer: int, mb: int, mail: Mailbox) -> None:
        """AttentionForward(layer, mb), in the parameters' dtype."""
        if layer == 0:
            x_BSH, inputs = self.model.embed(self._tokens(mb)[0]), None
        else:
            x_BSH, inputs = self._previous_output(layer, mb, mail)
        block = self.model.block(layer)
        topo = self.topology
        nxt = topo.attention_rank(topo.next_group(self.group), self.dp_index)
        if not isinstance(block, MoEBlock):
            out_BSH = block(x_BSH)
            mail.post(Payload.RESIDUAL, layer, mb, nxt, [out_BSH])
            self.segments[(layer, mb)] = Segment(inputs, [], [out_BSH], None)
            return
        h_BSH = block.attention_part(x_BSH)
        routing = block.route(h_BSH)
        x_PH, grouping = block.dispatch(routing)
        shared_NH = block.shared_ffn(routing)
        counts_E = routing.load_E  # rows per expert, the order of x_PH
        ranks = topo.expert_groups[self.group]
        dispatched, counts = split_by_rank(x_PH, counts_E, topo.expert_owners[layer], len(ranks), self.dp_index,
                                           self.dp)
        for rank, rows_PH, rank_counts in zip(ranks, dispatched, counts, strict=True):
            counts_R = torch.tensor(rank_counts, dtype=counts_E.dtype).to(counts_E.device, non_blocking=True)
            mail.post(Payload.DISPATCH, layer, mb, rank, [rows_PH, counts_R])
        shared = [] if shared_NH is None else [shared_NH]
        mail.post(Payload.RESIDUAL, layer, mb, nxt, [h_BSH, routing.topk_w_NK, routing.topk_idx_NK, *shared])
        carry = [h_BSH, routing.topk_w_NK, *shared]
        router_loss = self._router_loss(block, routing) / self.micro_batches
        self.segments[(layer, mb)] = Segment(inputs, dispatched, carry, router_loss)
        self.load_LE[layer] += routing.load_E

    def _router_loss(self, block: MoEBlock, routing: Routing) -> torch.Tensor:
        """This rank's share of the micro-batch's aux + z loss of one layer (module docstring)."""
        if self.dp == 1:
            aux, z = routing.aux_loss, routing.z_loss
        else:
            z = routing.z_loss / self.dp
            aux = routing.aux_loss
            if block.moe.router.cfg.aux_loss_coef > 0:
                load_E = routing.load_E.clone()
                dist.all_reduce(load_E, group=self.dp_group)
                aux = block.moe.router.aux_loss(routing.scores_NE, load_E) / self.dp
        self.loss_parts["aux_loss"] = self.loss_parts["aux_loss"] + aux.detach().float() / self.micro_batches
        self.loss_parts["z_loss"] = self.loss_parts["z_loss"] + z.detach().float() / self.micro_batches
        return aux.float() + z.float()

    def loss(self, mb: int, mail: Mailbox, backward: bool = True) -> None:
        """Loss(mb): the last layer's output, final norm, LM head, CE; backward at once (if asked)."""
        last = self.topology.num_layers
        x_BSH, inputs = self._previous_output(last, mb, mail)
        ce = linear_cross_entropy(self.model.norm(x_BSH).flatten(0, 1), self.model.head_weight(),
                                  self._tokens(mb)[1].flatten())
        self.loss_parts["ce"] = self.loss_parts["ce"] + ce.detach() / (self.dp * self.micro_batches)
        if backward:
            (ce / (self.dp * self.micro_batches)).backward()
            self._post_input_grads(inputs, mb, mail)

    def backward(self, layer: int, mb: int, mail: Mailbox) -> None:
        """AttentionBackward(layer, mb)."""
        segment = self.segments.pop((layer, mb))
        topo = self.topology
        outputs, grads = [], []
        for rank, rows_PH in zip(topo.expert_groups[self.group], segment.dispatched):
            outputs.append(rows_PH)
            grads.append(mail.take(Payload.DISPATCH_GRAD, layer, mb, rank)[0])
        nxt = topo.attention_rank(topo.next_group(self.group), self.dp_index)
        outputs += segment.carry
        grads += mail.take(Payload.RESIDUAL_GRAD, layer, mb, nxt)
        if segment.router_loss is not None:
            outputs.append(segment.router_loss)
            grads.append(torch.ones_like(segment.router_loss))
        live = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        if segment.inputs is not None:
            self._post_input_grads(segment.inputs, mb, mail)


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
