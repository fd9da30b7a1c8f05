"""Router selection, weights, losses and the balancing bias against direct formulas."""

import itertools

import pytest
import torch

from disagmoe.model.router import Router, group_limited_mask


def make_router(cfg, seed=0, std=1.0):
    router = Router(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=torch.Generator().manual_seed(seed)) * std)
    return router


def test_softmax_topk_picks_the_best_scores_and_renormalises(make_config):
    cfg = make_config(num_experts=6, top_k=2, router=dict(score="softmax", normalize_topk=True, routed_scaling=1.5))
    router = make_router(cfg)
    x = torch.randn(20, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    r = router(x)
    probs = (x @ router.weight.T).softmax(-1)
    best = probs.sort(-1, descending=True)
    assert torch.equal(r.topk_idx_NK.sort(-1).values, best.indices[:, :2].sort(-1).values)
    expected_w = probs.gather(1, r.topk_idx_NK)
    torch.testing.assert_close(r.topk_w_NK, 1.5 * expected_w / expected_w.sum(-1, keepdim=True))
    assert torch.equal(r.load_E, torch.bincount(r.topk_idx_NK.flatten(), minlength=6))


def test_sigmoid_without_renormalisation_uses_raw_scores(make_config):
    cfg = make_config(router=dict(score="sigmoid", normalize_topk=False))
    router = make_router(cfg)
    x = torch.randn(10, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    r = router(x)
    torch.testing.assert_close(r.topk_w_NK, (x @ router.weight.T).sigmoid().gather(1, r.topk_idx_NK))


def test_all_tokens_to_one_expert(make_config):
    cfg = make_config(num_experts=4, top_k=1)
    router = make_router(cfg)
    with torch.no_grad():
        router.weight.zero_()
        router.weight[2, 0] = 10.0
    x = torch.randn(12, cfg.hidden_size, generator=torch.Generator().manual_seed(3)).abs()
    r = router(x)
    assert torch.equal(r.load_E, torch.tensor([0, 0, 12, 0]))
    torch.testing.assert_close(r.topk_w_NK, torch.ones(12, 1))


def test_topk_equal_to_num_experts_gives_every_expert_its_probability(make_config):
    cfg = make_config(num_experts=4, top_k=4, router=dict(normalize_topk=False))
    router = make_router(cfg)
    x = torch.randn(9, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    r = router(x)
    assert torch.equal(r.load_E, torch.full((4,), 9))
    probs = (x @ router.weight.T).softmax(-1)
    torch.testing.assert_close(r.topk_w_NK, probs.gather(1, r.topk_idx_NK))
    torch.testing.assert_close(r.topk_w_NK.sum(-1), torch.ones(9))


def test_group_limited_topk_matches_brute_force(make_config):
    cfg = make_config(num_experts=8, top_k=3, router=dict(score="sigmoid", num_groups=4, topk_groups=2))
    router = make_router(cfg)
    x = torch.randn(30, cfg.hidden_size, generator=torch.Generator().manual_seed(5))
    r = router(x)
    scores = (x @ router.weight.T).sigmoid()
    for n in range(30):
        s = scores[n].view(4, 2)
        group_score = s.sum(-1)  # groups of two: the sum of the two best is the group sum
        groups = group_score.topk(2).indices.tolist()
        allowed = [g * 2 + j for g in groups for j in range(2)]
        best = max(itertools.combinations(allowed, 3), key=lambda c: sum(scores[n, e] for e in c))
        assert sorted(r.topk_idx_NK[n].tolist()) == sorted(best)


def test_group_mask_with_single_expert_groups_uses_the_expert_score():
    choice = torch.tensor([[0.1, 0.9, 0.5, 0.7]])
    mask = group_limited_mask(choice, num_groups=4, topk_groups=2)
    assert mask.tolist() == [[False, True, False, True]]


def test_aux_loss_is_coef_when_balanced_and_matches_formula(make_config):
    cfg = make_config(num_experts=4, top_k=4, router=dict(aux_loss_coef=0.1))
    router = Router(cfg)
    with torch.no_grad():
        router.weight.zero_()
    r = router(torch.randn(8, cfg.hidden_size))
    torch.testing.assert_close(r.aux_loss, torch.tensor(0.1))

    cfg = make_config(num_experts=4, top_k=2, router=dict(aux_loss_coef=0.1))
    router = make_router(cfg)
    x = torch.randn(16, cfg.hidden_size, generator=torch.Generator().manual_seed(6))
    r = router(x)
    probs = (x @ router.weight.T).softmax(-1)
    f = torch.stack([(r.topk_idx_NK == e).sum() for e in range(4)]).float() / 32
    torch.testing.assert_close(r.aux_loss, 0.1 * 4 * (f * probs.mean(0)).sum())


def test_z_loss_matches_formula(make_config):
    cfg = make_config(router=dict(z_loss_coef=0.01))
    router = make_router(cfg)
    x = torch.randn(10, cfg.hidden_size, generator=torch.Generator().manual_seed(7))
    r = router(x)
    logits = x @ router.weight.T
    torch.testing.assert_close(r.z_loss, 0.01 * (logits.exp().sum(-1).log() ** 2).mean())


def test_bias_changes_selection_but_not_weights(make_config):
    cfg = make_config(num_experts=4, top_k=1, router=dict(score="sigmoid", normalize_topk=False, bias_balancing=True))
    router = make_router(cfg)
    x = torch.randn(10, cfg.hidden_size, generator=torch.Generator().manual_seed(8))
    router.expert_bias[3] = 100.0
    r = router(x)
    assert torch.equal(r.topk_idx_NK, torch.full((10, 1), 3))
    torch.testing.assert_close(r.topk_w_NK[:, 0], (x @ router.weight[3]).sigmoid())


def test_bias_update_raises_underloaded_and_lowers_overloaded_experts(make_config):
    cfg = make_config(num_experts=4, router=dict(bias_balancing=True, bias_update_rate=0.01))
    router = Router(cfg)
    router.update_bias(torch.tensor([10, 2, 4, 4]))  # mean 5
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))
    router.update_bias(torch.tensor([5, 5, 5, 5]))
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.01, 0.01]))


def test_bias_update_is_a_noop_without_bias_balancing(make_config):
    router = Router(make_config())
    assert router.expert_bias is None
    router.update_bias(torch.tensor([10, 2, 4, 4]))
    assert "expert_bias" not in router.state_dict()


def test_fixed_indices_replace_selection_and_keep_weights_differentiable(make_config):
    cfg = make_config(num_experts=4, top_k=2)
    router = make_router(cfg)
    x = torch.randn(5, cfg.hidden_size)
    fixed = torch.tensor([[0, 1]] * 5)
    r = router(x, fixed)
    assert torch.equal(r.topk_idx_NK, fixed)
    r.topk_w_NK[:, 0].sum().backward()
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="expected"):
        router(x, fixed[:3])


def test_bias_stays_fp32_when_the_model_is_cast(make_config):
    router = Router(make_config(router=dict(bias_balancing=True, bias_update_rate=1e-3)))
    router.to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and router.expert_bias.dtype == torch.float32
    router.expert_bias.fill_(0.5)
    router.update_bias(torch.tensor([1, 0, 0, 3]))
    assert router.expert_bias[1].item() == pytest.approx(0.501)  # bf16 would round this back to 0.5
    r = router(torch.randn(5, router.weight.shape[1], dtype=torch.bfloat16))
    assert r.topk_w_NK.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(7, 48, 16), (1, 64, 128), (0, 32, 8)])
def test_half_precision_logits_are_the_upcast_products_without_fp32_copies(shape):
    """bf16 rows and gate: the logits are the upcast path's (bf16 products are exact in fp32), the
    backward is fp32 autograd's with d logits rounded to bf16, and what autograd keeps for it is
    the bf16 rows and weight (no fp32 copy of the rows)."""
    from disagmoe.model.router import router_logits

    n, h, e = shape
    g = torch.Generator().manual_seed(n + h)
    x = torch.randn(n, h, generator=g).bfloat16().requires_grad_()
    w = (torch.randn(e, h, generator=g) / h**0.5).bfloat16().requires_grad_()
    dlogits = torch.randn(n, e, generator=g)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        logits = router_logits(x, w)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, torch.nn.functional.linear(x.float(), w.float()))
    assert [t.dtype for t in saved] == [torch.bfloat16, torch.bfloat16]
    logits.backward(dlogits)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    torch.nn.functional.linear(x32, w32).backward(dlogits.bfloat16().float())
    assert x.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, x32.grad.bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, w32.grad.bfloat16(), rtol=0, atol=0)


def test_fp32_and_fp64_rows_keep_their_own_precision():
    from disagmoe.model.router import router_logits

    for dtype in (torch.float32, torch.float64):
        x, w = torch.randn(5, 8, dtype=dtype), torch.randn(3, 8, dtype=dtype)
        assert router_logits(x, w).dtype == dtype
        assert torch.equal(router_logits(x, w), torch.nn.functional.linear(x, w))
