"""The warp-specialised Gluon bf16 expert weight gradient (kernels/gluon_wgrad.py): compiled for sm_90a on the CPU
(its partitions, the transposed-A wgmma, registers and spills, each epilogue), its argument checks, its routing
from `grouped_gemm.ragged_weight_grad`, and on a Hopper GPU against an fp64 reference and our Triton kernel."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("triton.experimental.gluon")

from disagmoe.bench.tune_experts import GLUON_WGRAD_CANDIDATES  # noqa: E402
from disagmoe.kernels import gluon_ragged as gra  # noqa: E402
from disagmoe.kernels import gluon_wgrad as gw  # noqa: E402
from disagmoe.kernels import grouped_gemm as gg  # noqa: E402
from disagmoe.kernels.tile_configs import TileConfig  # noqa: E402
from tests.kernels.test_fp8 import _offsets, _rel_err  # noqa: E402
from tests.kernels.test_fp8_gluon import hopper_builds  # noqa: E402,F401 (a fixture)


def _rows(counts, ka, c, dtype=torch.bfloat16, device="cpu", seed=0, spare=0):
    """a [N, KA], b [N, C] of the groups' rows (`spare` rows more past the last group, NaN: a capacity buffer's
    rows no launch wrote) and offsets_E."""
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    a = torch.randn(rows + spare, ka, generator=gen)
    b = torch.randn(rows + spare, c, generator=gen)
    a[rows:], b[rows:] = float("nan"), float("nan")
    return a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype), _offsets(counts).to(device)


def _reference(a, b, offsets, weights=None, second=None):
    """out[e] = sum over groups g = e mod E_W of a[rows_g]^T @ b[rows_g] (+ the second set's group e), fp64."""
    ends = offsets.tolist()
    experts = weights or len(ends)
    out = torch.zeros(experts, a.shape[1], b.shape[1], dtype=torch.float64)
    for g, (s, t) in enumerate(zip([0, *ends[:-1]], ends)):
        out[g % experts] += a[s:t].double().cpu().T @ b[s:t].double().cpu()
    if second is not None:
        a2, b2, offsets2 = second
        ends2 = offsets2.tolist()
        for e, (s, t) in enumerate(zip([0, *ends2[:-1]], ends2)):
            out[e] += a2[s:t].double().cpu().T @ b2[s:t].double().cpu()
    return out.to(a.device)


# --- compiled for sm_90a on the CPU (nothing launched)

@pytest.mark.slow
@pytest.mark.parametrize("block_n,stages,tma_epilogue,atomic", GLUON_WGRAD_CANDIDATES,
                         ids=[f"n{n}-s{s}" + ("-tma" if t else "") + ("-atomic" if a else "")
                              for n, s, t, a in GLUON_WGRAD_CANDIDATES])
@pytest.mark.parametrize("accumulate", [True, False], ids=["into-main", "fresh"])
def test_each_offered_tile_compiles_warp_specialised_without_spills(hopper_builds, block_n, stages, tma_epilogue,
                                                                    atomic, accumulate):
    """Each tile `bench tune-experts` offers: one warp_specialize with the setmaxnreg budgets, the bf16 wgmma at
    the tile's N with A read transposed from shared memory (both operands MN-major: the rows' KA and C are their
    contiguous dims), one kept in flight, the partial chunk's zeroing fenced for the async proxy; the main
    gradient reduce-added by TMA (TMA epilogue), by fp32 reductions (atomic) or loaded and stored; ptxas
    (sm_90a): no spill stores, at most MAXNREG registers, the wgmmas not serialised; shared memory the ring and
    the epilogue's buffers."""
    from tests.kernels.test_compile_for_hopper import ptxas_report, ptxas_usage

    a, b, offsets = _rows([200, 0, 64, 333], 512, 768)
    out = torch.zeros(4, 512, 768)
    gw.gluon_weight_grad(a, b, offsets, out=out, accumulate=accumulate, atomic=atomic, tma_epilogue=tma_epilogue,
                         block_n=block_n, stages=stages, num_programs=132)
    (kernel,) = hopper_builds
    ttgir, ptx = kernel.asm["ttgir"], kernel.asm["ptx"]
    assert ttgir.count("ttg.warp_specialize(") == 1
    assert f"requestedRegisters = array<i32: {gra.CONSUMER_REGS}, {gra.PRODUCER_REGS}>" in ttgir
    wgmmas = {line.split()[0] for line in ptx.splitlines() if "wgmma.mma_async" in line}
    assert wgmmas == {f"wgmma.mma_async.sync.aligned.m64n{block_n}k16.f32.bf16.bf16"}
    assert all(line.rstrip().endswith("1, 1, 1, 1;") for line in ptx.splitlines() if "wgmma.mma_async" in line)
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    # the barriers' initialisation, each consumer's zeroing of a partial chunk and (TMA epilogue) each consumer's
    # buffer of sums, fenced for the async proxy
    assert ptx.count("fence.proxy.async.shared::cta") == 3 + 2 * tma_epilogue
    assert ("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add" in ptx) == (tma_epilogue and accumulate)
    assert ("cp.async.bulk.tensor.2d.global.shared::cta" in ptx) == (tma_epilogue and not accumulate)
    assert ("atom.global.gpu.relaxed.add" in ptx) == (atomic and accumulate and not tma_epilogue)
    registers, spilled = ptxas_usage(ptx)
    assert spilled == 0, f"block_n {block_n}, {stages} stages: {spilled} bytes of spill stores"
    assert registers <= gra.MAXNREG
    assert "serialized" not in ptxas_report(ptx)
    shared = stages * gw.stage_bytes(block_n) + (gw.epilogue_buffer_bytes(block_n, 4) if tma_epilogue else 0)
    assert shared <= kernel.metadata.shared <= gra.SHARED_MEMORY_BYTES


@pytest.mark.slow
def test_the_paired_and_banded_forms_compile_without_spills(hopper_builds):
    """`second` (the next micro-batch's rows: its own A and B descriptors) and banded offsets (groups over
    fewer weights) compile without spills (ptxas, sm_90a), and without ptxas serialising the wgmmas (its
    C7514/C7515 advisories: until session 45 the paired form carried the first set's sum into the second's loop
    with a wgmma in flight, and every wgmma of it was serialised)."""
    from tests.kernels.test_compile_for_hopper import ptxas_report, ptxas_usage

    a, b, offsets = _rows([200, 0, 64, 333], 256, 256)
    a2, b2, offsets2 = _rows([5, 64, 0, 100], 256, 256, seed=1)
    gw.gluon_weight_grad(a, b, offsets, out=torch.zeros(4, 256, 256), accumulate=True, num_programs=132,
                         second=(a2, b2, offsets2))
    gw.gluon_weight_grad(a, b, offsets, weights=2, num_programs=132)
    paired, banded = hopper_builds
    # each set's two A boxes and its B box, which Triton copies in 128-byte-wide pieces (two at block_n 128)
    assert paired.asm["ptx"].count("cp.async.bulk.tensor.2d.shared::cluster.global") == 2 * (2 + 2)
    for kernel in (paired, banded):
        registers, spilled = ptxas_usage(kernel.asm["ptx"])
        assert spilled == 0 and registers <= gra.MAXNREG
        assert "serialized" not in ptxas_report(kernel.asm["ptx"])


@pytest.mark.slow
def test_an_add_without_atomic_keeps_the_register_epilogues_exact_sum(hopper_builds):
    """Into a main gradient without `atomic` (the Triton kernel's load-add-store, exact to the denormals): no TMA
    reduce-add and no fp32 reductions even where the TMA epilogue is asked (a TMA reduction flushes denormals as
    the atomics do); the ring may then take the depth the epilogue's buffers would have used."""
    a, b, offsets = _rows([200, 0, 64, 333], 512, 768)
    deepest = gw.max_stages(128)
    gw.gluon_weight_grad(a, b, offsets, out=torch.zeros(4, 512, 768), accumulate=True, atomic=False,
                         tma_epilogue=True, stages=deepest, num_programs=132)
    (kernel,) = hopper_builds
    ptx = kernel.asm["ptx"]
    assert "cp.reduce.async.bulk" not in ptx and "atom.global.gpu.relaxed.add" not in ptx
    assert "ld.global" in ptx and "st.global" in ptx


# (what is changed, the message naming the fix)
REFUSED = [
    ("fp32 rows", "share a dtype"),
    ("mixed dtypes", "share a dtype"),
    ("a column-strided", "unit column stride"),
    ("rows differ", "the same rows"),
    ("block_n 32", "block_n in"),
    ("offsets int64", "int32"),
    ("groups not of the weights", "multiple of weights=3"),
    ("accumulate without out", "give the fp32 main gradient"),
    ("bf16 main gradient", "out must be"),
    ("one stage", "at least 2"),
    ("too deep beside the TMA epilogue", "at most 5 at block_n 128 beside the TMA epilogue"),
    ("second banded", "not banded"),
    ("second of other widths", "widths"),
    ("group_m 0", "group_m"),
]


@pytest.mark.parametrize("change,match", REFUSED, ids=[c for c, _ in REFUSED])
def test_arguments_it_cannot_take_are_refused_naming_the_fix(change, match):
    a, b, offsets = _rows([100, 28], 128, 256)
    kwargs: dict = {}
    if change == "fp32 rows":
        a, b = a.float(), b.float()
    elif change == "mixed dtypes":
        b = b.half()
    elif change == "a column-strided":
        a = torch.zeros(128, 256, dtype=torch.bfloat16)[:, ::2]
    elif change == "rows differ":
        b = b[:100]
    elif change == "block_n 32":
        kwargs["block_n"] = 32
    elif change == "offsets int64":
        offsets = offsets.long()
    elif change == "groups not of the weights":
        kwargs["weights"] = 3
    elif change == "accumulate without out":
        kwargs["accumulate"] = True
    elif change == "bf16 main gradient":
        kwargs.update(accumulate=True, out=torch.zeros(2, 128, 256, dtype=torch.bfloat16))
    elif change == "one stage":
        kwargs["stages"] = 1
    elif change == "too deep beside the TMA epilogue":
        kwargs.update(tma_epilogue=True, stages=6)
    elif change == "second banded":
        a, b, offsets = _rows([100, 28, 3, 5], 128, 256)
        kwargs.update(weights=2, second=_rows([4, 4], 128, 256))
    elif change == "second of other widths":
        kwargs["second"] = _rows([4, 4], 64, 256)
    elif change == "group_m 0":
        kwargs["group_m"] = 0
    with pytest.raises(ValueError, match=match):
        gw.gluon_weight_grad(a, b, offsets, num_programs=4, **kwargs)


def test_the_deepest_ring_is_what_shared_memory_holds():
    """`max_stages`: the stages that fit 227 KiB beside the epilogue's buffers, and one more does not."""
    for block_n in gw.BLOCK_NS:
        for tma_epilogue in (False, True):
            deepest = gw.max_stages(block_n, tma_epilogue)
            used = gw.epilogue_buffer_bytes(block_n, 4) if tma_epilogue else 0
            assert deepest * gw.stage_bytes(block_n) + used <= gra.SHARED_MEMORY_BYTES
            assert (deepest + 1) * gw.stage_bytes(block_n) + used > gra.SHARED_MEMORY_BYTES
    for block_n, stages, tma_epilogue, _ in GLUON_WGRAD_CANDIDATES:  # every offered tile fits
        assert 2 <= stages <= gw.max_stages(block_n, tma_epilogue)


def test_it_takes_nothing_on_a_cpu_or_in_the_interpreter():
    a, b, offsets = _rows([64, 64], 128, 256)
    assert not gw.takes(a, b, offsets)


def test_a_cpu_launch_with_the_gluon_tile_runs_our_triton_kernel_with_its_sums(interpreted):
    """`TileConfig.gluon` where the Gluon kernel cannot run (here: the CPU, under the interpreter) runs the
    Triton weight gradient at the config's own fields, whose sums equal the tile without it."""
    grouped = interpreted("disagmoe.kernels.grouped_gemm")
    a, b, offsets = _rows([40, 0, 17], 64, 64, dtype=torch.float32)
    tile = TileConfig(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=1)
    want = grouped.ragged_weight_grad(a, b, offsets, tile, num_programs=2)
    got = grouped.ragged_weight_grad(a, b, offsets, dataclasses.replace(tile, gluon=True, gluon_tma_store=True),
                                     num_programs=2)
    assert torch.equal(got, want)
    assert torch.allclose(want.double(), _reference(a, b, offsets), rtol=1e-4, atol=1e-4)


# --- on a Hopper GPU

def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a Hopper GPU (sm_90a: wgmma, TMA, setmaxnreg)")

# rows per group: empty groups, groups shorter than a chunk, groups of whole and partial chunks
GPU_COUNTS = {"mixed": [300, 0, 1000, 7], "short": [0, 1, 129, 0, 63, 65, 517, 0], "one-group": [2048, 0, 0, 0]}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("block_n,stages,tma_epilogue,atomic", GLUON_WGRAD_CANDIDATES,
                         ids=[f"n{n}-s{s}" + ("-tma" if t else "") + ("-atomic" if a else "")
                              for n, s, t, a in GLUON_WGRAD_CANDIDATES])
@pytest.mark.parametrize("ka,c", [(2048, 1536), (768, 2048), (192, 320)])  # (192, 320): partial KA and C tiles
@pytest.mark.parametrize("counts", list(GPU_COUNTS.values()), ids=list(GPU_COUNTS))
def test_gpu_matches_the_fp64_reference_and_the_triton_kernel(counts, ka, c, block_n, stages, tma_epilogue, atomic):
    """Added into an fp32 main gradient: within fp32-sum rounding of the fp64 product plus the prior, and of our
    Triton kernel; NaN in the rows past the last group (a capacity buffer's) reach no sum; a fresh gradient in
    bf16 (out given) within bf16 rounding; zeros for an empty expert."""
    a, b, offsets = _rows(counts, ka, c, device="cuda", seed=sum(counts) + ka, spare=37)
    prior = torch.randn(len(counts), ka, c, device="cuda")
    main = prior.clone()
    gw.gluon_weight_grad(a, b, offsets, out=main, accumulate=True, atomic=atomic, tma_epilogue=tma_epilogue,
                         block_n=block_n, stages=stages)
    want = _reference(a, b, offsets)
    assert torch.isfinite(main).all()
    assert _rel_err(main - prior, want) < 1e-5
    triton_main = prior.clone()
    gg.ragged_weight_grad(a, b, offsets, TileConfig(block_m=64, block_n=128, block_k=128), out=triton_main,
                          accumulate=True)
    assert _rel_err(main - prior, triton_main - prior) < 1e-5
    fresh = torch.full((len(counts), ka, c), float("nan"), dtype=torch.bfloat16, device="cuda")
    gw.gluon_weight_grad(a, b, offsets, out=fresh, tma_epilogue=tma_epilogue, block_n=block_n, stages=stages)
    assert _rel_err(fresh, want) < 8e-3
    for e, rows in enumerate(counts):
        if rows == 0:
            assert not fresh[e].any()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("tma_epilogue", [False, True], ids=["registers", "tma"])
def test_gpu_banded_groups_and_a_second_row_set(tma_epilogue):
    """Banded offsets (G = 3 x E_W groups, each weight's summed in ascending g) and a paired second row set
    (`kernels.wgrad_pairs`: the next micro-batch's rows, one group an expert, some empty) against the fp64 sums;
    a first set without rows runs the second alone."""
    a, b, offsets = _rows([64, 0, 300, 5, 128, 70, 1, 0, 511], 512, 256, device="cuda")
    got = gw.gluon_weight_grad(a, b, offsets, weights=3, tma_epilogue=tma_epilogue)
    assert _rel_err(got, _reference(a, b, offsets, weights=3)) < 1e-5
    a, b, offsets = _rows([300, 0, 1000, 7], 512, 256, device="cuda", seed=1)
    second = _rows([0, 65, 2, 900], 512, 256, device="cuda", seed=2, spare=5)
    main = torch.zeros(4, 512, 256, device="cuda")
    gw.gluon_weight_grad(a, b, offsets, out=main, accumulate=True, tma_epilogue=tma_epilogue, second=second)
    assert _rel_err(main, _reference(a, b, offsets, second=second)) < 1e-5
    empty = _rows([0, 0, 0, 0], 512, 256, device="cuda")
    alone = gw.gluon_weight_grad(*empty, tma_epilogue=tma_epilogue, second=second)
    assert _rel_err(alone, _reference(*second)) < 1e-5


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("programs", [1, 2, 7])
def test_gpu_a_two_stage_ring_over_many_short_groups(programs):
    """The ring at its shallowest (2 stages) with few programs, over many groups of 1-70 rows (most chunks partial,
    so the second consumer waits on the first's zeroing of B at most of them), into a main gradient: a stage
    released early, or B read before its rows past the group's end are zeroed, shows against fp64 (NaN rows
    past the last group, and each neighbour group's rows, would reach the sums)."""
    counts = torch.randint(1, 71, (96,), generator=torch.Generator().manual_seed(programs)).tolist()
    counts[5] = counts[40] = 0
    a, b, offsets = _rows(counts, 256, 384, device="cuda", seed=programs, spare=11)
    for tma_epilogue in (False, True):
        main = torch.zeros(len(counts), 256, 384, device="cuda")
        gw.gluon_weight_grad(a, b, offsets, out=main, accumulate=True, tma_epilogue=tma_epilogue, stages=2,
                             num_programs=programs)
        assert torch.isfinite(main).all()
        assert _rel_err(main, _reference(a, b, offsets)) < 1e-5


@pytest.mark.gpu
@needs_hopper
def test_gpu_the_gluon_tile_runs_the_gluon_kernel_in_the_ffns_launch(monkeypatch):
    """`TileConfig.gluon` on a weight gradient the kernel takes runs it at the config's Gluon fields (the same bits
    as calling it), paired launches included; fp32 rows (which it cannot take) run our Triton kernel."""
    calls = []
    real = gw.gluon_weight_grad
    monkeypatch.setattr(gw, "gluon_weight_grad", lambda *args, **kwargs: calls.append(kwargs) or real(*args, **kwargs))
    a, b, offsets = _rows([300, 0, 700, 24], 768, 2048, device="cuda")
    tile = TileConfig(block_m=64, block_n=128, block_k=128, gluon=True, gluon_block_n=256, gluon_stages=3,
                      atomic_accumulate=True)
    main = torch.zeros(4, 768, 2048, device="cuda")
    second = _rows([1, 2, 3, 4], 768, 2048, device="cuda", seed=1)
    gg.ragged_weight_grad(a, b, offsets, tile, out=main, accumulate=True, second=second)
    assert len(calls) == 1 and calls[0]["block_n"] == 256 and calls[0]["stages"] == 3 and calls[0]["second"]
    assert _rel_err(main, _reference(a, b, offsets, second=second)) < 1e-5
    got = gg.ragged_weight_grad(a, b, offsets, tile)
    assert got.dtype == torch.bfloat16 and len(calls) == 2
    assert torch.equal(got, real(a, b, offsets, out=torch.empty_like(got), block_n=256, stages=3))
    gg.ragged_weight_grad(a.float(), b.float(), offsets, tile)
    assert len(calls) == 2


def test_tma_rows_counts_a_row_stride_in_bytes():
    """TMA needs 16-byte row strides: bf16 rows 8 elements apart qualify, e4m3 rows 8 bytes apart do not, nor a
    column-strided view."""
    assert gra.tma_rows(torch.zeros(4, 8, dtype=torch.bfloat16))
    assert not gra.tma_rows(torch.zeros(4, 8, dtype=torch.float8_e4m3fn))
    assert gra.tma_rows(torch.zeros(4, 16, dtype=torch.float8_e4m3fn))
    assert not gra.tma_rows(torch.zeros(4, 16, dtype=torch.bfloat16)[:, ::2])
