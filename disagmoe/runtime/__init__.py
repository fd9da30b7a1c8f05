"""Training runtime. Its top-level modules are the pieces its sub-packages share: the plan's
layout applied to a run (`plan_layout`), ranks and their groups (`topology`), the part of the
model a rank holds (`rank_model`), the batch split (`batching`), the run folder (`out_dir`) and
the failure types (`failures`); they import only `runtime.schedule` of the runtime.

    schedule/  the pure pipeline schedule and its proofs (torch-free)
    stages/    what a rank computes in a step and the messages between ranks
    state/     what persists across steps: optimizer, checkpoints
    observe/   metrics, traces, GPU spans
    training/  the training loop and the single-process trainer (the oracle)
    cluster/   Ray processes, the distributed trainer, restarts, watchdogs

Import the submodules directly (`from disagmoe.runtime.training.trainer import train_single`); no
package file imports anything, so light users (the CLI's help, the planner) stay fast.
"""
