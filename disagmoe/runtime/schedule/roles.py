"""Who is who in a job: global rank numbers, roles and layer ownership.

Disaggregated (`Layout`): ranks are numbered attention first, then experts, each pool ordered by
pipeline group:

    attention rank (group g, data-parallel index d)  ->  g * attention_per_group + d
    expert rank (group g, index j)                   ->  attention_ranks + first expert of g + j

Group g owns layers g, g + p, g + 2p, ... (p = pipeline_groups). Forward: A_g -> E_g ->
A_(g+1 mod p); the LM head and loss run on group `num_layers mod p` (after the last layer).
Expert ranks may split unevenly over groups (earlier groups get one more); attention ranks may
not, because a token keeps its data-parallel index from group to group.

Colocated (`ColocatedLayout`): the same ring in which each group's expert ranks are its own
attention ranks; rank g * (ranks / p) + d is A_g,d and E_g,d at once.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import ClassVar

from disagmoe.config import ModelConfig, TrainConfig


class RoleKind(str, Enum):
    ATTENTION = "attention"
    EXPERT = "expert"


@dataclass(frozen=True)
class Role:
    """A rank's job: attention (index = data-parallel index) or expert (index within its group)."""

    kind: RoleKind
    group: int
    index: int

    def __str__(self) -> str:
        letter = "A" if self.kind is RoleKind.ATTENTION else "E"
        return f"{letter}{self.group}.{self.index}"


class LayerRing:
    """Which pipeline group owns which layer (group g owns layers g, g+p, ...) and which ranks are
    a group's attention ranks (g * data_parallel + d), for any class with `num_layers`,
    `num_dense_layers`, `pipeline_groups` and `data_parallel`; the checks both layouts share."""

    num_layers: int
    num_dense_layers: int
    pipeline_groups: int

    @property
    def head_group(self) -> int:
        """The group whose attention ranks run the final norm, LM head and loss."""
        return self.num_layers % self.pipeline_groups

    def group_of_layer(self, layer: int) -> int:
        return layer % self.pipeline_groups

    def is_moe(self, layer: int) -> bool:
        return layer >= self.num_dense_layers

    def layers_of_group(self, group: int) -> range:
        return range(group, self.num_layers, self.pipeline_groups)

    def next_group(self, group: int) -> int:
        return (group + 1) % self.pipeline_groups

    def prev_group(self, group: int) -> int:
        return (group - 1) % self.pipeline_groups

    @property
    def data_parallel(self) -> int:
        """Attention ranks per pipeline group (each layout's own count over `pipeline_groups`)."""
        raise NotImplementedError

    def attention_rank(self, group: int, dp_index: int) -> int:
        return group * self.data_parallel + dp_index

    def attention_group(self, group: int) -> tuple[int, ...]:
        return tuple(self.attention_rank(group, d) for d in range(self.data_parallel))

    def _check_counts(self, names: tuple[str, ...]) -> None:
        """ValueError for a count of `names` below 1 or dense layers outside 0 .. num_layers."""
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be at least 1")
        if not 0 <= self.num_dense_layers <= self.num_layers:
            raise ValueError(
                f"num_dense_layers={self.num_dense_layers} must be between 0 and "
                f"num_layers={self.num_layers}"
            )

    def _check_layers_per_group(self) -> None:
        if self.num_layers < self.pipeline_groups:
            raise ValueError(
                f"num_layers={self.num_layers} is fewer than pipeline_groups={self.pipeline_groups}; "
                "use at most one pipeline group per layer"
            )


@dataclass(frozen=True)
class Layout(LayerRing):
    """Ranks, pipeline groups and layers of a disaggregated job (totals over all groups)."""

    sums_gradients_in_backward: ClassVar[bool] = True  # see `schedule.ReduceGradients`

    attention_ranks: int
    expert_ranks: int
    pipeline_groups: int
    num_layers: int
    num_dense_layers: int = 0

    def __post_init__(self) -> None:
        p = self.pipeline_groups
        self._check_counts(("attention_ranks", "expert_ranks", "pipeline_groups", "num_layers"))
        if self.attention_ranks % p:
            raise ValueError(
                f"attention_ranks={self.attention_ranks} must be a multiple of pipeline_groups={p}: "
                "every group needs the same data-parallel width, because a token keeps its "
                "data-parallel index from group to group"
            )
        if self.expert_ranks < p:
            raise ValueError(
                f"expert_ranks={self.expert_ranks} is fewer than pipeline_groups={p}; "
                "every pipeline group needs at least one expert rank"
            )
        self._check_layers_per_group()

    @classmethod
    def from_config(cls, train: TrainConfig, model: ModelConfig) -> Layout:
        """The layout of a disaggregated run (TrainConfig's rank counts are totals over groups)."""
        return cls(train.attention_ranks, train.expert_ranks, train.pipeline_groups,
                   model.num_layers, model.num_dense_layers)

    @property
    def world_size(self) -> int:
        return self.attention_ranks + self.expert_ranks

    @property
    def data_parallel(self) -> int:
        """Attention ranks per pipeline group (the data-parallel width)."""
        return self.attention_ranks // self.pipeline_groups

    @cached_property
    def _expert_starts(self) -> tuple[int, ...]:
        base, extra = divmod(self.expert_ranks, self.pipeline_groups)
        starts = [self.attention_ranks]
        for g in range(self.pipeline_groups):
            starts.append(starts[-1] + base + (1 if g < extra else 0))
        return tuple(starts)

    def expert_group(self, group: int) -> tuple[int, ...]:
        return tuple(range(self._expert_starts[group], self._expert_starts[group + 1]))

    def roles(self, rank: int) -> tuple[Role, ...]:
        return (self.role(rank),)

    def role(self, rank: int) -> Role:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this {self.world_size}-rank layout")
        if rank < self.attention_ranks:
            group, dp_index = divmod(rank, self.data_parallel)
            return Role(RoleKind.ATTENTION, group, dp_index)
        for group in range(self.pipeline_groups):
            if rank < self._expert_starts[group + 1]:
                return Role(RoleKind.EXPERT, group, rank - self._expert_starts[group])
        raise AssertionError("unreachable: rank checked against world_size above")


@dataclass(frozen=True)
class ColocatedLayout(LayerRing):
    """Ranks, pipeline groups and layers of a colocated job: every rank runs attention for its
    data-parallel index and holds a share of its group's experts (`ranks`: the total)."""

    # the data-parallel sum stays in the optimizer step (`schedule.colocated` says why)
    sums_gradients_in_backward: ClassVar[bool] = False

    ranks: int
    pipeline_groups: int
    num_layers: int
    num_dense_layers: int = 0

    def __post_init__(self) -> None:
        self._check_counts(("ranks", "pipeline_groups", "num_layers"))
        if self.ranks % self.pipeline_groups:
            raise ValueError(
                f"ranks={self.ranks} must be a multiple of pipeline_groups={self.pipeline_groups}: "
                "every group needs the same data-parallel width"
            )
        self._check_layers_per_group()

    @property
    def world_size(self) -> int:
        return self.ranks

    @property
    def data_parallel(self) -> int:
        """Ranks per pipeline group (the data-parallel width and the expert-parallel degree)."""
        return self.ranks // self.pipeline_groups

    def expert_group(self, group: int) -> tuple[int, ...]:
        """The group's expert ranks: its attention ranks (E_g,j is A_g,j)."""
        return self.attention_group(group)

    def roles(self, rank: int) -> tuple[Role, ...]:
        """A_g,d and E_g,d: both jobs of the rank."""
        attention = self.role(rank)
        return attention, Role(RoleKind.EXPERT, attention.group, attention.index)

    def role(self, rank: int) -> Role:
        """The rank's attention role (its first: what names it and picks its optimizer peers)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside this {self.world_size}-rank layout")
        group, dp_index = divmod(rank, self.data_parallel)
        return Role(RoleKind.ATTENTION, group, dp_index)


AnyLayout = Layout | ColocatedLayout
