"""Transformer blocks, split at the seams where the disaggregated runtime cuts a layer.

A MoE layer runs as five steps; only `moe.experts` runs on an expert rank:

    h_BSH, xn_BSH    = block.attention_part_normed(x_BSH)   # attention rank: norm, attention, residual, FFN norm
    routing          = block.route(h_BSH, xn_BSH=xn_BSH)    # attention rank: router
    x_PH, grouping   = block.dispatch(routing)              # attention rank: rows grouped by expert
    y_PH             = block.moe.experts(x_PH, grouping.offsets_E)   # expert rank(s)
    shared_NH        = block.shared_ffn(routing)            # attention rank (overlaps the experts)
    out_BSH          = block.combine(h_BSH, routing, y_PH, grouping, shared_NH)

`forward` composes exactly these calls (on a GPU with the triton experts the steps after the router as
one, `_forward_fused`, whose combine also adds h). Leading dense layers (`DenseBlock`) run whole on the
attention rank. `recompute: full` (`set_recompute` with `kernels.recompute.BLOCK`): a block keeps
its input and its routing (`SavedRouting`) and runs again in the backward: whole in one process,
its attention half (`attention_half`) on an attention rank.

Shape legend: B batch, S sequence, H hidden, N tokens (B*S), P token-expert pairs (N*K), E experts.
"""

from __future__ import annotations

import torch
from torch import nn

from disagmoe.config import ModelConfig
from torch.utils.checkpoint import checkpoint

from disagmoe.kernels.attention_core import KeptCore
from disagmoe.kernels.recompute import (ATTENTION, BLOCK, EXPERT_INPUT, EXPERT_OUTPUT, RowSource, SavedRouting,
                                        UnwrittenRows, derived, recomputed)
from disagmoe.model.attention import build_attention
from disagmoe.model.dispatch import ExpertGrouping, combine, group_by_expert, permute
from disagmoe.model.experts import RoutedExperts
from disagmoe.model.layers import RMSNorm, SwiGLU, add_rms_norm
from disagmoe.model.router import Router, Routing


class Block(nn.Module):
    """The attention half shared by dense and MoE blocks."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attention = build_attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.recompute_attention = False  # `recompute_modules: [attention, ...]` (`set_recompute`)
        self.recompute_block = False  # `recompute: full` (`set_recompute`)

    def set_recompute(self, modules: frozenset[str]) -> None:
        """`attention` in `modules`: the forward keeps only x and the output projection's input;
        `kernels.recompute.BLOCK` (`recompute: full`): it keeps only x (and a MoE block's routing)
        and the block runs again in the backward."""
        self.recompute_attention = ATTENTION in modules
        self.recompute_block = BLOCK in modules

    def _recomputes_block(self) -> bool:
        return self.recompute_block and torch.is_grad_enabled()

    def _attention_core(self, x_BSH: torch.Tensor, kept: KeptCore) -> torch.Tensor:
        return self.attention.core(self.attention_norm(x_BSH), kept)

    def attention_part(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """x + attention(norm(x)). With `recompute_attention` (and grad mode on) the norm, the
        projections before the core, RoPE and the core run under a non-reentrant checkpoint: the
        forward keeps x (the checkpoint's input) and the core's output (the output projection's
        input) with its log-sum-exp (`kernels.attention_core.KeptCore`); the backward runs the
        rest again, the same ops on the same values (gradients bit-equal), and the core's own
        backward from the kept output (the kernel does not run again where F.sdpa picks cuDNN, or
        flash with as many key/value heads as query heads; elsewhere it does).
        No RNG in there (no dropout), so no RNG state is stashed (a host read a CUDA graph would
        freeze); the projections' weight gradients still wait under `deferred_weight_grads` (the
        backward of the recomputed ops runs in the outer backward, grad mode off)."""
        return x_BSH + self._attention_out(x_BSH)

    def attention_part_normed(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`attention_part`'s h, the FFN norm of h [B, S, H]): the residual add and the norm in one fused
        pass (`layers.add_rms_norm`), which also sums h's two gradients in the norm's backward."""
        return add_rms_norm(x_BSH, self._attention_out(x_BSH), self.ffn_norm.weight, self.ffn_norm.eps)

    def _attention_out(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """attention(norm(x)), the output projection's output; checkpointed as `attention_part` says."""
        if self.recompute_attention and torch.is_grad_enabled():
            o_in = checkpoint(self._attention_core, x_BSH, KeptCore(), use_reentrant=False, preserve_rng_state=False)
            return self.attention.wo(o_in)
        return self.attention(self.attention_norm(x_BSH))


class DenseBlock(Block):
    """Attention and a dense SwiGLU FFN (DeepSeek-V3's first layers)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.ffn = SwiGLU(cfg.hidden_size, cfg.dense_ffn_size)

    def forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        """x + attention + FFN; under `recompute: full` one recomputed segment that keeps x."""
        if self._recomputes_block():
            return recomputed(lambda x, _routing: self._forward(x), x_BSH)  # a dense block routes nothing
        return self._forward(x_BSH)

    def _forward(self, x_BSH: torch.Tensor) -> torch.Tensor:
        h_BSH, xn_BSH = self.attention_part_normed(x_BSH)
        return h_BSH + self.ffn(xn_BSH)


class MoE(nn.Module):
    """The FFN of a MoE layer: `router`, optional `shared_experts` (one SwiGLU), `experts`."""

    def __init__(self, cfg: ModelConfig, experts_backend: str) -> None:
        super().__init__()
        self.router = Router(cfg)
        self.shared_experts = SwiGLU(cfg.hidden_size, cfg.shared_ffn_size) if cfg.shared_ffn_size else None
        self.experts = RoutedExperts(cfg.num_experts, cfg.hidden_size, cfg.expert_ffn_size, experts_backend)


class MoEBlock(Block):
    """Attention and a MoE FFN; see the module docstring for how the steps split across ranks."""

    def __init__(self, cfg: ModelConfig, experts_backend: str = "loop") -> None:
        super().__init__(cfg)
        self.moe = MoE(cfg, experts_backend)

    def route(self, h_BSH: torch.Tensor, fixed_topk_idx_NK: torch.Tensor | None = None,
              saved: SavedRouting | None = None, xn_BSH: torch.Tensor | None = None) -> Routing:
        """Normed token rows and the router's choice for them. `saved` (`recompute: full`): the
        forward records its choice there and the recomputation routes by it (the weights come
        from the recomputed scores at those ids: their gradient is the forward's). `xn_BSH`: the FFN
        norm of h where the caller has it (`attention_part_normed`)."""
        xn_NH = (self.ffn_norm(h_BSH) if xn_BSH is None else xn_BSH).flatten(0, 1)
        if saved is None:
            return self.moe.router(xn_NH, fixed_topk_idx_NK)
        routing = self.moe.router(xn_NH, saved.choice(fixed_topk_idx_NK))
        saved.record(routing.topk_idx_NK)
        return routing

    def dispatch(self, routing: Routing, saved: SavedRouting | None = None) -> tuple[torch.Tensor, ExpertGrouping]:
        """Pair rows grouped by expert ([P, H]) and the grouping that `combine` undoes (`saved`:
        the grouping the forward made, on the recomputation's run)."""
        grouping = derived(saved, "grouping", lambda: group_by_expert(routing.topk_idx_NK, self.moe.router.num_experts))
        return permute(routing.xn_NH, grouping), grouping

    def shared_ffn(self, routing: Routing) -> torch.Tensor | None:
        """The shared experts' output [N, H], or None without shared experts."""
        if self.moe.shared_experts is None:
            return None
        return self.moe.shared_experts(routing.xn_NH)

    def combine(
        self,
        h_BSH: torch.Tensor,
        routing: Routing,
        y_PH: torch.Tensor,
        grouping: ExpertGrouping,
        shared_NH: torch.Tensor | None,
    ) -> torch.Tensor:
        """h + sum_k w_k * expert_k(xn) (+ shared(xn))."""
        ffn_NH = combine(y_PH, grouping, routing.topk_w_NK)
        if shared_NH is not None:
            ffn_NH = ffn_NH + shared_NH
        return h_BSH + ffn_NH.view_as(h_BSH)

    def attention_half(self, x_BSH: torch.Tensor) -> tuple[torch.Tensor, Routing, torch.Tensor | None,
                                                           torch.Tensor | None]:
        """What an attention rank runs of this block: (h [B, S, H], the routing, the shared experts'
        output [N, H] or None, the aux loss's mean routing probabilities [E] or None without an aux
        loss). Under `recompute: full` one recomputed segment that keeps x and the routing."""
        if self._recomputes_block():
            return recomputed(self._attention_half, x_BSH)
        return self._attention_half(x_BSH, None)

    def _attention_half(self, x_BSH: torch.Tensor, saved: SavedRouting | None):
        h_BSH, xn_BSH = self.attention_part_normed(x_BSH)
        routing = self.route(h_BSH, None, saved, xn_BSH)
        router = self.moe.router
        probs_E = router.mean_probs(routing.scores_NE).float() if router.cfg.aux_loss_coef > 0 else None
        return h_BSH, routing, self.shared_ffn(routing), probs_E

    def forward(
        self, x_BSH: torch.Tensor, fixed_topk_idx_NK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, Routing]:
        """The whole layer; under `recompute: full` one recomputed segment that keeps x and the routing."""
        if self._recomputes_block():
            return recomputed(self._forward, x_BSH, fixed_topk_idx_NK)
        return self._forward(x_BSH, fixed_topk_idx_NK, None)

    def _forward(self, x_BSH: torch.Tensor, fixed_topk_idx_NK: torch.Tensor | None,
                 saved: SavedRouting | None) -> tuple[torch.Tensor, Routing]:
        h_BSH, xn_BSH = self.attention_part_normed(x_BSH)
        routing = self.route(h_BSH, fixed_topk_idx_NK, saved, xn_BSH)
        if self.moe.experts.fuses_permute(h_BSH):
            return self._forward_fused(h_BSH, routing, saved), routing
        x_PH, grouping = self.dispatch(routing, saved)
        y_PH = self.moe.experts(x_PH, grouping.offsets_E)
        out_BSH = self.combine(h_BSH, routing, y_PH, grouping, self.shared_ffn(routing))
        return out_BSH, routing

    def _forward_fused(self, h_BSH: torch.Tensor, routing: Routing, saved: SavedRouting | None) -> torch.Tensor:
        """dispatch, experts, combine with the Triton permute and weighted-combine kernels
        (the same arithmetic; the combine sums each token's k rows and the residual h in fp32, one rounding; under
        recompute of expert_output the fused layer's output and h are added apart)."""
        from disagmoe.kernels.permute import combine_rows, pair_destinations

        experts = self.moe.experts
        num_experts = self.moe.router.num_experts
        if EXPERT_OUTPUT in experts.recompute:  # one op that keeps no output rows (`kernels.fused_moe`)
            ffn_NH = experts.fused_layer(routing.xn_NH, routing.topk_idx_NK, routing.topk_w_NK)
        else:
            destinations = derived(saved, "destinations", lambda: pair_destinations(routing.topk_idx_NK, num_experts))
            offsets_E, dest_NK = destinations
            source = RowSource.of_permute(routing.xn_NH, dest_NK) if EXPERT_INPUT in experts.recompute else None
            # FP8: each token quantised once for its K pairs where that is the fewer bytes (every pair
            # of the layer is served here: `RoutedExperts.quantized_rows`)
            x_fp8 = experts.quantized_rows(routing.xn_NH, dest_NK)
            grad_slot = experts.row_grad_slot()  # FP8: the combine's backward quantises the experts' dy
            y_PH = experts(self._expert_rows(routing, destinations, x_fp8), offsets_E, source=source, x_fp8=x_fp8,
                           grad_slot=grad_slot)
            del x_fp8  # the e4m3 rows freed once the FFN's forward returned
            # the residual stream (and the shared experts' output) added in the combine's own pass
            shared_NH = self.shared_ffn(routing)
            h_NH = h_BSH.flatten(0, 1)
            residual_NH = h_NH if shared_NH is None else h_NH + shared_NH
            return combine_rows(y_PH, dest_NK, routing.topk_w_NK, grad_slot=grad_slot,
                                residual_TH=residual_NH).view_as(h_BSH)
        shared_NH = self.shared_ffn(routing)
        if shared_NH is not None:
            ffn_NH = ffn_NH + shared_NH
        return h_BSH + ffn_NH.view_as(h_BSH)

    def _expert_rows(self, routing: Routing, destinations: tuple[torch.Tensor, torch.Tensor],
                     x_fp8: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor | UnwrittenRows:
        """The routed experts' input: the tokens' rows grouped by expert [P, H] (`permute_tokens`, by
        `destinations`), or left unwritten where the experts read none (`RoutedExperts.reads_rows`: FP8
        experts given `x_fp8` that recompute expert_input; a [P, H] write and allocation saved)."""
        from disagmoe.kernels.permute import permute_tokens

        if not self.moe.experts.reads_rows(x_fp8):
            return UnwrittenRows(routing.xn_NH, destinations[1])
        return permute_tokens(routing.xn_NH, routing.topk_idx_NK, self.moe.router.num_experts,
                              destinations=destinations)[0]
