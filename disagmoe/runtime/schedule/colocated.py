"""The colocated schedule: every rank runs attention (data-parallel) and holds a share of the experts.

The conventional expert-parallel layout, our baseline, with p pipeline groups of ranks / p ranks
each: `schedule.build_schedule` of a `roles.ColocatedLayout`, the disaggregated ring in which
each group's expert ranks are its own attention ranks. For each layer and micro-batch every rank
of the layer's group runs its attention, sends each rank of its EP block (the whole group with one
block; itself included) the rows routed to that rank's experts (DISPATCH), runs its experts on
what it received and sends the outputs to the next group's ranks of the same data-parallel
indices (COMBINE; at p = 1 back to the block itself), with the residual
stream to the next group's rank of its data-parallel index (RESIDUAL, p > 1); the backward pass
mirrors it (with EP blocks under an auxiliary loss each rank swaps its block's load with the
same position of the other blocks, EXPERT_LOAD). A message to oneself is delivered locally by the worker. At p = 1 with one block
every rank runs the same list.

The data-parallel gradient sum stays in the `OptimizerStep`: every point of the backward has a
send in flight to a peer that receives it only later, so a collective there could wait on a
peer's GPU held by that very transfer (`runtime.stages.nccl_order` finds the deadlock; the
disaggregated schedule overlaps it instead).
"""

from __future__ import annotations

from disagmoe.runtime.schedule.roles import ColocatedLayout
from disagmoe.runtime.schedule.schedule import LoadPeers, Op, Served, build_schedule
from disagmoe.wire import Send


def build_colocated_schedule(
    ranks: int, num_layers: int, num_dense_layers: int, micro_batches: int, pipeline_groups: int = 1,
    served: Served | None = None, load_peers: LoadPeers | None = None,
) -> tuple[tuple[Op, ...], ...]:
    """Every rank's ordered op list for one training step (`ranks`: the total over all groups;
    `served`, `load_peers`: `build_schedule`'s, None for one EP block a group)."""
    layout = ColocatedLayout(ranks, pipeline_groups, num_layers, num_dense_layers)
    return build_schedule(layout, micro_batches, served, load_peers).programs


def rank_pairs(programs: tuple[tuple[Op, ...], ...]) -> list[tuple[int, int]]:
    """The (src, dst) pairs of distinct ranks that exchange messages."""
    return sorted(
        {(rank, peer) for rank, program in enumerate(programs)
         for op in program if isinstance(op, Send) for peer in op.peers if peer != rank}
    )
