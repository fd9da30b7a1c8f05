"""Sparse dispatch by peer stores through the worker (disagmoe/runtime/cluster/worker.py
`_send_by_peer_stores`, the stages' stashes), on a CPU: every rank's program of one training step
runs in one process, each rank a `TrainWorker` holding just what `_run` reads, over the nvshmem
transport with CPU arenas (tests/comm/test_nvshmem.py's fake `nv`; the dispatch kernel
interpreted). Against the same step over the same transport's send/recv (the nccl/local path):
the same gradients and losses, and the same dispatch bytes, the routing's minimum (sum over
tokens of the distinct remote expert ranks serving them, times a row's bytes). The nvshmem path
stages no DISPATCH message for a peer (no gather into a [Q, T, H] buffer: only a colocated
rank's own message), and each DISPATCH and DISPATCH_GRAD send op is one launch."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from disagmoe.config import TrainConfig
from disagmoe.data import TokenDataset, load_splits
from disagmoe.model_ref import load_model
from disagmoe.runtime.cluster.worker import TrainWorker
from disagmoe.runtime.observe.trace import SpanRecorder
from disagmoe.runtime.rank_model import rank_model
from disagmoe.runtime.schedule.schedule import AttentionForward, OptimizerStep, ReduceGradients
from disagmoe.runtime.stages import attention_stage
from disagmoe.runtime.stages import sparse_dispatch as stage_sd
from disagmoe.runtime.stages.attention_stage import AttentionStage
from disagmoe.runtime.stages.expert_stage import ExpertStage
from disagmoe.runtime.stages.messages import Mailbox, MessageShapes
from disagmoe.runtime.topology import Topology
from disagmoe.wire import Recv, Send
from tests.comm.test_nvshmem import _sparse_transports, fake_cuda  # noqa: F401 (a fixture)

LAYOUTS = {
    "A1-E2": dict(attention_ranks=1, expert_ranks=2),
    "A2-E2": dict(attention_ranks=2, expert_ranks=2),
    "colocated-2": dict(mode="colocated", colocated_ranks=2),
}


def _config(layout: str) -> TrainConfig:
    fields = dict(model="tiny", mode="disaggregated", batch_size=4, seq_len=16, micro_batches=2, dispatch="sparse",
                  hop="partial_sums", cpu_threads=1, steps=1)
    return TrainConfig(**{**fields, **LAYOUTS[layout]})


def _workers(cfg: TrainConfig, routed: list) -> tuple[list[TrainWorker], Topology]:
    """One `TrainWorker` per rank with the state `_run` reads; `routed` gets (rank, layer, top-k ids)."""
    model_cfg = load_model(cfg.model)
    topology = Topology.from_config(cfg, model_cfg)
    shapes = MessageShapes.of_run(cfg, model_cfg, topology)
    assert shapes.sparse
    transports = _sparse_transports(topology, shapes, cfg.micro_batches)
    splits = load_splits(cfg.data, model_cfg.vocab_size, cfg.seq_len)
    workers = []
    for rank in range(topology.world_size):
        worker = object.__new__(TrainWorker)
        worker.rank, worker.device, worker.cfg, worker.topology, worker.shapes = (rank, torch.device("cpu"), cfg,
                                                                                  topology, shapes)
        worker.transport = transports[rank]
        worker.model = rank_model(model_cfg, cfg.experts_backend, topology, rank).materialise(worker.device, cfg.seed)
        worker.recorder, worker.gpu_spans, worker._held_back = SpanRecorder(), None, ("", [])
        worker.watchdog = SimpleNamespace(op=lambda name: contextlib.nullcontext())
        worker.attention = worker.experts = None
        if topology.attention_role(rank) is not None:
            data = TokenDataset(splits.train, cfg.seq_len, cfg.batch_size, cfg.seed, "train")
            worker.attention = AttentionStage(worker.model, topology, rank, data, cfg.micro_batches, sparse=True)
            for layer in worker.attention.layers:
                block = worker.model.block(layer)
                if hasattr(block, "route"):
                    def route(h_BSH, fixed=None, _route=block.route, _layer=layer, _rank=rank):
                        routing = _route(h_BSH, fixed)
                        routed.append((_rank, _layer, routing.topk_idx_NK.detach().clone()))
                        return routing
                    block.route = route
        if topology.expert_role(rank) is not None:
            worker.experts = ExpertStage(worker.model, topology, rank, tokens=shapes.tokens, sparse=True)
        workers.append(worker)
    return workers, topology


class _Gathers(TorchDispatchMode):
    """The shapes of the tensors that the gathers (advanced indexing) under it make."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[tuple[int, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.index, torch.ops.aten.index_select, torch.ops.aten.gather):
            self.seen.add(tuple(out.shape))
        return out


def _step(cfg: TrainConfig, peer_stores: bool, monkeypatch, sd, real_rows) -> dict:
    """One step of every rank's program, interleaved in one process (a receive runs once its
    senders' sends have); returns the gradients, losses, traffic, what the stages staged, the
    dispatch kernel's launches (their destinations) and the attention forwards' tensor shapes.
    `sd`: the interpreted `kernels.sparse_dispatch`, `real_rows` its own `dispatch_rows`."""
    routed, staged, launches = [], [], []
    workers, topology = _workers(cfg, routed)
    for name in ("dispatch_messages", "staged_message"):
        real = getattr(stage_sd, name)
        monkeypatch.setattr(attention_stage, name, lambda *a, _real=real, _name=name, **kw: (
            staged.append(_name), _real(*a, **kw))[1])
    monkeypatch.setattr(sd, "dispatch_rows", lambda x, picked, *a, **kw: (
        launches.append(picked.shape[0]), real_rows(x, picked, *a, **kw))[1])
    mails = [Mailbox(w.rank, peer_stores) for w in workers]
    handles = [[] for _ in workers]
    programs = [topology.programs(cfg.micro_batches)[w.rank] for w in workers]
    position, sent, shapes = [0] * len(workers), set(), _Gathers()
    progress = True
    while progress:
        progress = False
        for rank, (worker, program) in enumerate(zip(workers, programs, strict=True)):
            while position[rank] < len(program):
                op = program[position[rank]]
                if isinstance(op, OptimizerStep):
                    position[rank] = len(program)
                    break
                if isinstance(op, Recv) and any(peer != rank and (peer, rank, op.payload, op.layer, op.micro_batch)
                                                not in sent for peer in op.peers):
                    break
                if not isinstance(op, Send):
                    worker._run_held_back(0)
                if not isinstance(op, ReduceGradients):  # the data-parallel sums: the process group's, not here
                    with shapes if isinstance(op, AttentionForward) else contextlib.nullcontext():
                        worker._run(op, 0, mails[rank], handles[rank])
                if isinstance(op, Send):
                    sent.update((rank, peer, op.payload, op.layer, op.micro_batch) for peer in op.peers)
                position[rank] += 1
                progress = True
    assert position == [len(p) for p in programs], "every rank ran its whole program"
    for worker, mail in zip(workers, mails, strict=True):
        worker._run_held_back(0)
        assert mail.empty(), f"rank {worker.rank}: messages left over"
        assert worker.transport.status_2.tolist() == [0, 0]
    grads = {(w.rank, name): p.grad.clone() for w in workers for name, p in w.model.named_parameters()
             if p.grad is not None}
    losses = [{k: v.clone() for k, v in w.attention.loss_parts.items()} for w in workers if w.attention]
    traffic = [dict(zip(w.transport.traffic.names, w.transport.traffic.words().tolist())) for w in workers]
    return dict(real_rows=real_rows, grads=grads, losses=losses, traffic=traffic, staged=staged, launches=launches,
                shapes=shapes.seen,
                routed=routed, topology=topology, workers=workers)


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_peer_stores_stage_no_message_for_a_peer_and_train_like_send_recv(interpreted, fake_cuda, monkeypatch,
                                                                           layout):
    sd = interpreted("disagmoe.kernels.signal", "disagmoe.kernels.sparse_dispatch")[1]
    cfg = _config(layout)
    by_stores = _step(cfg, True, monkeypatch, sd, sd.dispatch_rows)
    by_messages = _step(cfg, False, monkeypatch, sd, by_stores["real_rows"])
    topology = by_stores["topology"]
    shapes = by_stores["workers"][0].shapes
    T, H = shapes.tokens, shapes.hidden
    Q = len(topology.expert_groups[0])
    moe_forwards = sum(topology.is_moe(layer) for layer in range(topology.num_layers)) * cfg.micro_batches
    attention_ranks = [w.rank for w in by_stores["workers"] if w.attention is not None]
    colocated = cfg.mode == "colocated"

    # the nvshmem path stages no message for a peer: only a colocated rank's own one, and gathers no rows
    # ([Q, T, H] for every rank, or [T, H] for one) but a colocated rank's own
    assert by_stores["staged"] == ["staged_message"] * (moe_forwards * len(attention_ranks) if colocated else 0)
    assert (Q, T, H) not in by_stores["shapes"] and ((T, H) in by_stores["shapes"]) == colocated
    assert by_messages["staged"] == ["dispatch_messages"] * moe_forwards * len(attention_ranks)
    assert (Q, T, H) in by_messages["shapes"], "the send/recv path gathers every rank's rows (the check sees it)"
    # one launch per DISPATCH send (every remote expert rank) and per DISPATCH_GRAD send (every remote source)
    remote_experts = Q - colocated
    sources = len(topology.attention_groups[0])
    want = sorted([remote_experts] * moe_forwards * len(attention_ranks)
                  + [sources - colocated] * moe_forwards * len(topology.expert_groups[0]))
    assert sorted(by_stores["launches"]) == want
    assert by_messages["launches"] == []

    # the same step
    assert by_stores["grads"].keys() == by_messages["grads"].keys() and by_stores["grads"]
    for key, grad in by_stores["grads"].items():
        assert torch.equal(grad, by_messages["grads"][key]), key
    for got, want_parts in zip(by_stores["losses"], by_messages["losses"], strict=True):
        assert all(torch.equal(got[k], want_parts[k]) for k in got)

    # the dispatch bytes: the routing's minimum over the link, the dense figure beside
    minimum = {rank: 0 for rank in range(topology.world_size)}
    for rank, layer, idx_NK in by_stores["routed"]:
        group = topology.expert_groups[topology.group_of_layer(layer)]
        rank_of_E = torch.tensor([group[who[0]] for who in topology.expert_owners[layer]])  # one owner each here
        minimum[rank] += sum(len(set(ranks) - {rank}) for ranks in rank_of_E[idx_NK].tolist())
    assert len(by_stores["routed"]) == moe_forwards * len(attention_ranks)
    for rank in attention_ranks:
        got = by_stores["traffic"][rank]
        assert got["dispatch"] == minimum[rank] * shapes.dispatch_row_bytes(True)
        assert got["dispatch_dense"] == moe_forwards * remote_experts * T * shapes.dispatch_row_bytes(False)
        assert got == by_messages["traffic"][rank]
    assert sum(by_stores["traffic"][rank]["dispatch"] for rank in attention_ranks) < sum(
        by_stores["traffic"][rank]["dispatch_dense"] for rank in attention_ranks)
