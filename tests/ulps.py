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
