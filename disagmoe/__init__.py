"""disagmoe: train Mixture-of-Experts models with attention and experts on disjoint GPU groups."""

__version__ = "0.1.0"
