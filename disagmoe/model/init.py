"""Deterministic, layout-independent initialisation: every tensor (every expert of a stacked
tensor) draws from its own CPU random stream keyed by (seed, name), so a process holding only
some layers or some experts initialises them exactly as the single-process model does."""

from __future__ import annotations

import hashlib

import torch


def stream(seed: int, key: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class _Staging:
    """One fp32 CPU buffer the draws for other devices and dtypes reuse: a fresh one per tensor paid
    its pages' first touch every time (a 3.8 B-parameter model spent most of its initialisation
    there)."""

    buffer = torch.empty(0)

    @classmethod
    def take(cls, numel: int) -> torch.Tensor:
        if cls.buffer.numel() < numel:
            cls.buffer = torch.empty(numel)
        return cls.buffer[:numel]


@torch.no_grad()
def seeded_normal_(t: torch.Tensor, seed: int, key: str, std: float) -> None:
    """Fill `t` in place with N(0, std^2) from the stream of (seed, key), drawn on the CPU in fp32:
    into `t` itself where it is a contiguous fp32 CPU tensor, else into a reused CPU buffer and
    copied (the same values: a draw depends on the stream and the element count only)."""
    if t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous():
        t.normal_(0.0, std, generator=stream(seed, key))
        return
    values = _Staging.take(t.numel()).view(t.shape).normal_(0.0, std, generator=stream(seed, key))
    t.copy_(values)  # a blocking copy: the buffer is free again when it returns
