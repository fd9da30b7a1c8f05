"""The training loop shared by both trainers (steps, checkpoints, signals, the summary) and the
single-process trainer, the correctness oracle of every distributed layout.

May import `state`, `observe` and the runtime's shared modules; never `stages` or `cluster`.
"""
