"""An expert rank's share of a MoE layer: its local experts over whole tokens, one weighted
partial sum per token (the compact hop of DESIGN 3c).

Each attention rank sends every expert rank of its group the layer's normed token rows once
(x_TH), each token's top-k choice mapped to this rank's experts (`local_TK`: the local expert
index, or `num_local` where the pair's expert is served elsewhere) and the routing weights. The
expert rank computes

    partial_TH[t] = sum over k with local_TK[t, k] < num_local of  w_TK[t, k] * expert_{local_TK[t, k]}(x_TH[t])

and returns that one row per token; the attention rank sums its group's partials. Gradients flow
to x (every token), to w (pairs served here; zero for the others, so summing over the expert ranks
gives the whole gradient) and to the expert weights.

The pairs served elsewhere are grouped into a spare last bucket that the experts never read and
whose rows are masked out of the gathers, so nothing depends on a count read back to the host.
On CUDA with the triton backend the permute and weighted-combine kernels do the grouping (one
launch each way; `RoutedExperts.fuses_permute`); otherwise plain torch (argsort, gather,
`torch.where`, the combine).

`recompute: full` (`kernels.recompute.BLOCK` in the experts' `recompute`): the forward keeps the
received rows, the local ids and weights (the checkpoint's inputs) and the grouping it derived
from the ids (`SavedRouting`); the grouped rows, the FFN's internals and the combine's rows run
again in the backward, grouped as the forward grouped them.

Shape legend: T tokens (from every source, concatenated), K top-k, H hidden, P = T*K pairs,
E local experts.
"""

from __future__ import annotations

import torch

from disagmoe.model.dispatch import expert_counts
from disagmoe.kernels.recompute import BLOCK, EXPERT_INPUT, EXPERT_OUTPUT, RowSource, SavedRouting, derived, recomputed
from disagmoe.model.experts import RoutedExperts


def local_expert_block(x_TH: torch.Tensor, local_TK: torch.Tensor, w_TK: torch.Tensor,
                       experts: RoutedExperts) -> torch.Tensor:
    """partial_TH of the module docstring; `local_TK` int (num_local = experts.num_experts marks
    a pair served elsewhere). Under `recompute: full` one recomputed segment (module docstring)."""
    if x_TH.shape[0] != local_TK.shape[0] or local_TK.shape != w_TK.shape:
        raise ValueError(f"x [T, H], local [T, K] and w [T, K] must agree; got {tuple(x_TH.shape)}, "
                         f"{tuple(local_TK.shape)}, {tuple(w_TK.shape)}")
    if BLOCK in experts.recompute and torch.is_grad_enabled():
        return recomputed(_partial_sums, x_TH, local_TK, w_TK, experts)
    return _partial_sums(x_TH, local_TK, w_TK, experts, None)


def _partial_sums(x_TH: torch.Tensor, local_TK: torch.Tensor, w_TK: torch.Tensor, experts: RoutedExperts,
                  saved: SavedRouting | None = None) -> torch.Tensor:
    if experts.fuses_permute(x_TH):
        return _fused(x_TH, local_TK, w_TK, experts, saved)
    return _torch(x_TH, local_TK, w_TK, experts, saved)


def _fused(x_TH: torch.Tensor, local_TK: torch.Tensor, w_TK: torch.Tensor, experts: RoutedExperts,
           saved: SavedRouting | None = None) -> torch.Tensor:
    from disagmoe.kernels.permute import combine_rows, pair_destinations, permute_tokens

    num_local = experts.num_experts
    if EXPERT_OUTPUT in experts.recompute:  # one op that keeps no output rows (`kernels.fused_moe`)
        return experts.fused_layer(x_TH, local_TK, w_TK, spare_last=True)
    destinations = derived(saved, "destinations", lambda: pair_destinations(local_TK, num_local + 1))
    x_PH, offsets_E1, dest_TK = permute_tokens(x_TH, local_TK, num_local + 1, spare_last=True,
                                               destinations=destinations)
    source = RowSource.of_permute(x_TH, dest_TK) if EXPERT_INPUT in experts.recompute else None
    grad_slot = experts.row_grad_slot()  # FP8: the combine's backward quantises the experts' dy
    y_PH = experts(x_PH, offsets_E1[:num_local], source=source, grad_slot=grad_slot)
    return combine_rows(y_PH, dest_TK, w_TK, limit=offsets_E1[num_local - 1:num_local], grad_slot=grad_slot)


def _grouping(local_TK: torch.Tensor, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order_P, offsets_E): the pairs by local expert, the spare bucket last, and the cumulative
    rows of the local experts (int32), on the device."""
    order_P = torch.argsort(local_TK.reshape(-1).long(), stable=True)
    offsets_E = torch.cumsum(expert_counts(local_TK.long(), num_local + 1)[:num_local], 0).to(torch.int32)
    return order_P, offsets_E


def _torch(x_TH: torch.Tensor, local_TK: torch.Tensor, w_TK: torch.Tensor, experts: RoutedExperts,
           saved: SavedRouting | None = None) -> torch.Tensor:
    num_local = experts.num_experts
    T, K = local_TK.shape
    order_P, offsets_E = derived(saved, "grouping", lambda: _grouping(local_TK, num_local))
    served_P1 = (torch.arange(T * K, device=x_TH.device) < offsets_E[-1])[:, None]
    x_PH = torch.where(served_P1, x_TH[order_P // K], 0)
    y_PH = torch.where(served_P1, experts(x_PH, offsets_E), 0)
    y_TKH = torch.empty_like(y_PH).index_copy(0, order_P, y_PH).view(T, K, -1)
    w_TK = torch.where(local_TK < num_local, w_TK, 0).to(y_PH.dtype)
    if x_TH.is_cuda:  # einsum's batched GEMV is slow on a GPU; a multiply and a sum are memory-bound
        return (y_TKH * w_TK[..., None]).sum(1)
    return torch.einsum("tkh,tk->th", y_TKH, w_TK)
