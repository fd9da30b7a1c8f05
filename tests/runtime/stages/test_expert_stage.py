"""The expert stage's routing of compact dispatches (disagmoe/runtime/stages/expert_stage.py): which pairs
each expert rank serves, replicas included, and that the ranks' partial sums add up to the layer."""

import pytest
import torch

from disagmoe.model_ref import load_model
from disagmoe.model import MoETransformer, RoutedExperts
from disagmoe.model.local_experts import local_expert_block
from disagmoe.runtime.stages.expert_stage import LocalRouting
from disagmoe.runtime.plan_layout import partition_owners, replica_rows
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.topology import Topology


def _topology(owners, ranks: int, dp: int) -> Topology:
    layout = Layout(attention_ranks=dp, expert_ranks=ranks, pipeline_groups=1, num_layers=1, num_dense_layers=0)
    return Topology.disaggregated(layout, len(owners), {0: owners})


@pytest.mark.parametrize("seed", range(8))
def test_each_pair_is_served_by_exactly_the_replica_the_senders_index_picks(seed):
    g = torch.Generator().manual_seed(seed)
    experts, ranks, top_k, tokens = 6, 3, 2, 23
    dp = 1 + seed % 4  # fewer, as many and more data-parallel ranks than some experts have replicas
    dp_index = int(torch.randint(0, dp, (1,), generator=g))

    def some_ranks(how_many: int) -> tuple[int, ...]:  # distinct ranks in random (replica) order
        return tuple(int(i) for i in torch.randperm(ranks, generator=g)[:how_many])

    owners = tuple(some_ranks(int(torch.randint(1, ranks + 1, (1,), generator=g))) for _ in range(experts - 1))
    owners += (some_ranks(ranks),)  # every rank holds one expert
    topology = _topology(owners, ranks, dp)
    idx_NK = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    idx_NK[idx_NK == 1] = 0 if seed % 2 else 1  # sometimes an expert nobody picks
    flat = idx_NK.reshape(-1)
    served = torch.zeros(flat.numel(), dtype=torch.int64)
    for i in range(ranks):
        local = LocalRouting(topology, 0, i, dp_index, dp, torch.device("cpu"))(idx_NK).reshape(-1)
        held = topology.expert_ids(0)[i]
        ours = local < len(held)
        served += ours.long()
        for e, who in enumerate(owners):
            mine = ours & (flat == e)
            if i not in who:
                assert not mine.any()
                continue
            sizes = replica_rows(int((flat == e).sum()), len(who), dp_index, dp)
            r = who.index(i)
            positions = torch.nonzero(flat == e).flatten()  # the sender's order within the expert
            want = positions[sum(sizes[:r]):sum(sizes[:r]) + sizes[r]]
            assert torch.equal(torch.nonzero(mine).flatten(), want)
            assert torch.all(local[mine] == held.index(e))
    assert torch.equal(served, torch.ones_like(served))  # every pair exactly once


def test_the_expert_ranks_partials_add_up_to_the_layer():
    cfg = load_model("tiny")
    model = MoETransformer(cfg)
    model.init_weights(0)
    block = model.layers[1]
    h_BSH = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    routing = block.route(h_BSH)
    x_PH, grouping = block.dispatch(routing)
    want = block.combine(h_BSH, routing, block.moe.experts(x_PH, grouping.offsets_E), grouping, None)
    for owners in (partition_owners(((1, 4, 6), (0, 2, 3, 5, 7)), 8),
                   ((0, 1), (1,), (1, 0), (0,), (1,), (0, 1), (0,), (1,))):  # experts 0, 2, 5 replicated
        topology = _topology(owners, 2, 1)
        partial = sum(
            local_expert_block(routing.xn_NH, LocalRouting(topology, 0, i, 0, 1, torch.device("cpu"))(routing.topk_idx_NK),
                               routing.topk_w_NK, RoutedExperts.from_indices(block.moe.experts, topology.expert_ids(0)[i]))
            for i in range(2))
        torch.testing.assert_close(h_BSH + partial.view_as(h_BSH), want, rtol=1e-6, atol=1e-6)
