"""AdamW over a flat bucket in one pass: `FlatAdamW`'s update kernel (`optim.update_kernel: triton`).

Each element is read once and written once: the fp32 master and main gradient and both moments
(fp32 or bf16) in, the master and both moments out and, where given, the bf16 compute copy of the
new master (what `compute_N.copy_(master_S)` wrote in a second pass). Bytes per parameter:

    moments   reads                          writes
    fp32      master 4, grad 4, m 4, v 4 = 16  master 4, m 4, v 4 = 12, + 2 compute copy
    bf16      master 4, grad 4, m 2, v 2 = 12  master 4, m 2, v 2 = 8,  + 2 compute copy

(torch's fused AdamW then the copy: 20 read, 18 written with a clip, for which it writes the
scaled gradient back; with bf16 moments, through fp32 copies of them: 32 read, 30 written.) The
main gradient is not written here: nothing reads it after the step but the next zero_grad.

Arithmetic: `_adam_math` of torch's fused CUDA kernel (aten/src/ATen/native/cuda/fused_adam_utils.cuh,
ADAMW mode), step by step: elements are fp32 ("opmath") values, the hyperparameters doubles, so
every expression with a hyperparameter runs in fp64 and is rounded to fp32 where torch assigns it
to an fp32 variable; the bias corrections are computed in fp64 from the fp32 step count and
rounded to fp32 (torch passes them as opmath). The lr is the fp32 device scalar, widened to a
double. fp32 divisions and square roots are correctly rounded (div_rn, sqrt_rn: nvcc's defaults;
Triton's plain `/` is not). Bf16 moments: the fp32 moments of that update (which the master's
update uses) rounded to nearest-even, what `_step_rounded_moments` did with torch's kernel on
fp32 copies and `tensor.copy_`; the compute copy is rounded the same way (bit arithmetic, so the
interpreter rounds as the GPU does).

Equality with torch's fused kernel, on the GPU: the operations and their order are the same. Two
things may still differ: both compilers contract an fp64 multiply-add into an FMA (Triton here:
fma(beta1, m, (1 - beta1) g), fma(beta2, v, (1 - beta2) g g), fma(-lr wd, p, p), ptxas sm_90a), and
if nvcc pairs them otherwise an fp64 result differs in its last bit; and the fp64 pow is libdevice's
__nv_pow here and the CUDA math library's pow of torch's build there (the same function, perhaps of
another CUDA version). Either would change an fp32 value only where the fp64 one lies within an fp64
ulp of an fp32 rounding boundary, and then by one ulp of the operands. The H200 measured more than
that on the second moment: exp_avg_sq up to 3.03 ulps of its operands, so torch's kernel differs
from this one beyond an FMA's last bit, and not rarely: 36% of the masters and moments differed
on an H200 (2026-12-04), and no emulation of the arithmetic its source reads as (fp64 or fp32, with
or without lerp) matched more than 73% of its exp_avg_sq or 52% of its exp_avg (not found yet; the
tests bound the difference at 4 ulps of the operands). Counted in raw ulps of the *result* that is no
bound: on an H200 (2026-12-03) the masters were up to 2048 raw ulps from torch's fused kernel at the
first step, where a master near zero and its update nearly cancel (torch's own CPU AdamW is 64 raw
ulps from the reference there, yet within 3 ulps of |master before| + |update|). The gpu tests bound
the difference in ulps of the operands: moments within 4 (3.03 measured on exp_avg_sq), masters
within 3 plus what their moments' differences carry through a nearly cancelling exp_avg
(`tests/ulps.py`, `adamw_master_tolerance`: 20 half-ulps of |master| + |update| measured at the
second step), and passed on an H200 (2026-12-04). The whole step trains alike (50 steps of the Qwen3
config: loss 2.8725 against 2.8714 with torch's update, 2.8717 with bf16 moments), so
`update_kernel` defaults to triton. In Triton's CPU interpreter (no FMA; C's pow) the kernel equals
`adamw_reference` bit for bit.

`skip` (an fp32 device scalar, torch's found_inf): where exactly 1.0 the masters, moments and
gradients are neither read nor written except the masters' read for the compute copy, which is
rewritten from them (as torch's path copies masters to compute after a skipped step: a non-finite
compute weight, what an FP8 step's skip is for, is restored). The step count is read, never written: the caller counts it (`flat_adamw.count_step`). Nothing
reads a host value: the launch can be captured in a CUDA graph.

Legend: N the flat length (a bucket, or a ZeRO-1 slice), B a program's block of elements.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from disagmoe.kernels.grouped_gemm import default_num_programs

# Untuned (to be measured on the GPU). A block is 4 elements per thread: one 16-byte access per
# fp32 tensor, and every load and store in one layout (at 8 per thread Triton 3.6 gave the fp32
# stores another layout, converted through shared memory with barriers: ptxas sm_90a). 64
# registers per thread at 8 warps: 4 programs resident per SM, so PROGRAMS_PER_SM persistent
# programs stride over the blocks and the per-program scalars (two fp64 pows) are computed about
# 500 times per launch, not once per block.
BLOCK = 1024
NUM_WARPS = 8
PROGRAMS_PER_SM = 4
HYPERPARAMETERS = ("beta1", "beta2", "weight_decay", "eps")  # the fp64 [4] tensor's order


if os.environ.get("TRITON_INTERPRET") == "1":
    def _pow(base, exponent):
        """Triton 3.6's interpreter has no libdevice: C's pow on the two scalars, as Python's `**`
        in `adamw_reference` (the interpreter runs kernels as Python; fp64 scalars only)."""
        import numpy as np
        from triton.runtime.interpreter import TensorHandle

        value = math.pow(float(base.handle.data.item()), float(exponent.handle.data.item()))
        return tl.core.tensor(TensorHandle(np.full_like(base.handle.data, value, dtype=np.float64), tl.float64),
                              tl.float64)
else:
    _pow = libdevice.pow  # __nv_pow: the CUDA math library's pow, as torch's kernel's std::pow on the device


@triton.jit
def _bf16_bits_to_fp32(bits):
    """bf16 (its 16 bits, int16) -> fp32, exactly."""
    return (bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def _fp32_to_bf16_bits(x):
    """fp32 -> bf16 bits (int16) rounded to nearest-even, as torch's fp32 -> bf16 copy
    (c10::round_to_nearest_even); a NaN -> 0x7FC0 (the CPU cast's; the GPU's cvt gives 0x7FFF)."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    rounded = tl.where(x != x, 0x7FC0, rounded)
    return rounded.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def _adamw_kernel(master_N, grad_N, exp_avg_N, exp_avg_sq_N, compute_N, step_ptr, lr_ptr, hyper_4, grad_scale_ptr,
                  skip_ptr, N, num_blocks, BLOCK: tl.constexpr, BF16_MOMENTS: tl.constexpr, SCALED: tl.constexpr,
                  SKIPPABLE: tl.constexpr, COMPUTE_COPY: tl.constexpr):
    # Contract: master_N, grad_N fp32 [N]; exp_avg_N, exp_avg_sq_N fp32 [N], or their bf16 bits as
    # int16 (BF16_MOMENTS); compute_N the bf16 bits (int16) [N] of the new master (COMPUTE_COPY);
    # step_ptr the fp32 count of steps before this one; lr_ptr the lr (fp32 on CUDA); hyper_4 fp64
    # (beta1, beta2, weight_decay, eps); grad_scale_ptr fp32 (SCALED: the gradient is divided by
    # it); skip_ptr fp32 (SKIPPABLE: 1.0 masks every load and store but the masters' read for the
    # compute copy, which gets the masters as they are). Program p takes blocks p, p + programs, ...
    # of BLOCK elements.
    n_live = N  # elements to update: none when skipping
    skipping = False  # the masters' values go to the compute copy (SKIPPABLE only)
    if SKIPPABLE:
        skipping = tl.load(skip_ptr) == 1.0  # torch's `*found_inf_ptr == 1`
        n_live = tl.where(skipping, 0, N)
    beta1 = tl.load(hyper_4)
    beta2 = tl.load(hyper_4 + 1)
    weight_decay = tl.load(hyper_4 + 2)
    eps = tl.load(hyper_4 + 3)
    lr = tl.load(lr_ptr).to(tl.float64)  # torch: `const double lr_double = *lr_ptr`
    step = (tl.load(step_ptr) + 1.0).to(tl.float64)  # fp32 + 1, as torch's _foreach_add_ before its kernel
    # torch passes the fp64 corrections to `_adam_math` as opmath (fp32) values
    bias_correction1 = (1.0 - _pow(beta1, step)).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(1.0 - _pow(beta2, step)).to(tl.float32)  # fp64: sqrt.rn.f64
    step_size = (lr / bias_correction1.to(tl.float64)).to(tl.float32)
    lr_decay = lr * weight_decay
    grad_scale = 1.0
    if SCALED:
        grad_scale = tl.load(grad_scale_ptr)
    for block in range(tl.program_id(0), num_blocks, tl.num_programs(0)):
        offs_B = tl.cast(block, tl.int64) * BLOCK + tl.arange(0, BLOCK)  # past 2^31 elements (3.8 G in a bucket)
        mask_B = offs_B < n_live
        copy_B = offs_B < N  # the compute copy is written even when skipping
        read_B = mask_B
        if COMPUTE_COPY:
            read_B = copy_B
        kept_B = tl.load(master_N + offs_B, mask=read_B, other=0.0)
        param_B = kept_B
        grad_B = tl.load(grad_N + offs_B, mask=mask_B, other=0.0)
        if BF16_MOMENTS:
            exp_avg_B = _bf16_bits_to_fp32(tl.load(exp_avg_N + offs_B, mask=mask_B, other=0))
            exp_avg_sq_B = _bf16_bits_to_fp32(tl.load(exp_avg_sq_N + offs_B, mask=mask_B, other=0))
        else:
            exp_avg_B = tl.load(exp_avg_N + offs_B, mask=mask_B, other=0.0)
            exp_avg_sq_B = tl.load(exp_avg_sq_N + offs_B, mask=mask_B, other=0.0)
        if SCALED:  # torch: `grad /= double(*grad_scale_ptr)`, fp64 then fp32: the correctly rounded fp32 quotient
            grad_B = tl.math.div_rn(grad_B, grad_scale)
        # `param -= lr * weight_decay * param` (if weight_decay != 0), in fp64
        param64_B = param_B.to(tl.float64)
        param_B = tl.where(weight_decay != 0.0, (param64_B - lr_decay * param64_B).to(tl.float32), param_B)
        grad64_B = grad_B.to(tl.float64)
        exp_avg_B = (beta1 * exp_avg_B.to(tl.float64) + (1.0 - beta1) * grad64_B).to(tl.float32)
        exp_avg_sq_B = (beta2 * exp_avg_sq_B.to(tl.float64) + (1.0 - beta2) * grad64_B * grad64_B).to(tl.float32)
        # `denom = (std::sqrt(exp_avg_sq) / bias_correction2_sqrt) + eps`: fp32 sqrt and quotient, fp64 sum
        denom_B = tl.math.div_rn(tl.sqrt_rn(exp_avg_sq_B), bias_correction2_sqrt)
        denom_B = (denom_B.to(tl.float64) + eps).to(tl.float32)
        # `param -= step_size * exp_avg / denom`, fp32
        param_B = param_B - tl.math.div_rn(step_size * exp_avg_B, denom_B)
        tl.store(master_N + offs_B, param_B, mask=mask_B)
        if BF16_MOMENTS:
            tl.store(exp_avg_N + offs_B, _fp32_to_bf16_bits(exp_avg_B), mask=mask_B)
            tl.store(exp_avg_sq_N + offs_B, _fp32_to_bf16_bits(exp_avg_sq_B), mask=mask_B)
        else:
            tl.store(exp_avg_N + offs_B, exp_avg_B, mask=mask_B)
            tl.store(exp_avg_sq_N + offs_B, exp_avg_sq_B, mask=mask_B)
        if COMPUTE_COPY:
            new_B = param_B
            if SKIPPABLE:
                new_B = tl.where(skipping, kept_B, param_B)
            tl.store(compute_N + offs_B, _fp32_to_bf16_bits(new_B), mask=copy_B)


def hyperparameters(beta1: float, beta2: float, weight_decay: float, eps: float,
                    device: torch.device | str) -> torch.Tensor:
    """The fp64 [4] device tensor `adamw_update` reads (HYPERPARAMETERS' order): doubles, as torch's
    fused kernel takes them (a Triton float argument would be rounded to fp32). Made once, outside
    any captured step (a host-to-device copy)."""
    return torch.tensor([beta1, beta2, weight_decay, eps], dtype=torch.float64, device=device)


def num_programs_for(device: torch.device, blocks: int) -> int:
    """Persistent programs of a launch: PROGRAMS_PER_SM per SM on a GPU (at most one per block); the
    interpreter (CPU) runs a few, so small tests cover the stride loop."""
    per_device = default_num_programs(device) * PROGRAMS_PER_SM if device.type == "cuda" else 3
    return max(1, min(blocks, per_device))


def adamw_update(master_N: torch.Tensor, grad_N: torch.Tensor, exp_avg_N: torch.Tensor, exp_avg_sq_N: torch.Tensor,
                 step: torch.Tensor, lr: torch.Tensor, hyper_4: torch.Tensor, grad_scale: torch.Tensor | None = None,
                 skip: torch.Tensor | None = None, compute_N: torch.Tensor | None = None, *, block: int = BLOCK,
                 num_programs: int | None = None) -> None:
    """One AdamW step in place (module docstring): master_N, exp_avg_N, exp_avg_sq_N and, given,
    compute_N are written; `step` (the count before this step, fp32 0-dim) is read, not counted.

    Args:
        master_N, grad_N: fp32 [N], contiguous.
        exp_avg_N, exp_avg_sq_N: [N], both fp32 or both bf16.
        step: fp32 scalar tensor; lr: the learning-rate scalar tensor (fp32 on CUDA: torch's kernel
            reads an fp32 lr); hyper_4: `hyperparameters(...)`.
        grad_scale: fp32 scalar or None: the gradient is divided by it (the clip's 1 / coef).
        skip: fp32 scalar or None: 1.0 leaves masters and moments as they were and rewrites compute_N
            (given) from the masters.
        compute_N: bf16 [N] or None: receives the new master rounded to nearest-even.
        block, num_programs: the launch (defaults: BLOCK, `num_programs_for`).
    """
    N = master_N.numel()
    assert master_N.dtype == grad_N.dtype == torch.float32, (master_N.dtype, grad_N.dtype)
    assert exp_avg_N.dtype == exp_avg_sq_N.dtype in (torch.float32, torch.bfloat16), (exp_avg_N.dtype,
                                                                                       exp_avg_sq_N.dtype)
    flats = [master_N, grad_N, exp_avg_N, exp_avg_sq_N] + ([] if compute_N is None else [compute_N])
    assert all(t.numel() == N and t.is_contiguous() and t.device == master_N.device for t in flats)
    assert compute_N is None or compute_N.dtype == torch.bfloat16, compute_N.dtype
    assert step.dtype == torch.float32 and step.numel() == 1 and hyper_4.dtype == torch.float64
    assert grad_scale is None or grad_scale.dtype == torch.float32
    assert skip is None or skip.dtype == torch.float32
    if N == 0:
        return
    bf16 = exp_avg_N.dtype == torch.bfloat16
    moments = (exp_avg_N.view(torch.int16), exp_avg_sq_N.view(torch.int16)) if bf16 else (exp_avg_N, exp_avg_sq_N)
    num_blocks = triton.cdiv(N, block)
    programs = num_programs or num_programs_for(master_N.device, num_blocks)
    _adamw_kernel[(programs,)](
        master_N, grad_N, *moments, master_N if compute_N is None else compute_N.view(torch.int16), step, lr, hyper_4,
        master_N if grad_scale is None else grad_scale, master_N if skip is None else skip, N, num_blocks,
        BLOCK=block, BF16_MOMENTS=bf16, SCALED=grad_scale is not None, SKIPPABLE=skip is not None,
        COMPUTE_COPY=compute_N is not None, num_warps=NUM_WARPS)


def adamw_reference(master_N: torch.Tensor, grad_N: torch.Tensor, exp_avg_N: torch.Tensor,
                    exp_avg_sq_N: torch.Tensor, step: torch.Tensor, lr: torch.Tensor, hyper_4: torch.Tensor,
                    grad_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None,
                    compute_N: torch.Tensor | None = None) -> None:
    """`adamw_update` in plain torch, in place, with the same arguments: torch's fused CUDA
    arithmetic written out (module docstring), each fp32 operation as the correctly rounded fp64
    one rounded to fp32 (the same value: fp64 has more than 2 x 24 + 2 bits), no FMA. Reads the
    scalars on the host (a test oracle, not for a captured step)."""
    if skip is not None and float(skip) == 1.0:
        if compute_N is not None:
            compute_N.copy_(master_N)
        return
    beta1, beta2, weight_decay, eps = (float(v) for v in hyper_4.tolist())
    lr_d = float(lr.float()) if lr.dtype == torch.float32 else float(lr)
    step_d = float(step.float() + 1.0)

    def f32(x: torch.Tensor | float) -> torch.Tensor:  # round to fp32, back in fp64 for the next operation
        return torch.as_tensor(x, dtype=torch.float64).float().double()

    bias_correction1 = f32(1.0 - beta1 ** step_d)
    bias_correction2_sqrt = f32(math.sqrt(1.0 - beta2 ** step_d))
    step_size = f32(lr_d / bias_correction1)
    param, grad = master_N.double(), grad_N.double()
    if grad_scale is not None:
        grad = f32(grad / float(grad_scale))
    if weight_decay != 0:
        param = f32(param - (lr_d * weight_decay) * param)
    exp_avg = f32(beta1 * exp_avg_N.double() + (1.0 - beta1) * grad)
    exp_avg_sq = f32(beta2 * exp_avg_sq_N.double() + (1.0 - beta2) * grad * grad)
    denom = f32(f32(f32(exp_avg_sq.sqrt()) / bias_correction2_sqrt) + eps)
    param = f32(param - f32(f32(step_size * exp_avg) / denom))
    master_N.copy_(param)
    exp_avg_N.copy_(exp_avg.float())  # bf16 moments: fp32, then round to nearest-even (as the kernel)
    exp_avg_sq_N.copy_(exp_avg_sq.float())
    if compute_N is not None:
        compute_N.copy_(param.float())
