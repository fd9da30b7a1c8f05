"""Where a distributed rank's training step is captured in CUDA graphs (`cuda_graphs` in modes
disaggregated and colocated; issue 20 item 1). Torch-free: the driver, the memory checks and
the arena sizing ask it before any process starts.

    capture, note = resolve_rank_graphs(cfg, topology)   # `on` where it cannot apply: ValueError with the fix

A rank's step is captured where nothing in it waits on the host or posts work from it: messages
over the nvshmem transport (puts and flag waits on the stream; nccl's and gloo's are posted from
the host), the gradient norm's all-ranks sum on the stream too (`NvshmemTransport.all_sum`: the
run sums it there once its steps are captured, as ranks sharing a GPU always do), and no other
collective in the step: one attention rank per pipeline group (data-parallel replicas sum
gradients and expert loads over the process group) and no replicated experts (their gradient
sums likewise). The experts' loop backend reads row counts on the host, the reference AdamW of
precision fp32 and the offloaded optimizer's copy streams are not captured (as in mode single).
Such a run's receive rings are rounded up to a step's messages (`reuse_order.step_ring`), so a
captured step replays in at most two phases of the transport's counts (`comm.counts`), one graph
each. An evaluation between training steps sends forward messages eagerly and moves those counts;
before the next training step every rank skips them on to the phase that step would have met
without the evaluation (`NvshmemTransport.realign`, no message), so it replays at once: no eager
step after an evaluation, whose activations would need memory beside the graphs' pool, which
the memory model does not price.
"""

from __future__ import annotations

from disagmoe.config import TrainConfig
from disagmoe.runtime.topology import Topology

CHECKED_ON_GPU = False  # the `gpu` test of a captured rank step has not run yet: auto stays eager


def _not_capturable(cfg: TrainConfig, topology: Topology) -> list[tuple[str, str]]:
    """(why the rank step is not captured, the fix) for each reason that holds."""
    return [(why, fix) for holds, why, fix in (
        (cfg.device != "cuda", f"a {cfg.device} run has no CUDA graphs", "run on device: cuda"),
        (cfg.transport != "nvshmem",
         f"transport {cfg.transport} posts every message from the host (the nvshmem transport's puts and flag "
         "waits are captured)", "set transport: nvshmem"),
        (topology.data_parallel > 1,
         f"the {topology.data_parallel} attention replicas per pipeline group sum gradients and expert loads over "
         "the process group, which is not captured", "use one attention rank per pipeline group"),
        (bool(topology.replica_groups()),
         "replicated experts sum their gradients over the process group, which is not captured",
         "place every expert once (no hot-expert replicas)"),
        (cfg.experts_backend == "loop", "experts_backend loop reads each expert's row count on the host",
         "set experts_backend: triton (or grouped_mm)"),
        (cfg.steps_reference_adamw, "precision fp32 steps torch's reference AdamW, which is not captured",
         "set precision: bf16"),
        (cfg.offload_optimizer, "the offloaded optimizer's copy streams are not captured yet",
         "set offload_optimizer: false"),
    ) if holds]


def resolve_rank_graphs(cfg: TrainConfig, topology: Topology) -> tuple[bool, str]:
    """(capture every rank's step?, the one line that says so and why) for a distributed run's
    `cuda_graphs` (module docstring). `on` where the step cannot be captured raises ValueError
    naming the fixes. `auto` runs eagerly there, and, until the captured rank step has been checked
    against the eager one on a GPU (tests/runtime/cluster/test_driver.py's
    `test_gpu_captured_rank_steps_on_one_shared_gpu_equal_the_eager_steps`; then `CHECKED_ON_GPU`),
    everywhere else too, saying so: auto captures only what a GPU run checked."""
    if cfg.mode == "single":
        raise ValueError("resolve_rank_graphs is for modes disaggregated and colocated; mode single's step is "
                         "graphed_step.resolve_cuda_graphs'")
    if cfg.cuda_graphs == "off":
        return False, "cuda_graphs: off"
    blocked = _not_capturable(cfg, topology)
    if cfg.cuda_graphs == "on":
        if blocked:
            raise ValueError(f"cuda_graphs: on cannot capture mode {cfg.mode}'s rank steps here: "
                             + "; ".join(f"{why} ({fix})" for why, fix in blocked) + "; or set cuda_graphs: off")
        return True, f"cuda_graphs: on: {CAPTURED}"
    if not blocked and not CHECKED_ON_GPU:
        blocked = [("the captured rank step has not been checked against the eager one on a GPU yet "
                    "(cuda_graphs: on captures it)", "")]
    if not blocked and cfg.expert_precision == "fp8":
        blocked = [("precision fp8's captured rank step has not been checked on a GPU yet", "")]
    if blocked:
        return False, f"cuda_graphs: auto -> eager: {blocked[0][0]}"
    return True, f"cuda_graphs: auto -> on: {CAPTURED}"


CAPTURED = ("every rank's step is captured after its eager warm-up steps and replayed, a graph per phase of the "
            "nvshmem transport's message counts (rings rounded up to a step's messages: a training step alternates "
            "between at most two phases; after an evaluation the counts are realigned to them)")
