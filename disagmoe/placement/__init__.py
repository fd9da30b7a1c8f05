"""Placement: split GPUs into attention and expert groups, pick p and m, map experts to GPUs."""
