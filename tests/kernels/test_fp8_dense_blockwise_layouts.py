"""The blockwise recipe's scale tensors as torch._scaled_mm's CUDA dispatch checks them
(aten/src/ATen/native/cuda/ScaledBlas.cpp: is_blockwise_1x128_scaling, is_blockwise_128x128_scaling,
get_joint_scaling), for fprop and dgrad, with and without copies, on the torch references and on
the Triton quantisers (interpreted). The CPU cannot run the library call: `scaled_mm` is replaced by
a checker that asserts the layout and then runs the emulation."""

from __future__ import annotations

import pytest
import torch


def _cdiv(a, b):
    return -(-a // b)


def _size_stride(scale, dim, size, stride):
    # check_size_stride: the stride of a dimension of size <= 1 is not checked
    return scale.size(dim) == size and (size <= 1 or scale.stride(dim) == stride)


def _is_1x128(t, scale):
    return (scale.dtype == torch.float32 and scale.dim() == 2 and _size_stride(scale, 0, t.size(0), 1)
            and _size_stride(scale, 1, _cdiv(t.size(1), 128), t.size(0)))


def _is_128x128(t, scale):
    k_blocks = _cdiv(t.size(1), 128)
    return (scale.dtype == torch.float32 and scale.dim() == 2
            and _size_stride(scale, 0, _cdiv(t.size(0), 128), -(-k_blocks // 4) * 4)
            and _size_stride(scale, 1, k_blocks, 1))


def _checking(fp8_dense, calls):
    emulated = fp8_dense.scaled_mm

    def scaled_mm(a, sa, b, sb, out_dtype, emulate=False):
        assert a.dtype == b.dtype == torch.float8_e4m3fn
        assert a.stride(1) == 1 and b.stride(0) == 1, "torch._scaled_mm: row-major A, column-major B"
        assert _is_1x128(a, sa), (tuple(sa.shape), sa.stride())
        assert _is_128x128(b.t(), sb.t()), (tuple(sb.shape), sb.stride())
        # not claimed first by a simpler scaling (tensorwise, rowwise)
        assert sa.numel() != 1 and not (sa.shape[1] == 1 and sb.shape[0] == 1)
        calls.append((tuple(a.shape), tuple(b.shape)))
        return emulated(a, sa, b, sb, out_dtype, emulate=True)
    return scaled_mm


def _run_all(fp8_dense, monkeypatch, n=200, i=1024, o=1536):
    calls = []
    monkeypatch.setattr(fp8_dense, "scaled_mm", _checking(fp8_dense, calls))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, i, generator=gen).bfloat16()
    w = (torch.randn(o, i, generator=gen) / i**0.5).bfloat16()
    dy = torch.randn(n, o, generator=gen).bfloat16()
    copies = fp8_dense.Fp8WeightCopies(w, "blockwise")
    copies.refresh(w)
    results = []
    for c in (None, copies):
        fp8_dense.forget_shared_inputs()
        results.append((fp8_dense.fprop(x, w, copies=c, scaling="blockwise"),
                        fp8_dense.dgrad(dy, w, copies=c, scaling="blockwise")))
    # a non-contiguous input and dy (a transposed view) and one token
    fp8_dense.forget_shared_inputs()
    fp8_dense.fprop(x.t().contiguous().t(), w, copies=copies, scaling="blockwise")
    fp8_dense.dgrad(dy.t().contiguous().t(), w, scaling="blockwise")
    fp8_dense.fprop(x[:1], w, copies=copies, scaling="blockwise")
    fp8_dense.dgrad(dy[:1], w, copies=copies, scaling="blockwise")
    assert len(calls) == 8
    (y0, dx0), (y1, dx1) = results
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    # the emulation against the product each block scale belongs to, element by element
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    assert rel(y0, x64 @ w64.T) < 0.08 and rel(dx0, dy64 @ w64) < 0.08


def test_blockwise_scales_have_cublas_layouts_on_the_torch_references(monkeypatch):
    from disagmoe.kernels import fp8_dense
    _run_all(fp8_dense, monkeypatch)


@pytest.mark.slow
def test_blockwise_scales_have_cublas_layouts_from_the_triton_quantisers(interpreted, monkeypatch):
    _, _, fp8_dense_i = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.fp8_dense")
    _run_all(fp8_dense_i, monkeypatch, n=16, i=512, o=1024)
