"""Roofline model: FLOPs and bytes of every stage, and their times under each ceiling."""
