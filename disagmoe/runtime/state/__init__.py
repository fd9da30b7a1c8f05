"""What persists across steps: the flat fused AdamW and its main gradients, the learning-rate
schedule, and the layout-independent checkpoints (single-file and per-rank shards).

May import the runtime's shared modules (`failures`, `rank_model`) and `model`; never `stages`,
`observe`, `training` or `cluster`.
"""
