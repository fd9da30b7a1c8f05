"""Training runtime: batching, optimizer, trainer (the single-process oracle), checkpoints, metrics.

Import the submodules directly (`from disagmoe.runtime.trainer import train_single`); this package
file imports nothing so that light users (the CLI's help, the planner) stay fast.
"""
