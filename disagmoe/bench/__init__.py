"""Benchmark harnesses behind `disagmoe bench ...` (each measures its own baselines in the same run)."""
