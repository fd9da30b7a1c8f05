"""Distributed training on Ray actors (disagmoe/runtime/cluster/driver.py) against the single-process oracle.

One Ray cluster serves the module, and warm actors (one group per world size) serve every run
that does not break them; the failure tests start their own. The oracle is
`SingleProcessTrainer` on the same config: same loss at every step, same parameters
after the run (read back from the distributed run's checkpoint, which also tests the sharded
checkpoint format against the single-mode loader).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
import ray
import torch
import yaml

from disagmoe.cli.plan_cmd import build_request
from disagmoe.config import OptimConfig, Plan, TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import evaluate
from disagmoe.placement.solver import (
    best_index,
    colocated_candidates,
    disaggregated_candidates,
    price,
    problem_of,
)
from disagmoe.model import MoETransformer
from disagmoe.runtime.state.checkpoint import checkpoint_dir, load_checkpoint, read_manifest, read_shards
from disagmoe.runtime.cluster.cluster import WorkerGroup
from disagmoe.comm.nvshmem import available as nvshmem_available
from disagmoe.runtime.cluster.driver import DistributedTrainer, check_memory, rank_needs, training_state_bytes
from disagmoe.runtime.stages.messages import MessageShapes, receive_layouts, transport_buffer_bytes
from disagmoe.runtime.failures import RunWarning, TrainingFailed
from disagmoe.runtime.observe.metrics import read_metrics
from disagmoe.runtime.state.optim import build_optimizer
from disagmoe.runtime.plan_layout import apply_plan
from disagmoe.runtime.cluster.restart import FAULT_RECORD, Fault
from disagmoe.runtime.topology import Topology
from disagmoe.runtime.training.loop import METRICS_FILE
from disagmoe.runtime.training.trainer import CHECKPOINTS_DIR, SingleProcessTrainer
from disagmoe.runtime.schedule.schedule import AttentionBackward
from disagmoe.wire import Payload, Send
from disagmoe.runtime.cluster.worker import TrainWorker, _op_name

pytestmark = pytest.mark.slow  # starts processes (Ray, gloo) or compiles: the quick subset skips it

ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors run `_sleep` from here

STEPS = 5
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def ray_cluster():
    # Logical CPUs for every actor of the module (warm and fresh ones) on the 2 physical cores.
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=32,
             log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def warm(ray_cluster):
    """world size -> a started group of TrainWorker actors, reused run after run."""
    groups: dict[int, WorkerGroup] = {}

    def workers(world_size: int) -> WorkerGroup:
        if world_size not in groups:
            groups[world_size] = WorkerGroup.start(world_size, "cpu", worker_cls=TrainWorker, log_to_driver=False)
            groups[world_size].init_process_group(timeout_s=60)
        return groups[world_size]

    yield workers
    for group in groups.values():
        group.shutdown()


def run_on(warm, cfg: TrainConfig):
    world = Topology.from_config(cfg, cfg.model).world_size
    return DistributedTrainer(cfg, workers=warm(world)).run()


def tiny_model(bias_balancing: bool, aux_loss: bool = True):
    """The tiny preset: a leading dense layer, a shared expert, aux and z losses; optional bias; without
    `aux_loss` no auxiliary loss (EP blocks and replica sets then swap no loads: `Topology.load_peers`,
    `RouterConfig.needs_every_source_load`)."""
    m = load_model("tiny")
    update = {"bias_balancing": bias_balancing, "bias_update_rate": 1e-2}
    return m.model_copy(update={"router": m.router.model_copy(
        update=update if aux_loss else {**update, "aux_loss_coef": 0.0})})


def run_config(out: Path, mode: str, **fields) -> TrainConfig:
    model = tiny_model(fields.pop("bias_balancing", False), fields.pop("aux_loss", True))
    base = dict(model=model, mode=mode, steps=STEPS, batch_size=8,
                seq_len=16, micro_batches=1, eval_every=STEPS, eval_batches=1, cpu_threads=1, recv_timeout_s=60,
                optim=OptimConfig(lr=3e-3, warmup_steps=2), out_dir=str(out), trace=False)
    return TrainConfig(**{**base, **fields})


def oracle(cfg: TrainConfig, out: Path) -> tuple[list[dict], MoETransformer]:
    single = cfg.model_copy(update={"mode": "single", "out_dir": str(out), "resume": False})
    trainer = SingleProcessTrainer(single)
    trainer.run()
    return read_metrics(out / METRICS_FILE), trainer.model


def model_from_checkpoint(cfg: TrainConfig, directory: Path) -> MoETransformer:
    """The checkpoint loaded by the oracle's plain AdamW (fp32 moments, whatever the run kept)."""
    model = MoETransformer(cfg.model)
    fp32_moments = cfg.optim.model_copy(update={"state_dtype": "fp32"})
    load_checkpoint(directory, model, build_optimizer(model.named_parameters(), fp32_moments), cfg.model)
    return model


def assert_same_losses(records: list[dict], reference: list[dict]) -> None:
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference, strict=True):
        assert ("val_loss" in got) == ("val_loss" in want)
        for name in ("loss", "ce", "aux_loss", "z_loss", "val_loss")[:4 + ("val_loss" in want)]:
            assert abs(got[name] - want[name]) <= TOLERANCE * abs(want[name]) + 1e-12, (got["step"], name)
        assert got["expert_load"] == want["expert_load"]


# bf16 moments: a gradient summed in another order (1e-7 relative) may round a moment to the neighbouring
# bf16 value, which moves that element's step by up to 2^-7 of it (lr 3e-3: 2e-5 a step)
BF16_MOMENTS_TOLERANCE = 1e-4


def parameter_tolerance(cfg: TrainConfig) -> float:
    return TOLERANCE if cfg.optim.state_dtype == "fp32" else BF16_MOMENTS_TOLERANCE


def assert_same_parameters(model: MoETransformer, reference: MoETransformer, tolerance: float = TOLERANCE) -> None:
    want = reference.state_dict()
    for name, tensor in model.state_dict().items():
        ref = want[name]
        assert torch.linalg.vector_norm(tensor - ref) <= tolerance * torch.linalg.vector_norm(ref) + 1e-12, name


CASES = {
    # (attention ranks, expert ranks, pipeline groups, micro-batches) and what else the case covers
    "A1-E1-p1-m1": dict(attention_ranks=1, expert_ranks=1, pipeline_groups=1, micro_batches=1),
    "A1-E2-p1-m2-bias": dict(attention_ranks=1, expert_ranks=2, pipeline_groups=1, micro_batches=2,
                             bias_balancing=True),
    "A2-E1-p1-m4": dict(attention_ranks=2, expert_ranks=1, pipeline_groups=1, micro_batches=4),
    "A2-E2-p2-m2-bias": dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2, micro_batches=2,
                             bias_balancing=True),
    "colocated-2": dict(mode="colocated", colocated_ranks=2, micro_batches=2),
    # colocated pipeline groups: each group's ranks its own experts, COMBINE and RESIDUAL to the next group
    # (p = 2: the head on group 1, both ways on the same rank pairs; p = 3: one rank a group)
    "colocated-4-p2-bias": dict(mode="colocated", colocated_ranks=4, pipeline_groups=2, micro_batches=2,
                                bias_balancing=True),
    "colocated-3-p3": dict(mode="colocated", colocated_ranks=3, pipeline_groups=3, micro_batches=2),
    "colocated-4-p2-zero": dict(mode="colocated", colocated_ranks=4, pipeline_groups=2, micro_batches=2,
                                optim=OptimConfig(lr=3e-3, warmup_steps=2, shard_states=True)),
    # ZeRO-1: AdamW's state of the replicated parameters split over the data-parallel group
    "A2-E1-p1-m2-zero": dict(attention_ranks=2, expert_ranks=1, pipeline_groups=1, micro_batches=2,
                             optim=OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.1, shard_states=True)),
    "colocated-3-zero": dict(mode="colocated", colocated_ranks=3, micro_batches=2, batch_size=6,
                             optim=OptimConfig(lr=3e-3, warmup_steps=2, shard_states=True)),
    # bf16 moments (the oracle: the single trainer's FlatAdamW with bf16 moments), sharded and not
    "A2-E1-p1-m2-zero-bf16-moments": dict(attention_ranks=2, expert_ranks=1, pipeline_groups=1, micro_batches=2,
                                          optim=OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.1,
                                                            shard_states=True, state_dtype="bf16")),
    "colocated-2-bf16-moments": dict(mode="colocated", colocated_ranks=2, micro_batches=2,
                                     optim=OptimConfig(lr=3e-3, warmup_steps=2, state_dtype="bf16")),
    "colocated-3-bias": dict(mode="colocated", colocated_ranks=3, micro_batches=2, batch_size=6,
                             bias_balancing=True),
    # offload_optimizer (on CPU: the bucketed update through the staging slots, nothing moved), with ZeRO-1's
    # gather from the fresh compute slice, and with bf16 moments
    "A2-E1-p1-m2-zero-offload": dict(attention_ranks=2, expert_ranks=1, pipeline_groups=1, micro_batches=2,
                                     offload_optimizer=True, offload_bucket_mib=1,
                                     optim=OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.1, shard_states=True)),
    "colocated-2-bf16-moments-offload": dict(mode="colocated", colocated_ranks=2, micro_batches=2,
                                             offload_optimizer=True, offload_bucket_mib=1,
                                             optim=OptimConfig(lr=3e-3, warmup_steps=2, state_dtype="bf16")),
    # hop: pair_rows (every (token, expert) row returned as its own row; the transport's emulation on CPU):
    # several expert ranks writing one buffer, data parallel, the weights riding RESIDUAL to another
    # pipeline group, colocated ranks writing their own buffer
    "pairs-A1-E2-p1-m2": dict(attention_ranks=1, expert_ranks=2, pipeline_groups=1, micro_batches=2, hop="pair_rows"),
    "pairs-A2-E2-p2-m2": dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2, micro_batches=2, hop="pair_rows"),
    "pairs-colocated-3": dict(mode="colocated", colocated_ranks=3, micro_batches=2, batch_size=6, hop="pair_rows"),
    "pairs-colocated-4-p2": dict(mode="colocated", colocated_ranks=4, pipeline_groups=2, micro_batches=2,
                                 hop="pair_rows"),
    # dispatch: sparse (each token only to the expert ranks serving its pairs; the worst-case buffer over gloo)
    "sparse-A1-E1-p1-m1": dict(attention_ranks=1, expert_ranks=1, pipeline_groups=1, micro_batches=1,
                               dispatch="sparse"),
    "sparse-A1-E2-p1-m2-bias": dict(attention_ranks=1, expert_ranks=2, pipeline_groups=1, micro_batches=2,
                                    bias_balancing=True, dispatch="sparse"),
    "sparse-A2-E1-p1-m4": dict(attention_ranks=2, expert_ranks=1, pipeline_groups=1, micro_batches=4,
                               dispatch="sparse"),
    "sparse-A1-E3-p1-m2": dict(attention_ranks=1, expert_ranks=3, pipeline_groups=1, micro_batches=2,
                               dispatch="sparse"),
    "sparse-A2-E2-p2-m2-bias": dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2, micro_batches=2,
                                    bias_balancing=True, dispatch="sparse"),
    "sparse-colocated-2": dict(mode="colocated", colocated_ranks=2, micro_batches=2, dispatch="sparse"),
    "sparse-colocated-4-p2": dict(mode="colocated", colocated_ranks=4, pipeline_groups=2, micro_batches=2,
                                  dispatch="sparse"),
    "sparse-colocated-3-p3": dict(mode="colocated", colocated_ranks=3, pipeline_groups=3, micro_batches=2,
                                  dispatch="sparse"),
    "sparse-colocated-3-zero": dict(mode="colocated", colocated_ranks=3, micro_batches=2, batch_size=6,
                                    dispatch="sparse", optim=OptimConfig(lr=3e-3, warmup_steps=2, shard_states=True)),
    # sparse dispatch with pair rows: each received row's pairs stored at its token's pair rows, COMBINE_GRAD
    # routed back by the top-k ids riding RESIDUAL (another pipeline group's rank with p = 2), d x per source
    "sparse-pairs-A1-E2-p1-m2": dict(attention_ranks=1, expert_ranks=2, pipeline_groups=1, micro_batches=2,
                                     hop="pair_rows", dispatch="sparse"),
    "sparse-pairs-A1-E3-p1-m2": dict(attention_ranks=1, expert_ranks=3, pipeline_groups=1, micro_batches=2,
                                     hop="pair_rows", dispatch="sparse"),
    "sparse-pairs-A2-E2-p2-m2-bias": dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2, micro_batches=2,
                                          bias_balancing=True, hop="pair_rows", dispatch="sparse"),
    "sparse-pairs-colocated-2": dict(mode="colocated", colocated_ranks=2, micro_batches=2, hop="pair_rows",
                                     dispatch="sparse"),
    "sparse-pairs-colocated-3": dict(mode="colocated", colocated_ranks=3, micro_batches=2, batch_size=6,
                                     hop="pair_rows", dispatch="sparse"),
    "sparse-pairs-colocated-4-p2": dict(mode="colocated", colocated_ranks=4, pipeline_groups=2, micro_batches=2,
                                        hop="pair_rows", dispatch="sparse"),
    # EP blocks (expert_replica_sets): each source dispatches only to its own block (ranks d mod 2, d mod 2 + 2:
    # ep = 2), the blocks sum their experts' gradients; p = 2 with two ranks a group: blocks of one rank, every
    # rank all of its group's experts, dispatching to itself and combining into the next group's same index
    "colocated-4-blocks2": dict(mode="colocated", colocated_ranks=4, expert_replica_sets=2, micro_batches=2,
                                aux_loss=False, bias_balancing=True),
    "colocated-4-p2-blocks2": dict(mode="colocated", colocated_ranks=4, pipeline_groups=2, expert_replica_sets=2,
                                   micro_batches=2, aux_loss=False),
    "sparse-colocated-4-blocks2": dict(mode="colocated", colocated_ranks=4, expert_replica_sets=2, micro_batches=2,
                                       aux_loss=False, dispatch="sparse"),
    "pairs-colocated-4-blocks2": dict(mode="colocated", colocated_ranks=4, expert_replica_sets=2, micro_batches=2,
                                      aux_loss=False, hop="pair_rows"),
    "sparse-pairs-colocated-4-blocks2": dict(mode="colocated", colocated_ranks=4, expert_replica_sets=2,
                                             micro_batches=2, aux_loss=False, hop="pair_rows", dispatch="sparse"),
    # under an aux loss too each source dispatches only to its block; the blocks swap their loads (EXPERT_LOAD)
    # so each returns the micro-batch's load over all four sources: dense, sparse, pair rows, and replica sets
    "colocated-4-blocks2-aux": dict(mode="colocated", colocated_ranks=4, expert_replica_sets=2, micro_batches=2),
    "sparse-colocated-4-blocks2-aux": dict(mode="colocated", colocated_ranks=4, expert_replica_sets=2,
                                           micro_batches=2, dispatch="sparse"),
    "pairs-colocated-4-blocks2-aux": dict(mode="colocated", colocated_ranks=4, expert_replica_sets=2,
                                          micro_batches=2, hop="pair_rows"),
    "A2-E2-sets2-aux-m2": dict(attention_ranks=2, expert_ranks=2, expert_replica_sets=2, micro_batches=2),
    # disaggregated replica sets: attention rank d feeds expert rank d only
    "A2-E2-sets2-m2": dict(attention_ranks=2, expert_ranks=2, expert_replica_sets=2, micro_batches=2,
                           aux_loss=False),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_the_single_process_oracle(warm, tmp_path, case):
    fields = dict(CASES[case])
    mode = fields.pop("mode", "disaggregated")
    cfg = run_config(tmp_path / "dist", mode, **fields)
    topology = Topology.from_config(cfg, cfg.model)
    assert topology.pipeline_groups == cfg.pipeline_groups  # colocated ones too
    assert topology.dispatch_width == len(topology.expert_groups[0]) // cfg.expert_replica_sets  # its own set only
    summary = run_on(warm, cfg)
    reference, reference_model = oracle(cfg, tmp_path / "single")
    assert summary.steps == STEPS and summary.checkpoint_path is not None
    assert summary.hop == fields.get("hop", "partial_sums")
    assert summary.dispatch == fields.get("dispatch", "dense")  # auto on local: dense
    assert_same_losses(read_metrics(tmp_path / "dist" / METRICS_FILE), reference)
    assert_same_parameters(model_from_checkpoint(cfg, Path(summary.checkpoint_path)), reference_model,
                           parameter_tolerance(cfg))


RECOMPUTE_CASES = {
    # recompute: full on every rank (attention halves from their inputs, expert shares from their received rows,
    # each routed by the forward's kept ids) and selective attention, against the oracle without recomputation
    "full-A1-E2-p1-m2-bias": dict(recompute="full", attention_ranks=1, expert_ranks=2, pipeline_groups=1,
                                  micro_batches=2, bias_balancing=True),
    "full-A2-E2-p2-m2": dict(recompute="full", attention_ranks=2, expert_ranks=2, pipeline_groups=2, micro_batches=2),
    "full-colocated-2-sparse": dict(recompute="full", mode="colocated", colocated_ranks=2, micro_batches=2,
                                    dispatch="sparse"),
    "full-colocated-4-p2-sparse": dict(recompute="full", mode="colocated", colocated_ranks=4, pipeline_groups=2,
                                       micro_batches=2, dispatch="sparse"),
    "full-colocated-3-p3": dict(recompute="full", mode="colocated", colocated_ranks=3, pipeline_groups=3,
                                micro_batches=2),
    "full-pairs-A1-E2-p1-m2": dict(recompute="full", attention_ranks=1, expert_ranks=2, pipeline_groups=1,
                                   micro_batches=2, hop="pair_rows"),
    "selective-attention-A1-E2-p1-m2": dict(recompute="selective", recompute_modules=["attention"], attention_ranks=1,
                                            expert_ranks=2, pipeline_groups=1, micro_batches=2),
}


@pytest.mark.parametrize("case", RECOMPUTE_CASES)
def test_recomputation_trains_like_the_plain_oracle(warm, tmp_path, case):
    fields = dict(RECOMPUTE_CASES[case])
    mode = fields.pop("mode", "disaggregated")
    cfg = run_config(tmp_path / "dist", mode, **fields)
    summary = run_on(warm, cfg)
    reference, reference_model = oracle(cfg.model_copy(update={"recompute": "none"}), tmp_path / "single")
    assert summary.steps == STEPS
    assert_same_losses(read_metrics(tmp_path / "dist" / METRICS_FILE), reference)
    assert_same_parameters(model_from_checkpoint(cfg, Path(summary.checkpoint_path)), reference_model)


def planned(gpus: int, **request) -> Plan:
    """The planner's best disaggregated plan for the tiny model on all `gpus` H200s (64-token
    sequences, 8 per step): for so small a model its overall pick is one GPU (latency dominates)."""
    cfg = build_request("tiny", "h200-sxm", gpus, 64, 512, **request)
    candidates = disaggregated_candidates(cfg, gpus)
    candidates = candidates.take((candidates.attn + candidates.expert == gpus).nonzero()[0])
    return price(cfg, candidates.take(best_index(evaluate(problem_of(cfg), candidates), candidates))).plan


def colocated_plan(gpus: int, micro_batches: int, p: int = 1) -> Plan:
    """The planner's colocated layout on `gpus` (`p` pipeline groups, `micro_batches`), priced as a
    plan (`colocated_candidates`: the first of that depth, micro-batches and GPUs whose one round is
    the run's 8 sequences: the distributed runtime runs one round a step, `plan_layout.check_rounds`)."""
    request = build_request("tiny", "h200-sxm", gpus, 64, 512)
    candidates = colocated_candidates(request, gpus)
    seqs = 8 // (micro_batches * (gpus // p))  # per GPU and micro-batch
    index = next(i for i in range(len(candidates))
                 if candidates.p[i] == p and candidates.m[i] == micro_batches and candidates.expert[i] == gpus
                 and candidates.seqs[i] == seqs)
    return price(request, candidates.take(index)).plan


PLANS = {
    # a plan's layout and expert map; the hand-made maps are non-contiguous and differ per MoE layer
    "hand-A1-E2-m2": lambda: planned(3).model_copy(update={"micro_batches": 2, "expert_map": [
        [[r] for r in (1, 0, 0, 1, 1, 0, 1, 1)], [[r] for r in (0, 1, 1, 1, 0, 0, 1, 0)]]}),
    "hand-A2-E2-p2": lambda: planned(3).model_copy(update={  # layer 1 on group 1, layer 2 on group 0
        "attention_gpus": 2, "expert_gpus": 2, "pipeline_groups": 2, "expert_map": [[[1]] * 8, [[0]] * 8]}),
    "planner-A1-E2": lambda: planned(3),
    "planner-colocated-2": lambda: colocated_plan(2, micro_batches=2),
    # two pipeline groups of two ranks, each expert once per group: COMBINE and RESIDUAL to the next group
    "planner-colocated-4-p2": lambda: colocated_plan(4, micro_batches=2, p=2),
    # replicated experts: each sender splits a replicated expert's rows over its owners, and the
    # owners sum its gradients; layer 2 has two whole replica sets, owners in both orders
    "replicas-A2-E2-m2": lambda: planned(3).model_copy(update={
        "attention_gpus": 2, "micro_batches": 2, "expert_map": [
            [[0, 1], [1], [1, 0], [0], [1], [0, 1], [0], [1]], [[0, 1], [1, 0]] * 4]}),
    # the planner's replicas on 3 expert ranks (two experts per layer on two ranks each): the warm
    # 4-rank group of the p2 cases, not a 5-rank group of its own
    "planner-replicas-A1-E3": lambda: planned(4, max_expert_replicas=1),
    "replicas-colocated-2": lambda: colocated_plan(2, micro_batches=2).model_copy(update={"expert_map": [
        [[0, 1], [0], [0], [0], [1], [1], [1], [1, 0]], [[1], [1], [0, 1], [0], [0], [1], [0], [1]]]}),
}


@pytest.mark.parametrize("case", PLANS)
def test_a_plan_trains_like_the_single_process_oracle(warm, tmp_path, case):
    plan = PLANS[case]()
    cfg = run_config(tmp_path / "dist", "disaggregated", plan=plan)
    summary = run_on(warm, cfg)
    planned_cfg = apply_plan(cfg, cfg.model)
    assert (planned_cfg.mode, planned_cfg.micro_batches, planned_cfg.pipeline_groups) == (
        plan.layout, plan.micro_batches, plan.pipeline_groups)
    reference, reference_model = oracle(planned_cfg, tmp_path / "single")
    assert_same_losses(read_metrics(tmp_path / "dist" / METRICS_FILE), reference)
    assert_same_parameters(model_from_checkpoint(cfg, Path(summary.checkpoint_path)), reference_model)


@pytest.mark.parametrize("case", ["replicas-A2-E2-m2", "replicas-colocated-2"])
def test_a_replicated_plan_with_pair_rows_and_evaluation_trains_like_the_oracle(warm, tmp_path, case):
    """Pair rows where expert rows are split over replica owners, with evaluation passes between
    steps (the pair slots' sequence numbers count them too)."""
    cfg = run_config(tmp_path / "dist", "disaggregated", plan=PLANS[case](), hop="pair_rows", eval_every=2,
                     eval_batches=2)
    summary = run_on(warm, cfg)
    assert summary.hop == "pair_rows"
    reference, reference_model = oracle(apply_plan(cfg, cfg.model), tmp_path / "single")
    assert_same_losses(read_metrics(tmp_path / "dist" / METRICS_FILE), reference)
    assert_same_parameters(model_from_checkpoint(cfg, Path(summary.checkpoint_path)), reference_model)


SPARSE_PLANS = {
    # skewed: one expert rank serves one expert of a layer, the other seven
    "skewed-A1-E2-m2": lambda: planned(3).model_copy(update={"micro_batches": 2, "expert_map": [
        [[0]] * 7 + [[1]], [[1]] * 7 + [[0]]]}),
    # every expert on both ranks: source d feeds owner d mod 2 only, so each expert rank receives no
    # token from one of the two sources (count-0 messages)
    "empty-A2-E2-m2": lambda: planned(3).model_copy(update={"attention_gpus": 2, "micro_batches": 2, "expert_map": [
        [[0, 1]] * 8, [[1, 0]] * 8]}),
    # one source, experts with two owners: the source splits their rows over both (in its token order)
    "split-A1-E2-m2": lambda: planned(3).model_copy(update={"micro_batches": 2, "expert_map": [
        [[0, 1], [1], [1, 0], [0], [1], [0, 1], [0], [1]], [[1, 0], [0], [1], [0, 1], [0], [1], [1, 0], [0]]]}),
}


@pytest.mark.parametrize("hop", ["partial_sums", "pair_rows"])
@pytest.mark.parametrize("case", [*SPARSE_PLANS, "replicas-A2-E2-m2"])
def test_sparse_dispatch_with_skewed_routing_and_empty_messages_trains_like_the_oracle(warm, tmp_path, case, hop):
    """Either hop, with evaluation passes between steps; replicas: every expert rank's rows split
    over owners or fed by one source each."""
    plan = {**SPARSE_PLANS, **PLANS}[case]()
    cfg = run_config(tmp_path / "dist", "disaggregated", plan=plan, dispatch="sparse", hop=hop, eval_every=2)
    summary = run_on(warm, cfg)
    assert summary.dispatch == "sparse" and summary.hop == hop
    reference, reference_model = oracle(apply_plan(cfg, cfg.model), tmp_path / "single")
    assert_same_losses(read_metrics(tmp_path / "dist" / METRICS_FILE), reference)
    assert_same_parameters(model_from_checkpoint(cfg, Path(summary.checkpoint_path)), reference_model)


def _oracle_routing(cfg: TrainConfig, out: Path) -> list[tuple[int, torch.Tensor]]:
    """(layer, top-k ids [N, K]) of every MoE layer and micro-batch the oracle routes in its run."""
    trainer = SingleProcessTrainer(cfg.model_copy(update={"mode": "single", "out_dir": str(out)}))
    seen = []
    for layer, block in enumerate(trainer.model.layers):
        if hasattr(block, "route"):
            def route(h_BSH, fixed=None, saved=None, xn_BSH=None, *, _route=block.route, _layer=layer):
                routing = _route(h_BSH, fixed, saved, xn_BSH)
                seen.append((_layer, routing.topk_idx_NK.detach().clone()))
                return routing
            block.route = route
    trainer.run()
    return seen


@pytest.mark.parametrize("dispatch", ["sparse", "dense"])
def test_hop_bytes_are_the_routings_minimum_with_sparse_dispatch_and_the_dense_figure_beside(warm, tmp_path,
                                                                                              dispatch):
    cfg = run_config(tmp_path / "dist", "disaggregated", attention_ranks=2, expert_ranks=3, micro_batches=2,
                     steps=1, eval_every=0, dispatch=dispatch)
    summary = run_on(warm, cfg)
    topology = Topology.from_config(cfg, cfg.model)
    shapes = MessageShapes.of_run(cfg, cfg.model, topology)
    minimum = 0
    routed = _oracle_routing(cfg, tmp_path / "single")
    for layer, idx_NK in routed:
        rank_of_E = torch.tensor([who[0] for who in topology.expert_owners[layer]])  # one owner each here
        minimum += sum(len(set(ranks)) for ranks in rank_of_E[idx_NK].tolist())
    moe_layers = sum(topology.is_moe(layer) for layer in range(topology.num_layers))
    assert len(routed) == moe_layers * cfg.micro_batches
    record = read_metrics(tmp_path / "dist" / METRICS_FILE)[0]
    # every hop message the sparse dispatch shrinks: a token's row once per (token, serving rank), each way
    for payload in (Payload.DISPATCH, Payload.COMBINE, Payload.COMBINE_GRAD, Payload.DISPATCH_GRAD):
        name = payload.value
        dense = cfg.batch_size * cfg.seq_len * moe_layers * 3 * shapes.row_bytes(payload, False)
        want = minimum * shapes.row_bytes(payload, True) if dispatch == "sparse" else dense
        assert record["traffic"][name] == want and record["traffic"][f"{name}_dense"] == dense, name
        assert summary.traffic[name] == want and summary.traffic[f"{name}_dense"] == dense, name
        if dispatch == "sparse":
            assert want < dense  # 8 experts top-2 on 3 ranks: most tokens reach one or two of them


def test_trace_has_every_rank_and_busy_fractions(warm, tmp_path):
    cfg = run_config(tmp_path / "dist", "disaggregated", attention_ranks=2, expert_ranks=2, pipeline_groups=2,
                     micro_batches=2, steps=2, trace=True)
    run_on(warm, cfg)
    events = json.loads((tmp_path / "dist" / "trace.json").read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert names == {0: "rank 0 (A0.0)", 1: "rank 1 (A1.0)", 2: "rank 2 (E0.0)", 3: "rank 3 (E1.0)"}
    assert {e["pid"] for e in spans} == {0, 1, 2, 3}
    assert {e["cat"] for e in spans} == {"compute", "send", "wait"}
    assert all(e["dur"] >= 0 for e in spans)
    by_rank = {rank: {e["name"] for e in spans if e["pid"] == rank} for rank in names}
    assert "Loss mb1" in by_rank[1] and "AttentionForward L0 mb0" in by_rank[0]  # 3 layers: head on group 1
    assert "ExpertForward L1 mb1" in by_rank[3] and "ExpertBackward L2 mb0" in by_rank[2]
    for record in read_metrics(tmp_path / "dist" / METRICS_FILE):
        assert set(record["busy"]) == {"A0", "A1", "E0", "E1"}
        assert all(0 < f <= 1 for f in record["busy"].values())


def rank_spans(trace_path: Path) -> dict[int, list[tuple[str, float, float]]]:
    """Each rank's (name, start, end) spans from a trace file, in the order they started."""
    spans: dict[int, list[tuple[str, float, float]]] = {}
    for e in json.loads(trace_path.read_text())["traceEvents"]:
        if e["ph"] == "X":
            spans.setdefault(e["pid"], []).append((e["name"], e["ts"], e["ts"] + e["dur"]))
    return {rank: sorted(s, key=lambda span: span[1]) for rank, s in spans.items()}


def input_grad_sends(program, index: int) -> list[str]:
    """The names of the sends right after op `index` of a rank's program (a backward's input gradients)."""
    sends = []
    for op in program[index + 1:]:
        if not isinstance(op, Send):
            break
        sends.append(_op_name(op))
    return sends


@pytest.mark.parametrize("layout", [
    dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2, micro_batches=2),  # residual and combine grads
    dict(attention_ranks=2, expert_ranks=1, pipeline_groups=1, micro_batches=2),  # data parallel: ReduceGradients
])
def test_attention_ranks_send_input_gradients_before_their_weight_gradients(warm, tmp_path, layout):
    """Every AttentionBackward L<l> mb<m> is followed by the sends of its input gradients, then by
    its `AttentionWeightGrad L<l> mb<m>` span (starting after the last send ended), then the next
    op: so before any ReduceGradients or OptimizerStep; and the run is still the oracle's."""
    cfg = run_config(tmp_path / "dist", "disaggregated", steps=3, trace=True, **layout)
    summary = run_on(warm, cfg)
    reference, reference_model = oracle(cfg, tmp_path / "single")
    assert_same_losses(read_metrics(tmp_path / "dist" / METRICS_FILE), reference)
    assert_same_parameters(model_from_checkpoint(cfg, Path(summary.checkpoint_path)), reference_model)
    topology = Topology.from_config(cfg, cfg.model)
    programs = topology.programs(cfg.micro_batches)
    spans = rank_spans(tmp_path / "dist" / "trace.json")
    sends_checked = 0
    for rank in range(topology.world_size):
        if topology.attention_role(rank) is None:
            continue
        program = programs[rank]
        names = [name for name, _, _ in spans[rank]]
        for backward_index, op in enumerate(program):
            if not isinstance(op, AttentionBackward):
                continue
            sends = input_grad_sends(program, backward_index)
            weight_grad = f"AttentionWeightGrad L{op.layer} mb{op.micro_batch}"
            starts = [i for i, name in enumerate(names) if name == _op_name(op)]
            assert len(starts) == cfg.steps
            for i in starts:
                after = i + 1 + len(sends)
                assert names[i + 1:after + 1] == sends + [weight_grad], (rank, names[i:after + 2])
                assert spans[rank][after][1] >= spans[rank][after - 1][2]
                assert not names[after + 1].startswith("Send "), names[after + 1]
            sends_checked += len(sends)
    assert sends_checked > 0


def single_run_resumable_at_3(tmp_path: Path, **fields) -> tuple[list[dict], MoETransformer, Path]:
    """The oracle's whole run (metrics, final model) and a fresh out_dir holding only its step-3
    checkpoint, for another layout to resume from."""
    cfg = run_config(tmp_path / "single", "single", micro_batches=2, checkpoint_every=3, **fields)
    uninterrupted, uninterrupted_model = oracle(cfg, tmp_path / "single")
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(checkpoint_dir(tmp_path / "single" / CHECKPOINTS_DIR, 3),
                    checkpoint_dir(resumed_dir / CHECKPOINTS_DIR, 3))
    return uninterrupted, uninterrupted_model, resumed_dir


def test_single_checkpoint_resumes_disaggregated_like_an_uninterrupted_run(warm, tmp_path):
    uninterrupted, uninterrupted_model, resumed_dir = single_run_resumable_at_3(tmp_path, bias_balancing=True)
    resumed = run_config(resumed_dir, "disaggregated", attention_ranks=1, expert_ranks=2, micro_batches=2,
                         bias_balancing=True, resume=True)
    summary = run_on(warm, resumed)
    assert summary.steps == STEPS
    assert_same_losses(read_metrics(resumed_dir / METRICS_FILE), uninterrupted[3:])
    final = Path(summary.checkpoint_path)
    assert {e["file"] for e in read_manifest(final)["shards"]} == {"rank-00000.pt", "rank-00001.pt",
                                                                   "rank-00002.pt", "trainer.pt"}
    assert_same_parameters(model_from_checkpoint(resumed, final), uninterrupted_model)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_sharded_optimizer_states_resume_from_and_save_to_the_common_format(warm, tmp_path, state_dtype):
    """single (steps 1-3) -> ZeRO-1 disaggregated (4-5): the slices come from the single run's
    checkpoint, and the final checkpoint gathers them back: the same moments as the oracle's.
    bf16 moments: the checkpoints hold them in fp32; a gradient summed in another order may round
    a moment to the neighbouring bf16 value (2^-7 relative, on few elements), hence 2^-8 in norm."""
    optim = OptimConfig(lr=3e-3, warmup_steps=2, weight_decay=0.1, state_dtype=state_dtype)
    moment_tolerance = TOLERANCE if state_dtype == "fp32" else 2**-8
    uninterrupted, uninterrupted_model, resumed_dir = single_run_resumable_at_3(tmp_path, optim=optim)
    resumed = run_config(resumed_dir, "disaggregated", attention_ranks=2, expert_ranks=1, micro_batches=2,
                         resume=True, optim=optim.model_copy(update={"shard_states": True}))
    summary = run_on(warm, resumed)
    assert_same_losses(read_metrics(resumed_dir / METRICS_FILE), uninterrupted[3:])
    final = Path(summary.checkpoint_path)
    assert_same_parameters(model_from_checkpoint(resumed, final), uninterrupted_model, parameter_tolerance(resumed))
    want = checkpoint_dir(tmp_path / "single" / CHECKPOINTS_DIR, STEPS)
    got_optim, want_optim = ({k: s for f, shard in read_shards(d, read_manifest(d)).items() if f != "trainer.pt"
                              for k, s in shard["optim"].items()} for d in (final, want))
    assert got_optim.keys() == want_optim.keys()
    for key, state in want_optim.items():
        for name in ("exp_avg", "exp_avg_sq"):
            ref = state[name]
            assert got_optim[key][name].dtype == torch.float32
            assert (torch.linalg.vector_norm(got_optim[key][name] - ref)
                    <= moment_tolerance * torch.linalg.vector_norm(ref) + 1e-12)
        assert float(got_optim[key]["step"]) == float(state["step"]) == STEPS


def test_a_hung_rank_is_named_and_the_run_resumes_in_another_layout(warm, tmp_path):
    cfg = run_config(tmp_path / "run", "disaggregated", attention_ranks=1, expert_ranks=1, micro_batches=2,
                     steps=4, checkpoint_every=2, recv_timeout_s=3)
    trainer = DistributedTrainer(cfg, log_to_driver=False)

    def hang_rank_1(record):  # after step 2 (and its checkpoint) rank 1 sleeps through step 3
        if record["step"] == 2:
            trainer.workers.actors[1].run.remote(_sleep, 12.0)

    with pytest.raises(TrainingFailed) as failure:
        trainer.run(hang_rank_1)
    assert failure.value.rank == 1
    message = str(failure.value)
    assert "rank 1 (E0.0)" in message and "step 3" in message and "hung" in message
    assert "step-00000002" in message and "resume=true" in message
    resumed = cfg.model_copy(update={"mode": "colocated", "colocated_ranks": 2, "resume": True})
    run_on(warm, resumed)
    reference, _ = oracle(cfg, tmp_path / "single")
    assert_same_losses(read_metrics(tmp_path / "run" / METRICS_FILE), reference)


def _sleep(worker, seconds):
    time.sleep(seconds)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (dict(attention_ranks=2, batch_size=6, micro_batches=2), "multiple of micro_batches * data-parallel"),
        (dict(expert_ranks=9), "only 8 experts"),
        (dict(attention_ranks=64, expert_ranks=8, batch_size=64), "CPU ranks"),
        (dict(transport="nccl"), "needs GPUs"),
    ],
    ids=["batch", "experts", "slots", "transport"],
)
def test_configurations_that_cannot_run_are_refused_before_any_actor(warm, tmp_path, fields, message):
    cfg = run_config(tmp_path / "run", "disaggregated", **fields)
    with pytest.raises(ValueError, match=re.escape(message)):
        DistributedTrainer(cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("transport, hop", [("nccl", "partial_sums"), ("nvshmem", "partial_sums"),
                                            ("nvshmem", "pair_rows")])
def test_gpu_transports_on_two_gpus_match_the_oracle(ray_cluster, tmp_path, capsys, transport, hop):
    """One attention and one expert rank on two GPUs, bf16 parameters, against the single-GPU fast
    path (bf16; the fp32 oracle on CPU is what the CPU tests compare with exactly); pair rows with
    the triton experts, whose kernels store them into the attention GPU's memory."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if transport == "nvshmem" and not nvshmem_available():
        pytest.skip("needs nvshmem4py")
    backend = dict(experts_backend="triton") if hop == "pair_rows" else {}
    cfg = run_config(tmp_path / "dist", "disaggregated", attention_ranks=1, expert_ranks=1, micro_batches=2,
                     device="cuda", transport=transport, cpu_threads=None, steps=20, batch_size=16, seq_len=128,
                     hop=hop, **backend)
    summary = DistributedTrainer(cfg, log_to_driver=False).run()
    reference, _ = oracle(cfg, tmp_path / "single")
    records = read_metrics(tmp_path / "dist" / METRICS_FILE)
    for got, want in zip(records, reference, strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-2 * want["loss"], got["step"]
    assert records[-1]["loss"] < 0.8 * records[0]["loss"]
    assert summary.hop == hop
    with capsys.disabled():
        print(f"\n{transport} ({hop}), 1 A + 1 E on 2 GPUs, tiny model, 16 x 128 tokens/step: "
              f"{summary.tokens_per_s:,.0f} tokens/s")


@pytest.mark.gpu
@pytest.mark.parametrize("mode, transport, hop, dispatch", [("disaggregated", "nccl", "partial_sums", "dense"),
                                                            ("colocated", "nccl", "partial_sums", "dense"),
                                                            ("colocated", "nccl", "partial_sums", "sparse"),
                                                            ("disaggregated", "nvshmem", "partial_sums", "dense"),
                                                            ("disaggregated", "nvshmem", "partial_sums", "sparse"),
                                                            ("disaggregated", "nvshmem", "pair_rows", "dense"),
                                                            ("colocated", "nvshmem", "pair_rows", "dense")])
def test_gpu_steps_make_no_host_waits_in_every_distributed_mode(ray_cluster, tmp_path, mode, transport, hop,
                                                                dispatch):
    """Steps on two GPUs with forbid_host_syncs: every rank runs its whole program (compute, nccl
    sends and receives, the optimizer step) under set_sync_debug_mode('error'), so any host wait
    inside a step raises; only the step's one read at the end is outside it."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    if transport == "nvshmem" and not nvshmem_available():
        pytest.skip("needs nvshmem4py")
    cfg = run_config(tmp_path / "dist", mode, attention_ranks=1, expert_ranks=1, colocated_ranks=2, micro_batches=2,
                     device="cuda", transport=transport, cpu_threads=None, steps=3, batch_size=8, seq_len=64,
                     forbid_host_syncs=True, hop=hop, experts_backend="triton",  # loop reads offsets on the host
                     dispatch=dispatch)
    summary = DistributedTrainer(cfg, log_to_driver=False).run()
    assert summary.steps == 3 and summary.final_loss is not None and summary.hop == hop
    assert summary.dispatch == dispatch


SHARED_CASES = {
    # one GPU shared by every rank over nvshmem (ranks_per_gpu = world size): every layout of the
    # two-GPU tests and more, both hops, evaluation at the end
    "A1-E1-sums": dict(attention_ranks=1, expert_ranks=1, hop="partial_sums"),
    "A1-E1-pairs": dict(attention_ranks=1, expert_ranks=1, hop="pair_rows"),
    "A1-E2-pairs": dict(attention_ranks=1, expert_ranks=2, hop="pair_rows", dispatch="dense"),  # auto: sparse
    "A2-E1-sums": dict(attention_ranks=2, expert_ranks=1, hop="partial_sums"),
    "A2-E2-p2-pairs": dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2, hop="pair_rows"),
    "colocated-2-pairs": dict(mode="colocated", colocated_ranks=2, hop="pair_rows", dispatch="dense"),
    "colocated-3-sums": dict(mode="colocated", colocated_ranks=3, batch_size=12, hop="partial_sums"),
    "replicas-A2-E2-pairs": dict(plan="replicas-A2-E2-m2", hop="pair_rows", dispatch="dense"),
    # sparse dispatch over nvshmem (auto picks it there with partial sums and several expert ranks)
    "A1-E2-sparse": dict(attention_ranks=1, expert_ranks=2, hop="partial_sums", dispatch="sparse"),
    "A1-E3-sparse": dict(attention_ranks=1, expert_ranks=3, hop="partial_sums", dispatch="sparse"),
    "skewed-A1-E2-sparse": dict(plan="skewed-A1-E2-m2", hop="partial_sums", dispatch="sparse"),
    # two sources: each expert rank returns both sources' d x in one launch (`send_counted`)
    "A2-E2-sparse": dict(attention_ranks=2, expert_ranks=2, hop="partial_sums", dispatch="sparse"),
    "colocated-2-sparse": dict(mode="colocated", colocated_ranks=2, hop="partial_sums", dispatch="sparse"),
    # COMBINE by peer stores to the next group's attention rank; count-0 messages (source d feeds owner d only)
    "A2-E2-p2-sparse": dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2, hop="partial_sums",
                            dispatch="sparse"),
    "empty-A2-E2-sparse": dict(plan="empty-A2-E2-m2", hop="partial_sums", dispatch="sparse"),
    # sparse dispatch with pair rows: the rows of each received token stored at its pair rows, COMBINE_GRAD
    # (dy of the tokens each expert rank served) and DISPATCH_GRAD (d x alone) by one launch each
    "A1-E2-sparse-pairs": dict(attention_ranks=1, expert_ranks=2, hop="pair_rows", dispatch="sparse"),
    # EP blocks and replica sets under tiny's aux loss: each source feeds its own block, and the blocks
    # swap their expert loads (EXPERT_LOAD) over the real transport before each expert backward
    "colocated-4-blocks-sums": dict(mode="colocated", colocated_ranks=4, expert_replica_sets=2, hop="partial_sums",
                                    dispatch="dense"),
    "colocated-4-blocks-sparse": dict(mode="colocated", colocated_ranks=4, expert_replica_sets=2,
                                      hop="partial_sums", dispatch="sparse"),
    "sets-A2-E2-pairs": dict(attention_ranks=2, expert_ranks=2, expert_replica_sets=2, hop="pair_rows",
                             dispatch="dense"),
    "A1-E3-sparse-pairs": dict(attention_ranks=1, expert_ranks=3, hop="pair_rows", dispatch="sparse"),
}


SHARED_FP8_CASES = {
    # precision fp8 on one shared GPU: the layouts the FP8 experts take (partial sums; pair rows are
    # refused under fp8), dense and sparse dispatch, against the same layout in bf16
    "fp8-A1-E1-sums": dict(attention_ranks=1, expert_ranks=1, hop="partial_sums"),
    "fp8-A1-E2-sums": dict(attention_ranks=1, expert_ranks=2, hop="partial_sums", dispatch="dense"),
    "fp8-A1-E2-sparse": dict(attention_ranks=1, expert_ranks=2, hop="partial_sums", dispatch="sparse"),
    "fp8-colocated-2-sums": dict(mode="colocated", colocated_ranks=2, hop="partial_sums"),
}


def shared_gpu_config(out: Path, case: str, **extra) -> TrainConfig:
    fields = dict({**SHARED_CASES, **SHARED_FP8_CASES}[case])
    mode = fields.pop("mode", "disaggregated")
    if "plan" in fields:
        fields["plan"] = {**PLANS, **SPARSE_PLANS}[fields["plan"]]()
    world = Topology.from_config(apply_plan(run_config(out, mode, **fields), tiny_model(False)),
                                 tiny_model(False)).world_size
    backend = "triton" if fields["hop"] == "pair_rows" else "loop"
    # fuse_elementwise off: each run's processes would compile their fused kernels anew (the
    # single-GPU tests cover them); the distributed path is what these runs test
    base = dict(micro_batches=2, device="cuda", transport="nvshmem", ranks_per_gpu=world, cpu_threads=None,
                steps=8, batch_size=16, seq_len=128, experts_backend=backend, recv_timeout_s=120,
                fuse_elementwise=False)
    return run_config(out, mode, **{**base, **fields, **extra})


def assert_ran_as_asked(summary, cfg: TrainConfig) -> None:
    """N distinct processes on the one GPU, over nvshmem, with the hop asked for: no fallback to
    one process or to another hop."""
    world = Topology.from_config(apply_plan(cfg, cfg.model), cfg.model).world_size
    assert summary.time_sliced and summary.gpus == 1 and summary.ranks_per_gpu == world
    assert len({p["pid"] for p in summary.processes}) == world == len(summary.processes)
    assert {(p["device"], p["transport"], p["hop"]) for p in summary.processes} == {("cuda:0", "nvshmem", cfg.hop)}
    if cfg.dispatch != "auto":
        assert summary.dispatch == cfg.dispatch


def needs_shared_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    if not nvshmem_available():
        pytest.skip("needs nvshmem4py")


@pytest.mark.gpu
@pytest.mark.parametrize("case", SHARED_CASES)
def test_gpu_every_layout_on_one_shared_gpu_matches_the_oracle(ray_cluster, tmp_path, case):
    """The two-GPU oracle test's tolerance (bf16 against the single-GPU fast path), with all ranks
    of the layout time-slicing one GPU over the real NVSHMEM transport and kernels."""
    needs_shared_gpu()
    cfg = shared_gpu_config(tmp_path / "dist", case)
    with pytest.warns(RunWarning, match="time-sliced, not a speed measurement"):
        trainer = DistributedTrainer(cfg, log_to_driver=False)
    summary = trainer.run()
    assert_ran_as_asked(summary, cfg)
    reference, _ = oracle(apply_plan(cfg, cfg.model), tmp_path / "single")
    records = read_metrics(tmp_path / "dist" / METRICS_FILE)
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for got, want in zip(records, reference, strict=True):
        assert abs(got["loss"] - want["loss"]) <= 1e-2 * want["loss"], (got["step"], got["loss"], want["loss"])
        assert got["time_sliced"] is True
    assert abs(summary.final_val_loss - reference[-1]["val_loss"]) <= 1e-2 * reference[-1]["val_loss"]
    if summary.dispatch == "sparse":  # every counted hop message at most all T tokens' rows (the peer stores')
        counted = {name: sent for name, sent in summary.traffic.items() if not name.endswith("_dense")}
        assert {"dispatch", "combine_grad", "dispatch_grad"} <= counted.keys()
        assert ("combine" in counted) == (summary.hop == "partial_sums")
        # a sparse row carries its token index (and ids) beside the dense row's values: where a set has
        # one expert rank every token goes there, and the count exceeds the dense figure by that much
        shapes = MessageShapes.of_run(apply_plan(cfg, cfg.model), cfg.model, Topology.from_config(cfg, cfg.model))
        for name, sent in counted.items():
            payload = Payload(name)
            overhead = shapes.row_bytes(payload, True) / shapes.row_bytes(payload, False)
            assert 0 < sent <= summary.traffic[f"{name}_dense"] * overhead, (name, counted, summary.traffic)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["A1-E1-sums", "A1-E1-pairs", "A1-E2-pairs", "A2-E2-p2-pairs", "A1-E3-sparse",
                                  "A2-E2-p2-sparse", "A1-E3-sparse-pairs"])
def test_gpu_shared_steps_make_no_host_waits_where_no_sum_goes_through_gloo(ray_cluster, tmp_path, case):
    """The two-GPU zero-sync test in its one-GPU form: the layouts whose only collective is the
    gradient norm (one attention rank per pipeline group, no replicated experts) sum it on the
    stream over the arena, so every rank's whole step runs under set_sync_debug_mode('error')."""
    needs_shared_gpu()
    cfg = shared_gpu_config(tmp_path / "dist", case, steps=3, batch_size=8, seq_len=64, forbid_host_syncs=True,
                            experts_backend="triton")  # the loop backend reads offsets on the host
    with pytest.warns(RunWarning, match=r"the gradient norm, on the GPU stream: no host wait in a step"):
        trainer = DistributedTrainer(cfg, log_to_driver=False)
    summary = trainer.run()
    assert summary.steps == 3 and summary.final_loss is not None
    assert_ran_as_asked(summary, cfg)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["A1-E1-sums", "A1-E2-pairs", "A2-E2-p2-pairs"])
def test_gpu_shared_ranks_pairing_their_expert_weight_gradients_train_as_unpaired_ones(ray_cluster, tmp_path, case):
    """expert_wgrad_pairs on the expert ranks (`runtime.cluster.worker`, `kernels.wgrad_pairs`): every rank on
    one GPU over nvshmem, the triton experts in bf16, three micro-batches (a pair and one alone, before the
    optimizer step), 6 steps, the rank steps captured where the layout allows: the losses with pairs on
    within 1e-2 relative of off's at every step (the two differ in the fp32 main gradients' summation order,
    then in bf16 weights), and the summary says which ran."""
    needs_shared_gpu()
    losses = {}
    for pairs in ("off", "on"):
        cfg = shared_gpu_config(tmp_path / pairs, case, steps=6, micro_batches=3, batch_size=12, seq_len=64,
                                experts_backend="triton", expert_wgrad_pairs=pairs, eval_every=0)
        with pytest.warns(RunWarning, match="time-sliced, not a speed measurement"):
            trainer = DistributedTrainer(cfg, log_to_driver=False)
        assert trainer.cfg.pairs_expert_wgrads == (pairs == "on")
        summary = trainer.run()
        assert_ran_as_asked(summary, cfg)
        assert summary.expert_wgrad_pairs == (pairs == "on")
        losses[pairs] = [r["loss"] for r in read_metrics(tmp_path / pairs / METRICS_FILE)]
    assert len(losses["on"]) == len(losses["off"]) == 6
    for on, off in zip(losses["on"], losses["off"], strict=True):
        assert abs(on - off) <= 1e-2 * off, (losses["on"], losses["off"])


def needs_fp8_gpu() -> None:
    needs_shared_gpu()
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs FP8 tensor cores")


def assert_fp8_fields(record: dict) -> None:
    """A step record's FP8 numerics, reduced over the ranks: every kind counted, nothing non-finite,
    nothing saturated (the scale is amax / 448 by construction)."""
    assert record["fp8_nonfinite"] == [] and "fp8_update_skipped" not in record, record
    assert record["fp8_saturated_share"] == 0.0 and record["fp8_underflow_share"] < 0.1, record
    assert record["fp8_amax"] == pytest.approx(448.0, rel=1e-6), record
    assert all(record["fp8_by_kind"][k]["elements"] > 0 for k in ("activations", "weights", "gradients")), record


@pytest.mark.gpu
@pytest.mark.parametrize("case", SHARED_FP8_CASES)
def test_gpu_fp8_on_one_shared_gpu_tracks_the_same_layout_in_bf16(ray_cluster, tmp_path, case):
    """precision fp8 in the distributed modes (every expert rank runs the FP8 experts with its own
    counters, reduced over the ranks in the step's one sum), all ranks time-slicing one GPU over
    nvshmem, 8 steps: the loss within 3% of the same layout in bf16 (triton experts) at every
    step and at the evaluation, and every record carrying the FP8 fields."""
    needs_fp8_gpu()
    records = {}
    for precision in ("bf16", "fp8"):
        cfg = shared_gpu_config(tmp_path / precision, case, precision=precision, experts_backend="triton")
        with pytest.warns(RunWarning, match="time-sliced, not a speed measurement"):
            trainer = DistributedTrainer(cfg, log_to_driver=False)
        summary = trainer.run()
        assert_ran_as_asked(summary, cfg)
        records[precision] = (read_metrics(tmp_path / precision / METRICS_FILE), summary)
    (fp8, fp8_summary), (bf16, bf16_summary) = records["fp8"], records["bf16"]
    assert [r["step"] for r in fp8] == [r["step"] for r in bf16] == list(range(1, 9))
    for got, want in zip(fp8, bf16, strict=True):
        assert abs(got["loss"] - want["loss"]) <= 0.03 * want["loss"], (got["step"], got["loss"], want["loss"])
        assert_fp8_fields(got)
        assert "fp8_amax" not in want
    assert abs(fp8_summary.final_val_loss - bf16_summary.final_val_loss) <= 0.03 * bf16_summary.final_val_loss


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["fp8-A1-E2-sums", "fp8-A1-E2-sparse"])
def test_gpu_fp8_shared_steps_make_no_host_waits(ray_cluster, tmp_path, case):
    """The zero-sync test under precision fp8: the FP8 weight copies, the counters and their
    reduction (in the gradient norm's on-stream sum) and the skip flag make no host wait."""
    needs_fp8_gpu()
    cfg = shared_gpu_config(tmp_path / "dist", case, steps=3, batch_size=8, seq_len=64, forbid_host_syncs=True,
                            experts_backend="triton", precision="fp8")
    with pytest.warns(RunWarning, match=r"the gradient norm, on the GPU stream: no host wait in a step"):
        trainer = DistributedTrainer(cfg, log_to_driver=False)
    summary = trainer.run()
    assert summary.steps == 3 and summary.final_loss is not None
    assert_ran_as_asked(summary, cfg)
    for record in read_metrics(tmp_path / "dist" / METRICS_FILE):
        assert_fp8_fields(record)


@pytest.mark.gpu
def test_gpu_a_shared_run_resumes_in_another_shared_layout(ray_cluster, tmp_path):
    """Steps 1-4 disaggregated (1 A + 2 E, pair rows) on one GPU, steps 5-8 colocated on it from
    that checkpoint: the losses of the single-GPU run of all 8 steps (a constant learning rate
    after warm-up, so the 4-step run's schedule is the 8-step run's)."""
    needs_shared_gpu()
    constant = OptimConfig(lr=3e-3, warmup_steps=2, min_lr_ratio=1.0)
    first = shared_gpu_config(tmp_path / "run", "A1-E2-pairs", steps=4, optim=constant)
    DistributedTrainer(first, log_to_driver=False).run()
    second = shared_gpu_config(tmp_path / "run", "colocated-2-pairs", resume=True, optim=constant)
    summary = DistributedTrainer(second, log_to_driver=False).run()
    assert summary.steps == 8 and summary.ranks_per_gpu == 2
    reference, _ = oracle(second, tmp_path / "single")
    for got, want in zip(read_metrics(tmp_path / "run" / METRICS_FILE), reference, strict=True):
        assert got["step"] == want["step"]
        assert abs(got["loss"] - want["loss"]) <= 1e-2 * want["loss"], (got["step"], got["loss"], want["loss"])


@pytest.mark.gpu
def test_gpu_a_killed_rank_on_a_shared_gpu_restarts_to_the_uninterrupted_result(ray_cluster, tmp_path):
    needs_shared_gpu()
    clean_cfg = shared_gpu_config(tmp_path / "clean", "A1-E2-pairs", steps=6, checkpoint_every=2)
    clean = DistributedTrainer(clean_cfg, log_to_driver=False).run()
    faulted_cfg = shared_gpu_config(tmp_path / "run", "A1-E2-pairs", steps=6, checkpoint_every=2, max_restarts=1,
                                    fault_injection={"rank": 2, "step": 4})
    trainer = DistributedTrainer(faulted_cfg, log_to_driver=False)
    first_pids = {p["pid"] for p in trainer.processes}
    with pytest.warns(RunWarning) as warned:
        summary = trainer.run()
    lines = [str(w.message) for w in warned if "restart 1 of 1" in str(w.message)]
    assert len(lines) == 1 and "rank 2 (E0.1) failed during train_step of step 4" in lines[0], lines
    assert summary.restarts == 1 and summary.steps == 6
    assert first_pids.isdisjoint(p["pid"] for p in summary.processes)  # new processes after the restart
    assert_ran_as_asked(summary, faulted_cfg)
    got, want = (read_metrics(d / METRICS_FILE) for d in (tmp_path / "run", tmp_path / "clean"))
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 7))
    for a, b in zip(got, want, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-3 * b["loss"], (a["step"], a["loss"], b["loss"])
    assert abs(summary.final_loss - clean.final_loss) <= 1e-3 * clean.final_loss


def test_the_summary_names_every_ranks_process_transport_and_hop(warm, tmp_path):
    cfg = run_config(tmp_path / "dist", "disaggregated", attention_ranks=1, expert_ranks=2, micro_batches=2, steps=1,
                     hop="pair_rows", routing="balanced")
    summary = run_on(warm, cfg)
    assert [p["rank"] for p in summary.processes] == [0, 1, 2]
    assert len({p["pid"] for p in summary.processes}) == 3 and {p["pid"] for p in summary.processes} != {os.getpid()}
    assert [p["role"] for p in summary.processes] == ["A0.0", "E0.0", "E0.1"]
    assert {(p["device"], p["transport"], p["hop"], p["dispatch"]) for p in summary.processes} == {
        ("cpu", "local", "pair_rows", "dense")}
    assert [p["dense_precision"] for p in summary.processes] == ["fp32", None, None]  # an attention rank's only
    # the expert ranks read the tiles tuned for `routing: balanced`'s even loads (`tile_configs.LOADS`)
    assert [p["expert_loads"] for p in summary.processes] == [None, "even", "even"]
    assert summary.dispatch == "dense"
    assert (summary.transport, summary.time_sliced, summary.ranks_per_gpu, summary.gpus) == ("local", False, 1, None)
    assert json.loads(json.dumps(summary.to_dict()))["processes"][1]["role"] == "E0.0"
    predicted = [need.predicted_peak_gib for need in rank_needs(cfg, cfg.model, Topology.from_config(cfg, cfg.model))]
    assert summary.predicted_peak_gib_per_rank == predicted and summary.predicted_peak_gib == max(predicted) > 0
    needs = rank_needs(cfg, cfg.model, Topology.from_config(cfg, cfg.model))
    assert summary.transport_gib_per_rank == [need.received_bytes / 2**30 for need in needs]
    # under pair_rows the attention rank receives only pair rows, which the send/recv emulation stages
    # per message (comm.base.pair_target), not in reserved slots (runtime.schedule.recv_slots)
    assert summary.transport_gib_per_rank[0] == 0 and all(gib > 0 for gib in summary.transport_gib_per_rank[1:])
    record = read_metrics(Path(cfg.out_dir) / METRICS_FILE)[0]
    assert (record["predicted_peak_gib_per_rank"], record["peak_memory_gib_per_rank"]) == (predicted, [None] * 3)


def test_a_rank_whose_training_state_exceeds_the_device_is_refused(tmp_path):
    cfg = run_config(tmp_path / "run", "disaggregated", attention_ranks=1, expert_ranks=2)
    topology = Topology.from_config(cfg, cfg.model)
    check_memory(cfg, cfg.model, topology, capacity_bytes=1e9)  # the tiny model fits anywhere
    with pytest.raises(ValueError, match=r"rank 0 \(A0.0\) holds [\d,]+ parameters and needs [\d.]+ GiB: .* GiB of "
                                         r"transport buffers \(receive buffers\) and [\d.]+ GiB of activations \(\d+ micro-batches in flight "
                                         r"at .*\), on a 0.0 GiB device; .*`disagmoe plan`"):
        check_memory(cfg, cfg.model, topology, capacity_bytes=1e6)


@pytest.mark.parametrize("transport, factor", [("nvshmem", 0.5), ("nccl", 2.0)])
def test_a_capacity_factor_that_cannot_apply_is_refused_before_start(tmp_path, transport, factor):
    cfg = run_config(tmp_path / "run", "disaggregated", attention_ranks=1, expert_ranks=1, transport=transport,
                     transport_capacity_factor=factor)
    with pytest.raises(ValueError, match=f"transport_capacity_factor={factor:g}: every message .* at >= 1"):
        DistributedTrainer(cfg)


def test_the_memory_check_counts_each_transports_receive_buffers(tmp_path):
    """nccl keeps one buffer per shared receive slot (fewer than the keys); nvshmem a ring per pool
    (`reuse_order.one_sided_slots`: more segments than nccl's slots, fewer than two per key), in an
    arena as large as the largest rank's on every rank. `rank_needs` counts these
    (`transport_buffer_bytes`)."""
    cfg = run_config(tmp_path / "run", "disaggregated", attention_ranks=1, expert_ranks=1, micro_batches=2)
    topology = Topology.from_config(cfg, cfg.model)
    shapes = MessageShapes.of_run(cfg, cfg.model, topology)
    nccl_cfg = cfg.model_copy(update={"transport": "nccl"})
    nccl = transport_buffer_bytes(nccl_cfg, shapes, topology)
    nvshmem = transport_buffer_bytes(cfg.model_copy(update={"transport": "nvshmem"}), shapes, topology)
    received = [sum(spec_bytes(s) for seg in layout.segments for s in seg.specs)
                for layout in receive_layouts(nccl_cfg, shapes, topology)]  # a buffer per key
    assert nvshmem[0] == nvshmem[1] < 2 * max(received)  # nvshmem: rings, fewer than two segments per key
    assert nvshmem[0] > max(nccl)  # a ring holds more than nccl's slots (a one-sided sender runs ahead)
    assert all(n < r for n, r in zip(nccl, received))  # nccl: the gradients' slots shared (`recv_slots`)
    assert [need.received_bytes for need in rank_needs(cfg, cfg.model, topology)] == transport_buffer_bytes(
        cfg, shapes, topology)


def test_sharded_optimizer_states_count_a_share_of_the_moments_per_attention_rank(tmp_path):
    """Bytes per parameter as FlatAdamW holds them (roofline.optimizer_state): ZeRO-1 over D = 2
    splits the master, the moments and the reduced slice of the replicated parameters."""
    plain = run_config(tmp_path / "run", "disaggregated", attention_ranks=2, expert_ranks=1, micro_batches=2)
    sharded = plain.model_copy(update={"optim": plain.optim.model_copy(update={"shard_states": True})})
    topology = Topology.from_config(plain, plain.model)
    for rank in range(topology.world_size):
        params, plain_bytes = training_state_bytes(plain, plain.model, topology, rank)
        _, sharded_bytes = training_state_bytes(sharded, sharded.model, topology, rank)
        assert plain_bytes == 16 * params  # fp32 on CPU: parameters are the masters, + gradient + moments
        if topology.attention_role(rank) is None:  # the expert rank keeps its whole state
            assert sharded_bytes == plain_bytes
        else:  # 16 -> 4 + 4 + (8 + 4) / 2 bytes per replicated parameter (the attention ranks hold no experts)
            assert sharded_bytes == pytest.approx(14 * params)
    bf16 = plain.model_copy(update={"precision": "bf16"})
    bf16_sharded = sharded.model_copy(update={"precision": "bf16"})
    params, bf16_bytes = training_state_bytes(bf16, bf16.model, topology, 0)
    assert bf16_bytes == 18 * params  # bf16 parameter, fp32 master and gradient, two fp32 moments
    assert training_state_bytes(bf16_sharded, bf16.model, topology, 0)[1] == pytest.approx((6 + 16 / 2) * params)


@pytest.mark.parametrize(("precision", "whole", "zero1"), [("fp32", 12, 4 + 4 + 8 / 2), ("bf16", 14, 6 + 12 / 2)])
def test_bf16_moments_count_two_bytes_each(tmp_path, precision, whole, zero1):
    cfg = run_config(tmp_path / "run", "disaggregated", attention_ranks=2, expert_ranks=1, micro_batches=2,
                     precision=precision, optim=OptimConfig(state_dtype="bf16"))
    sharded = cfg.model_copy(update={"optim": cfg.optim.model_copy(update={"shard_states": True})})
    topology = Topology.from_config(cfg, cfg.model)
    for rank in range(topology.world_size):
        params, state = training_state_bytes(cfg, cfg.model, topology, rank)
        assert state == whole * params
        attention = topology.attention_role(rank) is not None
        want = zero1 if attention else whole
        assert training_state_bytes(sharded, cfg.model, topology, rank)[1] == pytest.approx(want * params)


@pytest.mark.parametrize("outcome", ["completed", "failed"])
def test_a_trace_that_cannot_be_written_is_a_warning_not_the_outcome(tmp_path, monkeypatch, outcome):
    """The trace is written in `run`'s finally: its OSError must neither fail a completed run nor
    replace the failure that ended one."""
    from disagmoe.runtime.cluster import driver
    from disagmoe.runtime.failures import RunWarning

    def unwritable(path, *args):
        raise PermissionError(13, "Permission denied", str(path))

    def run_steps(on_step):
        if outcome == "failed":
            raise TrainingFailed(1, "rank 1 (E0.0) died")
        return "summary"

    trainer = object.__new__(DistributedTrainer)
    trainer.cfg = run_config(tmp_path, "disaggregated", trace=True)
    trainer.out_dir, trainer.spans, trainer.rank_names, trainer.owns_workers = tmp_path, {}, {}, False
    monkeypatch.setattr(driver, "write_chrome_trace", unwritable)
    monkeypatch.setattr(trainer, "_run", run_steps)
    with pytest.warns(RunWarning, match=rf"trace not written: {tmp_path / 'trace.json'}: Permission denied"):
        if outcome == "failed":
            with pytest.raises(TrainingFailed, match="rank 1"):
                trainer.run()
        else:
            assert trainer.run() == "summary"


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process `pid` has exited (Ray kills actors asynchronously: allow it a moment)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


RESTART_FIELDS = dict(attention_ranks=1, expert_ranks=1, micro_batches=2, steps=4, bias_balancing=True)


@pytest.fixture(scope="module")
def uninterrupted(warm, tmp_path_factory):
    """The restart tests' run without a fault (checkpoints every 2 steps; checkpoints leave the
    numbers as they are, which the from-checkpoint case's bit-for-bit resume shows): its config
    and summary."""
    clean = run_config(tmp_path_factory.mktemp("clean"), "disaggregated", **RESTART_FIELDS, checkpoint_every=2)
    return clean, run_on(warm, clean)


def assert_restarted_to_the_uninterrupted_result(uninterrupted, faulted: TrainConfig, line: str, first_pids: list[int],
                                                  steps: int, restarts: int, checkpoint_path: str) -> None:
    """A run whose expert rank was killed during step 3 (max_restarts=1): one restart line naming
    the rank and where it resumed, the fault's record, the first group gone, and every step's
    figures and the final parameters bit for bit those of the run without the fault."""
    clean, clean_summary = uninterrupted
    resumed_from = "step-00000002" if faulted.checkpoint_every else "from step 0 (no complete checkpoint yet)"
    assert "restart 1 of 1" in line and resumed_from in line, line
    assert "rank 1 (E0.0) failed during train_step of step 3" in line and "died" in line, line
    assert "resume=true" not in line  # the failure's advice to resume by hand is the restart's job here
    record = json.loads((Path(faulted.out_dir) / FAULT_RECORD).read_text())
    assert (record["rank"], record["step"], record["pid"]) == (1, 3, first_pids[1])
    assert _gone(first_pids[1]) and _gone(first_pids[0])  # the whole group was torn down
    assert steps == 4 and restarts == 1
    got, want = (read_metrics(Path(cfg.out_dir) / METRICS_FILE) for cfg in (faulted, clean))
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    for name in ("loss", "ce", "aux_loss", "z_loss", "grad_norm", "expert_load"):
        assert [r[name] for r in got] == [r[name] for r in want], name
    final, reference = (model_from_checkpoint(clean, Path(c)) for c in (checkpoint_path, clean_summary.checkpoint_path))
    for name, tensor in final.state_dict().items():
        assert torch.equal(tensor, reference.state_dict()[name]), name


def test_a_killed_expert_actor_restarts_the_run_from_step_0_to_the_uninterrupted_result(uninterrupted, tmp_path):
    """fault_injection SIGKILLs the expert rank's process during step 3; with max_restarts=1 and no
    checkpoint the run prints one restart line, starts new actors, starts again from step 0 and
    ends bit for bit where the same run without the fault ends."""
    faulted = run_config(tmp_path / "run", "disaggregated", **RESTART_FIELDS, checkpoint_every=0, max_restarts=1,
                         fault_injection={"rank": 1, "step": 3})
    trainer = DistributedTrainer(faulted, log_to_driver=False)
    first_pids = [ray.get(actor.info.remote())["pid"] for actor in trainer.workers.actors]
    with pytest.warns(RunWarning) as warned:
        summary = trainer.run()
    lines = [str(w.message) for w in warned if issubclass(w.category, RunWarning)]
    assert len(lines) == 1, lines
    assert_restarted_to_the_uninterrupted_result(uninterrupted, faulted, lines[0], first_pids, summary.steps,
                                                 summary.restarts, summary.checkpoint_path)


def test_train_restarts_a_killed_expert_actor_from_its_checkpoint_by_itself(uninterrupted, tmp_path, monkeypatch):
    """`disagmoe train` with max_restarts=1 and the expert rank's process SIGKILLed during step 3
    (fault_injection, as command-line overrides): one `warning: restart` line, exit 0, the JSON
    summary's restart count; the run resumed from step 2's checkpoint and ended bit for bit where
    the run without the fault ended, at the single-process oracle's loss. (Through the CLI on this
    module's Ray cluster: the CLI's own cluster start is the README demo's.)"""
    from typer.testing import CliRunner

    from disagmoe.cli.app import app

    clean, _ = uninterrupted
    faulted = run_config(tmp_path / "run", "disaggregated", **RESTART_FIELDS, checkpoint_every=2, max_restarts=1,
                         fault_injection={"rank": 1, "step": 3})
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(faulted.model_dump(mode="json", exclude={"max_restarts", "fault_injection"})))
    started = []  # each start's pids: the first group's, then the restart's
    start = DistributedTrainer._start

    def recording_start(self, workers, resume_from):
        start(self, workers, resume_from)
        started.append([p["pid"] for p in self.processes])

    monkeypatch.setattr(DistributedTrainer, "_start", recording_start)
    result = CliRunner().invoke(app, ["train", "--config", str(config), "--json", "max_restarts=1",
                                      "fault_injection.rank=1", "fault_injection.step=3"])
    assert result.exit_code == 0, result.output
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and warnings[0].startswith("warning: restart 1 of 1 (max_restarts=1) from "), warnings
    assert len(started) == 2
    summary = json.loads(result.stdout)
    assert_restarted_to_the_uninterrupted_result(uninterrupted, faulted, warnings[0], started[0], summary["steps"],
                                                 summary["restarts"], summary["checkpoint_path"])
    reference, _ = oracle(clean, tmp_path / "single")
    assert abs(summary["final_loss"] - reference[-1]["loss"]) <= TOLERANCE * reference[-1]["loss"]


def test_without_restarts_left_a_dead_rank_ends_the_run_naming_it(warm, tmp_path):
    """A rank whose process dies (here fault_injection's SIGKILL of rank 0 during step 2) is named
    in the run's report, which says there is no checkpoint to resume from yet."""
    cfg = run_config(tmp_path / "run", "disaggregated", steps=3, fault_injection={"rank": 0, "step": 2})
    with pytest.raises(TrainingFailed) as failure:
        DistributedTrainer(cfg, log_to_driver=False).run()
    assert failure.value.rank == 0 and "rank 0 (A0.0) failed during train_step of step 2" in str(failure.value)
    assert "died" in str(failure.value) and "no checkpoint yet" in str(failure.value)
    # fired once per run: a resume of this out_dir does not fire it again, a fresh run (resume=false) does
    assert Fault(cfg.fault_injection, tmp_path / "run", fresh_run=False).due(2) is False
    assert Fault(cfg.fault_injection, tmp_path / "run", fresh_run=True).due(2) is True


def test_a_fault_for_a_rank_the_run_lacks_or_in_single_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match=re.escape("fault_injection.rank=2 but the run has 2 ranks (0-1)")):
        DistributedTrainer(run_config(tmp_path / "run", "disaggregated", fault_injection={"rank": 2, "step": 1}))
    with pytest.raises(ValueError, match="fault_injection kills a Ray actor: it needs mode disaggregated"):
        run_config(tmp_path / "run", "single", fault_injection={"rank": 0, "step": 1})


def test_a_damaged_expert_shard_of_the_newest_checkpoint_is_skipped_for_the_previous_one(warm, tmp_path):
    """Not rank 0 blamed for rank 2's bad shard: the driver checks every shard before any rank
    loads, names the file in one warning and resumes from the step before, as the run went."""
    cfg = run_config(tmp_path / "run", "disaggregated", attention_ranks=1, expert_ranks=2, micro_batches=2,
                     steps=4, checkpoint_every=2)
    run_on(warm, cfg)
    straight = read_metrics(tmp_path / "run" / METRICS_FILE)
    shard = checkpoint_dir(tmp_path / "run" / CHECKPOINTS_DIR, 4) / "rank-00002.pt"
    shard.write_bytes(shard.read_bytes()[:-1])
    with pytest.warns(RunWarning) as warned:
        summary = run_on(warm, cfg.model_copy(update={"resume": True}))
    assert len(warned) == 1 and str(warned[0].message).startswith(
        f"skipped checkpoint step-00000004: checkpoint shard {shard} fails its sha256 check"), warned[0].message
    assert str(warned[0].message).endswith("resuming from step-00000002 instead")
    resumed = read_metrics(tmp_path / "run" / METRICS_FILE)
    assert summary.steps == 4 and [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["loss"] for r in resumed] == [r["loss"] for r in straight]


def spec_bytes(spec) -> int:
    return torch.empty(spec.shape, dtype=spec.dtype).nbytes


def test_a_signal_during_evaluation_stops_the_run_with_its_last_checkpoint(warm, tmp_path, monkeypatch):
    """The actors would still be inside the evaluation, so the step after the last checkpoint is
    not saved: the run stops at once naming the checkpoint it has (issue 23)."""
    import signal

    from disagmoe.runtime.failures import TrainingInterrupted

    cfg = run_config(tmp_path / "run", "disaggregated", steps=4, eval_every=2, checkpoint_every=1)

    def long_evaluation(self):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(60)
        return 0.0

    monkeypatch.setattr(DistributedTrainer, "validate", long_evaluation)
    start = time.monotonic()
    with pytest.raises(TrainingInterrupted) as stopped:
        DistributedTrainer(cfg, log_to_driver=False, workers=warm(2)).run()
    assert time.monotonic() - start < 30
    assert stopped.value.step == 2 and stopped.value.checkpoint == checkpoint_dir(tmp_path / "run" / CHECKPOINTS_DIR, 1)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["A1-E1-pairs", "A1-E1-sums", "A1-E2-sparse", "fp8-A1-E1-sums", "fp8-A1-E2-sparse"])
def test_gpu_captured_rank_steps_on_one_shared_gpu_equal_the_eager_steps(ray_cluster, tmp_path, case):
    """`cuda_graphs: on` (runtime/rank_graphs.py) against the same run eager: every step's loss and
    grad norm within 1e-5 relative (the same kernels in the same order; a replay differs from its
    capture's eager twin only where a kernel's atomics order differently, which two eager runs show
    too), the first 3 steps eager (the warm-up), then every step replayed: step 4's phase was met in
    step 2, and the evaluation after step 4, which moves the forward rings' counts, is followed by
    their realignment (`PhasedGraphs`, `NvshmemTransport.realign`), so step 5 runs in step 3's phase
    (captured there and replayed) and steps 6 to 8 replay the two graphs in turn. The fp8 cases
    (precision fp8, its counters summed on the stream with the gradient norm) are the check behind
    `step_capture.FP8_CHECKED_ON_GPU`."""
    fp8 = case in SHARED_FP8_CASES
    needs_fp8_gpu() if fp8 else needs_shared_gpu()
    fields = dict(experts_backend="triton", eval_every=4, eval_batches=1, **({"precision": "fp8"} if fp8 else {}))
    runs = {}
    for graphs in ("off", "on"):
        cfg = shared_gpu_config(tmp_path / graphs, case, cuda_graphs=graphs, **fields)
        with pytest.warns(RunWarning, match="time-sliced, not a speed measurement"):
            trainer = DistributedTrainer(cfg, log_to_driver=False)
        runs[graphs] = (trainer.run(), read_metrics(tmp_path / graphs / METRICS_FILE))
    (eager, eager_rows), (graphed, graphed_rows) = runs["off"], runs["on"]
    assert eager.cuda_graph_replays is None and "cuda_graphs: off" in eager.cuda_graphs_note
    assert graphed.cuda_graphs_note.startswith("cuda_graphs: on: every rank's step is captured")
    assert [r["cuda_graph"] for r in graphed_rows] == [False] * 3 + [True] * 5
    assert graphed.cuda_graph_replays == 5 and not any(r["cuda_graph"] for r in eager_rows)
    for got, want in zip(graphed_rows, eager_rows, strict=True):
        for key in ("loss", "grad_norm"):
            assert abs(got[key] - want[key]) <= 1e-5 * abs(want[key]), (got["step"], key, got[key], want[key])
    assert abs(graphed.final_val_loss - eager.final_val_loss) <= 1e-5 * eager.final_val_loss


def test_the_dense_fp8_copies_counted_are_those_of_the_linears_the_recipe_runs_in_fp8(tmp_path):
    """With dense FP8, an attention rank's state counts two e4m3 copies of each dense linear the recipe
    runs in FP8: every one rowwise, blockwise only those on its grid (`fp8_dense.fits_blockwise`; the
    rest keep their GEMMs in bf16 and copy nothing). The tiny model's linears are all off the grid."""
    from disagmoe.kernels.fp8_dense import fits_blockwise
    from disagmoe.model.layers import DeferrableLinear
    from disagmoe.runtime.rank_model import rank_model

    cfg = run_config(tmp_path / "run", "disaggregated", attention_ranks=1, expert_ranks=1, micro_batches=2)
    fp8 = cfg.model_copy(update={"precision": "fp8", "experts_backend": "triton"})
    recipes = {name: fp8.model_copy(update=update) for name, update in (
        ("bf16 dense", {"fp8_dense": False}), ("rowwise", {"fp8_dense": True, "fp8_dense_scaling": "rowwise"}),
        ("blockwise", {}))}
    topology = Topology.from_config(fp8, fp8.model)
    rank = next(r for r in range(topology.world_size) if topology.attention_role(r) is not None)
    state = {name: training_state_bytes(c, c.model, topology, rank)[1] for name, c in recipes.items()}
    linears = [m for m in rank_model(fp8.model, "triton", topology, rank).modules() if isinstance(m, DeferrableLinear)]
    assert linears and not any(fits_blockwise(m.in_features, m.out_features) for m in linears)
    assert state["rowwise"] - state["bf16 dense"] == 2 * sum(m.weight.numel() for m in linears)
    assert state["blockwise"] == state["bf16 dense"]
