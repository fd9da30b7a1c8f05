"""`TileConfig.split_epilogue`: the down data gradient as a plain launch and `swiglu_grad_rows`, against
the fused SwiGLU-gradient epilogue, in fp32 in the interpreter: with and without the recomputed SwiGLU
output, with gathered and weighted rows and their row dots (the fused combine's), empty experts, and
rows past the last offset left alone; the tuner offers it for the down data gradient only."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import triton

from disagmoe.kernels.tile_configs import TileConfig
from tests.kernels.test_moe_ffn import _rel_err

SMALL = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
SPLIT = dataclasses.replace(SMALL, split_epilogue=True)
CASES = [([5, 0, 37, 1], 40, 24), ([0, 0, 50, 0], 32, 16), ([17, 16, 0, 33, 2], 24, 40)]


@pytest.fixture
def gg(interpreted):
    return interpreted("disagmoe.kernels.grouped_gemm")


def _operands(counts, hidden, ffn, seed, spare=3):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts) + spare  # rows past the last offset: pairs served elsewhere
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    dy = torch.randn(rows, hidden, generator=gen)
    w2_t = (torch.randn(len(counts), ffn, hidden, generator=gen) / hidden**0.5).transpose(1, 2)
    h13 = torch.randn(rows, 2 * ffn, generator=gen)
    return offsets, dy, w2_t, h13


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("save_act", [False, True], ids=["kept-act", "recomputed-act"])
def test_the_split_epilogue_is_the_fused_one(gg, case, save_act):
    counts, hidden, ffn = CASES[case]
    offsets, dy, w2_t, h13 = _operands(counts, hidden, ffn, seed=case)
    served = int(offsets[-1])
    runs = {}
    for name, config in (("fused", SMALL), ("split", SPLIT)):
        out = torch.full((dy.shape[0], 2 * ffn), float("nan"))
        act = torch.full((dy.shape[0], ffn), float("nan")) if save_act else None
        gg.ragged_rows_gemm(dy, offsets, w2_t, config, epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13, out=out,
                            act_N_C=act, num_programs=3)
        runs[name] = (out, act)
    (fused, fused_act), (split, split_act) = runs["fused"], runs["split"]
    assert _rel_err(split[:served], fused[:served]) < 1e-6
    assert torch.isnan(split[served:]).all()  # no group's rows: unwritten, as the fused launch leaves them
    if save_act:
        assert torch.equal(split_act[:served], fused_act[:served])


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_split_epilogue_takes_gathered_weighted_rows_and_sums_their_dots(gg, case):
    """The fused combine's down dgrad (`kernels.fused_moe`): token rows gathered, each row's product
    scaled by its routing weight, and the row dots with the SwiGLU output (unscaled), summed over the
    column tiles by the caller: the split pass writes the whole dot into the first tile's row."""
    counts, hidden, ffn = CASES[case]
    offsets, _, w2_t, h13 = _operands(counts, hidden, ffn, seed=10 + case, spare=0)
    rows = int(offsets[-1])
    gen = torch.Generator().manual_seed(case)
    tokens = torch.randn(max(rows // 2, 1), hidden, generator=gen)
    token_N = torch.randint(0, tokens.shape[0], (rows,), generator=gen)
    scale_N = torch.rand(rows, generator=gen)
    results = []
    for config in (SMALL, SPLIT):
        rowdot = torch.full((triton.cdiv(ffn, config.block_n), rows), float("nan"))
        out = gg.ragged_rows_gemm(tokens, offsets, w2_t, config, epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13,
                                  a_rows_N=token_N, row_scale=(scale_N, rowdot), num_programs=2)
        results.append((out, rowdot.sum(0)))
    (fused, fused_dot), (split, split_dot) = results
    assert _rel_err(split, fused) < 1e-6 and _rel_err(split_dot, fused_dot) < 1e-5


def test_the_tuner_offers_the_split_epilogue_for_the_down_data_gradient_only():
    from disagmoe.bench.tune_experts import candidates
    from disagmoe.kernels.tile_configs import ROLES

    from disagmoe.kernels.tile_configs import tma_store_fits

    for role in ROLES:
        split = [c for c in candidates(role) if c.split_epilogue and not c.tma_store]
        assert len(split) == (2 if role == "down_dgrad" else 0), role
    assert {c.library for c in candidates("down_dgrad") if c.split_epilogue} == {False, True}
    # and its plain GEMM at every row tile loading and storing by TMA where the store's buffer fits (session 48)
    stored = [c for c in candidates("down_dgrad") if c.tma_store]
    assert stored and all(c.split_epilogue and c.tma and not c.library and tma_store_fits(c, "down") for c in stored)
    assert not any(c.tma_store and not c.split_epilogue for c in candidates("down_dgrad"))  # not the fused epilogue's


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("library", [False, True], ids=["ours", "library"])
def test_gpu_bf16_split_epilogue_is_the_fused_one_within_a_rounding(library):
    """bf16: the split pass reads d act rounded to bf16 once (the fused epilogue, fp32 accumulators):
    within bf16 rounding of the fused result, and its row dots too."""
    from disagmoe.kernels import grouped_gemm as gg

    counts, hidden, ffn = [300, 0, 1000, 7], 1024, 384
    offsets, dy, w2_t, h13 = (t.cuda() for t in _operands(counts, hidden, ffn, seed=3, spare=0))
    dy, w2_t, h13 = dy.bfloat16(), w2_t.bfloat16(), h13.bfloat16()
    fused_cfg = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
    split_cfg = dataclasses.replace(TileConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4),
                                    split_epilogue=True, library=library)
    scale = torch.rand(dy.shape[0], device="cuda")
    outs = []
    for config in (fused_cfg, split_cfg):
        rowdot = torch.empty((triton.cdiv(ffn, config.block_n), dy.shape[0]), device="cuda")
        act = torch.empty(dy.shape[0], ffn, device="cuda", dtype=torch.bfloat16)
        out = gg.ragged_rows_gemm(dy, offsets, w2_t, config, epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13,
                                  act_N_C=act, row_scale=(scale, rowdot))  # rows as they are: the library may run
        outs.append((out, act, rowdot.sum(0)))
    for got, want in zip(outs[1], outs[0], strict=True):
        assert _rel_err(got, want) < 2e-2
