"""Processes and failure: the Ray actors of a run (`cluster`, `worker`), the distributed trainer
that drives them (`driver`), automatic restart and injected faults (`restart`) and the per-op
watchdog (`watchdog`).

The top of the runtime: may import every other part of it; nothing in the runtime imports it.
"""
