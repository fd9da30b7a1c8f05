"""Permute token rows into expert-grouped order and combine expert outputs back, in plain torch.

A token picks K experts, so there are P = N*K token-expert pairs. The experts backends want the
pairs' rows grouped by expert with cumulative counts `offsets_E` (int32); `combine` undoes the
grouping and takes the weighted sum over each token's K outputs in a fixed order (no atomics, so
the result does not depend on how the rows were split across expert ranks).

Shape legend: N tokens, K experts per token, P pairs (N*K), E experts, H hidden.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertGrouping:
    """Where each pair goes: grouped row p holds pair `pair_idx_P[p]` (flat index n*K + k)."""

    pair_idx_P: torch.Tensor  # int64, pairs sorted by expert (stable: token order within an expert)
    offsets_E: torch.Tensor  # int32 cumulative pair counts; expert e owns rows offsets[e-1]:offsets[e]
    top_k: int

    @property
    def token_idx_P(self) -> torch.Tensor:
        return self.pair_idx_P // self.top_k


def expert_counts(topk_idx_NK: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: token-expert pairs per expert. scatter_add, not bincount: on a GPU bincount
    reads the largest index back to the host, a synchronisation per layer."""
    flat = topk_idx_NK.flatten()
    return torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))


def group_by_expert(topk_idx_NK: torch.Tensor, num_experts: int) -> ExpertGrouping:
    pair_idx_P = torch.argsort(topk_idx_NK.flatten(), stable=True)
    counts_E = expert_counts(topk_idx_NK, num_experts)
    return ExpertGrouping(pair_idx_P, torch.cumsum(counts_E, 0).to(torch.int32), topk_idx_NK.shape[1])


def permute(x_NH: torch.Tensor, grouping: ExpertGrouping) -> torch.Tensor:
    """Token rows -> pair rows grouped by expert, [P, H]."""
    return x_NH[grouping.token_idx_P]


def combine(y_PH: torch.Tensor, grouping: ExpertGrouping, topk_w_NK: torch.Tensor) -> torch.Tensor:
    """Expert-grouped output rows -> per-token sum_k w[n, k] * y[pair(n, k)], [N, H]."""
    N, K = topk_w_NK.shape
    y_pairs_PH = torch.empty_like(y_PH).index_copy(0, grouping.pair_idx_P, y_PH)
    y_NKH = y_pairs_PH.view(N, K, -1)
    return torch.einsum("nkh,nk->nh", y_NKH, topk_w_NK.to(y_PH.dtype))
