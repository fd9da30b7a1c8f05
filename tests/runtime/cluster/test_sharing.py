"""Ranks sharing a GPU (disagmoe/runtime/cluster/sharing.py): the settings that are refused, where
Ray places the actors (logical GPUs on this CPU host), the per-GPU memory check, the timeouts."""

from __future__ import annotations

import re
from typing import NamedTuple

import pytest
import ray

from disagmoe.config import TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.runtime.cluster.cluster import _placement_groups
from disagmoe.runtime.activation_memory import rank_activations
from disagmoe.runtime.cluster.driver import check_memory, rank_needs, step_timeout_s, training_state_bytes
from disagmoe.runtime.cluster.sharing import (
    PROCESS_BYTES,
    check_host_syncs,
    check_sharing,
    gpu_of,
    gpu_share,
    gpus_needed,
    host_collectives,
    ranks_per_gpu,
    sharing_line,
    stream_sum_width,
    wait_timeout_s,
)
from disagmoe.runtime.stages.messages import MessageShapes, dispatch_mode, hop_mode, receive_layouts
from disagmoe.runtime.topology import Topology
from disagmoe.comm.nvshmem import HEAP_MARGIN_BYTES


def shared(**fields) -> TrainConfig:
    base = dict(model="tiny", mode="disaggregated", device="cuda", transport="nvshmem", ranks_per_gpu=2,
                batch_size=8, seq_len=16)
    return TrainConfig(**{**base, **fields})


@pytest.mark.parametrize("fields, message", [
    (dict(transport="nccl"), "NCCL refuses two ranks on one GPU ('Duplicate GPU detected'); use transport: nvshmem"),
    (dict(device="cpu", transport="local"), "it needs device: cuda"),
    (dict(ranks_per_gpu=0), "greater than or equal to 1"),
    (dict(ranks_per_gpu=65), "less than or equal to 64"),
])
def test_settings_that_cannot_share_a_gpu_are_refused_with_the_fix(fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        shared(**fields)


def test_one_process_runs_and_cpu_runs_ignore_sharing():
    assert ranks_per_gpu(shared(mode="single", transport="nccl")) == 1
    assert ranks_per_gpu(shared(ranks_per_gpu=1, transport="nccl")) == 1
    assert ranks_per_gpu(shared(ranks_per_gpu=3)) == 3


@pytest.mark.parametrize("per_gpu", range(1, 65))
def test_k_shares_fit_one_gpu_at_rays_resolution(per_gpu):
    share = gpu_share(per_gpu)
    assert 0 < share <= 1 / per_gpu and per_gpu * round(share * 10_000) <= 10_000
    assert 1 / per_gpu - share < 1e-4


def test_ranks_fill_gpus_in_contiguous_blocks():
    assert [gpu_of(r, 2) for r in range(6)] == [0, 0, 1, 1, 2, 2]
    assert gpus_needed(5, 8) == 1 and gpus_needed(6, 2) == 3 and gpus_needed(7, 2) == 4
    check_sharing(3, 3, gpus_here=1)
    check_sharing(2, 4, gpus_here=1)  # fewer ranks than the share: still one GPU
    with pytest.raises(ValueError, match=r"4 ranks at ranks_per_gpu=2 need 2 GPUs, this host has 1; raise "
                                         r"ranks_per_gpu to 4"):
        check_sharing(4, 2, gpus_here=1)
    with pytest.raises(ValueError, match=r"leave GPU 1 with 1 ranks and the others with 2: NVSHMEM needs as many"):
        check_sharing(3, 2, gpus_here=2)


def test_waits_scale_with_the_ranks_time_slicing_a_gpu():
    cfg = shared(ranks_per_gpu=3, recv_timeout_s=40)
    assert wait_timeout_s(cfg) == 120 and step_timeout_s(cfg) == 4 * 120 + 60
    assert wait_timeout_s(cfg.model_copy(update={"ranks_per_gpu": 1})) == 40
    assert "3 ranks on 1 GPU: time-sliced, not a speed measurement" in sharing_line(3, 3, [])
    assert sharing_line(4, 2, []).startswith("4 ranks on 2 GPUs: ")


def _topology(**fields) -> Topology:
    cfg = shared(**fields)
    return Topology.from_config(cfg, load_model(cfg.model))


class _Replicated(NamedTuple):
    """Stands for the topology of a plan with a replicated expert (ranks 1 and 2 hold it)."""

    world_size: int = 3
    data_parallel: int = 1

    def replica_groups(self) -> list[tuple[int, ...]]:
        return [(1, 2)]


# (layout, what stays on gloo): one attention rank per pipeline group and no replicated experts
# sum only the gradient norm, on the stream; data parallelism or replicas add gloo sums
HOST_COLLECTIVES = {
    "A1-E1": (lambda: _topology(attention_ranks=1, expert_ranks=1), []),
    "A1-E2": (lambda: _topology(attention_ranks=1, expert_ranks=2), []),
    "A2-E2-p2": (lambda: _topology(attention_ranks=2, expert_ranks=2, pipeline_groups=2), []),
    "A2-E1": (lambda: _topology(attention_ranks=2, expert_ranks=1),
              ["the 2 attention replicas' gradient and expert-load sums"]),
    "colocated-3": (lambda: _topology(mode="colocated", colocated_ranks=3),
                    ["the 3 attention replicas' gradient and expert-load sums"]),
    "replicas": (_Replicated, ["replicated experts' gradient sums"]),
}


@pytest.mark.parametrize("case", HOST_COLLECTIVES)
def test_what_a_shared_layout_sums_through_the_host_is_named_at_start(case):
    make, staged = HOST_COLLECTIVES[case]
    topology = make()
    assert host_collectives(topology) == staged
    line = sharing_line(topology.world_size, topology.world_size, staged)
    if staged:
        assert " over gloo, staged through the host; the gradient norm on the GPU stream" in line
        assert staged[0] in line
    else:
        assert line.endswith("(its one collective, the gradient norm, on the GPU stream: no host wait in a step)")


@pytest.mark.parametrize("case", HOST_COLLECTIVES)
def test_forbid_host_syncs_on_shared_gpus_holds_where_no_sum_goes_through_the_host(case):
    make, staged = HOST_COLLECTIVES[case]
    cfg, topology = shared(forbid_host_syncs=True, experts_backend="triton"), make()
    if staged:
        with pytest.raises(ValueError, match=re.escape("over gloo, staged through the host, which the sync check "
                                                       "refuses; set one of them off, or use a layout with one "
                                                       "attention rank per pipeline group")):
            check_host_syncs(cfg, topology)
    else:
        check_host_syncs(cfg, topology)
    check_host_syncs(cfg.model_copy(update={"ranks_per_gpu": 1, "transport": "nccl"}), topology)  # own GPUs: NCCL


def _run_topology(cfg):
    return Topology.from_config(cfg, load_model(cfg.model))


def test_shared_runs_sum_the_gradient_norm_in_the_arena_and_others_over_the_group():
    own = shared(ranks_per_gpu=1)
    assert stream_sum_width(shared(), _run_topology(shared())) == 1
    assert stream_sum_width(own, _run_topology(own)) == 0
    assert stream_sum_width(shared(mode="single"), _run_topology(shared())) == 0
    captured = own.model_copy(update={"cuda_graphs": "on", "experts_backend": "triton"})
    assert stream_sum_width(captured, _run_topology(captured)) == 1  # a captured step sums on the stream too
    cfg = shared()
    topology = _run_topology(cfg)
    layouts = receive_layouts(cfg, MessageShapes.of_run(cfg, load_model(cfg.model), topology), topology,
                              stream_sum_width(cfg, topology))
    assert all(layout.sums is not None and layout.sums.ranks == topology.world_size for layout in layouts)


def test_fp8_counters_widen_the_arena_sum_by_their_words():
    """precision fp8: the norm's word, the 4 kinds' 4 counts and one amax slot per rank and kind,
    for ranks sharing a GPU and for captured rank steps on GPUs of their own (fp8 too, since its
    gate passed: `step_capture.FP8_CHECKED_ON_GPU`); an eager run on its own GPUs sums over the
    process group."""
    from disagmoe.kernels.fp8_stats import sum_words

    fp8 = shared(precision="fp8", experts_backend="triton", hop="partial_sums", attention_ranks=1, expert_ranks=2,
                 ranks_per_gpu=3)
    own = fp8.model_copy(update={"ranks_per_gpu": 1})
    eager = own.model_copy(update={"cuda_graphs": "off"})
    assert stream_sum_width(fp8, _run_topology(fp8)) == 1 + sum_words(3) == 1 + 16 + 12
    assert stream_sum_width(own, _run_topology(own)) == 1 + sum_words(3)  # auto captures: summed on the stream
    assert stream_sum_width(eager, _run_topology(eager)) == 0  # the process group sums


def test_the_memory_check_sums_the_ranks_sharing_a_gpu():
    """Each rank fits the device alone; together with a process's context and heap margin they
    do not, and the message names the GPU, its ranks and the fix."""
    cfg = shared(model=load_model("tiny"), attention_ranks=1, expert_ranks=2)
    topology = Topology.from_config(cfg, cfg.model)
    buffers = receive_layouts(cfg, MessageShapes.of_run(cfg, cfg.model, topology), topology,
                              stream_sum_width(cfg, topology))
    sparse = dispatch_mode(cfg, cfg.model, topology)[0] == "sparse"  # auto: sparse by peer stores here
    acts = rank_activations(cfg, cfg.model, topology, pair_rows=hop_mode(cfg, cfg.model, topology)[0] == "pair_rows",
                            sparse=sparse, peer_stores=sparse)
    needs = [training_state_bytes(cfg, cfg.model, topology, r)[1] + buffers[r].nbytes + acts[r].peak_bytes
             for r in range(3)]
    assert needs == [need.total_bytes for need in rank_needs(cfg, cfg.model, topology)]
    together = sum(needs) + 3 * (PROCESS_BYTES + HEAP_MARGIN_BYTES)
    check_memory(cfg, cfg.model, topology, capacity_bytes=together, per_gpu=3)
    check_memory(cfg, cfg.model, topology, capacity_bytes=together - 1, per_gpu=1)  # one rank per GPU: fits
    with pytest.raises(ValueError, match=r"GPU 0 is shared by 3 ranks \(ranks_per_gpu=3\) needing [\d.]+ GiB "
                                         r"together \(rank 0 [\d.]+ GiB \(.* of activations .*\); rank 2 .* lower ranks_per_gpu"):
        check_memory(cfg, cfg.model, topology, capacity_bytes=together - 1, per_gpu=3)
    # two GPUs of two ranks each: GPU 1 holds ranks 2 and 3
    cfg4 = shared(model=load_model("tiny"), attention_ranks=2, expert_ranks=2)
    with pytest.raises(ValueError, match=r"GPU 0 is shared by 2 ranks"):
        check_memory(cfg4, cfg4.model, Topology.from_config(cfg4, cfg4.model), capacity_bytes=4 * 2**30, per_gpu=2)


@pytest.fixture(scope="module")
def logical_gpus():
    """An embedded Ray node that declares 2 GPUs (logical: Ray places by resources, nothing here
    touches CUDA)."""
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=8, num_gpus=2,
             log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote
class _Probe:
    def gpus(self) -> list[int]:
        return [int(i) for i in ray.get_gpu_ids()]


@pytest.mark.slow
@pytest.mark.parametrize("world, per_gpu, want", [(4, 2, [0, 0, 1, 1]), (3, 3, [0, 0, 0]), (2, 1, [0, 1])])
def test_ray_gives_each_block_of_ranks_one_gpu(logical_gpus, world, per_gpu, want):
    groups, slots = _placement_groups(world, "cuda", 0.5, timeout_s=30, ranks_per_gpu=per_gpu)
    try:
        assert len(groups) == 1 and len(slots) == world
        assert [index for _, index in slots] == [gpu_of(r, per_gpu) for r in range(world)]
        strategy = ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy
        probes = [_Probe.options(num_cpus=0.5, num_gpus=gpu_share(per_gpu),
                                 scheduling_strategy=strategy(group, placement_group_bundle_index=index)).remote()
                  for group, index in slots]
        got = ray.get([probe.gpus.remote() for probe in probes], timeout=60)
        assert [ids[0] for ids in got] == want and all(len(ids) == 1 for ids in got)
        # GPU ids are Ray's: the two blocks sit on different GPUs, every rank of a block on the same one
        for probe in probes:
            ray.kill(probe)
    finally:
        for group in groups:
            ray.util.remove_placement_group(group)
