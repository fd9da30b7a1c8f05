"""Where a distributed rank's step is captured (disagmoe/runtime/rank_graphs.py): `on` refused with
the fix where it cannot apply, `auto` eager there with the reason in one line, and the receive
rings rounded up to a step's messages exactly where the steps are captured."""

from __future__ import annotations

from typing import NamedTuple

import pytest

from disagmoe.config import TrainConfig
from disagmoe.model_ref import load_model
from disagmoe.runtime.rank_graphs import resolve_rank_graphs
from disagmoe.runtime.schedule import step_capture
from disagmoe.runtime.stages.messages import MessageShapes, receive_layouts
from disagmoe.runtime.topology import Topology
from disagmoe.runtime.training.graphed_step import resolve_cuda_graphs

BASE = dict(model="tiny", mode="disaggregated", device="cuda", transport="nvshmem", experts_backend="triton",
            attention_ranks=1, expert_ranks=1, batch_size=8, seq_len=16, micro_batches=2)


def _cfg(**fields) -> TrainConfig:
    return TrainConfig(**{**BASE, **fields})


def _resolve(cfg: TrainConfig) -> tuple[bool, str]:
    return resolve_rank_graphs(cfg, Topology.from_config(cfg, load_model(cfg.model)))


class _Replicated(NamedTuple):
    """Stands for the topology of a plan with a replicated expert (ranks 1 and 2 hold it)."""

    world_size: int = 3
    data_parallel: int = 1

    def replica_groups(self) -> list[tuple[int, ...]]:
        return [(1, 2)]


@pytest.mark.parametrize("fields, why, fix", [
    (dict(attention_ranks=2), "the 2 attention replicas per pipeline group sum gradients",
     "one attention rank per pipeline group"),
    (dict(mode="colocated", colocated_ranks=2), "the 2 attention replicas", "one attention rank"),
])
def test_on_refuses_a_step_with_a_process_group_collective_with_the_fix(fields, why, fix):
    cfg = _cfg(cuda_graphs="on", **fields)
    with pytest.raises(ValueError, match=f"cuda_graphs: on cannot capture mode {cfg.mode}'s rank steps here: "
                                         f".*{why}.*{fix}.*or set cuda_graphs: off"):
        _resolve(cfg)
    with pytest.raises(ValueError, match="replicated experts sum their gradients .*no hot-expert replicas"):
        resolve_rank_graphs(_cfg(cuda_graphs="on"), _Replicated())


@pytest.mark.parametrize("fields, message", [
    (dict(transport="nccl"), "only over transport nvshmem .* set transport: nvshmem"),
    (dict(transport="local", device="cpu"), "captures steps on a GPU; this run is mode disaggregated on cpu"),
    (dict(experts_backend="loop"), "experts_backend: loop: the loop reads each expert's row count"),
    (dict(offload_optimizer=True), "offload_optimizer with cuda_graphs: on"),
])
def test_the_config_refuses_on_where_it_knows_the_step_cannot_be_captured(fields, message):
    with pytest.raises(ValueError, match=message):
        _cfg(cuda_graphs="on", **fields)


def test_on_captures_one_attention_rank_per_group_over_nvshmem():
    for fields in (dict(), dict(expert_ranks=2), dict(attention_ranks=2, expert_ranks=2, pipeline_groups=2),
                   dict(ranks_per_gpu=2)):
        capture, note = _resolve(_cfg(cuda_graphs="on", **fields))
        assert capture and note.startswith("cuda_graphs: on: every rank's step is captured"), fields
    assert resolve_cuda_graphs(_cfg(cuda_graphs="on")) == _resolve(_cfg(cuda_graphs="on"))  # the driver's note


@pytest.mark.parametrize("fields, says", [
    (dict(transport="nccl"), "transport nccl posts every message from the host"),
    (dict(transport="local", device="cpu"), "a cpu run has no CUDA graphs"),
    (dict(attention_ranks=2), "the 2 attention replicas per pipeline group"),
    (dict(experts_backend="loop"), "experts_backend loop reads each expert's row count on the host"),
    (dict(offload_optimizer=True), "the offloaded optimizer's copy streams"),
])
def test_auto_runs_eagerly_and_says_why_in_one_line(fields, says):
    capture, note = _resolve(_cfg(**fields))
    assert not capture and note.startswith(f"cuda_graphs: auto -> eager: {says}") and "\n" not in note


def test_auto_stays_eager_where_the_captured_rank_step_was_not_checked_on_a_gpu(monkeypatch):
    monkeypatch.setattr(step_capture, "CHECKED_ON_GPU", False)
    capture, note = _resolve(_cfg())
    assert not capture and note == ("cuda_graphs: auto -> eager: the captured rank step has not been checked "
                                    "against the eager one on a GPU yet (cuda_graphs: on captures it)")


def test_auto_captures_once_checked_on_a_gpu_and_fp8_once_its_own_gate_passed(monkeypatch):
    monkeypatch.setattr(step_capture, "CHECKED_ON_GPU", True)
    monkeypatch.setattr(step_capture, "FP8_CHECKED_ON_GPU", False)
    assert _resolve(_cfg())[0]
    capture, note = _resolve(_cfg(precision="fp8", hop="partial_sums"))
    assert not capture and "precision fp8's captured rank step" in note
    monkeypatch.setattr(step_capture, "FP8_CHECKED_ON_GPU", True)
    assert _resolve(_cfg(precision="fp8", hop="partial_sums"))[0]
    assert _resolve(_cfg(cuda_graphs="off")) == (False, "cuda_graphs: off")


def test_single_mode_is_not_a_rank_step():
    cfg = TrainConfig(model="tiny", mode="single", device="cuda")
    with pytest.raises(ValueError, match="graphed_step.resolve_cuda_graphs"):
        resolve_rank_graphs(cfg, Topology.from_config(cfg.model_copy(update={"mode": "disaggregated"}),
                                                      load_model(cfg.model)))


def test_captured_runs_get_rings_rounded_up_to_a_steps_messages():
    """The arena of a captured run: every ring's segments divide twice its keys' messages a step,
    never fewer than the eager run's ring of the same slot; an eager run keeps the plain rings (a
    forward ring one segment more than its keys), so at least one ring grows."""
    rings = {}
    for graphs in ("on", "off"):
        cfg = _cfg(cuda_graphs=graphs, hop="partial_sums")
        topology = Topology.from_config(cfg, load_model(cfg.model))
        rings[graphs] = {(i, seg.slot): (layout.ring(seg.slot), len(seg.keys))
                         for i, layout in enumerate(receive_layouts(cfg, MessageShapes.of_run(cfg, load_model(cfg.model),
                                                                                              topology), topology))
                         for seg in layout.segments}
    assert rings["on"].keys() == rings["off"].keys()
    for where, (n, keys) in rings["on"].items():
        eager, _ = rings["off"][where]
        assert (2 * keys) % n == 0 and n >= eager, (where, n, keys, eager)
        if not where[1][1].backward:
            assert (n, eager) == (2 * keys, keys + 1), where
    assert any(rings["on"][w][0] > rings["off"][w][0] for w in rings["on"])


def test_the_reasons_are_asked_apart_and_named_in_one_order():
    """`step_capture` asks a layout's two facts apart from the run's settings (the planner asks
    them of its candidates); `resolve_rank_graphs` names every reason, in one order: the transport's,
    the layout's, then the step's work."""
    cfg = _cfg(attention_ranks=2, transport="nccl").model_copy(update={"experts_backend": "loop"})
    transport = ("transport nccl posts every message from the host (the nvshmem transport's puts and flag waits "
                 "are captured)",)
    loop = ("experts_backend loop reads each expert's row count on the host",)
    (replicas,) = step_capture.layout_blockers(2, False)
    assert replicas == ("the 2 attention replicas per pipeline group sum gradients and expert loads over the "
                        "process group, which is not captured", "use one attention rank per pipeline group")
    assert step_capture.layout_blockers(1, False) == [] and len(step_capture.layout_blockers(1, True)) == 1
    with pytest.raises(ValueError) as refused:
        _resolve(cfg.model_copy(update={"cuda_graphs": "on"}))
    named = str(refused.value)
    assert named.index(transport[0]) < named.index(replicas[0]) < named.index(loop[0])
    assert _resolve(cfg) == (False, f"cuda_graphs: auto -> eager: {transport[0]}")
