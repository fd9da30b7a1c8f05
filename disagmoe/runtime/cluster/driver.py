"""The driver of a disaggregated or colocated run: actors, one call per rank per step, outputs.

    trainer = DistributedTrainer(cfg)     # checks the configuration fits, then starts the actors
    summary = trainer.run(on_step)        # metrics.jsonl, checkpoints, trace.json (first
                                          # TRACE_MAX_STEPS steps); shuts the actors down

Per step the driver makes one `train_step` call on every actor; the actors run the schedule and
exchange tensors among themselves. What comes back is small: loss shares, expert loads, the
gradient norm, compute time and trace spans. A failure is reported as `TrainingFailed` naming
the rank at fault and what happened (it died, or it stopped delivering within recv_timeout_s),
and the last checkpoint to resume from. With `max_restarts` = N > 0, `run` instead restarts
itself up to N times (`runtime.cluster.restart`): one `RunWarning` line naming the failure, the actors
killed, new ones started, the newest complete checkpoint loaded (the trace then covers the
last start only).
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError

from disagmoe.config import ModelConfig, TrainConfig, load_hardware
from disagmoe.model_ref import load_model
from disagmoe.model.experts import check_backend_device
from disagmoe.data import load_splits
from disagmoe.roofline.flops import step_flops
from disagmoe.kernels.fp8_dense import fits_blockwise
from disagmoe.model.layers import DeferrableLinear
from disagmoe.roofline.memory import MEMORY_HEADROOM, fp8_weight_copy_bytes
from disagmoe.roofline.optimizer_state import staging_bytes, state_bytes
from disagmoe.runtime.activation_memory import RankActivations, pairs_wgrads, rank_activations
from disagmoe.runtime.batching import check_divisible
from disagmoe.runtime.state.checkpoint import (
    TrainerState,
    check_compatible,
    latest_checkpoint,
    newest_loadable,
    read_manifest,
    resume_checkpoint,
    training_settings,
    verify_checkpoint,
    warn_changed_training,
)
from disagmoe.comm.nvshmem import HEAP_MARGIN_BYTES
from disagmoe.runtime.cluster.cluster import WorkerFailure, WorkerGroup
from disagmoe.runtime.cluster.connect import check_ray_address
from disagmoe.runtime.cluster.sharing import (
    PROCESS_BYTES,
    check_host_syncs,
    check_sharing,
    gpu_of,
    gpus_needed,
    host_collectives,
    ranks_per_gpu,
    sharing_line,
    stream_sum_width,
    wait_timeout_s,
)
from disagmoe.runtime.failures import RunWarning, TrainingFailed
from disagmoe.runtime.stages.messages import MessageShapes, dispatch_mode, hop_mode, transport_buffer_bytes
from disagmoe.runtime.observe.metrics import load_imbalance, peak_and_ceiling
from disagmoe.runtime.state.offload import check_host_memory
from disagmoe.runtime.state.optim import lr_at
from disagmoe.runtime.plan_layout import apply_plan
from disagmoe.runtime.rank_model import rank_model
from disagmoe.runtime.cluster.restart import Fault, restart_line
from disagmoe.runtime.state.sharded_checkpoint import begin_checkpoint, finish_checkpoint, read_trainer_state
from disagmoe.runtime.topology import Topology
from disagmoe.runtime.observe.trace import busy_fractions, wait_fractions, write_chrome_trace
from disagmoe.runtime.rank_graphs import resolve_rank_graphs
from disagmoe.runtime.training.loop import StepCallback, TrainingLoop, TrainSummary, signals_held
from disagmoe.runtime.out_dir import check_out_dir
from disagmoe.runtime.training.micro_batches import MicroBatchChoice, device_capacity_bytes, resolved
from disagmoe.runtime.training.trainer import CHECKPOINTS_DIR, fp8_record_fields
from disagmoe.runtime.cluster.worker import TrainWorker

TRACE_FILE = "trace.json"
TRACE_MAX_STEPS = 100  # spans of the first steps of a run only: a trace of every step grows unbounded
MIN_CPUS_PER_RANK = 0.1  # more CPU actors than this allows would thrash the host
PROBE_TIMEOUT_S = 2.0  # after a failure: an actor that does not answer `info` this fast is hung
MEMORY_FIX = ("use more micro-batches or fewer tokens per step (batch_size, seq_len), or add ranks / pipeline groups "
              "(`disagmoe plan` finds a layout that fits)")


def step_timeout_s(cfg: TrainConfig) -> float:
    """The driver's bound on one step: a hung peer is noticed by its peers after recv_timeout_s
    (one receive; scaled where ranks share a GPU), this backstop covers a rank stuck outside any
    receive."""
    return 4 * wait_timeout_s(cfg) + 60.0


def training_state_bytes(cfg: TrainConfig, model_cfg: ModelConfig, topology: Topology, rank: int,
                         host: bool = False) -> tuple[int, float]:
    """(parameters, bytes of their training state on the device) of one rank's `FlatAdamW`: the compute
    copy, the fp32 master and main gradient and AdamW's moments in `optim.state_dtype`, priced per
    parameter by `roofline.optimizer_state.state_bytes` as the planner prices them. With
    `optim.shard_states`, an attention rank's replicated parameters count their ZeRO-1 share over its
    data-parallel group. With `offload_optimizer` the masters and moments are host bytes (`host`: return
    those instead) and the device holds two staging slots (`staging_bytes`). With precision fp8 the
    rank's routed experts' FP8 weight copies are device bytes too, those their recipe reads
    (`roofline.memory.fp8_weight_copy_bytes`, as mode single counts them), and with `dense_precision`
    fp8 its dense projections' two e4m3 copies."""
    model = rank_model(model_cfg, cfg.experts_backend, topology, rank)
    named = list(model.named_parameters())
    params = sum(p.numel() for _, p in named)
    replicated = sum(p.numel() for n, p in named if ".moe.experts." not in n)
    dp = topology.data_parallel
    sharded = cfg.optim.shard_states and topology.attention_role(rank) is not None and dp > 1
    offload = cfg.offloads_to_host
    whole = state_bytes(cfg.optim.state_dtype, cfg.compute_dtype_name, offload=offload)
    shared = state_bytes(cfg.optim.state_dtype, cfg.compute_dtype_name, dp if sharded else 1, offload=offload)
    if host:
        return params, (params - replicated) * whole.host + replicated * shared.host
    device = (params - replicated) * whole.total + replicated * shared.total
    if cfg.offload_optimizer:
        device += staging_bytes(cfg.offload_bucket_bytes, cfg.optim.state_dtype, cfg.compute_dtype_name, params)
    if cfg.expert_precision == "fp8":
        device += int(fp8_weight_copy_bytes(params - replicated, cfg.expert_forward_precision,
                                            cfg.expert_backward_precision))
    if cfg.dense_precision == "fp8":  # two e4m3 copies of every FP8 dense projection (`fp8_dense.Fp8WeightCopies`;
        # blockwise keeps the linears off its grid in bf16, copying nothing: `fp8_dense.fits_blockwise`)
        blockwise = cfg.dense_fp8_scaling == "blockwise"
        device += 2 * sum(m.weight.numel() for m in model.modules() if isinstance(m, DeferrableLinear)
                          and (not blockwise or fits_blockwise(m.in_features, m.out_features)))
    return params, device


def host_state_bytes(cfg: TrainConfig, model_cfg: ModelConfig, topology: Topology) -> float:
    """Host bytes of every rank's offloaded masters and moments together (0 without offload to a host)."""
    if not cfg.offloads_to_host:
        return 0.0
    return sum(training_state_bytes(cfg, model_cfg, topology, rank, host=True)[1]
               for rank in range(topology.world_size))


def rank_states(cfg: TrainConfig, model_cfg: ModelConfig, topology: Topology) -> list[tuple[int, float]]:
    """`training_state_bytes` of every rank (the same whatever the micro-batches)."""
    return [training_state_bytes(cfg, model_cfg, topology, rank) for rank in range(topology.world_size)]


def rank_needs(cfg: TrainConfig, model_cfg: ModelConfig, topology: Topology,
               states: list[tuple[int, float]] | None = None) -> list[RankNeed]:
    """Every rank's memory at its peak (`RankNeed`), from its training state (`states`: `rank_states`,
    if already computed), its transport's message buffers (`messages.transport_buffer_bytes`: the
    nvshmem arena, nccl's reserved buffers) and its program's activation peak
    (`runtime.activation_memory`, for this run's hop and dispatch)."""
    states = rank_states(cfg, model_cfg, topology) if states is None else states
    buffers = transport_buffer_bytes(cfg, MessageShapes.of_run(cfg, model_cfg, topology), topology,
                                     stream_sum_width(cfg, topology))
    hop, _ = hop_mode(cfg, model_cfg, topology)
    sparse = dispatch_mode(cfg, model_cfg, topology)[0] == "sparse"
    activations = rank_activations(cfg, model_cfg, topology, pair_rows=hop == "pair_rows", sparse=sparse,
                                   peer_stores=sparse and cfg.transport == "nvshmem")
    needs = []
    for rank, (params, state) in enumerate(states):
        needs.append(RankNeed(params, state, buffers[rank], activations[rank],
                              torch_buffers=cfg.transport != "nvshmem"))
    return needs


def largest_device_need(cfg: TrainConfig, model_cfg: ModelConfig,
                        states: list[tuple[int, float]] | None = None) -> int:
    """Bytes the fullest device of this run holds at its peak (`rank_needs`): the largest rank's
    need on one GPU per rank; the fullest GPU's ranks together (each with its process's context and
    heap margin) where ranks share GPUs; every rank together on CPU (one host holds them all)."""
    needs = rank_needs(cfg, model_cfg, Topology.from_config(cfg, model_cfg), states)
    if cfg.device != "cuda":
        return sum(need.total_bytes for need in needs)
    per_gpu = ranks_per_gpu(cfg)
    if per_gpu == 1:
        return max(need.total_bytes for need in needs)
    return max(shared_gpu_bytes(ranks) for ranks in ranks_on_gpus(needs, per_gpu).values())


def ranks_on_gpus(needs: list[RankNeed], per_gpu: int) -> dict[int, list[tuple[int, RankNeed]]]:
    """GPU -> the (rank, need) of the ranks sharing it (`sharing.gpu_of`)."""
    on_gpu: dict[int, list[tuple[int, RankNeed]]] = {}
    for rank, need in enumerate(needs):
        on_gpu.setdefault(gpu_of(rank, per_gpu), []).append((rank, need))
    return on_gpu


def shared_gpu_bytes(ranks: list[tuple[int, RankNeed]]) -> int:
    """What ranks sharing one GPU need together: each its own peak plus its process's CUDA context
    and NVSHMEM heap margin (`sharing.PROCESS_BYTES`, `nvshmem.HEAP_MARGIN_BYTES`)."""
    return sum(need.total_bytes + PROCESS_BYTES + HEAP_MARGIN_BYTES for _, need in ranks)


def resolve_distributed_micro_batches(cfg: TrainConfig, model_cfg: ModelConfig, capacity_bytes: float | None = None,
                                      ) -> tuple[TrainConfig, MicroBatchChoice | None]:
    """A distributed config with `micro_batches: auto` chosen (`runtime.training.micro_batches`)
    from `largest_device_need` on this host's device (GPU 0, or the host's memory on CPU; on a
    joined cluster without a local GPU, the hardware preset's memory) or on `capacity_bytes`; a
    number given stays."""
    if cfg.micro_batches != "auto":
        return cfg, None
    capacity = _device_capacity(cfg, "micro_batches: auto", "a number of micro-batches", capacity_bytes)
    states = rank_states(cfg, model_cfg, Topology.from_config(cfg, model_cfg))  # built once: rank models are slow
    return resolved(cfg, model_cfg, lambda split: largest_device_need(split, model_cfg, states), capacity)


def _device_capacity(cfg: TrainConfig, setting: str, instead: str, capacity_bytes: float | None) -> float:
    """The memory a setting chosen from the devices' memory (`setting`) plans on: `capacity_bytes`, else this
    host's GPU 0 (its host memory on CPU), else, on a joined cluster without a local GPU, the hardware preset's
    (ValueError naming `instead` where there is none)."""
    if capacity_bytes is not None:
        return capacity_bytes
    if cfg.device == "cuda" and not torch.cuda.is_available():
        if cfg.hardware is None:
            raise ValueError(f"{setting} needs the GPUs' memory: this host has no GPU to ask, so set hardware (a "
                             f"preset with hbm_gib) or {instead}")
        return load_hardware(cfg.hardware).hbm_gib * 2**30
    return device_capacity_bytes(torch.device("cuda", 0) if cfg.device == "cuda" else torch.device("cpu"))


def resolve_distributed_wgrad_pairs(cfg: TrainConfig, model_cfg: ModelConfig, capacity_bytes: float | None = None,
                                    ) -> tuple[TrainConfig, str | None]:
    """(`cfg` with `expert_wgrad_pairs: auto` resolved to on or off for its expert ranks, a line saying what runs
    and why, or None where nothing pairs and nothing was asked), as `single_memory.resolve_wgrad_pairs` settles
    one process: on where it applies (`activation_memory.pairs_wgrads`: not under pair rows in bands) and the
    fullest device with each expert rank's waiting rows (`largest_device_need`) is within `MEMORY_HEADROOM` of
    the devices' memory (`capacity_bytes`, else as `micro_batches: auto` reads it), or the rows add nothing to it
    (where every forward of a step runs before the first backward, a rank's peak is at that backward, before any
    rows wait, though that backward may hold its own more: `activation_memory.replay_peak`'s `first_holds`); else
    off, saying why. on is the user's (the memory check holds it
    to the whole device); on under pair rows in bands is refused."""
    if cfg.expert_wgrad_pairs == "off":
        return cfg, None
    on, off = (cfg.model_copy(update={"expert_wgrad_pairs": value}) for value in ("on", "off"))
    if not on.pairs_expert_wgrads:  # where it does not apply (on is refused there by the config) or m = 1
        return off, None
    topology = Topology.from_config(cfg, model_cfg)
    if not pairs_wgrads(on, hop_mode(cfg, model_cfg, topology)[0] == "pair_rows"):
        if cfg.expert_wgrad_pairs == "on":
            raise ValueError(f"expert_wgrad_pairs: on cannot pair under hop pair_rows with pair_bands "
                             f"{cfg.pair_bands}: each band's rows are their own groups, whose weight gradients run "
                             "alone; set pair_bands: 1, hop: partial_sums, or expert_wgrad_pairs: auto")
        return off, (f"expert_wgrad_pairs: auto -> off: pair rows in {cfg.pair_bands} bands group each band's rows "
                     "apart, and launches over banded groups run alone")
    capacity = _device_capacity(cfg, "expert_wgrad_pairs: auto", "expert_wgrad_pairs: on or off", capacity_bytes)
    states = rank_states(cfg, model_cfg, topology)  # the same with or without pairs
    with_rows = largest_device_need(on, model_cfg, states)
    waiting = with_rows - largest_device_need(off, model_cfg, states)
    launches = (cfg.micro_batches + 1) // 2
    budget = capacity * MEMORY_HEADROOM
    if cfg.expert_wgrad_pairs == "auto" and waiting > 0 and with_rows > budget:  # the rows, not the run, past it
        return off, (f"expert_wgrad_pairs: auto -> off: a micro-batch's waiting expert rows would take the fullest "
                     f"device's predicted peak to {with_rows / 2**30:.1f} GiB, past the {budget / 2**30:.1f} GiB "
                     f"({MEMORY_HEADROOM:.0%} of {capacity / 2**30:.1f}) a run may plan for; each expert weight "
                     "gradient runs once per micro-batch (expert_wgrad_pairs: on asks for them anyway)")
    auto = " -> on" if cfg.expert_wgrad_pairs == "auto" else ""
    return on, (f"expert_wgrad_pairs: {cfg.expert_wgrad_pairs}{auto}: each expert rank runs each expert weight "
                f"gradient {launches} times a step over {cfg.micro_batches} micro-batches' rows (its fp32 main "
                f"gradient read and written {launches} times, not {cfg.micro_batches}); the fullest device's "
                f"predicted peak {waiting / 2**30:+.2f} GiB for the waiting rows (and what a first backward of a "
                "pair holds more)")


@dataclass(frozen=True)
class RankNeed:
    """What one rank holds at its peak: parameters (count), training state, its transport's message
    buffers (`received_bytes`) and activation bytes; `torch_buffers`: its buffers come from torch's
    allocator (nccl, local), not NVSHMEM's heap."""

    params: int
    state_bytes: int
    received_bytes: int
    activations: RankActivations
    torch_buffers: bool

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.received_bytes + self.activations.peak_bytes

    @property
    def predicted_peak_gib(self) -> float:
        """The counterpart of the measured `peak_memory_gib` (torch's allocator: an NVSHMEM
        arena is not in it)."""
        received = self.received_bytes if self.torch_buffers else 0
        return (self.state_bytes + received + self.activations.peak_bytes) / 2**30

    @property
    def buffers_kind(self) -> str:
        return "receive buffers" if self.torch_buffers else "nvshmem arena"

    def describe(self) -> str:
        acts = self.activations
        return (f"{self.state_bytes / 2**30:.1f} GiB of weights, fp32 masters, gradients and AdamW moments, "
                f"{self.received_bytes / 2**30:.1f} GiB of transport buffers ({self.buffers_kind}) and "
                f"{acts.peak_bytes / 2**30:.1f} GiB of activations ({acts.micro_batches_in_flight} micro-batches "
                f"in flight at {acts.at_op})")


def check_memory(cfg: TrainConfig, model_cfg: ModelConfig, topology: Topology, capacity_bytes: float,
                 per_gpu: int = 1, needs: list[RankNeed] | None = None) -> None:
    """ValueError naming the first rank whose parameters, gradients and AdamW moments (fp32;
    `training_state_bytes`), transport buffers (`messages.transport_buffer_bytes`: nccl's per receive
    slot, nvshmem's symmetric arena) and activations at its program's peak (`runtime.activation_memory`)
    exceed one device's memory. With `per_gpu` > 1 ranks sharing each GPU, also the first GPU whose
    ranks do not fit it together (each rank's process adding its context and NVSHMEM heap margin:
    `sharing.PROCESS_BYTES`). `needs`: `rank_needs`, if already computed."""
    needs = rank_needs(cfg, model_cfg, topology) if needs is None else needs
    for rank, need in enumerate(needs):
        if need.total_bytes > capacity_bytes:
            raise ValueError(
                f"rank {rank} ({topology.describe(rank)}) holds {need.params:,} parameters and needs "
                f"{need.total_bytes / 2**30:.1f} GiB: {need.describe()}, on a {capacity_bytes / 2**30:.1f} GiB "
                f"device; {MEMORY_FIX}"
            )
    if per_gpu == 1:
        return
    for gpu, ranks in ranks_on_gpus(needs, per_gpu).items():
        total = shared_gpu_bytes(ranks)
        if total > capacity_bytes:
            each = "; ".join(f"rank {rank} {need.total_bytes / 2**30:.1f} GiB ({need.describe()})"
                             for rank, need in ranks)
            raise ValueError(
                f"GPU {gpu} is shared by {len(ranks)} ranks (ranks_per_gpu={per_gpu}) needing "
                f"{total / 2**30:.1f} GiB together ({each}; plus "
                f"{(PROCESS_BYTES + HEAP_MARGIN_BYTES) / 2**30:.2f} GiB per process for its CUDA context and "
                f"NVSHMEM heap) on a {capacity_bytes / 2**30:.1f} GiB device; lower ranks_per_gpu (more GPUs), "
                f"or {MEMORY_FIX}")


def check_fits(cfg: TrainConfig, model_cfg: ModelConfig, topology: Topology) -> None:
    """ValueError (with the numbers) for a configuration that cannot run, before any actor starts."""
    world = topology.world_size
    check_divisible(cfg.batch_size, cfg.micro_batches, topology.data_parallel)
    check_backend_device(cfg.experts_backend, cfg.device)
    if 2 * model_cfg.num_layers > 512:
        raise ValueError(f"num_layers={model_cfg.num_layers}: the message tags hold at most 256 layers")
    if model_cfg.tie_embeddings and topology.head_group != 0:
        raise ValueError(
            f"tie_embeddings needs the LM head on the embedding's pipeline group, but with "
            f"{topology.pipeline_groups} groups and {model_cfg.num_layers} layers the head runs on group "
            f"{topology.head_group}; choose pipeline_groups dividing num_layers"
        )
    factor = cfg.transport_capacity_factor
    if factor is not None and (cfg.transport != "nvshmem" or factor < 1):
        raise ValueError(
            f"transport_capacity_factor={factor:g}: every message of this runtime has rows fixed by the run "
            "(tokens per micro-batch), so its buffers are sized exactly and a factor below 1 cannot hold them; "
            "it applies to transport: nvshmem only, at >= 1 (leave it unset)")
    if cfg.ray_address is not None:
        return  # a joined cluster's capacity is checked by Ray's placement (with the numbers)
    if cfg.device == "cuda":
        gpus, per_gpu = torch.cuda.device_count(), ranks_per_gpu(cfg)
        if per_gpu > 1:
            check_sharing(world, per_gpu, gpus)
            check_host_syncs(cfg, topology)
        elif world > gpus:
            raise ValueError(f"{cfg.mode} needs {world} GPUs (one per rank), this host has {gpus}; lower the rank "
                             "counts, join a larger cluster with ray_address, or share GPUs (ranks_per_gpu with "
                             "transport: nvshmem: a test of the layout, not of its speed)")
        if cfg.transport == "local":
            raise ValueError("transport=local runs on CPU (gloo); use transport=nccl with device=cuda")
        check_memory(cfg, model_cfg, topology, torch.cuda.get_device_properties(0).total_memory, per_gpu)
        if cfg.offloads_to_host:  # every rank on this host (no ray_address): their host copies together
            check_host_memory(host_state_bytes(cfg, model_cfg, topology), f"{world} ranks on this host")
    else:
        cpus = os.cpu_count() or 1
        if world > cpus / MIN_CPUS_PER_RANK:
            raise ValueError(f"{cfg.mode} needs {world} CPU ranks but this host has {cpus} cores "
                             f"(at most {int(cpus / MIN_CPUS_PER_RANK)} ranks); lower the rank counts")
        if cfg.transport != "local":
            raise ValueError(f"transport={cfg.transport} needs GPUs; on CPU use transport=local")


def check_fault_injection(cfg: TrainConfig, topology: Topology) -> None:
    fault = cfg.fault_injection
    if fault is not None and fault.rank >= topology.world_size:
        raise ValueError(f"fault_injection.rank={fault.rank} but the run has {topology.world_size} ranks "
                         f"(0-{topology.world_size - 1}); choose one of them")


class DistributedTrainer(TrainingLoop):
    """A `mode: disaggregated | colocated` run (module docstring)."""

    checkpoints_after_stopped_evaluation = False  # the actors are still evaluating; shutdown stops them

    def __init__(self, cfg: TrainConfig, log_to_driver: bool = True, workers: WorkerGroup | None = None) -> None:
        """`workers`: already started `TrainWorker` actors (with their process group) to reuse for
        this run instead of starting new ones; they stay up afterwards (the caller shuts them down)."""
        self.model_cfg = load_model(cfg.model)
        self.cfg = cfg = apply_plan(cfg, self.model_cfg)  # a plan's layout, checked; inline for the workers
        self.cfg = cfg = self._auto_split(resolve_distributed_micro_batches(cfg, self.model_cfg))
        cfg, self.wgrad_pairs_note = resolve_distributed_wgrad_pairs(cfg, self.model_cfg)  # after the split (m = 1 pairs nothing)
        self.cfg = cfg
        self.topology = Topology.from_config(cfg, self.model_cfg)
        # cuda_graphs: on where a rank's step cannot be captured is refused here, before any actor starts
        self.cuda_graphs, self.cuda_graphs_note = resolve_rank_graphs(cfg, self.topology)
        # counted with the dense projections' e4m3 copies where precision fp8 asks for them: conservative where
        # the ranks' GPUs then keep them in bf16 (`dense_as_run`; the predicted peaks are recounted after it)
        check_fits(cfg, self.model_cfg, self.topology)
        needs = rank_needs(cfg, self.model_cfg, self.topology)
        self.predicted_peak_gib = [need.predicted_peak_gib for need in needs]
        self.transport_gib = [need.received_bytes / 2**30 for need in needs]  # in the check and the peak
        self.offloaded_host_gib = host_state_bytes(cfg, self.model_cfg, self.topology) / 2**30
        self.hop, self.hop_reason = hop_mode(cfg, self.model_cfg, self.topology)
        self.dispatch, self.dispatch_reason = dispatch_mode(cfg, self.model_cfg, self.topology)
        self.traffic_sums: dict[str, int] = {}  # bytes of the rows sent, summed over ranks and steps run
        self.traffic_steps = 0
        self.graph_replays = 0  # steps in which every rank replayed its captured step (`cuda_graphs`)
        check_fault_injection(cfg, self.topology)
        check_ray_address(cfg.ray_address, cfg.ray_connect_timeout_s)  # bounded, before Ray
        check_out_dir(cfg.out_dir)  # before any actor starts
        splits = load_splits(cfg.data, self.model_cfg.vocab_size, cfg.seq_len)  # data errors surface here
        self.evaluates = splits.val is not None and cfg.eval_every > 0
        self.out_dir = Path(cfg.out_dir)
        self.checkpoint_root = self.out_dir / CHECKPOINTS_DIR
        resume_from = self._resume_point() if cfg.resume else None
        self.step = 0 if resume_from is None else read_trainer_state(resume_from).step
        self.tokens_per_step = cfg.batch_size * cfg.seq_len
        self.flops_per_step = step_flops(self.model_cfg, self.tokens_per_step, cfg.seq_len)
        self.ranks_per_gpu = ranks_per_gpu(cfg)
        self.gpus = gpus_needed(self.topology.world_size, self.ranks_per_gpu) if cfg.device == "cuda" else 0
        if self.ranks_per_gpu > 1:
            warnings.warn(sharing_line(self.topology.world_size, self.ranks_per_gpu, host_collectives(self.topology)),
                          RunWarning, stacklevel=2)
        # time-sliced ranks give no speed figure: no MFU in their records or summary
        self.peak_flops, self.ceiling_flops = ((None, None) if self.ranks_per_gpu > 1 else
                                               peak_and_ceiling(cfg, gpus=self.gpus or self.topology.world_size))
        self.rank_names = {r: self.topology.describe(r) for r in range(self.topology.world_size)}
        self.groups = [self.topology.group_name(r) for r in range(self.topology.world_size)]
        self.log_to_driver = log_to_driver
        self.fault = Fault(cfg.fault_injection, self.out_dir, fresh_run=not cfg.resume)
        self.restarts = 0
        self.owns_workers = workers is None
        self._start(workers, resume_from)
        if self.cfg.dense_precision != cfg.dense_precision:  # the ranks kept the dense projections in bf16
            self.predicted_peak_gib = [need.predicted_peak_gib
                                       for need in rank_needs(self.cfg, self.model_cfg, self.topology)]
        if resume_from is not None:  # against the recipe the ranks run (`dense_as_run`)
            warn_changed_training(read_manifest(resume_from), self.cfg, resume_from)

    def _start(self, workers: WorkerGroup | None, resume_from: Path | None) -> None:
        """Start the actors (or take `workers`), set every rank up, load `resume_from` if given;
        the trace starts empty."""
        cfg = self.cfg
        if workers is None:
            try:
                workers = WorkerGroup.start(self.topology.world_size, cfg.device, cfg.env, cfg.ray_address,
                                            worker_cls=TrainWorker, log_to_driver=self.log_to_driver,
                                            ranks_per_gpu=self.ranks_per_gpu)
            except WorkerFailure as failure:  # an actor that never came up: the run's report, not a traceback
                raise self._start_failed(failure, "starting the actors") from None
        elif workers.world_size != self.topology.world_size:
            raise ValueError(f"{cfg.mode} needs {self.topology.world_size} ranks; the given workers are "
                             f"{workers.world_size}")
        self.workers = workers
        try:
            if self.owns_workers:
                try:
                    self.workers.init_process_group(timeout_s=wait_timeout_s(cfg))
                except WorkerFailure as failure:
                    raise self._start_failed(failure, "joining the process group (init_process_group)") from None
            self._call("setup", cfg.model_dump(mode="json"), self.topology)
            self.processes = [_process_facts(info, self.rank_names[info["rank"]]) for info in self._call("info")]
            self.cfg = dense_as_run(self.cfg, self.processes)
            if resume_from is not None:
                self._call("load", str(resume_from))
        except BaseException:
            if self.owns_workers:
                self.workers.shutdown()
            raise
        self.spans: dict[int, list[tuple[str, str, float, float]]] = {r: [] for r in self.rank_names}
        self.traced_steps = 0

    def _start_failed(self, failure: WorkerFailure, phase: str) -> TrainingFailed:
        """A start-up `WorkerFailure` as the run's one-line report, naming the rank and the phase."""
        name = self.rank_names.get(failure.rank, "?")
        return TrainingFailed(failure.rank, f"rank {failure.rank} ({name}) failed while {phase}: {failure.reason}; "
                                            "nothing was trained (fix the cause and run again)")

    def _resume_point(self) -> Path:
        """The checkpoint to resume from, checked against the model and the step count."""
        directory, manifest = resume_checkpoint(self.checkpoint_root, verify_checkpoint)
        check_compatible(manifest, self.model_cfg, directory)
        step = read_trainer_state(directory).step
        if step >= self.cfg.steps:
            raise ValueError(f"checkpoint {directory} is at step {step}, already at steps={self.cfg.steps}; "
                             "raise steps to train further")
        return directory

    # -- the run ---------------------------------------------------------------------------------

    def run(self, on_step: StepCallback | None = None) -> TrainSummary:
        """Train to `cfg.steps`, restarting after a failed rank up to `max_restarts` times, then
        write the trace and shut the actors down (also on failure)."""
        try:
            failure: TrainingFailed | None = None
            while True:
                try:
                    if failure is not None:
                        self._restart(failure)
                    return self._run(on_step)
                except TrainingFailed as err:
                    if self.restarts >= self.cfg.max_restarts:
                        raise
                    failure = err
        finally:
            if self.cfg.trace:
                try:  # never in place of the run's outcome (its summary or its failure)
                    write_chrome_trace(self.out_dir / TRACE_FILE, self.spans, self.rank_names, self.cfg.device)
                except OSError as err:
                    warnings.warn(f"trace not written: {self.out_dir / TRACE_FILE}: {err.strerror or err}",
                                  RunWarning, stacklevel=2)
            if self.owns_workers:
                with signals_held("shutting the cluster down; signals are ignored until it is down"):
                    self.workers.shutdown()

    def _restart(self, failure: TrainingFailed) -> None:
        """Tear the actor group down (a given group is left to its owner), print one line, start
        new actors and load the newest complete checkpoint (none: start from step 0)."""
        self.restarts += 1
        resume_from = self._newest_checkpoint()
        warnings.warn(restart_line(self.restarts, self.cfg.max_restarts, failure, resume_from), RunWarning,
                      stacklevel=3)
        if self.owns_workers:
            self.workers.shutdown()
        self.owns_workers = True
        self.cfg = self.cfg.model_copy(update={"resume": True})  # metrics.jsonl is cut at the resumed step
        self.step = 0 if resume_from is None else read_trainer_state(resume_from).step
        self._start(None, resume_from)

    def _newest_checkpoint(self) -> Path | None:
        """The newest checkpoint whose shards all pass their sha256 (damaged ones: a warning each)."""
        found = newest_loadable(self.checkpoint_root, verify_checkpoint)
        return None if found is None else found[0]

    def _train_one_step(self) -> dict[str, Any]:
        cfg = self.cfg
        lr = lr_at(self.step, cfg.optim, cfg.steps)
        fault = (self.fault.arm(self.workers.actors[self.fault.spec.rank]) if self.fault.due(self.step + 1)
                 else None)
        start = time.perf_counter()
        traced = self.cfg.trace and self.traced_steps < TRACE_MAX_STEPS
        results = self._call("train_step", self.step, lr, traced, after_submit=fault)
        self.traced_steps += traced
        seconds = time.perf_counter() - start
        self.step += 1
        parts = {"ce": 0.0, "aux_loss": 0.0, "z_loss": 0.0}
        load: dict[int, list[int]] = {}
        traffic: dict[str, int] = {}
        for result in results:
            for name, sent in result["traffic"].items():
                traffic[name] = traffic.get(name, 0) + sent
            for name, value in result.get("loss_parts", {}).items():
                parts[name] += value
            load.update(result["expert_load"])
            self.spans[result["rank"]].extend(result["spans"])
        for name, sent in traffic.items():
            self.traffic_sums[name] = self.traffic_sums.get(name, 0) + sent
        self.traffic_steps += 1
        replayed = all(r.get("cuda_graph", False) for r in results)  # every rank replayed its graph
        self.graph_replays += replayed
        load_LE = torch.tensor([load[layer] for layer in sorted(load)], dtype=torch.int64).reshape(
            len(load), self.model_cfg.num_experts)
        return {
            "step": self.step,
            "loss": parts["ce"] + parts["aux_loss"] + parts["z_loss"],
            **parts,
            "lr": lr,
            "grad_norm": results[0]["grad_norm"],
            **self.step_speed(seconds),
            "peak_memory_gib": max((r["peak_memory_gib"] for r in results if r["peak_memory_gib"] is not None),
                                   default=None),
            "peak_memory_gib_per_rank": [r["peak_memory_gib"] for r in results],
            "predicted_peak_gib": max(self.predicted_peak_gib),  # `rank_needs`: beside the measured peak
            "predicted_peak_gib_per_rank": list(self.predicted_peak_gib),
            "expert_load": load_LE.tolist(),
            "load_imbalance": load_imbalance(load_LE),
            "traffic": traffic,  # bytes of the rows sent between ranks, per payload, with the dense figure
            "busy": busy_fractions([r["compute_s"] for r in results], seconds, self.groups),
            "gpu_wait": wait_fractions([r.get("gpu_wait_s", {}) for r in results], seconds, self.groups),
            "cuda_graph": replayed,
            "cuda_graph_ranks": sum(bool(r.get("cuda_graph", False)) for r in results),  # ranks that replayed
            **({"time_sliced": True} if self.ranks_per_gpu > 1 else {}),  # step_time_s is not a speed figure
            **fp8_step_fields(results, torch.device(cfg.device)),
        }

    def run_facts(self) -> dict[str, Any]:
        steps = max(self.traffic_steps, 1)
        traffic = {name: total / steps for name, total in self.traffic_sums.items()}  # mean per step
        return dict(hop=self.hop, dispatch=self.dispatch, traffic=traffic or None, transport=self.cfg.transport, gpus=self.gpus or None,
                    ranks_per_gpu=self.ranks_per_gpu, time_sliced=self.ranks_per_gpu > 1,
                    processes=self.processes, predicted_peak_gib=max(self.predicted_peak_gib),
                    predicted_peak_gib_per_rank=list(self.predicted_peak_gib), offloaded_host_gib=self.offloaded_host_gib,
                    transport_gib_per_rank=list(self.transport_gib), cuda_graphs_note=self.cuda_graphs_note,
                    expert_wgrad_pairs=self.cfg.pairs_expert_wgrads, expert_wgrad_pairs_note=self.wgrad_pairs_note,
                    cuda_graph_replays=self.graph_replays if self.cuda_graphs else None,
                    **self.split_facts())

    def validate(self) -> float:
        """Mean CE over `eval_batches` validation batches, as the oracle's `evaluate` defines it."""
        results = self._call("evaluate", self.cfg.eval_batches)
        return sum(r["ce"] for r in results) / self.cfg.eval_batches

    def save(self) -> Path:
        """Every rank writes its shard into a staging directory; the driver seals it."""
        staging = begin_checkpoint(self.checkpoint_root, self.step)
        listings = self._call("save_shard", str(staging))
        return finish_checkpoint(self.checkpoint_root, self.step, [e for e in listings if e is not None],
                                 self.model_cfg, TrainerState.capture(self.step), training_settings(self.cfg))

    def _call(self, method: str, *args: Any, after_submit: Callable[[], None] | None = None) -> list[Any]:
        try:
            return self.workers.call(method, *args, timeout_s=step_timeout_s(self.cfg), after_submit=after_submit)
        except WorkerFailure as failure:
            raise self._diagnose(failure, method) from failure

    def _diagnose(self, failure: WorkerFailure, method: str) -> TrainingFailed:
        """Name the rank at fault: a dead rank, else a hung one (its peers only time out), else the
        rank that raised."""
        rank, what = failure.rank, failure.reason
        dead, hung = probe_ranks(self.workers.actors, PROBE_TIMEOUT_S)
        if dead:
            rank = min(dead)
            what = f"{dead[rank]}; then {failure}"
        elif hung:
            rank = min(hung)
            watched = ("; its watchdog printed the op it is stuck in and its stacks to its stderr"
                       if method in ("train_step", "evaluate") else "")
            what = (f"it is hung (busy past recv_timeout_s={self.cfg.recv_timeout_s:g} s and not answering "
                    f"Ray{watched}); its peers report: {failure}")
        checkpoint = latest_checkpoint(self.checkpoint_root)
        resume = (f"resume from {checkpoint} with resume=true" if checkpoint is not None
                  else "no checkpoint yet (checkpoint_every / checkpoint_minutes keep progress)")
        name = self.rank_names.get(rank, "?")
        report = f"rank {rank} ({name}) failed during {method} of step {self.step + 1}: {what}"
        return TrainingFailed(rank, f"{report}; {resume}", report)


def fp8_step_fields(results: list[dict[str, Any]], device: torch.device) -> dict[str, Any]:
    """precision fp8: the step record's FP8 fields (`trainer.fp8_record_fields`, as mode single
    writes them) from the ranks' counters, reduced over all ranks in the step (every rank reads the
    same buffer; a rank disagreeing would mean the skip flag did too). Empty without fp8."""
    buffers = [r["fp8"] for r in results if r.get("fp8") is not None]
    if not buffers:
        return {}
    if any(b != buffers[0] for b in buffers) or len(buffers) != len(results):
        raise AssertionError(f"the ranks' reduced FP8 counters differ: {buffers}")
    return fp8_record_fields(buffers[0], device)


def _process_facts(info: dict[str, Any], name: str) -> dict[str, Any]:
    """A rank's process as the summary records it (`TrainWorker.info`), JSON-ready."""
    return {"rank": info["rank"], "pid": info["pid"], "node": info["node_ip"], "device": info["device"],
            "role": name, "transport": info.get("transport"), "hop": info.get("hop"),
            "dispatch": info.get("dispatch"), "dense_precision": info.get("dense_precision"),
            "expert_loads": info.get("expert_loads")}


def dense_as_run(cfg: TrainConfig, processes: list[dict[str, Any]]) -> TrainConfig:
    """`cfg` with `fp8_dense: false` where its attention ranks kept their dense projections in bf16
    (`processes`' facts: their GPUs cannot run the default blockwise FP8, `trainer.resolve_dense_fp8`,
    which warned there), so records and checkpoints name what trained; else `cfg`. ValueError where
    the ranks disagree (GPUs of several kinds)."""
    ran = {p["dense_precision"] for p in processes if p.get("dense_precision")}
    if cfg.dense_precision != "fp8" or ran <= {"fp8"}:
        return cfg
    if ran != {"bf16"}:
        raise ValueError("precision: fp8's default dense recipe (blockwise) runs on some attention ranks' GPUs and "
                         "not on others; set fp8_dense: false, or fp8_dense: true with fp8_dense_scaling: rowwise")
    return cfg.model_copy(update={"fp8_dense": False})


def probe_ranks(actors: list[Any], timeout_s: float) -> tuple[dict[int, str], list[int]]:
    """Ask every actor for `info`: ({rank: why it is dead}, [ranks that did not answer in time])."""
    futures = {actor.info.remote(): rank for rank, actor in enumerate(actors)}
    ready, pending = ray.wait(list(futures), num_returns=len(futures), timeout=timeout_s)
    dead = {}
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError as err:
            dead[futures[ref]] = f"its actor died ({str(err).strip().splitlines()[0]})"
    return dead, sorted(futures[ref] for ref in pending)


def train_distributed(cfg: TrainConfig, on_step: StepCallback | None = None) -> TrainSummary:
    """Run a whole `mode: disaggregated | colocated` run (resuming if `cfg.resume`)."""
    return DistributedTrainer(cfg).run(on_step)
