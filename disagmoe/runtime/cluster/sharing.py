"""Ranks sharing a GPU (`TrainConfig.ranks_per_gpu` = k > 1): which GPU each rank runs on, the
Ray share that puts it there, and how long its waits may take.

Rank r runs on GPU r // k of the run: NVSHMEM wants the PEs of one GPU contiguous, and equally
many on every GPU once there are several. Ray places them with one whole-GPU bundle per GPU and k
actors in it, each asking for a 1/k share (rounded down to Ray's 1e-4 resolution, so k shares fit
one GPU). Nothing isolates them: without MPS (the GPU's compute mode is not ours to change) their
processes time-slice the GPU, so a step's time says nothing about speed, and a spinning wait
progresses only while its producer gets slices: waits get k times `recv_timeout_s`. The process
group of such a run uses gloo (NCCL refuses two ranks on one device), staged through the host.
So the one collective of every layout, the step's all-ranks gradient norm (carrying, with
precision fp8, every rank's FP8 counters: `kernels.fp8_stats.pack_for_sum`), runs on the GPU
stream over the nvshmem transport's arena instead (`NvshmemTransport.all_sum`): a layout without
data parallelism or replicated experts makes no host wait in its step (`forbid_host_syncs`
holds). The other collectives (data-parallel gradient, expert-load and ZeRO-1 sums, replicated
experts' gradient sums) stay on gloo (`host_collectives`), and the run says so at start.
"""

from __future__ import annotations

import math

from disagmoe.config import TrainConfig
from disagmoe.kernels.fp8_stats import sum_words as fp8_sum_words
from disagmoe.runtime.topology import Topology
from disagmoe.runtime.rank_graphs import resolve_rank_graphs

# What one more process on a GPU costs beyond its tensors: the CUDA context (eager module
# loading), gloo and NVSHMEM's own state. Measured on an H200 (nvshmem4py 0.4.1, a 256 MiB
# symmetric heap): 1,886 MiB per process before its first tensor.
PROCESS_BYTES = 2 * 2**30
RAY_RESOLUTION = 10_000  # Ray accepts resource amounts in steps of 1e-4


def ranks_per_gpu(cfg: TrainConfig) -> int:
    """k for this run: 1 unless a distributed mode on cuda asks for more."""
    return cfg.ranks_per_gpu if cfg.mode != "single" and cfg.device == "cuda" else 1


def gpus_needed(world_size: int, per_gpu: int) -> int:
    return -(-world_size // per_gpu)


def gpu_of(rank: int, per_gpu: int) -> int:
    """The run's GPU (0, 1, ...) that `rank` runs on."""
    return rank // per_gpu


def gpu_share(per_gpu: int) -> float:
    """The GPU amount each of `per_gpu` actors asks Ray for: 1/k rounded down, so k fit one GPU."""
    return math.floor(RAY_RESOLUTION / per_gpu) / RAY_RESOLUTION


def wait_timeout_s(cfg: TrainConfig) -> float:
    """How long a receive or an op may wait before its peer counts as hung: `recv_timeout_s`,
    times k when k processes time-slice each GPU."""
    return cfg.recv_timeout_s * ranks_per_gpu(cfg)


def stream_sum_width(cfg: TrainConfig, topology: Topology) -> int:
    """float64 words of the all-ranks sum that runs on the stream over the nvshmem arena (the
    gradient norm's sum of squares; with precision fp8 also the step's FP8 counters,
    `kernels.fp8_stats.sum_words`): that many for ranks sharing GPUs and for runs whose rank steps
    are captured (`runtime.rank_graphs`: a process-group collective is not), else 0 (the process
    group sums)."""
    if cfg.mode == "single" or (ranks_per_gpu(cfg) == 1 and not resolve_rank_graphs(cfg, topology)[0]):
        return 0
    return 1 + (fp8_sum_words(topology.world_size) if cfg.expert_precision == "fp8" else 0)


def host_collectives(topology: Topology) -> list[str]:
    """What ranks sharing GPUs still sum over gloo, through the host (module docstring)."""
    staged = []
    if topology.data_parallel > 1:
        staged.append(f"the {topology.data_parallel} attention replicas' gradient and expert-load sums")
    if topology.replica_groups():
        staged.append("replicated experts' gradient sums")
    return staged


def check_sharing(world_size: int, per_gpu: int, gpus_here: int) -> None:
    """ValueError, with the fix, for ranks that cannot share this host's GPUs as asked."""
    need = gpus_needed(world_size, per_gpu)
    if need > gpus_here:
        raise ValueError(f"{world_size} ranks at ranks_per_gpu={per_gpu} need {need} GPUs, this host has {gpus_here}; "
                         f"raise ranks_per_gpu to {gpus_needed(world_size, max(gpus_here, 1))} or lower the rank counts")
    if need > 1 and world_size % per_gpu:
        raise ValueError(f"{world_size} ranks at ranks_per_gpu={per_gpu} would leave GPU {need - 1} with "
                         f"{world_size % per_gpu} ranks and the others with {per_gpu}: NVSHMEM needs as many PEs on "
                         "every GPU; choose ranks_per_gpu dividing the rank count (or equal to it: one GPU)")


def sharing_line(world_size: int, per_gpu: int, staged: list[str]) -> str:
    """The one line a shared run starts with; `staged`: its `host_collectives`."""
    gpus = gpus_needed(world_size, per_gpu)
    how = ("; ".join(staged) + " over gloo, staged through the host; the gradient norm on the GPU stream"
           if staged else "its one collective, the gradient norm, on the GPU stream: no host wait in a step")
    return f"{world_size} ranks on {gpus} GPU{'s' if gpus > 1 else ''}: time-sliced, not a speed measurement ({how})"


def check_host_syncs(cfg: TrainConfig, topology: Topology) -> None:
    """ValueError, with the fix, for `forbid_host_syncs` on shared GPUs in a layout whose step
    sums over gloo (`host_collectives`)."""
    staged = host_collectives(topology)
    if cfg.forbid_host_syncs and ranks_per_gpu(cfg) > 1 and staged:
        raise ValueError(f"forbid_host_syncs with ranks_per_gpu={cfg.ranks_per_gpu}: ranks sharing a GPU sum "
                         f"{' and '.join(staged)} over gloo, staged through the host, which the sync check refuses; "
                         "set one of them off, or use a layout with one attention rank per pipeline group and no "
                         "replicated experts (its only collective, the gradient norm, runs on the GPU stream)")
