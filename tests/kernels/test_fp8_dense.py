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


# --- the blockwise recipe: 1 x 128 activations, 128 x 128 weight blocks (torch._scaled_mm's block
# scaling on Hopper; the CPU runs it emulated). Shapes on the recipe's 512 grid, tokens ragged.
NB, IB, OB = 200, 1024, 512


def _block_inputs(seed: int, dtype=torch.bfloat16, loud: float = 1.0):
    """x, W, dy; with `loud`, every token's first 128 inputs and first 128 output gradients `loud` times
    the rest, and W's first 128 rows and columns zero, so the outputs and data gradients come from the
    quiet groups alone (a scale that spans a loud group pushes the quiet values into e4m3's subnormals)."""
    gen = torch.Generator().manual_seed(seed)
    x_NI = torch.randn(NB, IB, generator=gen)
    w_OI = torch.randn(OB, IB, generator=gen) / IB**0.5
    w_OI[:128, 128:256] *= 30.0  # one loud weight block (the blocks scale apart)
    dy_NO = torch.randn(NB, OB, generator=gen)
    if loud != 1.0:
        x_NI[:, :128] *= loud
        dy_NO[:, :128] *= loud
        w_OI[:128], w_OI[:, :128] = 0.0, 0.0
    return x_NI.to(dtype), w_OI.to(dtype), dy_NO.to(dtype)


def test_blockwise_operands_are_the_experts_quantisations_in_cublas_layouts():
    """The activation copy is `fp8.quantize_rows`' (1 x 128) with its scales token-major (strides
    (1, N): cuBLAS's 1 x 128 layout); W's copy is `fp8.quantize_blocks`' (128 x 128), and W^T's the
    same e4m3 values transposed with the block scales transposed."""
    from disagmoe.kernels import fp8

    x_NI, w_OI, _ = _block_inputs(0)
    q, s = fp8_dense.quantize_token_blocks(x_NI)
    want_q, want_s = fp8.quantize_rows_reference(x_NI)
    assert s.shape == (NB, IB // 128) and s.stride() == (1, NB)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    copies = fp8_dense.Fp8WeightCopies(w_OI, "blockwise")
    copies.refresh(w_OI)
    want_q, want_s = fp8.quantize_blocks_reference(w_OI[None])
    assert torch.equal(copies.rows[0].view(torch.uint8), want_q[0].view(torch.uint8))
    assert torch.equal(copies.rows[1], want_s[0]) and copies.rows[1].shape == (OB // 128, IB // 128)
    assert torch.equal(copies.cols[0].view(torch.uint8), want_q[0].t().contiguous().view(torch.uint8))
    assert torch.equal(copies.cols[1], want_s[0].t())
    q_t, s_t = fp8_dense.quantize_weight(w_OI.t(), None, "blockwise")  # per call: W^T read in place
    assert torch.equal(q_t.view(torch.uint8), copies.cols[0].view(torch.uint8)) and torch.equal(s_t, copies.cols[1])


def test_blockwise_gemms_track_fp64_where_rowwise_scales_do_not():
    """Against fp64, a loud 128-group in every token (1e5 times the rest) that the outputs do not
    read: the blockwise forward and data gradient stay within the FP8 bound; the rowwise recipe,
    whose one scale per token spans the loud group, loses the quiet values to underflow."""
    x_NI, w_OI, dy_NO = _block_inputs(1, loud=1e5)
    x64, w64, dy64 = x_NI.double(), w_OI.double(), dy_NO.double()
    errors = {}
    for scaling in fp8_dense.SCALINGS:
        errors[scaling] = (_rel(fp8_dense.fprop(x_NI, w_OI, emulate=True, scaling=scaling), x64 @ w64.T),
                           _rel(fp8_dense.dgrad(dy_NO, w_OI, emulate=True, scaling=scaling), dy64 @ w64))
    assert max(errors["blockwise"]) < REL_BOUND, errors
    assert min(errors["rowwise"]) > 3 * max(errors["blockwise"]), errors


def test_blockwise_copies_give_the_per_call_bits_count_w_once_and_refresh_in_place():
    x_NI, w_OI, dy_NO = _block_inputs(2)
    copies = fp8_dense.Fp8WeightCopies(w_OI, "blockwise")
    row, per_call = torch.zeros(FIELDS, dtype=torch.int64), torch.zeros(FIELDS, dtype=torch.int64)
    copies.refresh(w_OI, row)
    fp8_dense.quantize_weight(w_OI, per_call, "blockwise")
    assert torch.equal(row, per_call)  # one launch writes both copies: W counted once
    for fn, a in ((fp8_dense.fprop, x_NI), (fp8_dense.dgrad, dy_NO)):
        got = fn(a, w_OI, emulate=True, copies=copies, scaling="blockwise")
        assert torch.equal(got, fn(a, w_OI, emulate=True, scaling="blockwise")), fn.__name__
    buffers = [t.data_ptr() for t in (*copies.rows, *copies.cols)]
    w_OI.mul_(2.0)
    copies.refresh(w_OI)
    assert [t.data_ptr() for t in (*copies.rows, *copies.cols)] == buffers
    with pytest.raises(ValueError, match="made blockwise, the GEMM runs rowwise"):
        fp8_dense.fprop(x_NI, w_OI, emulate=True, copies=copies)


def test_blockwise_library_call_gets_token_counts_padded_to_four(monkeypatch):
    """cuBLAS refused a 1 x 128 scaled GEMM of 1001 tokens (its token-major scale columns not 16-byte
    aligned; an H100, session 33): `scaled_mm` hands the library a multiple of 4 rows (zero rows,
    unit scales) and returns the real ones, equal to the emulation of the unpadded operands."""
    calls = []

    def library(a, b, scale_a, scale_b, out_dtype):
        calls.append(a.shape[0])
        assert a.shape[0] % 4 == 0 and scale_a.shape == (a.shape[0], a.shape[1] // 128)
        assert scale_a.stride() == (1, a.shape[0])
        return fp8_dense.scaled_mm(a, scale_a, b, scale_b, out_dtype, emulate=True)

    monkeypatch.setattr(torch, "_scaled_mm", library)
    x_NI, w_OI, dy_NO = _block_inputs(5)
    for rows in (NB - 3, NB):  # 197 padded to 200, 200 as it is
        got = fp8_dense.fprop(x_NI[:rows], w_OI, scaling="blockwise")
        assert torch.equal(got, fp8_dense.fprop(x_NI[:rows], w_OI, emulate=True, scaling="blockwise"))
        got = fp8_dense.dgrad(dy_NO[:rows], w_OI, scaling="blockwise")
        assert torch.equal(got, fp8_dense.dgrad(dy_NO[:rows], w_OI, emulate=True, scaling="blockwise"))
    assert calls == [NB] * 4


def test_blockwise_gemms_take_zero_tokens():
    _, w_OI, _ = _block_inputs(4)
    empty = torch.zeros(0, IB, dtype=torch.bfloat16)
    assert fp8_dense.fprop(empty, w_OI, scaling="blockwise").shape == (0, OB)
    assert fp8_dense.dgrad(torch.zeros(0, OB, dtype=torch.bfloat16), w_OI, scaling="blockwise").shape == (0, IB)


def test_blockwise_refuses_torch_or_cuda_builds_without_block_scaling(monkeypatch):
    """On a Hopper GPU, a torch older than 2.9 or built against CUDA before 12.9 has no block-scaled
    torch._scaled_mm: refused with the fixes before the first GEMM (not torch's layout error)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    cuda = torch.device("cuda")
    for version, cuda_version in (("2.8.0+cu128", "12.8"), ("2.11.0+cu126", "12.6"), ("2.11.0", None)):
        monkeypatch.setattr(torch, "__version__", version)
        monkeypatch.setattr(torch.version, "cuda", cuda_version)
        with pytest.raises(ValueError, match="needs torch >= 2.9 built with CUDA >= 12.9.*fp8_dense_scaling: rowwise"):
            fp8_dense.check_blockwise_device(cuda)
    monkeypatch.setattr(torch, "__version__", "2.11.0+cu130")
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    fp8_dense.check_blockwise_device(cuda)
    assert fp8_dense.blockwise_unavailable(cuda) is None
    assert "Hopper GPUs (sm_90) only; this run is on cpu" in fp8_dense.blockwise_unavailable(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))  # Ada: FP8, no blocks
    assert "compute capability (8, 9)" in fp8_dense.blockwise_unavailable(cuda)


def test_blockwise_refuses_shapes_off_its_grid_and_devices_without_block_scaling():
    assert fp8_dense.fits_blockwise(2048, 512) and not fp8_dense.fits_blockwise(7168, 576)
    with pytest.raises(ValueError, match="multiples of 512.*fp8_dense_scaling: rowwise"):
        fp8_dense.check_shape(7168, 576, "blockwise")
    fp8_dense.check_shape(7168, 576, "rowwise")
    with pytest.raises(ValueError, match="Hopper GPUs.*fp8_dense_scaling: rowwise"):
        fp8_dense.check_blockwise_device(torch.device("cpu"))
    with pytest.raises(ValueError, match="unknown FP8 dense scaling 'tensorwise'"):
        fp8_dense.Fp8WeightCopies(torch.zeros(512, 512), "tensorwise")


def test_blockwise_quantisers_on_the_interpreter_are_the_cpu_references_bits(interpreted):
    """Under Triton's interpreter the blockwise operands come from the experts' Triton quantisers
    (the CUDA path): the same bits and counters as the torch references the CPU runs."""
    _, _, fp8_dense_i = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.fp8_dense")
    x_NI, w_OI, _ = _block_inputs(3)
    x_NI = x_NI[:40]
    row_i, row_ref = torch.zeros(FIELDS, dtype=torch.int64), torch.zeros(FIELDS, dtype=torch.int64)
    q_i, s_i = fp8_dense_i.quantize_token_blocks(x_NI, row_i)
    assert s_i.stride() == (1, 40)
    import os
    del os.environ["TRITON_INTERPRET"]  # the torch references, in the same test
    try:
        q_r, s_r = fp8_dense_i.quantize_token_blocks(x_NI, row_ref)
        (qw_r, sw_r) = fp8_dense_i.quantize_weight_blocks(w_OI)
    finally:
        os.environ["TRITON_INTERPRET"] = "1"
    assert torch.equal(q_i.view(torch.uint8), q_r.view(torch.uint8)) and torch.equal(s_i, s_r)
    assert torch.equal(row_i[[SATURATED, UNDERFLOW, TOTAL, NONFINITE]], row_ref[[SATURATED, UNDERFLOW, TOTAL, NONFINITE]])
    assert row_i[AMAX] == row_ref[AMAX]
    copies_q, copies_s = torch.empty_like(qw_r), torch.empty_like(sw_r)
    cols = (torch.empty(IB, OB, dtype=torch.float8_e4m3fn), torch.empty(IB // 128, OB // 128))
    fp8_dense_i.quantize_weight_blocks(w_OI, out=(copies_q, copies_s), transposed_out=cols)
    assert torch.equal(copies_q.view(torch.uint8), qw_r.view(torch.uint8)) and torch.equal(copies_s, sw_r)
    assert torch.equal(cols[0].view(torch.uint8), qw_r.t().contiguous().view(torch.uint8))
    assert torch.equal(cols[1], sw_r.t())


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs a Hopper GPU (torch._scaled_mm's 1 x 128 / 128 x 128 scaling)")
@pytest.mark.parametrize("shape", [(4096, 2048, 4096), (1001, 4096, 512), (8 * 31, 512, 1536), (2048, 1536, 2048)])
def test_cuda_blockwise_scaled_mm_equals_its_emulation_and_tracks_fp64(shape):
    """The library's block-scaled GEMMs (forward and data gradient) against the fp64 emulation of the
    same quantised operands (only fp32 sums and bf16 rounding apart) and against fp64 (the FP8 bound);
    d W the bf16 product. Token counts that are not multiples of 4 (1001, 248) give token-major scale
    columns that are not 16-byte aligned."""
    n, i, o = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, i, device="cuda", generator=gen).bfloat16().requires_grad_()
    w = (torch.randn(o, i, device="cuda", generator=gen) / i**0.5).bfloat16().requires_grad_()
    dy = torch.randn(n, o, device="cuda", generator=gen).bfloat16()
    y = fp8_dense.fp8_linear(x, w, scaling="blockwise")
    y.backward(dy)
    x64, w64, dy64 = x.detach().double(), w.detach().double(), dy.double()
    assert _rel(y, x64 @ w64.T) < REL_BOUND
    assert _rel(x.grad, dy64 @ w64) < REL_BOUND
    assert torch.equal(w.grad, dy.t().mm(x.detach()))
    assert _rel(y, fp8_dense.fprop(x.detach(), w.detach(), emulate=True, scaling="blockwise")) < LIB_BOUND
    assert _rel(x.grad, fp8_dense.dgrad(dy, w.detach(), emulate=True, scaling="blockwise")) < LIB_BOUND
