"""roofline.transport_memory against what the transports allocate: the nvshmem arena from
`symmetric_layouts` (what `NvshmemTransport` is given and allocates) and the buffers
`NcclTransport.reserve` creates (on CPU: its allocation only), for every rank's program."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagmoe.comm.nccl import NcclTransport
from disagmoe.config import TrainConfig, load_yaml
from disagmoe.model_ref import load_model
from disagmoe.roofline import transport_memory as tm
from disagmoe.runtime.schedule.recv_slots import slot_plan
from disagmoe.runtime.stages.messages import MessageShapes, dispatch_mode, receive_layouts, transport_buffer_bytes
from disagmoe.runtime.topology import Topology
from disagmoe.wire import Payload, Recv, message_key

MODEL = {"name": "t", "vocab_size": 256, "hidden_size": 64, "num_layers": 5, "num_dense_layers": 1,
         "dense_ffn_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 16, "num_experts": 8, "top_k": 2,
         "expert_ffn_size": 32, "seq_len": 64}
LAYOUTS = [
    {"attention_ranks": 1, "expert_ranks": 1, "pipeline_groups": 1, "micro_batches": 2},
    {"attention_ranks": 2, "expert_ranks": 4, "pipeline_groups": 1, "micro_batches": 2},
    {"attention_ranks": 4, "expert_ranks": 4, "pipeline_groups": 2, "micro_batches": 1},
    {"attention_ranks": 3, "expert_ranks": 3, "pipeline_groups": 3, "micro_batches": 2},
    {"mode": "colocated", "colocated_ranks": 4, "micro_batches": 2},
    {"mode": "colocated", "colocated_ranks": 4, "pipeline_groups": 2, "micro_batches": 2},
    {"mode": "colocated", "colocated_ranks": 3, "pipeline_groups": 3, "micro_batches": 2},
    # EP blocks and replica sets: a source's peers are its block's (set's), not the group's
    {"mode": "colocated", "colocated_ranks": 4, "expert_replica_sets": 2, "micro_batches": 2},
    {"mode": "colocated", "colocated_ranks": 8, "pipeline_groups": 2, "expert_replica_sets": 2, "micro_batches": 2},
    {"attention_ranks": 2, "expert_ranks": 4, "pipeline_groups": 1, "expert_replica_sets": 2, "micro_batches": 2},
    # under an auxiliary loss: the blocks (sets) also swap their loads (EXPERT_LOAD)
    {"mode": "colocated", "colocated_ranks": 4, "expert_replica_sets": 2, "micro_batches": 2, "aux_loss": True},
    {"mode": "colocated", "colocated_ranks": 8, "pipeline_groups": 2, "expert_replica_sets": 2, "micro_batches": 3,
     "aux_loss": True},
    {"attention_ranks": 2, "expert_ranks": 4, "pipeline_groups": 1, "expert_replica_sets": 2, "micro_batches": 2,
     "aux_loss": True},
]
EXTRA = [  # more micro-batches in flight; the head group fed by another (p > 1)
    {"attention_ranks": 1, "expert_ranks": 1, "pipeline_groups": 1, "micro_batches": 6},
    {"attention_ranks": 2, "expert_ranks": 2, "pipeline_groups": 2, "micro_batches": 4},
    {"attention_ranks": 4, "expert_ranks": 2, "pipeline_groups": 2, "micro_batches": 3},
    {"mode": "colocated", "colocated_ranks": 2, "micro_batches": 4},
    {"mode": "colocated", "colocated_ranks": 6, "pipeline_groups": 3, "micro_batches": 3},
    {"mode": "colocated", "colocated_ranks": 2, "pipeline_groups": 2, "micro_batches": 4},
    {"mode": "colocated", "colocated_ranks": 6, "expert_replica_sets": 3, "micro_batches": 3},
    {"mode": "colocated", "colocated_ranks": 12, "pipeline_groups": 3, "expert_replica_sets": 2, "micro_batches": 2},
    {"attention_ranks": 4, "expert_ranks": 4, "pipeline_groups": 2, "expert_replica_sets": 2, "micro_batches": 3},
    {"mode": "colocated", "colocated_ranks": 6, "expert_replica_sets": 3, "micro_batches": 4, "aux_loss": True},
    {"attention_ranks": 3, "expert_ranks": 6, "pipeline_groups": 1, "expert_replica_sets": 3, "micro_batches": 1,
     "aux_loss": True},
]


def _run(layout: dict, transport: str, shared: bool, **fields) -> tuple[TrainConfig, object, Topology]:
    d = load_yaml(open("configs/tiny-cpu.yaml").read())
    layout = dict(layout)
    model = dict(MODEL, num_shared_experts=1, shared_expert_ffn_size=32) if shared else MODEL
    if layout.pop("aux_loss", False):  # the router then needs the global load (`Topology.load_peers`)
        model = dict(model, router={"aux_loss_coef": 0.01})
    d.update(layout, model=model, transport=transport, batch_size=12,
             device="cuda" if transport != "local" else "cpu", **fields)
    cfg = TrainConfig.model_validate(d)
    m = load_model(cfg.model)
    return cfg, m, Topology.from_config(cfg, m)


def _model_bytes(cfg: TrainConfig, m, top: Topology, reuse: bool | str = False) -> tuple[list, tm.HopShape]:
    """Every rank's slot counts from the model (its role's formula) and the run's HopShape
    (`reuse`: slots shared as nccl and local keep them; RING: nvshmem's rings)."""
    sparse = dispatch_mode(cfg, m, top)[0] == "sparse"
    s = tm.HopShape(cfg.batch_size // (cfg.micro_batches * top.data_parallel), cfg.seq_len, m.hidden_size, m.top_k,
                    m.num_experts, "bf16", m.shared_ffn_size > 0, False, sparse)
    counts = []
    for rank in range(top.world_size):
        if top.colocated:  # its EP block's ep ranks
            g = top.attention_role(rank)[0]
            counts.append(tm.colocated_receives(m.num_layers, m.num_dense_layers, top.pipeline_groups, g,
                                                top.dispatch_width, cfg.micro_batches, reuse, _swaps(top, rank)))
        elif top.attention_role(rank) is not None:  # its set's Q expert ranks
            g = top.attention_role(rank)[0]
            counts.append(tm.attention_receives(m.num_layers, m.num_dense_layers, top.pipeline_groups, g,
                                                top.dispatch_width, cfg.micro_batches, reuse=reuse))
        else:  # its S sources
            g = top.expert_role(rank)[0]
            layer = min(top.experts_of(rank))
            counts.append(tm.expert_receives(m.num_layers, m.num_dense_layers, top.pipeline_groups, g,
                                             len(top.sources_of(layer, rank)), cfg.micro_batches, reuse,
                                             _swaps(top, rank)))
    return counts, s


def _swaps(top: Topology, rank: int) -> int:
    """The ranks an expert rank swaps its block's load with (`Topology.load_peers` of its first MoE layer)."""
    layers = top.experts_of(rank)
    return len(top.load_peers(min(layers), rank)) if layers else 0


def _captured(layout: dict) -> bool:
    """A layout whose rank steps `cuda_graphs: on` captures (`runtime.rank_graphs`): one attention
    rank per pipeline group (colocated: one rank is every rank's data-parallel replica), no replica sets."""
    return (layout.get("mode") != "colocated" and layout["attention_ranks"] == layout["pipeline_groups"]
            and layout.get("expert_replica_sets", 1) == 1)


CAPTURED = [layout for layout in LAYOUTS + EXTRA if _captured(layout)]


@pytest.mark.parametrize("layout, graphs", [(layout, "off") for layout in LAYOUTS + EXTRA]
                         + [(layout, "on") for layout in CAPTURED])
@pytest.mark.parametrize("shared", [False, True])
def test_nvshmem_arena_matches_symmetric_layouts(layout, graphs, shared):
    """The model's rings (`reuse=RING`: keys share a ring of segments, `reuse_order.one_sided_slots`;
    RING_STEP: rounded up to a step's messages where the rank steps are captured) are the arena
    `receive_layouts` builds, and never more than two copies of a segment per key."""
    step_aligned = graphs == "on"  # the loop backend reads counts on the host: a captured step runs triton's
    cfg, m, top = _run(layout, "nvshmem", shared, **(dict(cuda_graphs="on", experts_backend="triton", hop="partial_sums")
                                                      if step_aligned else {}))
    counts, s = _model_bytes(cfg, m, top, reuse=tm.RING_STEP if step_aligned else tm.RING)
    per_key, _ = _model_bytes(cfg, m, top, reuse=False)
    assert all(sum(c.values()) <= tm.COPIES * sum(k.values()) for c, k in zip(counts, per_key, strict=True))
    layouts = receive_layouts(cfg, MessageShapes.of_run(cfg, m, top), top)
    for rank, layout in enumerate(layouts):  # rank by rank, payload by payload: the rings' segments
        segments: dict = {}
        for seg in layout.segments:
            at = (seg.slot[1].value, top.is_moe(seg.slot[2]))
            segments[at] = segments.get(at, 0) + 1
        assert segments == {at: int(n) for at, n in counts[rank].items() if n}, rank
    assert int(tm.arena_bytes(counts, s)) == layouts[0].nbytes
    assert {int(tm.flag_words(c)) for c in counts} <= {layouts[0].flag_words} | set(range(layouts[0].flag_words))
    attn, exp = tm.layout_transport_bytes(m.num_layers, m.num_dense_layers, s, *_planner_layout(top),
                                          cfg.micro_batches, colocated=top.colocated, step_aligned=step_aligned,
                                          swaps_load=top.global_load)
    assert int(attn[0]) == int(exp[0]) == layouts[0].nbytes  # the planner's view: one arena for all


def _planner_layout(top: Topology) -> tuple[np.ndarray, ...]:
    """(p, dp, expert ranks, sets) of a topology as the planner's arrays hold them: the ranks a source
    serves (colocated: its EP block's ep) and the sets of them in a group."""
    per_set = top.dispatch_width
    sets = (top.data_parallel if top.colocated else len(top.expert_groups[0])) // per_set
    return np.array([top.pipeline_groups]), np.array([top.data_parallel]), np.array([per_set]), np.array([sets])


def _nccl_reserved(cfg, m, top: Topology, rank: int) -> int:
    """Bytes `NcclTransport.reserve` allocates for `rank`'s program, as `TrainWorker.setup` calls it
    (the shared slots of `recv_slots.slot_plan`; CPU: its allocation only, no process group)."""
    transport = object.__new__(NcclTransport)
    transport.device = "cpu"
    shapes = MessageShapes.of_run(cfg, m, top)
    plan = slot_plan(top.programs(cfg.micro_batches)[rank], rank, top.is_moe, top.num_layers)
    for (peer, payload, layer, mb), (pool, index) in plan.slot.items():
        transport.reserve(peer, message_key(0, Payload(payload), layer, mb), shapes.specs(Payload(payload), pool[2]),
                          slot=(pool, index))
    buffers = getattr(transport, "_buffers", {})
    return sum(b.numel() * b.element_size() for bs in buffers.values() for b in bs)


@pytest.mark.parametrize("layout", LAYOUTS + EXTRA)
def test_nccl_buffers_match_reserve(layout):
    """The allocated bytes are the model's, slots shared (`reuse`), rank by rank, and the planner's
    array form gives the busiest group's rank of each role (colocated: of any group, both the same)."""
    cfg, m, top = _run(layout, "nccl", shared=True)
    counts, s = _model_bytes(cfg, m, top, reuse=True)
    reserved = [_nccl_reserved(cfg, m, top, rank) for rank in range(top.world_size)]
    for rank in range(top.world_size):
        assert int(tm.receive_bytes(counts[rank], s, "nccl")) == reserved[rank]
    assert transport_buffer_bytes(cfg, MessageShapes.of_run(cfg, m, top), top) == reserved
    attn, exp = tm.layout_transport_bytes(m.num_layers, m.num_dense_layers, s, *_planner_layout(top),
                                          cfg.micro_batches, colocated=top.colocated, transport="nccl",
                                          swaps_load=top.global_load)
    roles = [top.attention_role(r) is not None for r in range(top.world_size)]  # colocated: every rank
    assert int(attn[0]) == max(b for b, a in zip(reserved, roles) if a)
    assert int(exp[0]) == max(b for b, a in zip(reserved, roles) if not a or top.colocated)


@pytest.mark.parametrize("layout", LAYOUTS + EXTRA)
def test_shared_slots_take_less_than_a_slot_per_key(layout):
    """Reuse keeps every gradient payload at one slot per peer; without it the model is the old one."""
    cfg, m, top = _run(layout, "nccl", shared=True)
    shared, s = _model_bytes(cfg, m, top, reuse=True)
    per_key, _ = _model_bytes(cfg, m, top, reuse=False)
    for rank in range(top.world_size):
        assert tm.receive_bytes(shared[rank], s, "nccl") <= tm.receive_bytes(per_key[rank], s, "nccl")
        assert tm.receive_bytes(per_key[rank], s, "nccl") == _per_key_bytes(cfg, m, top, rank)
        for (payload, moe), n in shared[rank].items():
            if payload.endswith("_grad") and n:
                peers = {peer for op in top.programs(cfg.micro_batches)[rank] if isinstance(op, Recv)
                         and op.payload.value == payload and top.is_moe(op.layer) == moe for peer in op.peers
                         if peer != rank}
                assert n == len(peers)


def _per_key_bytes(cfg, m, top: Topology, rank: int) -> int:
    shapes = MessageShapes.of_run(cfg, m, top)
    """Bytes of a buffer per receive key (peer, payload, layer, micro-batch): no slot shared."""
    return sum(sum(spec_bytes(sp) for sp in shapes.specs(op.payload, top.is_moe(op.layer)))
               * sum(p != rank for p in op.peers)
               for op in top.programs(cfg.micro_batches)[rank] if isinstance(op, Recv))


def spec_bytes(spec) -> int:
    return int(np.prod(spec.shape, dtype=np.int64)) * torch.empty(0, dtype=spec.dtype).element_size()


def test_message_specs_are_the_roofline_table():
    cfg, m, top = _run(LAYOUTS[1], "nvshmem", shared=True)
    shapes = MessageShapes.of_run(cfg, m, top)
    s = tm.HopShape(shapes.rows, shapes.seq_len, shapes.hidden, shapes.top_k, shapes.num_experts, "bf16",
                    shapes.shared_experts, False, shapes.sparse)
    assert shapes.sparse and shapes.shared_experts  # 4 expert ranks on nvshmem: dispatch auto is sparse
    for spec_payload in ("dispatch", "combine", "dispatch_grad", "combine_grad", "residual"):
        specs = shapes.specs(Payload(spec_payload), True)
        assert sum(int(np.prod(sp.shape)) * sp.dtype.itemsize for sp in specs) == \
            tm.message_bytes(spec_payload, True, s)


def test_the_arena_constants_are_the_transports():
    from disagmoe.comm import symmetric

    assert (tm.ALIGN, tm.COPIES) == (symmetric.ALIGN, symmetric.COPIES)
    assert all(tm.align(n) == symmetric.align(n) for n in (0, 1, 255, 256, 257, 10**9 + 7))


@pytest.mark.parametrize("layout", CAPTURED)
def test_step_aligned_rings_cost_at_most_two_segments_per_key(layout):
    """Rounded up to a step's messages, a rank's rings hold at least the plain rings' segments and
    at most two per key (what the per-key arena held before rings)."""
    cfg, m, top = _run(layout, "nvshmem", False, cuda_graphs="on", experts_backend="triton", hop="partial_sums")
    plain, _ = _model_bytes(cfg, m, top, reuse=tm.RING)
    aligned, _ = _model_bytes(cfg, m, top, reuse=tm.RING_STEP)
    per_key, _ = _model_bytes(cfg, m, top, reuse=False)
    for p, a, k in zip(plain, aligned, per_key, strict=True):
        for at in k:
            assert p[at] <= a[at] <= tm.COPIES * k[at], at


def test_step_ring_on_arrays_is_the_runtime_rule():
    from disagmoe.runtime.schedule.reuse_order import step_ring

    sizes, per_step = np.array([[3, 5, 9, 2], [1, 9, 5, 17]]), np.array([[4, 4, 32, 4], [1, 8, 12, 8]])
    want = [[step_ring(int(a), int(b)) for a, b in zip(row_s, row_k)] for row_s, row_k in zip(sizes, per_step)]
    assert tm.step_ring(sizes, per_step).tolist() == want
    assert tm.step_ring(np.array([3, 0]), np.array([0, 0])).tolist() == [0, 0]
