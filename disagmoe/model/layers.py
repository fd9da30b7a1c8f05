"""Small building blocks: RMSNorm, rotary position embedding, the SwiGLU feed-forward, and the
linear layer whose weight gradient can wait (`DeferrableLinear`, inside `kernels.deferral.deferred_weight_grads`).

Shape legend: B batch, S sequence, H hidden, N tokens (B*S), D head dim, R rotary dims, F FFN width,
I / O a linear layer's input / output features.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe.config import RopeScalingConfig
from disagmoe.kernels import fp8_dense
from disagmoe.kernels.deferral import hold_back
from disagmoe.kernels.moe_ffn import main_grad_of


class _Fusion:
    """Whether `fused` functions run compiled on CUDA tensors (`set_fusion`; default on)."""

    enabled = True


def set_fusion(enabled: bool) -> None:
    """Turn the torch.compile'd elementwise fusions of `fused` functions on or off (CUDA only)."""
    _Fusion.enabled = enabled


# Compiled graphs one `fused` function may hold: one per input signature (dynamo's default of 8
# per function is reached by a model's norms alone: hidden, q/k heads, MLA's two low-rank norms,
# times training and evaluation shapes, and a process that runs several models holds them all).
FUSED_GRAPHS_PER_FUNCTION = 256


def _signature(args: tuple[Any, ...]) -> tuple:
    """What dynamo guards a `fused` call on: each tensor's shape, strides, dtype, device and
    requires_grad (other arguments by value), and whether autograd records."""
    return (torch.is_grad_enabled(), *((a.shape, a.stride(), a.dtype, a.device, a.requires_grad)
                                       if isinstance(a, torch.Tensor) else a for a in args))


def fused(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` (a pure function of tensors: a chain of elementwise ops and reductions), compiled by
    torch.compile into fused kernels, forward and backward, when its first argument is a CUDA
    tensor and fusion is on; run as written otherwise (on the CPU the oracle stays exactly as
    written). One compiled graph per distinct input signature (shapes are fixed during training):
    a new signature compiles with dynamo's per-function limit raised to FUSED_GRAPHS_PER_FUNCTION
    (fullgraph would make the default limit a hard error mid-run)."""
    compiled: Callable[..., Any] | None = None
    seen: set[tuple] = set()

    @functools.wraps(fn)
    def dispatch(*args: Any) -> Any:
        nonlocal compiled
        if not (_Fusion.enabled and args[0].is_cuda):
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=False, fullgraph=True)
        signature = _signature(args)
        if signature in seen:
            return compiled(*args)
        seen.add(signature)
        with torch._dynamo.config.patch(recompile_limit=FUSED_GRAPHS_PER_FUNCTION):  # compiles here
            return compiled(*args)

    return dispatch


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions (norms, router softmax) run in at least fp32; fp64 stays fp64 (gradcheck)."""
    return torch.promote_types(dtype, torch.float32)


class RMSNorm(nn.Module):
    """x / rms(x) * weight, the statistics in fp32 (as in Llama, Mixtral, Qwen3, DeepSeek)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


@fused
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight over the last dim, statistics in at least fp32 (`RMSNorm`)."""
    x32 = x.to(compute_dtype(x.dtype))
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


@fused
def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(h = x + y, `rms_norm`(h)): a residual add and the norm that reads its sum, in one fused graph on a GPU:
    the forward writes h and its norm in one pass over x and y (h is not read again), and the backward sums
    h's two gradients (the residual stream's and the norm's) in the norm's own backward kernel, where autograd
    would add them in a pass of its own. The CPU runs the two ops as written (the same values, bit for bit)."""
    h = x + y
    return h, rms_norm.__wrapped__(h, weight, eps)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extended `factor` times."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_attention_factor(scaling: RopeScalingConfig) -> float:
    """The multiplier on cos/sin: given, or mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


def yarn_inv_freq(rot_dim: int, theta: float, scaling: RopeScalingConfig, device: torch.device) -> torch.Tensor:
    """[R/2] inverse frequencies: kept above beta_fast rotations over the original context,
    divided by `factor` below beta_slow, linearly blended in between (fp32)."""
    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the context
        context = scaling.original_max_position_embeddings
        return rot_dim * math.log(context / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(scaling.beta_fast), dim_of(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot_dim - 1)
    if low == high:
        high += 0.001  # a step instead of a ramp
    ramp_R2 = ((torch.arange(rot_dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    base_R2 = theta ** (torch.arange(0, rot_dim, 2, dtype=torch.float32, device=device) / rot_dim)
    kept_R2 = 1.0 - ramp_R2  # 1 where the original frequency is kept
    return (1.0 / (scaling.factor * base_R2)) * ramp_R2 + (1.0 / base_R2) * kept_R2


def rope_cos_sin(
    seq_len: int, rot_dim: int, theta: float, device: torch.device, dtype: torch.dtype,
    scaling: RopeScalingConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [S, R] for positions 0..S-1, frequencies repeated over the two halves
    (YaRN-scaled frequencies and magnitudes when `scaling` is given)."""
    work = compute_dtype(dtype)
    if scaling is None:
        inv_freq_R2 = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, device=device, dtype=work) / rot_dim))
        magnitude = 1.0
    else:
        inv_freq_R2 = yarn_inv_freq(rot_dim, theta, scaling, device).to(work)
        magnitude = yarn_attention_factor(scaling)
    angles_SR2 = torch.arange(seq_len, device=device, dtype=work)[:, None] * inv_freq_R2[None, :]
    angles_SR = torch.cat([angles_SR2, angles_SR2], dim=-1)
    return (angles_SR.cos() * magnitude).to(dtype), (angles_SR.sin() * magnitude).to(dtype)


def apply_rope(x_BSnR: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + R/2) of the last dim ("rotate half" layout) of a [B, S, heads, R] tensor."""
    half = x_BSnR.shape[-1] // 2
    x1, x2 = x_BSnR[..., :half], x_BSnR[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x_BSnR * cos_SR[:, None, :] + rotated * sin_SR[:, None, :]


def _linear_weight_grad(dy_NO: torch.Tensor, x_NI: torch.Tensor) -> torch.Tensor:
    """d W [O, I] of y = x W^T: the product autograd's linear computes (`mm` backward), bit for bit."""
    return dy_NO.t().mm(x_NI)


class _Fp32AccumulatorGemm:
    """Whether this torch's CUDA `addmm` takes an fp32 accumulator beside bf16 operands
    (`out_dtype=torch.float32`; torch >= 2.9's `addmm.dtype_out`): None until first asked."""

    supported: bool | None = None


def add_product_into_fp32_(acc_MN: torch.Tensor, a_MK: torch.Tensor, b_KN: torch.Tensor) -> bool:
    """acc += a @ b by one cuBLAS GEMM with an fp32 C and beta = 1, where `acc` is an fp32 CUDA tensor, `a` and
    `b` bf16 or fp16, and this torch offers `addmm`'s `out_dtype`: the product is summed into `acc` unrounded,
    with no product tensor written and read and no cast. True if it did; False (nothing done) leaves the
    caller to form the product itself."""
    if (not acc_MN.is_cuda or acc_MN.dtype != torch.float32 or a_MK.dtype not in (torch.bfloat16, torch.float16)
            or b_KN.dtype != a_MK.dtype or _Fp32AccumulatorGemm.supported is False):
        return False
    try:
        torch.addmm(acc_MN, a_MK, b_KN, out_dtype=torch.float32, out=acc_MN)
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError):  # a torch without it: the arguments are refused before any launch
        _Fp32AccumulatorGemm.supported = False
        return False
    _Fp32AccumulatorGemm.supported = True
    return True


def add_weight_grad_into_main(w_OI: torch.Tensor | None, dy_NO: torch.Tensor, x_NI: torch.Tensor) -> bool:
    """d W = dy^T x added into W's fp32 main gradient (FlatAdamW's `main_grad`) by the GEMM itself
    (`add_product_into_fp32_`: Megatron's gradient-accumulation fusion), where W is a bf16 or fp16 leaf
    parameter with a main gradient, on CUDA, outside a double backward. True if it did (autograd then
    gets no gradient for W); False leaves the caller to return d W as autograd's linear would. The
    product is added unrounded (fp32 sums of the bf16 products), where autograd's path rounds it to
    bf16 before FlatAdamW's hook adds it: at most a bf16 rounding of d W apart, and it saves that bf16
    d W's write and read and the hook's mixed-dtype add (17 ms of the DeepSeek config's eager step,
    2026-12-04)."""
    main = None if w_OI is None else main_grad_of(w_OI)
    if main is None or torch.is_grad_enabled() or w_OI.dtype not in (torch.bfloat16, torch.float16):
        return False
    return add_product_into_fp32_(main, dy_NO.t(), x_NI)


def _accumulate_weight_grad(w_OI: torch.Tensor, dy_NO: torch.Tensor, x_NI: torch.Tensor) -> None:
    """A held-back weight gradient, computed now: straight into W's main gradient where it can
    (`add_weight_grad_into_main`); otherwise accumulated by autograd itself, as the backward would
    have done: into `.grad` (in place where it exists: FlatAdamW's fp32 view), then the
    post-accumulate hooks (FlatAdamW adds a bf16 gradient into `main_grad`)."""
    with torch.no_grad():
        if add_weight_grad_into_main(w_OI, dy_NO, x_NI):
            return
        dw_OI = _linear_weight_grad(dy_NO, x_NI)
    torch.autograd.backward(w_OI, dw_OI)


def _linear_backward_weight(weight: torch.Tensor | None, dy_NO: torch.Tensor, x_NI: torch.Tensor,
                            ) -> torch.Tensor | None:
    """A linear's d W, bf16 as autograd's linear computes it, the one place both linears take it:
    held back inside `deferred_weight_grads` (first-order backward, a leaf `weight`), else added into
    W's main gradient by the GEMM where there is one, else returned (None when it went elsewhere)."""
    deferrable = weight is not None and not torch.is_grad_enabled()  # grad mode on: a double backward
    if deferrable and hold_back(functools.partial(_accumulate_weight_grad, weight, dy_NO, x_NI)):
        return None
    if add_weight_grad_into_main(weight, dy_NO, x_NI):
        return None
    return _linear_weight_grad(dy_NO, x_NI)


def _deferrable_weight(w_OI: torch.Tensor) -> torch.Tensor | None:
    """Where a held-back weight gradient accumulates: the leaf weight itself, kept on the ctx (None
    for a non-leaf weight: never deferred). Not its saved copy: under a checkpoint's saved-tensor
    hooks (`recompute`) that unpacks as an alias whose link to the leaf's gradient accumulator is
    weak, gone once the segment's graph is freed before the held-back work runs (a rank runs it
    after its sends), and the gradient would then land on the alias."""
    return w_OI if w_OI.is_leaf else None


class _LinearFunction(torch.autograd.Function):
    """y = x W^T (`F.linear` without bias). The backward computes d x as autograd's linear does and
    d W too, unless inside `deferred_weight_grads` (first-order backward, a leaf weight), where d W
    waits in the list; both from the same saved x and the incoming d y, so nothing is recomputed.
    d W goes straight into W's fp32 main gradient where there is one (`add_weight_grad_into_main`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_OI: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w_OI)
        ctx.weight = _deferrable_weight(w_OI)
        return F.linear(x, w_OI)

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x, w_OI = ctx.saved_tensors
        dy_NO = dy.reshape(-1, dy.shape[-1])
        dx = dy_NO.mm(w_OI).view(x.shape) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1]:
            return dx, None
        return dx, _linear_backward_weight(ctx.weight, dy_NO, x.reshape(-1, x.shape[-1]))


class _SharedInputLinearFunction(torch.autograd.Function):
    """y_i = x W_i^T for several weights that read one x (attention's q, k and v projections, MLA's
    two of the block input, a SwiGLU's gate and up): `_LinearFunction` for each, in one autograd
    node, so that d x = sum_i d y_i W_i is summed by the GEMMs themselves, the first a product and
    each next one added into it by the GEMM (`addmm_`, beta 1: the sum in the GEMM's fp32 epilogue,
    rounded once), where autograd summed the readers' d x at x with a separate add kernel per
    extra reader, each reading two [N, I] gradients and writing their sum (the Qwen3 config's
    backward spent 6 ms of its 497 ms step on an H100 in four such [B, S, H] adds per layer, two of
    them q's, k's and v's). The forward's
    products and the weight gradients are `_LinearFunction`'s, bit for bit; d x is the same sum
    rounded otherwise (fp32: the summation order; bf16: the partial sums rounded once per GEMM
    instead of once per product and once per add), within the activations' rounding."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, *ws_OI: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.save_for_backward(x, *ws_OI)
        ctx.weights = tuple(_deferrable_weight(w_OI) for w_OI in ws_OI)
        return tuple(F.linear(x, w_OI) for w_OI in ws_OI)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, *ws_OI = ctx.saved_tensors
        dys_NO = [dy.reshape(-1, dy.shape[-1]) for dy in dys]
        dx = None
        if ctx.needs_input_grad[0]:
            dx_NI = dys_NO[0].mm(ws_OI[0])
            for dy_NO, w_OI in zip(dys_NO[1:], ws_OI[1:], strict=True):
                dx_NI.addmm_(dy_NO, w_OI)
            dx = dx_NI.view(x.shape)
        x_NI = x.reshape(-1, x.shape[-1])
        dws = tuple(_linear_backward_weight(weight, dy_NO, x_NI) if needed else None
                    for weight, dy_NO, needed in zip(ctx.weights, dys_NO, ctx.needs_input_grad[1:], strict=True))
        return (dx, *dws)


class _Fp8LinearFunction(torch.autograd.Function):
    """`_LinearFunction` with its forward and data-gradient GEMMs in FP8 (`kernels.fp8_dense`,
    `RECIPE`: the weight gradient in bf16, taken as `_LinearFunction` takes it: held back, or into
    the main gradient). `copies`: W's e4m3 copies of this optimizer step
    (`fp8_dense.Fp8WeightCopies`, forward and data gradient), or None."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_OI: torch.Tensor, stats_row: torch.Tensor | None,
                emulate: bool, copies: fp8_dense.Fp8WeightCopies | None, scaling: str) -> torch.Tensor:
        ctx.save_for_backward(x, w_OI)
        ctx.weight = _deferrable_weight(w_OI)
        ctx.stats_row, ctx.emulate, ctx.copies, ctx.scaling = stats_row, emulate, copies, scaling
        return fp8_dense.fprop(x, w_OI, stats_row, emulate, copies, scaling)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, w_OI = ctx.saved_tensors
        dy_NO = dy.reshape(-1, dy.shape[-1])
        dx = (fp8_dense.dgrad(dy_NO, w_OI, ctx.stats_row, ctx.emulate, ctx.copies, ctx.scaling).view(x.shape)
              if ctx.needs_input_grad[0] else None)
        if not ctx.needs_input_grad[1]:
            return dx, None, None, None, None, None
        return dx, _linear_backward_weight(ctx.weight, dy_NO, x.reshape(-1, x.shape[-1])), None, None, None, None


class DeferrableLinear(nn.Linear):
    """`nn.Linear` without bias whose weight gradient can wait (`deferred_weight_grads`). Outside
    that context the same parameters, names and gradients, bit for bit, as `nn.Linear`; a bf16 CUDA
    weight with an fp32 main gradient (FlatAdamW) gets its gradient added there by the GEMM, unrounded
    (`add_weight_grad_into_main`).

    `set_fp8(True, stats_row, scaling=...)` (precision fp8, `fp8_dense`, `fp8_dense_scaling`) runs its
    forward and data-gradient GEMMs in FP8 instead (`kernels.fp8_dense`, rowwise or blockwise scales;
    its weight gradient stays bf16): the parameter stays bf16;
    its e4m3 copies (`fp8_copies`) are made by `prepare_fp8`, once per optimizer step, never
    checkpointed. `emulate` (`TrainConfig.fp8_emulate`, and the tests' reference): the same
    quantised operands dequantised and multiplied in fp64 instead of torch._scaled_mm
    (`fp8_dense.scaled_mm`; no alignment needed, so the shape check is skipped)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__(in_features, out_features, bias=False)
        self.fp8 = False
        self.fp8_stats_row: torch.Tensor | None = None
        self.fp8_emulate = False
        self.fp8_copies: fp8_dense.Fp8WeightCopies | None = None
        self.fp8_scaling = "rowwise"

    def set_fp8(self, enabled: bool, stats_row: torch.Tensor | None = None, emulate: bool = False,
                scaling: str = "rowwise") -> None:
        """ValueError where the library GEMM cannot take this linear's shape under `scaling`
        (`fp8_dense.check_shape`; emulated GEMMs take any)."""
        fp8_dense.check_scaling(scaling)
        if enabled and not emulate:
            fp8_dense.check_shape(self.in_features, self.out_features, scaling)
        self.fp8, self.fp8_stats_row, self.fp8_emulate, self.fp8_scaling = enabled, stats_row, emulate, scaling
        self.fp8_copies = None

    @torch.no_grad()
    def prepare_fp8(self) -> None:
        """Under FP8, refresh W's e4m3 copies from W, in place (the same buffers every time, allocated
        on the first call): once per optimizer step, before the step's first forward (the trainer,
        `MoETransformer.prepare_fp8`), and before an evaluation. W's counters go into the stats row
        here, once per refresh."""
        if not self.fp8:
            return
        if self.fp8_copies is None or self.fp8_copies.rows[0].device != self.weight.device:  # set_fp8 drops them
            self.fp8_copies = fp8_dense.Fp8WeightCopies(self.weight, self.fp8_scaling)
        self.fp8_copies.refresh(self.weight, self.fp8_stats_row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8:
            # no copies, or W written since (`Fp8WeightCopies.fits`, host metadata): W quantised per call
            copies = self.fp8_copies if self.fp8_copies is not None and self.fp8_copies.fits(self.weight) else None
            return _Fp8LinearFunction.apply(x, self.weight, self.fp8_stats_row, self.fp8_emulate, copies,
                                            self.fp8_scaling)
        return _LinearFunction.apply(x, self.weight)


def shared_input_linears(x: torch.Tensor, *linears: DeferrableLinear) -> tuple[torch.Tensor, ...]:
    """`linear(x)` for each of `linears`, all of one input: one autograd node whose d x the GEMMs sum
    (`_SharedInputLinearFunction`); with any of them in FP8, each its own call (`_Fp8LinearFunction`),
    d x summed by autograd."""
    if any(linear.fp8 for linear in linears):
        return tuple(linear(x) for linear in linears)
    return _SharedInputLinearFunction.apply(x, *(linear.weight for linear in linears))


def set_linears_fp8(module: nn.Module, enabled: bool, stats_row: torch.Tensor | None = None, emulate: bool = False,
                    scaling: str = "rowwise") -> list[str]:
    """Every `DeferrableLinear` in `module` in FP8 (`set_fp8`), scaled `scaling` (`fp8_dense.SCALINGS`),
    or back in bf16; blockwise, a linear off the recipe's grid (`fp8_dense.fits_blockwise`: MLA's
    kv_a, 576 wide) keeps its GEMMs in bf16. Returns those linears' names (empty otherwise): the
    model's dense projections (`MoETransformer.set_dense_fp8`) and `bench calibrate`'s FP8 projection
    probe go through here, so the probe runs what the step runs."""
    fp8_dense.check_scaling(scaling)
    kept_bf16 = []
    for name, linear in module.named_modules():
        if isinstance(linear, DeferrableLinear):
            fits = scaling != "blockwise" or fp8_dense.fits_blockwise(linear.in_features, linear.out_features)
            if enabled and not fits:
                kept_bf16.append(name)
            linear.set_fp8(enabled and fits, stats_row, emulate, scaling)
    return kept_bf16


@fused
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: one compiled kernel each way on CUDA (silu's output is neither written nor
    read back; the backward recomputes it from gate), as written on the CPU."""
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)); the leading dense layers' FFN and the shared experts.

    Names follow Llama: `w1` gate [F, H], `w3` up [F, H], `w2` down [H, F] (nn.Linear is [out, in]).
    It runs on the attention side (shared experts, dense layers): its weight gradients can wait.
    """

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.w1 = DeferrableLinear(hidden, ffn)
        self.w3 = DeferrableLinear(hidden, ffn)
        self.w2 = DeferrableLinear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(swiglu(*shared_input_linears(x, self.w1, self.w3)))
