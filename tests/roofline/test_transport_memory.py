"""roofline.transport_memory against what the transports allocate: the nvshmem arena from
`symmetric_layouts` (what `NvshmemTransport` is given and allocates) and the buffers
`NcclTransport.reserve` creates (on CPU: its allocation only), for every rank's program."""

from __future__ import annotations

import numpy as np
import pytest

from disagmoe.comm.nccl import NcclTransport
from disagmoe.config import TrainConfig, load_yaml
from disagmoe.model_ref import load_model
from disagmoe.roofline import transport_memory as tm
from disagmoe.runtime.stages.messages import MessageShapes, dispatch_mode, receive_layouts
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
]


def _run(layout: dict, transport: str, shared: bool) -> tuple[TrainConfig, object, Topology]:
    d = load_yaml(open("configs/tiny-cpu.yaml").read())
    model = dict(MODEL, num_shared_experts=1, shared_expert_ffn_size=32) if shared else MODEL
    d.update(layout, model=model, transport=transport, batch_size=12,
             device="cuda" if transport != "local" else "cpu")
    cfg = TrainConfig.model_validate(d)
    m = load_model(cfg.model)
    return cfg, m, Topology.from_config(cfg, m)


def _model_bytes(cfg: TrainConfig, m, top: Topology) -> tuple[list, tm.HopShape]:
    """Every rank's slot counts from the model (its role's formula) and the run's HopShape."""
    sparse = dispatch_mode(cfg, m, top)[0] == "sparse"
    s = tm.HopShape(cfg.batch_size // (cfg.micro_batches * top.data_parallel), cfg.seq_len, m.hidden_size, m.top_k,
                    m.num_experts, "bf16", m.shared_ffn_size > 0, False, sparse)
    counts = []
    for rank in range(top.world_size):
        if top.colocated:
            counts.append(tm.colocated_receives(m.num_moe_layers, top.world_size - 1, cfg.micro_batches))
        elif top.attention_role(rank) is not None:
            g = top.attention_role(rank)[0]
            counts.append(tm.attention_receives(m.num_layers, m.num_dense_layers, top.pipeline_groups, g,
                                                len(top.expert_groups[g]), cfg.micro_batches))
        else:
            g = top.expert_role(rank)[0]
            counts.append(tm.expert_receives(m.num_layers, m.num_dense_layers, top.pipeline_groups, g,
                                             len(top.attention_groups[g]), cfg.micro_batches))
    return counts, s


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shared", [False, True])
def test_nvshmem_arena_matches_symmetric_layouts(layout, shared):
    cfg, m, top = _run(layout, "nvshmem", shared)
    counts, s = _model_bytes(cfg, m, top)
    layouts = receive_layouts(cfg, MessageShapes.of_run(cfg, m, top), top)
    assert int(tm.arena_bytes(counts, s)) == layouts[0].nbytes
    assert {int(tm.flag_words(c)) for c in counts} <= {layouts[0].flag_words} | set(range(layouts[0].flag_words))
    if not top.colocated:  # the planner's view: the busiest group's rank of each role, one arena for all
        dp = top.data_parallel
        attn, exp = tm.layout_transport_bytes(m.num_layers, m.num_dense_layers, s, np.array([top.pipeline_groups]),
                                              np.array([dp]), np.array([len(top.expert_groups[0])]), np.array([1]),
                                              cfg.micro_batches, colocated=False)
        assert int(attn[0]) == int(exp[0]) == layouts[0].nbytes


def _nccl_reserved(cfg, m, top: Topology, rank: int) -> int:
    """Bytes `NcclTransport.reserve` allocates for `rank`'s program, as the worker calls it (CPU)."""
    transport = object.__new__(NcclTransport)  # its allocation only: no process group on CPU
    transport.device, transport._buffers = "cpu", {}
    shapes = MessageShapes.of_run(cfg, m, top)
    for op in top.programs(cfg.micro_batches)[rank]:
        if isinstance(op, Recv):
            for peer in op.peers:
                if peer != rank:
                    transport.reserve(peer, message_key(0, op.payload, op.layer, op.micro_batch),
                                      shapes.specs(op.payload, top.is_moe(op.layer)))
    return sum(b.numel() * b.element_size() for buffers in transport._buffers.values() for b in buffers)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_nccl_buffers_match_reserve(layout):
    cfg, m, top = _run(layout, "nccl", shared=True)
    counts, s = _model_bytes(cfg, m, top)
    for rank in range(top.world_size):
        assert int(tm.receive_bytes(counts[rank], s, "nccl")) == _nccl_reserved(cfg, m, top, rank)


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
