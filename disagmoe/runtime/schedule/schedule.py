"""The pipeline schedule: a pure function from (layout, micro-batches) to the ops of every rank.

Each rank runs its op list top to bottom within a training step. Sends are non-blocking (their
handles are waited at the end of the step); a `Recv` blocks until every peer's message arrived.

Data of layer l (owned by group g = l mod p), micro-batch mb, data-parallel index d:

    forward   A_g,d --DISPATCH--> E_g,j served --COMBINE--> A_(g+1),d  (compact: `runtime.stages.messages`)
              A_g,d --RESIDUAL (residual stream, shared experts' output)--> A_(g+1),d    (only p > 1)
    backward  the same edges reversed: COMBINE_GRAD, DISPATCH_GRAD, RESIDUAL_GRAD
              E_g,j --EXPERT_LOAD (its block's load [E])--> E_g,j' of the other blocks   (`load_peers`)

The expert ranks A_g,d serves for layer l are `served(l, d)` (`runtime.topology.Topology.served`:
those holding an expert replica d feeds), by default every expert rank of group g. Where a router's
auxiliary loss needs the load over every source and the group's expert ranks serve it in blocks,
each expert rank sends its block's load to its `load_peers` (`Topology.load_peers`) as its
backward of (l, mb) begins, before it waits for COMBINE_GRAD, and receives theirs just before
ExpertBackward(l, mb): sent and received in the backward's order, so each rank pair's loads
arrive in the order they are received (sent after ExpertForward they would come in the forward's
order, layers ascending, and an in-order transport would hand the backward the wrong layer's), and
the forward never waits for one.

A colocated layout (`roles.ColocatedLayout`) is the same ring with E_g,j = A_g,j: DISPATCH stays
in group g (a rank sends itself its own share, delivered locally), COMBINE goes to group g+1.

`AttentionForward(l)` starts by combining layer l-1's expert outputs with the residual stream,
then runs attention, router and shared experts; for a leading dense layer it runs the whole layer.
`Loss` (on the head group, l = num_layers) combines the last layer, applies the final norm, LM
head and loss, and computes their gradients, which start the backward pass.

Order: forward ops in (layer, micro-batch) order, then the losses, then backward ops with the
layers reversed and micro-batches ascending again (after each layer's last backward, and after
the last loss for the head, a data-parallel group starts that layer's gradient sum:
`ReduceGradients`, disaggregated only) (the loss of micro-batch 0 is ready first, so
the backward ping-pong starts while the head still computes later losses). So while E_g works
on micro-batch i, A_g computes i+1, and every rank's list is a sub-sequence of one global order,
which is why nothing deadlocks and each rank pair's messages arrive in the order they are
received (`disagmoe.runtime.schedule.schedule_sim` replays the lists and checks both).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from disagmoe.runtime.schedule.roles import AnyLayout, RoleKind
from disagmoe.wire import Payload, Recv, Send


@dataclass(frozen=True)
class AttentionForward:
    layer: int
    micro_batch: int


@dataclass(frozen=True)
class ExpertForward:
    layer: int
    micro_batch: int


@dataclass(frozen=True)
class Loss:
    """Final norm, LM head, loss and their backward for one micro-batch (head group only)."""

    micro_batch: int


@dataclass(frozen=True)
class ExpertBackward:
    layer: int
    micro_batch: int


@dataclass(frozen=True)
class AttentionBackward:
    layer: int
    micro_batch: int


@dataclass(frozen=True)
class ReduceGradients:
    """Start summing the replicated parameters' gradients of `layer` (num_layers: the final norm
    and LM head) over `peers`, the data-parallel attention group, once the layer's last backward
    ran: the all-reduce overlaps the rest of the backward and `OptimizerStep` waits for it. Only
    in groups of more than one data-parallel rank."""

    layer: int
    peers: tuple[int, ...]


@dataclass(frozen=True)
class OptimizerStep:
    """All-reduce gradients with `peers` (this rank included), then update the weights.

    For attention ranks the peers are the group's data-parallel replicas; for expert ranks only
    the rank itself (replicas of hot experts reduce among themselves inside the step, per plan).
    """

    peers: tuple[int, ...]


Compute = AttentionForward | ExpertForward | Loss | ExpertBackward | AttentionBackward
Op = Compute | Send | Recv | ReduceGradients | OptimizerStep
Served = Callable[[int, int], tuple[int, ...]]  # (MoE layer, data-parallel index) -> the expert ranks it dispatches to
LoadPeers = Callable[[int, int], tuple[int, ...]]  # (MoE layer, expert rank) -> the ranks it swaps block loads with


@dataclass(frozen=True)
class Schedule:
    layout: AnyLayout
    micro_batches: int
    programs: tuple[tuple[Op, ...], ...]  # programs[rank] = that rank's ops, in order

    def rank_pairs(self) -> list[tuple[int, int]]:
        """The (src, dst) rank pairs that exchange messages: what a transport must connect."""
        return sorted(
            {(rank, peer) for rank, program in enumerate(self.programs)
             for op in program if isinstance(op, Send) for peer in op.peers}
        )


def build_schedule(layout: AnyLayout, micro_batches: int, served: Served | None = None,
                   load_peers: LoadPeers | None = None) -> Schedule:
    """Every rank's ordered op list for one training step. `served`: the expert ranks each
    attention rank dispatches each MoE layer to (None: every expert rank of the layer's group);
    `load_peers`: the expert ranks each expert rank swaps its block's load with (None: none)."""
    if micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches} must be at least 1")
    ring = _Ring(layout, served or (lambda layer, d: layout.expert_group(layout.group_of_layer(layer))),
                 load_peers or (lambda layer, rank: ()))
    programs: list[list[Op]] = [[] for _ in range(layout.world_size)]
    for layer in range(layout.num_layers):
        for mb in range(micro_batches):
            _attention_forward(ring, programs, layer, mb)
            if layout.is_moe(layer):
                _expert_forward(ring, programs, layer, mb)
    for mb in range(micro_batches):
        _loss(ring, programs, mb)
    _reduce_gradients(layout, programs, layout.num_layers, layout.head_group)
    for layer in reversed(range(layout.num_layers)):
        for mb in range(micro_batches):
            if layout.is_moe(layer):
                _expert_backward(ring, programs, layer, mb)
            _attention_backward(ring, programs, layer, mb)
        _reduce_gradients(layout, programs, layer, layout.group_of_layer(layer))
    for rank in range(layout.world_size):
        role = layout.role(rank)
        peers = layout.attention_group(role.group) if role.kind is RoleKind.ATTENTION else (rank,)
        programs[rank].append(OptimizerStep(peers))
    return Schedule(layout, micro_batches, tuple(tuple(p) for p in programs))


def _reduce_gradients(layout: AnyLayout, programs: list[list[Op]], layer: int, group: int) -> None:
    """After `layer`'s last backward on A_group (layer = num_layers: the head), its gradient sum
    starts, where the group has data-parallel peers and the layout sums them in the backward."""
    ranks = layout.attention_group(group)
    if len(ranks) > 1 and layout.sums_gradients_in_backward:
        for rank in ranks:
            programs[rank].append(ReduceGradients(layer, ranks))


@dataclass(frozen=True)
class _Ring:
    """A layout with the expert ranks each attention rank serves: the peers of every hop."""

    layout: AnyLayout
    served: Served
    load_peers: LoadPeers

    def sources(self, layer: int, rank: int, group: int) -> tuple[int, ...]:
        """The attention ranks of `group` whose data-parallel index dispatches `layer` to expert
        rank `rank` (`group`: the layer's for DISPATCH, the next one for COMBINE)."""
        layout = self.layout
        return tuple(layout.attention_rank(group, d) for d in range(layout.data_parallel)
                     if rank in self.served(layer, d))


def _receive_layer_output(ring: _Ring, programs: list[list[Op]], layer: int, mb: int, group: int) -> None:
    """On A_group, receive what layer `layer` (of the previous group) left for the next step."""
    layout = ring.layout
    for d, rank in enumerate(layout.attention_group(group)):
        if layout.pipeline_groups > 1:
            prev = layout.attention_rank(layout.group_of_layer(layer), d)
            programs[rank].append(Recv(Payload.RESIDUAL, layer, mb, (prev,)))
        if layout.is_moe(layer):
            programs[rank].append(Recv(Payload.COMBINE, layer, mb, ring.served(layer, d)))


def _attention_forward(ring: _Ring, programs: list[list[Op]], layer: int, mb: int) -> None:
    layout = ring.layout
    group = layout.group_of_layer(layer)
    if layer > 0:
        _receive_layer_output(ring, programs, layer - 1, mb, group)
    for d, rank in enumerate(layout.attention_group(group)):
        programs[rank].append(AttentionForward(layer, mb))
        if layout.is_moe(layer):
            programs[rank].append(Send(Payload.DISPATCH, layer, mb, ring.served(layer, d)))
        if layout.pipeline_groups > 1:
            nxt = layout.attention_rank(layout.next_group(group), d)
            programs[rank].append(Send(Payload.RESIDUAL, layer, mb, (nxt,)))


def _expert_forward(ring: _Ring, programs: list[list[Op]], layer: int, mb: int) -> None:
    layout = ring.layout
    group = layout.group_of_layer(layer)
    for rank in layout.expert_group(group):
        programs[rank].append(Recv(Payload.DISPATCH, layer, mb, ring.sources(layer, rank, group)))
        programs[rank].append(ExpertForward(layer, mb))
        programs[rank].append(Send(Payload.COMBINE, layer, mb, ring.sources(layer, rank, layout.next_group(group))))


def _loss(ring: _Ring, programs: list[list[Op]], mb: int) -> None:
    layout = ring.layout
    last = layout.num_layers - 1
    _receive_layer_output(ring, programs, last, mb, layout.head_group)
    _send_layer_grads(ring, programs, last, mb, layout.head_group, Loss(mb))


def _send_layer_grads(ring: _Ring, programs: list[list[Op]], layer: int, mb: int, group: int, op: Compute) -> None:
    """On A_group run `op`, then send the grads of layer `layer`'s output back where it came from."""
    layout = ring.layout
    for d, rank in enumerate(layout.attention_group(group)):
        programs[rank].append(op)
        if layout.is_moe(layer):
            programs[rank].append(Send(Payload.COMBINE_GRAD, layer, mb, ring.served(layer, d)))
        if layout.pipeline_groups > 1:
            prev = layout.attention_rank(layout.group_of_layer(layer), d)
            programs[rank].append(Send(Payload.RESIDUAL_GRAD, layer, mb, (prev,)))


def _expert_backward(ring: _Ring, programs: list[list[Op]], layer: int, mb: int) -> None:
    layout = ring.layout
    group = layout.group_of_layer(layer)
    for rank in layout.expert_group(group):
        peers = ring.load_peers(layer, rank)
        if peers:
            programs[rank].append(Send(Payload.EXPERT_LOAD, layer, mb, peers))
        programs[rank].append(Recv(Payload.COMBINE_GRAD, layer, mb, ring.sources(layer, rank, layout.next_group(group))))
        if peers:
            programs[rank].append(Recv(Payload.EXPERT_LOAD, layer, mb, peers))
        programs[rank].append(ExpertBackward(layer, mb))
        programs[rank].append(Send(Payload.DISPATCH_GRAD, layer, mb, ring.sources(layer, rank, group)))


def _attention_backward(ring: _Ring, programs: list[list[Op]], layer: int, mb: int) -> None:
    layout = ring.layout
    group = layout.group_of_layer(layer)
    for d, rank in enumerate(layout.attention_group(group)):
        if layout.pipeline_groups > 1:
            nxt = layout.attention_rank(layout.next_group(group), d)
            programs[rank].append(Recv(Payload.RESIDUAL_GRAD, layer, mb, (nxt,)))
        if layout.is_moe(layer):
            programs[rank].append(Recv(Payload.DISPATCH_GRAD, layer, mb, ring.served(layer, d)))
    if layer == 0:
        for rank in layout.attention_group(group):
            programs[rank].append(AttentionBackward(layer, mb))
    else:
        _send_layer_grads(ring, programs, layer - 1, mb, group, AttentionBackward(layer, mb))
