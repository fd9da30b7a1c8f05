import math

import pytest
import torch

from disagmoe.model.layers import DeferrableLinear, RMSNorm, SwiGLU, apply_rope, rope_cos_sin


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
def test_cuda_a_fused_function_holds_a_graph_per_signature_past_dynamos_default_limit() -> None:
    """Twelve input signatures of one `fused` function in one process (shapes, dtypes, autograd on
    and off: a model's norms in training and evaluation, several models in one test process) each
    compile, where dynamo's default of 8 graphs per function made the ninth a hard error."""
    from disagmoe.model.layers import rms_norm

    gen = torch.Generator().manual_seed(0)
    cases = [((2 + i, 64 * (1 + i % 3)), dtype, grad) for i, (dtype, grad) in
             enumerate([(torch.bfloat16, True), (torch.float32, False)] * 6)]
    for shape, dtype, grad in cases:
        x = torch.randn(shape, generator=gen).to("cuda", dtype).requires_grad_(grad)
        weight = torch.rand(shape[-1], generator=gen).to("cuda", dtype)
        got = rms_norm(x, weight, 1e-6)
        x32 = x.detach().float()
        want = weight.float() * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype).float()
        torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
def test_cuda_fused_norm_and_rope_are_as_close_to_fp32_as_eager_bf16() -> None:
    """The torch.compile'd `fused` functions on bf16 CUDA tensors, forward and backward, are within
    bf16 error (relative norm) of the same functions in fp32, as the eager bf16 ones are; `add_rms_norm`
    with a gradient on both its outputs (the residual stream's and the norm's, summed in its backward)."""
    import torch

    from disagmoe.model.attention import qk_norm_rope_heads
    from disagmoe.model.layers import add_rms_norm, rms_norm, rope_cos_sin, set_fusion

    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    inputs = [torch.randn(2, 64, 4, 32, device=device, generator=g), torch.randn(2, 64, 2, 32, device=device, generator=g),
              torch.randn(2, 64, 2, 32, device=device, generator=g),
              1 + 0.1 * torch.randn(32, device=device, generator=g), 1 + 0.1 * torch.randn(32, device=device, generator=g),
              torch.randn(2, 64, 4, 32, device=device, generator=g)]

    def run(dtype: torch.dtype, fusion: bool) -> list[torch.Tensor]:
        set_fusion(fusion)
        leaves = [t.to(dtype).detach().requires_grad_() for t in inputs]
        cos, sin = rope_cos_sin(64, 32, 10000.0, device, dtype)
        outs = qk_norm_rope_heads(leaves[0], leaves[1], leaves[2], leaves[3], leaves[4], cos, sin, 1e-6)
        normed = rms_norm(leaves[0], leaves[3], 1e-6)
        h, h_normed = add_rms_norm(leaves[0], leaves[5], leaves[4], 1e-6)
        sum(o.float().square().sum() for o in (*outs, normed, h, h_normed)).backward()
        return [t.float() for t in (*outs, normed, h, h_normed, *(leaf.grad for leaf in leaves))]

    reference = run(torch.float32, False)
    compiled = run(torch.bfloat16, True)
    set_fusion(True)
    for got, want in zip(compiled, reference, strict=True):
        assert ((got - want).norm() / want.norm()).item() < 3e-2


# --- FP8 dense projections (DeferrableLinear.set_fp8, kernels.fp8_dense, recipe rowwise) --------

FP8_REL_BOUND = 7e-2  # e4m3 rowwise against fp64 (tests/kernels/test_fp8_dense.py)


def _fp8_rel(got, want):
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def _fp8_linear_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    lin = DeferrableLinear(64, 48)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(48, 64, generator=gen) / 8)
    x = torch.randn(2, 24, 64, generator=gen)
    dy = torch.randn(2, 24, 48, generator=gen)
    return lin, x, dy


def test_fp8_deferrable_linear_tracks_fp64_and_holds_its_weight_grad_back():
    """Emulated FP8 (dequantise then matmul): output and both gradients within the e4m3 bound of
    fp64; inside `deferred_weight_grads` d W waits and, once run, equals the plain FP8 backward's."""
    from disagmoe.kernels.deferral import deferred_weight_grads

    lin, x, dy = _fp8_linear_inputs()
    lin.set_fp8(True, emulate=True)
    x_plain = x.clone().requires_grad_()
    y = lin(x_plain)
    y.backward(dy)
    w64, x64, dy64 = lin.weight.double(), x.double().reshape(-1, 64), dy.double().reshape(-1, 48)
    assert _fp8_rel(y.reshape(-1, 48), x64 @ w64.T) < FP8_REL_BOUND
    assert _fp8_rel(x_plain.grad.reshape(-1, 64), dy64 @ w64) < FP8_REL_BOUND
    assert _fp8_rel(lin.weight.grad, dy64.T @ x64) < FP8_REL_BOUND
    plain_dw = lin.weight.grad.clone()
    lin.weight.grad = None
    x_held = x.clone().requires_grad_()
    with deferred_weight_grads() as held:
        lin(x_held).backward(dy)
    assert lin.weight.grad is None and len(held) == 1 and torch.equal(x_held.grad, x_plain.grad)
    held[0]()
    assert torch.equal(lin.weight.grad, plain_dw)


def test_fp8_deferrable_linear_off_is_the_plain_linear_and_refuses_unaligned_shapes():
    lin, x, _ = _fp8_linear_inputs()
    lin.set_fp8(True, emulate=True)
    lin.set_fp8(False)
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight))
    with pytest.raises(ValueError, match="multiples of 16"):
        DeferrableLinear(64, 40).set_fp8(True)


def test_fp8_deferrable_linear_reuses_its_weight_copies_until_refreshed(monkeypatch):
    """`prepare_fp8` quantises W twice (forward and data-gradient copies) and two micro-batches'
    forwards and backwards then quantise only activations and gradients, with the per-call path's
    bits; a write through W (an optimizer's in-place step) sends calls back to per-call
    quantisation, and a write into W's storage that W's version does not see (FlatAdamW's flat
    buffer) is picked up by the next `prepare_fp8`, into the same buffers."""
    from disagmoe.kernels import fp8_dense
    from disagmoe.kernels.fp8_stats import FIELDS, TOTAL

    lin, x, dy = _fp8_linear_inputs()
    quantised = []  # the first dimension of every tensor quantised: 48 (W) or 64 (W^T) for the weight
    original = fp8_dense.quantize_rowwise
    monkeypatch.setattr(fp8_dense, "quantize_rowwise", lambda t, *a, **kw: quantised.append(t) or original(t, *a, **kw))
    weight_calls = lambda: sum(t.data_ptr() == lin.weight.data_ptr() for t in quantised)  # noqa: E731

    def step(module):
        xs = [x.clone().requires_grad_() for _ in range(2)]
        ys = [module(xi) for xi in xs]
        for y in ys:
            y.backward(dy)
        return [y.detach() for y in ys], [xi.grad for xi in xs]

    plain, per_call_row = _fp8_linear_inputs()[0], torch.zeros(FIELDS, dtype=torch.int64)
    plain.set_fp8(True, per_call_row, emulate=True)
    row = torch.zeros(FIELDS, dtype=torch.int64)
    lin.set_fp8(True, row, emulate=True)
    lin.prepare_fp8()
    assert weight_calls() == 2 and lin.fp8_copies.fits(lin.weight)
    buffers = [t.data_ptr() for t in (*lin.fp8_copies.rows, *lin.fp8_copies.cols)]
    quantised.clear()
    got, want = step(lin), step(plain)
    assert weight_calls() == 0  # both micro-batches read the copies
    assert all(torch.equal(a, b) for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True))
    assert torch.equal(lin.weight.grad, plain.weight.grad)
    assert row[TOTAL] < per_call_row[TOTAL]  # W counted once (at the refresh), not per micro-batch
    with torch.no_grad():
        lin.weight.mul_(0.5)  # through W: its version moves
        plain.weight.mul_(0.5)
    quantised.clear()
    got, want = step(lin), step(plain)
    assert weight_calls() == 4 and torch.equal(got[0][0], want[0][0])  # per call: 2 forwards, 2 backwards
    lin.prepare_fp8()
    with torch.no_grad():
        lin.weight.data.mul_(2.0)  # into its storage, W's version unchanged: stale until refreshed
        plain.weight.data.mul_(2.0)
    assert lin.fp8_copies.fits(lin.weight)  # not seen by the host check: hence the trainer's refresh
    lin.prepare_fp8()
    quantised.clear()
    got, want = step(lin), step(plain)
    assert weight_calls() == 0 and torch.equal(got[0][0], want[0][0]) and torch.equal(got[1][1], want[1][1])
    assert [t.data_ptr() for t in (*lin.fp8_copies.rows, *lin.fp8_copies.cols)] == buffers


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")
def test_cuda_fp8_weight_copies_refresh_inside_a_captured_graph():
    """`prepare_fp8` and a forward captured in one CUDA graph: a replay after the weight changed in
    place refreshes the copies (the new weight's per-call quantisations, bit for bit) and the
    output follows (the library GEMM's algorithm may differ between capture and eager: a bound)."""
    from disagmoe.kernels import fp8_dense

    gen = torch.Generator(device="cuda").manual_seed(0)
    lin = DeferrableLinear(256, 128).cuda().bfloat16()
    lin.set_fp8(True)
    x = torch.randn(64, 256, device="cuda", generator=gen).bfloat16()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(side):  # compile the kernels before the capture
        lin.prepare_fp8()
        lin(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        lin.prepare_fp8()
        y = lin(x)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(128, 256, device="cuda", generator=gen).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    for (q, s), (want_q, want_s) in ((lin.fp8_copies.rows, fp8_dense.quantize_rowwise(lin.weight)),
                                     (lin.fp8_copies.cols, fp8_dense.quantize_rowwise(lin.weight.t()))):
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    assert _fp8_rel(y, fp8_dense.fprop(x, lin.weight)) < 1e-2
