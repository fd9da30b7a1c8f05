"""The attention block without its layout copies and gradient sums (issue 20; disagmoe/model/attention.py,
`model.layers.shared_input_linears`, `model.router._input_grad`) against the implementation they
replace, kept here as the reference (`reference_*`, main at 897d290): q, k, v come out of the
`fused` functions token-major and contiguous and are viewed heads-first outside them, so no
[B, S, heads, D] gradient is copied in the compiled backward or in the projections' views'
backward; the projections that read one input are one autograd node whose d x the GEMMs sum.

Forward outputs and every parameter gradient but those fed by the shared input's gradient are
the reference's bits; that input's gradient is the same sum rounded otherwise (`_close`). On the
CPU the `fused` functions run eagerly and F.sdpa is the math kernel, so the copies themselves are
checked by `test_compiled_on_the_cpu_the_tokens_functions_copy_no_gradient` (inductor on the CPU)
and on a GPU by the `gpu` tests (cuDNN, the fused functions compiled), which also compare bf16
results with the reference's."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from disagmoe.kernels.attention_core import causal_attention
from disagmoe.model import attention as attention_module
from disagmoe.model.attention import GroupedQueryAttention, MultiHeadLatentAttention
from disagmoe.model.layers import SwiGLU, fused, rope_cos_sin, swiglu


# --- the reference: main's attention and SwiGLU, as they were -------------------------------------------------


def _inside(tokens_fn, with_v: bool):
    """main's heads function: `tokens_fn`'s body and the heads-first transposes in one function (so
    compiled in one graph, as main compiled them); the same math as the model's token-major
    functions, which main's bodies were but for the transposes."""
    def heads(*args):
        if with_v:  # GQA: v passes through, transposed
            q, k, v, *rest = args
            return tuple(t.transpose(1, 2) for t in (*tokens_fn.__wrapped__(q, k, *rest), v))
        return tuple(t.transpose(1, 2) for t in tokens_fn.__wrapped__(*args))
    return heads


_qk_norm_rope_heads = _inside(attention_module.qk_norm_rope_tokens, with_v=True)
# compiled on CUDA as main compiled them: the transposes inside the compiled graph
reference_rope_heads = fused(_inside(attention_module.rope_tokens, with_v=True))
reference_qk_norm_rope_heads = fused(_qk_norm_rope_heads)
reference_mla_rope_heads = fused(_inside(attention_module.mla_rope_tokens, with_v=False))


def reference_gqa(attn: GroupedQueryAttention, x_BSH: torch.Tensor) -> torch.Tensor:
    """main's `GroupedQueryAttention.forward`: one `DeferrableLinear` call per projection."""
    B, S, _ = x_BSH.shape
    q_BSnD = attn.wq(x_BSH).view(B, S, attn.num_heads, attn.head_dim)
    k_BSgD = attn.wk(x_BSH).view(B, S, attn.num_kv_heads, attn.head_dim)
    v_BSgD = attn.wv(x_BSH).view(B, S, attn.num_kv_heads, attn.head_dim)
    cos_SD, sin_SD = rope_cos_sin(S, attn.head_dim, attn.rope_theta, x_BSH.device, x_BSH.dtype, attn.rope_scaling)
    if attn.q_norm is not None:
        q_BnSD, k_BgSD, v_BgSD = reference_qk_norm_rope_heads(q_BSnD, k_BSgD, v_BSgD, attn.q_norm.weight,
                                                              attn.k_norm.weight, cos_SD, sin_SD, attn.q_norm.eps)
    else:
        q_BnSD, k_BgSD, v_BgSD = reference_rope_heads(q_BSnD, k_BSgD, v_BSgD, cos_SD, sin_SD)
    o_BnSD = causal_attention(q_BnSD, k_BgSD, v_BgSD, None, gqa=attn.num_kv_heads != attn.num_heads)
    return attn.wo(o_BnSD.transpose(1, 2).reshape(B, S, -1))


def reference_mla(attn: MultiHeadLatentAttention, x_BSH: torch.Tensor) -> torch.Tensor:
    """main's `MultiHeadLatentAttention.forward`."""
    B, S, _ = x_BSH.shape
    n = attn.num_heads
    q_flat = attn.wq_b(attn.q_a_norm(attn.wq_a(x_BSH))) if attn.q_low_rank else attn.wq(x_BSH)
    c_BSC, k_rope_BSR = attn.wkv_a(x_BSH).split([attn.kv_rank, attn.rope_dim], dim=-1)
    kv_BSnX = attn.wkv_b(attn.kv_a_norm(c_BSC)).view(B, S, n, attn.nope_dim + attn.v_dim)
    cos_SR, sin_SR = rope_cos_sin(S, attn.rope_dim, attn.rope_theta, x_BSH.device, x_BSH.dtype, attn.rope_scaling)
    q_BnSQ, k_BnSQ, v_BnSV = reference_mla_rope_heads(q_flat.view(B, S, n, -1), kv_BSnX, k_rope_BSR, cos_SR, sin_SR,
                                                      attn.nope_dim)
    o_BnSV = causal_attention(q_BnSQ, k_BnSQ, v_BnSV, None, scale=attn.softmax_scale)
    return attn.wo(o_BnSV.transpose(1, 2).reshape(B, S, n * attn.v_dim))


def reference_swiglu(ffn: SwiGLU, x: torch.Tensor) -> torch.Tensor:
    return ffn.w2(swiglu(ffn.w1(x), ffn.w3(x)))


# --- helpers ---------------------------------------------------------------------------------------------------


def randomize(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    return module


def run(module: torch.nn.Module, forward, x: torch.Tensor, dy: torch.Tensor) -> dict[str, torch.Tensor]:
    """forward(module, x) and its backward from dy: {"out", "x", parameter names: their gradients}."""
    module.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    out = forward(module, x)
    out.backward(dy)
    return {"out": out.detach(), "x": x.grad, **{name: p.grad for name, p in module.named_parameters()}}


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same sum rounded otherwise: within a few of the dtype's roundings of the tensor's largest
    element (the partial sums' scale; an element may be a cancellation's small remainder)."""
    eps = torch.finfo(want.dtype).eps
    torch.testing.assert_close(got, want, rtol=4 * eps, atol=4 * eps * want.abs().max().item())


def check(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], summed: set[str]) -> None:
    """Bits equal, but for the gradients `summed` (the shared input's and those computed from it)."""
    assert got.keys() == want.keys()
    for name in want:
        if name in summed:
            _close(got[name], want[name])
        else:
            assert torch.equal(got[name], want[name]), f"{name}: not the reference's bits"


def random_gqa_shapes(count: int, seed: int) -> list[dict]:
    """Random GQA (g < n), MHA (g = n) and MQA (g = 1) shapes, with and without qk-norm."""
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        n = rng.choice([2, 4, 6, 8])
        g = [1, n, *(d for d in range(2, n) if n % d == 0)][i % 3 if n > 2 else i % 2]
        shapes.append(dict(num_heads=n, num_kv_heads=g, head_dim=rng.choice([4, 6, 8, 16]),
                           hidden_size=rng.choice([8, 16, 24]), qk_norm=bool(i % 2), B=rng.randint(1, 3),
                           S=rng.randint(1, 11)))
    return shapes


GQA_SHAPES = random_gqa_shapes(8, seed=20)
DTYPES = [torch.float64, torch.float32, torch.bfloat16]


# --- CPU: the same results as the reference --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", GQA_SHAPES, ids=lambda s: "n{num_heads}g{num_kv_heads}D{head_dim}".format(**s)
                         + ("-qk-norm" if s["qk_norm"] else ""))
def test_gqa_forward_and_gradients_are_the_references(make_config, shape, dtype):
    shape = dict(shape)
    B, S = shape.pop("B"), shape.pop("S")
    attn = randomize(GroupedQueryAttention(make_config(**shape)), seed=S).to(dtype)
    g = torch.Generator().manual_seed(B * 100 + S)
    x = torch.randn(B, S, shape["hidden_size"], generator=g).to(dtype)
    dy = torch.randn(B, S, shape["hidden_size"], generator=g).to(dtype)
    got = run(attn, lambda m, x_: m(x_), x, dy)
    want = run(attn, reference_gqa, x, dy)
    check(got, want, summed={"x"})  # x feeds wq, wk and wv: its gradient is their sum


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("q_lora_rank", [8, None], ids=["q-lora", "no-q-lora"])
def test_mla_forward_and_gradients_are_the_references(make_mla_config, q_lora_rank, dtype):
    cfg = make_mla_config(mla=dict(q_lora_rank=q_lora_rank, kv_lora_rank=6, qk_nope_head_dim=4, qk_rope_head_dim=2,
                                   v_head_dim=3))
    attn = randomize(MultiHeadLatentAttention(cfg), seed=3).to(dtype)
    g = torch.Generator().manual_seed(4)
    x, dy = (torch.randn(2, 7, cfg.hidden_size, generator=g).to(dtype) for _ in range(2))
    got = run(attn, lambda m, x_: m(x_), x, dy)
    want = run(attn, reference_mla, x, dy)
    check(got, want, summed={"x"})  # x feeds wq (or wq_a) and wkv_a


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_swiglu_forward_and_gradients_are_the_references(dtype):
    ffn = randomize(SwiGLU(12, 20), seed=5).to(dtype)
    g = torch.Generator().manual_seed(6)
    x, dy = torch.randn(3, 5, 12, generator=g).to(dtype), torch.randn(3, 5, 12, generator=g).to(dtype)
    check(run(ffn, lambda m, x_: m(x_), x, dy), run(ffn, reference_swiglu, x, dy), summed={"x"})


def test_the_heads_are_transposes_of_contiguous_token_major_tensors():
    """What the compiled functions return is contiguous [B, S, heads, D] (its tangent's guessed
    layout is then its own); what attention gets is its transpose, without a copy."""
    B, S, n, g, D = 2, 5, 4, 2, 8
    q, k, v = torch.randn(B, S, n, D), torch.randn(B, S, g, D), torch.randn(B, S, g, D)
    w = torch.ones(D)
    cos, sin = rope_cos_sin(S, D, 1e4, q.device, q.dtype)
    tokens = [*attention_module.rope_tokens(q, k, cos, sin), *attention_module.qk_norm_rope_tokens(q, k, w, w, cos, sin,
                                                                                                      1e-6)]
    assert all(t.is_contiguous() for t in tokens)
    for heads in (attention_module.rope_heads(q, k, v, cos, sin),
                  attention_module.qk_norm_rope_heads(q, k, v, w, w, cos, sin, 1e-6)):
        assert [t.shape for t in heads] == [(B, n, S, D), (B, g, S, D), (B, g, S, D)]
        assert all(t.transpose(1, 2).is_contiguous() for t in heads)
        assert heads[2].data_ptr() == v.data_ptr()  # v itself, viewed
    kv = torch.randn(B, S, n, 4 + 3)
    mla = attention_module.mla_rope_tokens(torch.randn(B, S, n, 6), kv, torch.randn(B, S, 2), *rope_cos_sin(
        S, 2, 1e4, q.device, q.dtype), 4)
    assert mla[0].is_contiguous() and mla[1].is_contiguous()
    assert mla[2].data_ptr() == kv[..., 4:].data_ptr()  # MLA's v: the kv projection's value columns, viewed


# --- CPU, compiled: the copies themselves ----------------------------------------------------------------------


def _backward_copy_nodes(forward, leaves: list[torch.Tensor]) -> list[str]:
    """The autograd nodes under which `aten::copy_` ran in the backward of `forward(*leaves)` (the
    heads, [B, heads, S, D]), their gradients handed in as cuDNN's backward allocates them
    (`empty_like` the operand: token-major). The first run compiles the backward; the second counts."""
    from torch.profiler import profile

    nodes = []
    for record in (False, True):
        heads = forward(*leaves)
        grads = [torch.randn_like(t) for t in heads]
        assert all(gr.stride() == t.stride() for gr, t in zip(grads, heads, strict=True))
        with profile(record_shapes=True) if record else contextlib.nullcontext() as prof:
            torch.autograd.backward(heads, grads)
    for event in prof.events():
        if event.name == "aten::copy_":
            node = event.cpu_parent
            while node is not None and not node.name.endswith(("Backward0", "Backward")):
                node = node.cpu_parent
            nodes.append(node.name if node is not None else "(no autograd node)")
    return nodes


@pytest.mark.slow  # inductor compiles C++ on the CPU
def test_compiled_on_the_cpu_the_tokens_functions_copy_no_gradient():
    """Compiled by inductor (CPU), AOTAutograd guessing tangents contiguous (torch 2.11's default;
    `guess_tangent_strides_as_outputs` off here), the reference's fused function, which returns
    the heads-first transposes, copies q's and k's gradients twice each (heads-first in the
    compiled backward, back token-major in the projections' views' backward); the token-major
    functions with the transposes outside copy none."""
    import torch._functorch.config as functorch_config

    B, S, n, g, D = 2, 16, 4, 2, 8
    gen = torch.Generator().manual_seed(0)
    leaves = [torch.randn(B, S, h * D, generator=gen).requires_grad_() for h in (n, g, g)]  # the projections' outputs
    leaves += [torch.ones(D, requires_grad=True) for _ in range(2)]  # the qk-norm gains
    cos, sin = rope_cos_sin(S, D, 1e4, torch.device("cpu"), torch.float32)
    views = lambda q, k, v: (q.view(B, S, n, D), k.view(B, S, g, D), v.view(B, S, g, D))  # noqa: E731
    old = torch.compile(_qk_norm_rope_heads, dynamic=False, fullgraph=True)
    new = torch.compile(attention_module.qk_norm_rope_tokens.__wrapped__, dynamic=False, fullgraph=True)

    def reference(q, k, v, w_q, w_k):
        return old(*views(q, k, v), w_q, w_k, cos, sin, 1e-6)

    def model(q, k, v, w_q, w_k):
        q, k, v = views(q, k, v)
        return attention_module.heads_first(*new(q, k, w_q, w_k, cos, sin, 1e-6), v)

    settings = {"guess_tangent_strides_as_outputs": False} if hasattr(
        functorch_config, "guess_tangent_strides_as_outputs") else {}
    with functorch_config.patch(settings):
        copies_old, copies_new = _backward_copy_nodes(reference, leaves), _backward_copy_nodes(model, leaves)
    assert sorted(copies_old) == ["CompiledFunctionBackward"] * 2 + ["ViewBackward0"] * 2, (
        f"the reference's copies: {copies_old} (expected q's and k's two each, or this check sees nothing)")
    assert copies_new == [], f"copies left in the backward: {copies_new}"


# --- GPU: the kernels gone, the bf16 results the reference's ---------------------------------------------------

QWEN3_HEADS = dict(num_heads=32, num_kv_heads=4, head_dim=128, qk_norm=True)  # the Qwen3-30B-A3B head layout
GPU_B, GPU_S, GPU_H = 2, 1024, 1024


def _gpu_attention_runs(make_config, device: str = "cuda") -> dict[str, dict]:
    """One bf16 GQA attention (Qwen3's heads, qk-norm, cuDNN or flash through F.sdpa), its forward and
    backward by the reference and by the model, each compiled (two warm-up runs, AOTAutograd's
    tangent guess contiguous where that is a setting, as torch 2.11's), then profiled once:
    {"reference" / "model": {"grads": run's results, "events": [(name, node, input shapes)]}}."""
    import torch._functorch.config as functorch_config
    from torch.profiler import ProfilerActivity, profile

    from disagmoe.model.layers import set_fusion

    set_fusion(True)
    cfg = make_config(hidden_size=GPU_H, **QWEN3_HEADS)
    attn = randomize(GroupedQueryAttention(cfg), seed=0).to(device, torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    x, dy = (torch.randn(GPU_B, GPU_S, GPU_H, generator=g).to(device, torch.bfloat16) for _ in range(2))
    patch = (functorch_config.patch(guess_tangent_strides_as_outputs=False)
             if hasattr(functorch_config, "guess_tangent_strides_as_outputs") else functorch_config.patch({}))
    results = {}
    with patch:
        for name, forward in (("reference", reference_gqa), ("model", lambda m, x_: m(x_))):
            for _ in range(2):
                run(attn, forward, x, dy)
            sync = torch.cuda.synchronize if device == "cuda" else lambda: None
            sync()
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
            with profile(activities=activities, record_shapes=True) as prof:
                grads = run(attn, forward, x, dy)
                sync()
            events = []
            for event in prof.events():
                node = event.cpu_parent
                while node is not None and not node.name.endswith(("Backward0", "Backward")):
                    node = node.cpu_parent
                events.append((event.name, node.name if node is not None else None, event.input_shapes))
            results[name] = {"grads": grads, "events": events}
    return results


@pytest.fixture(scope="module")
def gpu_runs(request):
    from tests.model.conftest import tiny_config

    return _gpu_attention_runs(tiny_config)


def _layout_copies(events) -> list[tuple]:
    """`aten::copy_` of a [B, S, heads, D] / [B, heads, S, D] tensor under ViewBackward0 or the
    compiled function's backward: the heads' gradients copied between layouts."""
    return [(node, shapes) for name, node, shapes in events
            if name == "aten::copy_" and node in ("ViewBackward0", "CompiledFunctionBackward")
            and shapes and len(shapes[0]) == 4]


def _input_sums(events) -> list[tuple]:
    """`aten::add` / `aten::add_` of two [B, S, H] tensors in the backward: autograd summing the
    gradients of a tensor read twice (here x, read by wq, wk and wv)."""
    want = [GPU_B, GPU_S, GPU_H]
    return [(name, node, shapes) for name, node, shapes in events
            if name in ("aten::add", "aten::add_") and shapes[:2] == [want, want]]


@pytest.mark.gpu
def test_gpu_attention_backward_copies_no_heads_gradient(gpu_runs):
    """cuDNN's gradients reach the projections without a layout copy: none in ViewBackward0 (q's
    and k's gradients laid out heads-first, viewed back to the projections' outputs) and none in
    CompiledFunctionBackward (the compiled qk-norm + RoPE backward copying the token-major
    gradients cuDNN returns into the layout AOTAutograd guessed), where the reference has both."""
    ref, got = _layout_copies(gpu_runs["reference"]["events"]), _layout_copies(gpu_runs["model"]["events"])
    assert got == [], f"layout copies left in the model's backward (node, shapes): {got}"
    assert ref, ("the reference's backward shows no layout copy, so this profile check could not tell: "
                 f"torch {torch.__version__} may guess the tangents' layout as the outputs'")


@pytest.mark.gpu
def test_gpu_the_projections_input_gradient_is_summed_by_the_gemms(gpu_runs):
    """x's gradient from wq, wk and wv: two [B, S, H] adds by autograd in the reference, none in the
    model (`shared_input_linears`: added into by `addmm_`)."""
    ref, got = _input_sums(gpu_runs["reference"]["events"]), _input_sums(gpu_runs["model"]["events"])
    assert got == [], f"gradient sums left at x (op, node, shapes): {got}"
    assert len(ref) == 2, f"the reference's sums at x: {ref} (expected autograd's two)"
    addmm = [e for e in gpu_runs["model"]["events"] if e[0] == "aten::addmm_"]
    assert len(addmm) == 2, f"expected the GEMMs' two accumulations (aten::addmm_), got {addmm}"


# gradients that may differ in rounding on the GPU: x's (the GEMMs' sum) and the qk-norm gains' (sums
# over tokens and heads: the compiled backward reads their gradient token-major now, not heads-first,
# and may sum in another order)
GPU_REORDERED = {"x", "q_norm.weight", "k_norm.weight"}


@pytest.mark.gpu
def test_gpu_bf16_results_are_the_references(gpu_runs):
    """bf16 on the GPU: the forward's bits and the projections' weight gradients equal; x's gradient
    and the qk-norm gains' within bf16 rounding (summed otherwise)."""
    got, want = gpu_runs["model"]["grads"], gpu_runs["reference"]["grads"]
    differ = {name: (got[name].float() - want[name].float()).abs().max().item() for name in want
              if not torch.equal(got[name], want[name])}
    assert set(differ) <= GPU_REORDERED, f"differ from the reference (max abs difference): {differ}"
    for name in GPU_REORDERED:
        _close(got[name], want[name])


@pytest.mark.gpu
def test_gpu_router_input_gradient_is_written_in_bf16():
    """The router's d x: the GEMM's own bf16 output, no fp32 [N, H] product cast by a copy, within
    one bf16 rounding of that product."""
    from torch.profiler import profile

    from disagmoe.model.router import _fp32_product, _HalfRouterLogits

    N, E, H = 4096, 128, 1024
    g = torch.Generator().manual_seed(2)
    x = torch.randn(N, H, generator=g).to("cuda", torch.bfloat16).requires_grad_()
    w = (torch.randn(E, H, generator=g) / H**0.5).to("cuda", torch.bfloat16).requires_grad_()
    d = torch.randn(N, E, generator=g).to("cuda")
    _HalfRouterLogits.apply(x, w).backward(d)
    x.grad = None
    with profile(record_shapes=True) as prof:
        _HalfRouterLogits.apply(x, w).backward(d)
        torch.cuda.synchronize()
    casts = [e.input_shapes for e in prof.events() if e.name == "aten::copy_" and e.input_shapes[:1] == [[N, H]]]
    assert casts == [], f"an [N, H] copy in the router's backward: {casts}"
    want = _fp32_product(d.to(torch.bfloat16), w.detach()).to(torch.bfloat16)
    assert x.grad.dtype == torch.bfloat16
    _close(x.grad, want)
