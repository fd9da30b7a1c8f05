"""The routed experts of one MoE layer as one autograd op: permute, expert FFN, weighted combine,
for `recompute` with `expert_output` (the triton experts on a GPU; the interpreter on CPU).

    y_TH[t] = sum_k w_TK[t, k] * FFN_{topk_TK[t, k]}(x_TH[t])

As three ops (`kernels.permute`, `kernels.moe_ffn`) the combine keeps the experts' output rows
y [T K, H] for its routing-weight gradient dw[t, k] = dy[t] . y[row of (t, k)], the largest
tensor of the layer after the input rows. Here nothing keeps them: with a = silu(gate) * up the
SwiGLU output and W2 the down weight, y = a W2, so dy . y = (dy W2^T) . a, and the backward's
first GEMM computes dy W2^T for every row anyway. So that GEMM reads each row's token gradient
dy[t] unscaled (`grouped_gemm` GATHER_A), writes per column tile the row's dot with a (a
recomputed from the kept pre-activations in the epilogue), then scales by w[t, k] before the
SwiGLU derivative (ROW_SCALE): the same products as the three ops, with the routing-weight
gradient from fp32 accumulators instead of bf16 rows; the tiles' partial dots are summed in
tile order (deterministic). The down weight's gradient still reads the weighted rows
dy[t] w[t, k], formed for the backward only.

The rest of `recompute` applies as in `kernels.moe_ffn`: `expert_input` keeps x_TH instead of
the grouped rows (K times smaller; the permute's own backward needs only the destinations),
`expert_swiglu` keeps h13 only. Deferred weight gradients and fp32 main gradients as in
`moe_ffn_backward`.

Shape legend: T tokens, K top-k, N = T K rows, H hidden, F expert FFN, E experts, B column tiles.
"""

from __future__ import annotations

import torch
import triton

from disagmoe.kernels import permute as pm
from disagmoe.kernels.autocast import autocast_operands
from disagmoe.kernels.moe_ffn import FFNTiles, _check_shapes, main_grad_of, moe_ffn_backward, moe_ffn_forward
from disagmoe.kernels.recompute import EXPERT_INPUT, EXPERT_SWIGLU, RowSource, pair_of_rows


class FusedMoEFunction(torch.autograd.Function):
    """permute -> expert FFN -> weighted combine (module docstring)."""

    @staticmethod
    def forward(ctx, x_TH, topk_TK, w_TK, w13_EH2F, w2_EFH, num_experts, spare_last, tiles, num_programs,
                recompute):
        x_NH, offsets_E1, dest_TK = pm.permute_forward(x_TH, topk_TK, num_experts)
        served = num_experts - 1 if spare_last else num_experts  # the spare bucket: pairs served elsewhere
        offsets_E = offsets_E1[:served]
        limit = offsets_E1[served - 1:served] if spare_last else None
        y_NH, act_NF, h13_N2F = moe_ffn_forward(x_NH, offsets_E, w13_EH2F, w2_EFH, tiles, save_for_backward=True,
                                                num_programs=num_programs)
        y_TH = pm.combine_forward(y_NH, dest_TK, w_TK, limit)
        pair_N = pair_of_rows(dest_TK)
        keep_x = x_TH if EXPERT_INPUT in recompute else x_NH
        ctx.save_for_backward(keep_x, offsets_E, dest_TK, pair_N, w_TK, w13_EH2F, w2_EFH,
                              None if EXPERT_SWIGLU in recompute else act_NF, h13_N2F,
                              *(() if limit is None else (limit,)))
        ctx.rows_from_tokens = EXPERT_INPUT in recompute
        ctx.tiles, ctx.num_programs = tiles, num_programs
        ctx.main_grads = (main_grad_of(w13_EH2F), main_grad_of(w2_EFH))
        return y_TH

    @staticmethod
    def backward(ctx, dy_TH):
        keep_x, offsets_E, dest_TK, pair_N, w_TK, w13, w2, act_NF, h13_N2F, *limit = ctx.saved_tensors
        limit = limit[0] if limit else None
        top_k = dest_TK.shape[1]
        token_N = pair_N // top_k
        dy_TH = dy_TH.contiguous().to(h13_N2F.dtype)
        rows = pair_N.numel()
        served_N = torch.arange(rows, device=pair_N.device) < (offsets_E[-1] if offsets_E.numel() else 0)
        scale_N = torch.where(served_N, w_TK.reshape(-1)[pair_N].float(), 0.0)
        # the weighted rows dy[t] w[t, k] the down weight's gradient reads, scattered in one pass
        # (a gather, an fp32 broadcast product and a cast took 3.5 ms a layer and micro-batch on an H200)
        dy_NH = pm.copy_rows(dy_TH, dest_TK, w_TK, limit)  # past the spare bucket's start: weight 0
        x_NH = RowSource(keep_x, token_N).rows(h13_N2F.dtype) if ctx.rows_from_tokens else keep_x
        ffn = w2.shape[1]
        rowdot_BN = torch.empty((triton.cdiv(ffn, ctx.tiles.down_dgrad.block_n), rows), dtype=torch.float32,
                                device=dy_TH.device)
        dx_NH, dw13, dw2 = moe_ffn_backward(dy_NH, x_NH, offsets_E, w13, w2, act_NF, h13_N2F, ctx.tiles,
                                            num_programs=ctx.num_programs, main_grads=ctx.main_grads,
                                            weighted_rows=(dy_TH, token_N, scale_N, rowdot_BN))
        dot_N = torch.where(served_N, rowdot_BN.sum(0), 0.0)  # tiles summed in order: deterministic
        dw_TK = dot_N.index_select(0, dest_TK.reshape(-1).long()).view_as(w_TK).to(w_TK.dtype)
        dx_TH = pm.combine_forward(dx_NH.contiguous(), dest_TK, None, limit)  # the permute's backward
        return dx_TH, None, dw_TK, dw13, dw2, None, None, None, None, None


def fused_moe(x_TH: torch.Tensor, topk_TK: torch.Tensor, w_TK: torch.Tensor, w13_EH2F: torch.Tensor,
              w2_EFH: torch.Tensor, *, spare_last: bool = False, recompute: frozenset[str] = frozenset(),
              tiles: FFNTiles | None = None, num_programs: int | None = None) -> torch.Tensor:
    """y_TH of the module docstring, differentiable in x, w and both weights. `topk_TK`: each
    pair's expert in [0, E) (E = w13's experts), or E for a pair served elsewhere when
    `spare_last` (its term is zero). Operands are cast as `moe_ffn.expert_ffn_triton` casts them."""
    if x_TH.is_cuda:
        x_TH, w13_EH2F, w2_EFH = autocast_operands(x_TH, w13_EH2F, w2_EFH)
    _check_shapes(x_TH, None, w13_EH2F, w2_EFH)
    if topk_TK.shape != w_TK.shape or topk_TK.shape[0] != x_TH.shape[0]:
        raise ValueError(f"x [T, H], topk [T, K] and w [T, K] must agree; got {tuple(x_TH.shape)}, "
                         f"{tuple(topk_TK.shape)}, {tuple(w_TK.shape)}")
    experts = w13_EH2F.shape[0]
    if tiles is None:
        tiles = FFNTiles.for_shape(topk_TK.numel(), experts, x_TH.shape[1], w2_EFH.shape[1], x_TH.device,
                                   x_TH.dtype)
    return FusedMoEFunction.apply(x_TH.contiguous(), topk_TK.contiguous(), w_TK.contiguous(), w13_EH2F, w2_EFH,
                                  experts + 1 if spare_last else experts, spare_last, tiles, num_programs,
                                  frozenset(recompute))
