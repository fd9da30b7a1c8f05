"""Pieces of the attention stage (disagmoe/runtime/attention_stage.py) against the model's own."""

import torch

from disagmoe.config import load_model
from disagmoe.model import MoETransformer
from disagmoe.runtime.attention_stage import combine_layer_output, router_scores


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
    got = combine_layer_output(h_BSH, routing.topk_w_NK, y_PH, routing.topk_idx_NK, shared_NH, cfg.num_experts)
    assert torch.equal(got, want)


def test_aux_shares_of_data_parallel_halves_add_up_to_the_whole():
    """Each half's aux share, formed with the summed load, adds up to the aux of all tokens."""
    cfg, block, h_BSH, whole = block_and_routing(seed=3)
    router = block.moe.router
    halves = [block.route(h_BSH[i:i + 1]) for i in range(2)]
    load_E = sum(r.load_E for r in halves)
    assert torch.equal(load_E, whole.load_E)
    shares = [router.aux_loss(router_scores(block, r.xn_NH), load_E) / 2 for r in halves]
    torch.testing.assert_close(sum(shares), whole.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(sum(r.z_loss / 2 for r in halves), whole.z_loss, rtol=1e-6, atol=0)
