"""The attention side of one rank: embedding, its layers' non-expert parts, final norm, head, loss.

Each compute op of the schedule is one *segment* of autograd graph. `AttentionForward(l)` first
rebuilds layer l-1's output from what arrived (the residual stream and, after a MoE layer, one
weighted partial sum per expert rank it serves, `Topology.served`: h + sum_j partial_j (+ shared
experts)), each received
tensor a fresh leaf, then runs layer l's attention, router and shared experts and posts the
compact dispatch (DESIGN 3c: the normed token rows once per expert rank, with their top-k ids and
routing weights; `runtime.stages.messages`) and the residual stream for the next hop. The segment keeps
its outputs; `AttentionBackward(l)` calls `torch.autograd.backward(outputs, grads)` with the
gradients that came back (the expert ranks' d xn and d weights summed in rank order), and posts
its leaves' gradients to where they came from; the weight gradients of the segment's projections
(attention, shared experts, a dense layer's FFN: `model.layers.DeferrableLinear`) are held back
and returned to the worker, which runs them once those gradients are sent (DESIGN 3c: the input
gradient is the backward's critical path). Nothing here reads the device from the host.

With `hop: pair_rows` (`runtime.stages.pair_return`) a MoE layer's output is rebuilt from one pair-row
buffer instead: each (token, expert) row weighted by the routing weights, which came with the
residual stream (their gradient goes back with it), combined as segments land; its gradient dy
goes to every expert rank, and the backward sums each token's returned pair rows of d xn.

With `dispatch: sparse` (`runtime.stages.sparse_dispatch`) each expert rank gets only the tokens
it serves (their rows, its local expert ids, their weights, the token index and the count); its
partial sums come back in that order with the index and count (only those rows live) and are
added at their tokens (`scatter_sum`), and so are the gradients of the rows sent; dy goes back to
each expert rank only for the tokens it served, in its dispatch's order (COMBINE_GRAD, rebuilt
from COMBINE's index and count). By peer stores (nvshmem) no message is staged for a peer: the
routing is stashed for the send op's one launch, which stores the rows from xn (dy) itself. With
pair rows too, the top-k ids ride RESIDUAL with the weights, and the combining rank routes dy with
them as the dispatch did; d xn comes back per expert rank in its dispatch's order, as without
pair rows.

Under `recompute: full` a layer's attention half (norms, attention, router, shared experts;
`MoEBlock.attention_half`, a dense layer's whole block) is one recomputed segment: it keeps its
input and the router's choice, and runs again when its backward reaches it.

The loss matches the oracle (`runtime.training.trainer`): micro-batch m of M is split over D
data-parallel ranks; each rank backpropagates its share

    CE_local / (D M)  +  (aux_share + z_local / D) / M        per MoE layer for the router terms

where aux_share = coef E sum_e f_e P_e^(d) / D: f_e the micro-batch's load fraction over all D
ranks, P^(d) this rank's mean routing probabilities. f is not known here in the forward pass;
every expert rank returns the micro-batch's load over all D ranks with the gradients (DISPATCH_GRAD:
its sources', plus, in EP blocks or replica sets, the other blocks' it received, EXPERT_LOAD,
`Topology.load_peers`), so the aux term enters at `AttentionBackward` as the gradient
coef E f / (D M) of P^(d). No collective runs inside a forward op (DESIGN 3c's NCCL ordering).

Legend: B batch rows of this rank's piece, S sequence, H hidden, N tokens (B*S), K top-k, E experts.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from disagmoe.data import TokenDataset
from disagmoe.model import MoEBlock
from disagmoe.kernels.deferral import deferred_weight_grads
from disagmoe.model.loss import linear_cross_entropy
from disagmoe.runtime.batching import batch_rows, inputs_and_targets
from disagmoe.runtime.stages.expert_stage import LocalRouting
from disagmoe.runtime.stages.messages import Mailbox
from disagmoe.runtime.stages.sparse_dispatch import (SetRouting, dispatch_messages, dispatch_order, pick_rows,
                                                     scatter_sum, sent_tokens, staged_message)
from disagmoe.runtime.stages.pair_return import PairHop, combine_pairs, sum_pairs
from disagmoe.runtime.rank_model import RankModel
from disagmoe.wire import Payload
from disagmoe.runtime.topology import Topology


@dataclass
class LayerInput:
    """The leaves a segment starts from (layer `prev`'s output parts), for sending gradients back."""

    prev: int  # the layer whose output this is
    carry: list[torch.Tensor] = field(default_factory=list)  # residual-stream parts (leaves)
    partials: list[torch.Tensor] = field(default_factory=list)  # per expert rank of `prev`: its partial sum
    combined: torch.Tensor | None = None  # pair_rows or sparse: the combined expert output (its grad goes back)
    topk_idx_NK: torch.Tensor | None = None  # sparse pair_rows: `prev`'s routing, which routes that grad
    received: tuple[torch.Tensor, torch.Tensor] | None = None  # sparse partial sums: COMBINE's (index_QN, count_Q1)


@dataclass
class Segment:
    """One AttentionForward's graph: its inputs and the outputs whose gradients come back later."""

    inputs: LayerInput | None
    dispatched: list[torch.Tensor]  # [xn_NH, topk_w_NK] as sent to every expert rank (dense: [])
    carry: list[torch.Tensor]  # residual-stream parts sent to the next group
    z_share: torch.Tensor | None = None  # z_local / (D M)
    probs_E: torch.Tensor | None = None  # P^(d) of the aux loss (None without one)
    router: object | None = None  # the layer's Router (aux weights from the returned load)
    sent: tuple[torch.Tensor, torch.Tensor] | None = None  # sparse: (index_QT, count_Q1) of the rows sent


class AttentionStage:
    """Forward, loss and backward of the attention ops of one rank for one step at a time."""

    def __init__(self, model: RankModel, topology: Topology, rank: int, data: TokenDataset,
                 micro_batches: int, pair: PairHop | None = None, sparse: bool = False) -> None:
        """`pair`: `hop: pair_rows` with these settings (None: partial sums); `sparse`: `dispatch:
        sparse`."""
        role = topology.attention_role(rank)
        assert role is not None, f"rank {rank} runs no attention"
        self.group, self.dp_index = role
        self.model, self.topology, self.rank = model, topology, rank
        self.data, self.micro_batches = data, micro_batches
        self.dp = topology.data_parallel
        self.num_experts = model.cfg.num_experts
        self.layers = topology.attention_layers(rank)
        self.pair = pair
        self.sparse = sparse
        # sparse dispatch: per MoE layer, each expert rank of the set's routing of this source's pairs; with
        # pair rows also of the layers whose output this rank combines (the previous group's: dy goes back so)
        routed = set(self.layers)
        if pair is not None:
            routed.update(topology.layers_of_group(topology.prev_group(self.group)))
        self.routes = {layer: self._set_routing(layer) for layer in sorted(routed) if sparse and topology.is_moe(layer)}
        # pair rows: the combine waits on the GPU inside this op; the worker times it as the receive
        self.wait_span: Callable[[str], AbstractContextManager[None]] = lambda name: contextlib.nullcontext()
        self.begin_step(0)

    def _set_routing(self, layer: int) -> SetRouting:
        """This source's pairs of `layer` mapped to each expert rank it serves (`_served_ranks`)."""
        group = self.topology.expert_groups[self.topology.group_of_layer(layer)]
        return SetRouting([LocalRouting(self.topology, layer, group.index(rank), self.dp_index, self.dp,
                                        self.model.device) for rank in self._served_ranks(layer)])

    def _served_ranks(self, layer: int) -> tuple[int, ...]:
        """The expert ranks this rank dispatches MoE layer `layer` to and hears back from."""
        return self.topology.served(layer, self.dp_index)

    def begin_step(self, step: int, data: TokenDataset | None = None, staged: bool = False) -> None:
        """Start step `step` of `data` (default: the training data); forgets the previous step.
        `staged`: its tokens are already in the static buffer (`stage_tokens`), which the step reads
        (a captured step reads them there on every replay)."""
        self.step = step
        self.batch_data = self.data if data is None else data
        self.segments: dict[tuple[int, int], Segment] = {}
        device = self.model.device
        zero = torch.zeros((), dtype=torch.float32, device=device)
        self.loss_parts = {"ce": zero, "aux_loss": zero, "z_loss": zero}  # this rank's shares, on the device
        self.load_LE = {layer: torch.zeros(self.num_experts, dtype=torch.int64, device=device)
                        for layer in self.layers if self.topology.is_moe(layer)}
        self._step_tokens = self.static_tokens_MBS1 if staged else self._load_tokens() if self._reads_tokens() else None

    def stage_tokens(self, step: int) -> None:
        """Copy training step `step`'s tokens into the static buffer `static_tokens_MBS1` (made at
        the first call: an eager step's), outside any captured step; a rank that reads no tokens
        keeps None there."""
        if not self._reads_tokens():
            self.static_tokens_MBS1 = None
            return
        self.step, self.batch_data = step, self.data
        tokens_MBS1 = self._load_tokens()
        if getattr(self, "static_tokens_MBS1", None) is None:
            self.static_tokens_MBS1 = tokens_MBS1  # its own tensor: later steps copy into it
        else:
            self.static_tokens_MBS1.copy_(tokens_MBS1, non_blocking=True)

    # -- the data --------------------------------------------------------------------------------

    def _reads_tokens(self) -> bool:
        """The embedding's group (layer 0) and the head's (the loss) read the step's tokens."""
        return self.group in (0, self.topology.head_group)

    def _load_tokens(self) -> torch.Tensor:
        """This rank's rows of every micro-batch of the step, int64 [M, b, S + 1], copied to the
        device at the step's start, from pinned memory without the host waiting (a pageable copy
        would wait for the GPU's queue inside the step)."""
        pieces = [self.batch_data.rows(self.step, batch_rows(self.data.batch_size, self.micro_batches, self.dp,
                                                              mb, self.dp_index))
                  for mb in range(self.micro_batches)]
        tokens_MBS1 = torch.stack(pieces)
        device = self.model.device
        if device.type == "cuda":
            return tokens_MBS1.pin_memory().to(device, non_blocking=True)
        return tokens_MBS1

    def _tokens(self, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        return inputs_and_targets(self._step_tokens[micro_batch])

    # -- receiving the previous layer ------------------------------------------------------------

    def _previous_output(self, layer: int, mb: int, mail: Mailbox) -> tuple[torch.Tensor, LayerInput]:
        """Layer `layer - 1`'s output rebuilt from received parts (each a leaf)."""
        topo, prev = self.topology, layer - 1
        source = topo.attention_rank(topo.group_of_layer(prev), self.dp_index)
        received = mail.take(Payload.RESIDUAL, prev, mb, source)
        with_ids = self.pair is not None and self.sparse and topo.is_moe(prev)
        ids_NK = received.pop() if with_ids else None  # the top-k ids: no gradient goes back for them
        parts = [t.detach().requires_grad_() for t in received]
        inputs = LayerInput(prev, carry=parts, topk_idx_NK=ids_NK)
        if not topo.is_moe(prev):
            return parts[0], inputs
        experts = self._served_ranks(prev)
        if self.pair is not None:  # pair rows, weighted by the weights that came with h
            h_BSH, *shared, w_NK = parts
            with self.wait_span(f"Recv {Payload.COMBINE.value} L{prev} mb{mb}"):  # waits and combines
                ffn_NH = combine_pairs(mail.landing(Payload.COMBINE, prev, mb), w_NK, self.pair.segment_tokens,
                                       self.pair.combine_programs(self.model.device))
            if ffn_NH.requires_grad:
                ffn_NH.retain_grad()
            inputs.combined = ffn_NH
        elif self.sparse:  # each rank's partial sums of the tokens it received, added at their tokens
            replies = [mail.take(Payload.COMBINE, prev, mb, r) for r in experts]
            h_BSH, *shared = parts
            inputs.received = (torch.stack([r[1] for r in replies]), torch.stack([r[2] for r in replies]))
            inputs.combined = ffn_NH = scatter_sum([r[0] for r in replies], *inputs.received).requires_grad_()
        else:
            replies = [mail.take(Payload.COMBINE, prev, mb, r) for r in experts]
            inputs.partials = [reply[0].detach().requires_grad_() for reply in replies]
            h_BSH, *shared = parts
            ffn_NH = _rank_sum(inputs.partials)
        if shared:
            ffn_NH = ffn_NH + shared[0]
        return h_BSH + ffn_NH.view_as(h_BSH), inputs

    def _post_input_grads(self, inputs: LayerInput, mb: int, mail: Mailbox) -> None:
        topo, prev = self.topology, inputs.prev
        if topo.is_moe(prev):
            experts = self._served_ranks(prev)
            if self.sparse:  # dy of the tokens each expert rank served
                self._post_routed_grad(prev, mb, mail, _grad(inputs.combined), self._served(inputs))
            else:  # pair rows: every expert rank gets dy and forms its w dy; partial sums: each its own
                grads = ([_grad(inputs.combined)] * len(experts) if inputs.combined is not None
                         else [_grad(leaf) for leaf in inputs.partials])
                for rank, grad in zip(experts, grads, strict=True):
                    mail.post(Payload.COMBINE_GRAD, prev, mb, rank, [grad])
        source = topo.attention_rank(topo.group_of_layer(prev), self.dp_index)
        mail.post(Payload.RESIDUAL_GRAD, prev, mb, source, [_grad(leaf) for leaf in inputs.carry])

    def _served(self, inputs: LayerInput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(picked_QN, index_QN, count_Q1) of the dispatch of `inputs.prev` that this rank combined,
        on the device: with pair rows from the routing that rode RESIDUAL (`sparse_dispatch.
        dispatch_order`, as the dispatch ran it), with partial sums from the index and count that
        came with COMBINE (`sent_tokens`, `pick_rows`: the same order)."""
        if inputs.received is None:
            route = self.routes[inputs.prev]
            return dispatch_order(route(inputs.topk_idx_NK), route.num_local_Q)
        picked_QN = sent_tokens(*inputs.received)
        return picked_QN, *pick_rows(picked_QN)

    def _post_routed_grad(self, layer: int, mb: int, mail: Mailbox, dy_NH: torch.Tensor,
                          served: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """COMBINE_GRAD of a sparse layer: to each expert rank of its set only the dy rows of the
        tokens it served, in its dispatch's order (`served`: `_served`), the first count rows live.
        By peer stores the send op's one launch stores them from dy (no gather); a colocated
        rank's own message is posted."""
        ranks = self._served_ranks(layer)
        picked_QN, index_QN, count_Q1 = served
        if mail.peer_stores and any(rank != self.rank for rank in ranks):  # the send op's, for its peers
            mail.stash((Payload.COMBINE_GRAD, layer, mb), (dy_NH, picked_QN, count_Q1, tuple(ranks)))
        for q, rank in enumerate(ranks):
            if rank == self.rank or not mail.peer_stores:
                mail.post(Payload.COMBINE_GRAD, layer, mb, rank, [dy_NH[index_QN[q]]], count=count_Q1[q])

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
            self.segments[(layer, mb)] = Segment(inputs, [], [out_BSH])
            return
        h_BSH, routing, shared_NH, probs_E = block.attention_half(x_BSH)  # `recompute: full`: one recomputed segment
        ranks = self._served_ranks(layer)
        posts = {rank: [routing.xn_NH, routing.topk_idx_NK.to(torch.int32), routing.topk_w_NK] for rank in ranks}
        sent = None
        if self.sparse:  # to each rank only the tokens it serves (`runtime.stages.sparse_dispatch`)
            route = self.routes[layer]
            local_QNK = route(routing.topk_idx_NK)
            if mail.peer_stores:  # the send op's one launch stores the picked rows (`NvshmemTransport.send_sparse`):
                # no message is staged for a peer (no gather, no [T, H] buffer); a colocated rank's own one only
                picked_QN, index_QN, count_Q1 = dispatch_order(local_QNK, route.num_local_Q)
                if any(rank != self.rank for rank in ranks):
                    mail.stash((Payload.DISPATCH, layer, mb), (routing.xn_NH.detach(), picked_QN, local_QNK,
                                                               routing.topk_w_NK.detach(), routing.load_E, count_Q1,
                                                               tuple(ranks)))
                posts = {rank: staged_message(routing.xn_NH, local_QNK, routing.topk_w_NK, routing.load_E, index_QN,
                                              count_Q1, q) for q, rank in enumerate(ranks) if rank == self.rank}
            else:
                messages, index_QN, count_Q1 = dispatch_messages(routing.xn_NH, local_QNK, route.num_local_Q,
                                                                 routing.topk_w_NK, routing.load_E)
                posts = dict(zip(ranks, messages, strict=True))
            sent = (index_QN, count_Q1)
        for q, rank in enumerate(ranks):
            if rank in posts:
                mail.post(Payload.DISPATCH, layer, mb, rank, posts[rank], count=None if sent is None else sent[1][q])
        carry = [h_BSH] + ([] if shared_NH is None else [shared_NH])
        dispatched = [routing.xn_NH, routing.topk_w_NK]
        ids = []
        if self.pair is not None:  # the weights travel to where the pair rows are combined (sparse: the ids too)
            carry.append(routing.topk_w_NK)
            dispatched = [routing.xn_NH]
            ids = [routing.topk_idx_NK.to(torch.int32)] if self.sparse else []
        mail.post(Payload.RESIDUAL, layer, mb, nxt, carry + ids)
        router = block.moe.router
        segment = Segment(inputs, dispatched, carry, router=router, sent=sent)
        if router.cfg.z_loss_coef > 0:
            segment.z_share = routing.z_loss.float() / (self.dp * self.micro_batches)
            self.loss_parts["z_loss"] = self.loss_parts["z_loss"] + segment.z_share.detach()
        segment.probs_E = probs_E
        self.segments[(layer, mb)] = segment
        self.load_LE[layer] += routing.load_E

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

    def backward(self, layer: int, mb: int, mail: Mailbox) -> list[Callable[[], None]]:
        """AttentionBackward(layer, mb): posts the input gradients; returns the weight-gradient work
        held back, for the worker to run once it has sent them."""
        segment = self.segments.pop((layer, mb))
        topo = self.topology
        outputs, grads = [], []
        if segment.dispatched:
            if self.pair is not None and not self.sparse:  # d xn: each token's pair rows summed; the load beside
                landing = mail.landing(Payload.DISPATCH_GRAD, layer, mb)
                outputs.append(segment.dispatched[0])
                with self.wait_span(f"Recv {Payload.DISPATCH_GRAD.value} L{layer} mb{mb}"):
                    grads.append(sum_pairs(landing, self.model.cfg.top_k, self.pair.segment_tokens,
                                           self.pair.combine_programs(self.model.device)))
                load_E = landing.extras[0]
            else:
                replies = [mail.take(Payload.DISPATCH_GRAD, layer, mb, rank) for rank in self._served_ranks(layer)]
                for i, leaf in enumerate(segment.dispatched):  # d xn, d weights: summed over the expert ranks
                    parts = [reply[i] for reply in replies]
                    outputs.append(leaf)
                    grads.append(scatter_sum(parts, *segment.sent) if self.sparse else _rank_sum(parts))
                load_E = replies[0][-1]
            if segment.probs_E is not None:  # the aux term, now that the micro-batch's load is known
                weights_E = segment.router.aux_weights(load_E) / (self.dp * self.micro_batches)
                outputs.append(segment.probs_E)
                grads.append(weights_E)
                self.loss_parts["aux_loss"] = self.loss_parts["aux_loss"] + (weights_E * segment.probs_E.detach()).sum()
            if segment.z_share is not None:
                outputs.append(segment.z_share)
                grads.append(torch.ones_like(segment.z_share))
        nxt = topo.attention_rank(topo.next_group(self.group), self.dp_index)
        outputs += segment.carry
        grads += mail.take(Payload.RESIDUAL_GRAD, layer, mb, nxt)
        live = [(o, g) for o, g in zip(outputs, grads, strict=True) if o.requires_grad]
        with deferred_weight_grads() as held:
            torch.autograd.backward([o for o, _ in live], [g for _, g in live])
        if segment.inputs is not None:
            self._post_input_grads(segment.inputs, mb, mail)
        return held


def _rank_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """The expert ranks' parts added in rank order (the same sum on every run)."""
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
