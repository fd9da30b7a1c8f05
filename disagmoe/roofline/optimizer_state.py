"""Training-state bytes per parameter, as `runtime/state/flat_adamw.py` holds them.

    state_bytes(state_dtype, compute_dtype, zero1_ranks) -> StateBytes(weights, grads, moments)

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

    @property
    def total(self) -> Any:
        return self.weights + self.grads + self.moments


def state_bytes(state_dtype: str, compute_dtype: str = "bf16", zero1_ranks: Any = 1) -> StateBytes:
    """Bytes per parameter of FlatAdamW's state (module docstring). `state_dtype` is the moments'
    dtype and `compute_dtype` the parameters' ('fp32' or 'bf16'). `zero1_ranks` is the ZeRO-1
    group that splits the master, the moments and the reduced slice (1: unsharded)."""
    if state_dtype not in DTYPE_BYTES or compute_dtype not in DTYPE_BYTES:
        raise ValueError(f"state dtype {state_dtype!r} / compute dtype {compute_dtype!r}: each must be one of "
                         f"{sorted(DTYPE_BYTES)}")
    share = 1.0 / zero1_ranks
    sharded = zero1_ranks > 1  # a bool, or a bool array: the runtime shards only a group of two or more
    master = 0 if compute_dtype == "fp32" else FP32_BYTES
    return StateBytes(weights=DTYPE_BYTES[compute_dtype] + master * share,
                      grads=FP32_BYTES + FP32_BYTES * share * sharded,
                      moments=2 * DTYPE_BYTES[state_dtype] * share)
