"""ZeRO-1 (disagmoe/runtime/zero.py) in two gloo processes: the sharded step equals AdamW's, the
state round-trips through the per-parameter form, and unequal replicas are refused."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from disagmoe.config import OptimConfig
from disagmoe.runtime.zero import ShardedAdamW

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1)


def _params(seed: int, extra: bool = False) -> list[tuple[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w": (5, 3), "b": (7,), "v": (2, 2)} | ({"x": (3,)} if extra else {})
    return [(n, nn.Parameter(torch.randn(s, generator=g))) for n, s in shapes.items()]


def _grads(rank: int, step: int, params) -> None:
    for i, (_, p) in enumerate(params):
        p.grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + 10 * i + rank))


def _worker(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        params = _params(0)
        zero = ShardedAdamW(params, OPTIM, group, rank, 2)
        for step in range(3):
            _grads(rank, step, params)
            zero.reduce_gradients()
            zero.step(OPTIM.lr)
        state = zero.state_by_name()
        fresh = ShardedAdamW(_params(0), OPTIM, group, rank, 2)
        fresh.load_state_by_name(dist_broadcast_state(state, rank))
        same_slices = all(torch.equal(fresh.inner.state[fb.shard][k], zero.inner.state[b.shard][k])
                          for fb, b in zip(fresh.buckets, zero.buckets) for k in ("exp_avg", "exp_avg_sq"))
        try:
            ShardedAdamW(_params(1, extra=rank == 1), OPTIM, group, rank, 2)
            mismatch = "accepted"
        except ValueError as err:
            mismatch = str(err)
        results[rank] = ({n: p.detach().clone() for n, p in params}, sorted(state), same_slices, mismatch)
    finally:
        dist.destroy_process_group()


def dist_broadcast_state(state, rank):
    """Index 0 holds the gathered state; hand it to every rank as a checkpoint load would."""
    box = [state if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_step_like_adamw_round_trip_their_state_and_refuse_unequal_replicas():
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(_free_port(), results), nprocs=2)
    params = _params(0)
    reference = torch.optim.AdamW([{"params": [p for _, p in params if p.ndim >= 2], "weight_decay": 0.1},
                                   {"params": [p for _, p in params if p.ndim < 2], "weight_decay": 0.0}],
                                  lr=OPTIM.lr, betas=(OPTIM.beta1, OPTIM.beta2), eps=OPTIM.eps)
    for step in range(3):
        for i, (_, p) in enumerate(params):  # the sum of both ranks' gradients
            p.grad = sum(torch.randn(p.shape, generator=torch.Generator().manual_seed(100 * step + 10 * i + r))
                         for r in range(2))
        reference.step()
    for rank in range(2):
        got, names, same_slices, mismatch = results[rank]
        for name, p in params:
            torch.testing.assert_close(got[name], p.detach(), rtol=1e-6, atol=1e-7)
        assert names == (["b", "v", "w"] if rank == 0 else [])  # only index 0 keeps the gathered state
        assert same_slices
        assert "hold different replicated parameters" in mismatch
