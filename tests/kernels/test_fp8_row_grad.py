"""The FP8 experts' dy quantised by the combine's backward (disagmoe/kernels/permute.py's
`combine_backward_quantized` and `Fp8RowGradSlot`, read by disagmoe/kernels/fp8_ffn.py): the row
gradient's e4m3 rows and scales are `fp8.quantize_rows`' bytes of it, bit for bit (interpreter fp32,
random shapes, a partial last group, a spare bucket's limit); through permute -> FP8 FFN -> combine
every gradient is the run that quantises dy in the FFN's, bit for bit, under both FP8 backwards, with
no row quantiser reading dy back; on a GPU (bf16) the same."""

from __future__ import annotations

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig

SMALL = dict(rows=TileConfig(block_m=16, block_n=32, block_k=128, group_m=2, num_warps=4, num_stages=1),
             swiglu=TileConfig(block_m=16, block_n=128, block_k=128, group_m=2, num_warps=4, num_stages=1),
             wgrad=TileConfig(block_m=128, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1))
# (tokens, top_k, rows' groups, hidden, limit): hidden 200 leaves a partial last group, a limit a spare bucket
COMBINE_CASES = [(37, 2, 4, 256, None), (21, 3, 5, 200, 40), (9, 1, 2, 128, None)]


@pytest.fixture
def permute(interpreted):
    _, permute = interpreted("disagmoe.kernels.fp8", "disagmoe.kernels.permute")
    return permute


def _combine_inputs(tokens, top_k, hidden, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    dest_TK = torch.randperm(tokens * top_k, generator=gen).view(tokens, top_k).to(torch.int32)
    # rows spread over 2^N(0, 2) and one zero token: groups far apart in scale and an all-zero one
    dy_TH = torch.randn(tokens, hidden, generator=gen) * torch.exp2(2 * torch.randn(tokens, 1, generator=gen))
    dy_TH[tokens // 2] = 0.0
    rows_NH = torch.randn(tokens * top_k, hidden, generator=gen)
    w_TK = torch.rand(tokens, top_k, generator=gen)
    return (dy_TH.to(device, dtype), rows_NH.to(device, dtype), dest_TK.to(device), w_TK.to(device))


@pytest.mark.parametrize("case", COMBINE_CASES, ids=["even", "partial-group-limit", "top-1"])
def test_the_combines_backward_quantises_its_row_gradient_as_the_quantiser_reads_it(permute, case):
    from disagmoe.kernels import fp8

    tokens, top_k, _, hidden, limit_at = case
    dy_TH, rows_NH, dest_TK, w_TK = _combine_inputs(tokens, top_k, hidden, seed=tokens)
    limit = None if limit_at is None else torch.tensor([limit_at], dtype=torch.int32)
    d_rows, d_w = permute.combine_backward(dy_TH, rows_NH, dest_TK, w_TK, limit)
    got_rows, got_w, (q_NH, s_NG) = permute.combine_backward_quantized(dy_TH, rows_NH, dest_TK, w_TK, limit)
    assert torch.equal(got_rows, d_rows) and torch.equal(got_w, d_w)
    want_q, want_s = fp8.quantize_rows(d_rows)
    assert q_NH.dtype == fp8.FP8 and s_NG.shape == (tokens * top_k, -(-hidden // fp8.SCALE_BLOCK))
    assert torch.equal(q_NH.view(torch.uint8), want_q.view(torch.uint8))
    assert torch.equal(s_NG, want_s)
    assert (q_NH.float() != 0).any() and (s_NG > 1e-20).any()  # something was quantised


def test_the_slot_hands_over_the_copy_of_that_gradient_alone_once():
    from disagmoe.kernels.permute import Fp8RowGradSlot

    d_rows = torch.randn(6, 256)
    copy = (torch.zeros(6, 256, dtype=torch.float8_e4m3fn), torch.ones(6, 2))
    slot = Fp8RowGradSlot()
    assert slot.take(d_rows) is None  # nothing put
    slot.put(d_rows, copy)
    assert slot.take(d_rows.clone()) is None  # another tensor: the experts quantise it themselves
    assert slot.take(d_rows) is None  # emptied by the take before
    slot.put(d_rows, copy)
    assert slot.take(d_rows[:, :128]) is None  # the same memory, another view
    slot.put(d_rows, copy)
    assert slot.take(d_rows) is copy
    assert slot.take(d_rows) is None


def _layer(permute, ffn8, backward, use_slot, device="cpu", dtype=torch.float32, spare_last=True):
    """(dx, dw, dw13, dw2, row quantisations of dy's width) of permute -> FP8 FFN (the run's forward: the
    down GEMM in FP8, x's rows not quantised) -> combine, dy's rows quantised by the combine's backward
    (`use_slot`) or by the FFN's."""
    from disagmoe.kernels import fp8

    tokens, top_k, experts, hidden, ffn = 12, 3, 4, 384, 128  # hidden apart from F and 2F
    gen = torch.Generator().manual_seed(5)
    pool = [e for e in range(experts + spare_last) if e != 1]  # expert 1 empty
    topk_TK = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=gen)[:top_k]]
                           for _ in range(tokens)]).to(torch.int32).to(device)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    leaves = [cast(t).requires_grad_() for t in (
        torch.randn(tokens, hidden, generator=gen), torch.rand(tokens, top_k, generator=gen),
        torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5,
        torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5)]
    x_TH, w_TK, w13, w2 = leaves
    dy_TH = cast(torch.randn(tokens, hidden, generator=gen) * torch.exp2(torch.randn(tokens, 1, generator=gen)))
    widths = []
    quantize_rows = fp8.quantize_rows

    def counted(x, *args, **kwargs):
        widths.append(x.shape[1])
        return quantize_rows(x, *args, **kwargs)

    fp8.quantize_rows = counted
    try:
        rows_NH, offsets_E1, dest_TK = permute.permute_tokens(x_TH, topk_TK, experts + spare_last, spare_last)
        slot = permute.Fp8RowGradSlot() if use_slot else None
        cpu = device == "cpu"
        y_NH = ffn8.expert_ffn_fp8(rows_NH, offsets_E1[:experts], w13, w2, backward=backward, forward="down",
                                   tiles=ffn8.Fp8Tiles(**SMALL) if cpu else None, num_programs=3 if cpu else None,
                                   grad_slot=slot)
        limit = offsets_E1[experts - 1:experts] if spare_last else None
        permute.combine_rows(y_NH, dest_TK, w_TK, limit, grad_slot=slot).backward(dy_TH)
    finally:
        fp8.quantize_rows = quantize_rows
    return [leaf.grad for leaf in leaves], widths.count(hidden)


@pytest.mark.slow  # 6-20 s in the interpreter; the quick subset keeps the combine's bytes test
@pytest.mark.parametrize("backward", ["bf16-wgrad", "fp8"])
def test_fp8_experts_take_dy_from_the_combine_with_the_same_gradients(interpreted, backward):
    _, _, permute, ffn8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                      "disagmoe.kernels.permute", "disagmoe.kernels.fp8_ffn")
    (want, dy_passes), (got, fused_passes) = (_layer(permute, ffn8, backward, use) for use in (False, True))
    for name, a, b in zip(("dx", "dw", "dw13", "dw2"), got, want, strict=True):
        assert torch.equal(a, b), name
    assert (dy_passes, fused_passes) == (1, 0)  # the FFN's quantiser no longer reads dy back


@pytest.mark.slow  # the FP8 FFN in the interpreter
@pytest.mark.parametrize("backward", ["bf16-wgrad", "fp8"])
def test_dys_copy_from_the_combine_is_dropped_after_its_last_reader(interpreted, monkeypatch, backward):
    """The copy the slot hands over is freed once the d h13 GEMM has read it, as a copy the FFN quantises
    itself is (`roofline.memory.fp8_expert_row_grad_bytes` counts it so): gone by the dx GEMM, which reads
    d h13's rows [N, 2F]."""
    import weakref

    _, _, permute, ffn8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                      "disagmoe.kernels.permute", "disagmoe.kernels.fp8_ffn")
    copies, alive_at_dx = [], []
    put, rows_gemm = permute.Fp8RowGradSlot.put, ffn8._rows_gemm

    def kept(self, d_rows, copy):
        copies.append(weakref.ref(copy[0]))
        put(self, d_rows, copy)

    def dx_gemm(a_MK, *args, **kwargs):
        if a_MK.shape[1] == 2 * 128:  # d h13's rows (F 128): the dx GEMM
            alive_at_dx.append(copies[-1]() is not None)
        return rows_gemm(a_MK, *args, **kwargs)

    monkeypatch.setattr(permute.Fp8RowGradSlot, "put", kept)
    monkeypatch.setattr(ffn8, "_rows_gemm", dx_gemm)
    _layer(permute, ffn8, backward, use_slot=True)
    assert len(copies) == 1 and alive_at_dx == [False]


@pytest.mark.gpu
@pytest.mark.parametrize("backward", ["bf16-wgrad", "fp8"])
def test_gpu_fp8_experts_take_dy_from_the_combine_with_the_same_gradients(backward):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a GPU with FP8 tensor cores")
    from disagmoe.kernels import fp8_ffn, permute

    (want, dy_passes), (got, fused_passes) = (_layer(permute, fp8_ffn, backward, use, device="cuda",
                                                     dtype=torch.bfloat16) for use in (False, True))
    for name, a, b in zip(("dx", "dw", "dw13", "dw2"), got, want, strict=True):
        assert torch.equal(a, b), name
    assert (dy_passes, fused_passes) == (1, 0)


def test_a_slot_is_refused_beside_counters_and_a_bf16_backward(interpreted):
    from disagmoe.kernels.fp8_stats import Fp8Stats

    _, _, permute, ffn8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                      "disagmoe.kernels.permute", "disagmoe.kernels.fp8_ffn")
    x, w13, w2 = torch.randn(4, 128), torch.randn(2, 128, 256), torch.randn(2, 128, 128)
    offsets = torch.tensor([2, 4], dtype=torch.int32)
    for kwargs in (dict(stats=Fp8Stats(torch.device("cpu"))), dict(backward="bf16")):
        with pytest.raises(ValueError, match="grad_slot"):
            ffn8.expert_ffn_fp8(x, offsets, w13, w2, grad_slot=permute.Fp8RowGradSlot(), **kwargs)
