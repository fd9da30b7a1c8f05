"""The pipeline schedule as pure data: ranks' roles (`roles`), every rank's ordered ops for a
step (`schedule`, `colocated`) and the proofs that they neither deadlock nor reuse a receive
buffer too early (`schedule_sim`, `reuse_order`), and whether a rank's step is captured in CUDA
graphs (`step_capture`).

Torch-free (the planner replays schedules in `placement.replay`); imports only `config` and
`wire`, nothing else of the runtime.
"""
