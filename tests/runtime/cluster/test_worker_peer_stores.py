"""Sparse dispatch by peer stores through the worker (disagmoe/runtime/cluster/worker.py
`_send_by_peer_stores`, the stages' stashes), on a CPU: every rank's program of one training step
runs in one process, each rank a `TrainWorker` holding just what `_run` reads, over the nvshmem
transport with CPU arenas (tests/comm/test_nvshmem.py's fake `nv`; the dispatch kernel
interpreted). Against the same step over the same transport's send/recv (the nccl/local path):
the same gradients and losses, and the same bytes of DISPATCH, COMBINE (partial sums),
COMBINE_GRAD and DISPATCH_GRAD, each the routing's minimum (sum over tokens of the distinct remote
expert ranks serving them, times a row's bytes) with the dense figure beside; against the same
step with dense dispatch (the path the driver's oracle tests cover): the same to rounding. The
nvshmem path stages no DISPATCH message for a peer (no gather into a [Q, T, H] buffer: only a
colocated rank's own message), gathers no dy for a peer, and each DISPATCH, COMBINE_GRAD and
DISPATCH_GRAD send op is one launch, and with partial sums each COMBINE send op too (with pair
rows the experts' pair rows are stored at their tokens' rows of the combining rank's region, its
combine interpreted)."""

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
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.schedule.schedule import AttentionBackward, AttentionForward, Loss, OptimizerStep, ReduceGradients
from disagmoe.runtime.stages import attention_stage
from disagmoe.runtime.stages import sparse_dispatch as stage_sd
from disagmoe.runtime.stages.attention_stage import AttentionStage
from disagmoe.runtime.stages.expert_stage import ExpertStage
from disagmoe.runtime.stages.messages import Mailbox, MessageShapes
from disagmoe.runtime.stages.pair_return import PairHop
from disagmoe.runtime.topology import Topology
from disagmoe.wire import Payload, Recv, Send
from tests.comm.test_nvshmem import _sparse_transports, fake_cuda  # noqa: F401 (a fixture)

PAIRS = dict(hop="pair_rows")
SKEWED = {1: [[0]] * 7 + [[1]], 2: [[1]] * 7 + [[0]]}  # one expert rank serves one expert of a layer, the other seven
EMPTY = {1: [[0, 1]] * 8, 2: [[1, 0]] * 8}  # source d feeds owner d mod 2 only: count-0 messages
REPLICAS = {1: [[0, 1], [1], [1, 0], [0], [1], [0, 1], [0], [1]], 2: [[0, 1], [1, 0]] * 4}  # split over owners
LAYOUTS = {  # (config fields, expert owners per MoE layer: None for contiguous ranges)
    "A1-E2": (dict(attention_ranks=1, expert_ranks=2), None),
    "A2-E2": (dict(attention_ranks=2, expert_ranks=2), None),
    "colocated-2": (dict(mode="colocated", colocated_ranks=2), None),
    "A1-E3": (dict(attention_ranks=1, expert_ranks=3), None),
    "A2-E2-p2": (dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2), None),
    "colocated-3": (dict(mode="colocated", colocated_ranks=3, batch_size=6), None),
    "skewed-A1-E2": (dict(attention_ranks=1, expert_ranks=2), SKEWED),
    "empty-A2-E2": (dict(attention_ranks=2, expert_ranks=2), EMPTY),
    "replicas-A2-E2": (dict(attention_ranks=2, expert_ranks=2), REPLICAS),
    "pairs-A1-E2": (dict(attention_ranks=1, expert_ranks=2, **PAIRS), None),
    "pairs-A1-E3": (dict(attention_ranks=1, expert_ranks=3, **PAIRS), None),
    "pairs-A2-E2-p2": (dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2, **PAIRS), None),
    "pairs-colocated-2": (dict(mode="colocated", colocated_ranks=2, **PAIRS), None),
    "pairs-colocated-3": (dict(mode="colocated", colocated_ranks=3, batch_size=6, **PAIRS), None),
    "pairs-skewed-A1-E2": (dict(attention_ranks=1, expert_ranks=2, **PAIRS), SKEWED),
    "pairs-empty-A2-E2": (dict(attention_ranks=2, expert_ranks=2, **PAIRS), EMPTY),
    "pairs-replicas-A1-E2": (dict(attention_ranks=1, expert_ranks=2, **PAIRS), REPLICAS),
    "pairs-replicas-A2-E2": (dict(attention_ranks=2, expert_ranks=2, **PAIRS), REPLICAS),
}


def _config(layout: str, dispatch: str = "sparse") -> TrainConfig:
    fields = dict(model="tiny", mode="disaggregated", batch_size=4, seq_len=16, micro_batches=2, dispatch=dispatch,
                  hop="partial_sums", cpu_threads=1, steps=1)
    return TrainConfig(**{**fields, **LAYOUTS[layout][0]})


def _topology(cfg: TrainConfig, layout: str) -> Topology:
    """The run's topology with the layout's owners, needing tiny's aux loss's global load as
    `Topology.from_config` decides: where a layer's expert ranks serve in blocks, each source
    dispatches to its block and the blocks swap their loads (EXPERT_LOAD), else to every expert rank."""
    model_cfg = load_model(cfg.model)
    owners = LAYOUTS[layout][1]
    if owners is None:
        return Topology.from_config(cfg, model_cfg)
    return Topology.disaggregated(Layout.from_config(cfg, model_cfg), model_cfg.num_experts, owners,
                                  global_load=model_cfg.router.needs_every_source_load)


def _workers(cfg: TrainConfig, topology: Topology, routed: list) -> list[TrainWorker]:
    """One `TrainWorker` per rank with the state `_run` reads; `routed` gets (rank, layer, top-k ids)."""
    model_cfg = load_model(cfg.model)
    shapes = MessageShapes.of_run(cfg, model_cfg, topology)
    pair = PairHop.of(cfg) if shapes.pair_rows else None
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
            data = TokenDataset(splits.train, cfg.seq_len, cfg.batch_size, cfg.data_seed, "train")
            worker.attention = AttentionStage(worker.model, topology, rank, data, cfg.micro_batches, pair=pair,
                                              sparse=shapes.sparse)
            for layer in worker.attention.layers:
                block = worker.model.block(layer)
                if hasattr(block, "route"):
                    def route(h_BSH, fixed=None, saved=None, xn_BSH=None, *, _route=block.route, _layer=layer,
                              _rank=rank):
                        routing = _route(h_BSH, fixed, saved, xn_BSH)
                        routed.append((_rank, _layer, routing.topk_idx_NK.detach().clone()))
                        return routing
                    block.route = route
        if topology.expert_role(rank) is not None:
            worker.experts = ExpertStage(worker.model, topology, rank, pair=pair, tokens=shapes.tokens,
                                         sparse=shapes.sparse)
        workers.append(worker)
    return workers


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


def _step(cfg: TrainConfig, topology: Topology, peer_stores: bool, monkeypatch, sd, real_rows) -> dict:
    """One step of every rank's program, interleaved in one process (a receive runs once its
    senders' sends have); returns the gradients, losses, traffic, what the stages staged, the
    dispatch kernel's launches (their destinations), the attention forwards' gathers' shapes and
    those of the ops posting COMBINE_GRAD (`_Gathers`). `sd`: the interpreted
    `kernels.sparse_dispatch`, `real_rows` its own `dispatch_rows`."""
    routed, staged, launches = [], [], []
    workers = _workers(cfg, topology, routed)
    for name in ("dispatch_messages", "staged_message"):
        real = getattr(stage_sd, name)
        monkeypatch.setattr(attention_stage, name, lambda *a, _real=real, _name=name, **kw: (
            staged.append(_name), _real(*a, **kw))[1])
    monkeypatch.setattr(sd, "dispatch_rows", lambda x, picked, *a, **kw: (
        launches.append(picked.shape[0]), real_rows(x, picked, *a, **kw))[1])
    mails = [Mailbox(w.rank, peer_stores) for w in workers]
    handles = [[] for _ in workers]
    programs = [topology.programs(cfg.micro_batches)[w.rank] for w in workers]
    position, sent, shapes, grad_shapes = [0] * len(workers), set(), _Gathers(), _Gathers()
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
                    seen = (shapes if isinstance(op, AttentionForward) else grad_shapes
                            if isinstance(op, (AttentionBackward, Loss)) else contextlib.nullcontext())
                    with seen:
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
                shapes=shapes.seen, grad_shapes=grad_shapes.seen, routed=routed, workers=workers)


def _launches(topology: Topology, micro_batches: int, pair_rows: bool) -> list[int]:
    """The destinations of every peer-store launch of a step, sorted: per MoE layer, micro-batch and
    source a DISPATCH to the remote expert ranks it serves (`Topology.served`) and from its combining
    rank a COMBINE_GRAD to them, per expert rank a DISPATCH_GRAD to its remote sources and, with
    partial sums, a COMBINE to their remote destinations; none where no peer is remote."""
    out = []
    for layer in range(topology.num_layers):
        if not topology.is_moe(layer):
            continue
        group = topology.group_of_layer(layer)
        sources, ranks = topology.attention_groups[group], topology.expert_groups[group]
        destinations = topology.attention_groups[topology.next_group(group)]
        for d, (src, dst) in enumerate(zip(sources, destinations, strict=True)):
            served = set(topology.served(layer, d))
            out += [len(served - {src}), len(served - {dst})] * micro_batches
        for rank in ranks:
            mine = topology.sources_of(layer, rank)
            out += [len({sources[d] for d in mine} - {rank})] * micro_batches
            out += [] if pair_rows else [len({destinations[d] for d in mine} - {rank})] * micro_batches
    return sorted(n for n in out if n)


def _combining_rank(topology: Topology, rank: int, layer: int) -> int:
    """The attention rank that combines source `rank`'s tokens of `layer` (the next group's, of its
    data-parallel index): COMBINE goes there, COMBINE_GRAD comes from there."""
    group = topology.next_group(topology.group_of_layer(layer))
    return topology.attention_rank(group, topology.attention_role(rank)[1])


def _minimum_rows(topology: Topology, rank: int, layer: int, idx_NK: torch.Tensor,
                  end: int | None = None) -> int | None:
    """The rows a source's sparse DISPATCH of `layer` sends to other ranks than `end` (default the
    source; the combining rank for COMBINE and COMBINE_GRAD): per token the distinct expert ranks
    serving its pairs but `end` (None where a replica splits this source's rows)."""
    dp_index, dp = topology.attention_role(rank)[1], topology.data_parallel
    owners = topology.expert_owners[layer]
    if any(1 < len(who) and dp < len(who) for who in owners):
        return None
    group = topology.expert_groups[topology.group_of_layer(layer)]
    rank_of_E = torch.tensor([group[who[dp_index % len(who)]] for who in owners])  # the owner this source feeds
    return sum(len(set(ranks) - {rank if end is None else end}) for ranks in rank_of_E[idx_NK].tolist())


def _assert_close(got: torch.Tensor, want: torch.Tensor, what) -> None:
    assert torch.linalg.vector_norm(got - want) <= 1e-5 * torch.linalg.vector_norm(want) + 1e-12, what


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_peer_stores_stage_no_message_for_a_peer_and_train_like_send_recv(interpreted, fake_cuda, monkeypatch,
                                                                           layout):
    sd = interpreted("disagmoe.kernels.signal", "disagmoe.kernels.sparse_dispatch", "disagmoe.kernels.fused_return")[1]
    cfg = _config(layout)
    topology = _topology(cfg, layout)
    by_stores = _step(cfg, topology, True, monkeypatch, sd, sd.dispatch_rows)
    by_messages = _step(cfg, topology, False, monkeypatch, sd, by_stores["real_rows"])
    dense = _step(_config(layout, "dense"), topology, False, monkeypatch, sd, by_stores["real_rows"])
    shapes = by_stores["workers"][0].shapes
    assert shapes.pair_rows == (cfg.hop == "pair_rows")
    T, H = shapes.tokens, shapes.hidden
    Q = topology.dispatch_width  # the expert ranks a source serves
    moe_forwards = sum(topology.is_moe(layer) for layer in range(topology.num_layers)) * cfg.micro_batches
    colocated = cfg.mode == "colocated"

    # the nvshmem path stages no message for a peer: only a colocated rank's own one, and gathers no rows
    # ([Q, T, H] for every rank, or [T, H] for one) but a colocated rank's own, dy's neither with pair rows
    sources = topology.data_parallel
    assert by_stores["staged"] == ["staged_message"] * (moe_forwards * sources if colocated else 0)
    assert (Q, T, H) not in by_stores["shapes"] and ((T, H) in by_stores["shapes"]) == colocated
    assert by_messages["staged"] == ["dispatch_messages"] * moe_forwards * sources
    assert (Q, T, H) in by_messages["shapes"], "the send/recv path gathers every rank's rows (the check sees it)"
    assert ((T, H) in by_stores["grad_shapes"]) == colocated and (T, H) in by_messages["grad_shapes"]
    # one launch per DISPATCH and COMBINE_GRAD send (every remote expert rank), per DISPATCH_GRAD send (every
    # remote source) and with partial sums per COMBINE send (every remote destination)
    assert sorted(by_stores["launches"]) == _launches(topology, cfg.micro_batches, shapes.pair_rows)
    assert by_messages["launches"] == []

    # the same step; with dense dispatch the same to rounding
    assert by_stores["grads"].keys() == by_messages["grads"].keys() == dense["grads"].keys() and by_stores["grads"]
    for key, grad in by_stores["grads"].items():
        assert torch.equal(grad, by_messages["grads"][key]), key
        _assert_close(grad, dense["grads"][key], key)
    for got, want_parts, dense_parts in zip(by_stores["losses"], by_messages["losses"], dense["losses"], strict=True):
        assert all(torch.equal(got[k], want_parts[k]) for k in got)
        assert all(abs(got[k] - dense_parts[k]) <= 1e-6 * abs(dense_parts[k]) + 1e-9 for k in got)

    # the dispatch bytes: the routing's minimum over the link (where no replica splits a source's rows), the
    # dense figure beside
    minimum = {rank: 0 for rank in range(topology.world_size)}
    dense_rows = dict(minimum)
    for rank, layer, idx_NK in by_stores["routed"]:
        rows = _minimum_rows(topology, rank, layer, idx_NK)
        minimum[rank] = None if rows is None or minimum[rank] is None else minimum[rank] + rows
        dense_rows[rank] += len(set(topology.served(layer, topology.attention_role(rank)[1])) - {rank}) * T
    assert len(by_stores["routed"]) == moe_forwards * sources
    for rank in {rank for rank, _, _ in by_stores["routed"]}:
        got = by_stores["traffic"][rank]
        if minimum[rank] is not None:
            assert got["dispatch"] == minimum[rank] * shapes.dispatch_row_bytes(True)
        assert got["dispatch_dense"] == dense_rows[rank] * shapes.dispatch_row_bytes(False)
        assert got == by_messages["traffic"][rank]
        if Q > 1:  # one expert rank per set: every token goes there either way, sparse with its index
            assert got["dispatch"] < got["dispatch_dense"]

    # every sparse hop message's bytes, summed over the ranks: the routing's minimum (where no replica splits a
    # source's rows) with the dense figure beside; COMBINE with pair rows is the pair-row message, not counted
    counted = [Payload.DISPATCH, Payload.COMBINE_GRAD, Payload.DISPATCH_GRAD] + ([] if shapes.pair_rows
                                                                                 else [Payload.COMBINE])
    ends = {Payload.DISPATCH: False, Payload.DISPATCH_GRAD: False, Payload.COMBINE: True, Payload.COMBINE_GRAD: True}
    for payload in counted:
        least, dense_total = 0, 0
        for rank, layer, idx_NK in by_stores["routed"]:
            end = _combining_rank(topology, rank, layer) if ends[payload] else rank
            rows = _minimum_rows(topology, rank, layer, idx_NK, end)
            least = None if rows is None or least is None else least + rows
            dense_total += len(set(topology.served(layer, topology.attention_role(rank)[1])) - {end}) * T
        got = {name: sum(t.get(name, 0) for t in by_stores["traffic"]) for name in (payload.value,
                                                                                    f"{payload.value}_dense")}
        if least is not None:
            assert got[payload.value] == least * shapes.row_bytes(payload, True), payload
        assert got[f"{payload.value}_dense"] == dense_total * shapes.row_bytes(payload, False), payload
        if Q > 1 and least is not None:
            assert got[payload.value] < got[f"{payload.value}_dense"], payload
    assert all("combine" not in t for t in by_stores["traffic"]) == shapes.pair_rows
