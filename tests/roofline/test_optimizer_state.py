"""Training-state bytes per parameter (disagmoe/roofline/optimizer_state.py): what FlatAdamW
holds, by compute dtype, moment dtype and ZeRO-1 group, for one parameter and for arrays of
layouts."""

import numpy as np
import pytest
import torch
from torch import nn

from disagmoe.config import OptimConfig
from disagmoe.roofline.optimizer_state import state_bytes
from disagmoe.runtime.state.flat_adamw import FlatAdamW


@pytest.mark.parametrize(("state", "compute", "whole"), [("fp32", "bf16", 18), ("bf16", "bf16", 14),
                                                          ("fp32", "fp32", 16), ("bf16", "fp32", 12)])
def test_unsharded_bytes_per_parameter(state, compute, whole):
    """bf16 weight 2 + fp32 master 4 + fp32 gradient 4 + two moments (8 in fp32, 4 in bf16); an
    fp32 weight is its own master."""
    got = state_bytes(state, compute)
    assert got.total == whole
    assert got.moments == (8 if state == "fp32" else 4) and got.grads == 4


@pytest.mark.parametrize(("state", "compute", "sharded"), [("fp32", "bf16", 6 + 16 / 4), ("bf16", "bf16", 6 + 12 / 4),
                                                            ("fp32", "fp32", 8 + 12 / 4), ("bf16", "fp32", 8 + 8 / 4)])
def test_zero1_splits_the_master_the_moments_and_the_reduced_slice(state, compute, sharded):
    assert state_bytes(state, compute, 4).total == pytest.approx(sharded)
    dp = np.array([1, 4])  # one element per candidate layout: a group of 1 is not sharded
    np.testing.assert_allclose(state_bytes(state, compute, dp).total, [state_bytes(state, compute).total, sharded])


def test_an_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="must be one of"):
        state_bytes("fp16")


@pytest.mark.parametrize("state", ["fp32", "bf16"])
@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
def test_the_price_is_what_flat_adamw_allocates(state, compute):
    """Count the bytes of every tensor a stepped FlatAdamW holds (parameters, masters, main
    gradients, moments) against the price: the accounting follows the optimizer, not a comment."""
    model = nn.Sequential(nn.Linear(16, 8), nn.Linear(8, 4)).to(compute)
    flat = FlatAdamW(model.named_parameters(), OptimConfig(state_dtype=state), compute)
    flat.zero_grad()
    model(torch.randn(3, 16, dtype=compute)).float().sum().backward()
    flat.set_lr(1e-3)
    flat.step()
    held, params = 0, sum(p.numel() for p in model.parameters())
    for b in flat.buckets:
        moments = b.inner.state[b.inner.param_groups[0]["params"][0]]
        tensors = [b.compute_N, b.grad_N, moments["exp_avg"], moments["exp_avg_sq"]]
        tensors += [] if b.master_S is b.compute_N else [b.master_S]
        held += sum(t.numel() * t.element_size() for t in tensors)
    assert held == params * state_bytes(state, "bf16" if compute == torch.bfloat16 else "fp32").total
