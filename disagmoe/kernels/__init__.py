"""Triton kernels, each with a plain-torch reference beside it (see DESIGN section 4)."""
