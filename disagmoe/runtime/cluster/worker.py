"""The training actor: one per rank; runs its schedule program for a whole step per driver call.

    setup(cfg, topology)       build the rank's model part, optimizer, data, transport, groups
    train_step(step, lr, trace)    run the program (compute ops, sends, receives), then the
                               optimizer step; return this rank's metrics and trace spans
    evaluate(batches)          the program's forward ops on validation batches, no gradients
    save_shard(dir) / load(dir)    checkpoint shards in the layout-independent format

The optimizer step, as in the oracle: wait for every send, all-reduce (sum) the replicated
parameters' gradients within the data-parallel group and replicated experts' gradients among their
owners (`runtime.stages.replicas`), clip every gradient by the global norm
(sum of squares all-reduced once over all ranks, replicated parameters counted once), AdamW at the
driver's learning rate, then the router-bias update from the step's expert loads summed over
micro-batches and data-parallel ranks.

Precision fp8 (`setup_fp8`): every rank holding experts runs them in FP8 with its own `Fp8Stats`,
refreshes their FP8 weight copies at the start of every step (after the last optimizer step) and
before an evaluation, as `mode: single` does. The step's counters of every rank travel in the
global norm's one all-ranks sum (`kernels.fp8_stats.pack_for_sum`: counts summed, each kind's amax
the max over ranks), so every rank holds the same step counters and takes the same skip of its
optimizer update where any rank's quantisers met an inf or NaN (a skip on some ranks only would
make replicas diverge); they reach the driver with the step's one read.

A backward op returns the weight-gradient work it held back (`kernels.deferral.deferred_weight_grads`:
the attention side's projections, the Triton experts); the worker issues the op's sends (its
input gradients), then runs that work as an `AttentionWeightGrad` / `ExpertWeightGrad` span
before the next op that is not a send.

Collectives run on their own process groups, never on the default group the `local` transport
uses for point-to-point messages, so collective and message tags cannot collide.
"""

from __future__ import annotations

import contextlib
import functools
import re
import time
from contextlib import AbstractContextManager
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disagmoe.comm import make_transport
from disagmoe.comm.base import SendHandle, check_specs
from disagmoe.wire import Direction, message_key, Payload, Recv, Send
from disagmoe.config import FP8_DENSE_SCALING, TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.data import TokenDataset, load_splits
from disagmoe.runtime.stages.attention_stage import AttentionStage
from disagmoe.runtime.cluster.cluster import Worker
from disagmoe.runtime.cluster.sharing import stream_sum_width, wait_timeout_s
from disagmoe.runtime.stages.expert_stage import ExpertStage
from disagmoe.runtime.observe.gpu_spans import GpuSpans
from disagmoe.runtime.observe.metrics import no_host_syncs, out_of_memory_hint, peak_memory_gib
from disagmoe.runtime.activation_memory import pairs_wgrads
from disagmoe.runtime.stages.messages import Mailbox, MessageShapes, receive_layouts
from disagmoe.runtime.stages.pair_return import PairHop
from disagmoe.model.experts import first_touch_params
from disagmoe.model.layers import set_fusion
from disagmoe.model.loss import set_fused_loss
from disagmoe.kernels.fp8_stats import Fp8Stats, pack_for_sum, reduced_nonfinite_flag, unpack_sum
from disagmoe.kernels.tile_configs import expert_loads, loads_of_routing, set_expert_loads
from disagmoe.kernels.wgrad_pairs import launches_waiting, paired_weight_grads, run_waiting
from disagmoe.runtime.state.flat_adamw import FlatAdamW, Shard, flat_squares
from disagmoe.runtime.rank_model import compute_dtype, offload_bucket_bytes, rank_model
from disagmoe.runtime.stages.replicas import ExpertReplicas
from disagmoe.runtime.schedule.recv_slots import slot_plan
from disagmoe.runtime.schedule.schedule import (
    AttentionBackward,
    AttentionForward,
    ExpertBackward,
    ExpertForward,
    Loss,
    Op,
    OptimizerStep,
    ReduceGradients,
)
from disagmoe.runtime.state.sharded_checkpoint import Listing, load_rank_state, rank_shard, write_shard
from disagmoe.runtime.topology import Topology
from disagmoe.runtime.observe.trace import SpanRecorder
from disagmoe.runtime.cluster.watchdog import OpWatchdog
from disagmoe.runtime.training.trainer import check_fp8_device, resolve_dense_fp8, set_dense_fp8
from disagmoe.runtime.rank_graphs import resolve_rank_graphs
from disagmoe.runtime.training.graphed_step import PhasedGraphs, is_capturing

REPLICATED, EXPERTS = "replicated", "experts"  # FlatAdamW buckets: all-reduced over data parallel, or not


_LAYER = re.compile(r"^layers\.(\d+)\.")


def reduce_bucket(name: str, num_layers: int) -> str:
    """A parameter's FlatAdamW bucket: its experts', or the replicated parameters of the layer whose
    last backward completes its gradient (`ReduceGradients`): `layers.<l>.*` -> l, the embedding
    -> 0 (its last use, tied or not), the final norm and LM head -> num_layers."""
    if ".moe.experts." in name:
        return EXPERTS
    match = _LAYER.match(name)
    key = int(match.group(1)) if match else 0 if name.startswith("embed.") else num_layers
    return f"{REPLICATED}.{key}"


def setup_fp8(model: Any, topology: Topology, rank: int, precision: str, device: torch.device,
              dense_precision: str = "bf16", backward: str | None = None, forward: str | None = None,
              emulate: bool = False, gluon: bool = False, dense_scaling: str | None = None,
              gluon_tma_store: bool = False, gluon_block_m: int | None = None) -> Fp8Stats | None:
    """precision fp8: the routed experts held here run in FP8 (`set_expert_precision`, refused on a
    GPU without FP8 tensor cores; their backward's and forward's GEMMs as `backward` and `forward`
    say, None: the defaults), and with `dense_precision` fp8 (`TrainConfig.fp8_dense`) an
    attention rank's dense projections too (`trainer.set_dense_fp8`, scaled `dense_scaling`,
    `TrainConfig.dense_fp8_scaling`; None: `FP8_DENSE_SCALING`); both count into one new
    `Fp8Stats`, returned. `emulate` (`TrainConfig.fp8_emulate`): both emulated (quantise-dequantise
    into higher-precision GEMMs). `gluon` (`TrainConfig.expert_gluon`): the experts' row GEMMs in the
    Gluon kernels (`fp8_ffn.set_gluon`), storing by TMA with `gluon_tma_store`
    (`TrainConfig.expert_gluon_tma_store`), at `gluon_block_m` rows a tile (`TrainConfig.expert_gluon_block_m`). None where nothing here runs in FP8 (nothing of its model
    changes)."""
    experts = precision == "fp8" and topology.expert_role(rank) is not None
    dense = dense_precision == "fp8" and topology.attention_role(rank) is not None
    if not (experts or dense):
        return None
    if device.type == "cuda":
        check_fp8_device(device)
    stats = Fp8Stats(device)
    if experts:
        from disagmoe.kernels.fp8_ffn import set_gluon

        model.set_expert_precision("fp8", backward, forward, emulate)
        set_gluon(gluon, gluon_tma_store, gluon_block_m)  # process-wide (`fp8_ffn._gluon`): every FP8 expert rank
    if dense:
        set_dense_fp8(model, stats, dense_scaling or FP8_DENSE_SCALING, emulate, device)
    model.set_fp8_stats(stats)
    return stats


def _rows_of(remote: list[int], ranks: tuple[int, ...], *tensors_Q: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The rows of `tensors_Q` (one per rank of `ranks`) of the `remote` ranks, in their order: all
    of them, or (colocated: this rank's own row out) by slices, no index from the host."""
    if remote == list(ranks):
        return tensors_Q
    rows = [ranks.index(peer) for peer in remote]
    return tuple(torch.cat([t[i:i + 1] for i in rows]) for t in tensors_Q)


def _op_name(op: Op) -> str:
    """A span name: e.g. 'AttentionForward L1 mb0', 'Recv dispatch L2 mb1'."""
    if isinstance(op, (Send, Recv)):
        return f"{type(op).__name__} {op.payload.value} L{op.layer} mb{op.micro_batch}"
    if isinstance(op, Loss):
        return f"Loss mb{op.micro_batch}"
    if isinstance(op, OptimizerStep):
        return "OptimizerStep"
    if isinstance(op, ReduceGradients):
        return f"ReduceGradients L{op.layer}"
    return f"{type(op).__name__} L{op.layer} mb{op.micro_batch}"


class TrainWorker(Worker):
    """A rank of a disaggregated or colocated run (see the module docstring)."""

    def setup(self, cfg_data: dict[str, Any], topology: Topology) -> None:
        """Build this rank's part of a run; a second call replaces the first (warm actors, new run)."""
        self._release()
        cfg = TrainConfig.model_validate(cfg_data)
        if topology.attention_role(self.rank) is not None:  # its dense projections run here: bf16 where the
            cfg = resolve_dense_fp8(cfg, self.device)  # default FP8 recipe cannot (`info` tells the driver)
        self.cfg, self.topology = cfg, topology
        self.model_cfg = load_model(cfg.model)
        if cfg.cpu_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(cfg.cpu_threads)
        self.program = topology.programs(cfg.micro_batches)[self.rank]
        wait_s = wait_timeout_s(cfg)  # recv_timeout_s, scaled where ranks time-slice a GPU
        self.world_group, self.dp_group = self._collective_groups(topology, wait_s)
        self.shapes = MessageShapes.of_run(cfg, self.model_cfg, topology)
        sum_width = stream_sum_width(cfg, topology)
        self.sums_on_stream = sum_width > 0  # the gradient norm (and FP8 counters) over the arena, not gloo
        self.transport = make_transport(cfg.transport, wait_s, topology.rank_pairs(cfg.micro_batches),
                                        layouts=receive_layouts(cfg, self.shapes, topology, sum_width)
                                        if cfg.transport == "nvshmem" else None)
        attention = topology.attention_role(self.rank)
        pair = PairHop.of(cfg) if self.shapes.pair_rows else None
        set_fusion(cfg.fuse_elementwise)
        set_fused_loss(cfg.fused_loss)
        set_expert_loads(loads_of_routing(cfg.routing))  # the expert tiles tuned for its loads
        self.model = rank_model(self.model_cfg, cfg.experts_backend, topology, self.rank).materialise(
            self.device, cfg.seed)
        self.model.set_routing(cfg.routing)
        self.model.set_recompute(cfg.recompute_set)
        self.fp8 = cfg.expert_precision == "fp8"  # every rank then sums the step's FP8 counters
        self.fp8_stats = setup_fp8(self.model, topology, self.rank, cfg.expert_precision, self.device,
                                   cfg.dense_precision, cfg.expert_backward_precision,
                                   cfg.expert_forward_precision, cfg.fp8_emulate, cfg.expert_gluon,
                                   cfg.dense_fp8_scaling, cfg.expert_gluon_tma_store, cfg.expert_gluon_block_m)
        bucket_of = functools.partial(reduce_bucket, num_layers=topology.num_layers)
        shards = {}
        if cfg.optim.shard_states and attention is not None and topology.data_parallel > 1:
            shard = Shard(self.dp_group, attention[1], topology.data_parallel)
            shards = {base: shard for base in {bucket_of(n) for n, _ in self.model.named_parameters()}
                      if base != EXPERTS}
        self.optimizer = FlatAdamW(self.model.named_parameters(), cfg.optim, compute_dtype(cfg),
                                   bucket_of=bucket_of, shards=shards, offload_bucket_bytes=offload_bucket_bytes(cfg),
                                   first_touch=first_touch_params(self.model))
        self._reductions: list[tuple[str, Any]] = []  # (bucket name, work) of this step's started sums
        self.replicas = ExpertReplicas(self.model, topology, self.rank)
        self.attention, self.val_data = None, None
        if attention is not None:
            splits = load_splits(cfg.data, self.model_cfg.vocab_size, cfg.seq_len)
            data = TokenDataset(splits.train, cfg.seq_len, cfg.batch_size, cfg.data_seed, "train")
            if splits.val is not None:
                self.val_data = TokenDataset(splits.val, cfg.seq_len, cfg.batch_size, cfg.data_seed, "val")
            self.attention = AttentionStage(self.model, topology, self.rank, data, cfg.micro_batches,
                                            pair=pair, sparse=self.shapes.sparse)
            self.attention.wait_span = self._gpu_wait_span
        self.experts = (ExpertStage(self.model, topology, self.rank, pair=pair, tokens=self.shapes.tokens,
                                    sparse=self.shapes.sparse) if topology.expert_role(self.rank) else None)
        # the expert weight gradients over pairs of micro-batches (`kernels.wgrad_pairs`; the driver resolved auto)
        self.pairs_wgrads = self.experts is not None and pairs_wgrads(cfg, self.shapes.pair_rows)
        # every receive buffer now, sized by the run's fixed message specs; keys whose lifetimes do
        # not overlap share a slot (`recv_slots`); pair rows land in the transport's own buffers
        slots = slot_plan(self.program, self.rank, topology.is_moe, topology.num_layers, skip=self._is_pair)
        for (peer, payload, layer, mb), (pool, index) in slots.slot.items():
            key = message_key(0, Payload(payload), layer, mb)
            self.transport.reserve(peer, key, self.shapes.specs(Payload(payload), pool[2]), slot=(pool, index))
        if self._peer_stores() and self.device.type == "cuda":  # compile the dispatch kernel now, not mid-step
            from disagmoe.kernels.sparse_dispatch import warm_up

            rows, _, w, *_ = self.shapes.specs(Payload.DISPATCH, True)
            drows, *dw, _ = self.shapes.specs(Payload.DISPATCH_GRAD, True)  # pair rows: no d w
            for sources in self._source_counts():  # the return's block count is specialised: each one's variant
                warm_up(self.shapes.tokens, self.shapes.hidden, self.shapes.top_k, rows.dtype, w.dtype, drows.dtype,
                        dw[0].dtype if dw else None, self.device, sources=sources)
            peers = {peer for op in self.program if isinstance(op, Send) and self._is_peer_stored(op)
                     for peer in op.peers if peer != self.rank}
            self.transport.map_peers(sorted(peers))  # the peer views the launches store into, taken now
        self.recorder = SpanRecorder()
        self.gpu_spans = GpuSpans(self.device) if self.device.type == "cuda" else None
        self.watchdog = OpWatchdog(f"rank {self.rank} ({topology.describe(self.rank)})", wait_s)
        captured, _ = resolve_rank_graphs(cfg, topology)  # `on` where it cannot apply: refused, with the fix
        self.graphs = PhasedGraphs(self.transport, self.device) if captured else None

    def _source_counts(self) -> list[int]:
        """The distinct counts of sources this rank's MoE layers serve ([1] without experts)."""
        if self.experts is None:
            return [1]
        return sorted({len(sources) for sources in self.experts.sources.values()}) or [1]

    def _peer_stores(self) -> bool:
        """Whether sparse dispatches go by the transport's peer stores (nvshmem, `dispatch: sparse`)."""
        shapes = getattr(self, "shapes", None)  # a worker whose set-up stopped short (tests) has none
        return bool(shapes is not None and shapes.sparse and hasattr(getattr(self, "transport", None), "send_sparse"))

    def _is_peer_stored(self, op: Send) -> bool:
        """A Send whose message the transport's peer stores deliver (`MessageShapes.is_peer_stored`)."""
        return self.shapes.is_peer_stored(op.payload, self.topology.is_moe(op.layer))

    def info(self) -> dict[str, Any]:
        """The base's facts, with the transport, hop and dispatch this rank really runs once set up,
        where it holds attention the dense projections' precision (`trainer.resolve_dense_fp8`), and where it holds
        experts the loads its expert launches read their tiles for (`tile_configs.set_expert_loads`)."""
        facts = super().info()
        if getattr(self, "transport", None) is not None:
            facts.update(transport=self.transport.kind,
                         hop="pair_rows" if self.shapes.pair_rows else "partial_sums",
                         dispatch="sparse" if self.shapes.sparse else "dense")
            if self.topology.attention_role(self.rank) is not None:
                facts.update(dense_precision=self.cfg.dense_precision)
            if self.topology.expert_role(self.rank) is not None:  # the loads its expert tiles were tuned for
                facts.update(expert_loads=expert_loads())
        return facts

    def _collective_groups(self, topology: Topology, timeout_s: float) -> tuple[Any, Any]:
        """The all-ranks group, this rank's data-parallel group and the groups of owners of
        replicated experts it belongs to (every rank creates every group, in one order)."""
        timeout = timedelta(seconds=timeout_s)
        world = dist.new_group(list(range(topology.world_size)), timeout=timeout)
        self._groups = [world]
        mine = None
        for ranks in topology.attention_groups:
            group = dist.new_group(list(ranks), timeout=timeout)
            if self.rank in ranks:
                mine = group
                self._groups.append(group)
        self.replica_groups = {}
        for ranks in topology.replica_groups():
            group = dist.new_group(list(ranks), timeout=timeout)
            if self.rank in ranks:
                self.replica_groups[ranks] = group
                self._groups.append(group)
        self._connect_groups()
        return world, mine

    def _connect_groups(self) -> None:
        """One tiny all-reduce on each of this rank's groups, in the order every rank created them:
        NCCL builds a communicator at its first collective, blocking the host until every member
        arrives, which inside a step could wait on a peer whose GPU waits on this rank's sends."""
        token = torch.zeros(1, device=self.device)
        for group in self._groups:
            dist.all_reduce(token, group=group)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- one step --------------------------------------------------------------------------------

    def train_step(self, step: int, lr: float, trace: bool) -> dict[str, Any]:
        """Run this rank's program for `step`; returns its metrics and (if `trace`) its spans. A CUDA
        out-of-memory error comes back as one line naming the knobs (`metrics.OutOfMemory`)."""
        with out_of_memory_hint(self.cfg, f"rank {self.rank} ({self.topology.describe(self.rank)})"):
            return self._train_step(step, lr, trace)

    def _train_step(self, step: int, lr: float, trace: bool) -> dict[str, Any]:
        self.recorder.enabled = trace
        if self.gpu_spans is not None:
            self.gpu_spans.begin_step()
        start = time.perf_counter()
        self.optimizer.set_lr(lr)  # the step's only host value of the lr, into the optimizer's device scalar
        self.transport.traffic.reset()  # an evaluation's messages are no step's (in place: a replay adds to them)
        with no_host_syncs(self.cfg.forbid_host_syncs, self.device):
            if self.graphs is None:
                result, replayed = self._step_body(step), False
            else:
                result, replayed = self._graphed_step(step)
        spans, compute_s = self._drain_spans()
        result.update(self._read_step(result), rank=self.rank, compute_s=compute_s,
                      gpu_wait_s=self.recorder.drain_waits(),
                      step_s=time.perf_counter() - start, spans=spans, cuda_graph=replayed,
                      peak_memory_gib=peak_memory_gib(self.device))
        return result

    def _step_body(self, step: int, staged: bool = False) -> dict[str, Any]:
        """The rank's step on the device: its program and the optimizer step; returns the device
        tensors the step's one read takes (`_read_step`), the attention side's loss shares among them.
        `staged`: the step's tokens are already in the attention stage's static buffer (`stage_tokens`)."""
        self.optimizer.zero_grad()
        if self.attention is not None:
            self.attention.begin_step(step, staged=staged)
        if self.experts is not None:
            self.experts.begin_step()
        mail = Mailbox(self.rank, self._peer_stores())
        handles: list[SendHandle] = []
        result: dict[str, Any] = {}
        self._held_back = ("", [])
        capturing = is_capturing(self.device)
        self.model.prepare_fp8()  # FP8 weight copies (experts, dense projections) from the last update
        with paired_weight_grads(self.pairs_wgrads):  # a launch waits for the next micro-batch's into its main gradient
            for op in self.program:
                if not isinstance(op, Send):
                    self._run_held_back(step)
                if isinstance(op, OptimizerStep):
                    self._run_waiting_weight_grads(step)  # watched as its own op (the watchdog's ops do not nest)
                with self.watchdog.op(f"step {step + 1}: {_op_name(op)}"):
                    if isinstance(op, OptimizerStep):
                        with self.recorder.span("wait for sends", "wait"):
                            for handle in handles:
                                handle.wait()
                        with self._compute_span(_op_name(op)):
                            result = self._optimizer_step()
                    else:
                        self._run(op, step, mail, handles)
                        if not capturing:  # an event query is no capturable work; a graph keeps its buffers anyway
                            handles[:] = [h for h in handles if not h.is_completed()]  # delivered: release buffers
        assert mail.empty(), f"rank {self.rank}: messages left over after step {step}"
        if self.attention is not None:
            result["loss_parts"] = dict(self.attention.loss_parts)
        return result

    def _graphed_step(self, step: int) -> tuple[dict[str, Any], bool]:
        """The step through `PhasedGraphs` (eager, captured, or replayed; `runtime.rank_graphs`): the
        tokens copied into the static buffer first, timed as one span (per-op spans mean nothing in a
        replay); a captured step's Python counters put back, a replay's advanced."""
        if self.attention is not None:
            self.attention.stage_tokens(step)
        taken = self.optimizer.steps_taken

        def captured() -> None:
            self.optimizer.steps_taken = taken  # capture ran nothing: the replay that follows is the step

        with self._whole_step_span(f"step {step + 1}"):
            result, replayed = self.graphs(lambda: self._step_body(step, staged=True), on_capture=captured)
        if replayed:
            self.optimizer.steps_taken = taken + 1
            if self.attention is not None:
                self.attention.loss_parts = result["loss_parts"]  # the graph's tensors, which this replay wrote
        return dict(result), replayed

    def _read_step(self, result: dict[str, Any]) -> dict[str, Any]:
        """The step's device-side figures to the host, once: grad norm, loss shares, expert loads
        (and, precision fp8, the step's FP8 counters of every rank, `_global_sums`; this rank's own
        are reset after the read for the next step)."""
        parts = result.pop("loss_parts", {})
        load_LE = result["expert_load"]
        status = self.transport.status_word()
        traffic = self.transport.traffic
        scalars = torch.stack([result["grad_norm"], *(v.float() for v in parts.values())]).double()
        loads = load_LE.flatten().double() if load_LE is not None else scalars.new_zeros(0)  # exact below 2^53
        sent = traffic.words().double()  # bytes: exact below 2^53
        tail = status.double() if status is not None else scalars.new_zeros(0)
        fp8_LF = result.get("fp8")
        fp8 = fp8_LF.flatten().double() if fp8_LF is not None else scalars.new_zeros(0)  # counts, fp32 bits
        values = torch.cat([scalars, loads, sent, fp8, tail]).tolist()  # the one read
        if self.fp8_stats is not None:
            self.fp8_stats.reset()  # after the read: the next step's quantisers count from zero
        if status is not None:
            self.transport.check_status([int(v) for v in values[len(values) - tail.numel():]])
            del values[len(values) - tail.numel():]
        read: dict[str, Any] = {}
        if fp8_LF is not None:
            read["fp8"] = [int(v) for v in values[len(values) - fp8.numel():]]
            del values[len(values) - fp8.numel():]
        read["traffic"] = dict(zip(traffic.names, map(int, values[len(values) - sent.numel():])))
        del values[len(values) - sent.numel():]
        read["grad_norm"] = values[0]
        if parts:
            read["loss_parts"] = dict(zip(parts, values[1:1 + len(parts)], strict=True))
        if load_LE is None:
            read["expert_load"] = {}
        else:
            flat = [int(v) for v in values[1 + len(parts):]]
            E = load_LE.shape[1]
            read["expert_load"] = {layer: flat[i * E:(i + 1) * E] for i, layer in enumerate(sorted(self.attention.load_LE))}
        return read

    @torch.no_grad()
    def evaluate(self, batches: int) -> dict[str, Any]:
        """The forward ops only (no gradients) over the first `batches` validation batches;
        returns this rank's share of the summed per-batch mean CE (attention ranks). Eager, also
        under CUDA graphs: its messages move the transport's counts, which the next captured step
        realigns before it replays (`PhasedGraphs`); each batch's status read waits for this
        rank's stream, so no reader of an evaluation message is still at work by then."""
        forward = [op for op in self.program if isinstance(op, (AttentionForward, ExpertForward, Loss))
                   or (isinstance(op, (Send, Recv)) and op.payload.direction is Direction.FORWARD)]
        ce = 0.0
        if self.fp8_stats is not None:  # FP8 here: the weights' copies as the last update left them
            self.model.prepare_fp8()
        for batch in range(batches):
            if self.attention is not None:
                self.attention.begin_step(batch, self.val_data)
            if self.experts is not None:
                self.experts.begin_step()
            if self.gpu_spans is not None:
                self.gpu_spans.begin_step()
            mail, handles = Mailbox(self.rank, self._peer_stores()), []
            for op in forward:
                with self.watchdog.op(f"evaluation batch {batch}: {_op_name(op)}"):
                    if isinstance(op, Loss):
                        with self._compute_span(_op_name(op)):
                            self.attention.loss(op.micro_batch, mail, backward=False)
                    else:
                        self._run(op, batch, mail, handles)
            with self.watchdog.op(f"evaluation batch {batch}: wait for sends"):
                for handle in handles:
                    handle.wait()
            if self.attention is not None:
                ce += float(self.attention.loss_parts["ce"])
            status = self.transport.status_word()
            if status is not None:  # a message that did not fit or never came spoils this batch's loss
                self.transport.check_status([int(v) for v in status.tolist()])
        self._drain_spans()  # evaluation time is not part of any step's trace, busy or wait fraction
        self.recorder.drain_waits()
        if self.fp8_stats is not None:
            self.fp8_stats.reset()  # the evaluation's quantisations are no step's
        return {"rank": self.rank, "ce": ce}

    def _is_pair(self, op: Op) -> bool:
        """A Send / Recv of a pair-row message (`hop: pair_rows`)."""
        return self.shapes.is_pair(op.payload, self.topology.is_moe(op.layer))

    def _pair_spec(self, payload: Payload, layer: int, receiver: int):
        """The pair-row message of (payload, layer) that lands on attention rank `receiver`: written by
        the expert ranks that rank serves (`Topology.served`, its Recv's peers)."""
        role = self.topology.attention_role(receiver)
        assert role is not None, f"rank {receiver} runs no attention"
        return self.shapes.pair_spec(payload, self.topology.served(layer, role[1]))

    def _aim_pairs(self, op: ExpertForward | ExpertBackward, step: int, mail: Mailbox) -> None:
        """Before an expert op of pair rows: where each receiver's rows go (`Transport.pair_target`):
        the forward's to the next group's attention ranks, the backward's d x (with the load) to
        the sources."""
        forward = isinstance(op, ExpertForward)
        payload = Payload.COMBINE if forward else Payload.DISPATCH_GRAD
        if not self.shapes.is_pair(payload, True):  # sparse: d x goes back per source, not as pair rows
            return
        key = message_key(step, payload, op.layer, op.micro_batch)
        extras = () if forward else (self.experts.load_of(op.layer, op.micro_batch, mail),)
        for dst in (self.experts.destinations if forward else self.experts.sources)[op.layer]:
            spec = self._pair_spec(payload, op.layer, dst)
            mail.aim(payload, op.layer, op.micro_batch, dst, self.transport.pair_target(dst, key, spec, extras))

    def _run_pairs(self, op: Send | Recv, step: int, mail: Mailbox, handles: list[SendHandle]) -> None:
        """The Send and Recv of a pair-row message: the rows were stored by the ExpertForward's
        kernel (a one-sided transport's delivery; otherwise `pair_send` sends them), and the
        receiver takes a view whose flags its combine waits on."""
        key = message_key(step, op.payload, op.layer, op.micro_batch)
        if isinstance(op, Send):
            with self.recorder.span(_op_name(op), "send"):
                for peer in op.peers:
                    target = mail.release_target(op.payload, op.layer, op.micro_batch, peer)
                    if peer != self.rank:
                        handle = self.transport.pair_send(peer, key, target)
                        if handle is not None:
                            handles.append(handle)
            return
        with self.recorder.span(_op_name(op), "wait"):  # a view; the GPU waits in the combine (`wait_span`)
            mail.land(op.payload, op.layer, op.micro_batch,
                      self.transport.pair_landing(key, self._pair_spec(op.payload, op.layer, self.rank)))

    def _run(self, op: Op, step: int, mail: Mailbox, handles: list[SendHandle]) -> None:
        if isinstance(op, (Send, Recv)) and self._is_pair(op):
            self._run_pairs(op, step, mail, handles)
            return
        if isinstance(op, Send) and mail.peer_stores and self._is_peer_stored(op):
            with self.recorder.span(_op_name(op), "send"):
                self._send_by_peer_stores(op, step, mail, handles)
            return
        if isinstance(op, Send):
            with self.recorder.span(_op_name(op), "send"):
                for peer in op.peers:
                    if peer != self.rank:  # to itself: already delivered by `Mailbox.post`
                        key = message_key(step, op.payload, op.layer, op.micro_batch)
                        tensors = mail.outgoing(op.payload, op.layer, op.micro_batch, peer)
                        check_specs(tensors, self.shapes.specs(op.payload, self.topology.is_moe(op.layer)),
                                    f"rank {self.rank}: {_op_name(op)} to rank {peer}")  # metadata only
                        handles.append(self.transport.send(peer, key, tensors))
                        if self.shapes.is_counted(op.payload, self.topology.is_moe(op.layer)):
                            self._count(op.payload, mail.live_rows(op.payload, op.layer, op.micro_batch, peer))
            return
        if isinstance(op, ReduceGradients):
            with self.recorder.span(_op_name(op), "send"):
                self._start_reduction(f"{REPLICATED}.{op.layer}")
            return
        if isinstance(op, Recv):
            with self.recorder.span(_op_name(op), "wait"):
                for peer in op.peers:
                    if peer == self.rank:
                        assert mail.has(op.payload, op.layer, op.micro_batch, peer)
                        continue
                    key = message_key(step, op.payload, op.layer, op.micro_batch)
                    specs = self.shapes.specs(op.payload, self.topology.is_moe(op.layer))
                    with self._gpu_wait_span(_op_name(op)):
                        tensors = self.transport.recv(peer, key, specs)
                    mail.deliver(op.payload, op.layer, op.micro_batch, peer, tensors)
            return
        with self._compute_span(_op_name(op)):
            if isinstance(op, AttentionForward):
                self.attention.forward(op.layer, op.micro_batch, mail)
            elif isinstance(op, ExpertForward):
                if self.shapes.pair_rows:
                    self._aim_pairs(op, step, mail)
                self.experts.forward(op.layer, op.micro_batch, mail)
            elif isinstance(op, Loss):
                self.attention.loss(op.micro_batch, mail)
            elif isinstance(op, ExpertBackward):
                if self.shapes.pair_rows:
                    self._aim_pairs(op, step, mail)
                self._held_back = (f"ExpertWeightGrad L{op.layer} mb{op.micro_batch}",
                                   self.experts.backward(op.layer, op.micro_batch, mail))
            elif isinstance(op, AttentionBackward):
                self._held_back = (f"AttentionWeightGrad L{op.layer} mb{op.micro_batch}",
                                   self.attention.backward(op.layer, op.micro_batch, mail))
            else:
                raise AssertionError(f"unknown op {op!r}")

    def _send_by_peer_stores(self, op: Send, step: int, mail: Mailbox, handles: list[SendHandle]) -> None:
        """A sparse DISPATCH, COMBINE (partial sums), COMBINE_GRAD or DISPATCH_GRAD on nvshmem: one
        launch for every remote peer stores only the live rows into the peers' segments
        (`NvshmemTransport.send_sparse`, `send_counted`), from what the stages stashed; they stage no
        message for a remote peer (a colocated rank's own message is already delivered by `Mailbox.post`)."""
        key = message_key(step, op.payload, op.layer, op.micro_batch)
        slot = (op.payload, op.layer, op.micro_batch)
        remote = [peer for peer in op.peers if peer != self.rank]
        if not remote:  # stashed only where a peer is remote (the stages' `stash`)
            return
        if op.payload is Payload.DISPATCH:
            x_TH, picked_QT, local_QTK, w_TK, load_E, count_Q1, ranks = mail.unstash(slot)
            picked_RT, local_RTK = _rows_of(remote, ranks, picked_QT, local_QTK)
            handles.append(self.transport.send_sparse(remote, key, x_TH, picked_RT, local_RTK, w_TK, [load_E]))
        elif op.payload is Payload.COMBINE_GRAD:  # dy of the tokens each expert rank served (`_post_routed_grad`)
            dy_TH, picked_QT, count_Q1, ranks = mail.unstash(slot)
            handles.append(self.transport.send_sparse(remote, key, dy_TH, *_rows_of(remote, ranks, picked_QT)))
        elif op.payload is Payload.COMBINE:  # the partial sums of the rows each source sent, their index
            partial_DTH, index_DT, count_Q1, ranks = mail.unstash(slot)
            handles.append(self.transport.send_counted(remote, key, partial_DTH, None, count_Q1, [], index_ST=index_DT,
                                                       blocks=[ranks.index(peer) for peer in remote]))
        else:  # DISPATCH_GRAD: d x (d w) of the rows each source sent (block d of the expert rank's sources), its load
            dx_DTH, dw_DTK, count_Q1, load_E, ranks = mail.unstash(slot)
            handles.append(self.transport.send_counted(remote, key, dx_DTH, dw_DTK, count_Q1, [load_E],
                                                       blocks=[ranks.index(peer) for peer in remote]))
        for peer in remote:
            self._count(op.payload, count_Q1[ranks.index(peer)])

    def _count(self, payload: Payload, count_1: torch.Tensor | None) -> None:
        """The bytes of one MoE layer's message to another rank (`comm.base.Traffic`): sparse, its
        first count rows (`count_1`, a device tensor [1]), else all T, beside the dense dispatch's T
        rows of the same payload (`MessageShapes.row_bytes`)."""
        T = self.shapes.tokens
        dense = T * self.shapes.row_bytes(payload, False)
        live = dense if count_1 is None else count_1.long() * self.shapes.row_bytes(payload, True)
        self.transport.traffic.add(payload.value, live, dense)

    def _run_held_back(self, step: int) -> None:
        """The weight-gradient work the last backward op held back (`deferred_weight_grads`), as
        its own compute span, now that the sends after that op (its input gradients) are issued:
        before the next op that is not a send, so before any `ReduceGradients` or `OptimizerStep`
        reads those gradients, and before a receive waits for a peer."""
        span, work = self._held_back
        self._held_back = ("", [])
        if not work:
            return
        with self.watchdog.op(f"step {step + 1}: {span}"), self._compute_span(span):
            for item in work:
                item()

    def _run_waiting_weight_grads(self, step: int) -> None:
        """The expert weight-gradient launches still waiting for a partner (an odd micro-batch count's last,
        `kernels.wgrad_pairs`), each alone, as their own compute span: before the optimizer step reads the
        main gradients (only it does: the expert buckets are never in a `ReduceGradients`)."""
        if launches_waiting():
            with self.watchdog.op(f"step {step + 1}: ExpertWeightGrad (unpaired)"), \
                    self._compute_span("ExpertWeightGrad (unpaired)"):
                run_waiting()

    def _compute_span(self, name: str) -> AbstractContextManager[None]:
        """A compute op's span: its GPU execution (CUDA events, no waiting) or, on CPU, its wall time.
        Under CUDA graphs the whole step is one span instead (`_whole_step_span`)."""
        if getattr(self, "graphs", None) is not None:
            return contextlib.nullcontext()
        return self._whole_step_span(name)

    def _whole_step_span(self, name: str) -> AbstractContextManager[None]:
        """A span of GPU execution (CUDA events) or, on CPU, of wall time: under CUDA graphs the
        whole step's, else one compute op's (`_compute_span`)."""
        if self.gpu_spans is not None:
            return self.gpu_spans.span(name)
        return self.recorder.span(name, "compute")

    def _gpu_wait_span(self, name: str) -> AbstractContextManager[None]:
        """On a GPU, how long the stream stands still for a receive (stream-ordered: the events
        around it), a `gpu-wait` span; on a CPU, or under CUDA graphs (no event in a capture), nothing
        (the host span around it says it)."""
        if self.gpu_spans is not None and getattr(self, "graphs", None) is None:
            return self.gpu_spans.span(name, "gpu-wait")
        return contextlib.nullcontext()

    def _drain_spans(self) -> tuple[list[tuple[str, str, float, float]], float]:
        """The step's spans (GPU spans merged in) and its compute seconds."""
        if self.gpu_spans is not None:
            self.recorder.add_gpu_spans(self.gpu_spans.collect())
        return self.recorder.drain()

    def _start_reduction(self, base: str) -> None:
        """Start the data-parallel sum of the buckets of `base` (async; waited in the optimizer step)."""
        for b in self.optimizer.buckets:
            if b.name.rsplit(".", 1)[0] == base and all(name != b.name for name, _ in self._reductions):
                self.optimizer.settle_grads(b)  # first-touch gradients no backward wrote: zeros, not stale
                work = (self.optimizer.reduce_scatter(b, async_op=True) if b.shard is not None
                        else dist.all_reduce(b.grad_N, group=self.dp_group, async_op=True))
                self._reductions.append((b.name, work))

    def _optimizer_step(self) -> dict[str, Any]:
        """Finish the main gradients' sums (those the schedule's `ReduceGradients` started in the
        backward; the rest now), clip by the global norm, step; returns device tensors (the step's
        one read happens in `train_step`)."""
        self.optimizer.settle_grads()  # before the replicas' sums and the norm read the expert gradients
        if self.topology.data_parallel > 1 and self.topology.attention_role(self.rank) is not None:
            for b in self.optimizer.buckets:
                if b.name.startswith(REPLICATED):
                    self._start_reduction(b.name.rsplit(".", 1)[0])
        for _, work in self._reductions:
            work.wait()  # on a GPU the stream waits, not the host
        self._reductions = []
        self.replicas.sum_gradients(self.replica_groups)
        load_LE = self._step_load()
        grad_norm, fp8_LF = self._global_sums()
        max_norm = self.cfg.optim.grad_clip
        coef = torch.clamp(max_norm / (grad_norm + 1e-6), max=1.0) if max_norm > 0 else None
        # precision fp8 on CUDA: an inf or NaN met by any rank's quantisers skips every rank's update
        # on the device (the flag from the summed counters: the same everywhere; the fused AdamW's
        # found_inf); the run stops when the step is read (the loop's `fp8_nonfinite`)
        skip = reduced_nonfinite_flag(fp8_LF) if fp8_LF is not None and self.device.type == "cuda" else None
        self.optimizer.step(clip_coef=coef, skip=skip)  # at the lr `_train_step` set
        for layer, load_E in zip(sorted(self.attention.load_LE) if self.attention else [], load_LE):
            self.model.block(layer).moe.router.update_bias(load_E)
        attention = self.topology.attention_role(self.rank)
        reports_load = attention is not None and attention[1] == 0 and len(load_LE)
        return {"grad_norm": grad_norm, "expert_load": load_LE if reports_load else None, "fp8": fp8_LF}

    def _step_load(self) -> torch.Tensor:
        """[layers held here, E]: the step's expert loads summed over micro-batches and DP ranks
        (layers in ascending order; empty without attention)."""
        if self.attention is None or not self.attention.load_LE:
            return torch.zeros((0, self.model_cfg.num_experts), dtype=torch.int64, device=self.device)
        load_LE = torch.stack([self.attention.load_LE[l] for l in sorted(self.attention.load_LE)])
        if self.topology.data_parallel > 1:
            dist.all_reduce(load_LE, group=self.dp_group)
        return load_LE

    def _global_sums(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Global L2 norm (fp32 device scalar) of the gradients over all ranks, replicas counted
        once: a replicated bucket by data-parallel index 0 (ZeRO-1: every index its slice of the
        sum), experts by their primary owner. Summed over the world group, or on the stream over
        the nvshmem arena where ranks share GPUs (`NvshmemTransport.all_sum`: gloo would wait on
        the host). With precision fp8 the same sum carries every rank's FP8 counters
        (`kernels.fp8_stats.pack_for_sum`): returns them too, the step's int64 [KINDS, FIELDS]
        buffer of all ranks (None without fp8)."""
        attention = self.topology.attention_role(self.rank)
        squares = torch.zeros((), dtype=torch.float64, device=self.device)
        for b in self.optimizer.buckets:
            if b.name.startswith(EXPERTS):
                for p in b.params:
                    squares += self.replicas.squares(p)
            elif b.shard is not None or attention is None or attention[1] == 0:
                squares += flat_squares(b.step_grad())
        world = self.topology.world_size
        words = squares.reshape(1)
        if self.fp8:
            buffer = None if self.fp8_stats is None else self.fp8_stats.buffer
            words = torch.cat([words, pack_for_sum(buffer, self.rank, world, self.device)])
        if self.sums_on_stream:
            words = self.transport.all_sum(words)
        else:
            dist.all_reduce(words, group=self.world_group)
        fp8_LF = unpack_sum(words[1:], world) if self.fp8 else None
        return words[0].sqrt().float(), fp8_LF

    # -- checkpoints ---------------------------------------------------------------

    def save_shard(self, directory: str) -> Listing | None:
        """Write rank-<r>.pt under `directory`; None when this rank holds nothing unique."""
        attention = self.topology.attention_role(self.rank)
        include_replicated = attention is not None and attention[1] == 0
        shard = rank_shard(self.model, self.optimizer, include_replicated,  # a collective under ZeRO-1
                           lambda layer, expert: self.topology.owner_ranks(layer, expert)[0] == self.rank)
        if not shard["model"]:
            return None
        return write_shard(Path(directory), f"rank-{self.rank:05d}.pt", shard)

    def load(self, directory: str) -> None:
        load_rank_state(Path(directory), self.model, self.optimizer, self.model_cfg)

    def _release(self) -> None:
        """Close the watchdog, transport and collective groups of a previous `setup`, if any."""
        watchdog = getattr(self, "watchdog", None)
        if watchdog is not None:
            watchdog.close()
            self.watchdog = None
        transport = getattr(self, "transport", None)
        if transport is not None:
            transport.close()
            self.transport = None
        for group in getattr(self, "_groups", []):
            if group is not None:
                dist.destroy_process_group(group)
        self._groups = []

    def close(self) -> None:
        self._release()
        super().close()
