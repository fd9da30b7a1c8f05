"""Pieces of the attention stage (disagmoe/runtime/stages/attention_stage.py) against the model's own."""

import torch

from disagmoe.model_ref import load_model
from disagmoe.model import MoETransformer


def block_and_routing(seed: int = 0):
    cfg = load_model("tiny")
    model = MoETransformer(cfg)
    model.init_weights(seed)
    block = model.layers[1]
    h_BSH = torch.randn(2, 8, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))
    return cfg, block, h_BSH, block.route(h_BSH)


def test_aux_shares_of_data_parallel_halves_add_up_to_the_whole():
    """Each half's aux share, its mean probabilities weighted by the summed load (what the stage
    backpropagates once the expert ranks returned the load), adds up to the aux of all tokens."""
    cfg, block, h_BSH, whole = block_and_routing(seed=3)
    router = block.moe.router
    halves = [block.route(h_BSH[i:i + 1]) for i in range(2)]
    load_E = sum(r.load_E for r in halves)
    assert torch.equal(load_E, whole.load_E)
    shares = [(router.aux_weights(load_E) * router.mean_probs(r.scores_NE)).sum() / 2 for r in halves]
    torch.testing.assert_close(sum(shares), whole.aux_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(sum(r.z_loss / 2 for r in halves), whole.z_loss, rtol=1e-6, atol=0)
