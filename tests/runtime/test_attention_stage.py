"""Pieces of the attention stage (disagmoe/runtime/attention_stage.py) against the model's own."""

import pytest
import torch

from disagmoe.config import load_model
from disagmoe.model import MoETransformer
from disagmoe.runtime.attention_stage import combine_layer_output, merge_ranks, split_by_rank
from disagmoe.runtime.plan_layout import partition_owners, replica_rows, replica_shares


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
    for owners in (partition_owners(((1, 4, 6), (0, 2, 3, 5, 7)), 8),  # two expert ranks, non-contiguous
                   ((0, 1), (1,), (1, 0), (0,), (1,), (0, 1), (0,), (1,))):  # experts 0, 2, 5 replicated
        for dp_index, dp in ((0, 1), (1, 2), (2, 3)):
            y_per_rank, _ = split_by_rank(y_PH, routing.load_E, owners, 2, dp_index, dp)
            got = combine_layer_output(h_BSH, routing.topk_w_NK, y_per_rank, owners, routing.topk_idx_NK,
                                       shared_NH, cfg.num_experts, dp_index, dp)
            assert torch.equal(got, want)


def test_rows_split_by_rank_hold_each_ranks_experts_and_merge_back():
    counts_E = torch.tensor([2, 0, 3, 1, 4, 2])
    offsets = [0, *counts_E.cumsum(0).tolist()]
    x_PH = torch.randn(int(counts_E.sum()), 4, generator=torch.Generator().manual_seed(1))
    expert_ids = ((2, 5), (0, 1, 4), (3,))
    owners = partition_owners(expert_ids, 6)
    per_rank, counts = split_by_rank(x_PH, counts_E, owners, 3, 0, 1)
    for rows_PH, rank_counts, ids in zip(per_rank, counts, expert_ids, strict=True):
        assert torch.equal(rows_PH, torch.cat([x_PH[offsets[e]:offsets[e + 1]] for e in ids]))
        assert rank_counts == [int(counts_E[e]) for e in ids]
    assert torch.equal(merge_ranks(per_rank, counts_E, owners, 0, 1), x_PH)


@pytest.mark.parametrize("seed", range(6))
def test_a_replicated_experts_rows_go_to_the_owners_of_the_senders_data_parallel_index(seed):
    g = torch.Generator().manual_seed(seed)
    experts, ranks = 6, 3
    dp = 1 + seed % 4  # fewer, as many and more data-parallel ranks than some experts have replicas
    dp_index = int(torch.randint(0, dp, (1,), generator=g))
    counts_E = torch.randint(0, 6, (experts,), generator=g)
    counts_E[int(torch.randint(0, experts, (1,), generator=g))] = 0  # an empty expert

    def some_ranks(how_many: int) -> tuple[int, ...]:  # distinct ranks in random (replica) order
        return tuple(int(i) for i in torch.randperm(ranks, generator=g)[:how_many])

    # random replica sets; the last expert on every rank, so each rank holds one
    owners = tuple(some_ranks(int(torch.randint(1, ranks + 1, (1,), generator=g))) for _ in range(experts - 1))
    owners += (some_ranks(ranks),)
    offsets = [0, *counts_E.cumsum(0).tolist()]
    x_PH = torch.randn(int(counts_E.sum()), 4, generator=g)
    per_rank, counts = split_by_rank(x_PH, counts_E, owners, ranks, dp_index, dp)
    for i in range(ranks):
        want_rows, want_counts = [], []
        for e, who in enumerate(owners):
            if i in who:
                sizes = replica_rows(int(counts_E[e]), len(who), dp_index, dp)
                r = who.index(i)
                start = offsets[e] + sum(sizes[:r])
                want_rows.append(x_PH[start:start + sizes[r]])
                want_counts.append(sizes[r])
        assert torch.equal(per_rank[i], torch.cat(want_rows)) and counts[i] == want_counts
    assert torch.equal(merge_ranks(per_rank, counts_E, owners, dp_index, dp), x_PH)


def test_replica_rows_follow_the_data_parallel_index_and_split_when_replicas_outnumber_senders():
    assert replica_shares(7, 3) == [3, 2, 2] and replica_shares(0, 2) == [0, 0]
    # as many or more senders than replicas: all rows to replica d mod n (a replica set per share)
    assert [replica_rows(5, 2, d, 4) for d in range(4)] == [[5, 0], [0, 5], [5, 0], [0, 5]]
    assert replica_rows(5, 3, 2, 3) == [0, 0, 5]
    # fewer senders than replicas: sender d splits over replicas d, d + D, ...
    assert replica_rows(7, 3, 0, 1) == [3, 2, 2]
    assert replica_rows(7, 4, 1, 2) == [0, 4, 0, 3]


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
