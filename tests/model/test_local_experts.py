"""An expert rank's partial sums (disagmoe/model/local_experts.py) against the whole MoE layer."""

import pytest
import torch

from disagmoe.model.dispatch import combine, group_by_expert, permute
from disagmoe.model.experts import RoutedExperts
from disagmoe.model.local_experts import local_expert_block


def _layer(experts: int = 6, hidden: int = 8, ffn: int = 12, tokens: int = 17, top_k: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    full = RoutedExperts(experts, hidden, ffn)
    full.init_weights(seed, "e", std=0.3)
    x = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    idx = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    w = torch.rand(tokens, top_k, generator=g, dtype=torch.float64)
    return full.double(), x, idx, w


@pytest.mark.parametrize("split", [[range(6)], [range(0, 2), range(2, 6)], [[0, 4], [1, 2, 3], [5]]])
def test_partials_of_the_expert_ranks_add_up_to_the_layer(split):
    full, x, idx, w = _layer()
    grouping = group_by_expert(idx, 6)
    whole = combine(full(permute(x, grouping), grouping.offsets_E), grouping, w)
    leaves = [t.clone().requires_grad_() for t in (x, w)]
    total = 0
    for ids in split:
        ids = list(ids)
        part = RoutedExperts.from_indices(full, ids)
        table = torch.full((6,), len(ids), dtype=torch.int32)
        table[ids] = torch.arange(len(ids), dtype=torch.int32)
        total = total + local_expert_block(leaves[0], table[idx], leaves[1], part)
    torch.testing.assert_close(total, whole, rtol=1e-12, atol=1e-12)
    d = torch.randn_like(whole)
    total.backward(d)
    x_ref, w_ref = x.clone().requires_grad_(), w.clone().requires_grad_()
    combine(full(permute(x_ref, grouping), grouping.offsets_E), grouping, w_ref).backward(d)
    torch.testing.assert_close(leaves[0].grad, x_ref.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(leaves[1].grad, w_ref.grad, rtol=1e-12, atol=1e-12)


def test_a_rank_none_of_whose_experts_are_chosen_gives_zeros():
    full, x, idx, w = _layer()
    part = RoutedExperts.from_indices(full, [0])
    local = torch.ones_like(idx, dtype=torch.int32)  # every pair served elsewhere
    xl = x.clone().requires_grad_()
    out = local_expert_block(xl, local, w, part)
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    assert torch.equal(xl.grad, torch.zeros_like(xl))


def test_shape_mismatch_is_refused():
    full, x, idx, w = _layer()
    with pytest.raises(ValueError, match="must agree"):
        local_expert_block(x[:-1], idx, w, full)
