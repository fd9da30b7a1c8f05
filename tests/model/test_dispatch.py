import torch

from disagmoe.model.dispatch import combine, group_by_expert, permute


def test_grouping_orders_pairs_by_expert_with_cumulative_offsets():
    topk_idx = torch.tensor([[2, 0], [2, 3], [0, 2]])
    g = group_by_expert(topk_idx, num_experts=5)
    assert g.offsets_E.dtype == torch.int32
    assert g.offsets_E.tolist() == [2, 2, 5, 6, 6]
    experts_in_order = topk_idx.flatten()[g.pair_idx_P]
    assert experts_in_order.tolist() == [0, 0, 2, 2, 2, 3]
    assert g.token_idx_P.tolist() == [0, 2, 0, 1, 2, 1]


def test_permute_then_combine_is_the_weighted_sum_over_each_tokens_experts():
    gen = torch.Generator().manual_seed(0)
    N, K, E, H = 7, 3, 5, 4
    topk_idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(N)])
    w = torch.rand(N, K, generator=gen)
    x = torch.randn(N, H, generator=gen)
    scale = torch.randn(E, H, generator=gen)  # "expert e" multiplies its rows by scale[e]
    g = group_by_expert(topk_idx, E)
    x_P = permute(x, g)
    experts_of_rows = topk_idx.flatten()[g.pair_idx_P]
    out = combine(x_P * scale[experts_of_rows], g, w)
    expected = torch.stack([sum(w[n, k] * x[n] * scale[topk_idx[n, k]] for k in range(K)) for n in range(N)])
    torch.testing.assert_close(out, expected)
