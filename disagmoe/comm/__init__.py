"""Transports: point-to-point tensor messages between ranks behind one interface (base.py).

`make_transport` picks the implementation named by `TrainConfig.transport`; each is imported
only when chosen, so CPU-only installs never touch CUDA code.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from disagmoe.comm.base import Transport

if TYPE_CHECKING:
    from disagmoe.comm.symmetric import ArenaLayout


def make_transport(
    kind: str, default_timeout_s: float, pairs: Iterable[tuple[int, int]] | None = None,
    layouts: Sequence["ArenaLayout"] | None = None,
) -> Transport:
    """The transport `kind` over the already-initialised default process group.

    `pairs`: the (src, dst) rank pairs that exchange messages (`Schedule.rank_pairs()`); the
    nccl transport connects only these, the local one needs no connections of its own.
    `layouts`: every rank's receive arena (`comm.symmetric.symmetric_layouts`), for nvshmem.
    """
    if kind == "local":
        from disagmoe.comm.local import LocalTransport

        return LocalTransport(default_timeout_s=default_timeout_s)
    if kind == "nccl":
        from disagmoe.comm.nccl import NcclTransport

        return NcclTransport(pairs=pairs, default_timeout_s=default_timeout_s)
    if kind == "nvshmem":
        from disagmoe.comm.nvshmem import NvshmemTransport, _nvshmem

        _nvshmem()  # installed, or the error says what to install
        if layouts is None:
            raise ValueError("the nvshmem transport needs every rank's receive arena layout "
                             "(comm.symmetric.symmetric_layouts over the run's programs)")
        return NvshmemTransport(layouts, default_timeout_s=default_timeout_s)
    raise ValueError(f"unknown transport {kind!r}; choose local (CPU, gloo), nccl (GPU) or nvshmem (GPU, NVLink)")
