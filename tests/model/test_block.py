"""The runtime's decomposition of a MoE layer composes to the single-process forward."""

import torch

from disagmoe.model.block import DenseBlock, MoEBlock
from disagmoe.model.experts import RoutedExperts
from disagmoe.model.transformer import MoETransformer


def test_steps_split_over_two_expert_ranks_equal_forward(make_config):
    cfg = make_config(num_experts=6, top_k=2, num_shared_experts=1)
    model = MoETransformer(cfg)
    model.init_weights(seed=5)
    block = model.layers[0]
    assert isinstance(block, MoEBlock)
    x = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(0))
    expected, _ = block(x)

    h = block.attention_part(x)
    routing = block.route(h)
    x_P, grouping = block.dispatch(routing)
    # two "expert ranks": experts 0..2 and 3..5, each sees only its rows and local offsets
    split = int(grouping.offsets_E[2])
    rank0 = RoutedExperts.from_slice(block.moe.experts, 0, 3)
    rank1 = RoutedExperts.from_slice(block.moe.experts, 3, 6)
    y_P = torch.cat([rank0(x_P[:split], grouping.offsets_E[:3]),
                     rank1(x_P[split:], grouping.offsets_E[3:] - split)])
    out = block.combine(h, routing, y_P, grouping, block.shared_ffn(routing))
    torch.testing.assert_close(out, expected)


def test_moe_block_equals_dense_mixture_reference(make_config):
    cfg = make_config(num_experts=4, top_k=2, num_shared_experts=2, shared_expert_ffn_size=4)
    model = MoETransformer(cfg)
    model.init_weights(seed=6)
    block = model.layers[1]
    x = torch.randn(1, 5, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    out, routing = block(x)
    h = block.attention_part(x)
    xn = block.ffn_norm(h).flatten(0, 1)
    w13, w2, Fw = block.moe.experts.w13_EH2F, block.moe.experts.w2_EFH, cfg.expert_ffn_size
    expert = lambda e, v: (torch.nn.functional.silu(v @ w13[e][:, :Fw]) * (v @ w13[e][:, Fw:])) @ w2[e]  # noqa: E731
    rows = [sum(routing.topk_w_NK[n, k] * expert(int(routing.topk_idx_NK[n, k]), xn[n]) for k in range(2))
            for n in range(5)]
    expected = h + (torch.stack(rows) + block.moe.shared_experts(xn)).view_as(h)
    assert block.moe.shared_experts.w1.weight.shape == (8, cfg.hidden_size)  # 2 shared x width 4
    torch.testing.assert_close(out, expected)


def test_dense_block_is_attention_then_swiglu(make_config):
    cfg = make_config(num_dense_layers=1, dense_ffn_size=12)
    block = MoETransformer(cfg).layers[0]
    assert isinstance(block, DenseBlock)
    x = torch.randn(1, 4, cfg.hidden_size)
    h = block.attention_part(x)
    torch.testing.assert_close(block(x), h + block.ffn(block.ffn_norm(h)))
