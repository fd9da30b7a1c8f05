"""Bytes the distributed transports allocate for their messages, torch-free (the planner and the
runtime's memory check share it).

    hop_tensors(payload, moe, shape)           a message's tensors: (dims, dtype name) each
    message_bytes(payload, moe, shape, aligned) one message's bytes (aligned: each tensor at ALIGN)
    row_bytes(payload, moe, shape)              bytes a token's row adds to a message (byte counts)
    layout_receives(...)                        receive slots of one rank of a role, per kind
    receive_bytes(counts, shape, transport)     one rank's buffers from its slot counts
    layout_transport_bytes(...)                 (attention GPU, expert GPU) buffers of a layout

`runtime.stages.messages.MessageShapes.specs` builds its `TensorSpec`s from `hop_tensors`, so the
shapes the transports allocate and the bytes priced here are one table. What each transport keeps:

- nccl: one buffer per receive slot, the message's tensors exactly (`NcclTransport.reserve`, at
  set-up; reused every step). Keys (peer, payload, layer, micro-batch) whose lifetimes do not
  overlap share a slot (`runtime.schedule.recv_slots`; `reuse=True` below): a gradient payload
  needs one slot per peer (each is read by the backward op right after it arrives), a forward
  payload one per key (its autograd state lives until the layer's backward), except the last
  layer's message to the head group when p > 1 (the loss reads and frees it: one slot).
- nvshmem: one symmetric arena per rank (`comm.symmetric.symmetric_layouts`): a flag word per
  segment (even count, region aligned), then the segments, each tensor at a 256-byte aligned
  offset; every rank allocates the largest rank's arena (symmetric memory). The keys of a pool
  (peer, payload, MoE layer) share a ring (`reuse=RING`, counted in segments:
  `runtime.schedule.reuse_order.one_sided_slots`, `ring_segments`): a forward payload a segment
  per key and one more, a gradient payload m + 1 (at most two per key); a one-sided sender runs
  ahead of its reader, so a ring holds more than nccl's slots (tests/roofline pins the counts
  rank by rank against the arena built). A run whose rank steps are captured in CUDA graphs
  rounds each ring up to the smallest divisor of twice its messages a step (`reuse=RING_STEP`,
  `step_ring`): a forward ring then holds two segments per key, a gradient ring at most that. The
  planner prices each candidate's rings so where its rank steps are captured (`placement.cost.rank_steps`).
- local (gloo, CPU): receives into the same shared slots as nccl once reserved (`TrainWorker`
  reserves them), so it exercises the reuse on CPU; priced as nccl.

Slot counts per micro-batch (layout `runtime.schedule`; tests/roofline/test_transport_memory.py
pins them against every rank's program): attention rank of group g receives DISPATCH_GRAD from
each of its set's Q expert ranks per MoE layer of g, COMBINE from each of Q per MoE layer of group
g - 1 (mod p), and with p > 1 RESIDUAL of every layer of g - 1 and RESIDUAL_GRAD of every layer
of g from one peer each; an expert rank of group g receives DISPATCH and COMBINE_GRAD from each of
its S sources per MoE layer of g (with R replica sets of a group's dp attention ranks: Q the set's
ranks, S = dp / R, as `runtime.topology.Topology.served` pairs them); a colocated rank of group g
is both, the ep ranks of its EP block the set and the sources (its own block: `Topology.served`),
less its messages to itself (delivered locally): DISPATCH and DISPATCH_GRAD from ep - 1 peers,
COMBINE and COMBINE_GRAD from the ep ranks of the same block of the neighbouring group (ep - 1 with
p = 1: its own block), RESIDUAL and RESIDUAL_GRAD as an attention rank's. Where the router has an
auxiliary loss (the micro-batch's load over every source) an expert rank of a group in B blocks
(sets) also receives EXPERT_LOAD from the B - 1 ranks at its position in the other blocks per
MoE layer of g (`swaps`; slots as COMBINE_GRAD's, read by the backward op right after it
arrives; nvshmem's rings at least 3 segments: `reuse_order.ring_segments`). Pair-row messages (`hop: pair_rows`) are not modelled here (the planner prices
partial sums; the runtime counts them from its layouts).

Legend: T tokens per data-parallel piece of a micro-batch, H hidden, K top-k, E experts,
Q expert ranks of a set, S sources (attention ranks) of an expert rank, ep colocated ranks of an
EP block.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from disagmoe.roofline.stages import Num

ALIGN = 256  # `comm.symmetric.ALIGN`: every tensor of an arena segment starts at a multiple of this
COPIES = 2  # `comm.symmetric.COPIES`: the copies of an nvshmem slot that no other key shares
DTYPE_BYTES = {"bf16": 2, "fp32": 4, "int32": 4, "int64": 8}
FORWARD = ("dispatch", "combine", "residual")
PAYLOADS = ("dispatch", "combine", "residual", "dispatch_grad", "combine_grad", "residual_grad", "expert_load")


@dataclass(frozen=True)
class HopShape:
    """The fixed sizes every message of a run is built from (`MessageShapes`' torch-free part)."""

    rows: Num  # sequences per data-parallel piece of a micro-batch
    seq_len: int
    hidden: int
    top_k: int
    num_experts: int
    value: str = "bf16"  # the compute dtype: bf16 or fp32
    shared_experts: bool = False
    pair_rows: bool = False
    sparse: bool = False

    @property
    def tokens(self) -> Num:
        return self.rows * self.seq_len


def hop_tensors(payload: str, moe: bool, s: HopShape) -> list[tuple[tuple, str]]:
    """A message's tensors as (dims, dtype name), in order (`runtime.stages.messages`' docstring
    lists what each carries)."""
    T, H, K, E, v = s.tokens, s.hidden, s.top_k, s.num_experts, s.value
    rows, index, count = ((T, H), v), ((T,), "int32"), ((1,), "int32")
    if payload == "expert_load":  # a block's load over its sources, to the other blocks
        return [((E,), "int64")]
    if payload == "dispatch" and s.sparse:
        return [rows, ((T, K), "int32"), ((T, K), v), index, count, ((E,), "int64")]
    if payload == "dispatch":
        return [rows, ((T, K), "int32"), ((T, K), v)]
    if payload == "combine" and s.sparse and not s.pair_rows:
        return [rows, index, count]
    if payload == "combine" and s.pair_rows:
        return [((T * K, H), v)]
    if payload == "dispatch_grad" and s.pair_rows and s.sparse:  # d x of the rows received, the load
        return [rows, ((E,), "int64")]
    if payload == "dispatch_grad" and s.pair_rows:  # d x per pair, then the load (an extra)
        return [((T * K, H), v), ((E,), "int64")]
    if payload in ("combine", "combine_grad"):
        return [rows]
    if payload == "dispatch_grad":
        return [rows, ((T, K), v), ((E,), "int64")]
    stream = ((s.rows, s.seq_len, H), v)  # residual, residual_grad
    parts = [stream, rows] if moe and s.shared_experts else [stream]
    if moe and s.pair_rows:
        parts.append(((T, K), v))  # the routing weights, combined on the receiving rank
    if moe and s.pair_rows and s.sparse and payload == "residual":
        parts.append(((T, K), "int32"))  # the top-k ids, routing COMBINE_GRAD from there
    return parts


def row_bytes(payload: str, moe: bool, s: HopShape) -> int:
    """Bytes one token's row adds to a message (its per-token tensors: rows, ids, weights, index),
    what a byte count multiplies by the rows a message carries (`comm.base.Traffic`): the message at
    two tokens less the message at one (every tensor but the count and the load grows with T)."""
    one, two = (dataclasses.replace(s, rows=1, seq_len=t) for t in (1, 2))
    return int(message_bytes(payload, moe, two) - message_bytes(payload, moe, one))


def align(n: Num) -> Num:
    """`n` bytes rounded up to the next ALIGN boundary (`comm.symmetric.align`)."""
    return -(-n // ALIGN) * ALIGN


def _even(n: Num) -> Num:
    return n + n % 2


def tensor_bytes(dims: tuple, dtype: str) -> Num:
    out = DTYPE_BYTES[dtype]
    for d in dims:
        out = out * d
    return out


def message_bytes(payload: str, moe: bool, s: HopShape, aligned: bool = False) -> Num:
    """One message's bytes; `aligned`: as an nvshmem segment lays it out (each tensor at ALIGN)."""
    parts = [tensor_bytes(dims, dtype) for dims, dtype in hop_tensors(payload, moe, s)]
    return sum(align(b) if aligned else b for b in parts)


Counts = dict[tuple[str, bool], Num]  # (payload, moe layer) -> receive slots (peer, layer, micro-batch)


def group_layers(num_layers: int, num_dense: int, p: int, g: int) -> tuple[int, int]:
    """(MoE layers, dense layers) of pipeline group g of p (layer l in group l mod p; zero for g >= p)."""
    if g >= p:
        return 0, 0
    dense = max(0, -(-(num_dense - g) // p))
    return max(0, -(-(num_layers - g) // p)) - dense, dense


def layer_tables(num_layers: int, num_dense: int, p: Num) -> tuple[np.ndarray, np.ndarray]:
    """int [max p + 1, max p] tables of `group_layers` (MoE, dense) for every p among `p` and group g."""
    top = int(np.max(p))
    moe, dense = np.zeros((top + 1, top), dtype=np.int64), np.zeros((top + 1, top), dtype=np.int64)
    for q in np.unique(p).tolist():
        for g in range(q):
            moe[q, g], dense[q, g] = group_layers(num_layers, num_dense, q, g)
    return moe, dense


RING = "ring"  # `reuse=RING`: nvshmem's rings (module docstring), counted in segments
RING_STEP = "ring-step"  # `reuse=RING_STEP`: the rings rounded up to a step's messages (captured rank steps)
RINGS = (RING, RING_STEP)


def _shared(per_key: Num, present: Num, reuse: bool | str, mb: Num = 1) -> Num:
    """A gradient payload's slots: `per_key` without reuse, one per peer (`present`) with it; with
    RING a ring per peer of m + 1 segments, at most two per key (`ring_segments`); RING_STEP that
    ring rounded up by `step_ring`."""
    if reuse in RINGS:
        keys = per_key // np.maximum(present, 1)  # a ring's keys: its messages a step
        ring = np.minimum(mb + 1, 2 * keys)
        return present * (step_ring(ring, keys) if reuse == RING_STEP else ring)
    return np.minimum(per_key, present) if reuse else per_key


def _forward(per_key: Num, present: Num, reuse: bool | str) -> Num:
    """A forward payload's segments with RING: a ring per peer of a segment per key and one more;
    RING_STEP that ring rounded up by `step_ring` (twice its keys)."""
    if reuse == RING_STEP:
        keys = per_key // np.maximum(present, 1)
        return present * step_ring(keys + 1, keys)
    return per_key + present if reuse == RING else per_key


def step_ring(size: Num, per_step: Num) -> Num:
    """`runtime.schedule.reuse_order.step_ring` on arrays (0 where `per_step` is 0): the smallest
    divisor of 2 `per_step` at least `size`, past 2 `per_step` its next multiple. Worked out once per
    distinct pair (the planner's candidates share a few dozen)."""
    size, per_step = np.broadcast_arrays(np.asarray(size, dtype=np.int64), np.asarray(per_step, dtype=np.int64))
    span = int(np.max(per_step, initial=0)) + 1
    pairs, back = np.unique((size * span + per_step).ravel(), return_inverse=True)
    return _step_ring(pairs // span, pairs % span)[back].reshape(size.shape)


def _step_ring(size: np.ndarray, per_step: np.ndarray) -> np.ndarray:
    """`step_ring` of 1-D arrays."""
    twice = 2 * per_step
    out = np.where(size > twice, -(-size // np.maximum(twice, 1)) * twice, twice)
    most = int(np.max(twice // np.maximum(size, 1), initial=1))
    for j in range(2, most + 1):  # divisors 2 per_step / j, the largest j giving the smallest fitting one
        fits = (twice % j == 0) & (twice // j >= size)
        out = np.where(fits, np.minimum(out, twice // j), out)
    return np.where(per_step > 0, out, 0)


def _loss_fed(num_layers: int, num_dense: int, p: Num, g: Num) -> tuple[Num, Num]:
    """(MoE, dense) 1 where group g receives the last layer's output from another group (p > 1, g
    the head: `num_layers` mod p), a message the loss reads and frees; else 0."""
    head = np.where((np.asarray(p) > 1) & (np.asarray(g) == num_layers % np.maximum(np.asarray(p), 1)), 1, 0)
    moe_last = 1 if num_layers - 1 >= num_dense else 0
    return head * moe_last, head * (1 - moe_last)


def attention_receives(num_layers: int, num_dense: int, p: Num, g: int, expert_ranks: Num,
                       micro_batches: Num, tables: tuple[np.ndarray, np.ndarray] | None = None,
                       reuse: bool | str = False) -> Counts:
    """Receive slots of an attention rank of group g (module docstring), `expert_ranks` Q in its set.
    `tables`: `layer_tables` of `p`, if already computed; `reuse`: slots shared by keys whose
    lifetimes do not overlap (`runtime.schedule.recv_slots`, module docstring)."""
    p = np.asarray(p)
    moe_t, dense_t = layer_tables(num_layers, num_dense, p) if tables is None else tables
    here = np.where(g < p, 1, 0)
    at = min(g, moe_t.shape[1] - 1)
    moe_g, dense_g = moe_t[p, at] * here, dense_t[p, at] * here
    prev = (g - 1) % np.maximum(p, 1)  # the group before g on the ring
    moe_prev, dense_prev = moe_t[p, prev] * here, dense_t[p, prev] * here
    ring = np.where(p > 1, 1, 0)
    return _attention_counts(num_layers, num_dense, p, g, expert_ranks, micro_batches, ring, moe_g, dense_g,
                             moe_prev, dense_prev, reuse)


def _attention_counts(num_layers, num_dense, p, g, q, mb, ring, moe_g, dense_g, moe_prev, dense_prev,
                      reuse: bool | str) -> Counts:
    """`attention_receives`' counts from its layer counts (scalars, or [N, G] with `layout_receives`).
    With reuse: a gradient payload one slot per peer (consumed by the backward op right after it
    arrives); a forward one a slot per key, as its autograd state lives until the backward, except
    the last layer's message to the head group (p > 1), which the loss reads and frees: one."""
    fed_moe, fed_dense = _loss_fed(num_layers, num_dense, p, g) if reuse and reuse not in RINGS else (0, 0)
    fwd_moe = mb * moe_prev - (mb - 1) * fed_moe * (moe_prev > 0)
    fwd_dense = mb * dense_prev - (mb - 1) * fed_dense * (dense_prev > 0)
    return {("dispatch_grad", True): _shared(mb * q * moe_g, q * (moe_g > 0), reuse, mb),
            ("combine", True): _forward(q * fwd_moe, q * (moe_prev > 0), reuse),
            ("residual", True): _forward(ring * fwd_moe, ring * (moe_prev > 0), reuse),
            ("residual", False): _forward(ring * fwd_dense, ring * (dense_prev > 0), reuse),
            ("residual_grad", True): _shared(mb * ring * moe_g, ring * (moe_g > 0), reuse, mb),
            ("residual_grad", False): _shared(mb * ring * dense_g, ring * (dense_g > 0), reuse, mb)}


def expert_receives(num_layers: int, num_dense: int, p: Num, g: int, sources: Num, micro_batches: Num,
                    reuse: bool | str = False, swaps: Num = 0) -> Counts:
    """Receive slots of an expert rank of group g serving `sources` attention ranks (`reuse`: one
    COMBINE_GRAD slot per source, `attention_receives`), swapping block loads with `swaps` ranks."""
    moe_g, _ = group_layers(num_layers, num_dense, p, g)
    n = micro_batches * sources * moe_g
    present = sources * (moe_g > 0)
    return {("dispatch", True): _forward(n, present, reuse),
            ("combine_grad", True): _shared(n, present, reuse, micro_batches),
            **_load_swaps(moe_g, micro_batches, swaps, reuse)}


def _load_swaps(moe_g: Num, mb: Num, swaps: Num, reuse: bool | str) -> Counts:
    """EXPERT_LOAD's slots where an expert rank swaps block loads with `swaps` ranks, none without:
    each read by the backward op right after it arrives (as COMBINE_GRAD: one per peer with reuse);
    with RING a ring per peer of m + 1 segments, at least 3 up to its keys (`reuse_order.ring_segments`:
    its sender runs a layer further ahead), RING_STEP that ring rounded up by `step_ring`."""
    if not np.any(swaps):
        return {}
    per_key, present = mb * swaps * moe_g, swaps * (moe_g > 0)
    if reuse not in RINGS:
        return {("expert_load", True): np.minimum(per_key, present) if reuse else per_key}
    keys = per_key // np.maximum(present, 1)
    ring = np.maximum(mb + 1, np.minimum(3, keys))
    return {("expert_load", True): present * (step_ring(ring, keys) if reuse == RING_STEP else ring)}


def colocated_receives(num_layers: int, num_dense: int, p: int, g: int, ep: Num, micro_batches: Num,
                       reuse: bool | str = False, swaps: Num = 0) -> Counts:
    """Receive slots of a colocated rank of group g of p in an EP block of `ep` ranks (one block a
    group: its ranks): an attention rank whose set is its block and an expert rank serving it
    (`attention_receives`, `expert_receives`, swapping block loads with `swaps` ranks), less its
    messages to itself (module docstring)."""
    own = np.asarray(ep) - 1  # the block's other ranks
    across = own if p == 1 else np.asarray(ep)  # the same block of the neighbouring group

    def attention(q: Num) -> Counts:
        return attention_receives(num_layers, num_dense, p, g, q, micro_batches, reuse=reuse)

    def expert(sources: Num) -> Counts:
        return expert_receives(num_layers, num_dense, p, g, sources, micro_batches, reuse, swaps)

    return {**attention(own), **expert(own), ("combine", True): attention(across)[("combine", True)],
            ("combine_grad", True): expert(across)[("combine_grad", True)]}


def receive_bytes(counts: Counts, s: HopShape, transport: str, sizes: dict | None = None) -> Num:
    """A rank's message buffers from its slot counts (nvshmem: the payload region of its arena,
    both copies; `arena_bytes` adds the flags and takes the largest rank). `sizes`: `message_bytes`
    by (payload, moe), if already computed."""
    aligned = transport == "nvshmem"
    copies = 1  # nvshmem counts segments (`reuse=RING`: a ring's copies are in its count)
    sizes = {} if sizes is None else sizes
    out = 0
    for key, n in counts.items():
        if key not in sizes:
            sizes[key] = message_bytes(*key, s, aligned)
        size = sizes[key]
        if np.ndim(n) == 2 and np.ndim(size) == 1:  # [N, G] counts (`layout_receives`), [N] sizes
            size = np.asarray(size)[:, None]
        out = out + copies * n * size
    return out


def flag_words(counts: Counts) -> Num:
    """nvshmem: the int64 flag words of a rank's segments (one per segment, even)."""
    return _even(sum(counts.values()))


def arena_bytes(ranks: list[Counts], s: HopShape) -> Num:
    """The nvshmem arena every rank allocates: the largest flag region (8-byte words, aligned) and
    the largest payload region among `ranks` (`comm.symmetric.symmetric_layouts`, no sum region)."""
    sizes: dict = {}
    words = _groups_max(np.maximum.reduce([np.asarray(flag_words(c)) for c in ranks]))
    payload = _groups_max(np.maximum.reduce([np.asarray(receive_bytes(c, s, "nvshmem", sizes)) for c in ranks]))
    return align(8 * words) + payload


def layout_receives(num_layers: int, num_dense: int, p: Num, dp: Num, expert_ranks: Num, sets: Num,
                    micro_batches: Num, colocated: bool, reuse: bool | str = False,
                    swaps_load: bool = False) -> tuple[list[Counts], list[Counts]]:
    """(attention ranks', expert ranks') slot counts of a layout (colocated: its ranks', each in an EP
    block of `expert_ranks` ep ranks as `colocated_receives` counts them, and no expert ranks). With
    array arguments (one element per candidate) each count is [N, G]: the rank of pipeline group g
    in column g (groups past a candidate's p count nothing), so the busiest group is one max over the
    last axis (`transport_bytes`). Arguments as `layout_transport_bytes`'."""
    p = np.atleast_1d(np.asarray(p))
    moe_t, dense_t = layer_tables(num_layers, num_dense, p)
    groups = np.arange(moe_t.shape[1])
    col = lambda x: np.asarray(x)[..., None] if np.ndim(x) else x  # noqa: E731  a candidate's value, every group
    moe_g, dense_g = moe_t[p], dense_t[p]  # [N, G]
    prev = (groups - 1) % col(p)  # the group before g on the ring
    here = groups < col(p)
    moe_prev = np.take_along_axis(moe_g, prev, 1) * here
    dense_prev = np.take_along_axis(dense_g, prev, 1) * here
    mb, ring = col(micro_batches), col(np.where(p > 1, 1, 0))

    def attention(q: Num) -> Counts:
        return _attention_counts(num_layers, num_dense, col(p), groups, q, mb, ring, moe_g, dense_g, moe_prev,
                                 dense_prev, reuse)

    # the other blocks an expert rank swaps block loads with: its sets' (fewer attention ranks feed sets
    # d, d + dp, ... each, one block: `plan_layout.fed_replicas`)
    swaps = (np.minimum(col(sets), col(dp)) - 1) * swaps_load

    def expert(sources: Num) -> Counts:
        return {("dispatch", True): _forward(mb * sources * moe_g, sources * (moe_g > 0), reuse),
                ("combine_grad", True): _shared(mb * sources * moe_g, sources * (moe_g > 0), reuse, mb),
                **_load_swaps(moe_g, mb, swaps, reuse)}

    if colocated:  # its own block's other ranks, and the neighbouring group's same block (p = 1: itself, ep - 1)
        own = col(expert_ranks) - 1
        across = np.where(ring > 0, own + 1, own)
        return [{**attention(own), **expert(own), ("combine", True): attention(across)[("combine", True)],
                 ("combine_grad", True): expert(across)[("combine_grad", True)]}], []
    return [attention(col(expert_ranks))], [expert(col(np.asarray(dp) // np.asarray(sets)))]


def transport_bytes(attn: list[Counts], exp: list[Counts], s: HopShape, transport: str = "nvshmem") -> tuple[Num, Num]:
    """(attention GPU, expert GPU) bytes of `layout_receives`' counts: nvshmem, the one arena every
    GPU holds; otherwise the busiest rank of each role (colocated: `attn` only, both the same)."""
    if transport == "nvshmem":
        arena = arena_bytes(attn + exp, s)
        return arena, arena
    sizes: dict = {}
    busiest = [_groups_max(np.maximum.reduce([np.asarray(receive_bytes(c, s, transport, sizes)) for c in counts]))
               for counts in (attn, exp or attn)]
    return busiest[0], busiest[1]


def _groups_max(x: np.ndarray) -> np.ndarray:
    """The busiest pipeline group's value of a [N, G] array (`layout_receives`); others as they are."""
    return x.max(axis=-1) if x.ndim == 2 else x


def layout_transport_bytes(num_layers: int, num_dense: int, s: HopShape, p: Num, dp: Num, expert_ranks: Num,
                           sets: Num, micro_batches: Num, colocated: bool,
                           transport: str = "nvshmem", step_aligned: bool = False,
                           swaps_load: bool = False) -> tuple[Num, Num]:
    """(attention GPU, expert GPU) transport bytes of a layout, the busiest pipeline group's rank
    of each role (colocated: both the same). `dp`: attention ranks per group, `expert_ranks`: Q per
    replica set, `sets` replica sets per group (an expert rank serves dp / sets sources); colocated:
    `expert_ranks` is the ep ranks of an EP block (a rank's peers: ep - 1 of its block, and with p > 1
    the neighbouring group's same block's ep). nvshmem: every GPU
    holds the largest arena of any rank (symmetric memory); nccl and local share slots between keys
    whose lifetimes do not overlap (`runtime.schedule.recv_slots`), nvshmem in rings of segments
    (`reuse=RING`, `runtime.schedule.reuse_order.one_sided_slots`; `step_aligned`: rounded up to a
    step's messages, RING_STEP, as a run with captured rank steps allocates them). `swaps_load`: the
    router needs the global load, so each expert rank swaps its block's with the `sets` - 1 others
    (EXPERT_LOAD, `runtime.topology.Topology.load_peers`)."""
    rings = RING_STEP if step_aligned else RING
    attn, exp = layout_receives(num_layers, num_dense, p, dp, expert_ranks, sets, micro_batches, colocated,
                                reuse=rings if transport == "nvshmem" else True, swaps_load=swaps_load)
    return transport_bytes(attn, exp, s, transport)
