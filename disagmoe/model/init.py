"""Deterministic, layout-independent initialisation: every tensor (every expert of a stacked
tensor) draws from its own CPU random stream keyed by (seed, name), so a process holding only
some layers or some experts initialises them exactly as the single-process model does."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def stream(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


_staging = threading.local()  # `staged_draws`' buffer, per thread


@contextmanager
def staged_draws() -> Iterator[None]:
    """Within the block, draws for another device or dtype reuse one fp32 CPU buffer of this thread
    (a fresh buffer per tensor paid its pages' first touch every time: most of a 3.8 B-parameter
    model's initialisation), freed when the block ends."""
    _staging.buffer = torch.empty(0)
    try:
        yield
    finally:
        del _staging.buffer


@torch.no_grad()
def seeded_normal_(t: torch.Tensor, seed: int, key: str, std: float) -> None:
    """Fill `t` in place with N(0, std^2) from the stream of (seed, key), drawn on the CPU in fp32:
    into `t` itself where it is a contiguous fp32 CPU tensor, else into a CPU buffer (`staged_draws`'
    within one) and copied: the same values either way (a draw depends on the stream and the
    element count only)."""
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
        t.normal_(0.0, std, generator=stream(seed, key))
        return
    buffer = getattr(_staging, "buffer", None)
    if buffer is None:
        buffer = torch.empty(t.numel())
    elif buffer.numel() < t.numel():
        buffer = _staging.buffer = torch.empty(t.numel())
    values = buffer[:t.numel()].view(t.shape).normal_(0.0, std, generator=stream(seed, key))
    t.copy_(values)  # blocking (keep it so): the buffer is free again when it returns


def materialise(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """A model built on the meta device (`MoETransformer`, `runtime.rank_model.RankModel`) allocated on
    `device` and initialised once by its `init_weights`: each tensor drawn on the CPU from its stream
    and copied into its device memory once."""
    for block in model.moe_blocks:  # the router keeps its fp32 bias through casts: give it one
        router = block.moe.router
        if router.expert_bias is not None:
            router.expert_bias = torch.zeros(router.expert_bias.shape, device=device)
    model.to_empty(device=device)
    with staged_draws():
        model.init_weights(seed)
    return model
