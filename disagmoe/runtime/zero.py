"""AdamW state sharded over a data-parallel group (ZeRO stage 1), for the replicated parameters.

Every attention rank of a data-parallel group holds the same non-expert parameters. Instead of
each keeping AdamW's two fp32 moments for all of them, rank d of D keeps them for the d-th 1/D of
the flattened parameters (one bucket for the decayed matrices, one for the undecayed gains): the
gradients are reduce-scattered (summed) instead of all-reduced, the rank steps its slice, and the
stepped slices are all-gathered back into every replica's parameters. AdamW is elementwise, so the
step equals the unsharded one (up to the order of the gradient sum). The parameters are re-seated
as views of one flat buffer per bucket, so a rank's slice is stepped in place, without a copy.
Per replicated parameter a rank holds 4 (weights) + 4 (gradients) + 12/D (moments and the slice's
summed gradient) bytes, not 16; a flat gradient buffer (4 bytes) lives during the reduce-scatter.

For checkpoints `state_by_name` gathers the moments, in chunks, onto the CPU of data-parallel
index 0 in the per-parameter form the layout-independent format stores (a collective: every rank
of the group calls it), and `load_state_by_name` takes this rank's slice of such a state.

Shapes: N a bucket's flattened length padded to a multiple of D, S = N / D (a rank's slice).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import nn

from disagmoe.config import OptimConfig

_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
GATHER_CHUNK = 1 << 24  # elements per rank per collective when gathering moments for a checkpoint


class _Bucket:
    """Parameters re-seated as consecutive views of one flat fp32 buffer of N elements; this
    rank's slice of the buffer, as one parameter (a view: stepping it steps the parameters)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]], weight_decay: float, rank: int, size: int) -> None:
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.weight_decay = weight_decay
        self.numel = sum(p.numel() for p in self.params)
        self.S = -(-self.numel // size)
        self.rank, self.size = rank, size
        first = self.params[0]
        self.flat_N = torch.zeros(self.S * size, dtype=first.dtype, device=first.device)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                view = self.flat_N[offset:offset + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
                offset += p.numel()
        self.shard = nn.Parameter(self.flat_N[rank * self.S:(rank + 1) * self.S])

    def flat(self, tensors: Iterable[torch.Tensor]) -> torch.Tensor:
        """The tensors (one per parameter, in order) flattened and zero-padded to N = S * D."""
        flat_N = torch.cat([t.reshape(-1).float() for t in tensors])
        return torch.nn.functional.pad(flat_N, (0, self.S * self.size - self.numel))

    def unflat(self, flat_N: torch.Tensor) -> list[torch.Tensor]:
        """The inverse of `flat`: one tensor per parameter, shaped like it."""
        parts = flat_N[:self.numel].split([p.numel() for p in self.params])
        return [part.view_as(p) for part, p in zip(parts, self.params, strict=True)]

    def gather_to_cpu(self, shard_S: torch.Tensor, group: dist.ProcessGroup, keep: bool) -> torch.Tensor | None:
        """Every rank's slice of a bucket-shaped tensor, assembled on the CPU of a rank that
        `keep`s it (the others only take part), in chunks so the device holds little extra."""
        full_N = torch.empty(self.S * self.size, dtype=shard_S.dtype) if keep else None
        for start in range(0, self.S, GATHER_CHUNK):
            n = min(GATHER_CHUNK, self.S - start)
            chunks_Dn = torch.empty(self.size * n, dtype=shard_S.dtype, device=shard_S.device)
            _all_gather(chunks_Dn, shard_S[start:start + n].contiguous(), group=group)
            if full_N is not None:
                chunks_Dn = chunks_Dn.view(self.size, n).cpu()
                for r in range(self.size):
                    full_N[r * self.S + start:r * self.S + start + n] = chunks_Dn[r]
        return full_N


class ShardedAdamW:
    """AdamW over the replicated parameters with its state split over the data-parallel group."""

    def __init__(self, named_params: Iterable[tuple[str, nn.Parameter]], optim: OptimConfig,
                 group: dist.ProcessGroup, rank: int, size: int) -> None:
        named = [(n, p) for n, p in named_params if p.requires_grad]
        self.group, self.rank, self.size = group, rank, size
        decay = [(n, p) for n, p in named if p.ndim >= 2]
        no_decay = [(n, p) for n, p in named if p.ndim < 2]
        self.buckets = [_Bucket(part, wd, rank, size)
                        for part, wd in ((decay, optim.weight_decay), (no_decay, 0.0)) if part]
        self._check_same_buckets(named[0][1].device)
        self.inner = torch.optim.AdamW(
            [{"params": [b.shard], "weight_decay": b.weight_decay} for b in self.buckets],
            lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)

    def _check_same_buckets(self, device: torch.device) -> None:
        """Every rank of the group must flatten the same parameters, or the slices would not line
        up (a hang or silently wrong sums); compare the bucket sizes once, up front."""
        sizes = torch.tensor([b.numel for b in self.buckets] + [0] * (2 - len(self.buckets)), device=device)
        every = torch.empty(self.size * 2, dtype=sizes.dtype, device=device)
        _all_gather(every, sizes, group=self.group)
        per_rank = every.view(self.size, 2).tolist()
        if any(row != per_rank[0] for row in per_rank):
            raise ValueError(f"the data-parallel group's ranks hold different replicated parameters (bucket "
                             f"sizes per rank: {per_rank}); ZeRO-1 needs identical replicas")

    def reduce_gradients(self) -> None:
        """Sum the replicas' gradients, each rank receiving its slice's sum (missing grads: 0)."""
        for b in self.buckets:
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in b.params]
            b.shard.grad = torch.empty_like(b.shard)
            _reduce_scatter(b.shard.grad, b.flat(grads), group=self.group)

    def squares(self) -> torch.Tensor:
        """float64 sum of squares of this rank's gradient slices (the group's add up to the whole)."""
        total = torch.zeros((), dtype=torch.float64, device=self.buckets[0].shard.device)
        for b in self.buckets:
            total += torch.linalg.vector_norm(b.shard.grad).double() ** 2
        return total

    def scale_gradients(self, coef: torch.Tensor) -> None:
        for b in self.buckets:
            b.shard.grad.mul_(coef.to(b.shard.grad.device))

    def step(self, lr: float) -> None:
        """AdamW on this rank's slices (views of the parameters), then every slice to every rank."""
        for g in self.inner.param_groups:
            g["lr"] = lr
        self.inner.step()
        with torch.no_grad():
            for b in self.buckets:
                _all_gather(b.flat_N, b.shard.detach().clone(), group=self.group)

    # -- checkpoints ---------------------------------------------------------------------------

    def state_by_name(self) -> dict[str, dict[str, torch.Tensor]]:
        """AdamW's per-parameter state (step, exp_avg, exp_avg_sq) of every replicated parameter,
        on the CPU of data-parallel index 0, which writes it; empty elsewhere and before the first
        step. A collective: every rank of the group calls it."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        keep = self.rank == 0
        for b in self.buckets:
            state = self.inner.state.get(b.shard)
            if not state:
                continue
            moments = {k: b.gather_to_cpu(state[k], self.group, keep) for k in ("exp_avg", "exp_avg_sq")}
            if keep:
                avg, avg_sq = b.unflat(moments["exp_avg"]), b.unflat(moments["exp_avg_sq"])
                for name, m1, m2 in zip(b.names, avg, avg_sq, strict=True):
                    out[name] = {"step": state["step"].detach().cpu().clone(), "exp_avg": m1.clone(),
                                 "exp_avg_sq": m2.clone()}
        return out

    def load_state_by_name(self, by_name: dict[str, dict[str, torch.Tensor]]) -> None:
        """Take this rank's slice of a per-parameter state (as `state_by_name` returns; flattened
        on the CPU, only the slice goes to the device)."""
        with torch.no_grad():
            for b in self.buckets:
                if not all(n in by_name for n in b.names):
                    missing = [n for n in b.names if n not in by_name]
                    if len(missing) == len(b.names):
                        continue  # saved before any step: no moments yet
                    raise ValueError(f"the checkpoint has optimizer state for some but not all replicated "
                                     f"parameters (missing e.g. {missing[:3]})")
                state = {"step": by_name[b.names[0]]["step"].detach().cpu().clone()}
                for k in ("exp_avg", "exp_avg_sq"):
                    full_N = b.flat([by_name[n][k].detach().cpu() for n in b.names])
                    state[k] = full_N[b.rank * b.S:(b.rank + 1) * b.S].to(b.shard.device)
                self.inner.state[b.shard] = state
