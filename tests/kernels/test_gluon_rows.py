"""The warp-specialised Gluon bf16 row GEMM (kernels/gluon_rows.py): compiled for sm_90a on the CPU (its
partitions, wgmmas, registers and spills, both weight layouts, both epilogues), its argument checks, and
on a Hopper GPU against an fp64 reference and our Triton kernel (`grouped_gemm.ragged_rows_gemm`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from disagmoe.kernels import fp8_gluon as fg  # noqa: E402
from disagmoe.kernels import gluon_rows as gr  # noqa: E402
from disagmoe.kernels import gluon_wgrad as gw  # noqa: E402
from disagmoe.kernels import grouped_gemm as gg  # noqa: E402
from disagmoe.kernels.tile_configs import ROLES, TileConfig  # noqa: E402
from tests.kernels.test_fp8 import _exact, _offsets, _rel_err  # noqa: E402
from tests.kernels.test_fp8_gluon import hopper_builds  # noqa: E402,F401 (a fixture)


def _operands(counts, k, n, layout, dtype=torch.bfloat16, device="cpu", seed=0):
    """a [M, K], offsets_E and b [E, K, N] in `layout`: 'n-major' (the weights as stored) or 'k-major'
    (a transposed view of [E, N, K] storage, as the gate/up data gradient reads w13)."""
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(sum(counts), k, generator=gen).to(device=device, dtype=dtype)
    b = (torch.randn(len(counts), k, n, generator=gen) / k**0.5).to(device=device, dtype=dtype)
    if layout == "k-major":
        b = b.transpose(1, 2).contiguous().transpose(1, 2)
    return a, _offsets(counts).to(device), b


# --- compiled for sm_90a on the CPU (nothing launched)

# (block_m, block_n, stages, tma_store): the tiles `tune_experts.GLUON_ROWS_CANDIDATES` offers
COMPILED = [(128, 128, 4, False), (128, 128, 4, True), (128, 256, 3, False), (128, 256, 3, True),
            (128, 256, 4, False), (64, 128, 4, False), (64, 256, 4, True)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["n-major", "k-major"])
@pytest.mark.parametrize("block_m,block_n,stages,tma_store", COMPILED,
                         ids=[f"{m}x{n}-s{s}" + ("-tma-store" if t else "") for m, n, s, t in COMPILED])
def test_the_kernel_compiles_warp_specialised_without_spills(hopper_builds, block_m, block_n, stages, tma_store,
                                                            layout):
    """TTGIR: one warp_specialize (the second consumer warpgroup at block_m 128 and the TMA producer),
    TMA loads and wgmmas; PTX: the bf16 wgmma at the tile's N, one kept in flight (wait_group 1), the
    register reallocation where 12 warps share the file, bulk tensor stores with tma_store; ptxas
    (sm_90a): no spill stores and at most MAXNREG registers where 12 warps share the file; the block's
    shared memory the ring's stages and the store's buffers, within the limit."""
    from tests.kernels.test_compile_for_hopper import ptxas_report, ptxas_usage

    a, offsets, b = _operands([300, 0, 5, 700], 512, 512, layout)
    out = torch.empty(a.shape[0], 512, dtype=torch.bfloat16)
    gr.gluon_rows_gemm(a, offsets, b, out=out, block_m=block_m, block_n=block_n, stages=stages, num_programs=132,
                       tma_store=tma_store)
    (kernel,) = hopper_builds
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    assert ttgir.count("ttg.warp_specialize(") == 1
    assert "ttng.async_tma_copy_global_to_local" in ttgir and "ttng.warp_group_dot" in ttgir
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16" in ptx
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert ("cp.async.bulk.tensor.2d.global.shared::cta" in ptx) == tma_store
    if block_m == 128:
        assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    registers, spilled = ptxas_usage(ptx)
    assert spilled == 0, f"{block_m} x {block_n} ({layout}): {spilled} bytes of spill stores"
    assert "serialized" not in ptxas_report(ptx)  # ptxas's C7514/C7515: the wgmmas serialised
    if block_m == 128:
        assert registers <= fg.MAXNREG
    shared = stages * gr.ring_stage_bytes(block_m, block_n)
    shared += gr.epilogue_bytes(block_m, block_n, 2) if tma_store else 0
    assert shared <= kernel.metadata.shared <= fg.SHARED_MEMORY_BYTES


@pytest.mark.slow
def test_the_deepest_ring_each_tile_takes_compiles(hopper_builds):
    """`max_stages` is the ring the launch accepts at its deepest; it compiles within the block's memory."""
    a, offsets, b = _operands([200, 64], 256, 256, "n-major")
    deepest = gr.max_stages(128, 256, 2, tma_store=True)
    assert deepest >= 3
    gr.gluon_rows_gemm(a, offsets, b, block_m=128, block_n=256, stages=deepest, num_programs=132, tma_store=True)
    (kernel,) = hopper_builds
    assert kernel.metadata.shared <= fg.SHARED_MEMORY_BYTES
    with pytest.raises(ValueError, match=f"at most {deepest}"):
        gr.gluon_rows_gemm(a, offsets, b, block_m=128, block_n=256, stages=deepest + 1, num_programs=132,
                           tma_store=True)


# (block_m, block_n, stages, h13 saved, act by TMA): the SwiGLU tiles `tune_experts.GLUON_SWIGLU_CANDIDATES` offers
SWIGLU_COMPILED = [(128, 128, 4, True, False), (128, 128, 3, False, False), (128, 128, 4, True, True),
                   (128, 128, 3, True, True), (128, 64, 4, True, False), (64, 128, 4, True, True)]


@pytest.mark.slow
@pytest.mark.parametrize("block_m,block_n,stages,save_h13,tma_store", SWIGLU_COMPILED,
                         ids=[f"{m}x{n}-s{s}" + ("-h13" if h else "") + ("-tma-store" if t else "")
                              for m, n, s, h, t in SWIGLU_COMPILED])
def test_the_swiglu_kernel_compiles_warp_specialised_without_spills(hopper_builds, block_m, block_n, stages, save_h13,
                                                                   tma_store):
    """The SwiGLU GEMM: one warp_specialize, two bf16 wgmmas a slice (gate, up) with the pair kept in flight
    (wait_group 2), the exponential of the SiLU, act's bulk tensor stores with tma_store; ptxas (sm_90a): no
    spill stores, at most MAXNREG registers where 12 warps share the file; shared memory the ring's stages of
    an A and two B boxes and act's store buffers."""
    from tests.kernels.test_compile_for_hopper import ptxas_report, ptxas_usage

    x, offsets, w13 = _operands([300, 0, 5, 700], 512, 1024, "n-major")
    h13 = torch.empty(x.shape[0], 1024, dtype=torch.bfloat16) if save_h13 else None
    gr.gluon_swiglu_gemm(x, offsets, w13, h13_N2F=h13, block_m=block_m, block_n=block_n, stages=stages,
                         num_programs=132, tma_store=tma_store)
    (kernel,) = hopper_builds
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    assert ttgir.count("ttg.warp_specialize(") == 1 and ttgir.count("ttng.warp_group_dot") >= 2
    assert f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16" in ptx
    assert "wgmma.wait_group.sync.aligned 2;" in ptx and "ex2.approx" in ptx
    assert ("cp.async.bulk.tensor.2d.global.shared::cta" in ptx) == tma_store
    registers, spilled = ptxas_usage(ptx)
    assert spilled == 0, f"{block_m} x {block_n}: {spilled} bytes of spill stores"
    assert "serialized" not in ptxas_report(ptx)
    if block_m == 128:
        assert registers <= fg.MAXNREG
    shared = stages * gr.ring_stage_bytes(block_m, block_n, b_boxes=2)
    shared += gr.epilogue_bytes(block_m, block_n, 2) if tma_store else 0
    assert shared <= kernel.metadata.shared <= fg.SHARED_MEMORY_BYTES


SWIGLU_REFUSED = [("block_n 256", "block_n in"), ("odd half", "halves"), ("w13 transposed", "contiguous"),
                  ("h13 too narrow", "h13_N2F must be"), ("too deep", "at most"),
                  ("too deep beside the TMA store", "at most 4 at 128 x 128 beside the TMA store buffers")]


@pytest.mark.parametrize("change,match", SWIGLU_REFUSED, ids=[c for c, _ in SWIGLU_REFUSED])
def test_swiglu_arguments_it_cannot_take_are_refused_naming_the_fix(change, match):
    x, offsets, w13 = _operands([100, 28], 128, 512, "n-major")
    kwargs: dict = {}
    if change == "block_n 256":
        kwargs["block_n"] = 256
    elif change == "odd half":
        x, offsets, w13 = _operands([100, 28], 128, 384, "n-major")
    elif change == "w13 transposed":
        w13 = w13.transpose(1, 2).contiguous().transpose(1, 2)
    elif change == "h13 too narrow":
        kwargs["h13_N2F"] = torch.empty(x.shape[0], 256, dtype=torch.bfloat16)
    elif change == "too deep":
        kwargs["stages"] = 6
    elif change == "too deep beside the TMA store":
        kwargs.update(stages=5, tma_store=True)
    with pytest.raises(ValueError, match=match):
        gr.gluon_swiglu_gemm(x, offsets, w13, num_programs=4, **kwargs)


# (what is changed, the message naming the fix)
REFUSED = [
    ("fp32 operands", "share a dtype"),
    ("mixed dtypes", "share a dtype"),
    ("block_m 256", "block_m in"),
    ("block_n 32", "block_n in"),
    ("K 96", "multiple of 64"),
    ("N not of block_n", "multiple of block_n"),
    ("b strided", "contiguous"),
    ("a column-strided", "unit column stride"),
    ("offsets int64", "int32"),
    ("out of the wrong shape", "out must be"),
    ("one stage", "at least 2"),
    ("fp32 out beside the TMA store", "at most 2"),
    ("b misaligned", "16-byte aligned"),
]


@pytest.mark.parametrize("change,match", REFUSED, ids=[c for c, _ in REFUSED])
def test_arguments_it_cannot_take_are_refused_naming_the_fix(change, match):
    a, offsets, b = _operands([100, 28], 128, 256, "n-major")
    kwargs: dict = {}
    if change == "fp32 operands":
        a, b = a.float(), b.float()
    elif change == "mixed dtypes":
        b = b.half()
    elif change == "block_m 256":
        kwargs["block_m"] = 256
    elif change == "block_n 32":
        kwargs["block_n"] = 32
    elif change == "K 96":
        a, offsets, b = _operands([100, 28], 96, 256, "n-major")
    elif change == "N not of block_n":
        a, offsets, b = _operands([100, 28], 128, 192, "n-major")
    elif change == "b strided":
        b = torch.zeros(2, 128, 512, dtype=torch.bfloat16)[:, :, ::2]
    elif change == "a column-strided":
        a = torch.zeros(128, 256, dtype=torch.bfloat16)[:, ::2]
    elif change == "offsets int64":
        offsets = offsets.long()
    elif change == "out of the wrong shape":
        kwargs["out"] = torch.empty(a.shape[0], 128, dtype=torch.bfloat16)
    elif change == "one stage":
        kwargs["stages"] = 1
    elif change == "fp32 out beside the TMA store":  # two [64, 256] fp32 buffers leave room for 2 stages, not 3
        kwargs.update(out=torch.empty(a.shape[0], 256, dtype=torch.float32), block_n=256, stages=3, tma_store=True)
    elif change == "b misaligned":
        b = torch.zeros(1 + b.numel(), dtype=torch.bfloat16)[1:].view(b.shape)
    with pytest.raises(ValueError, match=match):
        gr.gluon_rows_gemm(a, offsets, b, num_programs=4, **kwargs)


def test_no_rows_return_the_empty_output_without_a_launch():
    a, offsets, b = _operands([0, 0], 128, 256, "k-major")
    out = gr.gluon_rows_gemm(a, offsets, b, num_programs=4)
    assert out.shape == (0, 256) and out.dtype == torch.bfloat16


def test_it_takes_nothing_on_a_cpu_or_in_the_interpreter():
    a, _, b = _operands([64, 64], 128, 256, "n-major")
    assert not gr.takes(a, b)


def test_a_cpu_launch_with_the_gluon_tile_runs_our_triton_kernel_with_its_products(interpreted):
    """`TileConfig.gluon` where the Gluon kernel cannot run (here: the CPU, under the interpreter) runs
    the Triton kernel at the config's tile fields, whose products equal the tile without it."""
    grouped = interpreted("disagmoe.kernels.grouped_gemm")
    a, offsets, b = _operands([40, 0, 17], 64, 64, "n-major", dtype=torch.float32)
    tile = TileConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1)
    want = grouped.ragged_rows_gemm(a, offsets, b, tile, num_programs=2)
    got = grouped.ragged_rows_gemm(a, offsets, b, dataclasses.replace(tile, gluon=True, gluon_tma_store=True),
                                   num_programs=2)
    assert torch.equal(got, want)
    assert torch.allclose(want, _exact(a, b, offsets).float(), rtol=1e-4, atol=1e-4)


# --- on a Hopper GPU

def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90a: wgmma, TMA, setmaxnreg)")

# rows per group: empty groups, groups shorter than a tile (one or both consumers' halves partly past the
# group's end), groups of several tiles with short last tiles
GPU_COUNTS = {"mixed": [300, 0, 1000, 7], "short": [0, 1, 129, 0, 63, 65, 517, 0], "one-group": [2048, 0, 0, 0]}
GPU_TILES = [(128, 128, 4, False), (128, 128, 4, True), (128, 256, 3, False), (128, 256, 3, True),
             (128, 256, 4, False), (64, 128, 4, False), (64, 256, 4, True)]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("block_m,block_n,stages,tma_store", GPU_TILES,
                         ids=[f"{m}x{n}-s{s}" + ("-tma-store" if t else "") for m, n, s, t in GPU_TILES])
@pytest.mark.parametrize("layout", ["n-major", "k-major"])
@pytest.mark.parametrize("k,n", [(768, 2048), (2048, 768), (192, 512), (64, 512)])  # (64, ...): one K slice
@pytest.mark.parametrize("counts", list(GPU_COUNTS.values()), ids=list(GPU_COUNTS))
def test_gpu_matches_the_fp64_reference_and_the_triton_kernel(counts, k, n, layout, block_m, block_n, stages,
                                                             tma_store):
    """bf16 out within bf16 rounding of the fp64 product (the same bound as our Triton kernel's against
    it, which it is checked against too), every row of every group written; with the TMA store the
    same bits as the masked store's (the same sums, each wave stored once)."""
    if n % block_n:
        pytest.skip(f"N={n} is not a multiple of block_n={block_n} (the kernel refuses it; takes() says no)")
    a, offsets, b = _operands(counts, k, n, layout, device="cuda", seed=sum(counts) + k)
    out = torch.full((a.shape[0], n), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = gr.gluon_rows_gemm(a, offsets, b, out=out, block_m=block_m, block_n=block_n, stages=stages,
                             tma_store=tma_store)
    if tma_store:
        plain = gr.gluon_rows_gemm(a, offsets, b, block_m=block_m, block_n=block_n, stages=stages)
        assert torch.equal(got, plain)
    want = _exact(a.float(), b.float(), offsets)
    assert torch.isfinite(got).all()
    assert _rel_err(got, want) < 8e-3
    triton_out = gg.ragged_rows_gemm(a, offsets, b, TileConfig(block_m=128, block_n=128, block_k=64))
    assert _rel_err(got, triton_out) < 8e-3


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tma_store", [False, True], ids=["masked", "tma-store"])
def test_gpu_fp32_out_and_groups_sharing_weights(tma_store):
    """out given in fp32, offsets holding twice the experts' count (group g uses b[g mod E])."""
    counts = [64, 0, 300, 5, 128, 70]
    a, offsets, b = _operands(counts, 512, 256, "k-major", device="cuda")
    b = b[:3]
    out = torch.full((a.shape[0], 256), float("nan"), dtype=torch.float32, device="cuda")
    gr.gluon_rows_gemm(a, offsets, b, out=out, tma_store=tma_store)
    want = torch.cat([a[s:t].double() @ b[g % 3].double()
                      for g, (s, t) in enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist()))])
    assert _rel_err(out, want) < 1e-3


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("role", ["down", "gate_up_dgrad"])
def test_gpu_the_gluon_tile_runs_the_gluon_kernel_in_the_ffns_launch(role, monkeypatch):
    """`TileConfig.gluon` on a plain launch the kernel takes runs it (the same bits as calling it), and
    one it cannot take (a scattered result) runs our Triton kernel."""
    calls = []
    real = gr.gluon_rows_gemm
    monkeypatch.setattr(gr, "gluon_rows_gemm", lambda *args, **kwargs: calls.append(kwargs) or real(*args, **kwargs))
    layout = "n-major" if role == "down" else "k-major"
    a, offsets, b = _operands([300, 0, 700, 24], 768, 2048, layout, device="cuda")
    tile = TileConfig(block_m=128, block_n=128, block_k=64, gluon=True, gluon_block_n=256, gluon_stages=3)
    got = gg.ragged_rows_gemm(a, offsets, b, tile)
    assert len(calls) == 1 and calls[0]["block_n"] == 256 and calls[0]["stages"] == 3
    assert torch.equal(got, real(a, offsets, b, block_m=128, block_n=256, stages=3))
    dst = torch.randperm(a.shape[0], device="cuda")
    gg.ragged_rows_gemm(a, offsets, b, tile, dst_rows_N=dst, out=torch.empty_like(got))
    assert len(calls) == 1


@pytest.mark.gpu
@needs_hopper
def test_gpu_the_down_data_gradients_split_epilogue_runs_its_plain_gemm_in_gluon(monkeypatch):
    """down dgrad under `split_epilogue` with the Gluon tile: its plain GEMM (d act = dy @ w2^T) runs the
    Gluon kernel, then the SwiGLU derivative's pass; d h13 within bf16 rounding of the Triton tile's."""
    calls = []
    real = gr.gluon_rows_gemm
    monkeypatch.setattr(gr, "gluon_rows_gemm", lambda *args, **kwargs: calls.append(kwargs) or real(*args, **kwargs))
    counts, hidden, ffn = [300, 0, 700, 24], 512, 768
    dy, offsets, w2_t = _operands(counts, hidden, ffn, "k-major", device="cuda")
    h13 = torch.randn(dy.shape[0], 2 * ffn, device="cuda", dtype=torch.bfloat16)
    tile = TileConfig(block_m=128, block_n=128, block_k=64, num_stages=4, split_epilogue=True)
    want = gg.ragged_rows_gemm(dy, offsets, w2_t, tile, epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13)
    got = gg.ragged_rows_gemm(dy, offsets, w2_t, dataclasses.replace(tile, gluon=True),
                              epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13)
    assert len(calls) == 1
    assert _rel_err(got, want) < 8e-3


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("block_m,block_n,stages,tma_store", [(128, 128, 4, False), (128, 128, 4, True),
                                                               (128, 64, 4, False), (64, 128, 4, True)])
@pytest.mark.parametrize("hidden,ffn", [(2048, 768), (768, 1024)])
@pytest.mark.parametrize("counts", list(GPU_COUNTS.values()), ids=list(GPU_COUNTS))
def test_gpu_the_swiglu_gemm_matches_the_reference_and_the_triton_epilogue(counts, hidden, ffn, block_m, block_n,
                                                                         stages, tma_store):
    """act and the saved pre-activations within bf16 rounding of the fp64 reference and of our Triton kernel's
    SwiGLU epilogue, every row of every group written; routed from `ragged_rows_gemm` by `TileConfig.gluon`."""
    if ffn % block_n:
        pytest.skip(f"F={ffn} is not a multiple of block_n={block_n}")
    x, offsets, w13 = _operands(counts, hidden, 2 * ffn, "n-major", device="cuda", seed=sum(counts) + hidden)
    act = torch.full((x.shape[0], ffn), float("nan"), dtype=torch.bfloat16, device="cuda")
    h13 = torch.full((x.shape[0], 2 * ffn), float("nan"), dtype=torch.bfloat16, device="cuda")
    gr.gluon_swiglu_gemm(x, offsets, w13, out=act, h13_N2F=h13, block_m=block_m, block_n=block_n, stages=stages,
                         tma_store=tma_store)
    if tma_store:  # the same sums, each wave stored once: by TMA inside its group, masked past its end
        assert torch.equal(act, gr.gluon_swiglu_gemm(x, offsets, w13, block_m=block_m, block_n=block_n,
                                                     stages=stages))
    h13_want = _exact(x.float(), w13.float(), offsets)
    gate, up = h13_want[:, :ffn], h13_want[:, ffn:]
    assert torch.isfinite(act).all() and torch.isfinite(h13).all()
    assert _rel_err(h13, h13_want) < 8e-3
    assert _rel_err(act, gate * torch.sigmoid(gate) * up) < 1.5e-2
    tile = TileConfig(block_m=block_m, block_n=block_n, block_k=64, num_stages=stages)
    h13_triton = torch.empty_like(h13)
    act_triton = gg.ragged_rows_gemm(x, offsets, w13, tile, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13_triton)
    assert _rel_err(act, act_triton) < 1e-2 and _rel_err(h13, h13_triton) < 8e-3
    routed = gg.ragged_rows_gemm(x, offsets, w13, dataclasses.replace(tile, gluon=True, gluon_block_m=block_m,
                                                                        gluon_block_n=block_n, gluon_stages=stages,
                                                                        gluon_tma_store=tma_store),
                                 epilogue=gg.EPILOGUE_SWIGLU)
    assert torch.equal(routed, act)


# --- in training (Hopper): the step with the Gluon tiles against the step with our Triton ones

def _gluon_tiles(tiles):
    """The FFN's tiles with every launch the Gluon kernels can run sent there, as `bench experts`'
    `triton:gluon` runs them (`FFNTiles.on_gluon`: TMA stores)."""
    return tiles.on_gluon()


def _triton_tiles(tiles):
    """The FFN's tiles with every launch on our Triton kernel (a tuned table may name Gluon or library tiles)."""
    return dataclasses.replace(tiles, **{role: dataclasses.replace(getattr(tiles, role), gluon=False, library=False)
                                         for role in ROLES})


def _tiles_from(monkeypatch, choose) -> None:
    """`FFNTiles.for_shape` (every launch's tile lookup) answering `choose(the tuned tiles)` from now on (the
    tuned lookup's own, not an earlier call's choice)."""
    from disagmoe.kernels.moe_ffn import FFNTiles

    current = FFNTiles.for_shape.__func__
    tuned = getattr(current, "tuned", current)

    def for_shape(cls, *args, **kwargs):
        return choose(tuned(cls, *args, **kwargs))

    for_shape.tuned = tuned
    monkeypatch.setattr(FFNTiles, "for_shape", classmethod(for_shape))


def _count_gluon_calls(monkeypatch) -> list[str]:
    """The names of the Gluon kernels' host functions as they are called from now on."""
    calls = []
    for module, name in ((gr, "gluon_rows_gemm"), (gr, "gluon_swiglu_gemm"), (gw, "gluon_weight_grad")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name,
                            lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    return calls


def _qwen3_bf16_forward_backward(tokens_BS: torch.Tensor, fixed=None):
    """(loss, the routed experts' w13 and w2 gradients in fp32, the routing) of one forward and backward of
    a 2-layer Qwen3-30B-A3B-shaped model (bf16, seed 0, a 4,096-token vocabulary), routed as `fixed` says."""
    import torch.nn.functional as F

    from disagmoe.model.experts import RoutedExperts
    from disagmoe.model.init import materialise
    from disagmoe.model.transformer import MoETransformer
    from tests.kernels.test_fp8_gluon import _qwen3_two_layers

    with torch.device("meta"):
        model = MoETransformer(_qwen3_two_layers(), experts_backend="triton")
    materialise(model, torch.device("cuda"), 0).to(torch.bfloat16)
    out = model(tokens_BS[:, :-1], fixed)
    loss = F.cross_entropy(out.logits_BSV.flatten(0, 1).float(), tokens_BS[:, 1:].flatten())
    loss.backward()
    torch.cuda.synchronize()
    experts = [m for m in model.modules() if isinstance(m, RoutedExperts)]
    return loss.item(), [g.float() for e in experts for g in (e.w13_EH2F.grad, e.w2_EFH.grad)], out.topk_idx_LNK


@pytest.mark.gpu
@pytest.mark.slow
@needs_hopper
@pytest.mark.parametrize("routing", ["learned", "skewed"])
def test_gpu_training_a_qwen3_shaped_models_step_is_the_same_with_the_gluon_gemms(routing, monkeypatch):
    """One forward and backward of a 2-layer Qwen3-30B-A3B-shaped model at one 4,096-token sequence
    (32,768 expert rows a layer, K 768 to 2,048) with every expert launch on our Triton kernel and with every
    launch the Gluon kernels take sent there, routed alike (the router's choice, or Zipf-skewed loads with 40
    of the 128 experts idle): the Gluon kernels ran (at least four launches a layer) and the Triton pass none,
    the same loss within 1e-4 and the experts' weight gradients within 1e-2."""
    from tests.kernels.test_fp8_gluon import _skewed_routing

    tokens_BS = torch.randint(0, 4096, (1, 4097), generator=torch.Generator().manual_seed(3)).cuda()
    fixed = _skewed_routing(2, 4096, 128, 8, empty=40, seed=4) if routing == "skewed" else None
    calls = _count_gluon_calls(monkeypatch)
    _tiles_from(monkeypatch, _triton_tiles)
    loss_t, grads_t, fixed = _qwen3_bf16_forward_backward(tokens_BS, fixed)
    assert calls == []
    _tiles_from(monkeypatch, _gluon_tiles)
    loss_g, grads_g, _ = _qwen3_bf16_forward_backward(tokens_BS, fixed)
    # per layer at least the gate/up forward, the down forward, d act's plain GEMM, the gate/up data gradient
    # and the two weight gradients
    assert calls.count("gluon_swiglu_gemm") >= 2 and calls.count("gluon_rows_gemm") >= 2 * 3, calls
    assert calls.count("gluon_weight_grad") >= 2 * 2, calls
    assert loss_g == pytest.approx(loss_t, rel=1e-4)
    errors = [float((g - t).norm() / t.norm()) for g, t in zip(grads_g, grads_t, strict=True)]
    assert max(errors) < 1e-2, errors


@pytest.mark.gpu
@pytest.mark.slow
@needs_hopper
@pytest.mark.parametrize("cuda_graphs", ["off", "on"])
def test_gpu_training_thirty_steps_train_alike_with_the_gluon_gemms(tmp_path, cuda_graphs, monkeypatch):
    """Thirty steps of the tiny model at hidden 256 and FFN 256 (multiples of 128), learned routing, eager
    and captured in one CUDA graph (the records say the graph replayed), with every expert launch on our Triton
    kernel and with the Gluon kernels (their host functions called, at the eager steps and at the capture):
    the first step's loss to 1e-5 (one forward, the same weights) and the mean of the last ten within 1%."""
    from disagmoe.config import TrainConfig
    from disagmoe.model_ref import load_model
    from disagmoe.runtime.observe.metrics import read_metrics
    from disagmoe.runtime.training.loop import METRICS_FILE
    from disagmoe.runtime.training.trainer import train_single

    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    calls = _count_gluon_calls(monkeypatch)
    losses = {}
    for gluon in (False, True):
        _tiles_from(monkeypatch, _gluon_tiles if gluon else _triton_tiles)
        out = tmp_path / f"gluon-{gluon}"
        train_single(TrainConfig(model=model, mode="single", device="cuda", steps=30, batch_size=8, seq_len=128,
                                 micro_batches=2, eval_every=0, checkpoint_at_end=False, experts_backend="triton",
                                 cuda_graphs=cuda_graphs, out_dir=str(out)))
        records = read_metrics(out / METRICS_FILE)
        losses[gluon] = [r["loss"] for r in records]
        assert any(r["cuda_graph"] for r in records) == (cuda_graphs == "on")
        assert bool(calls) == gluon
    assert set(calls) == {"gluon_rows_gemm", "gluon_swiglu_gemm", "gluon_weight_grad"}
    triton_run, gluon_run = losses[False], losses[True]
    assert len(triton_run) == len(gluon_run) == 30
    assert gluon_run[0] == pytest.approx(triton_run[0], rel=1e-5)
    assert sum(gluon_run[-10:]) == pytest.approx(sum(triton_run[-10:]), rel=1e-2)
