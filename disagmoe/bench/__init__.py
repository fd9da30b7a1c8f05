"""Benchmark harnesses behind `disagmoe bench ...` (each measures its baselines in the same run)."""
