"""Sparse dispatch (`dispatch: sparse`): a token travels to an expert rank only if that rank serves
at least one of its top-k pairs, once per rank however many it serves; the messages'
specs are in `runtime.stages.messages`.

Sender (attention rank d): each expert rank q's `LocalRouting` for source d maps each pair to a
local expert of q or to L (elsewhere; replica splits included, computed on the sender's whole
token order), for all Q ranks in one gather where none splits (`SetRouting`); the tokens with a
pair < L are q's. Their positions come from a prefix sum on the device (`pick_rows`, all ranks at
once): the picked tokens first, in token order, then the others, so each message is a
permutation of the dense one whose first `count` rows are the tokens sent. Nothing is read back
to the host and nothing is allocated from a count: the buffers have the worst case's T rows.
By peer stores (nvshmem) the sender gathers nothing (`dispatch_order`: [Q, T] only; the kernel
reads xn), but a colocated rank's own message (`staged_message`).

Receiver: rows at or past `count` are never read (`received_locals` marks their pairs L; the
combine masks them), so a transport that moves only the first `count` rows (a one-sided put) is
as correct as one moving the whole buffer. Expert ranks return the partial sums of the rows they
received, in the dispatch's order, with its token index; the attention rank scatters them back
(`unpermute`), and the gradients of rows sent (d x, d w) back the same way. With pair rows the
expert rank stores each received row's pairs at its token's pair rows (`received_order`), and
COMBINE_GRAD comes to it in its dispatch's order, routed by the combining attention rank with the
same `SetRouting` and `dispatch_order` over the top-k ids that rode RESIDUAL.

Legend: Q expert ranks of the set, T tokens of the source, H hidden, K top-k, E experts of the layer,
L local experts (of one rank), X a row's width.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SetRouting:
    """One source's pairs mapped to every expert rank of its set for one layer: each rank's
    `LocalRouting` (expert_stage), in one gather where no rank splits a replicated expert's rows."""

    def __init__(self, routes: list) -> None:
        self.routes = list(routes)
        device = self.routes[0].local_E.device
        self.num_local_Q = torch.tensor([r.num_local for r in self.routes], dtype=torch.int32, device=device)
        self.local_QE = None if any(r.split for r in self.routes) else torch.stack([r.local_E for r in self.routes])

    def __call__(self, topk_idx_TK: torch.Tensor) -> torch.Tensor:
        """int32 [Q, T, K]: each pair's local expert on rank q, or that rank's L."""
        if self.local_QE is not None:
            return self.local_QE[:, topk_idx_TK.long()]
        return torch.stack([route(topk_idx_TK) for route in self.routes])


def pick_rows(picked_QT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index_QT int64, count_Q1 int64), along the last dimension: a permutation of the T tokens
    with the `picked` ones first, in token order, then the rest in token order; count = how many
    are picked. Prefix sums on the device, no host read."""
    T = picked_QT.shape[-1]
    position_T = torch.arange(T, device=picked_QT.device)
    if T == 0:
        return position_T.expand_as(picked_QT), torch.zeros((*picked_QT.shape[:-1], 1), dtype=torch.int64,
                                                              device=picked_QT.device)
    upto_QT = torch.cumsum(picked_QT.to(torch.int64), -1)  # picked tokens up to and including t
    count_Q1 = upto_QT[..., -1:]
    slot_QT = torch.where(picked_QT, upto_QT - 1, count_Q1 + position_T - upto_QT)
    return torch.empty_like(slot_QT).scatter_(-1, slot_QT, position_T.expand_as(slot_QT)), count_Q1


def dispatch_order(local_QTK: torch.Tensor,
                   num_local_Q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(picked_QT bool, index_QT int64, count_Q1 int64) of one source's sparse dispatch: which
    tokens each expert rank q serves (`local_QTK`: their routing, `SetRouting`) and their order
    there (`pick_rows`). [Q, T] only: no row is gathered."""
    Q = local_QTK.shape[0]
    picked_QT = (local_QTK < num_local_Q.view(Q, 1, 1)).any(2)
    return picked_QT, *pick_rows(picked_QT)


def staged_message(xn_TH: torch.Tensor, local_QTK: torch.Tensor, w_TK: torch.Tensor, load_E: torch.Tensor,
                   index_QT: torch.Tensor, count_Q1: torch.Tensor, q: int) -> list[torch.Tensor]:
    """Expert rank q's sparse DISPATCH tensors (module docstring), gathered in its dispatch order:
    a worst-case [T, H] buffer, what send/recv moves (and a colocated rank hands itself)."""
    T, K = local_QTK.shape[1:]
    index_T = index_QT[q]
    return [xn_TH.detach()[index_T], local_QTK[q].gather(0, index_T[:, None].expand(T, K)).to(torch.int32),
            w_TK.detach()[index_T], index_T.to(torch.int32), count_Q1[q].to(torch.int32), load_E]


def dispatch_messages(xn_TH: torch.Tensor, local_QTK: torch.Tensor, num_local_Q: torch.Tensor, w_TK: torch.Tensor,
                      load_E: torch.Tensor) -> tuple[list[list[torch.Tensor]], torch.Tensor, torch.Tensor]:
    """The sparse DISPATCH tensors for each expert rank q of the set (`local_QTK`: their routing
    of this source's pairs, `SetRouting`), and (index_QT, count_Q1) for the way back. Detached:
    the gradients come back through `unpermute`. (The nvshmem path builds none of them for a peer:
    its kernel stores the rows itself, `AttentionStage.forward`.)"""
    Q, T, K = local_QTK.shape
    _, index_QT, count_Q1 = dispatch_order(local_QTK, num_local_Q)
    rows_QTH = xn_TH.detach()[index_QT]
    sent_QTK = local_QTK.gather(1, index_QT[:, :, None].expand(Q, T, K)).to(torch.int32)
    w_QTK = w_TK.detach()[index_QT]
    index32_QT, count32_Q1 = index_QT.to(torch.int32), count_Q1.to(torch.int32)
    messages = [[rows_QTH[q], sent_QTK[q], w_QTK[q], index32_QT[q], count32_Q1[q], load_E] for q in range(Q)]
    return messages, index_QT, count_Q1


def valid_rows(count_1: torch.Tensor, rows: int) -> torch.Tensor:
    """bool [..., rows]: the rows before `count` (the message's sent rows)."""
    return torch.arange(rows, device=count_1.device) < count_1


def received_locals(local_TK: torch.Tensor, count_1: torch.Tensor, num_local: int) -> torch.Tensor:
    """The received local ids with every pair of a padding row (at or past `count`) marked L."""
    return torch.where(valid_rows(count_1, local_TK.shape[0])[:, None], local_TK, num_local)


def live_index(index_QT: torch.Tensor, count_Q1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid_QT bool, index_QT int64) along the last dimension: the rows before the count, and
    the index there (0 past it, whatever a peer store left: stale, or garbage never written), so
    a gather or scatter through it stays in range and reads nothing past the count."""
    valid_QT = valid_rows(count_Q1, index_QT.shape[-1])
    return valid_QT, torch.where(valid_QT, index_QT.long(), 0)


def sent_tokens(index_QT: torch.Tensor, count_Q1: torch.Tensor) -> torch.Tensor:
    """bool [..., T]: the tokens a message's first `count` rows carry (its index there), along the
    last dimension: the `picked` of the dispatch that sent them (`dispatch_order`)."""
    valid_QT, index_QT = live_index(index_QT, count_Q1)
    return torch.zeros_like(index_QT).scatter_add_(-1, index_QT, valid_QT.long()).bool()  # each token once


def received_order(index_T: torch.Tensor, count_1: torch.Tensor) -> torch.Tensor:
    """int64 [T]: the source's token of each received row, a permutation of its T tokens (what its
    `pick_rows` sent): the index for the first `count` rows, then the tokens not sent in token
    order, whatever the index holds past the count (a peer store leaves it stale). The pair rows
    of a received row go to its token's (`pair_return.expert_pair_rows`' `token_T`)."""
    return pick_rows(sent_tokens(index_T, count_1))[0]


def unpermute(rows_QTX: torch.Tensor, index_QT: torch.Tensor, count_Q1: torch.Tensor) -> torch.Tensor:
    """Each rank's rows, in its dispatch's order, back at their tokens' positions, padding rows
    zero: [Q, T, X] (differentiable: the gradient of `rows_QTX` is the tokens' rows gathered in
    dispatch order, zero for padding). The index past the count may hold anything (a peer store
    leaves it as it was): the zeroed padding rows are added at token 0, not written over a token's
    row (each token once among the first count, so the sum is exact)."""
    Q, T = index_QT.shape
    valid_QT, index_QT = live_index(index_QT, count_Q1)
    kept_QTX = torch.where(valid_QT.view(Q, T, *([1] * (rows_QTX.dim() - 2))), rows_QTX, 0)
    index_QTX = index_QT.view(Q, T, *([1] * (rows_QTX.dim() - 2))).expand_as(kept_QTX)
    return torch.zeros_like(kept_QTX).scatter_add(1, index_QTX, kept_QTX)


def scatter_sum(rows: Sequence[torch.Tensor], index_QT: torch.Tensor, count_Q1: torch.Tensor) -> torch.Tensor:
    """[T, X]: each rank q's first count_Q1[q] rows (`rows[q]` [T, X], in its dispatch's order)
    added into their tokens' rows, rank after rank (the same sum on every run), in one [T, X]
    buffer (not Q of them, as `unpermute` and a sum would hold); rows and index past the count are
    never used. Detached: the received partial sums (COMBINE; a colocated rank's own come from its
    expert graph) and the returned d x, d w are data, the sum a tensor of its own."""
    Q, T = index_QT.shape
    if len(rows) != Q:
        raise ValueError(f"{len(rows)} blocks of rows for the index of {Q} ranks: one block per rank")
    valid_QT, index_QT = live_index(index_QT, count_Q1)
    out_TX = torch.zeros_like(rows[0])
    for q, rows_TX in enumerate(rows):
        shape = (T, *([1] * (rows_TX.dim() - 1)))
        kept_TX = torch.where(valid_QT[q].view(shape), rows_TX.detach(), 0)
        out_TX.scatter_add_(0, index_QT[q].view(shape).expand_as(kept_TX), kept_TX)
    return out_TX
