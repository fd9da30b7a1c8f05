"""The rowwise e4m3 quantiser kernel (disagmoe/kernels/fp8_rowwise.py) under Triton's CPU
interpreter against the torch reference (`fp8_dense.quantize_rowwise_reference`): the same e4m3
bits and fp32 scales, and the same `Fp8Stats` counters, on ragged shapes, zero rows, inf and NaN
entries, and transposed (column-major) views read in place.

Shape legend: M rows, K the row length."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels import fp8_dense
from disagmoe.kernels.fp8_stats import FIELDS


@pytest.fixture
def rowwise(interpreted):
    _, module = interpreted("disagmoe.kernels.fp8", "disagmoe.kernels.fp8_rowwise")
    return module


def _awkward(m: int, k: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    """[m, k] normal values over several decades, a zero row, a -0.0, a NaN row, an inf row, a tiny
    value beside a normal amax (underflows), in `dtype` (plain values only where m < 5)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.logspace(-3, 3, m)[:, None]
    if m > 4:
        x[1] = 0.0
        x[2, 0] = -0.0
        x[3, k // 2] = float("nan")
        x[4, 0] = -float("inf")
        x[0, 1] = 1e-9
    return x.to(dtype)


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """e4m3 bits equal; a NaN's sign is not kept (torch's CPU inf / inf is a negative NaN), so NaNs
    compare as NaNs, and the kernel's are 0x7F."""
    assert got.shape == want.shape and got.dtype == want.dtype == torch.float8_e4m3fn
    nan = want.float().isnan()
    assert torch.equal(got.float().isnan(), nan)
    got_bits, want_bits = got.view(torch.uint8), want.view(torch.uint8)
    assert torch.equal(got_bits[~nan], want_bits[~nan])
    assert bool((got_bits[nan] == 0x7F).all())


def _start_row() -> torch.Tensor:
    """A stats row already holding counts (the kernel adds, and maxes the amax, into what is there)."""
    return torch.tensor([torch.tensor(3.0).view(torch.int32).item(), 1, 2, 3, 0], dtype=torch.int64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("m", "k", "transposed", "blocks"), [
    (19, 70, False, (8, 32)),    # ragged rows and columns, three chunks per row
    (19, 70, True, (8, 32)),     # x^T as a column-major view of a [70, 19] tensor
    (9, 30, False, (4, 32)),     # one read (K <= block_k)
    (6, 45, True, (2, 64)),      # transposed, one read
    (1, 5, False, None),         # the default tiles
])
@pytest.mark.parametrize("split_k", [False, True], ids=["one-launch", "split-k"])
def test_kernel_gives_the_references_bits_scales_and_counters(rowwise, dtype, m, k, transposed, blocks, split_k):
    """One launch per row block, or (split_k) two launches over (row block, K block) tiles merging
    each row's amax by atomics: the reference's bits, scales and counters either way."""
    x = _awkward(k, m, 0, dtype).t() if transposed else _awkward(m, k, 0, dtype)
    assert x.shape == (m, k) and x.is_contiguous() != transposed
    row, want_row = _start_row(), _start_row()
    block_m, block_k = blocks or (None, None)
    q, scale = rowwise.quantize_rowwise(x, row, block_m=block_m, block_k=block_k, split_k=split_k)
    want_q, want_scale = fp8_dense.quantize_rowwise_reference(x, want_row)
    _assert_same_bits(q, want_q)
    assert q.is_contiguous() and scale.shape == (m, 1) and torch.equal(scale, want_scale)
    assert torch.equal(row, want_row), (row.tolist(), want_row.tolist())
    q_plain, scale_plain = rowwise.quantize_rowwise(x, block_m=block_m, block_k=block_k,  # no counting
                                                    split_k=split_k)
    _assert_same_bits(q_plain, want_q)
    assert torch.equal(scale_plain, want_scale)


@pytest.mark.parametrize("split_k", [False, True], ids=["one-launch", "split-k"])
def test_rows_with_a_nan_or_an_inf_quantise_as_the_reference_and_are_counted(rowwise, split_k):
    x = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    x[0, 3] = float("nan")  # scale 1: the finite values keep their own magnitude, clamped at 448
    x[0, 5] = 1e4
    x[1, 7] = float("inf")  # scale inf: finite values to +-0, the inf itself to NaN
    row = torch.zeros(FIELDS, dtype=torch.int64)
    q, scale = rowwise.quantize_rowwise(x, row, split_k=split_k)
    assert scale[0].item() == 1.0 and scale[1].item() == float("inf")
    assert q[0, 5].float().item() == 448.0 and q[1, 7].float().isnan()
    want_row = torch.zeros(FIELDS, dtype=torch.int64)
    fp8_dense.quantize_rowwise_reference(x, want_row)
    assert torch.equal(row, want_row) and row[4].item() == 2


def test_out_buffers_are_written_in_place(rowwise):
    x = _awkward(12, 48, 2, torch.bfloat16)
    out = (torch.empty(12, 48, dtype=torch.float8_e4m3fn), torch.empty(12, 1))
    q, scale = rowwise.quantize_rowwise(x, out=out)
    assert q is out[0] and scale is out[1]
    want_q, want_scale = fp8_dense.quantize_rowwise_reference(x)
    _assert_same_bits(q, want_q)
    assert torch.equal(scale, want_scale)


def test_the_dispatch_runs_the_kernel_under_the_interpreter_and_the_reference_on_the_cpu(rowwise, monkeypatch):
    x = _awkward(10, 33, 3, torch.float32)
    calls = []
    original = rowwise.quantize_rowwise
    monkeypatch.setattr(rowwise, "quantize_rowwise", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    q, _ = fp8_dense.quantize_rowwise(x)
    assert calls == [1]
    monkeypatch.delenv("TRITON_INTERPRET")
    q_ref, _ = fp8_dense.quantize_rowwise(x)
    assert calls == [1]
    _assert_same_bits(q, q_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("split_k", [False, True], ids=["one-launch", "split-k"])
@pytest.mark.parametrize("transposed", [False, True], ids=["rows", "transposed"])
@pytest.mark.parametrize(("m", "k"), [(4096, 2048), (257, 6000), (64, 4096)])
def test_cuda_kernel_gives_the_references_bits_without_a_host_sync(m, k, transposed, split_k):
    """The compiled kernel at `gpu_tiles` (or split over K) against the torch reference on the same
    GPU (both divide correctly rounded), with counters, inside `no_host_syncs`."""
    from disagmoe.kernels import fp8_rowwise
    from disagmoe.runtime.observe.metrics import no_host_syncs

    x = _awkward(k, m, 4, torch.bfloat16).cuda().t() if transposed else _awkward(m, k, 4, torch.bfloat16).cuda()
    row, want_row = _start_row().cuda(), _start_row().cuda()
    with no_host_syncs(True, x.device):
        q, scale = fp8_rowwise.quantize_rowwise(x, row, split_k=split_k)
    want_q, want_scale = fp8_dense.quantize_rowwise_reference(x, want_row)
    _assert_same_bits(q.cpu(), want_q.cpu())
    assert torch.equal(scale, want_scale) and torch.equal(row, want_row)
