"""The LM: outputs, initialisation, whole-model gradients (gradcheck, routing fixed), bias updates."""

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

from disagmoe.model.experts import RoutedExperts
from disagmoe.model.transformer import MoETransformer


def tokens(cfg, B=2, S=6, seed=0):
    return torch.randint(0, cfg.vocab_size, (B, S), generator=torch.Generator().manual_seed(seed))


def test_output_fields(make_mla_config):
    cfg = make_mla_config()
    model = MoETransformer(cfg)
    tok = tokens(cfg)
    out = model(tok)
    assert out.logits_BSV.shape == (2, 6, cfg.vocab_size)
    assert out.expert_load_LE.shape == (2, 8) and out.expert_load_LE.dtype == torch.int64
    assert torch.equal(out.expert_load_LE.sum(1), torch.full((2,), 12 * cfg.top_k))
    assert out.topk_idx_LNK.shape == (2, 12, cfg.top_k)
    assert out.aux_loss.dim() == 0 and out.z_loss.dim() == 0
    per_layer = []
    x = model.embed(tok)
    for block in model.layers:
        if hasattr(block, "moe"):
            x, r = block(x)
            per_layer.append(r.aux_loss)
        else:
            x = block(x)
    torch.testing.assert_close(out.aux_loss, sum(per_layer))


def test_init_is_deterministic_and_sets_norms_to_one(make_config):
    cfg = make_config()
    a, b = MoETransformer(cfg), MoETransformer(cfg)
    a.init_weights(seed=7)
    b.init_weights(seed=7)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values(), strict=True):
        assert torch.equal(pa, pb), name
    assert torch.equal(a.layers[0].attention_norm.weight, torch.ones(cfg.hidden_size))
    std = a.layers[0].attention.wq.weight.std().item()
    assert 0.015 < std < 0.025
    b.init_weights(seed=8)
    assert not torch.equal(a.embed.weight, b.embed.weight)


def test_embedding_init_std_sets_an_untied_embedding_a_tied_one_keeps_std(make_config):
    default = MoETransformer(make_config(vocab_size=512))
    untied = MoETransformer(make_config(vocab_size=512, embedding_init_std=1.0))
    tied = MoETransformer(make_config(vocab_size=512, tie_embeddings=True, embedding_init_std=1.0))
    assert 0.015 < default.embed.weight.std().item() < 0.025
    assert 0.95 < untied.embed.weight.std().item() < 1.05
    assert 0.015 < tied.embed.weight.std().item() < 0.025


def test_expert_init_does_not_depend_on_the_slice(make_config):
    cfg = make_config(num_experts=4)
    model = MoETransformer(cfg)
    model.init_weights(seed=9)
    part = RoutedExperts(2, cfg.hidden_size, cfg.expert_ffn_size, expert_ids=(2, 3))
    part.init_weights(seed=9, prefix="layers.1.moe.experts")
    assert torch.equal(part.w2_EFH, model.layers[1].moe.experts.w2_EFH[2:])


def test_tied_embeddings_share_the_embedding_matrix(make_config):
    cfg = make_config(tie_embeddings=True)
    model = MoETransformer(cfg)
    assert model.lm_head is None and "lm_head.weight" not in model.state_dict()
    tok = tokens(cfg)
    h = model.norm(model.layers[1](model.layers[0](model.embed(tok))[0])[0])
    torch.testing.assert_close(model(tok).logits_BSV, h @ model.embed.weight.T)


def test_backends_give_the_same_logits_and_grads(make_config):
    cfg = make_config(hidden_size=16, expert_ffn_size=8)  # 64/32-byte rows: grouped_mm runs for real
    loop, grouped = MoETransformer(cfg, "loop"), MoETransformer(cfg, "grouped_mm")
    loop.init_weights(seed=1)
    grouped.load_state_dict(loop.state_dict())
    tok = tokens(cfg)
    for model in (loop, grouped):
        out = model(tok)
        (F.cross_entropy(out.logits_BSV.flatten(0, 1), tok.flatten()) + out.aux_loss).backward()
    torch.testing.assert_close(grouped(tok).logits_BSV, loop(tok).logits_BSV)
    for (name, p), q in zip(loop.named_parameters(), grouped.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, msg=name)


@pytest.mark.parametrize("which", ["gqa", "mla"])
def test_whole_model_gradcheck_with_routing_fixed(which, make_config, make_mla_config):
    cfg = make_config(qk_norm=True, num_shared_experts=1) if which == "gqa" else make_mla_config()
    model = MoETransformer(cfg).double()
    model.init_weights(seed=2)
    model.double()
    with torch.no_grad():  # larger weights so that every term's gradient is well above rounding
        for p in model.parameters():
            p.mul_(10.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    tok = tokens(cfg, B=1, S=5)
    fixed = model(tok).topk_idx_LNK
    names, shapes = zip(*((n, p.shape) for n, p in model.named_parameters()), strict=True)
    flat_params = torch.cat([p.detach().flatten() for p in model.parameters()]).requires_grad_()

    def loss(flat):  # all parameters as one vector: fast-mode gradcheck probes one direction
        chunks = flat.split([s.numel() for s in shapes])
        params = {n: c.view(s) for n, c, s in zip(names, chunks, shapes, strict=True)}
        out = functional_call(model, params, (tok,), {"fixed_topk_idx_LNK": fixed})
        return F.cross_entropy(out.logits_BSV.flatten(0, 1), tok.flatten()) + out.aux_loss + out.z_loss

    assert torch.autograd.gradcheck(loss, (flat_params,), fast_mode=True, eps=1e-6, atol=1e-5, rtol=1e-4)


def test_fixed_routing_reproduces_the_free_forward(make_config):
    cfg = make_config()
    model = MoETransformer(cfg)
    tok = tokens(cfg)
    out = model(tok)
    again = model(tok, fixed_topk_idx_LNK=out.topk_idx_LNK)
    torch.testing.assert_close(again.logits_BSV, out.logits_BSV)
    with pytest.raises(ValueError, match="MoE layers"):
        model(tok, fixed_topk_idx_LNK=out.topk_idx_LNK[:1])


def test_update_router_bias_direction_and_noop(make_config):
    cfg = make_config(router=dict(bias_balancing=True, bias_update_rate=0.5))
    model = MoETransformer(cfg)
    load = torch.tensor([[8, 0, 4, 4], [1, 1, 1, 13]])
    model.update_router_bias(load)
    assert model.layers[0].moe.router.expert_bias.tolist() == [-0.5, 0.5, 0.0, 0.0]
    assert model.layers[1].moe.router.expert_bias.tolist() == [0.5, 0.5, 0.5, -0.5]

    plain = MoETransformer(make_config())
    before = {k: v.clone() for k, v in plain.state_dict().items()}
    plain.update_router_bias(load)
    assert all(torch.equal(v, before[k]) for k, v in plain.state_dict().items())
    with pytest.raises(ValueError, match="MoE layers x experts"):
        plain.update_router_bias(load[:1])


def test_bias_balancing_evens_out_a_skewed_router(make_config):
    """Repeated updates from the measured loads undo a bias that overloads expert 0."""
    cfg = make_config(num_experts=4, top_k=1, num_layers=1,
                      router=dict(score="sigmoid", bias_balancing=True, bias_update_rate=0.01))
    model = MoETransformer(cfg)
    router = model.layers[0].moe.router
    with torch.no_grad():
        router.weight.mul_(20.0)
        router.expert_bias[0] = 0.2
    tok = tokens(cfg, B=4, S=16)
    first = model(tok).expert_load_LE[0]
    for _ in range(30):
        model.update_router_bias(model(tok).expert_load_LE)
    last = model(tok).expert_load_LE[0]
    assert first.argmax() == 0 and first.max() > 2 * first.float().mean()
    assert last.max() - last.min() <= 4 < first.max() - first.min()


def test_all_dense_model_reports_empty_router_statistics(make_config):
    cfg = make_config(num_dense_layers=2, dense_ffn_size=12)
    out = MoETransformer(cfg)(tokens(cfg))
    assert out.expert_load_LE.shape == (0, cfg.num_experts) and out.topk_idx_LNK.shape == (0, 12, cfg.top_k)
    assert out.aux_loss.item() == 0.0


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["loop", "grouped_mm", "triton"])
def test_cuda_bf16_backends_train_like_the_cpu_fp32_reference(backend, make_mla_config):
    """Same weights, routing fixed to the reference's: logits and every parameter's gradient of a
    bf16 CUDA model within bf16 error (relative norm) of the fp32 CPU model."""
    cfg = make_mla_config(hidden_size=64, expert_ffn_size=32, vocab_size=128)
    cpu = MoETransformer(cfg)
    cpu.init_weights(seed=4)
    gpu = MoETransformer(cfg, backend).cuda().to(torch.bfloat16)
    gpu.load_state_dict(cpu.state_dict())
    tok = tokens(cfg, B=2, S=32)
    ref = cpu(tok)
    out = gpu(tok.cuda(), fixed_topk_idx_LNK=ref.topk_idx_LNK.cuda())
    for o, t in ((ref, tok), (out, tok.cuda())):
        F.cross_entropy(o.logits_BSV.float().flatten(0, 1), t.flatten()).backward()
    rel = lambda got, want: ((got.float().cpu() - want).norm() / want.norm()).item()  # noqa: E731
    assert rel(out.logits_BSV, ref.logits_BSV) < 2e-2
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters(), strict=True):
        assert rel(q.grad, p.grad) < 5e-2, name


# --- FP8 dense projections (set_dense_fp8; kernels.fp8_dense, recipe rowwise) --------------------


def _tiny_aligned():
    from disagmoe.model_ref import load_model

    return load_model("tiny")  # every projection a multiple of 16 wide: torch._scaled_mm's alignment


def test_dense_fp8_model_tracks_the_fp32_loss_counts_and_stores_no_fp8_copies():
    """Every projection (attention, shared experts, the dense layer) in FP8 on torch._scaled_mm
    (its CPU kernel), routing fixed to the fp32 model's: the loss within 2% of it, the gradients
    within 20%, every quantisation counted
    in the dense row, no saturation, the state dict exactly the bf16 model's keys and dtypes."""
    from disagmoe.kernels.fp8_stats import DENSE, NONFINITE, SATURATED, TOTAL, Fp8Stats
    from disagmoe.model.layers import DeferrableLinear

    cfg = _tiny_aligned()
    ref, fp8 = MoETransformer(cfg), MoETransformer(cfg)
    fp8.load_state_dict(ref.state_dict())
    keys = {k: (v.dtype, v.shape) for k, v in fp8.state_dict().items()}
    stats = Fp8Stats("cpu")
    fp8.set_dense_fp8(True, stats)
    assert all(m.fp8 for m in fp8.modules() if isinstance(m, DeferrableLinear))
    tok = tokens(cfg, B=2, S=16)
    losses, fixed = [], None
    for model in (ref, fp8):
        out = model(tok, fixed)  # the fp32 model's expert choices: no top-k flip between the two
        fixed = out.topk_idx_LNK
        loss = F.cross_entropy(out.logits_BSV.flatten(0, 1), tok.flatten())
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=0.02)
    row = stats.row(DENSE)
    assert row[TOTAL] > 0 and row[SATURATED] == 0 and row[NONFINITE] == 0
    assert all(stats.row(k)[TOTAL] == 0 for k in range(DENSE))
    assert {k: (v.dtype, v.shape) for k, v in fp8.state_dict().items()} == keys
    for (name, p), (_, q) in zip(ref.named_parameters(), fp8.named_parameters(), strict=True):
        if q.grad is None:
            continue
        rel = float((q.grad - p.grad).norm() / p.grad.norm().clamp_min(1e-12))
        assert rel < 0.2, name  # gradients through several FP8 GEMMs: looser than one GEMM's 7e-2


def test_dense_fp8_prepare_makes_every_projections_copies_with_the_per_call_bits():
    """`prepare_fp8` (the trainer's, once per optimizer step) reaches every FP8 `DeferrableLinear`:
    each then holds W's copies, the forward reads them and gives the per-call path's loss bit for
    bit, and the state dict still holds no FP8 tensor (checkpoints keep only the weights)."""
    from disagmoe.kernels.fp8_stats import Fp8Stats
    from disagmoe.model.layers import DeferrableLinear

    cfg = _tiny_aligned()
    model = MoETransformer(cfg)
    keys = {k: (v.dtype, v.shape) for k, v in model.state_dict().items()}
    model.set_dense_fp8(True, Fp8Stats("cpu"))
    tok = tokens(cfg, B=2, S=16)
    out = model(tok)
    per_call = F.cross_entropy(out.logits_BSV.flatten(0, 1), tok.flatten())
    model.prepare_fp8()
    linears = [m for m in model.modules() if isinstance(m, DeferrableLinear)]
    assert linears and all(m.fp8_copies is not None and m.fp8_copies.fits(m.weight) for m in linears)
    out = model(tok, out.topk_idx_LNK)
    assert torch.equal(F.cross_entropy(out.logits_BSV.flatten(0, 1), tok.flatten()), per_call)
    assert {k: (v.dtype, v.shape) for k, v in model.state_dict().items()} == keys


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.slow  # 2 x 60 training steps on the GPU
@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")
def test_dense_fp8_trains_like_bf16_on_the_gpu():
    """60 AdamW steps on one fixed batch, bf16 parameters, bf16 experts: the dense projections in
    FP8 (torch._scaled_mm, rowwise) against bf16 from the same initialisation: both losses fall by
    more than half and end within 5% of each other."""
    from disagmoe.kernels.fp8_stats import DENSE, SATURATED, TOTAL, Fp8Stats
    from disagmoe.model.layers import set_fusion

    set_fusion(False)
    cfg = _tiny_aligned()
    tok = tokens(cfg, B=8, S=33).cuda()  # 32 inputs per sequence: the FP8 wgrad contracts 8 x 32 tokens
    curves = []
    for dense_fp8 in (False, True):
        torch.manual_seed(0)
        model = MoETransformer(cfg, experts_backend="grouped_mm")
        model.init_weights(seed=0)
        model.to("cuda", torch.bfloat16)
        stats = Fp8Stats("cuda")
        if dense_fp8:
            model.set_dense_fp8(True, stats)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        curve = []
        for _ in range(60):
            out = model(tok[:, :-1])
            loss = F.cross_entropy(out.logits_BSV.float().flatten(0, 1), tok[:, 1:].flatten())
            opt.zero_grad()
            loss.backward()
            opt.step()
            curve.append(loss.item())
        curves.append(curve)
        if dense_fp8:
            assert stats.row(DENSE)[TOTAL] > 0 and stats.row(DENSE)[SATURATED] == 0
    (bf16, fp8) = curves
    assert bf16[-1] < 0.5 * bf16[0] and fp8[-1] < 0.5 * fp8[0]
    assert fp8[-1] == pytest.approx(bf16[-1], rel=0.05)


def _blockwise_sized():
    """tiny with every attention projection and the dense FFN on the blockwise recipe's 512 grid; the
    shared experts (512 -> 64) off it."""
    from disagmoe.model_ref import load_model

    return load_model("tiny").model_copy(update={"hidden_size": 512, "num_heads": 4, "num_kv_heads": 4,
                                                 "head_dim": 128, "dense_ffn_size": 1024, "num_layers": 2})


def test_dense_fp8_blockwise_keeps_off_grid_linears_in_bf16_and_tracks_the_fp32_loss():
    """`set_dense_fp8(scaling="blockwise")` (emulated GEMMs, the CPU): the attention projections and the
    dense FFN in FP8 with 1 x 128 / 128 x 128 scales, the shared experts (64 wide, off the 512 grid) kept
    in bf16 and named; the loss within 2% of the fp32 model's on its routing, every quantisation
    counted in the dense row; `prepare_fp8`'s blockwise copies give the per-call loss bit for bit."""
    from disagmoe.kernels.fp8_stats import DENSE, SATURATED, TOTAL, Fp8Stats
    from disagmoe.model.layers import DeferrableLinear

    cfg = _blockwise_sized()
    ref, fp8 = MoETransformer(cfg), MoETransformer(cfg)
    fp8.load_state_dict(ref.state_dict())
    stats = Fp8Stats("cpu")
    kept = fp8.set_dense_fp8(True, stats, emulate=True, scaling="blockwise")
    assert kept and all(".shared_experts." in name for name in kept)
    linears = dict(fp8.named_modules())
    assert all(not linears[name].fp8 for name in kept)
    on = [m for name, m in fp8.named_modules() if isinstance(m, DeferrableLinear) and name not in kept]
    assert on and all(m.fp8 and m.fp8_scaling == "blockwise" for m in on)
    tok = tokens(cfg, B=2, S=16)
    losses, fixed = [], None
    for model in (ref, fp8):
        out = model(tok, fixed)
        fixed = out.topk_idx_LNK
        losses.append(F.cross_entropy(out.logits_BSV.flatten(0, 1), tok.flatten()))
    assert losses[1].item() == pytest.approx(losses[0].item(), rel=0.02)
    assert stats.row(DENSE)[TOTAL] > 0 and stats.row(DENSE)[SATURATED] == 0
    fp8.prepare_fp8()
    assert all(m.fp8_copies.scaling == "blockwise" and m.fp8_copies.fits(m.weight) for m in on)
    out = fp8(tok, fixed)
    assert torch.equal(F.cross_entropy(out.logits_BSV.flatten(0, 1), tok.flatten()), losses[1])
    assert fp8.set_dense_fp8(True, stats, emulate=True, scaling="rowwise") == []
