import math

import pytest
import torch

from disagmoe.model.layers import RMSNorm, SwiGLU, apply_rope, rope_cos_sin


def test_rmsnorm_matches_formula():
    torch.manual_seed(0)
    norm = RMSNorm(8, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 5, 8)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * norm.weight
    torch.testing.assert_close(norm(x), expected)


def test_rope_rotates_pairs_i_and_i_plus_half_by_position_times_frequency():
    torch.manual_seed(0)
    S, R, theta = 7, 6, 500.0
    x = torch.randn(2, S, 3, R, dtype=torch.float64)
    cos, sin = rope_cos_sin(S, R, theta, torch.device("cpu"), torch.float64)
    out = apply_rope(x, cos, sin)
    # reference: complex multiplication of (x_i + j x_{i+R/2}) by exp(j * pos * theta^(-2i/R))
    half = R // 2
    z = torch.complex(x[..., :half], x[..., half:])
    freq = theta ** (-torch.arange(half, dtype=torch.float64) * 2 / R)
    angle = torch.arange(S, dtype=torch.float64)[:, None] * freq[None, :]
    rotated = z * torch.polar(torch.ones_like(angle), angle)[None, :, None, :]
    torch.testing.assert_close(out, torch.cat([rotated.real, rotated.imag], dim=-1))


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(0)
    R = 8
    q, k = torch.randn(R, dtype=torch.float64), torch.randn(R, dtype=torch.float64)
    cos, sin = rope_cos_sin(12, R, 10000.0, torch.device("cpu"), torch.float64)
    rot = lambda v, p: apply_rope(v.view(1, 1, 1, R), cos[p : p + 1], sin[p : p + 1]).flatten()  # noqa: E731
    assert math.isclose(float(rot(q, 5) @ rot(k, 2)), float(rot(q, 10) @ rot(k, 7)), rel_tol=1e-12)


def test_swiglu_matches_formula():
    torch.manual_seed(0)
    ffn = SwiGLU(6, 10)
    x = torch.randn(4, 6)
    gate, up = x @ ffn.w1.weight.T, x @ ffn.w3.weight.T
    torch.testing.assert_close(ffn(x), (gate * torch.sigmoid(gate) * up) @ ffn.w2.weight.T)


@pytest.mark.gpu
def test_cuda_fused_norm_and_rope_are_as_close_to_fp32_as_eager_bf16() -> None:
    """The torch.compile'd `fused` functions on bf16 CUDA tensors, forward and backward, are within
    bf16 error (relative norm) of the same functions in fp32, as the eager bf16 ones are."""
    import torch

    from disagmoe.model.attention import qk_norm_rope_heads
    from disagmoe.model.layers import rms_norm, rope_cos_sin, set_fusion

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(2, 64, 4, 32, device=device, generator=g), torch.randn(2, 64, 2, 32, device=device, generator=g),
              torch.randn(2, 64, 2, 32, device=device, generator=g),
              1 + 0.1 * torch.randn(32, device=device, generator=g), 1 + 0.1 * torch.randn(32, device=device, generator=g)]

    def run(dtype: torch.dtype, fusion: bool) -> list[torch.Tensor]:
        set_fusion(fusion)
        leaves = [t.to(dtype).detach().requires_grad_() for t in inputs]
        cos, sin = rope_cos_sin(64, 32, 10000.0, device, dtype)
        outs = qk_norm_rope_heads(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], cos, sin, 1e-6)
        normed = rms_norm(leaves[0], leaves[3], 1e-6)
        sum(o.float().square().sum() for o in (*outs, normed)).backward()
        return [t.float() for t in (*outs, normed, *(leaf.grad for leaf in leaves))]

    reference = run(torch.float32, False)
    compiled = run(torch.bfloat16, True)
    set_fusion(True)
    for got, want in zip(compiled, reference, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 3e-2
