"""Sparse dispatch (`dispatch: sparse`): a token travels to an expert rank only if that rank serves
at least one of its top-k pairs, once per rank however many it serves; the messages'
specs are in `runtime.stages.messages`.

Sender (attention rank d, for expert rank j): j's `LocalRouting` for source d maps each pair to a
local expert of j or to L (elsewhere; replica splits included, computed on the sender's whole
token order); the tokens with a pair < L are j's. Their positions come from a prefix sum on the
device (`pick_rows`): the picked tokens first, in token order, then the others, so the message is
a permutation of the dense one whose first `count` rows are the tokens sent. Nothing is read back
to the host and nothing is allocated from a count: the buffers have the worst case's T rows.

Receiver: rows at or past `count` are never read (`received_locals` marks their pairs L; the
combine masks them), so a transport that moves only the first `count` rows (a one-sided put) is
as correct as one moving the whole buffer. Expert ranks return the partial sums of the rows they
received, in the dispatch's order, with its token index; the attention rank scatters them back
(`unpermute`), and the gradients of rows sent (d x, d w) back the same way.

Legend: T tokens of the source, H hidden, K top-k, E experts of the layer, L local experts.
"""

from __future__ import annotations

import torch


def pick_rows(picked_T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index_T int64, count_1 int64): a permutation of the T tokens with the `picked_T` ones first,
    in token order, then the rest in token order; count = how many are picked. Prefix sums on the
    device, no host read."""
    T = picked_T.shape[0]
    upto_T = torch.cumsum(picked_T.to(torch.int64), 0)  # picked tokens up to and including t
    count_1 = upto_T[-1:] if T else torch.zeros(1, dtype=torch.int64, device=picked_T.device)
    position_T = torch.arange(T, device=picked_T.device)
    slot_T = torch.where(picked_T, upto_T - 1, count_1 + position_T - upto_T)
    return torch.empty_like(position_T).scatter_(0, slot_T, position_T), count_1


def dispatch_message(xn_TH: torch.Tensor, local_TK: torch.Tensor, num_local: int, w_TK: torch.Tensor,
                     load_E: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The sparse DISPATCH tensors for one expert rank (`local_TK`: its `LocalRouting` of this
    source's pairs), and (index_T, count_1) for the backward. Detached: the gradients come back
    through `unpermute`."""
    index_T, count_1 = pick_rows((local_TK < num_local).any(1))
    tensors = [xn_TH.detach()[index_T], local_TK.to(torch.int32)[index_T], w_TK.detach()[index_T],
               index_T.to(torch.int32), count_1.to(torch.int32), load_E]
    return tensors, index_T, count_1


def valid_rows(count_1: torch.Tensor, rows: int) -> torch.Tensor:
    """bool [rows]: the rows before `count` (the message's sent rows)."""
    return torch.arange(rows, device=count_1.device) < count_1


def received_locals(local_TK: torch.Tensor, count_1: torch.Tensor, num_local: int) -> torch.Tensor:
    """The received local ids with every pair of a padding row (at or past `count`) marked L."""
    return torch.where(valid_rows(count_1, local_TK.shape[0])[:, None], local_TK, num_local)


def unpermute(rows_TX: torch.Tensor, index_T: torch.Tensor, count_1: torch.Tensor) -> torch.Tensor:
    """Rows in the dispatch's order back at their tokens' positions, padding rows zero
    (differentiable: the gradient of `rows_TX` is the tokens' rows gathered in dispatch order,
    zero for padding)."""
    valid_T1 = valid_rows(count_1, rows_TX.shape[0]).view(-1, *([1] * (rows_TX.dim() - 1)))
    kept_TX = torch.where(valid_T1, rows_TX, 0)
    return torch.zeros_like(kept_TX).index_copy(0, index_T.long(), kept_TX)

