"""Who holds what in a distributed run: attention and expert ranks per pipeline group, expert slices.

One description serves both distributed modes:

- disaggregated: the `roles.Layout` numbering (attention ranks first, then expert ranks); each
  expert rank of group g holds a contiguous slice of every MoE layer's experts of group g.
- colocated: one group (p = 1) whose n ranks are all data-parallel attention ranks *and* the
  expert ranks: rank r runs attention for data-parallel index r and holds expert slice r.

Expert slices are contiguous and as even as possible (earlier ranks get one more expert), so a
token's expert-grouped rows split into one contiguous piece per expert rank, in rank order.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagmoe.config import ModelConfig, TrainConfig
from disagmoe.runtime.colocated import build_colocated_schedule, rank_pairs
from disagmoe.runtime.roles import Layout
from disagmoe.runtime.schedule import Op, build_schedule


def expert_slices(num_experts: int, ranks: int) -> tuple[tuple[int, int], ...]:
    """Contiguous [start, stop) expert ranges for `ranks` expert ranks, earlier ranks one larger."""
    if ranks > num_experts:
        raise ValueError(
            f"{ranks} expert ranks in one pipeline group but only {num_experts} experts per layer; "
            f"use at most {num_experts} expert ranks per group (expert_ranks / pipeline_groups)"
        )
    base, extra = divmod(num_experts, ranks)
    bounds = [0]
    for j in range(ranks):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return tuple(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class Topology:
    """Ranks and ownership of a distributed run (see the module docstring)."""

    colocated: bool
    num_layers: int
    num_dense_layers: int
    attention_groups: tuple[tuple[int, ...], ...]  # per pipeline group: ranks by data-parallel index
    expert_groups: tuple[tuple[int, ...], ...]  # per pipeline group: expert ranks in slice order
    slices: tuple[tuple[tuple[int, int], ...], ...]  # per pipeline group: each expert rank's slice
    layout: Layout | None  # the disaggregated layout; None when colocated

    @classmethod
    def disaggregated(cls, layout: Layout, num_experts: int) -> Topology:
        p = layout.pipeline_groups
        experts = tuple(layout.expert_group(g) for g in range(p))
        return cls(
            colocated=False,
            num_layers=layout.num_layers,
            num_dense_layers=layout.num_dense_layers,
            attention_groups=tuple(layout.attention_group(g) for g in range(p)),
            expert_groups=experts,
            slices=tuple(expert_slices(num_experts, len(ranks)) for ranks in experts),
            layout=layout,
        )

    @classmethod
    def colocated_ranks(cls, ranks: int, num_layers: int, num_dense_layers: int, num_experts: int) -> Topology:
        everyone = tuple(range(ranks))
        return cls(
            colocated=True,
            num_layers=num_layers,
            num_dense_layers=num_dense_layers,
            attention_groups=(everyone,),
            expert_groups=(everyone,),
            slices=(expert_slices(num_experts, ranks),),
            layout=None,
        )

    @classmethod
    def from_config(cls, cfg: TrainConfig, model_cfg: ModelConfig) -> Topology:
        if cfg.mode == "colocated":
            return cls.colocated_ranks(cfg.colocated_ranks, model_cfg.num_layers, model_cfg.num_dense_layers,
                                       model_cfg.num_experts)
        if cfg.mode != "disaggregated":
            raise ValueError(f"mode {cfg.mode!r} has no distributed topology; use disaggregated or colocated")
        return cls.disaggregated(Layout.from_config(cfg, model_cfg), model_cfg.num_experts)

    # -- sizes and groups ---------------------------------------------------------------------

    @property
    def pipeline_groups(self) -> int:
        return len(self.attention_groups)

    @property
    def world_size(self) -> int:
        if self.colocated:
            return len(self.attention_groups[0])
        return sum(map(len, self.attention_groups)) + sum(map(len, self.expert_groups))

    @property
    def data_parallel(self) -> int:
        return len(self.attention_groups[0])

    @property
    def head_group(self) -> int:
        """The group whose attention ranks run the final norm, LM head and loss."""
        return self.num_layers % self.pipeline_groups

    def group_of_layer(self, layer: int) -> int:
        return layer % self.pipeline_groups

    def is_moe(self, layer: int) -> bool:
        return layer >= self.num_dense_layers

    def next_group(self, group: int) -> int:
        return (group + 1) % self.pipeline_groups

    # -- one rank's jobs ----------------------------------------------------------------------

    def attention_role(self, rank: int) -> tuple[int, int] | None:
        """(pipeline group, data-parallel index) if `rank` runs attention, else None."""
        for group, ranks in enumerate(self.attention_groups):
            if rank in ranks:
                return group, ranks.index(rank)
        return None

    def expert_role(self, rank: int) -> tuple[int, int] | None:
        """(pipeline group, index within the group's expert ranks) if `rank` holds experts."""
        for group, ranks in enumerate(self.expert_groups):
            if rank in ranks:
                return group, ranks.index(rank)
        return None

    def layers_of_group(self, group: int) -> range:
        return range(group, self.num_layers, self.pipeline_groups)

    def attention_layers(self, rank: int) -> list[int]:
        role = self.attention_role(rank)
        return [] if role is None else list(self.layers_of_group(role[0]))

    def expert_slices_of(self, rank: int) -> dict[int, tuple[int, int]]:
        """MoE layer -> this rank's [start, stop) experts of it."""
        role = self.expert_role(rank)
        if role is None:
            return {}
        group, index = role
        return {layer: self.slices[group][index] for layer in self.layers_of_group(group) if self.is_moe(layer)}

    def attention_rank(self, group: int, dp_index: int) -> int:
        return self.attention_groups[group][dp_index]

    def programs(self, micro_batches: int) -> tuple[tuple[Op, ...], ...]:
        """Every rank's ordered op list for one training step."""
        if self.colocated:
            return build_colocated_schedule(self.world_size, self.num_layers, self.num_dense_layers, micro_batches)
        assert self.layout is not None
        return build_schedule(self.layout, micro_batches).programs

    def rank_pairs(self, micro_batches: int) -> list[tuple[int, int]]:
        """The (src, dst) pairs of distinct ranks that exchange messages (what a transport connects)."""
        return rank_pairs(self.programs(micro_batches))

    def describe(self, rank: int) -> str:
        """e.g. 'A0.1' (attention, group 0, data-parallel index 1), 'E1.0', or 'C2' (colocated)."""
        if self.colocated:
            return f"C{rank}"
        attention = self.attention_role(rank)
        if attention is not None:
            return f"A{attention[0]}.{attention[1]}"
        expert = self.expert_role(rank)
        assert expert is not None, f"rank {rank} has no role"
        return f"E{expert[0]}.{expert[1]}"

    def group_name(self, rank: int) -> str:
        """The busy-fraction group of a rank: 'A<g>', 'E<g>' or 'colocated'."""
        return "colocated" if self.colocated else self.describe(rank).split(".")[0]
