"""Learning-rate schedule, AdamW parameter groups and gradient clipping (disagmoe/runtime/state/optim.py)."""

from __future__ import annotations

import math

import pytest
import torch

from disagmoe.config import OptimConfig
from disagmoe.runtime.state.optim import build_optimizer, clip_grad_norm, lr_at


def test_warmup_rises_linearly_to_the_peak():
    optim = OptimConfig(lr=1e-3, warmup_steps=4)
    assert [lr_at(s, optim, 100) for s in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3])


def test_cosine_runs_from_peak_to_floor_over_the_remaining_steps():
    optim = OptimConfig(lr=2e-3, min_lr_ratio=0.1, warmup_steps=5)
    total = 25  # decay steps 5..24: the midpoint step 14.5 is between 14 and 15
    lrs = [lr_at(s, optim, total) for s in range(optim.warmup_steps, total)]
    floor = optim.lr * optim.min_lr_ratio
    assert lrs[0] == pytest.approx(optim.lr)
    assert lrs[-1] == pytest.approx(floor)
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    assert (lrs[9] + lrs[10]) / 2 == pytest.approx((optim.lr + floor) / 2, rel=1e-2)
    assert lr_at(total + 10, optim, total) == pytest.approx(floor)


def test_no_warmup_starts_at_the_peak():
    optim = OptimConfig(lr=1e-3, warmup_steps=0, min_lr_ratio=0.0)
    assert lr_at(0, optim, 10) == pytest.approx(1e-3)
    assert lr_at(9, optim, 10) == pytest.approx(0.0, abs=1e-12)


def test_only_matrices_are_decayed():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    opt = build_optimizer(model.named_parameters(), OptimConfig(weight_decay=0.1))
    decayed, plain = opt.param_groups
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert all(p.ndim >= 2 for p in decayed["params"]) and all(p.ndim < 2 for p in plain["params"])
    assert len(decayed["params"]) + len(plain["params"]) == len(list(model.parameters()))


def _params_with_grads(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in [(3, 4), (5,), (2, 2, 2)]]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    return params


def test_clip_reports_the_global_norm_and_scales_to_the_limit():
    params = _params_with_grads(0)
    reference = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    norm = clip_grad_norm(params, max_norm=0.5)
    assert norm == pytest.approx(reference, rel=1e-6)
    clipped = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in params))
    assert clipped == pytest.approx(0.5, rel=1e-5)


def test_clip_zero_measures_without_changing_gradients():
    params = _params_with_grads(1)
    before = [p.grad.clone() for p in params]
    norm = clip_grad_norm(params, max_norm=0.0)
    assert norm > 0
    assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
