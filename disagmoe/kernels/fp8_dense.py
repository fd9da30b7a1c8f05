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

Recipe "blockwise, bf16 weight gradient" (`SCALINGS`, `TrainConfig.fp8_dense_scaling`; a run's default,
`config.FP8_DENSE_SCALING`, where the device runs it: `blockwise_unavailable`): the routed
experts' fine-grained scaling, DeepSeek-V3's, through the same library call: torch._scaled_mm takes
1 x 128 activation and 128 x 128 weight scales on Hopper (cuBLASLt from CUDA 12.9; torch >= 2.9):

  forward  y_NO  = x_NI W_OI^T   e4m3: x per token and 128 of I, W per 128 x 128 block
  dgrad    dx_NI = dy_NO W_OI    e4m3: dy per token and 128 of O, W^T's blocks (W's scales, transposed)
  wgrad    dW_OI = dy_NO^T x_NI  bf16, as above

cuBLAS reads the activations' scales token-major (`fp8.quantize_rows(m_major=True)` writes them so)
and wants a weight block grid whose K side is a multiple of 4 blocks (torch pull 166752: scales
padded to 4 blocks, silent wrong results otherwise), so both dimensions of a blockwise linear are
multiples of `BLOCKWISE_MULTIPLE` (512); a linear that is not (MLA's kv_a, 7168 -> 576) keeps its
GEMMs in bf16 under this recipe (`fits_blockwise`, `MoETransformer.set_dense_fp8` names them).
Its quantisers are the experts' (`kernels.fp8`: `quantize_rows`, `quantize_blocks` writing W's
e4m3 copy and its transpose in one launch), so its bits are theirs.

The rowwise quantiser is one Triton launch on CUDA (`kernels.fp8_rowwise`; transposed operands read in
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
# How the dense FP8 GEMMs' operands are scaled (`TrainConfig.fp8_dense_scaling`): one scale per token /
# feature over the whole contraction, or the experts' 1 x 128 / 128 x 128 grid (module docstring).
SCALINGS = ("rowwise", "blockwise")
E4M3 = torch.float8_e4m3fn
ALIGN = 16  # torch._scaled_mm: every GEMM dimension but M (the tokens, here) a multiple of 16
BLOCK = 128  # the blockwise recipe's scale group: 1 x 128 activations, 128 x 128 weight blocks
BLOCKWISE_MULTIPLE = 4 * BLOCK  # cuBLAS pads a 128 x 128 scale grid's K side to 4 blocks: keep it whole
# cuBLAS reads the 1 x 128 scales' token-major columns 16 bytes aligned: a token count off a multiple of 4
# was refused (CUBLAS_STATUS_NOT_SUPPORTED from its heuristic, an H100, session 33), so `scaled_mm` pads
# such a GEMM's rows to one with zero rows and unit scales and returns the real rows.
TOKEN_ALIGN = 4


def check_scaling(scaling: str) -> None:
    if scaling not in SCALINGS:
        raise ValueError(f"unknown FP8 dense scaling {scaling!r}; choose one of {', '.join(SCALINGS)}")


def fits_blockwise(in_features: int, out_features: int) -> bool:
    """Whether a linear in -> out runs the blockwise recipe: both dimensions (each the contraction of
    one of its FP8 GEMMs) multiples of `BLOCKWISE_MULTIPLE`."""
    return in_features % BLOCKWISE_MULTIPLE == 0 and out_features % BLOCKWISE_MULTIPLE == 0


BLOCKWISE_TORCH = (2, 9)  # torch._scaled_mm's block scaling (pytorch pull 158037)
BLOCKWISE_CUDA = (12, 9)  # cuBLASLt's 1 x 128 / 128 x 128 scaling


def _version(text: str | None) -> tuple[int, ...]:
    """(major, minor) of a version string such as '2.11.0+cu130' or '13.0'; () for None."""
    if not text:
        return ()
    return tuple(int(part) for part in text.split("+")[0].split(".")[:2] if part.isdigit())


def blockwise_unavailable(device: torch.device) -> str | None:
    """Why `device` cannot run torch._scaled_mm's 1 x 128 / 128 x 128 scaling (cuBLASLt implements
    that pair on Hopper GPUs, sm_90, only, from CUDA 12.9, reached from torch 2.9); None where it can."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    if capability is None or capability[0] != 9:
        where = device.type if capability is None else f"a GPU of compute capability {capability}"
        return (f"cuBLAS implements torch._scaled_mm's 1 x 128 / 128 x 128 scaling on Hopper GPUs (sm_90) only; "
                f"this run is on {where}")
    if _version(torch.__version__) < BLOCKWISE_TORCH or _version(torch.version.cuda) < BLOCKWISE_CUDA:
        return (f"torch._scaled_mm's block scaling needs torch >= 2.9 built with CUDA >= 12.9; this is torch "
                f"{torch.__version__} with CUDA {torch.version.cuda}")
    return None


def check_blockwise_device(device: torch.device) -> None:
    """ValueError where `device` cannot run the blockwise recipe (`blockwise_unavailable`), naming the fixes."""
    reason = blockwise_unavailable(device)
    if reason is not None:
        raise ValueError(f"fp8_dense_scaling: blockwise: {reason}: set fp8_dense_scaling: rowwise, or fp8_dense: "
                         "false (or fp8_emulate: true for a numerics check)")


def _interpreted_or_cuda(x: torch.Tensor) -> bool:
    """Whether the Triton quantisers run on x: a CUDA tensor, or Triton's interpreter (the tests)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1"


def quantize_token_blocks(x_MK: torch.Tensor, stats_row: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_MK e4m3, s_MG fp32 token-major, strides (1, M)): the blockwise recipe's activation operand,
    one scale per token and 128 of K (`fp8.quantize_rows`; `stats_row` counts as there). On CUDA and
    under the interpreter the experts' Triton quantiser; else its torch reference, the same bits."""
    from disagmoe.kernels import fp8

    if _interpreted_or_cuda(x_MK):
        return fp8.quantize_rows(x_MK, stats_row, m_major=True)
    q_MK, s_MG = fp8.quantize_rows_reference(x_MK)
    if stats_row is not None:
        x32 = x_MK.float()
        _count(stats_row, x32, x32 / _expanded(s_MG, x32.shape), q_MK)
    return q_MK, s_MG.t().contiguous().t()


def quantize_weight_blocks(w_OI: torch.Tensor, stats_row: torch.Tensor | None = None, *,
                           out: tuple[torch.Tensor, torch.Tensor] | None = None,
                           transposed_out: tuple[torch.Tensor, torch.Tensor] | None = None,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_OI e4m3 row-major, s_OB fp32 [O/128, I/128]): W per 128 x 128 block (`fp8.quantize_blocks`
    of W as one expert; any strides: W^T is read in place), into `out` where given.
    `transposed_out` (q_IO, s_IB): also W^T's copy, the data gradient's operand, written by the same
    launch (its blocks' scales are W's, transposed: nothing quantised twice). On CUDA and under the
    interpreter the experts' Triton quantiser; else its torch reference, the same bits."""
    from disagmoe.kernels import fp8

    if _interpreted_or_cuda(w_OI):
        q_OI, s_OB = fp8.quantize_blocks(
            w_OI[None], stats_row, out=None if out is None else (out[0][None], out[1][None]),
            transposed_out=None if transposed_out is None else transposed_out[0][None])
        q_OI, s_OB = q_OI[0], s_OB[0]
    else:
        q_OI, s_OB = (t[0] for t in fp8.quantize_blocks_reference(w_OI[None]))
        if stats_row is not None:
            w32 = w_OI.float()
            _count(stats_row, w32, w32 / _expanded(s_OB, w32.shape), q_OI)
        if out is not None:
            out[0].copy_(q_OI)
            out[1].copy_(s_OB)
            q_OI, s_OB = out
        if transposed_out is not None:
            transposed_out[0].copy_(q_OI.t())
    if transposed_out is not None:
        transposed_out[1].copy_(s_OB.t())
    return q_OI, s_OB


def quantize_activation(x_MK: torch.Tensor, stats_row: torch.Tensor | None, scaling: str,
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """An FP8 GEMM's A operand under `scaling`: `quantize_rowwise` or `quantize_token_blocks`."""
    return quantize_rowwise(x_MK, stats_row) if scaling == "rowwise" else quantize_token_blocks(x_MK, stats_row)


def quantize_weight(w_OI: torch.Tensor, stats_row: torch.Tensor | None, scaling: str,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """W's e4m3 copy under `scaling` (W^T read in place where a transpose is passed): per row over its
    columns (rowwise) or per 128 x 128 block (blockwise); the B operand is its transpose."""
    return quantize_rowwise(w_OI, stats_row) if scaling == "rowwise" else quantize_weight_blocks(w_OI, stats_row)


def quantize_rowwise(x_MK: torch.Tensor, stats_row: torch.Tensor | None = None,
                     out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_MK e4m3 row-major, scale_M1 fp32) with x ~= q * scale: one scale per row, amax / 448 (a
    zero row gets scale 1 and quantises to zeros). x any strides (a transposed view is read in
    place on the kernel). `stats_row`: an `Fp8Stats` row to add the counters into (device ops, no
    host sync). `out`: (q_MK, scale_M1) buffers to write into. On CUDA (and under Triton's
    interpreter) one Triton launch (`kernels.fp8_rowwise`), else `quantize_rowwise_reference`:
    the same bits."""
    # the interpreter's CPU path wants fp8_rowwise built under it (the tests' `interpreted` fixture)
    if _interpreted_or_cuda(x_MK):
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


def _expanded(scale: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """`scale` spread over a tensor of `shape`: a dimension of size 1 broadcasts, one of the tensor's
    size is per element, any other holds one scale per `BLOCK` (the last block may be short)."""
    for dim, size in enumerate(shape):
        if scale.shape[dim] not in (1, size):
            scale = scale.repeat_interleave(BLOCK, dim=dim).narrow(dim, 0, size)
    return scale


def scaled_mm(a_MK: torch.Tensor, scale_a: torch.Tensor, b_KN: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, emulate: bool = False) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b), e4m3 operands, `b_KN` column-major (a transposed row-major
    tensor). Rowwise: scale_a [M, 1], scale_b [1, N]; blockwise: scale_a [M, K/128] token-major,
    scale_b [K/128, N/128] (the transpose of a row-major block grid). `emulate` (the tests' reference
    and `TrainConfig.fp8_emulate`): dequantise in fp64 and matmul, rounded once to `out_dtype`,
    instead of `torch._scaled_mm` (exact products of the same e4m3 values and scales, wider sums than
    its fp32 ones; no alignment needed)."""
    rows = a_MK.shape[0]
    if rows == 0:  # no tokens: torch's layout check of token-major scales refuses [0, G]
        return a_MK.new_zeros((0, b_KN.shape[1]), dtype=out_dtype)
    if emulate:
        a = a_MK.double() * _expanded(scale_a, a_MK.shape).double()
        b = b_KN.double() * _expanded(scale_b, b_KN.shape).double()
        return (a @ b).to(out_dtype)
    if scale_a.shape[1] > 1 and rows % TOKEN_ALIGN:  # blockwise: cuBLAS wants 16-byte scale columns
        padded = rows + -rows % TOKEN_ALIGN
        a_pad = a_MK.new_zeros((padded, a_MK.shape[1]))
        a_pad[:rows] = a_MK
        s_pad = scale_a.new_ones((scale_a.shape[1], padded)).t()
        s_pad[:rows] = scale_a
        return torch._scaled_mm(a_pad, b_KN, scale_a=s_pad, scale_b=scale_b, out_dtype=out_dtype)[:rows]
    return torch._scaled_mm(a_MK, b_KN, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def check_shape(in_features: int, out_features: int, scaling: str = "rowwise") -> None:
    """torch._scaled_mm wants the contraction and the output columns in multiples of 16; the
    blockwise recipe both in multiples of `BLOCKWISE_MULTIPLE` (`fits_blockwise`)."""
    check_scaling(scaling)
    if in_features % ALIGN or out_features % ALIGN:
        raise ValueError(f"an FP8 dense linear {in_features} -> {out_features}: torch._scaled_mm needs both "
                         f"dimensions multiples of {ALIGN}; set fp8_dense: false")
    if scaling == "blockwise" and not fits_blockwise(in_features, out_features):
        raise ValueError(f"an FP8 dense linear {in_features} -> {out_features}: the blockwise recipe needs both "
                         f"dimensions multiples of {BLOCKWISE_MULTIPLE} (whole 128 x 128 blocks, 4 along each "
                         "contraction); keep this linear in bf16 or set fp8_dense_scaling: rowwise")


class Fp8WeightCopies:
    """The e4m3 copies of one weight W_OI that its GEMMs read, made once per optimizer step
    (`refresh`) and reused by every micro-batch of it: `rows` = W's copy for the forward's B operand
    and `cols` = W^T's for the data gradient's. Rowwise: (q_OI, s_O1), W per output feature over I,
    and (q_IO, s_I1), W per input feature over O. Blockwise: (q_OI, s_OB [O/128, I/128]) per 128 x
    128 block and (q_IO, s_IB), the same blocks transposed (one launch writes both). The buffers are
    allocated here, once; `refresh` writes into them in place (a captured CUDA graph replays into the
    same addresses) and counts W's quantisations into its stats row: once per refresh, not once per
    micro-batch as without copies."""

    def __init__(self, w_OI: torch.Tensor, scaling: str = "rowwise") -> None:
        check_scaling(scaling)
        o, i = w_OI.shape
        empty = functools.partial(torch.empty, device=w_OI.device)
        self.scaling = scaling
        if scaling == "rowwise":
            self.rows = (empty((o, i), dtype=E4M3), empty((o, 1), dtype=torch.float32))
            self.cols = (empty((i, o), dtype=E4M3), empty((i, 1), dtype=torch.float32))
        else:
            blocks_o, blocks_i = -(-o // BLOCK), -(-i // BLOCK)
            self.rows = (empty((o, i), dtype=E4M3), empty((blocks_o, blocks_i), dtype=torch.float32))
            self.cols = (empty((i, o), dtype=E4M3), empty((blocks_i, blocks_o), dtype=torch.float32))
        self._seen: tuple | None = None  # `_identity(W)` at the last refresh

    @torch.no_grad()
    def refresh(self, w_OI: torch.Tensor, stats_row: torch.Tensor | None = None) -> None:
        """Quantise W into the copies (rowwise: two launches on CUDA, W^T read in place; blockwise:
        one, W counted once)."""
        if self.scaling == "rowwise":
            quantize_rowwise(w_OI, stats_row, out=self.rows)
            quantize_rowwise(w_OI.t(), stats_row, out=self.cols)
        else:
            quantize_weight_blocks(w_OI, stats_row, out=self.rows, transposed_out=self.cols)
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
                emulate: bool, scaling: str = "rowwise") -> torch.Tensor:
        ctx.save_for_backward(x, w_OI)
        ctx.stats_row, ctx.emulate, ctx.scaling = stats_row, emulate, scaling
        return fprop(x, w_OI, stats_row, emulate, scaling=scaling)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w_OI = ctx.saved_tensors
        dy_NO = dy.reshape(-1, dy.shape[-1])
        dx = (dgrad(dy_NO, w_OI, ctx.stats_row, ctx.emulate, scaling=ctx.scaling).view(x.shape)
              if ctx.needs_input_grad[0] else None)
        dw = dy_NO.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


class _SharedInputs(threading.local):
    """The last quantised forward input, with the tensor itself held, so the next linear that reads
    the same tensor takes the same e4m3 copy instead of quantising it again: q, k and v read one x,
    as do a SwiGLU's gate and up. Same tensor = same storage address, shape, strides, dtype and
    version counter while the held reference keeps the storage from being reused; and the same
    stats row (an input shared this way is counted once, not once per reader). Per thread."""

    def __init__(self) -> None:
        self.last: tuple[tuple, torch.Tensor, tuple[torch.Tensor, torch.Tensor]] | None = None


_shared_inputs = _SharedInputs()


def quantize_input(x_MK: torch.Tensor, stats_row: torch.Tensor | None,
                   scaling: str = "rowwise") -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_activation(x_MK, stats_row, scaling)` of a linear's input, reused when the previous
    input was the same tensor under the same scaling (`_SharedInputs`): one quantisation per input,
    not per reader."""
    key = (x_MK.data_ptr(), tuple(x_MK.shape), x_MK.stride(), x_MK.dtype, x_MK.device, x_MK._version,
           None if stats_row is None else id(stats_row), scaling)
    last = _shared_inputs.last
    if last is not None and last[0] == key:
        return last[2]
    result = quantize_activation(x_MK, stats_row, scaling)
    _shared_inputs.last = (key, x_MK, result)
    return result


def forget_shared_inputs() -> None:
    """Drop the held input and its copy (`_SharedInputs`): at the end of a step, or in tests."""
    _shared_inputs.last = None


def _copies_for(copies: Fp8WeightCopies | None, scaling: str) -> Fp8WeightCopies | None:
    if copies is not None and copies.scaling != scaling:
        raise ValueError(f"W's e4m3 copies were made {copies.scaling}, the GEMM runs {scaling}: refresh them "
                         f"with Fp8WeightCopies(w, {scaling!r})")
    return copies


def fprop(x: torch.Tensor, w_OI: torch.Tensor, stats_row: torch.Tensor | None = None,
          emulate: bool = False, copies: Fp8WeightCopies | None = None, scaling: str = "rowwise") -> torch.Tensor:
    """y = x W^T, x [..., I]: x scaled per token (rowwise) or per token and 128 of I (blockwise), its
    copy shared with the next linear reading the same x (`quantize_input`); W per output feature over
    I or per 128 x 128 block (`copies.rows` where given, else quantised here)."""
    x_NI = x.reshape(-1, x.shape[-1])
    qx_NI, sx = quantize_input(x_NI, stats_row, scaling)
    copies = _copies_for(copies, scaling)
    qw_OI, sw = copies.rows if copies is not None else quantize_weight(w_OI, stats_row, scaling)
    y_NO = scaled_mm(qx_NI, sx, qw_OI.t(), sw.t(), x.dtype, emulate)
    return y_NO.view(*x.shape[:-1], w_OI.shape[0])


def dgrad(dy_NO: torch.Tensor, w_OI: torch.Tensor, stats_row: torch.Tensor | None = None,
          emulate: bool = False, copies: Fp8WeightCopies | None = None, scaling: str = "rowwise") -> torch.Tensor:
    """dx_NI = dy_NO W_OI: dy scaled per token (rowwise) or per token and 128 of O (blockwise); W per
    input feature over O or W^T per 128 x 128 block (`copies.cols` where given, else quantised here
    from W^T, read in place)."""
    qdy_NO, sdy = quantize_activation(dy_NO, stats_row, scaling)
    copies = _copies_for(copies, scaling)
    qw_IO, sw = copies.cols if copies is not None else quantize_weight(w_OI.t(), stats_row, scaling)
    return scaled_mm(qdy_NO, sdy, qw_IO.t(), sw.t(), dy_NO.dtype, emulate)


def fp8_linear(x: torch.Tensor, w_OI: torch.Tensor, stats_row: torch.Tensor | None = None,
               emulate: bool = False, scaling: str = "rowwise") -> torch.Tensor:
    """y = x W^T with FP8 GEMMs (`Fp8Linear`), x [..., I], W [O, I]. `emulate`: `scaled_mm`'s."""
    check_scaling(scaling)
    return Fp8Linear.apply(x, w_OI, stats_row, emulate, scaling)
