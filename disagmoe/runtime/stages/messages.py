"""A rank's mail for one training step: what compute ops leave for the next hop, and what arrived.

Compute ops never talk to the transport: they `post` tensors for a destination rank and `take`
what their `Recv` ops collected. The worker moves posted messages with the schedule's `Send`
ops (or straight into its own inbox when the destination is itself: p = 1 hand-over of the
residual stream, a colocated rank's own expert slice) and files received ones with `Recv`.

Every message's shapes are fixed by the run (`MessageShapes`), so receivers allocate (or reuse)
their buffers without a header. With T tokens per data-parallel piece of a micro-batch (B/(M D)
sequences of S), H hidden, K top-k, E experts, in the compute dtype (idx int32, load int64):

    DISPATCH       A_g,d -> E_g,j    xn [T, H], top-k ids [T, K], routing weights [T, K]
    COMBINE        E_g,j -> A_g+1,d  the weighted partial sum of E_g,j's experts [T, H]
    RESIDUAL       A_g,d -> A_g+1,d  h [B, S, H] (+ shared experts' output [T, H])   (dense: out [B, S, H])
    DISPATCH_GRAD  E_g,j -> A_g,d    d xn [T, H], d weights [T, K], the micro-batch's load over d [E]
    COMBINE_GRAD   A_g+1,d -> E_g,j  d partial [T, H]
    RESIDUAL_GRAD  as RESIDUAL, backwards
    EXPERT_LOAD    E_g,j -> E_g,j'   its block's load over its sources [E] (blocks under an aux loss)

With `hop: pair_rows` (`hop_mode`) three change. COMBINE becomes one pair-row message per (layer,
micro-batch) that every expert rank of the set writes its pairs' rows into (`comm.base.PairSpec`:
[T K, H], unweighted, each pair row t K + j from the rank serving it; `runtime.stages.pair_return`).
RESIDUAL of a MoE layer also carries the routing weights [T, K], which the receiving attention rank
combines with, so their gradient returns with RESIDUAL_GRAD. DISPATCH_GRAD becomes a pair-row
message of each pair's d x [T K, H] (summed over a token's pairs on the receiver) carrying the
load [E] as its extra; it has no d weights. COMBINE_GRAD stays dy [T, H]: each expert rank forms
its pairs' w dy itself.

With `dispatch: sparse` (`dispatch_mode`; `runtime.stages.sparse_dispatch`) a token goes only to
the expert ranks serving one of its pairs, once per rank. Buffers keep the worst case (all T tokens
to one rank); the first `count` rows are the tokens sent, in token order, the rest unread padding:

    DISPATCH       rows [T, H], local expert ids [T, K] (L: served elsewhere), weights [T, K],
                   token index [T], count [1], this source's expert load [E]
    COMBINE        the partial sums of the received tokens [T, H], token index [T], count [1]
                   (the dispatch's: the first count rows live, in the received order)
    DISPATCH_GRAD  as dense, its rows in the dispatch's order (the first count live)
    COMBINE_GRAD   as dense, its rows in the dispatch's order (the first count live)

A one-sided transport moves only the live rows of all four (`is_peer_stored`).

Sparse with pair rows: DISPATCH as sparse; COMBINE the pair-row message, each received row's pairs
stored at its token's pair rows (token index t: rows t K + j, the attention rank's index space);
RESIDUAL also carries the top-k ids [T, K] (int32), with which the combining attention rank
routes COMBINE_GRAD as the dispatch did (dy of the tokens each rank served, in its dispatch
order: sparse's COMBINE_GRAD); DISPATCH_GRAD d xn of the received rows [T, H] in their order and
the load [E] (the d weights come back with RESIDUAL_GRAD): per source, not pair rows
(`pair_payloads`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from disagmoe.comm.base import PairLanding, PairSpec, PairTarget, TensorSpec
from disagmoe.roofline.transport_memory import HopShape, hop_tensors, receive_bytes, row_bytes
from disagmoe.wire import Payload, Recv

Slot = tuple[Payload, int, int]  # (payload, layer, micro-batch)
# sparse: sent by peer stores on nvshmem (with pair rows COMBINE is the pair-row message instead)
PEER_STORED = (Payload.DISPATCH, Payload.COMBINE, Payload.COMBINE_GRAD, Payload.DISPATCH_GRAD)
COUNTED = PEER_STORED  # the payloads whose bytes a step counts (`comm.base.Traffic`, `MessageShapes.row_bytes`)


def pair_payloads(sparse: bool) -> tuple[Payload, ...]:
    """The payloads that travel as pair-row messages with `hop: pair_rows`: COMBINE, and
    DISPATCH_GRAD unless the dispatch is sparse (its d x then goes back per source, in the
    dispatch's order, as sparse dispatch's does)."""
    return (Payload.COMBINE,) if sparse else (Payload.COMBINE, Payload.DISPATCH_GRAD)


class Mailbox:
    """Posted (outgoing) and received (incoming) messages of one rank, by slot and peer."""

    def __init__(self, rank: int, peer_stores: bool = False) -> None:
        """`peer_stores`: the transport stores sparse dispatches itself (`NvshmemTransport.send_sparse`),
        so the stages also leave their routing (`stash`) for the send op."""
        self.rank = rank
        self.peer_stores = peer_stores
        self._stashed: dict[tuple, tuple] = {}  # (payload, layer, mb[, peer]) -> what the peer-store send needs
        self._counts: dict[tuple[Payload, int, int, int], torch.Tensor] = {}  # (payload, layer, mb, dst) -> live rows
        self._outgoing: dict[Slot, dict[int, list[torch.Tensor]]] = defaultdict(dict)
        self._incoming: dict[Slot, dict[int, list[torch.Tensor]]] = defaultdict(dict)
        self._targets: dict[tuple[Payload, int, int, int], PairTarget] = {}  # (payload, layer, mb, dst)
        self._landings: dict[Slot, PairLanding] = {}  # pair rows that land here

    def post(self, payload: Payload, layer: int, micro_batch: int, dst: int, tensors: list[torch.Tensor],
             count: torch.Tensor | None = None) -> None:
        """Leave `tensors` for `dst`; addressed to this rank, they arrive at once. `count`: a sparse
        message's live rows (a device tensor [1]: the rows before it), for the send's byte count."""
        box = self._incoming if dst == self.rank else self._outgoing
        box[(payload, layer, micro_batch)][dst] = tensors
        if count is not None and dst != self.rank:
            self._counts[(payload, layer, micro_batch, dst)] = count

    def live_rows(self, payload: Payload, layer: int, micro_batch: int, dst: int) -> torch.Tensor | None:
        """The live rows `post` was given for the message to `dst` (removed), None for a message
        whose rows are all live (dense dispatch)."""
        return self._counts.pop((payload, layer, micro_batch, dst), None)

    def outgoing(self, payload: Payload, layer: int, micro_batch: int, dst: int) -> list[torch.Tensor]:
        """The tensors posted for `dst` (removed: each message leaves once)."""
        box = self._outgoing[(payload, layer, micro_batch)]
        assert dst in box, f"rank {self.rank}: nothing posted for rank {dst} in {payload.name} {layer}/{micro_batch}"
        return box.pop(dst)

    def deliver(self, payload: Payload, layer: int, micro_batch: int, src: int, tensors: list[torch.Tensor]) -> None:
        self._incoming[(payload, layer, micro_batch)][src] = tensors

    def has(self, payload: Payload, layer: int, micro_batch: int, src: int) -> bool:
        return src in self._incoming.get((payload, layer, micro_batch), {})

    def take(self, payload: Payload, layer: int, micro_batch: int, src: int) -> list[torch.Tensor]:
        """The message from `src` (removed)."""
        box = self._incoming[(payload, layer, micro_batch)]
        assert src in box, f"rank {self.rank}: no {payload.name} {layer}/{micro_batch} from rank {src}"
        return box.pop(src)

    # pair-row messages (`hop: pair_rows`): the worker aims the expert op at the receivers' buffers
    # before it runs, sends after it (`Transport.pair_send`), and files what lands for the combine.

    def aim(self, payload: Payload, layer: int, micro_batch: int, dst: int, target: PairTarget) -> None:
        self._targets[(payload, layer, micro_batch, dst)] = target

    def target(self, payload: Payload, layer: int, micro_batch: int, dst: int) -> PairTarget:
        """Where this rank's pair rows of (payload, layer, micro_batch) for `dst` go (kept for the send)."""
        key = (payload, layer, micro_batch, dst)
        assert key in self._targets, (f"rank {self.rank}: no pair-row target for rank {dst} in {payload.name} "
                                      f"{layer}/{micro_batch}")
        return self._targets[key]

    def release_target(self, payload: Payload, layer: int, micro_batch: int, dst: int) -> PairTarget:
        """The target, removed (the send op's)."""
        self.target(payload, layer, micro_batch, dst)
        return self._targets.pop((payload, layer, micro_batch, dst))

    def land(self, payload: Payload, layer: int, micro_batch: int, landing: PairLanding) -> None:
        self._landings[(payload, layer, micro_batch)] = landing

    def landing(self, payload: Payload, layer: int, micro_batch: int) -> PairLanding:
        """The pair rows of (payload, layer, micro_batch) that land here (removed)."""
        key = (payload, layer, micro_batch)
        assert key in self._landings, (f"rank {self.rank}: no pair rows of {payload.name} {layer}/{micro_batch} "
                                       "received")
        return self._landings.pop(key)

    # sparse dispatch by peer stores (`peer_stores`): what the send op's one launch needs, beside the messages

    def stash(self, key: tuple, value: tuple) -> None:
        self._stashed[key] = value

    def unstash(self, key: tuple) -> tuple:
        assert key in self._stashed, f"rank {self.rank}: nothing stashed for the peer-store send {key}"
        return self._stashed.pop(key)

    def empty(self) -> bool:
        return not (any(self._outgoing.values()) or any(self._incoming.values()) or self._targets or self._landings
                    or self._stashed or self._counts)


@dataclass(frozen=True)
class MessageShapes:
    """The fixed shapes of every message of a run (module docstring)."""

    rows: int  # sequences per data-parallel piece of a micro-batch (B / (M D))
    seq_len: int
    hidden: int
    top_k: int
    num_experts: int
    dtype: torch.dtype
    shared_experts: bool
    pair_rows: bool = False  # `hop: pair_rows` (module docstring)
    sparse: bool = False  # `dispatch: sparse` (module docstring)
    segment_tokens: int = 256  # pair_rows: tokens per landing segment

    @classmethod
    def of_run(cls, cfg, model_cfg, topology) -> MessageShapes:
        """The shapes of a run (`TrainConfig`, `ModelConfig`, `Topology`)."""
        from disagmoe.runtime.rank_model import compute_dtype

        return cls(rows=cfg.batch_size // (cfg.micro_batches * topology.data_parallel), seq_len=cfg.seq_len,
                   hidden=model_cfg.hidden_size, top_k=model_cfg.top_k, num_experts=model_cfg.num_experts,
                   dtype=compute_dtype(cfg),
                   shared_experts=model_cfg.shared_ffn_size > 0,
                   pair_rows=hop_mode(cfg, model_cfg, topology)[0] == "pair_rows",
                   sparse=dispatch_mode(cfg, model_cfg, topology)[0] == "sparse",
                   segment_tokens=cfg.pair_segment_tokens)

    @property
    def segments(self) -> int:
        """Landing segments of a pair-row message (the last one may be short)."""
        return -(-self.tokens // self.segment_tokens)

    def pair_spec(self, payload: Payload, sources: tuple[int, ...]) -> PairSpec:
        """A pair-row message (COMBINE, or DISPATCH_GRAD with the load as its extra) written by
        expert ranks `sources` (in flag-block order)."""
        rows, *extras = self.specs(payload, True)
        return PairSpec(rows, self.segments, tuple(sources), tuple(extras))

    def pair_layout(self, payload: Payload, layer_is_moe: bool) -> tuple[TensorSpec, int, tuple[TensorSpec, ...]] | None:
        """(rows, segments, extras) of a pair-row message's region (`comm.symmetric`'s `pair_of`),
        None for a message sent as segments."""
        if not self.is_pair(payload, layer_is_moe):
            return None
        rows, *extras = self.specs(payload, True)
        return rows, self.segments, tuple(extras)

    def is_pair(self, payload: Payload, layer_is_moe: bool) -> bool:
        """Whether this payload's message is a pair-row one in this run."""
        return self.pair_rows and payload in pair_payloads(self.sparse) and layer_is_moe

    def is_peer_stored(self, payload: Payload, layer_is_moe: bool) -> bool:
        """Whether a one-sided transport sends this payload's message by peer stores (sparse
        dispatch: DISPATCH, COMBINE, COMBINE_GRAD and DISPATCH_GRAD, but a pair-row message;
        `TrainWorker`)."""
        return (self.sparse and layer_is_moe and payload in PEER_STORED
                and not self.is_pair(payload, layer_is_moe))

    def is_counted(self, payload: Payload, layer_is_moe: bool) -> bool:
        """Whether a step's byte count covers this payload's messages (`comm.base.Traffic`): a MoE
        layer's DISPATCH, COMBINE, COMBINE_GRAD and DISPATCH_GRAD, but a pair-row message."""
        return layer_is_moe and payload in COUNTED and not self.is_pair(payload, layer_is_moe)

    @property
    def tokens(self) -> int:
        return self.rows * self.seq_len

    def dispatch_row_bytes(self, sparse: bool) -> int:
        """Bytes of one token's row of a DISPATCH message: xn, ids and weights (sparse: and its
        token index), the per-token part that byte counts multiply (`comm.base.Traffic`)."""
        return self.row_bytes(Payload.DISPATCH, sparse)

    def row_bytes(self, payload: Payload, sparse: bool) -> int:
        """Bytes one token's row adds to a MoE layer's `payload` message with `sparse` dispatch or
        dense (`roofline.transport_memory.row_bytes`): what a byte count multiplies by the rows a
        message carries (`comm.base.Traffic`)."""
        return row_bytes(payload.value, True, self.hop_shape(sparse))

    def hop_shape(self, sparse: bool) -> HopShape:
        """The torch-free `HopShape` of this run's messages with `sparse` dispatch or dense."""
        value = "bf16" if self.dtype == torch.bfloat16 else "fp32"
        return HopShape(self.rows, self.seq_len, self.hidden, self.top_k, self.num_experts, value,
                        self.shared_experts, self.pair_rows, sparse)

    def specs(self, payload: Payload, layer_is_moe: bool) -> list[TensorSpec]:
        """The message's tensors, from `roofline.transport_memory.hop_tensors` (the one table the
        planner and the memory check price)."""
        return [TensorSpec(tuple(dims), DTYPES[name])
                for dims, name in hop_tensors(payload.value, layer_is_moe, self.hop_shape(self.sparse))]


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "int32": torch.int32, "int64": torch.int64}


def hop_mode(cfg, model_cfg, topology) -> tuple[str, str]:
    """(hop, why) of a run: `cfg.hop`, with auto resolved. Per-pair rows move T K H values to an
    attention rank where partial sums move Q T H (Q expert ranks of the set), so they win once
    Q > top-k; they need the one-sided transport (or `local`, on CPU) and, on it, the triton
    experts, whose down GEMM stores them (in bf16: under precision fp8 auto is partial sums). Q is
    the most expert ranks an attention rank serves (`Topology.dispatch_width`: its set or EP block)."""
    ranks = topology.dispatch_width
    k = model_cfg.top_k
    if cfg.hop != "auto":
        return cfg.hop, "as configured"
    per_set = f"{ranks} expert rank{'' if ranks == 1 else 's'} per set"
    if cfg.expert_precision == "fp8":
        return "partial_sums", "precision fp8: the pair-row return's fused kernel runs its down GEMM in bf16"
    if cfg.transport == "nvshmem" and cfg.experts_backend == "triton" and ranks > k:
        return "pair_rows", f"{per_set} > top-k {k}: per-pair rows move fewer bytes"
    why = (f"{per_set} <= top-k {k}: one partial sum per token per expert rank moves fewer bytes"
           if ranks <= k else "pair rows need transport nvshmem with experts_backend triton")
    return "partial_sums", why


def dispatch_mode(cfg, model_cfg, topology) -> tuple[str, str]:
    """(dispatch, why) of a run: `cfg.dispatch`, with auto resolved. Sparse sends a token to the Q'
    expert ranks serving its pairs instead of all Q of the set, with either hop (the pair rows of
    a received row go to its token's pair rows); the saving is the one-sided transport's (nccl and
    local move the worst-case buffer with a device-side count). Auto picks it with either hop
    (pair rows with sparse dispatch passed the shared-GPU oracle and zero-sync GPU tests for 1A+2E
    and 1A+3E over nvshmem on 2026-12-03)."""
    if cfg.dispatch != "auto":
        return cfg.dispatch, "as configured"
    ranks = topology.dispatch_width
    per_set = f"{ranks} expert rank{'' if ranks == 1 else 's'} per set"
    if ranks <= 1:
        return "dense", f"{per_set}: every token goes to it either way"
    if cfg.transport != "nvshmem":
        return "dense", (f"{per_set}, but transport {cfg.transport} moves the worst-case buffer either way "
                         "(sparse dispatch saves bytes on nvshmem)")
    return "sparse", (f"{per_set}: a token goes only to the ranks serving its top-k experts ("
                      "one Triton launch stores only the routed rows into the peers' segments)")


def receive_layouts(cfg, shapes: MessageShapes, topology, sum_width: int = 0) -> list:
    """Every rank's receive buffers as `comm.symmetric` arenas, from every rank's program: for
    `transport: nvshmem` the symmetric arenas it allocates (a ring of segments per shared slot, the largest
    rank's size everywhere; a pair-row message one shared buffer with its flag block; with
    `sum_width` > 0 the all-ranks sum's shares); otherwise each rank's own buffers, one copy (as
    nccl reserves them; pair rows: one per source). A run whose rank steps are captured
    (`runtime.rank_graphs`) rounds each ring up to a step's messages (`reuse_order.step_ring`)."""
    from disagmoe.comm.symmetric import ArenaLayout, symmetric_layouts

    programs = topology.programs(cfg.micro_batches)

    def specs_of(payload: Payload, layer: int) -> list[TensorSpec]:
        return shapes.specs(payload, topology.is_moe(layer))

    def pair_of(payload: Payload, layer: int) -> tuple[TensorSpec, int, tuple[TensorSpec, ...]] | None:
        return shapes.pair_layout(payload, topology.is_moe(layer))

    if cfg.transport == "nvshmem":
        from disagmoe.runtime.schedule.reuse_order import one_sided_slots

        def pair(op: Recv) -> bool:
            return shapes.pair_rows and shapes.is_pair(op.payload, topology.is_moe(op.layer))

        # keys whose lifetimes do not overlap share segments where the replay orders every write
        # after the reader is done (`reuse_order.one_sided_slots`); pair rows keep their regions
        from disagmoe.runtime.rank_graphs import resolve_rank_graphs

        shared = one_sided_slots(programs, topology.is_moe, topology.num_layers, skip=pair,
                                 step_aligned=resolve_rank_graphs(cfg, topology)[0])
        return symmetric_layouts(programs, specs_of, capacity_factor=cfg.transport_capacity_factor,
                                 pair_of=pair_of if shapes.pair_rows else None, sum_width=sum_width, shared=shared)
    return [ArenaLayout.of_program(p, specs_of, rank, copies=1) for rank, p in enumerate(programs)]


def receive_counts(shapes: MessageShapes, topology, programs) -> list[dict[tuple[str, bool], int]]:
    """Every rank's receive slots (peer other than itself, layer, micro-batch) by (payload, MoE
    layer), read off its program: the counts `roofline.transport_memory` prices."""
    out = []
    for rank, program in enumerate(programs):
        counts: dict[tuple[str, bool], int] = defaultdict(int)
        for op in program:
            if isinstance(op, Recv):
                counts[(op.payload.value, topology.is_moe(op.layer))] += sum(peer != rank for peer in op.peers)
        out.append(dict(counts))
    return out


def transport_buffer_bytes(cfg, shapes: MessageShapes, topology, sum_width: int = 0) -> list[int]:
    """Bytes every rank's transport allocates for its messages: nvshmem, the symmetric arena it is
    given (`receive_layouts`: pair regions, capacity factor and the all-ranks sum included; equal to
    `roofline.transport_memory.arena_bytes` where those are absent, tests/roofline pin it); nccl
    and local, the buffers `reserve` keeps per shared receive slot (`slot_counts`), priced by
    `roofline.transport_memory.receive_bytes`."""
    if cfg.transport == "nvshmem":
        return [layout.nbytes for layout in receive_layouts(cfg, shapes, topology, sum_width)]
    counts = slot_counts(shapes, topology, topology.programs(cfg.micro_batches))
    return [int(receive_bytes(c, shapes.hop_shape(shapes.sparse), cfg.transport)) for c in counts]


def slot_counts(shapes: MessageShapes, topology, programs) -> list[dict[tuple[str, bool], int]]:
    """Every rank's receive buffers by (payload, MoE layer) as the in-order and local transports
    keep them: slots shared by keys whose lifetimes do not overlap (`schedule.recv_slots`, the
    plan `TrainWorker.setup` reserves), pair-row messages aside."""
    from disagmoe.runtime.schedule.recv_slots import slot_plan

    def pair(op) -> bool:
        return shapes.is_pair(op.payload, topology.is_moe(op.layer))

    return [slot_plan(p, rank, topology.is_moe, topology.num_layers, skip=pair).counts()
            for rank, p in enumerate(programs)]
