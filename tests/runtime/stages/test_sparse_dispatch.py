"""Sparse dispatch's messages (disagmoe/runtime/stages/sparse_dispatch.py): the rows a source picks
for each expert rank, and that serving only those (padding unread) gives the dense dispatch's
partial sums and gradients, replica splits included."""

import pytest
import torch

from disagmoe.model import MoETransformer, RoutedExperts
from disagmoe.model.local_experts import local_expert_block
from disagmoe.model_ref import load_model
from disagmoe.runtime.schedule.roles import Layout
from disagmoe.runtime.stages.expert_stage import LocalRouting
from disagmoe.runtime.stages.sparse_dispatch import (SetRouting, dispatch_messages, dispatch_order, pick_rows,
                                                     received_locals, received_order, scatter_sum, sent_tokens,
                                                     unpermute, valid_rows)
from disagmoe.runtime.topology import Topology


@pytest.mark.parametrize("seed", range(6))
def test_picked_rows_come_first_in_token_order_and_the_rest_after(seed):
    g = torch.Generator().manual_seed(seed)
    T = seed * 7  # T = 0 too
    picked_QT = torch.rand(4, T, generator=g) < torch.tensor([0.0, 1.0, 0.3, 0.8])[:, None]
    index_QT, count_Q1 = pick_rows(picked_QT)
    for picked, index, count in zip(picked_QT, index_QT, count_Q1, strict=True):
        want = torch.cat([torch.nonzero(picked).flatten(), torch.nonzero(~picked).flatten()])
        assert torch.equal(index, want) and count.tolist() == [int(picked.sum())]


@pytest.mark.parametrize("seed", range(6))
def test_the_receiver_rebuilds_the_senders_whole_order_whatever_the_stale_padding(seed):
    """`received_order` from the first `count` entries of the index (the rest scrambled, as a peer
    store leaves them): the sender's `pick_rows` permutation, so pair rows land at distinct rows."""
    g = torch.Generator().manual_seed(seed)
    T = seed * 7
    picked_QT = torch.rand(3, T, generator=g) < torch.tensor([0.0, 1.0, 0.4])[:, None]
    index_QT, count_Q1 = pick_rows(picked_QT)
    for index_T, count_1 in zip(index_QT, count_Q1.to(torch.int32), strict=True):
        stale_T = torch.where(torch.arange(T) < count_1, index_T, torch.randint(0, max(T, 1), (T,), generator=g))
        assert torch.equal(received_order(stale_T.to(torch.int32), count_1), index_T)


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
    routes = [LocalRouting(topology, 0, i, dp_index, dp, torch.device("cpu")) for i in range(ranks)]
    setting = SetRouting(routes)
    local_QNK = setting(idx_NK)
    messages, index_QN, count_Q1 = dispatch_messages(xn, local_QNK, setting.num_local_Q, w, routing.load_E)
    got_parts, dx_parts, dw_parts, counts = [], [], [], []
    for i, (route, message) in enumerate(zip(routes, messages, strict=True)):
        experts = RoutedExperts.from_indices(block.moe.experts, topology.expert_ids(0)[i])
        local_NK = route(idx_NK)
        assert torch.equal(local_QNK[i], local_NK)
        x_dense, w_dense = xn.clone().requires_grad_(), w.clone().requires_grad_()
        want = local_expert_block(x_dense, local_NK, w_dense, experts)
        want.backward(dy_NH)

        rows, local_sent, w_sent, index_sent, count_sent, load = message
        n = int(count_sent)
        counts.append(n)
        assert n == int((local_NK < route.num_local).any(1).sum())
        rows, w_sent, local_sent = rows.clone(), w_sent.clone(), local_sent.clone()
        rows[n:] = torch.randn(rows[n:].shape, generator=g) * 1e3  # padding a one-sided put leaves stale
        w_sent[n:] = 7.0
        local_sent[n:] = 0  # a local expert: served if it were read
        index_sent = index_sent.clone()  # a peer store leaves the index past the count as it was: tokens repeat
        index_sent[n:] = torch.randint(0, max(len(index_sent), 1), index_sent[n:].shape, generator=g,
                                       dtype=index_sent.dtype)
        x_leaf, w_leaf = rows.requires_grad_(), w_sent.requires_grad_()
        partial = local_expert_block(x_leaf, received_locals(local_sent, count_sent, route.num_local), w_leaf,
                                     experts)
        got = unpermute(partial[None], index_sent[None], count_sent[None])[0]
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        got.backward(dy_NH)
        got_parts.append(got.detach())
        dx_parts.append((x_leaf.grad, x_dense.grad))
        dw_parts.append((w_leaf.grad, w_dense.grad))
        assert torch.equal(load, routing.load_E)
    for parts in (dx_parts, dw_parts):  # the way back, all ranks at once, against each rank's dense gradient
        back = unpermute(torch.stack([sent for sent, _ in parts]), index_QN, count_Q1)
        torch.testing.assert_close(back, torch.stack([dense for _, dense in parts]), rtol=1e-6, atol=1e-6)
    if case == "empty-rank":
        assert counts[2] == 0  # rank 2 holds no expert of the layer that a token picked: it receives none
    assert sum(counts) >= xn.shape[0]  # every token goes somewhere, some to several ranks
    # source 0 splits expert 4's rows over its owners 0 and 2 (3 owners, 2 sources): each rank's own routing;
    # otherwise one gather for all ranks
    assert (setting.local_QE is None) == (case == "replicas" and dp_index == 0)


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
        # triton on the GPU: grouped_mm waits on the host for its offsets (torch 2.11), the loop reads them
        model = MoETransformer(cfg, experts_backend="triton" if device == "cuda" else "loop")
        model.init_weights(0)
        model.to(device)
        block = model.layers[1]
        routing = block.route(h_BSH.to(device))
        setting = SetRouting([LocalRouting(topology, 0, i, 1, dp, torch.device(device)) for i in range(ranks)])
        experts = [RoutedExperts.from_indices(block.moe.experts, topology.expert_ids(0)[i]) for i in range(ranks)]
        xn, w = routing.xn_NH.detach().requires_grad_(), routing.topk_w_NK.detach().requires_grad_()
        dy = dy_NH.to(device)  # a host-to-device copy waits on the host: outside the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if device == "cuda" else "default")
        try:
            messages, index_QN, count_Q1 = dispatch_messages(xn, setting(routing.topk_idx_NK), setting.num_local_Q,
                                                             w, routing.load_E)
            partials, leaves = [], []
            for message, served, route in zip(messages, experts, setting.routes, strict=True):
                rows, local_sent, w_sent, _, count_sent, _ = message
                x_leaf, w_leaf = rows.detach().requires_grad_(), w_sent.detach().requires_grad_()
                partials.append(local_expert_block(x_leaf, received_locals(local_sent, count_sent, route.num_local),
                                                   w_leaf, served))
                leaves.append((x_leaf, w_leaf))
            received = (torch.stack([m[3] for m in messages]), torch.stack([m[4] for m in messages]))
            out = scatter_sum([p.detach() for p in partials], *received)  # the combining rank's sum
            order_QN, served_Q1 = pick_rows(sent_tokens(*received))  # COMBINE_GRAD's order, from COMBINE
            for partial, order_N, served_1 in zip(partials, order_QN, served_Q1, strict=True):  # its dy rows
                partial.backward(torch.where(valid_rows(served_1, order_N.shape[0])[:, None], dy[order_N], 0))
            dx = scatter_sum([x.grad for x, _ in leaves], index_QN, count_Q1)
            dw = scatter_sum([w.grad for _, w in leaves], index_QN, count_Q1)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        results[device] = [t.cpu() for t in (out, dx, dw)]
    for got, want in zip(results["cuda"], results["cpu"], strict=True):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)  # TF32 / reduction order on the GPU


@pytest.mark.parametrize("seed", range(4))
def test_the_combining_rank_adds_only_the_counted_rows_and_rebuilds_each_rank_s_order(seed):
    """With partial sums the attention rank adds each expert rank's first count rows at their
    tokens (`scatter_sum`: rank after rank, as the dense sum of `unpermute`'s rows; NaN rows and
    out-of-range indices past the count, a peer store's leftovers or never-written memory, are not
    used) and rebuilds from COMBINE's index and count the dispatch's picks and order
    (`sent_tokens`, `pick_rows`: COMBINE_GRAD's), ragged, empty and full ranks alike."""
    g = torch.Generator().manual_seed(seed)
    Q, T, H = 4, 23, 6
    picked_QT = torch.rand(Q, T, generator=g) < 0.4
    picked_QT[1] = False  # an empty rank
    picked_QT[2] = True  # one serving every token
    local_QTK = torch.where(picked_QT[:, :, None], 0, 1).to(torch.int32)  # one local expert, L = 1
    _, index_QT, count_Q1 = dispatch_order(local_QTK, torch.ones(Q, dtype=torch.int32))
    index32_QT = index_QT.to(torch.int32)
    rows = [torch.randn(T, H, generator=g) for _ in range(Q)]
    stale = [r.clone() for r in rows]
    for q in range(Q):
        n = int(count_Q1[q])
        stale[q][n:] = float("nan")
        index32_QT[q, n:] = torch.randint(-5, 10 * T, (T - n,), generator=g, dtype=torch.int32)
    got = scatter_sum(stale, index32_QT, count_Q1)
    want = unpermute(torch.stack(rows), index_QT, count_Q1)
    assert torch.equal(got, want[0] + want[1] + want[2] + want[3])
    assert torch.equal(sent_tokens(index32_QT, count_Q1), picked_QT)
    rebuilt_QT, rebuilt_count_Q1 = pick_rows(sent_tokens(index32_QT, count_Q1))
    assert torch.equal(rebuilt_QT, index_QT) and torch.equal(rebuilt_count_Q1, count_Q1)
    with pytest.raises(ValueError, match="one block per rank"):
        scatter_sum(stale[:2], index32_QT, count_Q1)
