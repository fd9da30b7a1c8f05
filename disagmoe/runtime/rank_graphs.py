"""Where a distributed rank's training step is captured in CUDA graphs (`cuda_graphs` in modes
disaggregated and colocated; issue 20 item 1). Torch-free: the driver, the memory checks and
the arena sizing ask it before any process starts.

    capture, note = resolve_rank_graphs(cfg, topology)   # `on` where it cannot apply: ValueError with the fix

The reasons below and the decision are `runtime.schedule.step_capture`'s, which the planner asks
of every candidate layout (`placement.cost.rank_steps`) to price its rings as the run allocates them.

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
from disagmoe.runtime.schedule.step_capture import StepSettings, resolve
from disagmoe.runtime.topology import Topology


def resolve_rank_graphs(cfg: TrainConfig, topology: Topology) -> tuple[bool, str]:
    """(capture every rank's step?, the one line that says so and why) for a distributed run's
    `cuda_graphs` (module docstring), from its settings and its topology's two facts
    (`runtime.schedule.step_capture`, where every reason is written once and the planner asks them
    too). `on` where the step cannot be captured raises ValueError naming the fixes. `auto` runs
    eagerly there, saying why, and captures everywhere else: the captured rank step equals the
    eager one on a GPU (tests/runtime/cluster/test_driver.py's
    `test_gpu_captured_rank_steps_on_one_shared_gpu_equal_the_eager_steps`, `step_capture.CHECKED_ON_GPU`);
    precision fp8's still waits for its own GPU check."""
    if cfg.mode == "single":
        raise ValueError("resolve_rank_graphs is for modes disaggregated and colocated; mode single's step is "
                         "graphed_step.resolve_cuda_graphs'")
    return resolve(StepSettings.of_run(cfg), cfg.mode, topology.data_parallel, bool(topology.replica_groups()))
