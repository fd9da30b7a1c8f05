"""Named kernels of a profiled step against their roofline bound (`bench profile`'s bounds table).

Issue 20 item 2 holds the expert weight gradients to 1.3x of max(FLOPs / matmul ceiling, bytes /
HBM) for their own traffic; this makes that ratio a product figure, and the same for the step's
memory-bound passes whose bytes the roofline defines (the FP8 token-group quantiser and weight
copies, the permute and combine, the AdamW update): how far each sits from the copy rate. A family
is the kernels whose names hold one of its keys; the work a step asks of it is the roofline's own
stage (`roofline.stages`, the definition the planner prices and `bench calibrate` fits; the permute
and combine by their kernels' own bytes, which that stage overstates: `_permute_and_combine`), summed over the
step's MoE layers and micro-batches of `mode: single` on one GPU; its bound is that work's time under
the config's hardware preset (`Ceilings.of`: with a calibrated preset the measured matmul fraction
and HBM rate, with a datasheet one its efficiency factors, so there the ratio reads low). Pure
arithmetic: no torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from disagmoe.config import HardwareConfig, ModelConfig, TrainConfig, load_hardware
from disagmoe.roofline.ceilings import Ceilings
from disagmoe.placement.cost import FP8_FORWARD_SHARES
from disagmoe.roofline.memory import fp8_token_group_rows, fp8_weight_copy_bytes, fp8_weight_copy_shares
from disagmoe.roofline.params import count_params
from disagmoe.runtime.training.tile_coverage import launch_rows
from disagmoe.roofline.stages import (BF16, FP8_TOKEN_GROUP_BYTES, Work, adamw_update_bytes, dense_fp8_weight_copies,
                                      dense_fp8_weights, expert_weight_grads, main_grad_passes, routed_experts)


@dataclass(frozen=True)
class KernelFamily:
    name: str
    keys: tuple[str, ...]  # kernel names holding any of these (lower case) belong to it
    # the work one step asks of it, or (a str) why this run prices none: its kernels are others
    work: Callable[[TrainConfig, ModelConfig], Work | str]
    fp8: bool = False  # its GEMMs run in e4m3: the compute ceiling is the bf16 one times fp8_tflops / bf16_tflops
    # kernels counted only where the experts' data gradients run in this family's precision (the split epilogue's
    # SwiGLU-gradient pass follows either precision's data gradient)
    data_grad_keys: tuple[str, ...] = ()


def _micro_batch_rows(cfg: TrainConfig, m: ModelConfig) -> tuple[int, int]:
    """(micro-batches a step, routed rows a micro-batch) of `mode: single` on the one GPU."""
    return int(cfg.micro_batches), launch_rows(cfg, m)


def _weight_grads_of_step(cfg: TrainConfig, m: ModelConfig, operand_bytes: float) -> Work:
    """The step's expert weight gradients, each launch adding into the fp32 main gradient (the first of a
    step storing it: first touch), one launch per micro-batch or, paired (`TrainConfig.pairs_expert_wgrads`,
    `kernels.wgrad_pairs`), per two, as the planner prices them; the rows read at `operand_bytes` a value."""
    micro_batches, rows = _micro_batch_rows(cfg, m)
    launch = expert_weight_grads(m, rows, m.num_experts, stored_share=1.0 / micro_batches,
                                 main_grad_passes=main_grad_passes(micro_batches, cfg.pairs_expert_wgrads),
                                 operand_bytes=operand_bytes)
    return launch.scale(micro_batches * m.num_moe_layers)


def _expert_weight_grads(cfg: TrainConfig, m: ModelConfig) -> Work | str:
    """The bf16 Triton experts' weight gradients (`_weight_grads_of_step` over the bf16 rows)."""
    if cfg.experts_backend != "triton":
        return f"experts_backend: {cfg.experts_backend} runs no Triton weight-gradient kernel"
    if cfg.expert_backward_precision == "fp8":
        return "fp8_expert_backward: fp8 runs the FP8 weight-gradient kernels (the FP8 family)"
    return _weight_grads_of_step(cfg, m, BF16)


def _fp8_expert_weight_grads(cfg: TrainConfig, m: ModelConfig) -> Work | str:
    """The all-FP8 backward's weight gradients (`kernels.fp8.fp8_weight_grad`, `kernels.fp8_gluon`'s):
    `_weight_grads_of_step` over the e4m3 token-group copies (a byte a value and a scale per 128 tokens;
    each group's padding to 128 rows not counted), at the FP8 compute ceiling."""
    if cfg.experts_backend != "triton":
        return f"experts_backend: {cfg.experts_backend} runs no Triton weight-gradient kernel"
    if cfg.expert_backward_precision != "fp8":
        return "no all-FP8 backward here (fp8_expert_backward: fp8 under precision fp8): the bf16 family's kernels run"
    return _weight_grads_of_step(cfg, m, FP8_TOKEN_GROUP_BYTES)


def _row_gemm_flops(cfg: TrainConfig, m: ModelConfig, fp8: bool) -> float:
    """The step's FLOPs of the routed experts' row GEMMs (the forward's gate/up and down, the data gradients:
    each the forward's FLOPs, `roofline.stages.expert_data_grads`) that run in e4m3 (`fp8`) or in bf16: under FP8
    experts the forward's gate/up GEMM (two thirds of it) and down GEMM (one third) as `expert_forward_precision`
    says, the data gradients in FP8 unless `expert_backward_precision` is bf16; the forward twice under
    `recompute: full`."""
    micro_batches, rows = _micro_batch_rows(cfg, m)
    forward = float(routed_experts(m, rows, m.num_experts).flops) * micro_batches * m.num_moe_layers
    if cfg.expert_precision != "fp8":
        return 0.0 if fp8 else forward * (2 if cfg.recompute == "full" else 1) + forward
    fp8_forward = FP8_FORWARD_SHARES[cfg.expert_forward_precision]
    fp8_backward = cfg.expert_backward_precision != "bf16"
    if fp8:
        return forward * fp8_forward + forward * fp8_backward
    return forward * (1 - fp8_forward) + forward * (not fp8_backward)


def _row_gemms(fp8: bool) -> Callable[[TrainConfig, ModelConfig], Work | str]:
    """The expert row GEMMs of one precision (`_row_gemm_flops`) as FLOPs alone: their bound is the matmul
    ceiling (the planner prices them by FLOPs at the measured rate), so the ratio reads as the share of it they
    reach, issue 20 item 3's measure."""
    def work(cfg: TrainConfig, m: ModelConfig) -> Work | str:
        if cfg.experts_backend != "triton":
            return f"experts_backend: {cfg.experts_backend} runs no Triton row GEMM"
        flops = _row_gemm_flops(cfg, m, fp8)
        if flops == 0.0:
            return "no FP8 row GEMM here (precision fp8)" if fp8 else "every expert row GEMM runs in FP8 here"
        return Work(flops=flops)
    return work


def _fp8_token_groups(cfg: TrainConfig, m: ModelConfig) -> Work | str:
    """The all-FP8 backward's token-group quantiser (`kernels.fp8.quantize_token_groups`): a micro-batch's
    weight-gradient operands, the rows `expert_weight_grads` reads (x and d y, H values a row; act, F; d h13, 2F),
    each read once in bf16 (x from its tokens where recomputation dropped the grouped rows: the same bytes) and
    written as a token-contiguous e4m3 copy, every expert's group padded to 128 rows (`fp8_token_group_rows`),
    with an fp32 scale per 128 rows of a column; no FLOPs worth a ceiling."""
    if cfg.experts_backend != "triton":
        return f"experts_backend: {cfg.experts_backend} runs no FP8 token-group quantiser"
    if cfg.expert_backward_precision != "fp8":
        return "no all-FP8 backward here (fp8_expert_backward: fp8 under precision fp8): no token-group copies"
    micro_batches, rows = _micro_batch_rows(cfg, m)
    values = 2 * m.hidden_size + 3 * m.expert_ffn_size
    launch = Work(hbm_bytes=values * (BF16 * rows + FP8_TOKEN_GROUP_BYTES * fp8_token_group_rows(rows, m.num_experts)))
    return launch.scale(micro_batches * m.num_moe_layers)


def _fp8_weight_copies(cfg: TrainConfig, m: ModelConfig) -> Work | str:
    """The block quantiser's step (`kernels.fp8.quantize_blocks`, once an optimizer step): the routed experts'
    bf16 weights its recipe reads a copy of, each read once and written as the e4m3 copies the recipe reads
    (`roofline.memory.fp8_weight_copy_shares`: a run's default, the down GEMM's forward and the data gradients,
    4/3 of a byte a parameter), and under blockwise FP8 dense projections their weights' two copies
    (`roofline.stages.dense_fp8_weight_copies`; rowwise copies are another kernel's), each copy with an fp32
    scale per 128 x 128 block."""
    expert_bytes = 0.0
    if cfg.expert_precision == "fp8":
        recipe = cfg.expert_forward_precision, cfg.expert_backward_precision
        params = count_params(m).routed_experts
        expert_bytes = fp8_weight_copy_shares(*recipe)[0] * params * BF16 + fp8_weight_copy_bytes(params, *recipe)
    dense_bytes = 0.0
    if cfg.dense_fp8_scaling == "blockwise":
        weights = dense_fp8_weights(m, m.num_moe_layers, m.num_dense_layers, "blockwise")
        dense_bytes = float(dense_fp8_weight_copies(weights, "blockwise").hbm_bytes)
    if expert_bytes == 0.0 and dense_bytes == 0.0:
        return "no block-quantised FP8 weight copies here (precision fp8: the experts', and blockwise dense ones)"
    return Work(hbm_bytes=expert_bytes + dense_bytes)


def _adamw_update(cfg: TrainConfig, m: ModelConfig) -> Work | str:
    """FlatAdamW's update pass in the Triton kernel (`kernels.adamw`, `optim.update_kernel: triton`): every
    parameter's master, main gradient and moments read and master, moments and compute copy written, as
    `roofline.stages.adamw_update_bytes` prices it (the planner's optimizer stage without its zeroing and norm
    passes, other kernels)."""
    if cfg.optim.update_kernel != "triton":
        return f"optim.update_kernel: {cfg.optim.update_kernel} runs torch's fused AdamW (other kernels)"
    read, written = adamw_update_bytes(cfg.optim.state_dtype, "triton", cfg.optim.grad_clip > 0)
    return Work(hbm_bytes=count_params(m).total * (read + written))


def _permute_and_combine(cfg: TrainConfig, m: ModelConfig) -> Work | str:
    """The Triton permute and weighted combine around the routed experts (`kernels.permute`, the block's fused
    path), by the bytes its kernels move to and from HBM, bf16 rows of H values, a layer and micro-batch of T tokens
    and N = T x top-k rows: the forward's row copy (T read, N written: a token's top-k copies read it from the L2)
    and combine (N and the residual's T read, T written); the backward's combine gradient (dy's T and the N rows
    read, their N gradients written) and the permute's backward, a combine without weights (N read, T written):
    5 N + 5 T rows in all, the forward's 2 N + 3 T once more under `recompute: full`. Not the planner's permute
    stage (`roofline.stages.permute`: 4 N rows each way, the bytes its calibrated HBM fraction was fitted to),
    which would put these kernels below their bound; rows selective recomputation gathers again run the same row
    copy and are not counted (the ratio reads high there); the routing weights' gradients are negligible."""
    if cfg.experts_backend != "triton":
        return f"experts_backend: {cfg.experts_backend} runs no Triton permute or combine"
    if cfg.expert_precision == "fp8":
        return ("precision fp8: the row copy moves e4m3 rows and their scales, and skips the bf16 rows where no "
                "GEMM reads them (not priced here)")
    micro_batches, rows = _micro_batch_rows(cfg, m)
    tokens = rows // m.top_k
    moved = 5 * rows + 5 * tokens + ((2 * rows + 3 * tokens) if cfg.recompute == "full" else 0)
    return Work(hbm_bytes=float(moved * m.hidden_size * BF16 * micro_batches * m.num_moe_layers))


# torch._grouped_mm's CUTLASS kernels, where a tuned tile routes a bf16 row GEMM to the library (`TileConfig.library`):
# their mangled names hold the grouped problem shape and the pointer-array schedule; a step's dense projections run
# cuBLAS's (nvjet) kernels, and its FP8 rowwise projections CUTLASS GEMMs without either
LIBRARY_GROUPED_GEMM_KEYS = ("groupproblemshape", "ptrarraytmawarpspecialized")
# the split epilogue's SwiGLU-gradient pass after a plain down data gradient (bf16, or quantising its output in FP8)
SWIGLU_GRAD_PASS_KEYS = ("_swiglu_grad_rows_kernel", "_swiglu_grad_rows_quantized_kernel")

FAMILIES = (
    # each with the split epilogue's SwiGLU-gradient pass (down dgrad's other half) where its data gradients run
    KernelFamily("expert row GEMMs (bf16)", ("_ragged_rows_gemm", "_gluon_rows_gemm", "_gluon_swiglu_gemm")
                 + LIBRARY_GROUPED_GEMM_KEYS, _row_gemms(fp8=False), data_grad_keys=SWIGLU_GRAD_PASS_KEYS),
    KernelFamily("expert row GEMMs (FP8)", ("fp8_rows_gemm",), _row_gemms(fp8=True), fp8=True,
                 data_grad_keys=SWIGLU_GRAD_PASS_KEYS),
    KernelFamily("expert weight gradients (bf16)", ("_ragged_weight_grad", "_gluon_weight_grad"), _expert_weight_grads),
    KernelFamily("expert weight gradients (FP8)", ("fp8_weight_grad",), _fp8_expert_weight_grads, fp8=True),
    # (not `_quantize_rows_and_token_groups`, the one-pass quantiser no step runs)
    KernelFamily("FP8 token-group quantiser", ("_quantize_token_groups",), _fp8_token_groups),
    KernelFamily("FP8 weight copies", ("_quantize_blocks",), _fp8_weight_copies),
    KernelFamily("permute and combine", ("_permute_copy_kernel", "_combine_kernel", "_combine_backward_kernel"),
                 _permute_and_combine),
    KernelFamily("AdamW update", ("_adamw_kernel",), _adamw_update),
)


def _ceilings(hw: HardwareConfig, fp8: bool) -> Ceilings:
    """The hardware's ceilings, the compute one at the FP8 rate for an FP8 family (the bf16 rate, or the
    calibrated one, times fp8_tflops / bf16_tflops: as the planner prices FP8 GEMMs)."""
    ceilings = Ceilings.of(hw)
    if not fp8:
        return ceilings
    return dataclasses.replace(ceilings, flops_per_s=ceilings.flops_per_s * hw.fp8_tflops / hw.bf16_tflops)


def kernel_bounds(cfg: TrainConfig, m: ModelConfig, kernel_ms: dict[str, float]) -> list[dict]:
    """For each family (`FAMILIES`): its kernels' measured ms a step (`kernel_ms`: kernel name -> ms
    a step), the bound's ms (the slower of compute and HBM under `cfg.hardware`'s ceilings), which
    one binds, the work (TFLOP, GB) and measured / bound; a family this run does not run, or a run
    without a hardware preset, gets its reason in `note` and no figures."""
    rows = []
    fp8_data_grads = cfg.expert_backward_precision not in (None, "bf16")  # None: bf16 experts
    for family in FAMILIES:
        keys = family.keys + (family.data_grad_keys if family.fp8 == fp8_data_grads else ())
        measured = sum(ms for name, ms in kernel_ms.items() if any(k in name.lower() for k in keys))
        work = family.work(cfg, m)
        row: dict = {"family": family.name, "ms_per_step": measured}
        if isinstance(work, str) or cfg.hardware is None or measured == 0.0:
            row["note"] = (work if isinstance(work, str) else
                           "no hardware preset: set hardware= to price the bound" if cfg.hardware is None else
                           "none of its kernels ran in the profiled steps")
            rows.append(row)
            continue
        times = _ceilings(load_hardware(cfg.hardware), family.fp8).times(work)
        bound = max(("compute", "hbm"), key=lambda k: float(times[k]))
        bound_ms = float(times[bound]) * 1e3
        row.update(bound_ms_per_step=bound_ms, bound=bound, tflop=float(work.flops) / 1e12,
                   gb=float(work.hbm_bytes) / 1e9, compute_ms=float(times["compute"]) * 1e3,
                   hbm_ms=float(times["hbm"]) * 1e3, ratio=measured / bound_ms, hardware=cfg.hardware)
        rows.append(row)
    return rows
