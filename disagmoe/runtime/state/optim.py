"""The learning-rate schedule (warmup + cosine), and the oracle's AdamW and clipping.

`build_optimizer` / `clip_grad_norm` are the reference step of `mode: single` with `precision:
fp32` and fp32 moments (the CPU oracle): a plain `torch.optim.AdamW` over fp32 parameters. Every other run steps
with `runtime.state.flat_adamw.FlatAdamW` (bf16 or fp32 compute parameters, fp32 masters and main
gradients over flat buffers, one fused AdamW per bucket), which is tested against this one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from disagmoe.config import OptimConfig


def lr_at(step: int, optim: OptimConfig, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based) of `total_steps`.

    Linear warmup from lr/warmup_steps to lr over the first `warmup_steps` steps, then a cosine
    decay that reaches lr * min_lr_ratio on the last step (and stays there beyond it).

    Host float64, by design: the step gets it through `FlatAdamW.set_lr` (a CUDA-graph replay
    loop calls that before each replay). The same formula in torch ops on a step counter is not
    this value: on the CPU, in fp32 it missed fp32(lr_at) on 59% of 24,912 (step, schedule)
    points, in float64 (torch's vectorised cos) on 19.
    """
    if step < optim.warmup_steps:
        return optim.lr * (step + 1) / optim.warmup_steps
    decay_steps = max(1, total_steps - optim.warmup_steps - 1)
    progress = min(1.0, (step - optim.warmup_steps) / decay_steps)
    min_lr = optim.lr * optim.min_lr_ratio
    return min_lr + (optim.lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(params: Iterable[tuple[str, torch.nn.Parameter]], optim: OptimConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (norm gains and biases are not decayed).

    `params` are (name, parameter) pairs; their order fixes the optimizer's state indices. Its
    moments are fp32: torch's AdamW keeps them in the parameters' dtype, so `optim.state_dtype: bf16`
    is refused here (FlatAdamW keeps bf16 moments beside fp32 parameters).
    """
    if optim.state_dtype != "fp32":
        raise ValueError(f"optim.state_dtype={optim.state_dtype}: the oracle's plain torch AdamW keeps fp32 moments; "
                         "step runtime.state.flat_adamw.FlatAdamW for bf16 moments (the single trainer does), "
                         "or set optim.state_dtype=fp32")
    decay, no_decay = [], []
    for _, p in params:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": optim.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grad_norm(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Global L2 norm of all gradients before clipping; clip to `max_norm` unless it is 0."""
    grads = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(grads, max_norm if max_norm > 0 else math.inf)
    return float(norm)
