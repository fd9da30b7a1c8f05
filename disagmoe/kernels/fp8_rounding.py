"""The FP8 recipe's rounding: e4m3 values and their fp32 scales, as Triton functions every quantising
kernel shares (`kernels.fp8`'s quantisers, `kernels.grouped_gemm`'s SwiGLU epilogue that writes the down
GEMM's FP8 input), kept apart so that a kernel module can quantise without importing `kernels.fp8`
(which imports `grouped_gemm`). Compiled, the hardware's conversions; under the CPU interpreter the
e4m3 rounding in integer arithmetic (`kernels.fp8`'s docstring says why). This module reads
TRITON_INTERPRET when it loads: the tests' `interpreted` fixture reloads it before the kernel modules.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from disagmoe.kernels.fp8_stats import E4M3_MAX, SATURATION_BOUND

SCALE_BLOCK = 128  # the recipe's group and block edge
# Floor on a group's amax: an all-zero group gets a finite scale (and dequantises to 0); 1e-30
# keeps the scale a normal fp32 (1e-30 / 448 > 2^-126) and the recipe scale-free above it.
AMAX_FLOOR = 1e-30
FP8 = torch.float8_e4m3fn

_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_SCALE_BLOCK = tl.constexpr(SCALE_BLOCK)
_SATURATION_BOUND = tl.constexpr(SATURATION_BOUND)
# the interpreter's fp8 cast rounds wrongly (module docstring): emulate it there, else the hardware's
# (the test fixture reloads this module with TRITON_INTERPRET set, so this is read per build)
_HARDWARE_ROUNDING = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"))


# --- rounding and quantising rows (1 x 128 groups along K) and weights (128 x 128 blocks)

@triton.jit
def _round_to_e4m3(v):
    """v (fp32) rounded to the nearest e4m3 value (ties to even, saturating at +-448), as fp32.
    Compiled: the hardware's conversion (`cvt.rn.satfinite`), and back. Interpreted: integer
    arithmetic on the fp32 bits (`_round_to_e4m3_emulated`)."""
    if _HARDWARE_ROUNDING:
        return _e4m3(v).to(tl.float32)
    else:
        return _round_to_e4m3_emulated(v)


@triton.jit
def _e4m3(v):
    """`_round_to_e4m3(v)` as float8e4nv values (one conversion where only the e4m3 values are stored)."""
    if _HARDWARE_ROUNDING:
        # clamped first as the emulation clamps (its min drops a NaN: +-448 by the sign bit), so the
        # two agree on every fp32 bit pattern, not only on finite values
        a = tl.minimum(tl.abs(v), _E4M3_MAX)
        sign = (v.to(tl.int32, bitcast=True) >> 31) << 31
        return (a.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True).to(tl.float8e4nv)
    else:
        return _round_to_e4m3_emulated(v).to(tl.float8e4nv)


@triton.jit
def _round_to_e4m3_emulated(v):
    """`_round_to_e4m3` in integer arithmetic on the fp32 bits: the value is n x 2^k with n = v's
    24-bit significand shifted right by `shift` (20 keeps e4m3's 3 mantissa bits; more below 2^-6,
    e4m3's subnormals, whose quantum is 2^-9; 25 or more leaves nothing) and rounded on the bits
    shifted out."""
    a = tl.minimum(tl.abs(v), 448.0)
    bits = a.to(tl.int32, bitcast=True)
    biased = bits >> 23  # a >= 0: no sign bit
    sig = (bits & 0x7FFFFF) | 0x800000
    shift = tl.minimum(tl.maximum(141 - biased, 20), 25)
    n = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    n += ((rem > half) | ((rem == half) & ((n & 1) == 1))).to(tl.int32)
    quantum = ((biased - 23 + shift) << 23).to(tl.float32, bitcast=True)  # 2^(biased - 150 + shift)
    r = (n.to(tl.float32) * quantum).to(tl.int32, bitcast=True)  # n <= 16: exact
    sign = (v.to(tl.int32, bitcast=True) >> 31) << 31  # v's sign bit (Triton's -r is 0 - r: no -0.0)
    return (r | sign).to(tl.float32, bitcast=True)


@triton.jit
def _scale_of(amax):
    """Group scale: max(amax, AMAX_FLOOR) / 448, correctly rounded (as torch divides)."""
    return tl.math.div_rn(tl.maximum(amax, _AMAX_FLOOR), _E4M3_MAX)


# `_reciprocal_of`: scales below _TINY_SCALE are multiplied by _TINY_SCALE_UP (and x with them) first, so that
# `_quotient`'s remainder stays a normal fp32, exact (1e-30 / 448 > 2^-109).
_TINY_SCALE = tl.constexpr(2.0**-64)
_TINY_SCALE_UP = tl.constexpr(2.0**64)
_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_E4M3_MAX_RECIPROCAL = tl.constexpr(0.0022321429569274187)  # RN(1 / 448), an fp32 (0x3B124925)


@triton.jit
def _negated(v):
    """-v with its sign bit flipped for every v (Triton's unary minus is 0 - v: +0 for +0); folded into the
    FMA that takes it (an operand's negation), where 0 - v took an add of its own (ptxas sm_90a)."""
    return v * -1.0


@triton.jit
def _scale_by_fma(amax):
    """`_scale_of(amax)`'s bits. Compiled: a / 448 as q + (a - q 448) y, q = a y, y = RN(1 / 448) (Markstein's
    correction; div_rn's bits for every significand, a >= AMAX_FLOOR keeping the remainder normal; an inf amax
    kept inf), where div_rn took ten instructions and a branch a scale, and a token-group tile's thread holds
    8 to 16 columns. Interpreted: `_scale_of`."""
    if _HARDWARE_ROUNDING:
        a = tl.maximum(amax, _AMAX_FLOOR)
        q = a * _E4M3_MAX_RECIPROCAL
        return tl.where(a <= _FP32_MAX, tl.fma(tl.fma(q, _E4M3_MAX, _negated(a)), -_E4M3_MAX_RECIPROCAL, q), a)
    else:
        return _scale_of(amax)


@triton.jit
def _reciprocal_of(scale):
    """(up, s, y) of scales from `_scale_of` (normal, or +inf where x holds an inf) for `_quotient`: compiled, up
    = 2^64 for a scale under 2^-64 (its quotients' remainders would underflow; a power of two: the same
    quotients), else 1, s = scale x up (clamped to the largest fp32: x / inf = x y = +-0, inf / inf NaN, as
    div_rn), y = RN(1 / (scale x up)); interpreted, (1, scale, 1) (`_quotient` divides)."""
    if _HARDWARE_ROUNDING:
        up = tl.where(scale < _TINY_SCALE, _TINY_SCALE_UP, 1.0)
        s = scale * up
        return up, tl.minimum(s, _FP32_MAX), tl.math.div_rn(1.0, s)
    else:
        return tl.full(scale.shape, 1.0, tl.float32), scale, tl.full(scale.shape, 1.0, tl.float32)


@triton.jit
def _quotient(x, up, s, y):
    """x / scale from the scale's `_reciprocal_of` (broadcast to x's shape), |x| <= 448 scale: div_rn's bits
    wherever the quotient reaches 2^-11 (below, an underflowing remainder may move its last bits: still
    under 2^-10, it rounds to e4m3's 0 by x's sign as div_rn's does). Compiled: two multiplies and two FMAs
    an element (Markstein's correction: q = x y, r = q s - x exact, q - r y rounds to x / s; -0 / s = -0 by
    r's sign, q s - x not x - q s; `_negated`), where div_rn took ten instructions and a branch around a
    call to its slow path (ptxas sm_90a); emulated exactly in numpy by tests/kernels/test_fp8.py.
    Interpreted: div_rn (the interpreter's fma rounds twice)."""
    if _HARDWARE_ROUNDING:
        x = x * up
        q = x * y
        return tl.fma(tl.fma(q, s, _negated(x)), _negated(y), q)
    else:
        return tl.math.div_rn(x, tl.broadcast_to(s, x.shape))


@triton.jit
def _divided_by(x, scale, AXIS: tl.constexpr):
    """x / scale correctly rounded (`_quotient`), scale fp32 [rows] (AXIS 1: one a row of x) or [columns]
    (AXIS 0) from `_scale_of`."""
    up, s, y = _reciprocal_of(scale)
    if AXIS == 1:
        return _quotient(x, up[:, None], s[:, None], y[:, None])
    else:
        return _quotient(x, up[None, :], s[None, :], y[None, :])


@triton.jit
def _quantized_rows(x):
    """The 1 x 128 recipe on x fp32 [rows, group] (zeros where masked): (each row's amax, its scale,
    x / scale, its e4m3 values as fp32)."""
    row_amax = tl.max(tl.abs(x), axis=1)
    scale = _scale_of(row_amax)
    scaled = tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))
    return row_amax, scale, scaled, _round_to_e4m3(scaled)


@triton.jit
def _quantize_group_store(x, ok, row_ok, rows64, ks, group, q_ptr, s_ptr, stride_qm, stride_qk, stride_sm,
                          stride_sg):
    """Quantise one 1 x 128 group of some rows, x fp32 [rows, 128] (zeros outside ok), to the bits
    `_rows_tile` writes (`_quantized_rows`): q stored at columns ks, each row's scale at group `group`.
    Compiled, the scale and x / scale by their FMA forms (`_scale_by_fma`, `_divided_by`: div_rn's bits,
    a few instructions an element where div_rn took ten and a branch), as the token-group quantiser
    divides: the epilogues that call this (the SwiGLU GEMM's, the SwiGLU gradient's, the combine
    backward's) quantise beside other work, where the instructions count (session 40, H100: the three kernels' GPU
    bit tests pass with it; of the two epilogues on two shapes, three of the four beat their passes and the fourth
    is even: `bench quantise --epilogues`, docs/benchmarks.md). Interpreted, `_quantized_rows`'."""
    scale = _scale_by_fma(tl.max(tl.abs(x), axis=1))
    q = _e4m3(_divided_by(x, scale, 1))
    tl.store(q_ptr + rows64[:, None] * stride_qm + ks[None, :] * stride_qk, q.to(q_ptr.dtype.element_ty), mask=ok)
    tl.store(s_ptr + rows64 * stride_sm + group * stride_sg, scale, mask=row_ok)
