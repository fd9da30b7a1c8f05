"""The FP8 dense linear (disagmoe/kernels/fp8_dense.py, recipe rowwise): the quantiser, the three
GEMMs and the autograd Function against fp64, on the emulated GEMM (dequantise then matmul) and on
torch's own `torch._scaled_mm` (CPU here, CUDA in the gpu tests).

Shape legend: N tokens, I input features, O output features."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels import fp8_dense
from disagmoe.kernels.fp8_stats import AMAX, FIELDS, NONFINITE, SATURATED, TOTAL, UNDERFLOW, stats_reference

# Relative (Frobenius) error of an e4m3 rowwise GEMM against fp64: e4m3 keeps 3 mantissa bits (a
# relative step of 2^-4 = 6.25%, half of it per rounding), and the errors of a long contraction
# average out; 7e-2 bounds a single element's rounding, so one wrong scale breaks it.
REL_BOUND = 7e-2
# torch._scaled_mm against the emulation on the same quantised operands: only bf16 output rounding.
LIB_BOUND = 1e-2

N, I, O = 96, 128, 80


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).norm() / want.norm())


def _inputs(seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x_NI = torch.randn(N, I, generator=gen).to(dtype)
    w_OI = (torch.randn(O, I, generator=gen) / I**0.5).to(dtype)
    dy_NO = torch.randn(N, O, generator=gen).to(dtype)
    return x_NI, w_OI, dy_NO


def test_rowwise_quantiser_scales_each_row_to_448_and_keeps_zero_rows():
    x_NI, _, _ = _inputs(0)
    x_NI[3] = 0.0
    x_NI[5, 7] = 1e4  # an outlier costs precision to its own row only
    q, scale = fp8_dense.quantize_rowwise(x_NI)
    assert q.dtype == torch.float8_e4m3fn and q.is_contiguous() and scale.shape == (N, 1)
    assert torch.equal(q[3].float(), torch.zeros(I)) and scale[3].item() == 1.0
    live = [r for r in range(N) if r != 3]
    assert torch.equal(q[live].float().abs().amax(dim=1), torch.full((N - 1,), 448.0))
    deq = q.float() * scale
    others = [r for r in live if r != 5]
    # per element: half an e4m3 step (2^-4) of the value, or of the row's smallest normal step
    err = (deq[others] - x_NI[others]).abs()
    assert bool((err <= x_NI[others].abs() * 2**-4 + scale[others] * 2**-9).all())


def test_quantiser_on_a_transposed_view_gives_row_major_rows():
    _, w_OI, _ = _inputs(1)
    q_IO, s_I1 = fp8_dense.quantize_rowwise(w_OI.t())
    assert q_IO.shape == (I, O) and q_IO.is_contiguous() and s_I1.shape == (I, 1)
    assert q_IO.t().stride() == (1, O)  # column-major: torch._scaled_mm's B operand


def test_quantiser_counts_into_a_stats_row_as_the_reference():
    x_NI, _, _ = _inputs(2)
    x_NI[0, 0] = float("inf")
    x_NI[1, :4] = 1e-9  # beside a normal amax these underflow
    row = torch.zeros(FIELDS, dtype=torch.int64)
    q, scale = fp8_dense.quantize_rowwise(x_NI, row)
    amax, saturated, underflow, total, nonfinite = stats_reference(x_NI, scale, q)
    assert row[AMAX:AMAX + 1].to(torch.int32).view(torch.float32).item() == pytest.approx(amax, rel=1e-6)
    assert (row[SATURATED].item(), row[UNDERFLOW].item(), row[TOTAL].item(), row[NONFINITE].item()) == (
        saturated, underflow, total, nonfinite)
    assert row[NONFINITE].item() == 1 and row[UNDERFLOW].item() >= 4


@pytest.mark.parametrize("emulate", [True, False], ids=["emulated", "torch_scaled_mm_cpu"])
def test_the_two_fp8_gemms_track_fp64(emulate):
    x_NI, w_OI, dy_NO = _inputs(3, torch.bfloat16)
    x64, w64, dy64 = x_NI.double(), w_OI.double(), dy_NO.double()
    assert _rel(fp8_dense.fprop(x_NI, w_OI, emulate=emulate), x64 @ w64.T) < REL_BOUND
    assert _rel(fp8_dense.dgrad(dy_NO, w_OI, emulate=emulate), dy64 @ w64) < REL_BOUND


def test_the_library_kernel_matches_the_emulation_on_the_same_operands():
    x_NI, w_OI, dy_NO = _inputs(4, torch.bfloat16)
    for fn, args in ((fp8_dense.fprop, (x_NI, w_OI)), (fp8_dense.dgrad, (dy_NO, w_OI))):
        assert _rel(fn(*args), fn(*args, emulate=True)) < LIB_BOUND, fn.__name__


def test_autograd_function_gives_fp8_grads_of_fp64_quality_and_the_weight_gradient_in_bf16():
    """y and dx within the FP8 bound; d W is the bf16 product autograd's linear computes (the recipe
    keeps the weight gradient out of FP8: kernels/fp8_dense.py)."""
    x_NI, w_OI, dy_NO = _inputs(6)
    x = x_NI.view(4, N // 4, I).clone().requires_grad_()
    w = w_OI.clone().requires_grad_()
    y = fp8_dense.fp8_linear(x, w, emulate=True)
    assert y.shape == (4, N // 4, O)
    y.backward(dy_NO.view(4, N // 4, O))
    x64, w64, dy64 = x_NI.double(), w_OI.double(), dy_NO.double()
    assert _rel(y.reshape(N, O), x64 @ w64.T) < REL_BOUND
    assert _rel(x.grad.reshape(N, I), dy64 @ w64) < REL_BOUND
    assert torch.equal(w.grad, dy_NO.t().mm(x_NI))


def test_library_path_refuses_unaligned_shapes_with_the_fix():
    with pytest.raises(ValueError, match="multiples of 16.*fp8_dense: false"):
        fp8_dense.check_shape(128, 72)
    x_NI, w_OI, dy_NO = _inputs(7, torch.bfloat16)  # the tokens (the GEMMs' M) need no alignment
    assert fp8_dense.fprop(x_NI[:90], w_OI).shape == (90, O)
    assert fp8_dense.dgrad(dy_NO[:90], w_OI).shape == (90, I)


def _cuda_fp8() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.mark.gpu
@pytest.mark.skipif(not _cuda_fp8(), reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")
@pytest.mark.parametrize("shape", [(4096, 2048, 4096), (1024, 4096, 512), (512, 128, 1536), (8 * 31, 256, 512)])
def test_cuda_scaled_mm_tracks_fp64(shape):
    """The two FP8 GEMMs within the bound of fp64, d W the bf16 product (tokens need no alignment:
    8 x 31 failed mid-step when the weight gradient contracted them on torch._scaled_mm)."""
    n, i, o = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, i, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(o, i, device="cuda", generator=gen) / i**0.5).bfloat16().requires_grad_()
    dy = torch.randn(n, o, device="cuda", generator=gen).bfloat16()
    y = fp8_dense.fp8_linear(x, w)
    y.backward(dy)
    assert y.dtype == torch.bfloat16
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    assert _rel(y, x64 @ w64.T) < REL_BOUND
    assert _rel(x.grad, dy64 @ w64) < REL_BOUND
    assert torch.equal(w.grad, dy.t().mm(x.detach()))
    # and the library kernel agrees with the emulation of the same quantisation
    assert _rel(y, fp8_dense.fp8_linear(x.detach(), w.detach(), emulate=True)) < LIB_BOUND


def test_weight_copies_hold_the_per_call_quantisations_and_refresh_in_place():
    """`Fp8WeightCopies`: after `refresh`, `rows` and `cols` are W's and W^T's per-call quantisations
    bit for bit, the GEMMs give the same bits with or without them, a second refresh writes into
    the same buffers, and `fits` turns false when W is written in place."""
    x_NI, w_OI, dy_NO = _inputs(8, torch.bfloat16)
    copies = fp8_dense.Fp8WeightCopies(w_OI)
    assert not copies.fits(w_OI)
    row, per_call_row = torch.zeros(FIELDS, dtype=torch.int64), torch.zeros(FIELDS, dtype=torch.int64)
    copies.refresh(w_OI, row)
    assert copies.fits(w_OI)
    for (q, s), (want_q, want_s) in ((copies.rows, fp8_dense.quantize_rowwise(w_OI, per_call_row)),
                                     (copies.cols, fp8_dense.quantize_rowwise(w_OI.t(), per_call_row))):
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    assert torch.equal(row, per_call_row)  # W and W^T counted once each
    for fn, a in ((fp8_dense.fprop, x_NI), (fp8_dense.dgrad, dy_NO)):
        assert torch.equal(fn(a, w_OI, emulate=True, copies=copies), fn(a, w_OI, emulate=True)), fn.__name__
    buffers = [t.data_ptr() for t in (*copies.rows, *copies.cols)]
    w_OI.mul_(2.0)
    assert not copies.fits(w_OI)
    copies.refresh(w_OI)
    assert copies.fits(w_OI) and [t.data_ptr() for t in (*copies.rows, *copies.cols)] == buffers
    assert torch.equal(copies.rows[1], fp8_dense.quantize_rowwise(w_OI)[1])


def test_linears_reading_one_input_quantise_it_once(monkeypatch):
    """q, k and v as three FP8 DeferrableLinears on one x (the library GEMM, CPU): x is quantised
    once in the forward (and never in the backward: the weight gradients run in bf16), counted once;
    outputs and gradients equal those of quantising per linear; writing x in place (its version)
    or a different stats row makes a fresh quantisation."""
    from disagmoe.model.layers import DeferrableLinear

    torch.manual_seed(0)
    linears = [DeferrableLinear(I, o) for o in (O, 32, 32)]
    for lin in linears:
        lin.set_fp8(True)
    x_NI, _, _ = _inputs(8)
    real = fp8_dense.quantize_rowwise
    reads: list[int] = []

    def counted(x, stats_row=None, out=None):
        reads.append(x.data_ptr())
        return real(x, stats_row, out)

    def run(share: bool):
        fp8_dense.forget_shared_inputs()
        x = x_NI.clone().requires_grad_()
        reads.clear()
        outs = []
        for lin in linears:
            if not share:
                fp8_dense.forget_shared_inputs()
            outs.append(lin(x))
        forward_reads = reads.count(x.data_ptr())
        torch.autograd.backward(outs, [torch.ones_like(y) for y in outs])
        return forward_reads, reads.count(x.data_ptr()) - forward_reads, outs, x.grad, [lin.weight.grad for lin in linears]

    monkeypatch.setattr(fp8_dense, "quantize_rowwise", counted)
    shared = run(share=True)
    for lin in linears:
        lin.weight.grad = None
    apart = run(share=False)
    assert shared[:2] == (1, 0) and apart[:2] == (3, 0)
    for a, b in zip(shared[2:], apart[2:], strict=True):
        for t, u in (zip(a, b, strict=True) if isinstance(a, list) else [(a, b)]):
            assert torch.equal(t, u)
    fp8_dense.forget_shared_inputs()
    x = x_NI.clone()
    first = fp8_dense.quantize_input(x, None)
    assert fp8_dense.quantize_input(x, None) is first
    x.mul_(2.0)  # written in place: its version moves on
    assert fp8_dense.quantize_input(x, None) is not first
    row = torch.zeros(FIELDS, dtype=torch.int64)
    assert fp8_dense.quantize_input(x, row) is not fp8_dense.quantize_input(x, None)
    fp8_dense.forget_shared_inputs()
