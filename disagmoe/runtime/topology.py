"""Who holds what in a distributed run: attention and expert ranks per pipeline group, expert ids.

One description serves both distributed modes:

- disaggregated: the `roles.Layout` numbering (attention ranks first, then expert ranks); the
  expert ranks of group g share out the experts of every MoE layer of group g.
- colocated: the `roles.ColocatedLayout` numbering, p groups of n / p ranks; each group's ranks
  are its data-parallel attention ranks *and* its expert ranks: rank g * (n / p) + d runs
  attention for data-parallel index d of group g and holds its share of that group's experts.

The expert placement is, per MoE layer and per expert, its owners: the expert ranks of the
layer's group that hold it (`expert_owners`, indices into the group); `expert_ids` says the same
per rank (the ascending ids it holds). Without a plan each expert has one owner and each rank a
contiguous range, as even as possible (earlier ranks one more); with `expert_replica_sets` B the
group's ranks form B blocks (replica sets), block c the ranks c, c + B, c + 2B, ... of the group,
each holding every expert once in contiguous ranges (`blocked_owners`). A `disagmoe plan` result
may assign any subsets, different per layer, and replicate experts: each attention rank sends its
rows of a replicated expert to one or several of the owners (`plan_layout.replica_rows`), and the
owners sum their gradients before the optimizer step (`replica_groups`).

Who talks to whom follows from the owners: `served(layer, d)` are the expert ranks the attention
rank of data-parallel index d dispatches layer `layer` to (those holding an owner it feeds:
`plan_layout.fed_replicas`), `sources_of(layer, rank)` the indices whose dispatch reaches an
expert rank; COMBINE, COMBINE_GRAD and DISPATCH_GRAD travel the same pairs. With B blocks source
d feeds block d mod B only (colocated: its own block).

A router with an auxiliary loss needs each micro-batch's expert load over every source of the
group (`global_load`, `RouterConfig.needs_every_source_load`), which each expert rank returns with
DISPATCH_GRAD. An expert rank counts it over its own sources only, so where a layer's expert
ranks split into blocks (`blocks`: the ranks with one set of sources, the sets disjoint, blocks of
equal size, colocated each rank among its own block's sources, so that no other message travels
between two blocks' ranks of the layer) each rank sends its block's load to the rank at its
position in every other block (`load_peers`, EXPERT_LOAD) and adds theirs before its backward.
Where they do not (a plan's uneven replicas), every source dispatches that layer to its whole
group, as before the exchange.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from disagmoe.config import ModelConfig, TrainConfig
from disagmoe.runtime.schedule.colocated import build_colocated_schedule, rank_pairs
from disagmoe.runtime.plan_layout import (
    ExpertIds,
    ExpertOwners,
    apply_plan,
    fed_replicas,
    held_ids,
    plan_placement,
)
from disagmoe.runtime.schedule.roles import ColocatedLayout, LayerRing, Layout
from disagmoe.runtime.schedule.schedule import Op, build_schedule


def contiguous_expert_ids(num_experts: int, ranks: int) -> tuple[ExpertIds, ...]:
    """The default placement of one layer: contiguous id ranges, earlier ranks one larger."""
    if ranks > num_experts:
        raise ValueError(
            f"{ranks} expert ranks in one pipeline group but only {num_experts} experts per layer; "
            f"use at most {num_experts} expert ranks per group (expert_ranks / pipeline_groups)"
        )
    base, extra = divmod(num_experts, ranks)
    bounds = [0]
    for j in range(ranks):
        bounds.append(bounds[-1] + base + (1 if j < extra else 0))
    return tuple(tuple(range(start, stop)) for start, stop in zip(bounds[:-1], bounds[1:]))


def blocked_owners(num_experts: int, ranks: int, sets: int) -> ExpertOwners:
    """The default placement of one layer in `sets` blocks of the group's `ranks` (each block every
    expert once, in contiguous ranges; block c the ranks c, c + sets, ...): per expert, its owners in
    replica order, replica c in block c."""
    if ranks % sets:
        raise ValueError(f"{ranks} expert ranks in one pipeline group do not split into expert_replica_sets={sets} "
                         "blocks of equal size; make the group's ranks a multiple of expert_replica_sets")
    per_block = contiguous_expert_ids(num_experts, ranks // sets)
    owner = {e: j for j, ids in enumerate(per_block) for e in ids}
    return tuple(tuple(c + sets * owner[e] for c in range(sets)) for e in range(num_experts))


@dataclass(frozen=True)
class Topology(LayerRing):
    """Ranks and ownership of a distributed run (see the module docstring)."""

    colocated: bool
    num_layers: int
    num_dense_layers: int
    attention_groups: tuple[tuple[int, ...], ...]  # per pipeline group: ranks by data-parallel index
    expert_groups: tuple[tuple[int, ...], ...]  # per pipeline group: its expert ranks
    expert_owners: tuple[ExpertOwners, ...]  # per layer, per expert: owner indices in its group (dense: ())
    layout: Layout | None  # the disaggregated layout; None when colocated
    global_load: bool = False  # the router needs each micro-batch's load over every source (module docstring)

    def __post_init__(self) -> None:
        for layer, owners in enumerate(self.expert_owners):
            if self.is_moe(layer):
                ranks = len(self.expert_groups[self.group_of_layer(layer)])
                assert all(who and len(set(who)) == len(who) for who in owners), f"layer {layer}: distinct owners"
                assert all(0 <= i < ranks for who in owners for i in who), f"layer {layer}: owners in the group"
                assert all(held_ids(owners, ranks)), f"layer {layer}: every expert rank holds an expert"

    @classmethod
    def disaggregated(cls, layout: Layout, num_experts: int, placement: dict[int, ExpertOwners] | None = None,
                      sets: int = 1, global_load: bool = False) -> Topology:
        """`placement`: MoE layer -> each expert's owners (default: contiguous ranges in `sets`
        blocks of each group's expert ranks, `blocked_owners`); `global_load`: the field's."""
        p = layout.pipeline_groups
        experts = tuple(layout.expert_group(g) for g in range(p))
        return cls(
            colocated=False,
            num_layers=layout.num_layers,
            num_dense_layers=layout.num_dense_layers,
            attention_groups=tuple(layout.attention_group(g) for g in range(p)),
            expert_groups=experts,
            expert_owners=_per_layer(layout.num_layers, layout.num_dense_layers, num_experts,
                                     [len(experts[layout.group_of_layer(l)]) for l in range(layout.num_layers)],
                                     placement, sets),
            layout=layout,
            global_load=global_load,
        )

    @classmethod
    def colocated_ranks(cls, ranks: int, num_layers: int, num_dense_layers: int, num_experts: int,
                        placement: dict[int, ExpertOwners] | None = None, pipeline_groups: int = 1,
                        sets: int = 1, global_load: bool = False) -> Topology:
        """`ranks`: the total over the `pipeline_groups` groups; the rest as `disaggregated`'s (`sets`:
        each group's EP blocks)."""
        layout = ColocatedLayout(ranks, pipeline_groups, num_layers, num_dense_layers)
        groups = tuple(layout.attention_group(g) for g in range(pipeline_groups))
        return cls(
            colocated=True,
            num_layers=num_layers,
            num_dense_layers=num_dense_layers,
            attention_groups=groups,
            expert_groups=groups,
            expert_owners=_per_layer(num_layers, num_dense_layers, num_experts,
                                     [layout.data_parallel] * num_layers, placement, sets),
            layout=None,
            global_load=global_load,
        )

    @classmethod
    def from_config(cls, cfg: TrainConfig, model_cfg: ModelConfig) -> Topology:
        """The topology of `cfg`, or of its plan when it names one (see `plan_layout.apply_plan`)."""
        placement = None
        if cfg.plan is not None:
            cfg = apply_plan(cfg, model_cfg)
            placement = plan_placement(cfg.plan, model_cfg)
        load = model_cfg.router.needs_every_source_load
        if cfg.mode == "colocated":
            return cls.colocated_ranks(cfg.colocated_ranks, model_cfg.num_layers, model_cfg.num_dense_layers,
                                       model_cfg.num_experts, placement, cfg.pipeline_groups,
                                       cfg.expert_replica_sets, load)
        if cfg.mode != "disaggregated":
            raise ValueError(f"mode {cfg.mode!r} has no distributed topology; use disaggregated or colocated")
        return cls.disaggregated(Layout.from_config(cfg, model_cfg), model_cfg.num_experts, placement,
                                 cfg.expert_replica_sets, load)

    # -- sizes and groups ---------------------------------------------------------------------

    @property
    def pipeline_groups(self) -> int:
        return len(self.attention_groups)

    @property
    def world_size(self) -> int:
        if self.colocated:
            return sum(map(len, self.attention_groups))
        return sum(map(len, self.attention_groups)) + sum(map(len, self.expert_groups))

    @property
    def data_parallel(self) -> int:
        return len(self.attention_groups[0])

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

    def experts_of(self, rank: int) -> dict[int, ExpertIds]:
        """MoE layer -> the ids of this rank's experts of it (replicas included)."""
        role = self.expert_role(rank)
        if role is None:
            return {}
        group, index = role
        return {layer: self.expert_ids(layer)[index] for layer in self.layers_of_group(group) if self.is_moe(layer)}

    def expert_ids(self, layer: int) -> tuple[ExpertIds, ...]:
        """Per expert rank of the layer's group: the ids it holds (replicas included)."""
        return held_ids(self.expert_owners[layer], len(self.expert_groups[self.group_of_layer(layer)]))

    def owner_ranks(self, layer: int, expert: int) -> tuple[int, ...]:
        """The global ranks holding `expert` of `layer`, in replica order (the first is its primary)."""
        group = self.expert_groups[self.group_of_layer(layer)]
        return tuple(group[i] for i in self.expert_owners[layer][expert])

    def replica_groups(self) -> list[tuple[int, ...]]:
        """Every set of global ranks (ascending) that holds a replicated expert together, sorted:
        the groups whose members sum that expert's gradients."""
        return sorted({tuple(sorted(self.owner_ranks(layer, e))) for layer, owners in enumerate(self.expert_owners)
                       for e, who in enumerate(owners) if len(who) > 1})

    def attention_rank(self, group: int, dp_index: int) -> int:
        return self.attention_groups[group][dp_index]

    # -- who talks to whom --------------------------------------------------------------------

    def served(self, layer: int, dp_index: int) -> tuple[int, ...]:
        """The expert ranks (in group order) the attention rank of data-parallel index `dp_index`
        dispatches MoE layer `layer` to, and hears back from (module docstring)."""
        return self._served[layer][dp_index]

    def sources_of(self, layer: int, rank: int) -> tuple[int, ...]:
        """The data-parallel indices (ascending) whose dispatch of MoE layer `layer` reaches expert
        rank `rank`: its sources in the layer's group, its destinations in the next."""
        return tuple(d for d, ranks in enumerate(self._served[layer]) if rank in ranks)

    @property
    def dispatch_width(self) -> int:
        """The most expert ranks one attention rank dispatches one MoE layer to (0: no MoE layer)."""
        return max((len(ranks) for per_source in self._served for ranks in per_source), default=0)

    def load_peers(self, layer: int, rank: int) -> tuple[int, ...]:
        """The expert ranks that expert rank `rank` sends its load of MoE layer `layer` to, and hears
        theirs from (EXPERT_LOAD): the rank at its position in every other block of the layer (block
        order), where the run needs the global load and the layer's group serves in blocks (module
        docstring); else ()."""
        blocks = self.blocks(layer) if self.global_load and self.is_moe(layer) else None
        if blocks is None or len(blocks) == 1:
            return ()
        position = next(block.index(rank) for block in blocks if rank in block)
        return tuple(block[position] for block in blocks if rank not in block)

    def blocks(self, layer: int) -> tuple[tuple[int, ...], ...] | None:
        """MoE layer `layer`'s expert ranks grouped by the sources they serve (module docstring),
        blocks ordered by their sources, ranks in group order; None where they do not split into
        blocks."""
        return self._blocks[layer]

    @cached_property
    def _blocks(self) -> tuple[tuple[tuple[int, ...], ...] | None, ...]:
        return tuple(self._layer_blocks(layer) if self.is_moe(layer) else None for layer in range(self.num_layers))

    def _layer_blocks(self, layer: int) -> tuple[tuple[int, ...], ...] | None:
        """The blocks of MoE layer `layer` as its fed ranks split the group, or None."""
        group = self.expert_groups[self.group_of_layer(layer)]
        fed = self._fed[layer]
        sources = {rank: tuple(d for d, ranks in enumerate(fed) if rank in ranks) for rank in group}
        by_sources: dict[tuple[int, ...], list[int]] = {}
        for rank in group:
            by_sources.setdefault(sources[rank], []).append(rank)
        blocks = [tuple(by_sources[s]) for s in sorted(by_sources)]
        disjoint = sum(map(len, by_sources)) == self.data_parallel
        even = len({len(block) for block in blocks}) == 1
        own = not self.colocated or all(group.index(rank) in sources[rank] for rank in group)
        return tuple(blocks) if disjoint and even and own else None

    @cached_property
    def _served(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """`served` of every layer (dense: ()) and data-parallel index: the fed ranks, or the whole
        group where the run needs the global load and the group does not split into blocks."""
        return tuple(
            tuple(self.expert_groups[self.group_of_layer(layer)] for _ in fed)
            if self.global_load and self.blocks(layer) is None else fed
            for layer, fed in enumerate(self._fed))

    @cached_property
    def _fed(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Per layer (dense: ()) and data-parallel index: the expert ranks holding a replica it feeds."""
        return tuple(tuple(self._fed_ranks(layer, d) for d in range(self.data_parallel)) if self.is_moe(layer) else ()
                     for layer in range(self.num_layers))

    def _fed_ranks(self, layer: int, dp_index: int) -> tuple[int, ...]:
        group = self.expert_groups[self.group_of_layer(layer)]
        fed = {who[r] for who in self.expert_owners[layer] for r in fed_replicas(len(who), dp_index, self.data_parallel)}
        return tuple(rank for i, rank in enumerate(group) if i in fed)

    def programs(self, micro_batches: int) -> tuple[tuple[Op, ...], ...]:
        """Every rank's ordered op list for one training step."""
        if self.colocated:
            return build_colocated_schedule(self.world_size, self.num_layers, self.num_dense_layers, micro_batches,
                                            self.pipeline_groups, self.served, self.load_peers)
        assert self.layout is not None
        return build_schedule(self.layout, micro_batches, self.served, self.load_peers).programs

    def rank_pairs(self, micro_batches: int) -> list[tuple[int, int]]:
        """The (src, dst) pairs of distinct ranks that exchange messages (what a transport connects)."""
        return rank_pairs(self.programs(micro_batches))

    def describe(self, rank: int) -> str:
        """e.g. 'A0.1' (attention, group 0, data-parallel index 1), 'E1.0', or colocated 'C2' (one
        group) and 'C1.0' (group 1, data-parallel index 0)."""
        attention = self.attention_role(rank)
        if self.colocated:
            assert attention is not None, f"rank {rank} has no role"
            return f"C{rank}" if self.pipeline_groups == 1 else f"C{attention[0]}.{attention[1]}"
        if attention is not None:
            return f"A{attention[0]}.{attention[1]}"
        expert = self.expert_role(rank)
        assert expert is not None, f"rank {rank} has no role"
        return f"E{expert[0]}.{expert[1]}"

    def group_name(self, rank: int) -> str:
        """The busy-fraction group of a rank: 'A<g>', 'E<g>', 'colocated' (one colocated group) or
        'C<g>' (colocated pipeline group g)."""
        if self.colocated and self.pipeline_groups == 1:
            return "colocated"
        return self.describe(rank).split(".")[0]


def _per_layer(num_layers: int, num_dense_layers: int, num_experts: int, ranks_of_layer: list[int],
               placement: dict[int, ExpertOwners] | None, sets: int = 1) -> tuple[ExpertOwners, ...]:
    """Every layer's owners: `placement`'s where given, else contiguous ranges in `sets` blocks
    (dense layers: ())."""
    return tuple(
        () if layer < num_dense_layers
        else tuple(tuple(who) for who in placement[layer]) if placement is not None
        else blocked_owners(num_experts, ranks_of_layer[layer], sets)
        for layer in range(num_layers)
    )
