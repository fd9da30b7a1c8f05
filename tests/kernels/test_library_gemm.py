"""`TileConfig.library`: the down and gate/up data-gradient launches run as `torch._grouped_mm` where
it can run them (`grouped_gemm.library_takes`), our kernel with the same tile fields where it cannot,
and the tuner offers it for those roles only. The FFN with the library's launches against the torch
reference in fp32 on the CPU (interpreter for our other launches), and in bf16 on a GPU."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig
from tests.kernels.test_moe_ffn import _inputs, _rel_err  # the FFN tests' ragged inputs and error

SMALL = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
LIBRARY = dataclasses.replace(SMALL, library=True)
CASES = [([5, 0, 37, 1], 40, 24), ([0, 0, 50, 0], 32, 16), ([17, 16, 0, 33, 2], 24, 40)]


@pytest.fixture
def kernels(interpreted):
    return interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.moe_ffn")


def _count_library(monkeypatch) -> list[tuple[int, ...]]:
    calls: list[tuple[int, ...]] = []
    real = torch._grouped_mm

    def counted(a, b, *args, **kwargs):
        calls.append(tuple(a.shape))
        return real(a, b, *args, **kwargs)

    monkeypatch.setattr(torch, "_grouped_mm", counted)
    return calls


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_ffn_with_library_launches_matches_the_reference(kernels, monkeypatch, case):
    """down and gate/up dgrad through the library (two calls per forward and backward), the rest
    ours; empty experts and ragged counts; every gradient within fp32 rounding of the reference."""
    _, moe_ffn = kernels
    counts, hidden, ffn = CASES[case]
    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=case)
    dy = torch.randn(x.shape[0], hidden, generator=torch.Generator().manual_seed(7 + case))
    tiles = dataclasses.replace(moe_ffn.FFNTiles.uniform(SMALL), down=LIBRARY, gate_up_dgrad=LIBRARY)
    calls = _count_library(monkeypatch)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = moe_ffn.expert_ffn_triton(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles, num_programs=3)
    y.backward(dy)
    assert calls == [(x.shape[0], ffn), (x.shape[0], 2 * ffn)]  # down's act rows, then the dgrad's dh13 rows
    ref = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y_ref = moe_ffn.expert_ffn_reference(ref[0], offsets, ref[1], ref[2])
    y_ref.backward(dy)
    assert _rel_err(y, y_ref) < 1e-5
    for got, want in zip(leaves, ref, strict=True):
        assert _rel_err(got.grad, want.grad) < 1e-5


def test_launches_the_library_cannot_run_fall_back_to_our_kernel_with_the_same_tile(kernels, monkeypatch):
    """A given output, scattered or gathered rows, a SwiGLU epilogue, banded groups, unaligned
    rows: our kernel runs them, with the tile's fields (the same bits as without `library`)."""
    gg, _ = kernels
    x, offsets, w13, w2 = _inputs([5, 0, 37, 1], 40, 24, torch.float32, "cpu", seed=1)
    act = torch.randn(x.shape[0], 24)
    calls = _count_library(monkeypatch)
    rows = x.shape[0]
    dst = torch.randperm(rows, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    odd_a, odd_b = torch.randn(rows, 18), torch.randn(4, 18, 8)  # 72-byte rows: not 16-byte aligned
    launches = {
        "given output": lambda c: gg.ragged_rows_gemm(act, offsets, w2, c, out=torch.empty(rows, 40)),
        "scattered rows": lambda c: gg.ragged_rows_gemm(act, offsets, w2, c, out=torch.zeros(rows, 40),
                                                        dst_rows_N=dst),
        "gathered rows": lambda c: gg.ragged_rows_gemm(act, offsets, w2, c, a_rows_N=dst),
        "swiglu epilogue": lambda c: gg.ragged_rows_gemm(x, offsets, w13, c, epilogue=gg.EPILOGUE_SWIGLU),
        "banded groups": lambda c: gg.ragged_rows_gemm(act, torch.cat([offsets // 2, offsets]).to(torch.int32),
                                                       w2, c),
        "unaligned rows": lambda c: gg.ragged_rows_gemm(odd_a, offsets, odd_b, c),
    }
    for name, launch in launches.items():
        assert torch.equal(launch(LIBRARY), launch(SMALL)), name
    assert calls == []
    assert torch.equal(gg.ragged_rows_gemm(act, offsets, w2, LIBRARY)[:offsets[-1]],
                       torch._grouped_mm(act, w2, offs=offsets)[:offsets[-1]])
    assert len(calls) == 2  # the plain launch took the library (and the check's own call)


def test_the_tuner_offers_the_library_for_the_plain_roles_only():
    from disagmoe.bench.tune_experts import LIBRARY_ROLES, candidates
    from disagmoe.kernels.tile_configs import ROLES, TileConfig

    for role in ROLES:  # (the down dgrad's split epilogue runs its plain GEMM in the library too)
        offered = [c for c in candidates(role) if c.library and not c.split_epilogue]
        assert len(offered) == (1 if role in LIBRARY_ROLES else 0), role
    assert set(LIBRARY_ROLES) == {"down", "gate_up_dgrad"}
    assert TileConfig(**LIBRARY.to_json()) == LIBRARY  # a tuned table keeps the flag


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_library_launches_match_ours(monkeypatch):
    """bf16 on a GPU: the library's down and gate/up dgrad launches (both taken) against our
    kernels, within bf16 rounding, forward and backward."""
    from disagmoe.kernels import moe_ffn

    x, offsets, w13, w2 = _inputs([300, 0, 1000, 7], 512, 384, torch.bfloat16, "cuda", seed=3)
    dy = torch.randn_like(x)

    def run(tiles):
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
        y = moe_ffn.expert_ffn_triton(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles)
        y.backward(dy)
        return [y.detach()] + [t.grad for t in leaves]

    ours = run(None)
    default = moe_ffn.FFNTiles.for_shape(x.shape[0], 4, 512, 384, x.device)
    calls = _count_library(monkeypatch)
    library = run(dataclasses.replace(default, down=dataclasses.replace(default.down, library=True),
                                      gate_up_dgrad=dataclasses.replace(default.gate_up_dgrad, library=True)))
    assert len(calls) == 2
    for got, want in zip(library, ours, strict=True):
        assert _rel_err(got, want) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_library_launch_makes_no_host_wait_and_replays_in_a_cuda_graph():
    """The step is captured whole (`cuda_graphs`): the library's launch must neither read the
    offsets on the host nor fail capture; its replay on new routing gives the new product."""
    from disagmoe.kernels import grouped_gemm as gg

    act, offsets, _, w2 = _inputs([300, 0, 1000, 7], 384, 512, torch.bfloat16, "cuda", seed=5)
    act = act[:, :384].contiguous()
    w2 = w2[:, :384].contiguous()
    tile = dataclasses.replace(SMALL, library=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gg.ragged_rows_gemm(act, offsets, w2, tile)  # warm-up outside capture
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gg.ragged_rows_gemm(act, offsets, w2, tile)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = gg.ragged_rows_gemm(act, offsets, w2, tile)
    offsets.copy_(torch.tensor([700, 700, 1100, 1307], dtype=torch.int32, device="cuda"))
    graph.replay()
    torch.cuda.synchronize()
    want = torch.cat([act[s:e].float() @ w2[i].float() for i, (s, e) in enumerate(zip([0, 700, 700, 1100],
                                                                                       [700, 700, 1100, 1307]))])
    assert _rel_err(y[:1307], want) < 1e-2
