"""The part of the model one rank holds, under the full model's parameter names.

An attention rank holds the blocks of its pipeline group's layers without their routed experts
(plus the embedding on the group of layer 0, the final norm and LM head on the head group); an
expert rank holds, per MoE layer of its group, a `RoutedExperts` of its experts at `layers.<i>.moe.experts`.
A colocated rank holds both. The modules are built on the meta device, so no rank ever allocates
the whole model, then initialised by the full model's own rules: every tensor draws from the
stream of (seed, its name), so a rank's tensors equal the single-process model's bit for bit.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from torch import nn

from disagmoe.config import ModelConfig, TrainConfig
from disagmoe.model import MoEBlock, MoETransformer, RoutedExperts
from disagmoe.model.init import materialise
from disagmoe.runtime.topology import Topology


def compute_dtype(cfg: TrainConfig) -> torch.dtype:
    """The parameters' dtype for compute: bf16 (fp32 masters in FlatAdamW) or fp32."""
    return torch.bfloat16 if cfg.compute_dtype_name == "bf16" else torch.float32


def offload_bucket_bytes(cfg: TrainConfig) -> int | None:
    """FlatAdamW's `offload_bucket_bytes`: bytes per staging slot with `offload_optimizer`, else None."""
    return cfg.offload_bucket_mib * 2**20 if cfg.offload_optimizer else None


def rank_model(cfg: ModelConfig, experts_backend: str, topology: Topology, rank: int) -> RankModel:
    """The (meta-device) part of the model that `rank` of `topology` holds."""
    attention = topology.attention_role(rank)
    return RankModel(
        cfg, experts_backend,
        attention_layers=topology.attention_layers(rank),
        expert_ids=topology.experts_of(rank),
        holds_embedding=attention is not None and attention[0] == 0,
        holds_head=attention is not None and attention[0] == topology.head_group,
    )


class RankModel(nn.Module):
    """Embedding / layers / norm / head of one rank; absent parts are None or missing layers."""

    def __init__(
        self,
        cfg: ModelConfig,
        experts_backend: str,
        attention_layers: Iterable[int],
        expert_ids: dict[int, tuple[int, ...]],
        holds_embedding: bool,
        holds_head: bool,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        attention_layers = set(attention_layers)
        with torch.device("meta"):
            full = MoETransformer(cfg, experts_backend)
            self.embed = full.embed if holds_embedding or (holds_head and cfg.tie_embeddings) else None
            self.layers = nn.ModuleDict()
            for layer in sorted(attention_layers | set(expert_ids)):
                block = full.layers[layer]
                experts = None
                if layer in expert_ids:
                    experts = RoutedExperts.from_indices(block.moe.experts, expert_ids[layer])
                if layer in attention_layers:
                    if isinstance(block, MoEBlock):
                        block.moe.experts = experts  # None on a pure attention rank
                    self.layers[str(layer)] = block
                else:
                    self.layers[str(layer)] = _ExpertsOnly(experts)
            self.norm = full.norm if holds_head else None
            self.lm_head = full.lm_head if holds_head else None

    # The full model's initialisation, applied by name to the modules held here.
    init_weights = MoETransformer.init_weights
    set_routing = MoETransformer.set_routing
    set_recompute = MoETransformer.set_recompute
    # precision fp8 (`runtime.cluster.worker.setup_fp8`): on the routed experts held here, none on a
    # pure attention rank
    set_expert_precision = MoETransformer.set_expert_precision
    set_dense_fp8 = MoETransformer.set_dense_fp8  # the dense projections held here (attention side)
    set_fp8_stats = MoETransformer.set_fp8_stats
    prepare_fp8 = MoETransformer.prepare_fp8
    fp8_stats = None  # kernels.fp8_stats.Fp8Stats of the FP8 experts held here (`set_fp8_stats`)

    @property
    def moe_blocks(self) -> list[MoEBlock]:
        return [b for b in self.layers.values() if isinstance(b, MoEBlock)]

    def materialise(self, device: torch.device, seed: int) -> RankModel:
        """Allocate the meta tensors on `device` and initialise them like the full model (`model.init`)."""
        return materialise(self, device, seed)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def block(self, layer: int) -> nn.Module:
        return self.layers[str(layer)]

    def experts(self, layer: int) -> RoutedExperts:
        return self.layers[str(layer)].moe.experts

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.lm_head is None else self.lm_head.weight

    def expert_parameters(self) -> Iterator[nn.Parameter]:
        """Parameters of routed experts (sharded over the expert ranks; a replicated expert's slice
        is also held by its other owners, `runtime.stages.replicas`)."""
        for name, param in self.named_parameters():
            if ".moe.experts." in name:
                yield param

    def replicated_parameters(self) -> Iterator[nn.Parameter]:
        """Every other parameter (attention side: replicated over the data-parallel group)."""
        for name, param in self.named_parameters():
            if ".moe.experts." not in name:
                yield param


class _ExpertsOnly(nn.Module):
    """An expert rank's view of a MoE layer: just `moe.experts` (keeps the full model's names)."""

    def __init__(self, experts: RoutedExperts) -> None:
        super().__init__()
        self.moe = nn.Module()
        self.moe.experts = experts
