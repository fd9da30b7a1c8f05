"""The expert side of one rank: its routed experts of every MoE layer of its group.

`ExpertForward(l)` takes, from each attention rank d of the group that it serves (its sources:
`Topology.sources_of`, the whole group but with replica sets or EP blocks), the compact dispatch (the
layer's normed token rows once, their top-k expert ids and routing weights; `runtime.stages.messages`),
maps every (token, k) pair to the local expert that serves it here or to "elsewhere"
(`LocalRouting`), runs all its experts once over every source's tokens and posts to attention rank
d of the next group one weighted partial sum per token (`model.local_experts`).
`ExpertBackward(l)` backpropagates the partial sums' gradients that came back and posts each
source its d xn and d routing weights, with the micro-batch's expert load (the attention ranks
need it for the aux loss's gradient): over its sources, and where the run needs the load over
every source (`RouterConfig.needs_every_source_load`) and the group serves in blocks, plus the
other blocks' loads, which their ranks at its position sent (EXPERT_LOAD, `Topology.load_peers`;
ExpertForward posts its own for them); with the triton backend the weight
gradients are held back (`kernels.deferral.deferred_weight_grads`) and returned to the worker, which
runs them once it has sent those, so the input gradients leave before the weight gradients are
computed. Nothing reads the device from the host.

With `hop: pair_rows` (`runtime.stages.pair_return`) the expert ops write their rows into the receivers'
pair-row buffers instead of posting messages: ExpertForward stores each served (token, expert)
row into the next group's attention rank's buffer, ExpertBackward each pair's d x into the
source's (the load beside it), one launch pair per source; the worker aims them first.

With `dispatch: sparse` (`runtime.stages.sparse_dispatch`) a source sends only the tokens this rank
serves, already mapped to its local experts (the sender ran this rank's `LocalRouting` over its
whole token order), with their token index, the count and the source's expert load; the rows past
the count are padding, never computed; the partial sums of the received rows go back in that
order with the index and count (by peer stores one launch for every source, only the first
count rows), the gradients of the received rows likewise (one leaf of all sources' rows, so their
gradients are one buffer: by peer stores one launch returns them all); COMBINE_GRAD comes in the
dispatch's order, its rows past the count never used.
With pair rows too, each received row's pairs go to its token's pair rows (`sparse_dispatch.
received_order`), COMBINE_GRAD comes in the dispatch's order, and d xn goes back per source in it
(not as pair rows), the load beside.

Replicated experts (a plan's hot experts): the attention rank of data-parallel index d (of D)
sends its pairs of an expert with n owners to owner d mod n when D >= n, and splits them in token
order over owners d, d + D, ... when D < n (`plan_layout.replica_rows`); every owner receives the
whole dispatch of a source that feeds it and keeps exactly its share, computed on the device from
the counts.

Legend: D data-parallel sources, N tokens per source, K top-k, E experts of the layer, L local.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from disagmoe.model.dispatch import expert_counts
from disagmoe.kernels.deferral import deferred_weight_grads
from disagmoe.model.local_experts import local_expert_block
from disagmoe.runtime.stages.messages import Mailbox
from disagmoe.runtime.stages.pair_return import PairHop, PairRows, expert_pair_rows, expert_pair_rows_backward
from disagmoe.runtime.stages.sparse_dispatch import received_locals, received_order, valid_rows
from disagmoe.runtime.plan_layout import fed_replicas
from disagmoe.runtime.rank_model import RankModel
from disagmoe.wire import Payload
from disagmoe.runtime.topology import Topology


class LocalRouting:
    """Which of one source's (token, k) pairs this rank serves, for one layer (module docstring).

    Per expert e: `local_E[e]` its local index here (L = elsewhere); where this rank holds one of
    several replicas that split the source's rows, `parts_E[e]` (how many owners share them) and
    `part_E[e]` (which share is ours), else 1 and 0.
    """

    def __init__(self, topology: Topology, layer: int, index: int, dp_index: int, dp: int,
                 device: torch.device) -> None:
        owners = topology.expert_owners[layer]
        held = [e for e, who in enumerate(owners) if index in who]
        self.num_local = len(held)
        local, parts, part = [self.num_local] * len(owners), [1] * len(owners), [0] * len(owners)
        for i, e in enumerate(held):
            who = owners[e]
            r = who.index(index)
            mine = fed_replicas(len(who), dp_index, dp)  # the owners this source feeds
            if r in mine:
                local[e], parts[e], part[e] = i, len(mine), mine.index(r)
        self.split = any(p > 1 for p in parts)
        as_tensor = lambda v: torch.tensor(v, dtype=torch.int32, device=device)  # noqa: E731
        self.local_E, self.parts_E, self.part_E = as_tensor(local), as_tensor(parts), as_tensor(part)

    def __call__(self, topk_idx_NK: torch.Tensor) -> torch.Tensor:
        """int32 [N, K]: the local expert serving each pair, or L."""
        idx_NK = topk_idx_NK.long()
        local_NK = self.local_E[idx_NK]
        if not self.split:
            return local_NK
        flat_P = idx_NK.reshape(-1)
        order_P = torch.argsort(flat_P, stable=True)  # the sender's row order within each expert
        counts_E = expert_counts(idx_NK, self.local_E.numel())
        starts_E = torch.cumsum(counts_E, 0) - counts_E
        position_P = torch.empty_like(order_P).scatter_(
            0, order_P, torch.arange(flat_P.numel(), device=flat_P.device) - starts_E[flat_P[order_P]])
        parts_E, part_E = self.parts_E.long(), self.part_E.long()
        base_E, extra_E = counts_E // parts_E, counts_E % parts_E  # `replica_shares`: earlier parts one more
        lo_E = part_E * base_E + torch.minimum(part_E, extra_E)
        hi_E = lo_E + base_E + (part_E < extra_E).long()
        ours_P = (position_P >= lo_E[flat_P]) & (position_P < hi_E[flat_P])
        return torch.where(ours_P.view_as(idx_NK), local_NK, self.num_local).to(torch.int32)


@dataclass
class ExpertSegment:
    inputs: list[torch.Tensor]  # leaves per source: xn rows, then routing weights (sparse: one of each)
    outputs: list[torch.Tensor]  # the partial sums per destination
    load_E: torch.Tensor  # the micro-batch's expert load over its sources (+ the other blocks', once summed)
    pairs: list[PairRows] | None = None  # pair_rows: per source, what its backward needs
    counts: list[torch.Tensor] | None = None  # sparse: per source, the count of rows it sent (int32 [1])
    unsummed: tuple[int, ...] = ()  # the load peers whose block loads are not yet in load_E


class ExpertStage:
    """Forward and backward of the expert ops of one rank."""

    def __init__(self, model: RankModel, topology: Topology, rank: int,
                 pair: PairHop | None = None, tokens: int = 0, sparse: bool = False) -> None:
        """`pair`: `hop: pair_rows` with these settings, for sources of `tokens` tokens (None:
        partial sums); `sparse`: `dispatch: sparse`."""
        role = topology.expert_role(rank)
        assert role is not None, f"rank {rank} holds no experts"
        self.group, index = role
        self.model, self.topology, self.rank = model, topology, rank
        here, nxt = topology.attention_groups[self.group], topology.attention_groups[topology.next_group(self.group)]
        indices = {layer: topology.sources_of(layer, rank) for layer in topology.experts_of(rank)}
        # per MoE layer: the attention ranks whose dispatch comes here, and where each one's outputs go
        self.sources = {layer: tuple(here[d] for d in ds) for layer, ds in indices.items()}
        self.destinations = {layer: tuple(nxt[d] for d in ds) for layer, ds in indices.items()}
        self.routing = {layer: [LocalRouting(topology, layer, index, d, topology.data_parallel, model.device)
                                for d in ds] for layer, ds in indices.items()}
        self.load_peers = {layer: topology.load_peers(layer, rank) for layer in indices}
        self.segments: dict[tuple[int, int], ExpertSegment] = {}
        self.pair = pair
        self.sparse = sparse
        if pair is not None:  # the down GEMM's per-segment store counts (zero between launches)
            self.pair_counters_S = torch.zeros(-(-tokens // pair.segment_tokens), dtype=torch.int32,
                                               device=model.device)

    def begin_step(self) -> None:
        self.segments = {}  # an evaluation pass leaves its forward segments behind

    def forward(self, layer: int, mb: int, mail: Mailbox) -> None:
        """ExpertForward(layer, mb)."""
        messages = [mail.take(Payload.DISPATCH, layer, mb, src) for src in self.sources[layer]]
        if self.pair is not None:
            return self._forward_pairs(layer, mb, mail, messages)
        if self.sparse:  # the sender mapped the pairs to local experts; padding rows serve none
            # one leaf of every source's rows (and one of weights): their gradients are one [D N, H] buffer,
            # each source's rows a view of it, returned in one launch on nvshmem (`_post_dispatch_grads`)
            xs = [_cat([xn_NH for xn_NH, *_ in messages]).detach().requires_grad_()]
            ws = [_cat([w_NK for _, _, w_NK, *_ in messages]).detach().requires_grad_()]
            num_local = self.routing[layer][0].num_local
            local_TK = _cat([received_locals(local_NK, count_1, num_local)
                             for _, local_NK, _, _, count_1, _ in messages])
        else:
            xs = [xn_NH.detach().requires_grad_() for xn_NH, *_ in messages]
            ws = [w_NK.detach().requires_grad_(w_NK.is_floating_point()) for _, _, w_NK, *_ in messages]
            local_TK = _cat([route(idx_NK) for route, (_, idx_NK, _) in zip(self.routing[layer], messages, strict=True)])
        partial_TH = local_expert_block(_cat(xs), local_TK, _cat(ws), self.model.experts(layer))
        N = messages[0][0].shape[0]
        outputs = list(partial_TH.split(N))
        counts = [message[4] for message in messages] if self.sparse else None
        if self.sparse:
            self._post_combine(layer, mb, mail, partial_TH.view(len(messages), N, -1), messages)
        else:
            for dst, partial_NH in zip(self.destinations[layer], outputs, strict=True):
                mail.post(Payload.COMBINE, layer, mb, dst, [partial_NH])
        self.segments[(layer, mb)] = ExpertSegment(xs + ws, outputs, self._block_load(layer, mb, mail, messages),
                                                   counts=counts, unsummed=self.load_peers[layer])

    def _post_combine(self, layer: int, mb: int, mail: Mailbox, partial_DNH: torch.Tensor, messages) -> None:
        """Sparse dispatch's COMBINE with partial sums: each source's partial sums of the rows it
        sent, in their received order, with the token index and count it sent (only the first count
        rows live). Over send/recv one message per destination (the next group's attention rank of
        the source's data-parallel index); by peer stores (nvshmem) the send op's one launch stores
        the first count rows of each block and of its index (`NvshmemTransport.send_counted`), so
        only a colocated rank's own message is posted."""
        index_DN = _stack([message[3] for message in messages])
        count_D1 = _stack([message[4] for message in messages])
        destinations = self.destinations[layer]
        if mail.peer_stores and any(dst != mail.rank for dst in destinations):  # the send op's, for its peers
            mail.stash((Payload.COMBINE, layer, mb), (partial_DNH, index_DN, count_D1, destinations))
        for d, dst in enumerate(destinations):
            if dst == mail.rank or not mail.peer_stores:
                mail.post(Payload.COMBINE, layer, mb, dst, [partial_DNH[d], index_DN[d], count_D1[d]],
                          count=count_D1[d])

    def backward(self, layer: int, mb: int, mail: Mailbox) -> list[Callable[[], None]]:
        """ExpertBackward(layer, mb): the input gradients now; returns the weight-gradient work
        held back (the triton backend with fp32 main gradients; else none), for the worker to
        run once it has sent these."""
        self.sum_block_loads(layer, mb, mail)
        segment = self.segments.pop((layer, mb))
        sources = self.sources[layer]
        grads = [mail.take(Payload.COMBINE_GRAD, layer, mb, dst)[0] for dst in self.destinations[layer]]
        if segment.pairs is not None:  # d x returns as pair rows with the load (`runtime.stages.pair_return`);
            with deferred_weight_grads() as held:  # sparse: into the leaves, then per source
                for saved, dy_NH, src in zip(segment.pairs, grads, sources, strict=True):
                    target = None if self.sparse else mail.target(Payload.DISPATCH_GRAD, layer, mb, src)
                    expert_pair_rows_backward(saved, dy_NH, target, self.pair_counters_S, self.pair.segment_tokens)
            if self.sparse:
                x_leaves = segment.inputs[:len(sources)]
                self._post_dispatch_grads(layer, mb, mail, segment, _stack([_grad(x) for x in x_leaves]))
            return held
        if self.sparse:  # the rows past a source's count: whatever a peer store left there, never used
            grads = [torch.where(valid_rows(count_1, dy_NH.shape[0])[:, None], dy_NH, 0)
                     for dy_NH, count_1 in zip(grads, segment.counts, strict=True)]
        with deferred_weight_grads() as held:
            torch.autograd.backward(segment.outputs, grads)
        D = len(sources)
        if self.sparse:  # one leaf of rows, one of weights: each source's gradient a view
            dx_SH, dw_SK = (_grad(leaf) for leaf in segment.inputs)
            self._post_dispatch_grads(layer, mb, mail, segment, dx_SH.view(D, -1, dx_SH.shape[1]),
                                      dw_SK.view(D, -1, dw_SK.shape[1]))
            return held
        for d, src in enumerate(sources):
            x_leaf, w_leaf = segment.inputs[d], segment.inputs[D + d]
            mail.post(Payload.DISPATCH_GRAD, layer, mb, src, [_grad(x_leaf), _grad(w_leaf), segment.load_E])
        return held

    def _post_dispatch_grads(self, layer: int, mb: int, mail: Mailbox, segment: ExpertSegment,
                             dx_DNH: torch.Tensor, dw_DNK: torch.Tensor | None = None) -> None:
        """Sparse dispatch: d x (and d w; none with pair rows, whose weights' gradient forms where
        they combine) of every source's received rows, in source order (views of one leaf's
        gradient where the sources' rows are one leaf). Over send/recv one message per source; by
        peer stores (nvshmem) the send op's one launch returns the first count rows of each
        source's block (`NvshmemTransport.send_counted`), so only a colocated rank's own message
        is posted."""
        sources = self.sources[layer]
        if mail.peer_stores and any(src != mail.rank for src in sources):  # the send op's, for its peers
            mail.stash((Payload.DISPATCH_GRAD, layer, mb), (dx_DNH, dw_DNK, torch.stack(segment.counts),
                                                             segment.load_E, sources))
        for d, src in enumerate(sources):
            if src == mail.rank or not mail.peer_stores:
                dw = [] if dw_DNK is None else [dw_DNK[d]]
                mail.post(Payload.DISPATCH_GRAD, layer, mb, src, [dx_DNH[d], *dw, segment.load_E],
                          count=segment.counts[d])
    def _block_load(self, layer: int, mb: int, mail: Mailbox, messages) -> torch.Tensor:
        """The micro-batch's expert load over its sources' dispatches (int64 [E]), posted to the
        other blocks' ranks at this rank's position (`load_peers`; their Send is the backward's)."""
        if self.sparse:  # each source's own load came with its rows
            load_E = sum(message[5] for message in messages)
        else:
            load_E = sum(expert_counts(idx_NK.long(), self.model.cfg.num_experts) for _, idx_NK, _ in messages)
        for peer in self.load_peers[layer]:
            mail.post(Payload.EXPERT_LOAD, layer, mb, peer, [load_E])
        return load_E

    def sum_block_loads(self, layer: int, mb: int, mail: Mailbox) -> None:
        """Add the other blocks' loads of (layer, mb), received, to this block's (once: a new
        tensor, as the block's own may still be in flight to them), so the load returned with
        DISPATCH_GRAD is the micro-batch's over every source of the group."""
        segment = self.segments[(layer, mb)]
        if segment.unsummed:
            peers_E = [mail.take(Payload.EXPERT_LOAD, layer, mb, peer)[0] for peer in segment.unsummed]
            segment.load_E = segment.load_E + sum(peers_E)
            segment.unsummed = ()

    def load_of(self, layer: int, mb: int, mail: Mailbox) -> torch.Tensor:
        """The micro-batch's expert load (int64 [E]) its backward returns (`sum_block_loads`)."""
        self.sum_block_loads(layer, mb, mail)
        return self.segments[(layer, mb)].load_E

    def _forward_pairs(self, layer: int, mb: int, mail: Mailbox, messages) -> None:
        """ExpertForward with `hop: pair_rows`: one launch pair per source, its rows stored into its
        destination's pair-row buffer (`runtime.stages.pair_return`); the weights' gradient is formed on
        the attention side. Sparse: the received rows' pairs at their tokens' pair rows."""
        xs = [message[0].detach().requires_grad_() for message in messages]
        ws = [message[2].detach() for message in messages]
        experts = self.model.experts(layer)
        pairs = []
        for route, dst, x_leaf, message, w_NK in zip(self.routing[layer], self.destinations[layer], xs, messages, ws,
                                                     strict=True):
            local_NK, token_N = self._pair_routing(route, message)
            pairs.append(expert_pair_rows(x_leaf, local_NK, w_NK, experts,
                                          mail.target(Payload.COMBINE, layer, mb, dst), self.pair_counters_S,
                                          self.pair.segment_tokens, bands=self.pair.bands, token_T=token_N))
        load_E = self._block_load(layer, mb, mail, messages)
        counts = [message[4] for message in messages] if self.sparse else None
        self.segments[(layer, mb)] = ExpertSegment(xs + ws, [], load_E, pairs, counts, self.load_peers[layer])

    def _pair_routing(self, route: LocalRouting, message: list[torch.Tensor]) -> tuple[torch.Tensor,
                                                                                        torch.Tensor | None]:
        """(local_NK, token_N) of one source's DISPATCH: each pair's local expert (or L) and, sparse,
        each received row's token on the source (None: row t is token t)."""
        if not self.sparse:
            return route(message[1]), None
        _, local_NK, _, index_N, count_1, _ = message
        return received_locals(local_NK, count_1, route.num_local), received_order(index_N, count_1)


def _cat(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The sources' rows in source order (one source: itself, no copy)."""
    return tensors[0] if len(tensors) == 1 else torch.cat(tensors)


def _stack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[D, ...]: the sources' tensors stacked in source order (one source: a view, no copy)."""
    return tensors[0][None] if len(tensors) == 1 else torch.stack(tensors)


def _grad(leaf: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(leaf) if leaf.grad is None else leaf.grad
