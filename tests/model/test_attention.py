"""Attention modules against a naive softmax(QK^T)V reference written out here."""

import pytest
import torch

from disagmoe.model.attention import GroupedQueryAttention, MultiHeadLatentAttention
from disagmoe.model.layers import apply_rope, rope_cos_sin


def naive_causal_attention(q_BSnD, k_BSnD, v_BSnV):
    S, D = q_BSnD.shape[1], q_BSnD.shape[-1]
    scores = torch.einsum("bqnd,bknd->bnqk", q_BSnD, k_BSnD) / D**0.5
    mask = torch.ones(S, S, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(mask, float("-inf")).softmax(-1)
    return torch.einsum("bnqk,bknv->bqnv", probs, v_BSnV).flatten(2)


def randomize(module):
    torch.manual_seed(1)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


def test_gqa_with_qk_norm_matches_naive_reference(make_config):
    cfg = make_config(num_heads=4, num_kv_heads=2, head_dim=4, qk_norm=True)
    attn = randomize(GroupedQueryAttention(cfg)).double()
    x = torch.randn(2, 6, cfg.hidden_size, dtype=torch.float64)
    B, S, n, g, D = 2, 6, 4, 2, 4
    q = attn.q_norm(attn.wq(x).view(B, S, n, D))
    k = attn.k_norm(attn.wk(x).view(B, S, g, D))
    v = attn.wv(x).view(B, S, g, D)
    cos, sin = rope_cos_sin(S, D, cfg.rope_theta, x.device, x.dtype)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    k, v = k.repeat_interleave(n // g, dim=2), v.repeat_interleave(n // g, dim=2)
    torch.testing.assert_close(attn(x), attn.wo(naive_causal_attention(q, k, v)))


def test_mla_matches_naive_reference(make_mla_config):
    for q_lora_rank in (8, None):
        cfg = make_mla_config(mla=dict(q_lora_rank=q_lora_rank, kv_lora_rank=6, qk_nope_head_dim=4,
                                       qk_rope_head_dim=2, v_head_dim=3))
        attn = randomize(MultiHeadLatentAttention(cfg)).double()
        x = torch.randn(2, 5, cfg.hidden_size, dtype=torch.float64)
        B, S, n = 2, 5, cfg.num_heads
        q = attn.wq_b(attn.q_a_norm(attn.wq_a(x))) if q_lora_rank else attn.wq(x)
        q_nope, q_rope = q.view(B, S, n, 6).split([4, 2], dim=-1)
        latent, k_rope = attn.wkv_a(x).split([6, 2], dim=-1)
        k_nope, v = attn.wkv_b(attn.kv_a_norm(latent)).view(B, S, n, 7).split([4, 3], dim=-1)
        cos, sin = rope_cos_sin(S, 2, cfg.rope_theta, x.device, x.dtype)
        q = torch.cat([q_nope, apply_rope(q_rope, cos, sin)], -1)
        k = torch.cat([k_nope, apply_rope(k_rope[:, :, None], cos, sin).expand(B, S, n, 2)], -1)
        torch.testing.assert_close(attn(x), attn.wo(naive_causal_attention(q, k, v)))


def test_attention_is_causal(make_config, make_mla_config):
    for attn in (GroupedQueryAttention(make_config()), MultiHeadLatentAttention(make_mla_config())):
        randomize(attn)
        x = torch.randn(1, 6, 16)
        changed = x.clone()
        changed[:, 4:] = torch.randn(1, 2, 16)
        torch.testing.assert_close(attn(x)[:, :4], attn(changed)[:, :4])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_heads_outputs_come_back_token_major():
    """bf16 GQA with qk-norm as the model runs it (the fused RoPE, F.sdpa): q, k, v stay token-major
    in memory, the fused kernel F.sdpa picks still takes them (cuDNN or flash, not the math or
    memory-efficient fallback), and its output and q's gradient come back token-major, so the
    heads' outputs reshape to [B, S, n D] without a copy."""
    from disagmoe.kernels.attention_core import CUDNN, FLASH, fused_backend
    from disagmoe.model.attention import qk_norm_rope_heads

    B, S, n, g, D = 2, 512, 8, 2, 128
    q, k, v = (torch.randn(B, S, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (n, g, g))
    w_q, w_k = (torch.ones(D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cos, sin = rope_cos_sin(S, D, 1e6, q.device, q.dtype)
    q_h, k_h, v_h = qk_norm_rope_heads(q, k, v, w_q, w_k, cos, sin, 1e-6)
    assert all(t.transpose(1, 2).is_contiguous() for t in (q_h, k_h, v_h))
    assert fused_backend(q_h, k_h, v_h, None, True) in (CUDNN, FLASH)
    o = torch.nn.functional.scaled_dot_product_attention(q_h, k_h, v_h, is_causal=True, enable_gqa=True)
    assert o.transpose(1, 2).is_contiguous()
    (o.float().square().sum()).backward()
    assert q.grad is not None and torch.isfinite(q.grad.float()).all()
