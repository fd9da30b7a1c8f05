"""Deterministic, layout-independent initialisation: every tensor (every expert of a stacked
tensor) draws from its own CPU random stream keyed by (seed, name), so a process holding only
some layers or some experts initialises them exactly as the single-process model does."""

from __future__ import annotations

import hashlib

import torch


def stream(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


@torch.no_grad()
def seeded_normal_(t: torch.Tensor, seed: int, key: str, std: float) -> None:
    """Fill `t` in place with N(0, std^2) from the stream of (seed, key), drawn on the CPU in fp32."""
    values = torch.empty(t.shape, dtype=torch.float32).normal_(0.0, std, generator=stream(seed, key))
    t.copy_(values)
