"""Sparse dispatch's messages (disagmoe/runtime/stages/sparse_dispatch.py): the rows a source picks
for an expert rank, and that serving only those (padding unread) gives the dense dispatch's
partial sums and gradients, replica splits included."""

import pytest
import torch

from disagmoe.model import MoETransformer, RoutedExperts
from disagmoe.model.local_experts import local_expert_block
from disagmoe.model_ref import load_model
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.stages.expert_stage import LocalRouting
from disagmoe.runtime.stages.sparse_dispatch import dispatch_message, pick_rows, received_locals, unpermute
from disagmoe.runtime.topology import Topology


@pytest.mark.parametrize("seed", range(6))
def test_picked_rows_come_first_in_token_order_and_the_rest_after(seed):
    g = torch.Generator().manual_seed(seed)
    T = 1 + seed * 7
    picked = torch.rand(T, generator=g) < (0.0, 1.0, 0.3, 0.5, 0.8, 0.1)[seed]
    index, count = pick_rows(picked)
    want = torch.cat([torch.nonzero(picked).flatten(), torch.nonzero(~picked).flatten()])
    assert torch.equal(index, want) and count.tolist() == [int(picked.sum())]


def _topology(owners, ranks: int, dp: int) -> Topology:
    layout = Layout(attention_ranks=dp, expert_ranks=ranks, pipeline_groups=1, num_layers=1, num_dense_layers=0)
    return Topology.disaggregated(layout, len(owners), {0: owners})


OWNERS = {  # 8 experts on 3 expert ranks: one rank empty, skewed, and replicas split over owners
    "empty-rank": ((0,), (0,), (1,), (1,), (0,), (1,), (0,), (2,)),  # no token picks expert 7
    "skewed": ((0,), (0,), (0,), (0,), (0,), (0,), (1,), (2,)),
    "replicas": ((0, 1), (1,), (2, 0), (0,), (1, 2, 0), (2,), (0,), (1,)),
}


@pytest.mark.parametrize("case", OWNERS)
@pytest.mark.parametrize("dp_index", [0, 1])
def test_serving_only_the_rows_sent_gives_the_dense_partial_sums_and_gradients(case, dp_index):
    cfg = load_model("tiny")
    model = MoETransformer(cfg)
    model.init_weights(0)
    block = model.layers[1]
    g = torch.Generator().manual_seed(dp_index)
    h_BSH = torch.randn(2, 8, cfg.hidden_size, generator=g)
    routing = block.route(h_BSH)
    idx_NK = routing.topk_idx_NK.clone()
    if case == "empty-rank":
        idx_NK[idx_NK == 7] = 6  # a pair of expert 6 twice is still a pair each
    owners, ranks, dp = OWNERS[case], 3, 2
    topology = _topology(owners, ranks, dp)
    dy_NH = torch.randn(routing.xn_NH.shape, generator=g)
    xn = routing.xn_NH.detach()
    w = routing.topk_w_NK.detach()
    counts = []
    for i in range(ranks):
        experts = RoutedExperts.from_indices(block.moe.experts, topology.expert_ids(0)[i])
        route = LocalRouting(topology, 0, i, dp_index, dp, torch.device("cpu"))
        local_NK = route(idx_NK)
        x_dense, w_dense = xn.clone().requires_grad_(), w.clone().requires_grad_()
        want = local_expert_block(x_dense, local_NK, w_dense, experts)
        want.backward(dy_NH)

        tensors, index, count = dispatch_message(xn, local_NK, route.num_local, w, routing.load_E)
        rows, local_sent, w_sent, index_sent, count_sent, load = tensors
        n = int(count_sent)
        counts.append(n)
        assert n == int((local_NK < route.num_local).any(1).sum())
        rows, w_sent = rows.clone(), w_sent.clone()
        rows[n:] = torch.randn(rows[n:].shape, generator=g) * 1e3  # padding a one-sided put leaves stale
        w_sent[n:] = 7.0
        local_sent = local_sent.clone()
        local_sent[n:] = 0  # a local expert: served if it were read
        x_leaf, w_leaf = rows.requires_grad_(), w_sent.requires_grad_()
        partial = local_expert_block(x_leaf, received_locals(local_sent, count_sent, route.num_local), w_leaf,
                                     experts)
        got = unpermute(partial, index_sent, count_sent)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        got.backward(dy_NH)
        torch.testing.assert_close(unpermute(x_leaf.grad, index, count), x_dense.grad, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(unpermute(w_leaf.grad, index, count), w_dense.grad, rtol=1e-6, atol=1e-6)
        assert torch.equal(load, routing.load_E)
    if case == "empty-rank":
        assert counts[2] == 0  # rank 2 holds no expert of the layer: it receives no token
    assert sum(counts) >= xn.shape[0]  # every token goes somewhere, some to several ranks


@pytest.mark.gpu
@pytest.mark.parametrize("case", OWNERS)
def test_gpu_sparse_dispatch_makes_no_host_wait_and_matches_the_cpu(case):
    """Sender and receiver of every expert rank, forward and backward, on the GPU under the sync
    check (`torch.cuda.set_sync_debug_mode('error')`: a host wait raises), against the same on CPU."""
    cfg = load_model("tiny")
    owners, ranks, dp = OWNERS[case], 3, 2
    topology = _topology(owners, ranks, dp)
    g = torch.Generator().manual_seed(1)
    h_BSH = torch.randn(2, 8, cfg.hidden_size, generator=g)
    dy_NH = torch.randn(16, cfg.hidden_size, generator=g)
    results = {}
    for device in ("cpu", "cuda"):
        model = MoETransformer(cfg, experts_backend="grouped_mm" if device == "cuda" else "loop")
        model.init_weights(0)
        model.to(device)
        block = model.layers[1]
        routing = block.route(h_BSH.to(device))
        routes = [LocalRouting(topology, 0, i, 1, dp, torch.device(device)) for i in range(ranks)]
        experts = [RoutedExperts.from_indices(block.moe.experts, topology.expert_ids(0)[i]) for i in range(ranks)]
        xn, w = routing.xn_NH.detach().requires_grad_(), routing.topk_w_NK.detach().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if device == "cuda" else "default")
        try:
            out, dx, dw = 0, 0, 0
            for route, served in zip(routes, experts, strict=True):
                tensors, index, count = dispatch_message(xn, route(routing.topk_idx_NK), route.num_local, w,
                                                         routing.load_E)
                rows, local_sent, w_sent, index_sent, count_sent, _ = tensors
                x_leaf, w_leaf = rows.detach().requires_grad_(), w_sent.detach().requires_grad_()
                partial = local_expert_block(x_leaf, received_locals(local_sent, count_sent, route.num_local), w_leaf,
                                             served)
                placed = unpermute(partial, index_sent, count_sent)
                placed.backward(dy_NH.to(device))
                out = out + placed.detach()
                dx = dx + unpermute(x_leaf.grad, index, count)
                dw = dw + unpermute(w_leaf.grad, index, count)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[device] = [t.cpu() for t in (out, dx, dw)]
    for got, want in zip(results["cuda"], results["cpu"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # TF32 / reduction order on the GPU
