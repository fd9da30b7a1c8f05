"""FP8 numerics counters of a step: what the quantisers saw, gathered on the device (no host sync).

The quantisers of `kernels.fp8` (and the FP8 permute) take an optional `stats` row and add into it
with atomics; without one they run exactly as before. A buffer is int64 [KINDS, FIELDS]:

  kinds   activations (x, the SwiGLU output; forward rows and the weight gradients' token copies;
          x counted once per token where a layer quantises its tokens for all their pairs,
          `permute.quantize_then_permute` in mode single at top-k 3 or more, once per served
          pair elsewhere),
          weights (the 128 x 128 block copies), gradients (dy, dh13: rows and token copies),
          dense (every operand of the FP8 dense projections, `kernels.fp8_dense`: blockwise, the
          default, through the experts' quantisers `fp8.quantize_rows` / `quantize_blocks`; rowwise
          through `kernels.fp8_rowwise`'s atomics on CUDA, torch ops on the CPU)
  fields  AMAX       max |x| / scale over finite elements, as the bits of a non-negative fp32
                     (integer order = float order, so an integer atomic max keeps it)
          SATURATED  finite elements with |x| / scale > SATURATION_BOUND: clipped by the clamp
          UNDERFLOW  finite nonzero elements that quantise to zero
          TOTAL      elements quantised (padding rows and columns past the edges not counted)
          NONFINITE  inf or NaN inputs: an inf makes its group's scale inf; a NaN may be dropped by
                     the GPU's max and quantise to 448, so the inputs are checked, not the scales

By construction (scale = amax / 448) AMAX is 448 up to one fp32 rounding and SATURATED is zero;
a nonzero SATURATED or NONFINITE means the recipe no longer holds. Pure torch (no triton import):
the trainer reads and resets a buffer through `Fp8Stats`.
"""

from __future__ import annotations

import torch

KINDS = ("activations", "weights", "gradients", "dense")
ACTIVATIONS, WEIGHTS, GRADIENTS, DENSE = range(4)
AMAX, SATURATED, UNDERFLOW, TOTAL, NONFINITE = range(5)
FIELDS = 5
# Saturated: |x| / scale beyond where rounding to e4m3 would still give 448 (448 + half its top
# step of 32), so the clamp changed the value. Not 448 itself: the element at a group's amax lands
# on 448 + 1 fp32 ulp in about 9% of groups (the scale's rounding), which is no loss at all.
E4M3_MAX = 448.0  # the largest finite e4m3 value: every FP8 recipe's scale is amax / E4M3_MAX
SATURATION_BOUND = 464.0


class Fp8Stats:
    """One device buffer of counters (module docstring) with its host-side reading.

    `row(kind)` is what a quantiser takes; `reset` zeroes it in place (a captured step keeps the
    address); `fields(values)` turns one host copy of `buffer` (flattened, any number type) into
    a step record's fields."""

    def __init__(self, device: torch.device | str) -> None:
        self.buffer = torch.zeros((len(KINDS), FIELDS), dtype=torch.int64, device=device)

    def row(self, kind: int) -> torch.Tensor:
        return self.buffer[kind]

    def reset(self) -> None:
        self.buffer.zero_()

    def nonfinite_flag(self) -> torch.Tensor:
        """fp32 device scalar, 1.0 where any kind saw an inf or NaN so far, else 0.0 (no host wait):
        the `skip` of the optimizer's step (`FlatAdamW.step`)."""
        return (self.buffer[:, NONFINITE].sum() > 0).float()

    @staticmethod
    def fields(values) -> dict:
        """Step-record fields from a host copy of the buffer (`values`: its KINDS x FIELDS numbers
        in order): fp8_amax (max over kinds), fp8_saturated_share and fp8_underflow_share (over all
        elements quantised), the same per kind in fp8_by_kind, and fp8_nonfinite: the kinds that
        saw an inf or NaN (empty when none)."""
        rows = [[int(v) for v in values[k * FIELDS:(k + 1) * FIELDS]] for k in range(len(KINDS))]
        by_kind = {name: _summary(row) for name, row in zip(KINDS, rows, strict=True)}
        total = sum(row[TOTAL] for row in rows)
        return {
            "fp8_amax": max(_amax(row[AMAX]) for row in rows),
            "fp8_saturated_share": sum(row[SATURATED] for row in rows) / total if total else 0.0,
            "fp8_underflow_share": sum(row[UNDERFLOW] for row in rows) / total if total else 0.0,
            "fp8_by_kind": by_kind,
            "fp8_nonfinite": [name for name, row in zip(KINDS, rows, strict=True) if row[NONFINITE]],
        }


def _amax(bits: int) -> float:
    return torch.tensor([bits], dtype=torch.int32).view(torch.float32).item()


def _summary(row: list[int]) -> dict:
    total = row[TOTAL]
    return {"amax": _amax(row[AMAX]), "saturated_share": row[SATURATED] / total if total else 0.0,
            "underflow_share": row[UNDERFLOW] / total if total else 0.0, "elements": total,
            "nonfinite": row[NONFINITE]}


def stats_reference(x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor, valid: torch.Tensor | None = None) -> list:
    """Plain torch counters of one quantisation (x fp32, scale broadcastable to it, q its e4m3
    values; `valid` a mask of the elements that count): [AMAX as a float, SATURATED, UNDERFLOW,
    TOTAL, NONFINITE], what a kernel adds into its row."""
    x = x.float()
    valid = torch.ones_like(x, dtype=torch.bool) if valid is None else valid.expand_as(x)
    finite = valid & x.isfinite()
    scaled = (x / scale).abs()
    amax = torch.where(finite & scaled.isfinite(), scaled, 0.0).max().item() if x.numel() else 0.0
    return [amax, int((finite & (scaled > SATURATION_BOUND)).sum()),
            int((finite & (x != 0) & (q.float() == 0)).sum()), int(valid.sum()), int((valid & ~x.isfinite()).sum())]


# --- the counters of several ranks (the distributed modes) -------------------------------------
#
# Every rank of a distributed run sums the same float64 words once per step, over the collective
# its gradient norm already uses (`runtime.cluster.worker`: the world group, or the GPU stream over
# the nvshmem arena on shared GPUs). A sum suits the counts, not the amax: so each rank puts its
# per-kind amax into its own slot of a [ranks, KINDS] block, zeros elsewhere, the sum gathers them
# all, and every rank takes the max of the same numbers. Integers (counts, amax bits < 2^31) are
# exact in float64 below 2^53, so every rank ends with the same buffer, whatever order it summed
# in: the skip flag derived from it (`reduced_nonfinite_flag`) agrees on every rank.

COUNTS = (SATURATED, UNDERFLOW, TOTAL, NONFINITE)  # summed over ranks; AMAX is maxed
# the counts are the fields after AMAX: a slice, not a list index (a list would be copied from the
# host to the device on every use, which a step under `forbid_host_syncs` may not do)
_COUNTS = slice(AMAX + 1, FIELDS)
assert COUNTS == tuple(range(FIELDS))[_COUNTS]


def sum_words(world_size: int) -> int:
    """float64 words one rank adds into the step's all-ranks sum for its FP8 counters."""
    return len(KINDS) * len(COUNTS) + world_size * len(KINDS)


def pack_for_sum(buffer: torch.Tensor | None, rank: int, world_size: int,
                 device: torch.device | str | None = None) -> torch.Tensor:
    """float64 [sum_words(world_size)]: this rank's share of the all-ranks sum, from its
    `Fp8Stats.buffer` (None: a rank without FP8 experts, e.g. an attention rank, adds zeros)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not one of {world_size} ranks")
    if buffer is None:
        return torch.zeros(sum_words(world_size), dtype=torch.float64, device=device)
    counts = buffer[:, _COUNTS].flatten().double()
    slots = torch.zeros((world_size, len(KINDS)), dtype=torch.float64, device=buffer.device)
    slots[rank] = buffer[:, AMAX].double()
    return torch.cat([counts, slots.flatten()])


def unpack_sum(summed: torch.Tensor, world_size: int) -> torch.Tensor:
    """The int64 [KINDS, FIELDS] buffer of the whole step from the summed words (`pack_for_sum`
    of every rank, added): each count summed over ranks, each kind's amax the max over ranks."""
    if summed.shape != (sum_words(world_size),):
        raise ValueError(f"expected {sum_words(world_size)} summed words for {world_size} ranks, "
                         f"got {tuple(summed.shape)}")
    n = len(KINDS) * len(COUNTS)
    out = torch.zeros((len(KINDS), FIELDS), dtype=torch.int64, device=summed.device)
    out[:, _COUNTS] = summed[:n].view(len(KINDS), len(COUNTS)).round().to(torch.int64)
    out[:, AMAX] = summed[n:].view(world_size, len(KINDS)).amax(dim=0).round().to(torch.int64)
    return out


def reduced_nonfinite_flag(buffer: torch.Tensor) -> torch.Tensor:
    """fp32 device scalar, 1.0 where any rank's quantisers saw an inf or NaN this step (`buffer`:
    `unpack_sum`'s, the same on every rank): the `skip` every rank's optimizer step takes."""
    return (buffer[:, NONFINITE].sum() > 0).float()
