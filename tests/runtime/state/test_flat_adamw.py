"""FlatAdamW (disagmoe/runtime/state/flat_adamw.py): the flat fp32 step equals torch's AdamW on the
parameters themselves (CPU, fp32: to rounding), micro-batch gradients accumulate in fp32 main
gradients for bf16 parameters, clipping scales like clip_grad_norm_, state round-trips, and the
ZeRO-1 split over two gloo processes takes the same step."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from disagmoe.config import OptimConfig
from disagmoe.runtime.state.flat_adamw import FlatAdamW, Shard
from disagmoe.runtime.state.optim import build_optimizer

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.1)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))


def _loss(model: nn.Module, step: int, mb: int) -> torch.Tensor:
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(10 * step + mb))
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def test_flat_step_equals_adamw_on_the_parameters() -> None:
    oracle, fast = _model(), _model()
    reference = build_optimizer(oracle.named_parameters(), OPTIM)
    flat = FlatAdamW(fast.named_parameters(), OPTIM, torch.float32)
    for step in range(4):
        reference.zero_grad(set_to_none=True)
        flat.zero_grad()
        for mb in range(3):
            (_loss(oracle, step, mb) / 3).backward()
            (_loss(fast, step, mb) / 3).backward()
        reference.step()
        flat.step(OPTIM.lr)
    for (name, a), b in zip(oracle.named_parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=name)


def test_bf16_parameters_accumulate_fp32_main_gradients() -> None:
    model = _model().to(torch.bfloat16)
    flat = FlatAdamW(model.named_parameters(), OPTIM, torch.bfloat16)
    flat.zero_grad()
    expected = [torch.zeros(p.shape) for p in model.parameters()]
    for mb in range(3):
        grads = torch.autograd.grad(_loss(model, 0, mb), list(model.parameters()))
        expected = [e + g.float() for e, g in zip(expected, grads)]
        _loss(model, 0, mb).backward()
    for p, e in zip(model.parameters(), expected, strict=True):
        assert p.grad is None and p.dtype == torch.bfloat16
        assert p.main_grad.dtype == torch.float32
        torch.testing.assert_close(p.main_grad, e, rtol=1e-6, atol=1e-7)
    before = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    flat.step(OPTIM.lr)
    masters = flat.masters_by_name()
    for name, p in model.named_parameters():
        assert not torch.equal(p.float(), before[name]), name
        torch.testing.assert_close(p.float(), masters[name].to(torch.bfloat16).float(), rtol=0, atol=0)


def test_clip_coefficient_scales_like_clip_grad_norm() -> None:
    oracle, fast = _model(), _model()
    reference = build_optimizer(oracle.named_parameters(), OPTIM)
    flat = FlatAdamW(fast.named_parameters(), OPTIM, torch.float32)
    flat.zero_grad()
    _loss(oracle, 0, 0).backward()
    _loss(fast, 0, 0).backward()
    norm = torch.nn.utils.clip_grad_norm_(list(oracle.parameters()), 0.01)
    squares = flat.grad_squares()
    torch.testing.assert_close(squares.sqrt().float(), norm, rtol=1e-6, atol=0)
    coef = torch.clamp(0.01 / (squares.sqrt().float() + 1e-6), max=1.0)
    reference.step()
    flat.step(OPTIM.lr, coef)
    for a, b in zip(oracle.parameters(), fast.parameters(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_state_round_trips_through_the_per_parameter_form() -> None:
    model = _model()
    flat = FlatAdamW(model.named_parameters(), OPTIM, torch.float32)
    assert flat.state_by_name() == {}
    for step in range(2):
        flat.zero_grad()
        _loss(model, step, 0).backward()
        flat.step(OPTIM.lr)
    masters, state = flat.masters_by_name(), flat.state_by_name()
    assert set(masters) == set(state) == {n for n, _ in model.named_parameters()}
    assert all(float(s["step"]) == 2 for s in state.values())
    other = _model(seed=1)
    fresh = FlatAdamW(other.named_parameters(), OPTIM, torch.float32)
    fresh.load_state(masters, state)
    for (name, a), b in zip(model.named_parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b), name
    for step in range(2, 4):
        for f, m in ((flat, model), (fresh, other)):
            f.zero_grad()
            _loss(m, step, 0).backward()
            f.step(OPTIM.lr)
    for a, b in zip(model.parameters(), other.parameters(), strict=True):
        assert torch.equal(a, b)


def test_partial_state_is_refused() -> None:
    model = _model()
    flat = FlatAdamW(model.named_parameters(), OPTIM, torch.float32)
    flat.zero_grad()
    _loss(model, 0, 0).backward()
    flat.step(OPTIM.lr)
    state = flat.state_by_name()
    state.pop(next(iter(state)))
    with pytest.raises(ValueError, match="some but not all"):
        FlatAdamW(_model().named_parameters(), OPTIM, torch.float32).load_state(flat.masters_by_name(), state)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sharded_worker(rank: int, port: int, dtype: torch.dtype, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        model = _model()
        flat = FlatAdamW(model.named_parameters(), OPTIM, dtype, shards={"params": Shard(group, rank, 2)})
        for step in range(3):
            flat.zero_grad()
            _loss(model, step, rank).backward()  # each rank its own micro-batch
            for b in flat.buckets:
                flat.reduce_scatter(b)
            squares = flat.grad_squares()
            dist.all_reduce(squares, group=group)
            flat.step(OPTIM.lr)
        masters, state = flat.masters_by_name(), flat.state_by_name()
        results[rank] = ({n: p.detach().float().clone() for n, p in model.named_parameters()},
                         masters, state, float(squares))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero1_split_takes_the_unsharded_step(dtype: torch.dtype) -> None:
    results = mp.Manager().dict()
    mp.spawn(_sharded_worker, args=(_free_port(), dtype, results), nprocs=2)
    model = _model().to(dtype)
    flat = FlatAdamW(model.named_parameters(), OPTIM, dtype)
    for step in range(3):
        flat.zero_grad()
        for rank in range(2):
            _loss(model, step, rank).backward()
        squares = flat.grad_squares()
        flat.step(OPTIM.lr)
    params0, masters0, state0, squares0 = results[0]
    params1, _, state1, _ = results[1]
    assert state1 == {} and set(state0) == {n for n, _ in model.named_parameters()}
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 1e-2}  # bf16 forward
    torch.testing.assert_close(squares0, float(squares), rtol=tol["rtol"], atol=0)
    for name, p in model.named_parameters():
        torch.testing.assert_close(params0[name], p.float(), **tol)
        torch.testing.assert_close(params1[name], params0[name], rtol=0, atol=0)  # replicas stay identical
        torch.testing.assert_close(masters0[name], flat.masters_by_name()[name], **tol)


class _AddsIntoMainGrad(torch.autograd.Function):
    """y = x @ w whose backward adds dw into `w.main_grad` itself and returns None for w (as the
    Triton experts backend does)."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, dy):
        x, w = ctx.saved_tensors
        w.main_grad.add_((x.T @ dy).float())
        return dy @ w.T, None


def test_kernels_may_add_into_main_gradients_themselves() -> None:
    w = nn.Parameter(torch.randn(4, 3).to(torch.bfloat16))
    flat = FlatAdamW([("w", w)], OPTIM, torch.bfloat16)
    flat.zero_grad()
    x = torch.randn(5, 4).to(torch.bfloat16)
    for _ in range(2):
        _AddsIntoMainGrad.apply(x, w).float().sum().backward()
    expected = 2 * (x.T @ torch.ones(5, 3, dtype=torch.bfloat16)).float()
    assert w.grad is None
    torch.testing.assert_close(w.main_grad, expected)
