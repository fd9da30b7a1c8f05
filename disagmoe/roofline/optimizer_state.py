"""Training-state bytes per parameter, as `runtime/state/flat_adamw.py` holds them.

    state_bytes(state_dtype, compute_dtype, zero1_ranks, offload) -> StateBytes(weights, grads, moments, host)
    staging_bytes(bucket_bytes, state_dtype, compute_dtype, largest) -> device bytes of offload's two slots
    host_link_bytes(state_dtype, compute_dtype, zero1_ranks) -> bytes per parameter each way per step

The one price of a parameter's optimizer state. The planner (placement/cost.py) and the check before
a run starts (runtime/cluster/driver.py) both call it, so the two cannot drift apart.

What FlatAdamW keeps per parameter of a bucket. D is the ZeRO-1 group (`optim.shard_states`). The
runtime shards a replicated bucket only when D > 1; D = 1 means unsharded.
  - the compute copy: 2 bytes (bf16) or 4 (fp32), kept whole
  - the fp32 main gradient: 4, kept whole (the reduce-scatter reads all of it)
  - the fp32 master: 4 / D. None in fp32 compute, where the compute copy is the master.
  - AdamW's exp_avg and exp_avg_sq: 2 x 4 / D (fp32) or 2 x 2 / D (bf16, `optim.state_dtype`)
  - sharded only: the slice's reduced fp32 gradient, 4 / D
Unsharded that is 2 + 4 + 4 + 8 = 18 bytes (bf16 compute, fp32 moments), 14 with bf16 moments;
fp32 compute gives 16 and 12.

Offloaded (`offload_optimizer`, runtime/state/offload.py): the master and the moments live in host
memory (`host`, not part of `total`, the device's bytes) and cross the host link twice per step,
in and out (`host_link_bytes`: 12 bytes each way with fp32 moments, 8 with bf16); the bf16 copy is
refreshed on the device, the gradient stays there. The device holds two staging slots instead
(`staging_bytes`, a constant per rank, not per parameter). fp32 compute keeps its master (the
parameters) on the device and offloads only the moments.

Torch-free: `disagmoe plan` imports it. `zero1_ranks` may be a numpy array (one element per
candidate layout).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
FP32_BYTES = 4


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter on one rank, by what they hold (each a float, or an array like `zero1_ranks`)."""

    weights: Any  # the compute copy, plus the fp32 master where it is a separate tensor
    grads: Any  # the fp32 main gradient, plus (ZeRO-1) the slice's reduced gradient
    moments: Any  # AdamW's exp_avg and exp_avg_sq
    host: Any = 0  # offloaded: the master and moments in host memory (not in `total`)

    @property
    def total(self) -> Any:
        """Device bytes per parameter."""
        return self.weights + self.grads + self.moments


def state_bytes(state_dtype: str, compute_dtype: str = "bf16", zero1_ranks: Any = 1,
                offload: bool = False) -> StateBytes:
    """Bytes per parameter of FlatAdamW's state (module docstring). `state_dtype` is the moments'
    dtype and `compute_dtype` the parameters' ('fp32' or 'bf16'). `zero1_ranks` is the ZeRO-1
    group that splits the master, the moments and the reduced slice (1: unsharded). `offload`: the
    master and moments are counted in `host` instead of on the device."""
    if state_dtype not in DTYPE_BYTES or compute_dtype not in DTYPE_BYTES:
        raise ValueError(f"state dtype {state_dtype!r} / compute dtype {compute_dtype!r}: each must be one of "
                         f"{sorted(DTYPE_BYTES)}")
    share = 1.0 / zero1_ranks
    sharded = zero1_ranks > 1  # a bool, or a bool array: the runtime shards only a group of two or more
    master = 0 if compute_dtype == "fp32" else FP32_BYTES
    moments = 2 * DTYPE_BYTES[state_dtype] * share
    grads = FP32_BYTES + FP32_BYTES * share * sharded
    if offload:
        return StateBytes(weights=DTYPE_BYTES[compute_dtype], grads=grads, moments=0 * share,
                          host=master * share + moments)
    return StateBytes(weights=DTYPE_BYTES[compute_dtype] + master * share, grads=grads, moments=moments)


def host_link_bytes(state_dtype: str, compute_dtype: str = "bf16", zero1_ranks: Any = 1) -> Any:
    """Bytes per parameter an offloaded step moves over the host link in each direction: the master
    and the moments in (h2d) and the same out (d2h). Both directions run at once (full duplex)."""
    return state_bytes(state_dtype, compute_dtype, zero1_ranks, offload=True).host


def slot_elements(bucket_bytes: int, state_dtype: str, compute_dtype: str, largest: int) -> int:
    """Elements per staging slot: as many of (master, two moments) as fit `bucket_bytes`, no more
    than the largest bucket slice needs (a small model does not hold two 256 MiB slots it never fills)."""
    per_element = (0 if compute_dtype == "fp32" else FP32_BYTES) + 2 * DTYPE_BYTES[state_dtype]
    return max(1, min(bucket_bytes // per_element, largest))


def staging_bytes(bucket_bytes: int, state_dtype: str, compute_dtype: str, largest: int) -> int:
    """Device bytes of offload's staging area (runtime/state/offload.py): two slots of `slot_elements`
    masters and moments, plus one slot's fp32 scratch for both moments when they are bf16."""
    elements = slot_elements(bucket_bytes, state_dtype, compute_dtype, largest)
    per_element = (0 if compute_dtype == "fp32" else FP32_BYTES) + 2 * DTYPE_BYTES[state_dtype]
    scratch = 2 * FP32_BYTES if state_dtype == "bf16" else 0
    return elements * (2 * per_element + scratch)
