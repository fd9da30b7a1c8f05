"""Replicated experts on one rank: summing their gradients with the other owners, counting them once.

A plan may give a hot expert several owners (`Topology.expert_owners`); each runs it for its share
of the data-parallel ranks, so each holds part of the expert's gradient. Before the optimizer
step the owners of the same experts sum those parts (one all-reduce per set of owners, over the
flattened slices, sets in sorted order on every rank), so every replica takes the same AdamW step
from the same state and stays identical. The global gradient norm counts a replicated expert once
(on its primary, the first owner), and so does a checkpoint.

Legend: E local experts of a stacked tensor.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from disagmoe.runtime.rank_model import RankModel
from disagmoe.runtime.topology import Topology

STACKED = ("w13_EH2F", "w2_EFH")


class ExpertReplicas:
    """This rank's replicated expert slices and how its expert gradients count (module docstring)."""

    def __init__(self, model: RankModel, topology: Topology, rank: int) -> None:
        self.rank = rank
        # owner ranks (sorted) -> (stacked parameter, local expert index) of every slice they
        # share, in a fixed order (layer, expert id, tensor) that every owner builds identically
        self.shared: dict[tuple[int, ...], list[tuple[torch.nn.Parameter, int]]] = defaultdict(list)
        self.counted_E: dict[torch.nn.Parameter, torch.Tensor] = {}  # 1.0 where this rank is the primary
        for layer, ids in sorted(topology.experts_of(rank).items()):
            experts = model.experts(layer)
            for name in STACKED:
                param = getattr(experts, name)
                counted = [topology.owner_ranks(layer, e)[0] == rank for e in ids]
                if not all(counted):
                    self.counted_E[param] = torch.tensor(counted, dtype=torch.float64, device=param.device)
            for k, e in enumerate(ids):
                owners = tuple(sorted(topology.owner_ranks(layer, e)))
                if len(owners) > 1:
                    self.shared[owners] += [(getattr(experts, name), k) for name in STACKED]

    def sum_gradients(self, groups: dict[tuple[int, ...], dist.ProcessGroup]) -> None:
        """All-reduce (sum) every shared slice's main gradient (`FlatAdamW`) with its other owners."""
        for owners in sorted(self.shared):
            grads = [param.main_grad[k] for param, k in self.shared[owners]]
            flat = _flatten_dense_tensors(grads)
            dist.all_reduce(flat, group=groups[owners])
            for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(summed)

    def squares(self, param: torch.nn.Parameter) -> torch.Tensor:
        """The float64 sum of squares of `param`'s main gradient that this rank counts in the global norm."""
        counted_E = self.counted_E.get(param)
        if counted_E is None:
            return torch.linalg.vector_norm(param.main_grad).double() ** 2
        norms_E = torch.linalg.vector_norm(param.main_grad.flatten(1), dim=1).double()
        return (norms_E.pow(2) * counted_E).sum()
