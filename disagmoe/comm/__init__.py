"""Transports: point-to-point tensor messages between ranks behind one interface (base.py).

`make_transport` picks the implementation named by `TrainConfig.transport`; each is imported
only when chosen, so CPU-only installs never touch CUDA code.
"""

from __future__ import annotations

from collections.abc import Iterable

from disagmoe.comm.base import Transport


def make_transport(
    kind: str, default_timeout_s: float, pairs: Iterable[tuple[int, int]] | None = None
) -> Transport:
    """The transport `kind` over the already-initialised default process group.

    `pairs`: the (src, dst) rank pairs that exchange messages (`Schedule.rank_pairs()`); the
    nccl transport connects only these, the local one needs no connections of its own.
    """
    if kind == "local":
        from disagmoe.comm.local import LocalTransport

        return LocalTransport(default_timeout_s=default_timeout_s)
    if kind == "nccl":
        from disagmoe.comm.nccl import NcclTransport

        return NcclTransport(pairs=pairs, default_timeout_s=default_timeout_s)
    if kind == "nvshmem":
        raise ValueError(
            "transport 'nvshmem' is not available in this build; use transport: local (CPU) or nccl (GPU)"
        )
    raise ValueError(f"unknown transport {kind!r}; choose local (CPU, gloo) or nccl (GPU)")
