"""FP8 dense linear y = x W^T (attention projections, shared experts, dense FFN layers) on torch's
own kernel, `torch._scaled_mm`, under `precision: fp8` (`TrainConfig.fp8_dense`).

Recipe "rowwise, bf16 weight gradient" (`RECIPE`; torchao's ROWWISE_WITH_GW_HP, which it calls its
most accurate), not the routed experts' fine-grained one (`kernels.fp8`): `torch._scaled_mm` takes
one fp32 scale per row of A ([M, 1]) and per column of B ([1, N]), so each FP8 operand gets one
scale (amax / 448) per row along the GEMM's contraction, e4m3 values, fp32 accumulation, bf16 out:

  forward  y_NO  = x_NI W_OI^T   e4m3: x per token (over I), W per output feature (over I)
  dgrad    dx_NI = dy_NO W_OI    e4m3: dy per token (over O), W per input feature (over O)
  wgrad    dW_OI = dy_NO^T x_NI  bf16 (`model.layers`: into the fp32 main gradient by the GEMM)

Why the weight gradient stays bf16: it contracts the tokens, so row-wise scales there are one per
feature over every token of the micro-batch, and each token's gradient is rounded against the
largest of some 32k tokens' (late in training a few mispredicted tokens' gradients are orders
above the rest). Session 18's 300-step parity run with all three GEMMs in e4m3 learned more slowly
than bf16 from step 127 on (+82% loss at step 300, no overflow). It also drops the two transposed
quantisations per call (x^T and dy^T: the quantiser's slowest launches, few long rows).

The quantiser is one Triton launch on CUDA (`kernels.fp8_rowwise`; transposed operands read in
place), plain torch on the CPU, the same bits. The bf16 weight stays the parameter; its two e4m3
copies (`Fp8WeightCopies`) are made once per optimizer step by `DeferrableLinear.prepare_fp8`,
reused by every micro-batch, never checkpointed. `emulate=True`: dequantise-then-matmul in fp64 on
the same quantised operands instead of the library GEMM (the tests' reference, and the numerics check
`TrainConfig.fp8_emulate`: the FP8 format without the FP8 kernel, slower than bf16). torch 2.13 also has a CPU
`torch._scaled_mm` (the CPU tests run it). Every quantisation can add into an `Fp8Stats` row (kind
"dense"; W's once per refresh). A linear's input read by several linears in a row (q, k and v's x;
a SwiGLU's gate and up) is quantised once for them all (`quantize_input`), and counted once.

Shape legend: N tokens, I input features, O output features; M / K a GEMM's rows / contraction.
"""

from __future__ import annotations

import functools
import os
import threading

import torch

from disagmoe.kernels.fp8_stats import AMAX, E4M3_MAX, NONFINITE, SATURATED, SATURATION_BOUND, TOTAL, UNDERFLOW

RECIPE = "rowwise, bf16 weight gradient"
E4M3 = torch.float8_e4m3fn
ALIGN = 16  # torch._scaled_mm: every GEMM dimension but M (the tokens, here) a multiple of 16


def quantize_rowwise(x_MK: torch.Tensor, stats_row: torch.Tensor | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_MK e4m3 row-major, scale_M1 fp32) with x ~= q * scale: one scale per row, amax / 448 (a
    zero row gets scale 1 and quantises to zeros). x any strides (a transposed view is read in
    place on the kernel). `stats_row`: an `Fp8Stats` row to add the counters into (device ops, no
    host sync). `out`: (q_MK, scale_M1) buffers to write into. On CUDA (and under Triton's
    interpreter) one Triton launch (`kernels.fp8_rowwise`), else `quantize_rowwise_reference`:
    the same bits."""
    # the interpreter's CPU path wants fp8_rowwise built under it (the tests' `interpreted` fixture)
    if x_MK.is_cuda or os.environ.get("TRITON_INTERPRET") == "1":
        from disagmoe.kernels import fp8_rowwise

        return fp8_rowwise.quantize_rowwise(x_MK, stats_row, out)
    q_MK, scale_M1 = quantize_rowwise_reference(x_MK, stats_row)
    if out is None:
        return q_MK, scale_M1
    out[0].copy_(q_MK)
    out[1].copy_(scale_M1)
    return out


def quantize_rowwise_reference(x_MK: torch.Tensor, stats_row: torch.Tensor | None = None,
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch `quantize_rowwise` (the CPU path): several passes over x (and six more for the
    counters). A row holding a NaN gets scale 1 (amax propagates it; NaN > 0 is false)."""
    x32 = x_MK.float().contiguous()  # row-major: B operands are this, transposed (column-major)
    amax_M1 = x32.abs().amax(dim=-1, keepdim=True)
    # / a device 448: CUDA torch divides by a host scalar as a multiply by its reciprocal (not
    # correctly rounded); by a tensor exactly, as the kernel's div_rn
    e4m3_max = torch.full((), E4M3_MAX, dtype=torch.float32, device=x32.device)
    scale_M1 = torch.where(amax_M1 > 0, amax_M1 / e4m3_max, torch.ones_like(amax_M1))
    scaled = x32 / scale_M1
    q_MK = scaled.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)  # clamp: NaN stays NaN, counted below
    if stats_row is not None:
        _count(stats_row, x32, scaled, q_MK)
    return q_MK, scale_M1


def _count(row: torch.Tensor, x32: torch.Tensor, scaled: torch.Tensor, q: torch.Tensor) -> None:
    """Add one quantisation's counters into `row` (`kernels.fp8_stats` fields), on the device."""
    finite = x32.isfinite()
    mag = scaled.abs()
    amax = torch.where(finite & mag.isfinite(), mag, 0.0).amax() if x32.numel() else x32.new_zeros(())
    bits = amax.reshape(1).view(torch.int32).to(torch.int64)
    row[AMAX:AMAX + 1] = torch.maximum(row[AMAX:AMAX + 1], bits)
    row[SATURATED] += (finite & (mag > SATURATION_BOUND)).sum()
    row[UNDERFLOW] += (finite & (x32 != 0) & (q.float() == 0)).sum()
    row[TOTAL] += x32.numel()
    row[NONFINITE] += (~finite).sum()


def scaled_mm(a_MK: torch.Tensor, scale_a_M1: torch.Tensor, b_KN: torch.Tensor, scale_b_1N: torch.Tensor,
              out_dtype: torch.dtype, emulate: bool = False) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b), e4m3 operands, `b_KN` column-major (a transposed row-major
    tensor). `emulate` (the tests' reference and `TrainConfig.fp8_emulate`): dequantise in fp64 and
    matmul, rounded once to `out_dtype`, instead of `torch._scaled_mm` (exact products of the same
    e4m3 values and scales, wider sums than its fp32 ones; no alignment needed)."""
    if emulate:
        return ((a_MK.double() * scale_a_M1.double()) @ (b_KN.double() * scale_b_1N.double())).to(out_dtype)
    return torch._scaled_mm(a_MK, b_KN, scale_a=scale_a_M1, scale_b=scale_b_1N, out_dtype=out_dtype)


def check_shape(in_features: int, out_features: int) -> None:
    """torch._scaled_mm wants the contraction and the output columns in multiples of 16."""
    if in_features % ALIGN or out_features % ALIGN:
        raise ValueError(f"an FP8 dense linear {in_features} -> {out_features}: torch._scaled_mm needs both "
                         f"dimensions multiples of {ALIGN}; set fp8_dense: false")


class Fp8WeightCopies:
    """The e4m3 copies of one weight W_OI that its GEMMs read, made once per optimizer step
    (`refresh`) and reused by every micro-batch of it: `rows` = (q_OI, s_O1), W per output feature
    over I (the forward's B operand), and `cols` = (q_IO, s_I1), W per input feature over O (the
    data gradient's). The buffers are allocated here, once; `refresh` writes into them in place
    (a captured CUDA graph replays into the same addresses) and counts W's two quantisations into
    its stats row: once per refresh, not once per micro-batch as without copies."""

    def __init__(self, w_OI: torch.Tensor) -> None:
        o, i = w_OI.shape
        empty = functools.partial(torch.empty, device=w_OI.device)
        self.rows = (empty((o, i), dtype=E4M3), empty((o, 1), dtype=torch.float32))
        self.cols = (empty((i, o), dtype=E4M3), empty((i, 1), dtype=torch.float32))
        self._seen: tuple | None = None  # `_identity(W)` at the last refresh

    @torch.no_grad()
    def refresh(self, w_OI: torch.Tensor, stats_row: torch.Tensor | None = None) -> None:
        """Quantise W into the copies (two launches on CUDA; W^T read in place)."""
        quantize_rowwise(w_OI, stats_row, out=self.rows)
        quantize_rowwise(w_OI.t(), stats_row, out=self.cols)
        self._seen = _identity(w_OI)

    def fits(self, w_OI: torch.Tensor) -> bool:
        """Whether the copies were refreshed from W as it is: host metadata only (no sync). It sees
        in-place writes through W itself (torch optimizers, `copy_`) and a re-seated W (`.data =`),
        not writes into W's storage from elsewhere: FlatAdamW writes its flat buffer, so the trainer
        refreshes after every optimizer step (`MoETransformer.prepare_fp8`)."""
        return self._seen == _identity(w_OI)


def _identity(w_OI: torch.Tensor) -> tuple:
    """W's version counter, storage address, dtype, shape and device: host metadata, no sync."""
    return w_OI._version, w_OI.data_ptr(), w_OI.dtype, tuple(w_OI.shape), w_OI.device


class Fp8Linear(torch.autograd.Function):
    """y = x W^T with the forward and data-gradient GEMMs in e4m3 and d W in bf16 (module
    docstring), returned to autograd. Saves the bf16 x and W: the data gradient's W is scaled along
    another dimension than the forward's, and the weight gradient reads x in bf16."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_OI: torch.Tensor, stats_row: torch.Tensor | None,
                emulate: bool) -> torch.Tensor:
        ctx.save_for_backward(x, w_OI)
        ctx.stats_row, ctx.emulate = stats_row, emulate
        return fprop(x, w_OI, stats_row, emulate)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w_OI = ctx.saved_tensors
        dy_NO = dy.reshape(-1, dy.shape[-1])
        dx = dgrad(dy_NO, w_OI, ctx.stats_row, ctx.emulate).view(x.shape) if ctx.needs_input_grad[0] else None
        dw = dy_NO.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None


class _SharedInputs(threading.local):
    """The last quantised forward input, with the tensor itself held, so the next linear that reads
    the same tensor takes the same e4m3 copy instead of quantising it again: q, k and v read one x,
    as do a SwiGLU's gate and up. Same tensor = same storage address, shape, strides, dtype and
    version counter while the held reference keeps the storage from being reused; and the same
    stats row (an input shared this way is counted once, not once per reader). Per thread."""

    def __init__(self) -> None:
        self.last: tuple[tuple, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None


_shared_inputs = _SharedInputs()


def quantize_input(x_MK: torch.Tensor, stats_row: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rowwise(x_MK, stats_row)` of a linear's input, reused when the previous input was
    the same tensor (`_SharedInputs`): one quantisation per input, not per reader."""
    key = (x_MK.data_ptr(), tuple(x_MK.shape), x_MK.stride(), x_MK.dtype, x_MK.device, x_MK._version,
           None if stats_row is None else id(stats_row))
    last = _shared_inputs.last
    if last is not None and last[0] == key:
        return last[2]
    result = quantize_rowwise(x_MK, stats_row)
    _shared_inputs.last = (key, x_MK, result)
    return result


def forget_shared_inputs() -> None:
    """Drop the held input and its copy (`_SharedInputs`): at the end of a step, or in tests."""
    _shared_inputs.last = None


def fprop(x: torch.Tensor, w_OI: torch.Tensor, stats_row: torch.Tensor | None = None,
          emulate: bool = False, copies: Fp8WeightCopies | None = None) -> torch.Tensor:
    """y = x W^T, x [..., I]: x scaled per token (its copy shared with the next linear reading the
    same x, `quantize_input`), W per output feature (both over I; `copies.rows` where given, else
    quantised here)."""
    x_NI = x.reshape(-1, x.shape[-1])
    qx_NI, sx_N1 = quantize_input(x_NI, stats_row)
    qw_OI, sw_O1 = copies.rows if copies is not None else quantize_rowwise(w_OI, stats_row)
    y_NO = scaled_mm(qx_NI, sx_N1, qw_OI.t(), sw_O1.t(), x.dtype, emulate)
    return y_NO.view(*x.shape[:-1], w_OI.shape[0])


def dgrad(dy_NO: torch.Tensor, w_OI: torch.Tensor, stats_row: torch.Tensor | None = None,
          emulate: bool = False, copies: Fp8WeightCopies | None = None) -> torch.Tensor:
    """dx_NI = dy_NO W_OI: dy scaled per token, W per input feature (both over O; `copies.cols`
    where given, else quantised here from W^T, read in place)."""
    qdy_NO, sdy_N1 = quantize_rowwise(dy_NO, stats_row)
    qw_IO, sw_I1 = copies.cols if copies is not None else quantize_rowwise(w_OI.t(), stats_row)
    return scaled_mm(qdy_NO, sdy_N1, qw_IO.t(), sw_I1.t(), dy_NO.dtype, emulate)


def fp8_linear(x: torch.Tensor, w_OI: torch.Tensor, stats_row: torch.Tensor | None = None,
               emulate: bool = False) -> torch.Tensor:
    """y = x W^T with FP8 GEMMs (`Fp8Linear`), x [..., I], W [O, I]. `emulate`: `scaled_mm`'s."""
    return Fp8Linear.apply(x, w_OI, stats_row, emulate)
