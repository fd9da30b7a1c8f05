"""Expert FFN kernels vs the torch reference: interpreter (fp32, CPU) and GPU (bf16)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig

SMALL_TILES = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)

# (rows per expert, hidden, ffn): empty experts, one expert taking everything, row counts that are
# not multiples of the row tile, hidden/ffn sizes that are not multiples of the blocks.
RAGGED_CASES = [
    ([5, 0, 37, 1], 40, 24),
    ([0, 0, 50, 0], 32, 16),
    ([17, 16, 0, 33, 2], 24, 40),
]


def _inputs(counts, hidden, ffn, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    experts, rows = len(counts), sum(counts)
    x = torch.randn(rows, hidden, generator=gen)
    w13 = torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), offsets.to(device), cast(w13), cast(w2)


def _rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.fixture
def kernels(interpreted):
    gg, moe_ffn = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.moe_ffn")
    return gg, moe_ffn


@pytest.mark.parametrize("case", range(len(RAGGED_CASES)))
def test_forward_writes_every_row_through_the_destination_map(kernels, case):
    gg, moe_ffn = kernels
    counts, hidden, ffn = RAGGED_CASES[case]
    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=case)
    rows = x.shape[0]
    dst_rows = torch.randperm(rows, generator=torch.Generator().manual_seed(case)).to(torch.int32)
    out = torch.full((rows, hidden), float("nan"))
    tiles = moe_ffn.FFNTiles.uniform(SMALL_TILES)
    y, act, h13 = moe_ffn.moe_ffn_forward(x, offsets, w13, w2, tiles, out=out, dst_rows_N=dst_rows,
                                          save_for_backward=True, num_programs=3)
    want = moe_ffn.expert_ffn_reference(x, offsets, w13, w2)
    assert torch.isfinite(y).all()
    assert _rel_err(y[dst_rows.long()], want) < 1e-5
    assert torch.isfinite(h13).all() and torch.isfinite(act).all()


@pytest.mark.parametrize("case", range(len(RAGGED_CASES)))
def test_forward_and_backward_match_reference(kernels, case):
    _, moe_ffn = kernels
    counts, hidden, ffn = RAGGED_CASES[case]
    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=10 + case)
    dy = torch.randn(x.shape[0], hidden, generator=torch.Generator().manual_seed(case))
    tiles = moe_ffn.FFNTiles.uniform(SMALL_TILES)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = moe_ffn.expert_ffn_triton(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles,
                                  num_programs=2 + case % 3)
    y.backward(dy)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y_ref = moe_ffn.expert_ffn_reference(ref_leaves[0], offsets, ref_leaves[1], ref_leaves[2])
    y_ref.backward(dy)
    assert _rel_err(y, y_ref) < 1e-5
    for got, want in zip(leaves, ref_leaves):
        assert torch.isfinite(got.grad).all()
        assert _rel_err(got.grad, want.grad) < 1e-5


def test_backward_kernels_write_every_element(kernels):
    gg, moe_ffn = kernels
    counts, hidden, ffn = [9, 0, 23], 20, 24
    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=7)
    rows = x.shape[0]
    h13 = torch.randn(rows, 2 * ffn, generator=torch.Generator().manual_seed(1))
    dy = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(2))
    dh13 = gg.ragged_rows_gemm(dy, offsets, w2.transpose(1, 2), SMALL_TILES,
                               epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13,
                               out=torch.full((rows, 2 * ffn), float("nan")), num_programs=2)
    gate, up = h13[:, :ffn].requires_grad_(), h13[:, ffn:].clone().requires_grad_()
    act_grad = torch.cat([dy[s:e] @ w2[i].T for i, (s, e) in
                          enumerate(zip([0, *offsets[:-1].tolist()], offsets.tolist()))])
    (torch.nn.functional.silu(gate) * up).backward(act_grad)
    assert _rel_err(dh13, torch.cat([gate.grad, up.grad], dim=1)) < 1e-5
    dw = gg.ragged_weight_grad(x, dh13, offsets, SMALL_TILES,
                               out=torch.full((3, hidden, 2 * ffn), float("nan")), num_programs=4)
    starts = [0, *offsets[:-1].tolist()]
    want = torch.stack([x[s:e].T @ dh13[s:e] for s, e in zip(starts, offsets.tolist())])
    assert torch.isfinite(dw).all() and (dw[1] == 0).all()
    assert _rel_err(dw, want) < 1e-5


@pytest.mark.parametrize("block_n, chunk", [(32, 8), (64, 16), (32, 32)], ids=["8-of-32", "16-of-64", "whole"])
@pytest.mark.parametrize("weighted", [False, True], ids=["plain", "row-scale"])
def test_swiglu_grad_epilogue_in_column_chunks_matches_reference(kernels, block_n, chunk, weighted):
    """The SwiGLU-gradient epilogue finishing its tile `epilogue_chunk` columns at a time (and the
    whole tile at once): d gate, d up and the recomputed SwiGLU output as the torch reference, the
    same bits whatever the chunk (the same arithmetic per element); with `row_scale` and gathered
    token rows, each column tile's row dots within fp32 rounding of the reference's. Ragged
    experts, an empty one, ffn not a multiple of the tile or the chunk."""
    import dataclasses

    gg, _ = kernels
    counts, hidden, ffn, tokens = [21, 0, 37, 1], 24, 40, 30
    rows = sum(counts)
    gen = torch.Generator().manual_seed(3)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    w2 = torch.randn(len(counts), ffn, hidden, generator=gen) / ffn**0.5
    h13 = torch.randn(rows, 2 * ffn, generator=gen)
    dy_TH, token_N = torch.randn(tokens, hidden, generator=gen), torch.randint(0, tokens, (rows,), generator=gen)
    scale_N = torch.rand(rows, generator=gen)
    tile = TileConfig(block_m=16, block_n=block_n, block_k=16, group_m=2, num_warps=4, num_stages=1)

    def run(config):
        out, act = torch.full((rows, 2 * ffn), float("nan")), torch.full((rows, ffn), float("nan"))
        kw = {}
        if weighted:
            kw = dict(a_rows_N=token_N, row_scale=(scale_N, torch.full((-(-ffn // block_n), rows), float("nan"))))
        gg.ragged_rows_gemm(dy_TH if weighted else dy_TH[token_N], offsets, w2.transpose(1, 2), config,
                            epilogue=gg.EPILOGUE_SWIGLU_GRAD, h13_N2C=h13, out=out, act_N_C=act, num_programs=3, **kw)
        return out, act, kw["row_scale"][1] if weighted else None

    out, act, rowdot = run(dataclasses.replace(tile, epilogue_chunk=chunk))
    whole = run(dataclasses.replace(tile, epilogue_chunk=block_n))
    assert torch.equal(out, whole[0]) and torch.equal(act, whole[1])
    starts = [0, *offsets[:-1].tolist()]
    prod = torch.cat([dy_TH[token_N[s:e]] @ w2[i].T for i, (s, e) in enumerate(zip(starts, offsets.tolist()))])
    gate, up = h13[:, :ffn].clone().requires_grad_(), h13[:, ffn:].clone().requires_grad_()
    y = torch.nn.functional.silu(gate) * up
    y.backward(prod * scale_N[:, None] if weighted else prod)
    assert _rel_err(out, torch.cat([gate.grad, up.grad], dim=1)) < 1e-5
    assert _rel_err(act, y.detach()) < 1e-6
    if weighted:
        dots = (prod * y.detach()).split(block_n, dim=1)
        assert _rel_err(rowdot, torch.stack([d.sum(dim=1) for d in dots])) < 1e-5
        assert _rel_err(rowdot, whole[2]) < 1e-6


# Banded rows (segment-major order, `fused_return.segment_major_order`): G = BANDS x E row groups,
# group g = b * E + e holding band b's rows of expert e. (rows per expert, hidden, ffn, seed)
BANDS = 3
BANDED_CASES = [
    ([5, 0, 37, 1], 40, 24, 0),
    ([19, 33, 0, 2, 16], 24, 40, 1),
    ([0, 50, 0], 32, 16, 2),
]


def _banded(counts, bands, gen):
    """(order_N, offsets_G): expert-grouped rows regrouped into (band, expert) groups, each row of
    expert e in one of a random subset of the bands (so some (band, expert) groups are empty)."""
    experts = len(counts)
    expert_N = torch.repeat_interleave(torch.arange(experts), torch.tensor(counts))
    allowed_EB = torch.rand(experts, bands, generator=gen) < 0.6
    allowed_EB[torch.arange(experts), torch.randint(bands, (experts,), generator=gen)] = True
    band_N = torch.empty_like(expert_N)
    for e in range(experts):
        rows, choices = (expert_N == e).nonzero().flatten(), allowed_EB[e].nonzero().flatten()
        band_N[rows] = choices[torch.randint(len(choices), (len(rows),), generator=gen)]
    group_N = band_N * experts + expert_N
    order_N = torch.sort(group_N, stable=True).indices
    counts_G = torch.bincount(group_N, minlength=bands * experts)
    assert (counts_G == 0).any(), "the case has empty groups"
    return order_N, counts_G.cumsum(0).to(torch.int32)


def _ragged_offsets(counts, banded, gen):
    """int32 cumulative row counts: one group per expert, or `_banded`'s (band, expert) groups."""
    if banded:
        return _banded(counts, BANDS, gen)[1]
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _weight_grad_reference(a_NK, b_NC, offsets_G, experts):
    """Plain torch, group by group: out[e] = sum over g = e mod E of a[rows_g]^T @ b[rows_g]."""
    out = a_NK.new_zeros((experts, a_NK.shape[1], b_NC.shape[1]))
    ends = offsets_G.tolist()
    for g, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        out[g % experts] += a_NK[start:end].T @ b_NC[start:end]
    return out


@pytest.mark.parametrize("case", range(len(BANDED_CASES)))
def test_banded_weight_grad_sums_every_group_of_a_weight(kernels, case):
    """G = 3 x E row groups, group g to weight g mod E: out [E, K, C], every element written
    (NaN-filled first), zeros for the expert with no rows; with `accumulate`, added in place."""
    gg, _ = kernels
    counts, k, c, seed = BANDED_CASES[case]
    gen = torch.Generator().manual_seed(20 + seed)
    experts, rows = len(counts), sum(counts)
    _, offsets_G = _banded(counts, BANDS, gen)
    a, b = torch.randn(rows, k, generator=gen), torch.randn(rows, c, generator=gen)
    want = _weight_grad_reference(a, b, offsets_G, experts)
    out = torch.full((experts, k, c), float("nan"))
    got = gg.ragged_weight_grad(a, b, offsets_G, SMALL_TILES, out=out, weights=experts, num_programs=3)
    assert got is out and torch.isfinite(got).all()
    assert _rel_err(got, want) < 1e-5
    assert all((got[e] == 0).all() for e in range(experts) if counts[e] == 0)
    start = torch.randn(experts, k, c, generator=gen)
    main = start.clone()
    gg.ragged_weight_grad(a, b, offsets_G, SMALL_TILES, out=main, accumulate=True, weights=experts, num_programs=4)
    assert _rel_err(main - start, want) < 1e-5
    with pytest.raises(AssertionError):
        gg.ragged_weight_grad(a, b, offsets_G[:-1], SMALL_TILES, weights=experts)  # not a multiple of E


@pytest.mark.parametrize("banded", [False, True], ids=["one-group-per-expert", "banded"])
@pytest.mark.parametrize("seed", [0, 1])
def test_atomic_accumulation_is_the_load_add_store_sum_bit_for_bit(kernels, banded, seed):
    """`TileConfig.atomic_accumulate`: weight gradients added into an fp32 main gradient with fp32
    atomics give the very bits of the load, add and store (in the interpreter; the GPU's reduction
    also flushes denormals, which these values never are), for random ragged counts with empty
    experts, one group per expert or banded; a bf16 output, or no accumulation, ignores the flag."""
    gg, _ = kernels
    gen = torch.Generator().manual_seed(40 + seed)
    experts = int(torch.randint(2, 6, (1,), generator=gen))
    counts = [0 if i % 3 == 1 else int(torch.randint(1, 40, (1,), generator=gen)) for i in range(experts)]
    k, c = (int(v) for v in torch.randint(5, 50, (2,), generator=gen))
    rows = sum(counts)
    offsets = _ragged_offsets(counts, banded, gen)
    a, b = torch.randn(rows, k, generator=gen), torch.randn(rows, c, generator=gen)
    start = torch.randn(experts, k, c, generator=gen)
    plain, atomic = start.clone(), start.clone()
    atomic_tiles = dataclasses.replace(SMALL_TILES, atomic_accumulate=True)
    gg.ragged_weight_grad(a, b, offsets, SMALL_TILES, out=plain, accumulate=True, weights=experts, num_programs=3)
    gg.ragged_weight_grad(a, b, offsets, atomic_tiles, out=atomic, accumulate=True, weights=experts, num_programs=3)
    assert torch.equal(plain, atomic)
    assert _rel_err(plain - start, _weight_grad_reference(a, b, offsets, experts)) < 1e-5
    fresh = gg.ragged_weight_grad(a, b, offsets, atomic_tiles, out=torch.full_like(start, float("nan")),
                                  weights=experts, num_programs=2)  # no accumulation: stored
    assert torch.isfinite(fresh).all() and _rel_err(fresh, plain - start) < 1e-5
    half, half_atomic = start.bfloat16(), start.bfloat16()  # a bf16 output: loaded, added and stored either way
    gg.ragged_weight_grad(a, b, offsets, SMALL_TILES, out=half, accumulate=True, weights=experts, num_programs=3)
    gg.ragged_weight_grad(a, b, offsets, atomic_tiles, out=half_atomic, accumulate=True, weights=experts,
                          num_programs=3)
    assert torch.equal(half, half_atomic)


@pytest.mark.parametrize("banded", [False, True], ids=["one-group-per-expert", "banded"])
@pytest.mark.parametrize("seed", [0, 1])
def test_a_prefetched_main_gradient_gives_the_load_add_store_sum_bit_for_bit(kernels, banded, seed):
    """`TileConfig.prefetch_accumulator`: each tile's main-gradient values loaded before its row loop
    give the very bits of loading them after it, fp32 and bf16 outputs, pointer and TMA row loads, for
    random ragged counts with empty experts, one group per expert or banded; a launch that does not
    accumulate (stored) or adds atomically ignores it."""
    gg, _ = kernels
    gen = torch.Generator().manual_seed(70 + seed)
    experts = int(torch.randint(2, 6, (1,), generator=gen))
    counts = [0 if i % 3 == 1 else int(torch.randint(1, 40, (1,), generator=gen)) for i in range(experts)]
    k, c = (4 * int(v) for v in torch.randint(2, 12, (2,), generator=gen))
    offsets = _ragged_offsets(counts, banded, gen)
    a, b = torch.randn(sum(counts), k, generator=gen), torch.randn(sum(counts), c, generator=gen)
    start = torch.randn(experts, k, c, generator=gen)
    prefetch = dataclasses.replace(SMALL_TILES, prefetch_accumulator=True)
    for dtype in (torch.float32, torch.bfloat16):
        for tma in (False, True):
            plain, early = start.to(dtype).clone(), start.to(dtype).clone()  # (.to of the same dtype: start itself)
            gg.ragged_weight_grad(a, b, offsets, dataclasses.replace(SMALL_TILES, tma=tma), out=plain,
                                  accumulate=True, weights=experts, num_programs=3)
            gg.ragged_weight_grad(a, b, offsets, dataclasses.replace(prefetch, tma=tma), out=early,
                                  accumulate=True, weights=experts, num_programs=3)
            assert torch.equal(plain, early), (dtype, tma)
    want = _weight_grad_reference(a, b, offsets, experts)
    assert _rel_err(plain.float() - start, want) < 1e-1  # bf16 output: the sum rounded once per element
    fresh = gg.ragged_weight_grad(a, b, offsets, prefetch, out=torch.full_like(start, float("nan")),
                                  weights=experts, num_programs=2)  # not accumulating: nothing prefetched
    assert torch.isfinite(fresh).all() and _rel_err(fresh, want) < 1e-5
    atomic = start.clone()
    gg.ragged_weight_grad(a, b, offsets, dataclasses.replace(prefetch, atomic_accumulate=True), out=atomic,
                          accumulate=True, weights=experts, num_programs=3)
    assert _rel_err(atomic - start, want) < 1e-5


@pytest.mark.parametrize("banded", [False, True], ids=["one-group-per-expert", "banded"])
@pytest.mark.parametrize("seed", [0, 1])
def test_tma_loads_give_the_pointer_loads_weight_gradient(kernels, banded, seed):
    """`TileConfig.tma`: the whole row steps loaded through TensorDescriptors and each row group's last
    partial step through masked pointers give the pointer-only kernel's bits (the same products summed
    in the same order), for random ragged counts with empty experts and groups both shorter and longer
    than the row step, K and C not multiples of their tiles, plain, accumulated and atomic; an operand
    TMA cannot take (a row stride off 16 bytes) falls back to pointer loads with the same result."""
    gg, _ = kernels
    gen = torch.Generator().manual_seed(60 + seed)
    experts = int(torch.randint(2, 6, (1,), generator=gen))
    counts = [0 if i % 3 == 1 else int(torch.randint(1, 60, (1,), generator=gen)) for i in range(experts)]
    k, c = (4 * int(v) for v in torch.randint(3, 12, (2,), generator=gen))  # rows of 16-byte multiples
    rows = sum(counts)
    offsets = _ragged_offsets(counts, banded, gen)
    a, b = torch.randn(rows, k, generator=gen), torch.randn(rows, c, generator=gen)
    assert gg.tma_takes(a) and gg.tma_takes(b)
    tma = dataclasses.replace(SMALL_TILES, tma=True)
    want = _weight_grad_reference(a, b, offsets, experts)
    for tiles in (SMALL_TILES, dataclasses.replace(SMALL_TILES, atomic_accumulate=True)):
        start = torch.randn(experts, k, c, generator=gen)
        plain, loaded = start.clone(), start.clone()
        gg.ragged_weight_grad(a, b, offsets, tiles, out=plain, accumulate=True, weights=experts, num_programs=3)
        gg.ragged_weight_grad(a, b, offsets, dataclasses.replace(tiles, tma=True), out=loaded, accumulate=True,
                              weights=experts, num_programs=3)
        assert torch.equal(plain, loaded)
        assert _rel_err(loaded - start, want) < 1e-5
    fresh = gg.ragged_weight_grad(a, b, offsets, tma, out=torch.full((experts, k, c), float("nan")),
                                  weights=experts, num_programs=2)
    assert torch.isfinite(fresh).all() and _rel_err(fresh, want) < 1e-5
    assert all((fresh[e] == 0).all() for e in range(experts) if counts[e] == 0)
    wide = torch.randn(rows, k + 1, generator=gen)
    strided = wide[:, :k]  # a row stride of k + 1 fp32: not 16-byte aligned
    assert not gg.tma_takes(strided)
    fallback = gg.ragged_weight_grad(strided, b, offsets, tma, weights=experts, num_programs=2)
    assert torch.equal(fallback, gg.ragged_weight_grad(strided, b, offsets, SMALL_TILES, weights=experts,
                                                       num_programs=2))
    no_rows = torch.zeros(experts, dtype=torch.int32)  # every expert empty: zeros, through pointers (no descriptor)
    assert not gg.tma_takes(a[:0])
    empty = gg.ragged_weight_grad(a[:0], b[:0], no_rows, tma, out=torch.full((experts, k, c), float("nan")),
                                  num_programs=2)
    assert (empty == 0).all()


@pytest.mark.parametrize("banded", [False, True], ids=["one-group-per-expert", "banded"])
@pytest.mark.parametrize("seed", [0, 1])
def test_tma_stores_give_the_pointer_stores_weight_gradient(kernels, banded, seed):
    """`TileConfig.tma_store` in the weight gradient (`weight_grad_store_descriptor`, out as [E x K, C] rows): the
    reduce-add under `atomic_accumulate`, the stored sum otherwise (accumulated, prefetched, or a fresh gradient),
    each tile by TMA, give the pointer epilogues' bits, for random ragged counts with empty experts and C off the
    column tile (the box clipped at C); a K off the K tile keeps the pointer stores (a box would reach the next
    weight's rows), the same bits."""
    gg, _ = kernels
    gen = torch.Generator().manual_seed(70 + seed)
    experts = int(torch.randint(2, 6, (1,), generator=gen))
    counts = [0 if i % 3 == 1 else int(torch.randint(1, 60, (1,), generator=gen)) for i in range(experts)]
    rows = sum(counts)
    offsets = _ragged_offsets(counts, banded, gen)
    for k in (16 * int(torch.randint(1, 4, (1,), generator=gen)), 20):  # whole K tiles, then K off them
        c = 4 * int(torch.randint(3, 12, (1,), generator=gen))
        a, b = torch.randn(rows, k, generator=gen), torch.randn(rows, c, generator=gen)
        out = torch.empty(experts, k, c)
        assert (gg.weight_grad_store_descriptor(out, dataclasses.replace(SMALL_TILES, tma_store=True), banded)
                is None) == (k % SMALL_TILES.block_k != 0)
        for tiles in (SMALL_TILES, dataclasses.replace(SMALL_TILES, atomic_accumulate=True),
                      dataclasses.replace(SMALL_TILES, prefetch_accumulator=True), dataclasses.replace(SMALL_TILES, tma=True)):
            start = torch.randn(experts, k, c, generator=gen)
            by_pointers, by_tma = start.clone(), start.clone()
            gg.ragged_weight_grad(a, b, offsets, tiles, out=by_pointers, accumulate=True, weights=experts,
                                  num_programs=3)
            gg.ragged_weight_grad(a, b, offsets, dataclasses.replace(tiles, tma_store=True), out=by_tma,
                                  accumulate=True, weights=experts, num_programs=3)
            assert torch.equal(by_pointers, by_tma), tiles
        fresh = [gg.ragged_weight_grad(a, b, offsets, dataclasses.replace(SMALL_TILES, tma_store=store),
                                       out=torch.full((experts, k, c), float("nan")), weights=experts, num_programs=2)
                 for store in (False, True)]
        assert torch.isfinite(fresh[1]).all() and torch.equal(*fresh)


@pytest.mark.parametrize("counts,hidden,ffn", [
    ([5, 0, 37, 1], 32, 48), ([0, 50, 0], 64, 16),
    pytest.param([17, 16, 0, 33, 2], 48, 40, marks=pytest.mark.slow)],  # 6.5 s on 2 cores
    ids=["ragged", "one-expert", "k-off-the-tile"])
def test_tma_row_gemms_give_the_pointer_loads_ffn(kernels, counts, hidden, ffn):
    """`TileConfig.tma` in the row GEMMs (`rows_gemm_descriptors`): the gate/up SwiGLU launch and the down
    launch (weights as [E x K, width] rows), the down data gradient with its SwiGLU-gradient epilogue and
    the gate/up data gradient (transposed weights, boxes transposed in shared memory), then the weight
    gradients: the forward, dx, dw13 and dw2 are the pointer-loading FFN's very bits, for ragged counts
    with empty experts (a box's rows past its group and columns past C reach only masked outputs); a K
    off the tile (ffn 40 against 16-wide K tiles) loads the down GEMM through pointers, the same bits."""
    gg, moe_ffn = kernels
    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=len(counts))
    dy = torch.randn(x.shape[0], hidden, generator=torch.Generator().manual_seed(9))
    tma = dataclasses.replace(SMALL_TILES, tma=True)
    assert gg.rows_gemm_descriptors(x, w13, tma)[2:] == (hidden, False)
    assert gg.rows_gemm_descriptors(dy, w2.transpose(1, 2), tma)[2:] == (ffn, True)
    assert gg.rows_gemm_descriptors(x, w13, SMALL_TILES) is None
    results = []
    for tiles in (SMALL_TILES, tma):
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
        y = moe_ffn.expert_ffn_triton(leaves[0], offsets, leaves[1], leaves[2], tiles=moe_ffn.FFNTiles.uniform(tiles),
                                      num_programs=3)
        y.backward(dy)
        results.append([y.detach(), *(leaf.grad for leaf in leaves)])
    for pointers, loaded in zip(*results):
        assert torch.equal(pointers, loaded)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y_ref = moe_ffn.expert_ffn_reference(ref_leaves[0], offsets, ref_leaves[1], ref_leaves[2])
    y_ref.backward(dy)
    assert _rel_err(results[1][0], y_ref) < 1e-5
    assert all(_rel_err(got, leaf.grad) < 1e-5 for got, leaf in zip(results[1][1:], ref_leaves))


@pytest.mark.parametrize("counts,hidden,ffn", [
    ([32, 0, 37, 16], 32, 48), ([0, 48, 0], 64, 16),
    pytest.param([17, 16, 0, 33, 2], 48, 40, marks=pytest.mark.slow)],
    ids=["full-and-partial-tiles", "one-expert-whole-tiles", "ffn-off-the-column-tile"])
def test_tma_stores_give_the_masked_stores_ffn(kernels, counts, hidden, ffn):
    """`TileConfig.tma_store` (`rows_store_descriptors`): the gate/up SwiGLU launch (act and both pre-activations by
    TMA), the down launch, the down data gradient's split plain GEMM and the gate/up data gradient store their
    tiles wholly inside a group by TMA and a group's last partial tile through masked pointers: the forward, dx,
    dw13 and dw2 are the masked stores' very bits, with the outputs' rows never written by either left as they were
    (NaN-filled before); an ffn off the 16-column tile (40) keeps the SwiGLU launch on masked stores."""
    gg, moe_ffn = kernels
    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=len(counts) + 40)
    dy = torch.randn(x.shape[0], hidden, generator=torch.Generator().manual_seed(19))
    stored = dataclasses.replace(SMALL_TILES, tma=True, tma_store=True)
    h13 = torch.empty(x.shape[0], 2 * ffn)
    assert (gg.rows_store_descriptors(x, h13, ffn, stored) is None) == (ffn % stored.block_n != 0)
    assert gg.rows_store_descriptors(x, h13, ffn, SMALL_TILES) is None
    assert gg.rows_store_descriptors(x, None, hidden, dataclasses.replace(stored, flatten=True)) is None
    results = []
    for tiles in (dataclasses.replace(SMALL_TILES, tma=True), stored):
        ffn_tiles = dataclasses.replace(moe_ffn.FFNTiles.uniform(tiles),
                                        down_dgrad=dataclasses.replace(tiles, split_epilogue=True))
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
        y = moe_ffn.expert_ffn_triton(leaves[0], offsets, leaves[1], leaves[2], tiles=ffn_tiles, num_programs=3)
        y.backward(dy)
        pre = torch.full((x.shape[0], 2 * ffn), float("nan"))
        act = gg.ragged_rows_gemm(x, offsets, w13, tiles, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=pre,
                                  out=torch.full((x.shape[0], ffn), float("nan")), num_programs=2)
        results.append([y.detach(), *(leaf.grad for leaf in leaves), act, pre])
    for masked, by_tma in zip(*results):
        assert torch.isfinite(by_tma).all() and torch.equal(masked, by_tma)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y_ref = moe_ffn.expert_ffn_reference(ref_leaves[0], offsets, ref_leaves[1], ref_leaves[2])
    y_ref.backward(dy)
    assert _rel_err(results[1][0], y_ref) < 1e-5


def test_row_dots_keep_pointer_loads_under_tma(kernels):
    """`row_scale` (the SwiGLU-gradient epilogue's row dots sum the tile's columns) keeps a TMA tile on
    pointer loads: a box past C would read the next weight's rows, and an inf there (expert 1 has no
    rows here) would make expert 0's row dots NaN. They equal the pointer tile's bits."""
    gg, _ = kernels
    counts, hidden, ffn = [20, 0], 32, 40  # ffn off the 16-column tile: the last box reaches expert 1
    rows = sum(counts)
    gen = torch.Generator().manual_seed(8)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    w2 = torch.randn(2, ffn, hidden, generator=gen)
    w2[1] = float("inf")
    h13, dy = torch.randn(rows, 2 * ffn, generator=gen), torch.randn(rows, hidden, generator=gen)
    scale = torch.rand(rows, generator=gen)
    got = []
    for tiles in (SMALL_TILES, dataclasses.replace(SMALL_TILES, tma=True)):
        rowdot = torch.full((-(-ffn // SMALL_TILES.block_n), rows), float("nan"))
        out = gg.ragged_rows_gemm(dy, offsets, w2.transpose(1, 2), tiles, epilogue=gg.EPILOGUE_SWIGLU_GRAD,
                                  h13_N2C=h13, row_scale=(scale, rowdot), num_programs=2)
        got.append((out, rowdot))
    assert torch.isfinite(got[1][1]).all() and torch.isfinite(got[1][0]).all()
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


def test_tma_row_gemms_over_banded_groups_give_the_pointer_loads_bits(kernels):
    """`TileConfig.tma` in the row GEMMs over G = 3 x E row groups (group g multiplies by weight g mod E,
    the fused return's segment-major order; some groups empty): the SwiGLU launch, the down launch with
    its rows scattered, and the transposed-weight data gradient give the pointer loads' bits."""
    gg, _ = kernels
    counts, hidden, ffn = [9, 0, 30, 5], 32, 48
    gen = torch.Generator().manual_seed(31)
    order, offsets_G = _banded(counts, BANDS, gen)
    x, _, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=31)
    x = x[order]
    dst = torch.randperm(x.shape[0], generator=gen).to(torch.int32)
    tma = dataclasses.replace(SMALL_TILES, tma=True)
    got = []
    for tiles in (SMALL_TILES, tma):
        h13 = torch.full((x.shape[0], 2 * ffn), float("nan"))
        act = gg.ragged_rows_gemm(x, offsets_G, w13, tiles, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13, num_programs=3)
        y = gg.ragged_rows_gemm(act, offsets_G, w2, tiles, out=torch.full_like(x, float("nan")), dst_rows_N=dst,
                                num_programs=3)
        dact = gg.ragged_rows_gemm(y, offsets_G, w2.transpose(1, 2), tiles, num_programs=2)
        got.append((act, h13, y, dact))
    for pointers, loaded in zip(*got):
        assert torch.isfinite(loaded).all() and torch.equal(pointers, loaded)


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
@pytest.mark.parametrize("case", range(len(BANDED_CASES)))
@pytest.mark.parametrize("main", [False, True], ids=["returned", "main-grads"])
def test_ffn_over_banded_groups_matches_expert_order(kernels, case, main):
    """moe_ffn_forward + moe_ffn_backward over G = 3 x E groups (each expert's rows split over 3
    bands, some bands empty, one expert with no rows) give the same rows' y and dx as autograd
    through the reference in expert order, and the same weight gradients (returned, or added
    into fp32 main gradients)."""
    _, moe_ffn = kernels
    counts, hidden, ffn, seed = BANDED_CASES[case]
    gen = torch.Generator().manual_seed(30 + seed)
    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=40 + seed)
    dy = torch.randn(x.shape[0], hidden, generator=gen)
    order, offsets_G = _banded(counts, BANDS, gen)
    tiles = moe_ffn.FFNTiles.uniform(SMALL_TILES)
    y, act, h13 = moe_ffn.moe_ffn_forward(x[order], offsets_G, w13, w2, tiles, save_for_backward=True,
                                          num_programs=3)
    start13, start2 = torch.randn(w13.shape, generator=gen), torch.randn(w2.shape, generator=gen)
    main_grads = (start13.clone(), start2.clone()) if main else (None, None)
    dx, dw13, dw2 = moe_ffn.moe_ffn_backward(dy[order], x[order], offsets_G, w13, w2, act, h13, tiles,
                                            num_programs=3, main_grads=main_grads)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y_ref = moe_ffn.expert_ffn_reference(leaves[0], offsets, leaves[1], leaves[2])
    y_ref.backward(dy)
    assert _rel_err(y, y_ref[order]) < 1e-5
    assert _rel_err(dx, leaves[0].grad[order]) < 1e-5
    if main:
        assert dw13 is None and dw2 is None
        dw13, dw2 = main_grads[0] - start13, main_grads[1] - start2
    assert dw13.shape == w13.shape and dw2.shape == w2.shape
    assert _rel_err(dw13, leaves[1].grad) < 1e-5 and _rel_err(dw2, leaves[2].grad) < 1e-5
    empty = [e for e, n in enumerate(counts) if n == 0]
    assert empty and all(not dw13[e].any() and not dw2[e].any() for e in empty)


def test_rejects_mismatched_weights(kernels):
    _, moe_ffn = kernels
    x, offsets, w13, w2 = _inputs([3, 4], 16, 16, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="w2"):
        moe_ffn.expert_ffn_triton(x, offsets, w13, w2.transpose(1, 2).contiguous()[:, :, :8])
    with pytest.raises(ValueError, match="int32"):
        moe_ffn.expert_ffn_triton(x, offsets.long(), w13, w2)


# GPU tiles: the launch's own choice (tuned or heuristic), and the pipelining variants the tuner may
# pick (two programs per SM; the work-list loop flattened into the reduction loop).
GPU_TILES = [None, TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3,
                              programs_per_sm=2, flatten=True)]


@pytest.mark.gpu
@pytest.mark.parametrize("tile", GPU_TILES, ids=["default", "flattened"])
@pytest.mark.parametrize("counts,hidden,ffn", [([300, 0, 1000, 7], 512, 384),
                                                ([0, 2000, 0, 0], 384, 256),
                                                ([129, 511, 64, 3, 900], 1024, 320)])
def test_gpu_bf16_forward_backward(counts, hidden, ffn, tile):
    from disagmoe.kernels import moe_ffn

    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.bfloat16, "cuda", seed=3)
    dy = torch.randn_like(x)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    tiles = moe_ffn.FFNTiles.uniform(tile) if tile else None
    y = moe_ffn.expert_ffn_triton(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles)
    y.backward(dy)
    ref_leaves = [t.float().clone().requires_grad_() for t in (x, w13, w2)]
    y_ref = moe_ffn.expert_ffn_reference(ref_leaves[0], offsets, ref_leaves[1], ref_leaves[2])
    y_ref.backward(dy.float())
    assert _rel_err(y, y_ref) < 1e-2
    for got, want in zip(leaves, ref_leaves):
        assert _rel_err(got.grad, want.grad) < 1e-2


@pytest.mark.gpu
@pytest.mark.parametrize("counts,hidden,ffn", [([300, 0, 1000, 7], 512, 384), ([129, 511, 64, 3, 900], 1024, 320)])
def test_gpu_tma_row_gemms_give_the_pointer_loads_ffn(counts, hidden, ffn):
    """`TileConfig.tma` in every GEMM of the bf16 FFN on the GPU (the row GEMMs' descriptors, weights as rows
    and transposed; the weight gradients'), at the heuristic tiles: the forward and the three gradients are
    the pointer-loading FFN's very bits, for ragged counts with an empty expert."""
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels import moe_ffn
    from disagmoe.kernels.tile_configs import heuristic

    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.bfloat16, "cuda", seed=4)
    dy = torch.randn_like(x)
    assert gg.rows_gemm_descriptors(x, w13, dataclasses.replace(heuristic("gate_up"), tma=True)) is not None
    results = []
    for tma in (False, True):
        tiles = moe_ffn.FFNTiles(**{role: dataclasses.replace(heuristic(role), tma=tma)
                                    for role in ("gate_up", "down", "down_dgrad", "gate_up_dgrad", "wgrad_w2",
                                                 "wgrad_w13")})
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
        y = moe_ffn.expert_ffn_triton(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles)
        y.backward(dy)
        results.append([y.detach(), *(leaf.grad for leaf in leaves)])
    torch.cuda.synchronize()
    for pointers, loaded in zip(*results):
        assert torch.equal(pointers, loaded)


@pytest.mark.gpu
@pytest.mark.parametrize("counts,hidden,ffn", [([256, 0, 1024, 130], 512, 384), ([129, 511, 64, 3, 900], 1024, 256)])
def test_gpu_tma_stores_give_the_masked_stores_ffn(counts, hidden, ffn):
    """`TileConfig.tma_store` on the GPU at every tile the tuner offers it on: each launch's outputs, written into
    NaN-filled tensors (so a box that never lands, or lands elsewhere, shows), equal the masked stores' bits: the
    gate/up SwiGLU launch (act and both pre-activations), the down launch, the gate/up data gradient and down dgrad's
    split plain GEMM; then the whole FFN's forward and three gradients (bf16; counts of whole 128-row tiles,
    partial ones and an empty expert)."""
    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels import moe_ffn

    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.bfloat16, "cuda", seed=6)
    dy = torch.randn_like(x)
    rows = x.shape[0]
    nan = lambda *shape: torch.full(shape, float("nan"), device="cuda", dtype=torch.bfloat16)  # noqa: E731
    act_in, dh13 = torch.randn(rows, ffn, device="cuda").bfloat16(), torch.randn(rows, 2 * ffn, device="cuda").bfloat16()
    launches = {
        "gate_up": lambda c: (lambda out, h13: (gg.ragged_rows_gemm(x, offsets, w13, c, epilogue=gg.EPILOGUE_SWIGLU,
                                                                    h13_N2C=h13, out=out), h13))(nan(rows, ffn),
                                                                                                 nan(rows, 2 * ffn)),
        "down": lambda c: (gg.ragged_rows_gemm(act_in, offsets, w2, c, out=nan(rows, hidden)),),
        "down_dgrad": lambda c: (gg.ragged_rows_gemm(dy, offsets, w2.transpose(1, 2),
                                                     dataclasses.replace(c, split_epilogue=False),
                                                     out=nan(rows, ffn)),),
        "gate_up_dgrad": lambda c: (gg.ragged_rows_gemm(dh13, offsets, w13.transpose(1, 2), c,
                                                        out=nan(rows, hidden)),),
    }
    stored = {role: [t for t in tuner.candidates(role) if t.tma_store] for role in launches}
    for role, tiles in stored.items():
        for tile in tiles:
            masked = launches[role](dataclasses.replace(tile, tma_store=False))  # kept alive: the next launch's
            by_tma = launches[role](tile)  # NaN-filled outputs cannot be the blocks it holds
            for want, got in zip(masked, by_tma):
                assert torch.isfinite(got).all() and torch.equal(want, got), (role, tile)
    for i in range(max(len(tiles) for tiles in stored.values())):
        picks = {role: tiles[i % len(tiles)] for role, tiles in stored.items()}
        results = []
        for tma_store in (False, True):
            tiles = moe_ffn.FFNTiles(**{role: dataclasses.replace(tile, tma_store=tma_store)
                                        for role, tile in picks.items()},
                                     wgrad_w2=tuner.heuristic("wgrad_w2"), wgrad_w13=tuner.heuristic("wgrad_w13"))
            leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
            y = moe_ffn.expert_ffn_triton(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles)
            y.backward(dy)
            results.append([y.detach(), *(leaf.grad for leaf in leaves)])
        torch.cuda.synchronize()
        for masked, by_tma in zip(*results):
            assert torch.equal(masked, by_tma), picks


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["one-set", "paired", "banded"])
def test_gpu_weight_gradients_written_by_tma_give_the_pointer_epilogues_bits(case):
    """`TileConfig.tma_store` in the bf16 weight gradient on the GPU, at every tile the tuner offers it on: each
    tile's halves reduce-added into the fp32 main gradient by TMA give the relaxed atomics' bits (one writer per
    element; both flush denormals); a first touch (`accumulate=False`: the step's first launch into each main
    gradient) and the load-add-store epilogue store by TMA, into NaN-filled and random gradients, the pointer
    stores' bits. Ragged counts with an empty expert, C off the 128- and 256-column tiles (clipped by the box), one
    row set, two (`second`), or banded groups."""
    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg

    gen = torch.Generator(device="cuda").manual_seed(11)
    counts, k, c = [300, 0, 1024, 129], 512, 700
    experts = len(counts)
    if case == "banded":  # 3 row groups a weight, some empty
        counts = counts + [0, 77, 5, 0] + [13, 0, 400, 2]
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    rows = sum(counts)
    a, b = (torch.randn(rows, n, device="cuda", generator=gen).bfloat16() for n in (k, c))
    second = (torch.randn(rows, k, device="cuda", generator=gen).bfloat16(),
              torch.randn(rows, c, device="cuda", generator=gen).bfloat16(), offsets) if case == "paired" else None
    start = torch.randn(experts, k, c, device="cuda", generator=gen)
    for tile in (t for t in tuner.candidates("wgrad_w13") if t.tma_store):
        assert gg.weight_grad_store_descriptor(start, tile, banded=case == "banded") is not None
        for variant, accumulate, begin in ((tile, True, start), (tile, False, torch.full_like(start, float("nan"))),
                                           (dataclasses.replace(tile, atomic_accumulate=False), True, start)):
            results = []
            for store in (False, True):
                out = begin.clone()
                gg.ragged_weight_grad(a, b, offsets, dataclasses.replace(variant, tma_store=store), out=out,
                                      accumulate=accumulate, weights=experts, second=second)
                results.append(out)
            torch.cuda.synchronize()
            assert torch.isfinite(results[1]).all() and torch.equal(*results), (variant, accumulate)


@pytest.mark.gpu
def test_gpu_fp32_and_autocast_with_fp32_master_weights():
    """The two ways a trainer calls the backend on a GPU: plain fp32 (tiles sized for 4-byte
    operands), and bf16 autocast over fp32 parameters (operands cast, fp32 weight grads)."""
    from disagmoe.kernels import moe_ffn

    x, offsets, w13, w2 = _inputs([64, 0, 200, 17], 64, 32, torch.float32, "cuda", seed=5)
    y = moe_ffn.expert_ffn_triton(x, offsets, w13, w2)
    # fp32 operands go through Triton's default tf32 dot: 2.3e-3 measured on an H200
    assert _rel_err(y, moe_ffn.expert_ffn_reference(x, offsets, w13, w2)) < 5e-3

    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        y = moe_ffn.expert_ffn_triton(leaves[0], offsets, leaves[1], leaves[2])
    assert y.dtype == torch.bfloat16
    dy = torch.randn_like(y)
    y.backward(dy)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    moe_ffn.expert_ffn_reference(ref_leaves[0], offsets, ref_leaves[1], ref_leaves[2]).backward(dy.float())
    for got, want in zip(leaves, ref_leaves):
        assert got.grad.dtype == torch.float32
        assert _rel_err(got.grad, want.grad) < 2e-2


def test_mixed_dtypes_outside_autocast_are_refused(kernels):
    _, moe_ffn = kernels
    x, offsets, w13, w2 = _inputs([3, 4], 16, 16, torch.float32, "cpu", seed=0)
    with pytest.raises(ValueError, match="autocast"):
        moe_ffn.expert_ffn_triton(x.double(), offsets, w13, w2)


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
@pytest.mark.parametrize("case", range(len(RAGGED_CASES)))
def test_weight_gradients_add_into_main_gradients(kernels, case):
    """With FlatAdamW's `main_grad` on the weight parameters, the weight-gradient GEMMs add into
    those fp32 buffers (two micro-batches: twice) and autograd gets no weight gradient."""
    gg, moe_ffn = kernels
    counts, hidden, ffn = RAGGED_CASES[case]
    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=10 + case)
    w13, w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    start13, start2 = torch.randn(w13.shape), torch.randn(w2.shape)
    w13.main_grad, w2.main_grad = start13.clone(), start2.clone()
    tiles = moe_ffn.FFNTiles.uniform(SMALL_TILES)
    dy = torch.randn(x.shape[0], hidden, generator=torch.Generator().manual_seed(case))
    for _ in range(2):
        y = moe_ffn.ExpertFFNFunction.apply(x, offsets, w13, w2, tiles, 3)
        y.backward(dy)
    assert w13.grad is None and w2.grad is None
    r13, r2 = w13.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    moe_ffn.expert_ffn_reference(x, offsets, r13, r2).backward(dy)
    assert _rel_err(w13.main_grad - start13, 2 * r13.grad) < 1e-5
    assert _rel_err(w2.main_grad - start2, 2 * r2.grad) < 1e-5


def test_deferred_weight_gradients_wait_for_their_launch(kernels):
    """Inside deferred_weight_grads the backward leaves the main gradients alone and returns the
    weight-gradient launches; running them adds exactly what the undeferred backward adds."""
    from disagmoe.kernels.deferral import deferred_weight_grads

    gg, moe_ffn = kernels
    counts, hidden, ffn = RAGGED_CASES[0]
    x, offsets, w13, w2 = _inputs(counts, hidden, ffn, torch.float32, "cpu", seed=7)
    w13, w2 = torch.nn.Parameter(w13), torch.nn.Parameter(w2)
    w13.main_grad, w2.main_grad = torch.zeros(w13.shape), torch.zeros(w2.shape)
    tiles = moe_ffn.FFNTiles.uniform(SMALL_TILES)
    xl = x.clone().requires_grad_()
    with deferred_weight_grads() as pending:
        moe_ffn.ExpertFFNFunction.apply(xl, offsets, w13, w2, tiles, 3).sum().backward()
    assert len(pending) == 1 and xl.grad is not None
    assert not w13.main_grad.any() and not w2.main_grad.any()
    for launch in pending:
        launch()
    r13, r2 = w13.detach().clone().requires_grad_(), w2.detach().clone().requires_grad_()
    moe_ffn.expert_ffn_reference(x, offsets, r13, r2).sum().backward()
    assert _rel_err(w13.main_grad, r13.grad) < 1e-5 and _rel_err(w2.main_grad, r2.grad) < 1e-5


def test_the_expert_stage_holds_back_a_triton_blocks_weight_gradients(kernels):
    """`deferred_weight_grads` around a local expert block's backward (FlatAdamW's fp32 main
    gradients, the triton backend): input gradients at once, weight gradients when run."""
    from disagmoe.config import OptimConfig
    from disagmoe.model.experts import RoutedExperts
    from disagmoe.kernels.deferral import deferred_weight_grads
    from disagmoe.model.local_experts import local_expert_block
    from disagmoe.runtime.state.flat_adamw import FlatAdamW

    g = torch.Generator().manual_seed(3)
    experts = RoutedExperts(3, 16, 24, backend="triton")
    experts.init_weights(3, "e", std=0.3)
    flat = FlatAdamW(experts.named_parameters(), OptimConfig(), torch.float32)
    flat.zero_grad()
    x = torch.randn(11, 16, generator=g).requires_grad_()
    local = torch.randint(0, 4, (11, 2), generator=g, dtype=torch.int32)  # 3 = served elsewhere
    w = torch.rand(11, 2, generator=g)
    with deferred_weight_grads() as pending:
        local_expert_block(x, local, w, experts).sum().backward()
    assert len(pending) == 1 and x.grad is not None and not flat.buckets[0].grad_N.any()
    pending[0]()
    reference = RoutedExperts(3, 16, 24)
    reference.load_state_dict({k: v.detach() for k, v in experts.state_dict().items()})
    local_expert_block(x.detach(), local, w, reference).sum().backward()
    assert _rel_err(experts.w13_EH2F.main_grad, reference.w13_EH2F.grad) < 1e-5
    assert _rel_err(experts.w2_EFH.main_grad, reference.w2_EFH.grad) < 1e-5


def _gpu_weight_grad_inputs(banded: bool, seed: int):
    """(experts, offsets, a bf16 [N, 512], b bf16 [N, 384], an fp32 main gradient holding a sum) on the GPU:
    ragged counts with an empty expert, one group per expert or banded (`_banded`)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    counts, k, c = [700, 0, 1300, 45], 512, 384
    experts, rows = len(counts), sum(counts)
    if banded:
        _, offsets = _banded(counts, BANDS, torch.Generator().manual_seed(seed))
        offsets = offsets.cuda()
    else:
        offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    a = torch.randn(rows, k, device="cuda", generator=gen).bfloat16()
    b = torch.randn(rows, c, device="cuda", generator=gen).bfloat16()
    return experts, offsets, a, b, torch.randn(experts, k, c, device="cuda", generator=gen)


@pytest.mark.gpu
@pytest.mark.parametrize("banded", [False, True], ids=["one-group-per-expert", "banded"])
def test_gpu_tma_weight_grads_add_the_pointer_loads_bits(banded):
    """`TileConfig.tma` on the GPU: each tuner TMA wgrad tile, bf16 rows (ragged, an empty expert, row
    groups not multiples of the row step) into an fp32 main gradient twice, the very bits of the same
    tile loading through pointers (the same wgmma chain over the same rows; only the loads differ)."""
    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg

    experts, offsets, a, b, start = _gpu_weight_grad_inputs(banded, seed=5)
    assert gg.tma_takes(a) and gg.tma_takes(b)
    want = start + 2 * _weight_grad_reference(a.float(), b.float(), offsets.cpu(), experts).cuda()
    for tile in [t for t in tuner.candidates("wgrad_w13") if t.tma]:
        pointers, loaded = start.clone(), start.clone()
        for _ in range(2):
            gg.ragged_weight_grad(a, b, offsets, dataclasses.replace(tile, tma=False), out=pointers, accumulate=True,
                                  weights=experts)
            gg.ragged_weight_grad(a, b, offsets, tile, out=loaded, accumulate=True, weights=experts)
        torch.cuda.synchronize()
        assert torch.equal(pointers, loaded), tile
        assert _rel_err(loaded, want) < 1e-5, tile


@pytest.mark.gpu
@pytest.mark.parametrize("banded", [False, True], ids=["one-group-per-expert", "banded"])
def test_gpu_atomic_weight_grads_add_the_same_bits_as_load_add_store(banded):
    """`TileConfig.atomic_accumulate` on the GPU (REDG.E.ADD.F32x4: relaxed vector reductions at L2),
    bf16 rows into an fp32 main gradient that already holds a sum, ragged counts with an empty
    expert, twice in a row (a step's two micro-batches): the very bits of the load-add-store epilogue
    at the heuristic wgrad tile (no denormals among these values, which the reduction would flush); so
    does the tuner's first prefetching TMA tile (`TileConfig.prefetch_accumulator`)."""
    from disagmoe.bench import tune_experts as tuner
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.tile_configs import heuristic

    experts, offsets, a, b, start = _gpu_weight_grad_inputs(banded, seed=3)
    tile = dataclasses.replace(heuristic("wgrad_w13"), atomic_accumulate=False)
    early_tile = next(c for c in tuner.candidates("wgrad_w13") if c.prefetch_accumulator and c.tma)
    plain, atomic, early = start.clone(), start.clone(), start.clone()
    for _ in range(2):
        gg.ragged_weight_grad(a, b, offsets, tile, out=plain, accumulate=True, weights=experts)
        gg.ragged_weight_grad(a, b, offsets, dataclasses.replace(tile, atomic_accumulate=True), out=atomic,
                              accumulate=True, weights=experts)
        gg.ragged_weight_grad(a, b, offsets, early_tile, out=early, accumulate=True, weights=experts)
    torch.cuda.synchronize()
    assert torch.equal(plain, atomic)
    assert torch.equal(plain, early)  # the main gradient's tile read before the row loop (prefetch_accumulator)
    want = start + 2 * _weight_grad_reference(a.float(), b.float(), offsets.cpu(), experts).cuda()
    assert _rel_err(plain, want) < 1e-5
