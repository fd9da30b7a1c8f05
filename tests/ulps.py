"""Distances between floating-point results for the optimizer tests: raw ulps of a result, and
half-ulps of the operands the last operation combined (the bound where a result cancels)."""

from __future__ import annotations

import torch

HALF_ULP = 2.0**-24  # half an fp32 ulp at 1: one correctly rounded fp32 operation's relative error, at most


def raw_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units in the last place of their dtype (fp32 or bf16), by ordered bit patterns."""
    bits, sign = {torch.float32: (torch.int32, 0x7FFFFFFF), torch.bfloat16: (torch.int16, 0x7FFF)}[a.dtype]

    def ordered(x: torch.Tensor) -> torch.Tensor:
        i = x.view(bits).long()
        return torch.where(i < 0, -(i & sign), i)

    return (ordered(a) - ordered(b)).abs()


def operand_half_ulps(got: torch.Tensor, want: torch.Tensor, operands: torch.Tensor) -> torch.Tensor:
    """|got - want| in fp32 half-ulps of `operands` (the magnitude of what the last operation
    combined, e.g. |master before| + |update|): raw ulps of the result are no bound where the
    terms nearly cancel (a master of 1e-3 moved by 1e-3: one ulp of the update is 30 of the result)."""
    return (got.double() - want.double()).abs() / (HALF_ULP * operands.double()).clamp_min(2.0**-149)


def adamw_master_tolerance(master_before: torch.Tensor, master: torch.Tensor, exp_avg: torch.Tensor,
                           exp_avg_operands: torch.Tensor, exp_avg_sq: torch.Tensor,
                           exp_avg_sq_operands: torch.Tensor, decay: float = 0.0,
                           moment_half_ulps: float = 8.0) -> torch.Tensor:
    """How far two AdamW implementations' new masters may lie apart (fp64, elementwise) when their
    moments differ by up to `moment_half_ulps` of their operands (`operand_half_ulps`): 3 ulps of
    |master before| + |master change| for the update's own roundings, plus the relative error its
    moments carry into the Adam term u = master before (1 - decay) - master (`decay` = lr x weight
    decay): |u| (e_m / |m| + e_v / 2v), at most 2|u| (m may change sign). Where exp_avg nearly
    cancels (b1 m and (1 - b1) g of opposite signs) one ulp of its operands is many of it, and of
    the update: on an H200 (2026-12-04) masters were 20 half-ulps of |master| + |update| apart at
    the second step."""
    before64, master64 = master_before.double(), master.double()
    adam_term = (before64 * (1.0 - decay) - master64).abs()
    tiny = 2.0**-149
    rel_m = moment_half_ulps * HALF_ULP * exp_avg_operands.double() / exp_avg.double().abs().clamp_min(tiny)
    rel_v = moment_half_ulps * HALF_ULP * exp_avg_sq_operands.double() / exp_avg_sq.double().clamp_min(tiny)
    carried = torch.where(adam_term == 0, 0.0, adam_term * (rel_m + rel_v / 2).clamp_max(2.0))
    return 6 * HALF_ULP * (before64.abs() + (master64 - before64).abs()) + carried


def over_tolerance(got: torch.Tensor, want: torch.Tensor, tolerance: torch.Tensor) -> float:
    """The largest |got - want| / tolerance: at most 1 passes."""
    return float(((got.double() - want.double()).abs() / tolerance.clamp_min(2.0**-149)).max())


def bf16_moment_apart(got: torch.Tensor, want: torch.Tensor, operands: torch.Tensor) -> torch.Tensor:
    """|got - want| of two bf16 moments over what they may differ by: their fp32 values within 8 fp32
    half-ulps of `operands` (as `operand_half_ulps` bounds fp32 moments), each then rounded to
    nearest bf16, which adds at most one bf16 ulp (2^-7 of the larger magnitude). At most 1 passes."""
    got64, want64 = got.double(), want.double()
    allowed = 8 * HALF_ULP * operands.double() + 2.0**-7 * torch.maximum(got64.abs(), want64.abs())
    return (got64 - want64).abs() / allowed.clamp_min(2.0**-149)
