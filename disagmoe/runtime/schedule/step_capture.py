"""Whether a distributed rank's training step is captured in CUDA graphs: every reason it is not,
each written once, and `cuda_graphs`' decision from them (`runtime.rank_graphs` says why each
reason keeps a step eager). Torch-free: a run asks it through `rank_graphs.resolve_rank_graphs`
(its config and topology), the planner of every candidate layout (`placement.cost.rank_steps`).

    settings = StepSettings.of_run(cfg)
    layout_blockers(data_parallel, replicated)          (why, fix) per reason of the layout
    one_gpu_blockers(settings)                          (why, fix) per reason of a step without messages
    resolve(settings, mode, data_parallel, replicated)  (captured?, the one line); `on` where it cannot: ValueError

A layout enters as two facts, so the planner asks them of its candidates without a topology:
its data-parallel attention replicas per pipeline group (`Topology.data_parallel`; colocated:
every rank) and whether an expert is held more than once (`Topology.replica_groups()` not empty).
"""

from __future__ import annotations

from dataclasses import dataclass

from disagmoe.config import TrainConfig

# tests/runtime/cluster/test_driver.py's `test_gpu_captured_rank_steps_on_one_shared_gpu_equal_the_eager_steps`
# passed (all three cases) on one H100, 2026-12-05 (docs/benchmarks.md, session 26): auto captures
CHECKED_ON_GPU = True
# the same test's fp8 cases (fp8-A1-E1-sums, fp8-A1-E2-sparse) passed on one H100, 2026-12-05 (session 27);
# like the bf16 gate, checked with ranks sharing a GPU: rank steps on GPUs of their own have not run captured
FP8_CHECKED_ON_GPU = True

Blocker = tuple[str, str]  # (why the rank step is not captured, the fix)


@dataclass(frozen=True)
class StepSettings:
    """What a run's config says about capturing its rank steps, whatever its layout."""

    cuda_graphs: str  # auto, on or off
    device: str
    transport: str
    experts_backend: str
    reference_adamw: bool  # precision fp32 steps torch's reference AdamW (`TrainConfig.steps_reference_adamw`)
    offload_optimizer: bool
    expert_precision: str  # fp8: auto waits for its own GPU check

    @classmethod
    def of_run(cls, cfg: TrainConfig) -> StepSettings:
        return cls(cuda_graphs=cfg.cuda_graphs, device=cfg.device, transport=cfg.transport,
                   experts_backend=cfg.experts_backend, reference_adamw=cfg.steps_reference_adamw,
                   offload_optimizer=cfg.offload_optimizer, expert_precision=cfg.expert_precision)


def layout_blockers(data_parallel: int, replicated: bool) -> list[Blocker]:
    """The reasons the layout gives: a process-group collective in the step."""
    return [(why, fix) for holds, why, fix in (
        (data_parallel > 1,
         f"the {data_parallel} attention replicas per pipeline group sum gradients and expert loads over "
         "the process group, which is not captured", "use one attention rank per pipeline group"),
        (replicated, "replicated experts sum their gradients over the process group, which is not captured",
         "place every expert once (no hot-expert replicas)"),
    ) if holds]


def one_gpu_blockers(s: StepSettings) -> list[Blocker]:
    """The reasons a step without messages (mode single's, `graphed_step.resolve_cuda_graphs`) is
    not captured: where it runs and its work."""
    return _device_blockers(s) + _work_blockers(s)


def _device_blockers(s: StepSettings) -> list[Blocker]:
    return [(f"a {s.device} run has no CUDA graphs", "run on device: cuda")] if s.device != "cuda" else []


def _transport_blockers(s: StepSettings) -> list[Blocker]:
    """How the step's messages travel."""
    if s.transport == "nvshmem":
        return []
    return [(f"transport {s.transport} posts every message from the host (the nvshmem transport's puts and flag "
             "waits are captured)", "set transport: nvshmem")]


def _work_blockers(s: StepSettings) -> list[Blocker]:
    """Work in the step that is not captured."""
    return [(why, fix) for holds, why, fix in (
        (s.experts_backend == "loop", "experts_backend loop reads each expert's row count on the host",
         "set experts_backend: triton (or grouped_mm)"),
        (s.reference_adamw, "precision fp32 steps torch's reference AdamW, which is not captured",
         "set precision: bf16"),
        (s.offload_optimizer, "the offloaded optimizer's copy streams are not captured yet",
         "set offload_optimizer: false"),
    ) if holds]


def resolve(s: StepSettings, mode: str, data_parallel: int, replicated: bool) -> tuple[bool, str]:
    """(capture every rank's step?, the one line that says so and why) for a `mode` (disaggregated
    or colocated) run of these settings on this layout. `on` where the step cannot be captured
    raises ValueError naming every reason with its fix (the device's and transport's, the layout's,
    then the step's work). `auto` runs eagerly there, naming the first reason, and captures
    elsewhere once `CHECKED_ON_GPU` (precision fp8 waits for its own check; `runtime.rank_graphs`)."""
    if s.cuda_graphs == "off":
        return False, "cuda_graphs: off"
    blocked = (_device_blockers(s) + _transport_blockers(s) + layout_blockers(data_parallel, replicated)
               + _work_blockers(s))
    if s.cuda_graphs == "on":
        if blocked:
            raise ValueError(f"cuda_graphs: on cannot capture mode {mode}'s rank steps here: "
                             + "; ".join(f"{why} ({fix})" for why, fix in blocked) + "; or set cuda_graphs: off")
        return True, f"cuda_graphs: on: {CAPTURED}"
    if not blocked and not CHECKED_ON_GPU:
        blocked = [("the captured rank step has not been checked against the eager one on a GPU yet "
                    "(cuda_graphs: on captures it)", "")]
    if not blocked and s.expert_precision == "fp8" and not FP8_CHECKED_ON_GPU:
        blocked = [("precision fp8's captured rank step has not been checked on a GPU yet", "")]
    if blocked:
        return False, f"cuda_graphs: auto -> eager: {blocked[0][0]}"
    return True, f"cuda_graphs: auto -> on: {CAPTURED}"


CAPTURED = ("every rank's step is captured after its eager warm-up steps and replayed, a graph per phase of the "
            "nvshmem transport's message counts (rings rounded up to a step's messages: a training step alternates "
            "between at most two phases; after an evaluation the counts are realigned to them)")
