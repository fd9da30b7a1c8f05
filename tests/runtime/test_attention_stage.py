"""Pieces of the attention stage (disagmoe/runtime/attention_stage.py) against the model's own."""

import torch

from disagmoe.config import load_model
from disagmoe.model import MoETransformer
from disagmoe.runtime.attention_stage import combine_layer_output, merge_ranks, split_by_rank


def block_and_routing(seed: int = 0):
    cfg = load_model("tiny")
    model = MoETransformer(cfg)
    model.init_weights(seed)
    block = model.layers[1]
    h_BSH = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    return cfg, block, h_BSH, block.route(h_BSH)


def test_combine_reproduces_the_block_bit_for_bit():
    cfg, block, h_BSH, routing = block_and_routing()
    x_PH, grouping = block.dispatch(routing)
    y_PH = block.moe.experts(x_PH, grouping.offsets_E)
    shared_NH = block.shared_ffn(routing)
    want = block.combine(h_BSH, routing, y_PH, grouping, shared_NH)
    expert_ids = ((1, 4, 6), (0, 2, 3, 5, 7))  # two expert ranks, non-contiguous
    y_per_rank = split_by_rank(y_PH, routing.load_E, expert_ids)
    got = combine_layer_output(h_BSH, routing.topk_w_NK, y_per_rank, expert_ids, routing.topk_idx_NK, shared_NH,
                               cfg.num_experts)
    assert torch.equal(got, want)


def test_rows_split_by_rank_hold_each_ranks_experts_and_merge_back():
    counts_E = torch.tensor([2, 0, 3, 1, 4, 2])
    offsets = [0, *counts_E.cumsum(0).tolist()]
    x_PH = torch.randn(int(counts_E.sum()), 4, generator=torch.Generator().manual_seed(1))
    expert_ids = ((2, 5), (0, 1, 4), (3,))
    per_rank = split_by_rank(x_PH, counts_E, expert_ids)
    for rows_PH, ids in zip(per_rank, expert_ids, strict=True):
        assert torch.equal(rows_PH, torch.cat([x_PH[offsets[e]:offsets[e + 1]] for e in ids]))
    assert torch.equal(merge_ranks(per_rank, counts_E, expert_ids), x_PH)


def test_aux_shares_of_data_parallel_halves_add_up_to_the_whole():
    """Each half's aux share, formed with the summed load, adds up to the aux of all tokens."""
    cfg, block, h_BSH, whole = block_and_routing(seed=3)
    router = block.moe.router
    halves = [block.route(h_BSH[i:i + 1]) for i in range(2)]
    load_E = sum(r.load_E for r in halves)
    assert torch.equal(load_E, whole.load_E)
    shares = [router.aux_loss(r.scores_NE, load_E) / 2 for r in halves]
    torch.testing.assert_close(sum(shares), whole.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(sum(r.z_loss / 2 for r in halves), whole.z_loss, rtol=1e-6, atol=0)
