"""What a run reports about itself: metrics (the JSONL log, MFU, memory), span traces and busy
fractions, and GPU spans of an op's kernels.

May import the runtime's shared modules (`failures`); never `stages`, `state`, `training` or
`cluster`.
"""
