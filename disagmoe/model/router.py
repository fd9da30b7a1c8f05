"""The router: scores, (group-limited) top-k, balancing losses and the aux-loss-free bias.

Dropless: every token reaches exactly its k experts. Selection may add a non-trainable per-expert
bias (DeepSeek-V3's auxiliary-loss-free balancing); the combine weights never include it.

Shape legend: N tokens, H hidden, E experts, K experts per token, G expert groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe.config import ModelConfig
from disagmoe.model.dispatch import expert_counts
from disagmoe.model.layers import compute_dtype


@dataclass
class Routing:
    """What the router decided for one MoE layer's tokens."""

    xn_NH: torch.Tensor  # the FFN-normed token rows the experts consume
    topk_idx_NK: torch.Tensor  # int64 expert ids per token
    topk_w_NK: torch.Tensor  # combine weights (routed_scaling already applied), dtype of xn_NH
    aux_loss: torch.Tensor  # scalar, already multiplied by router.aux_loss_coef
    z_loss: torch.Tensor  # scalar, already multiplied by router.z_loss_coef
    load_E: torch.Tensor  # int64 token-expert pairs per expert, detached
    scores_NE: torch.Tensor  # router scores (softmax or sigmoid), differentiable: the aux loss's input


def _fp32_product(a_MK: torch.Tensor, b_KN: torch.Tensor) -> torch.Tensor:
    """a @ b in fp32 from half-precision operands: on CUDA the tensor cores' GEMM with fp32
    accumulation and output (`mm` with `out_dtype`); elsewhere both upcast (the same products:
    a product of two bf16 values is exact in fp32; only the summation order may differ)."""
    if a_MK.is_cuda:
        return torch.mm(a_MK, b_KN, out_dtype=torch.float32)
    return a_MK.float() @ b_KN.float()


def _input_grad(d_NE: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    """d x = d logits @ W in the operands' half precision: on CUDA the GEMM's own bf16 (fp16) output,
    accumulated in fp32 and rounded once, where the fp32 product (`_fp32_product`) was written and
    then cast (an fp32 [N, H] write and an [N, H] copy, 1.7 ms of the Qwen3 config's step on an
    H100): the same rounding of the same fp32 sums, up to the kernels' summation order; elsewhere
    that product, rounded."""
    if d_NE.is_cuda:
        return torch.mm(d_NE, w_EH)
    return _fp32_product(d_NE, w_EH).to(d_NE.dtype)


class _HalfRouterLogits(torch.autograd.Function):
    """logits_NE fp32 = x_NH @ w_EH^T for bf16 (or fp16) x and w, without the fp32 copies the
    upcast path makes (one of x per MoE layer and micro-batch, kept for the backward: H fp32
    values per token) and without its fp32 GEMMs, which run on CUDA cores (15 ms of the Qwen3
    step at 2 micro-batches on an H200, docs/benchmarks.md). The backward rounds d logits to x's
    dtype, as every other layer's gradient is, and accumulates both GEMMs in fp32; on CUDA d x's
    GEMM writes x's dtype itself (`_input_grad`: no fp32 [N, H] product and cast of it)."""

    @staticmethod
    def forward(ctx, x_NH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_NH, w_EH)
        return _fp32_product(x_NH, w_EH.t())

    @staticmethod
    def backward(ctx, dlogits_NE: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        x_NH, w_EH = ctx.saved_tensors
        d_NE = dlogits_NE.to(x_NH.dtype)
        dx_NH = _input_grad(d_NE, w_EH) if ctx.needs_input_grad[0] else None
        dw_EH = _fp32_product(d_NE.t(), x_NH).to(w_EH.dtype) if ctx.needs_input_grad[1] else None
        return dx_NH, dw_EH


def router_logits(xn_NH: torch.Tensor, w_EH: torch.Tensor) -> torch.Tensor:
    """The gate's logits in fp32 (or fp64 for fp64 inputs): half-precision rows and weight through
    `_HalfRouterLogits`, anything else upcast to its compute dtype."""
    if xn_NH.dtype in (torch.bfloat16, torch.float16) and w_EH.dtype == xn_NH.dtype:
        logits = _HalfRouterLogits.apply(xn_NH.reshape(-1, xn_NH.shape[-1]), w_EH)
        return logits.view(*xn_NH.shape[:-1], w_EH.shape[0])
    work = compute_dtype(xn_NH.dtype)
    return F.linear(xn_NH.to(work), w_EH.to(work))


def group_limited_mask(choice_NE: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """Bool [N, E]: experts inside the `topk_groups` best groups of each token.

    A group's score is the sum of its two best experts' scores (its best one if a group has
    a single expert), as in DeepSeek-V3.
    """
    N, E = choice_NE.shape
    choice_NGe = choice_NE.view(N, num_groups, E // num_groups)
    best = min(2, E // num_groups)
    group_score_NG = choice_NGe.topk(best, dim=-1).values.sum(dim=-1)
    group_idx = group_score_NG.topk(topk_groups, dim=-1).indices
    group_mask_NG = torch.zeros_like(group_score_NG, dtype=torch.bool).scatter_(1, group_idx, True)
    return group_mask_NG[:, :, None].expand_as(choice_NGe).reshape(N, E)


def balanced_topk(tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """int64 [N, K]: token n takes experts (n*K + j) mod E, j < K: K distinct experts per token and,
    whenever N*K is a multiple of E, exactly N*K/E pairs per expert (forced-balanced routing)."""
    pairs_NK = torch.arange(tokens, device=device)[:, None] * top_k + torch.arange(top_k, device=device)[None, :]
    return pairs_NK % num_experts


class Router(nn.Module):
    """Gate `weight` [E, H]; with `router.bias_balancing` also the buffer `expert_bias` [E]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg.router
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.balanced = False  # `balanced_topk` instead of the scores' choice (benchmarks; weights stay live)
        self.weight = nn.Parameter(torch.empty(cfg.num_experts, cfg.hidden_size))
        if self.cfg.bias_balancing:
            self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))
        else:
            self.expert_bias = None

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202  (nn.Module's hook for .to() etc.)
        """Keep `expert_bias` fp32 when the model is cast (bf16 cannot hold its ~1e-3 steps);
        it still follows the model's device."""
        bias = self.expert_bias
        super()._apply(fn, recurse)
        if bias is not None:
            self.expert_bias = bias.to(self.weight.device)
        return self

    def forward(self, xn_NH: torch.Tensor, fixed_topk_idx_NK: torch.Tensor | None = None) -> Routing:
        """Route the normed rows; `fixed_topk_idx_NK` replaces the selection (weights stay live)."""
        rc = self.cfg
        logits_NE = router_logits(xn_NH, self.weight)
        scores_NE = logits_NE.softmax(-1) if rc.score == "softmax" else logits_NE.sigmoid()

        if fixed_topk_idx_NK is None:
            topk_idx_NK = self.select(scores_NE.detach())
        else:
            if fixed_topk_idx_NK.shape != (xn_NH.shape[0], self.top_k):
                raise ValueError(
                    f"fixed top-k indices have shape {tuple(fixed_topk_idx_NK.shape)}, expected "
                    f"{(xn_NH.shape[0], self.top_k)}; pass the indices recorded for these tokens"
                )
            topk_idx_NK = fixed_topk_idx_NK

        topk_w_NK = scores_NE.gather(1, topk_idx_NK)
        if rc.normalize_topk:
            topk_w_NK = topk_w_NK / (topk_w_NK.sum(-1, keepdim=True) + 1e-20)
        topk_w_NK = topk_w_NK * rc.routed_scaling

        load_E = expert_counts(topk_idx_NK, self.num_experts).detach()
        return Routing(
            xn_NH=xn_NH,
            topk_idx_NK=topk_idx_NK,
            topk_w_NK=topk_w_NK.to(xn_NH.dtype),
            aux_loss=self.aux_loss(scores_NE, load_E),
            z_loss=self.z_loss(logits_NE),
            load_E=load_E,
            scores_NE=scores_NE,
        )

    def select(self, scores_NE: torch.Tensor) -> torch.Tensor:
        """Top-k expert ids by score (+ balancing bias), within the token's best groups; with
        `balanced`, `balanced_topk` whatever the scores."""
        if self.balanced:
            return balanced_topk(scores_NE.shape[0], self.top_k, self.num_experts, scores_NE.device)
        choice_NE = scores_NE if self.expert_bias is None else scores_NE + self.expert_bias.to(scores_NE.dtype)
        if self.cfg.num_groups > 1:
            allowed_NE = group_limited_mask(choice_NE, self.cfg.num_groups, self.cfg.topk_groups)
            choice_NE = choice_NE.masked_fill(~allowed_NE, float("-inf"))
        return choice_NE.topk(self.top_k, dim=-1).indices

    def aux_loss(self, scores_NE: torch.Tensor, load_E: torch.Tensor) -> torch.Tensor:
        """Switch-style coef * E * sum_e f_e * P_e: f_e the fraction of token-expert pairs sent to e,
        P_e the mean routing probability of e (sigmoid scores are normalised per token first).
        Equals coef when the load and the probabilities are uniform."""
        if self.cfg.aux_loss_coef == 0:
            return scores_NE.new_zeros(())
        return (self.aux_weights(load_E, scores_NE.dtype) * self.mean_probs(scores_NE)).sum()

    def mean_probs(self, scores_NE: torch.Tensor) -> torch.Tensor:
        """P_E of `aux_loss`: the tokens' mean routing probability per expert (differentiable)."""
        probs_NE = scores_NE if self.cfg.score == "softmax" else scores_NE / scores_NE.sum(-1, keepdim=True)
        return probs_NE.mean(0)

    def aux_weights(self, load_E: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """coef * E * f_E, so that aux_loss = sum_e aux_weights_e * P_e (f_E from `load_E`)."""
        return self.cfg.aux_loss_coef * self.num_experts * load_E.to(dtype) / load_E.sum()

    def z_loss(self, logits_NE: torch.Tensor) -> torch.Tensor:
        """coef * mean over tokens of logsumexp(logits)^2 (keeps the gate logits small)."""
        if self.cfg.z_loss_coef == 0:
            return logits_NE.new_zeros(())
        return self.cfg.z_loss_coef * torch.logsumexp(logits_NE, dim=-1).pow(2).mean()

    @torch.no_grad()
    def update_bias(self, load_E: torch.Tensor) -> None:
        """bias += rate * sign(mean load - load_e): under-loaded experts become more attractive.

        Call after the optimizer step with the step's summed loads; no-op without bias balancing."""
        if self.expert_bias is None:
            return
        load = load_E.to(self.expert_bias.device, torch.float64)
        step = torch.sign(load.mean() - load) * self.cfg.bias_update_rate
        self.expert_bias += step.to(self.expert_bias.dtype)
