"""Expert-FFN backends against a per-row reference; slices; the grouped_mm path on CPU."""

import pytest
import torch
import torch.nn.functional as F

from disagmoe.model import experts as experts_mod
from disagmoe.model.experts import (
    RoutedExperts,
    expert_ffn_grouped_mm,
    expert_ffn_loop,
    get_expert_ffn,
    grouped_mm_supported,
)


def problem(counts, H=16, Fw=8, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    E = len(counts)
    x = torch.randn(sum(counts), H, generator=gen).to(dtype)
    w13 = (torch.randn(E, H, 2 * Fw, generator=gen) * 0.3).to(dtype)
    w2 = (torch.randn(E, Fw, H, generator=gen) * 0.3).to(dtype)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    return x, offsets, w13, w2


def per_row_reference(x, offsets, w13, w2):
    expert_of_row = torch.bucketize(torch.arange(x.shape[0]), offsets.long(), right=True)
    Fw = w2.shape[1]
    rows = []
    for i, e in enumerate(expert_of_row.tolist()):
        h = x[i] @ w13[e]
        rows.append((F.silu(h[:Fw]) * h[Fw:]) @ w2[e])
    return torch.stack(rows)


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 6, 0], [2, 2, 2, 2]])
def test_loop_matches_per_row_reference(counts):
    x, offsets, w13, w2 = problem(counts)
    torch.testing.assert_close(expert_ffn_loop(x, offsets, w13, w2), per_row_reference(x, offsets, w13, w2))


def test_loop_with_no_rows_returns_empty_and_zero_grads():
    x, offsets, w13, w2 = problem([0, 0])
    w13.requires_grad_()
    y = expert_ffn_loop(x, offsets, w13, w2)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert torch.equal(w13.grad, torch.zeros_like(w13))


@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 7, 0, 0]])
def test_grouped_mm_matches_loop_forward_and_backward(counts, monkeypatch):
    x, offsets, w13, w2 = problem(counts)
    assert grouped_mm_supported(x, w13, w2), "torch 2.13 runs _grouped_mm on CPU for aligned fp32"
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    ref_leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = expert_ffn_grouped_mm(leaves[0], offsets, leaves[1], leaves[2])
    y_ref = expert_ffn_loop(ref_leaves[0], offsets, ref_leaves[1], ref_leaves[2])
    assert len(calls) == 2
    torch.testing.assert_close(y, y_ref)
    y.sum().backward()
    y_ref.sum().backward()
    for got, want in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_grouped_mm_under_autocast_computes_in_the_autocast_dtype_with_fp32_weight_grads(monkeypatch):
    """fp32 master weights under autocast: the grouped GEMMs run in bf16 (autocast does not cast
    `_grouped_mm` itself) and the weights still get fp32 gradients, close to the fp32 result."""
    x, offsets, w13, w2 = problem([3, 0, 5, 8], H=32, Fw=16)
    dtypes = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda a, b, **k: dtypes.append((a.dtype, b.dtype)) or real(a, b, **k))
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = expert_ffn_grouped_mm(leaves[0], offsets, leaves[1], leaves[2])
    assert dtypes == [(torch.bfloat16, torch.bfloat16)] * 2 and y.dtype == torch.bfloat16
    y.float().sum().backward()
    ref_leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    expert_ffn_loop(ref_leaves[0], offsets, ref_leaves[1], ref_leaves[2]).sum().backward()
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert got.grad.dtype == torch.float32
        assert (got.grad - want.grad).abs().max() <= 3e-2 * want.grad.abs().max()


def test_grouped_mm_falls_back_to_loop_when_unsupported():
    x, offsets, w13, w2 = problem([2, 3], H=6, Fw=3, dtype=torch.float64)
    assert not grouped_mm_supported(x, w13, w2)
    torch.testing.assert_close(expert_ffn_grouped_mm(x, offsets, w13, w2), expert_ffn_loop(x, offsets, w13, w2))


def test_backend_lookup():
    assert get_expert_ffn("loop") is expert_ffn_loop
    with pytest.raises(ValueError, match="choose one of"):
        get_expert_ffn("cutlass")


def test_triton_backend_missing_kernel_is_a_clear_error(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_kernels(name, *args, **kwargs):
        if name.startswith("disagmoe.kernels"):
            raise ImportError("no module named disagmoe.kernels.moe_ffn")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_kernels)
    with pytest.raises(ValueError, match="'loop' or 'grouped_mm'"):
        experts_mod.get_expert_ffn("triton")


def test_slices_compute_and_initialise_like_the_full_module():
    full = RoutedExperts(6, 16, 8)
    full.init_weights(seed=3, prefix="layers.1.moe.experts")
    counts = [2, 0, 3, 1, 4, 2]
    x, offsets, _, _ = problem(counts)
    y_full = full(x, offsets)
    low, high = RoutedExperts.from_slice(full, 0, 2), RoutedExperts.from_slice(full, 2, 6)
    assert high.expert_ids == (2, 3, 4, 5)
    y_low = low(x[:2], offsets[:2])
    y_high = high(x[2:], offsets[2:] - 2)
    torch.testing.assert_close(torch.cat([y_low, y_high]), y_full)

    fresh = RoutedExperts(4, 16, 8, expert_ids=(2, 3, 4, 5))
    fresh.init_weights(seed=3, prefix="layers.1.moe.experts")
    assert torch.equal(fresh.w13_EH2F, high.w13_EH2F) and torch.equal(fresh.w2_EFH, high.w2_EFH)
    with pytest.raises(ValueError, match="outside"):
        RoutedExperts.from_slice(full, 4, 8)


def test_any_subset_of_experts_computes_and_initialises_like_the_full_module():
    full = RoutedExperts(6, 16, 8)
    full.init_weights(seed=3, prefix="layers.1.moe.experts")
    counts = [2, 0, 3, 1, 4, 2]
    x, offsets, _, _ = problem(counts)
    y_full = full(x, offsets)
    ids = (4, 0, 3)  # any order in; held ascending
    part = RoutedExperts.from_indices(full, ids)
    assert part.expert_ids == (0, 3, 4)
    starts = [0, *offsets.tolist()]
    rows = [torch.arange(starts[e], starts[e + 1]) for e in part.expert_ids]
    local_offsets = torch.cumsum(torch.tensor([counts[e] for e in part.expert_ids]), 0).to(torch.int32)
    assert torch.equal(part(x[torch.cat(rows)], local_offsets), y_full[torch.cat(rows)])

    fresh = RoutedExperts(3, 16, 8, expert_ids=(0, 3, 4))
    fresh.init_weights(seed=3, prefix="layers.1.moe.experts")
    assert torch.equal(fresh.w13_EH2F, part.w13_EH2F) and torch.equal(fresh.w2_EFH, part.w2_EFH)
    with pytest.raises(ValueError, match="not among"):
        RoutedExperts.from_indices(part, (1,))
    with pytest.raises(ValueError, match="ascending"):
        RoutedExperts(2, 16, 8, expert_ids=(3, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["grouped_mm", "triton"])
def test_backends_match_an_fp32_reference_on_cuda(backend):
    """bf16, uneven groups with an empty expert: forward and all three gradients."""
    counts = [300, 0, 129, 64, 1, 500, 7, 23]
    x, offsets, w13, w2 = (t.cuda() for t in problem(counts, H=256, Fw=128, dtype=torch.bfloat16))
    g = torch.randn(x.shape[0], 256, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    ffn = get_expert_ffn(backend)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    ref_leaves = [t.float().requires_grad_() for t in (x, w13, w2)]
    y = ffn(leaves[0], offsets, leaves[1], leaves[2])
    y_ref = expert_ffn_loop(ref_leaves[0], offsets, ref_leaves[1], ref_leaves[2])
    (y.float() * g).sum().backward()
    (y_ref * g).sum().backward()
    for got, want in [(y, y_ref), *((a.grad, b.grad) for a, b in zip(leaves, ref_leaves, strict=True))]:
        scale = want.abs().max().item()
        assert (got.float() - want).abs().max().item() <= 2e-2 * scale


def test_the_triton_backend_on_a_cpu_is_refused_before_a_run_with_the_fix(tmp_path, monkeypatch):
    """Without Triton's interpreter a CPU run of the triton experts would fail at its first
    launch ("0 active drivers"); the run is refused first, in one line, single and distributed."""
    from typer.testing import CliRunner

    from disagmoe.cli.app import app
    from disagmoe.model.experts import check_backend_device

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="experts_backend: triton runs its kernels on CUDA GPUs; on device: cpu use"):
        check_backend_device("triton", "cpu")
    check_backend_device("triton", "cuda")
    check_backend_device("loop", "cpu")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    check_backend_device("triton", "cpu")  # the kernel tests' interpreter
    monkeypatch.delenv("TRITON_INTERPRET")
    for mode in ("single", "disaggregated"):
        r = CliRunner().invoke(app, ["train", "-c", "configs/tiny-cpu.yaml", "--mode", mode, "--steps", "1",
                                     "--out-dir", str(tmp_path / mode), "experts_backend=triton"])
        assert r.exit_code != 0 and "experts_backend: triton runs its kernels on CUDA GPUs" in r.output, r.output
        assert "Traceback" not in r.output
