"""The causal LM: embedding, dense then MoE blocks, final norm, LM head (optionally tied).

Parameter names (stable, layout-independent; the checkpoint keys build on them):
`embed.weight`, `layers.{i}.attention_norm.weight`, `layers.{i}.attention.*`,
`layers.{i}.ffn_norm.weight`, dense layers `layers.{i}.ffn.{w1,w3,w2}.weight`, MoE layers
`layers.{i}.moe.router.weight` (+ buffer `.expert_bias`), `layers.{i}.moe.shared_experts.{w1,w3,w2}.weight`,
`layers.{i}.moe.experts.{w13_EH2F,w2_EFH}`, `norm.weight`, `lm_head.weight` (absent when tied).

Shape legend: B batch, S sequence, H hidden, V vocabulary, L MoE layers, E experts, N tokens, K top-k.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from disagmoe.config import ModelConfig
from disagmoe.kernels.recompute import expert_modules
from disagmoe.model.block import Block, DenseBlock, MoEBlock
from disagmoe.model.experts import RoutedExperts
from disagmoe.model.init import seeded_normal_
from disagmoe.model.layers import DeferrableLinear, RMSNorm, set_linears_fp8


@dataclass
class ModelOutput:
    logits_BSV: torch.Tensor | None  # None when asked for the hidden states only
    hidden_BSH: torch.Tensor  # final-normed hidden states (the LM head's input)
    aux_loss: torch.Tensor  # scalar: sum over MoE layers, already weighted by its coefficient
    z_loss: torch.Tensor  # scalar: sum over MoE layers, already weighted by its coefficient
    expert_load_LE: torch.Tensor  # int64 token-expert pairs per expert per MoE layer, detached
    topk_idx_LNK: torch.Tensor  # int64 chosen experts per MoE layer (pass back as fixed_topk_idx_LNK)


class MoETransformer(nn.Module):
    def __init__(self, cfg: ModelConfig, experts_backend: str = "loop") -> None:
        super().__init__()
        self.cfg = cfg
        self.fp8_stats = None  # kernels.fp8_stats.Fp8Stats of the FP8 experts (`set_fp8_stats`)
        self.fp8_uncounted = False  # precision fp8 on a step without the counters (`set_fp8_counting`)
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DenseBlock(cfg) if i < cfg.num_dense_layers else MoEBlock(cfg, experts_backend)
            for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.embed.weight.device.type != "meta":  # never hand out uninitialised memory
            self.init_weights(seed=0)

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        return [b for b in self.layers if isinstance(b, MoEBlock)]

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def forward(
        self, tokens_BS: torch.Tensor, fixed_topk_idx_LNK: Sequence[torch.Tensor] | torch.Tensor | None = None,
        logits: bool = True,
    ) -> ModelOutput:
        """Logits (unless `logits=False`: then only the final hidden states, for a chunked loss)
        and router statistics; `fixed_topk_idx_LNK` (e.g. a previous output's `topk_idx_LNK`)
        replaces every MoE layer's expert selection, the weights stay differentiable."""
        if fixed_topk_idx_LNK is not None and len(fixed_topk_idx_LNK) != self.cfg.num_moe_layers:
            raise ValueError(
                f"fixed_topk_idx_LNK has {len(fixed_topk_idx_LNK)} layers, the model has "
                f"{self.cfg.num_moe_layers} MoE layers"
            )
        x_BSH = self.embed(tokens_BS)
        aux_loss = z_loss = x_BSH.new_zeros(())
        loads, choices = [], []  # per MoE layer; a layer's routing is dropped with its block (its rows too)
        for block in self.layers:
            if isinstance(block, MoEBlock):
                fixed = None if fixed_topk_idx_LNK is None else fixed_topk_idx_LNK[len(choices)]
                x_BSH, routing = block(x_BSH, fixed)
                aux_loss, z_loss = aux_loss + routing.aux_loss, z_loss + routing.z_loss
                loads.append(routing.load_E)
                choices.append(routing.topk_idx_NK.detach())
            else:
                x_BSH = block(x_BSH)
        h_BSH = self.norm(x_BSH)
        E, NK = self.cfg.num_experts, (tokens_BS.numel(), self.cfg.top_k)
        return ModelOutput(
            logits_BSV=F.linear(h_BSH, self.head_weight()) if logits else None,
            hidden_BSH=h_BSH,
            aux_loss=aux_loss,
            z_loss=z_loss,
            expert_load_LE=torch.stack(loads) if loads else tokens_BS.new_zeros((0, E), dtype=torch.int64),
            topk_idx_LNK=(torch.stack(choices) if choices
                          else tokens_BS.new_zeros((0, *NK), dtype=torch.int64)),
        )

    def set_routing(self, routing: str) -> None:
        """'learned' (the router's top-k) or 'balanced' (`router.balanced_topk`, for benchmarks)."""
        if routing not in ("learned", "balanced"):
            raise ValueError(f"routing {routing!r}: choose learned or balanced")
        for block in self.moe_blocks:
            block.moe.router.balanced = routing == "balanced"

    def set_recompute(self, modules: frozenset[str]) -> None:
        """What every block and routed-expert module held here recomputes in the backward instead
        of keeping (`TrainConfig.recompute_set`: the attention side's `Block.set_recompute`, the
        experts' `RoutedExperts.set_recompute`; `recompute: full`'s `BLOCK` reaches both: a block
        recomputes itself where it runs whole, an expert rank its experts)."""
        for module in self.modules():
            if isinstance(module, RoutedExperts):
                module.set_recompute(expert_modules(modules))
            elif isinstance(module, Block):
                module.set_recompute(modules)

    def set_expert_precision(self, precision: str, backward: str | None = None, forward: str | None = None,
                             emulate: bool = False) -> None:
        """The routed experts' GEMM precision (`TrainConfig.expert_precision`) and under fp8 their
        backward's and forward's (`TrainConfig.expert_backward_precision`, `expert_forward_precision`)
        and whether the forward's FP8 GEMMs are emulated (`TrainConfig.fp8_emulate`;
        `RoutedExperts.set_precision`)."""
        for module in self.modules():
            if isinstance(module, RoutedExperts):
                module.set_precision(precision, backward, forward, emulate)

    def set_dense_fp8(self, enabled: bool, stats=None, emulate: bool = False, scaling: str = "rowwise") -> list[str]:
        """The dense projections held here (attention, MLA's, shared experts, dense FFN layers: every
        `DeferrableLinear`) in FP8, scaled `scaling` (`kernels.fp8_dense.SCALINGS`;
        `TrainConfig.dense_fp8_scaling`), counting into `stats`' dense row (a
        `kernels.fp8_stats.Fp8Stats`, or None); `TrainConfig.dense_precision`. `emulate`
        (`TrainConfig.fp8_emulate`, and the tests' reference): the same quantised operands
        dequantised and multiplied in fp64 instead of torch._scaled_mm (`fp8_dense.scaled_mm`).
        Blockwise, a linear whose shape is off the recipe's grid (`fp8_dense.fits_blockwise`: MLA's
        kv_a, 576 wide) keeps its GEMMs in bf16; returns those linears' names (empty otherwise):
        `model.layers.set_linears_fp8`, which `bench calibrate`'s FP8 projection probe runs too."""
        from disagmoe.kernels.fp8_stats import DENSE

        return set_linears_fp8(self, enabled, None if stats is None else stats.row(DENSE), emulate, scaling)

    def set_fp8_stats(self, stats) -> None:
        """One `kernels.fp8_stats.Fp8Stats` for every FP8 expert module (`RoutedExperts.set_fp8_stats`)."""
        self.fp8_stats = stats  # the step's body reads it: a non-finite scale skips the optimizer's update
        for module in self.modules():
            if isinstance(module, RoutedExperts):
                module.set_fp8_stats(stats)

    def set_fp8_counting(self, stats) -> None:
        """Whether this step's FP8 quantisers count (`TrainConfig.fp8_counters_every`): into `stats`
        (the `kernels.fp8_stats.Fp8Stats` of `set_fp8_stats`, and its dense row for the FP8 dense
        projections) or, with None, not at all: their plain kernels, about a third of the counting ones'
        time (`bench quantise`); the step's body then skips the update on a non-finite gradient norm
        instead (`fp8_uncounted`). The FP8 weight copies stay as they are (a captured step reads them)."""
        from disagmoe.kernels.fp8_stats import DENSE

        self.set_fp8_stats(stats)
        self.fp8_uncounted = stats is None
        row = None if stats is None else stats.row(DENSE)
        for module in self.modules():
            if isinstance(module, DeferrableLinear) and module.fp8:
                module.fp8_stats_row = row

    def prepare_fp8(self) -> None:
        """Refresh the FP8 weight copies of every FP8 expert module and FP8 dense projection from its
        weights, in place (a no-op without FP8): once per optimizer step, before its first forward,
        and before an evaluation. The dense projections' shared input copies of the last step are
        dropped (`fp8_dense.forget_shared_inputs`: no activation held across steps)."""
        from disagmoe.kernels.fp8_dense import forget_shared_inputs

        forget_shared_inputs()
        for module in self.modules():
            if isinstance(module, (RoutedExperts, DeferrableLinear)):
                module.prepare_fp8()

    @torch.no_grad()
    def update_router_bias(self, load_LE: torch.Tensor) -> None:
        """Aux-loss-free balancing step; call after optimizer.step() with the step's summed loads."""
        if load_LE.shape != (self.cfg.num_moe_layers, self.cfg.num_experts):
            raise ValueError(
                f"load_LE has shape {tuple(load_LE.shape)}, expected "
                f"{(self.cfg.num_moe_layers, self.cfg.num_experts)} (MoE layers x experts)"
            )
        for block, load_E in zip(self.moe_blocks, load_LE, strict=True):
            block.moe.router.update_bias(load_E)

    @torch.no_grad()
    def init_weights(self, seed: int, std: float = 0.02) -> None:
        """Norm weights 1, router biases 0, an untied embedding N(0, cfg.embedding_init_std^2)
        (default `std`), every other weight N(0, std^2), each from its own stream.

        A MoE with many experts wants a unit embedding (`embedding_init_std: 1.0`, as torchtitan's
        Llama): at 0.02 the token is ~2% of the first attention output (gain ~1.2 on normed rows
        at Qwen3-30B's shape), so every router input is nearly the same vector and all tokens pick
        the same experts. A tied embedding is also the LM head and keeps `std`."""
        embed_std = std if self.cfg.tie_embeddings or self.cfg.embedding_init_std is None else self.cfg.embedding_init_std
        for name, module in self.named_modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, RoutedExperts):
                module.init_weights(seed, name, std)
            else:
                tensor_std = embed_std if name == "embed" else std
                for pname, param in module.named_parameters(recurse=False):
                    seeded_normal_(param, seed, f"{name}.{pname}", tensor_std)
        for block in self.moe_blocks:
            if block.moe.router.expert_bias is not None:
                block.moe.router.expert_bias.zero_()
