"""What a rank computes in a training step: the attention and expert stages, the pair-row fused
return, the messages between ranks and their fixed shapes, replicated experts' gradient sums, and
the proof of the step's NCCL issue order (`nccl_order`).

May import `runtime.schedule`, the runtime's shared modules, `model`, `kernels` and `comm`; never
`state`, `observe`, `training` or `cluster`.
"""
