"""Operands cast as autocast casts a matmul's (disagmoe/kernels/autocast.py)."""

import torch

from disagmoe.kernels.autocast import autocast_operands


def test_autocast_operands_cast_like_autocast_and_only_under_it():
    x32, x64 = torch.ones(2, 2), torch.ones(2, 2, dtype=torch.float64)
    assert [t.dtype for t in autocast_operands(x32, x64)] == [torch.float32, torch.float64]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert [t.dtype for t in autocast_operands(x32, x64)] == [torch.bfloat16, torch.float64]
