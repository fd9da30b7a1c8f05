"""Expert weight gradients over pairs of micro-batches (`kernels.wgrad_pairs`, `ragged_weight_grad`'s
`second`): interpreter (fp32, CPU) and GPU (bf16)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig

SMALL_TILES = TileConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_warps=4, num_stages=1)
TILE_KINDS = {"pointers": SMALL_TILES, "tma": dataclasses.replace(SMALL_TILES, tma=True),
              "atomic": dataclasses.replace(SMALL_TILES, atomic_accumulate=True, tma=True),
              "prefetch": dataclasses.replace(SMALL_TILES, prefetch_accumulator=True),
              "flattened": dataclasses.replace(SMALL_TILES, flatten=True)}


@pytest.fixture
def kernels(interpreted):
    return interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.wgrad_pairs", "disagmoe.kernels.moe_ffn")


def _rows(gen, experts, k, c, device="cpu", dtype=torch.float32):
    """(a [N, k], b [N, c], offsets) for random ragged counts with an empty expert and groups both
    shorter and longer than the row step."""
    counts = [0 if i % 3 == 1 else int(torch.randint(1, 45, (1,), generator=gen)) for i in range(experts)]
    rows = sum(counts)
    a, b = torch.randn(rows, k, generator=gen), torch.randn(rows, c, generator=gen)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    return a.to(device, dtype), b.to(device, dtype), offsets.to(device)


def _reference(a, b, offsets, experts):
    out = torch.zeros((experts, a.shape[1], b.shape[1]), dtype=torch.float64)
    ends = offsets.tolist()
    for e, (start, end) in enumerate(zip([0, *ends[:-1]], ends)):
        out[e] += a[start:end].double().T @ b[start:end].double()
    return out


def _rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("kind", list(TILE_KINDS))
@pytest.mark.parametrize("seed", [0, 1])
def test_a_second_row_set_adds_both_micro_batches_rows_in_one_launch(kernels, kind, seed):
    """`second`: out[e] (+)= a^T b over expert e's rows of both sets (ragged counts with empty experts, K
    and C not multiples of their tiles, the two sets of different row counts), stored and accumulated,
    with pointer, TMA, atomic, prefetching and flattened tiles: the reference sum, and the two
    one-set launches' sum to fp32 rounding."""
    gg, _, _ = kernels
    gen = torch.Generator().manual_seed(90 + seed)
    experts = int(torch.randint(2, 6, (1,), generator=gen))
    k, c = (4 * int(v) for v in torch.randint(3, 12, (2,), generator=gen))
    a, b, offsets = _rows(gen, experts, k, c)
    a2, b2, offsets2 = _rows(gen, experts, k, c)
    tile = TILE_KINDS[kind]
    want = _reference(a, b, offsets, experts) + _reference(a2, b2, offsets2, experts)
    fresh = gg.ragged_weight_grad(a, b, offsets, tile, out=torch.full((experts, k, c), float("nan")),
                                  weights=experts, num_programs=3, second=(a2, b2, offsets2))
    assert torch.isfinite(fresh).all() and _rel_err(fresh, want) < 1e-6
    start = torch.randn(experts, k, c, generator=gen)
    paired, one_by_one = start.clone(), start.clone()
    gg.ragged_weight_grad(a, b, offsets, tile, out=paired, accumulate=True, weights=experts, num_programs=3,
                          second=(a2, b2, offsets2))
    for rows in ((a, b, offsets), (a2, b2, offsets2)):
        gg.ragged_weight_grad(*rows, tile, out=one_by_one, accumulate=True, weights=experts, num_programs=3)
    assert _rel_err(paired - start, want) < 1e-6
    torch.testing.assert_close(paired, one_by_one, rtol=1e-5, atol=1e-5)


def test_a_second_row_set_is_refused_where_one_launch_cannot_take_it(kernels):
    gg, _, _ = kernels
    gen = torch.Generator().manual_seed(5)
    a, b, offsets = _rows(gen, 3, 8, 12)
    a2, b2, offsets2 = _rows(gen, 3, 8, 12)
    with pytest.raises(AssertionError, match="widths"):
        gg.ragged_weight_grad(a, b, offsets, SMALL_TILES, weights=3, second=(a2[:, :4].contiguous(), b2, offsets2))
    with pytest.raises(AssertionError, match="not banded"):  # two bands of 3 experts' groups
        banded = torch.cat([offsets, offsets + int(offsets[-1])])
        gg.ragged_weight_grad(torch.cat([a, a]), torch.cat([b, b]), banded, SMALL_TILES, weights=3,
                              second=(a2, b2, offsets2))


def test_launches_into_one_main_gradient_pair_up_and_the_odd_one_runs_at_the_blocks_end(kernels):
    """Inside `paired_weight_grads` the first launch into a main gradient waits, the second runs both row
    sets (the main gradient stored at the step's first write, `kernels.first_touch`), the third waits
    and runs alone when the block exits; a launch without a main gradient returns its gradient at once,
    and outside the block every launch runs at once."""
    from disagmoe.kernels.first_touch import is_untouched, mark_untouched

    gg, wgrad_pairs, _ = kernels
    gen = torch.Generator().manual_seed(11)
    experts, k, c = 4, 12, 20
    sets = [_rows(gen, experts, k, c) for _ in range(3)]
    main = torch.full((experts, k, c), float("nan"))
    mark_untouched(main)  # zero_grad left it stale: the first write stores
    with wgrad_pairs.paired_weight_grads():
        assert wgrad_pairs.pairing()
        assert wgrad_pairs.weight_grad_into(*sets[0], SMALL_TILES, main=main, weights=experts) is None
        assert main.isnan().all() and is_untouched(main)  # waiting
        fresh = wgrad_pairs.weight_grad_into(*sets[0], SMALL_TILES, main=None, weights=experts, num_programs=2)
        assert _rel_err(fresh, _reference(*sets[0], experts)) < 1e-6  # no main gradient: at once
        wgrad_pairs.weight_grad_into(*sets[1], SMALL_TILES, main=main, weights=experts, num_programs=3)
        two = _reference(*sets[0], experts) + _reference(*sets[1], experts)
        assert not is_untouched(main) and _rel_err(main, two) < 1e-6  # the pair, stored
        wgrad_pairs.weight_grad_into(*sets[2], SMALL_TILES, main=main, weights=experts)
        assert _rel_err(main, two) < 1e-6  # the third waits ...
    assert not wgrad_pairs.pairing()
    assert _rel_err(main, two + _reference(*sets[2], experts)) < 1e-6  # ... and ran at the block's end
    before = main.clone()
    wgrad_pairs.weight_grad_into(*sets[0], SMALL_TILES, main=main, weights=experts)  # outside: at once
    assert _rel_err(main - before, _reference(*sets[0], experts)) < 1e-5
    with wgrad_pairs.paired_weight_grads(enabled=False):
        assert not wgrad_pairs.pairing()


def test_run_waiting_runs_the_waiting_launches_alone_and_the_block_goes_on_pairing(kernels):
    """`run_waiting` (a rank's optimizer step inside its step's block): each waiting launch runs alone now,
    nothing waits after it, and the launches after it pair again; outside a block it does nothing."""
    gg, wgrad_pairs, _ = kernels
    gen = torch.Generator().manual_seed(13)
    experts, k, c = 3, 8, 12
    sets = [_rows(gen, experts, k, c) for _ in range(3)]
    mains = [torch.zeros(experts, k, c), torch.zeros(experts, k, c)]
    wgrad_pairs.run_waiting()  # outside a block: nothing to run
    with wgrad_pairs.paired_weight_grads():
        for main in mains:
            wgrad_pairs.weight_grad_into(*sets[0], SMALL_TILES, main=main, weights=experts)
        assert wgrad_pairs.launches_waiting() == 2 and not any(main.any() for main in mains)
        wgrad_pairs.run_waiting()
        assert wgrad_pairs.launches_waiting() == 0
        for main in mains:
            assert _rel_err(main, _reference(*sets[0], experts)) < 1e-6
        wgrad_pairs.weight_grad_into(*sets[1], SMALL_TILES, main=mains[0], weights=experts)
        assert wgrad_pairs.launches_waiting() == 1  # after the flush, the next launch waits again ...
        wgrad_pairs.weight_grad_into(*sets[2], SMALL_TILES, main=mains[0], weights=experts)
        assert wgrad_pairs.launches_waiting() == 0  # ... for its partner
    want = _reference(*sets[0], experts) + _reference(*sets[1], experts) + _reference(*sets[2], experts)
    assert _rel_err(mains[0], want) < 1e-6
    assert wgrad_pairs.launches_waiting() == 0


def test_a_failed_block_drops_its_waiting_launches(kernels):
    _, wgrad_pairs, _ = kernels
    gen = torch.Generator().manual_seed(12)
    rows = _rows(gen, 3, 8, 8)
    main = torch.zeros(3, 8, 8)
    with pytest.raises(RuntimeError, match="boom"), wgrad_pairs.paired_weight_grads():
        wgrad_pairs.weight_grad_into(*rows, SMALL_TILES, main=main, weights=3)
        raise RuntimeError("boom")
    assert not wgrad_pairs.pairing() and not main.any()


@pytest.mark.slow  # 2-5 s a case on 2 cores (the fresh-clone CI: 5.3 s)
@pytest.mark.parametrize("micro_batches", [2, 3])
@pytest.mark.parametrize("recompute", [frozenset(), frozenset({"expert_swiglu"})], ids=["kept", "swiglu-recomputed"])
def test_the_expert_ffns_paired_main_gradients_are_the_unpaired_ones(kernels, micro_batches, recompute):
    """The Triton expert FFN's backward over 2 and 3 micro-batches with FlatAdamW-style main gradients:
    inside `paired_weight_grads` the main gradients equal the unpaired run's to fp32 rounding, and the
    input gradients are the same bits."""
    _, wgrad_pairs, moe_ffn = kernels
    gen = torch.Generator().manual_seed(21)
    experts, hidden, ffn = 3, 24, 40
    w13 = torch.nn.Parameter(torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5)
    w2 = torch.nn.Parameter(torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5)
    batches = []
    for _ in range(micro_batches):
        x, _, offsets = _rows(gen, experts, hidden, 1)
        batches.append((x.requires_grad_(), offsets, torch.randn(x.shape[0], hidden, generator=gen)))
    tiles = moe_ffn.FFNTiles.uniform(SMALL_TILES)
    results = {}
    for paired in (False, True):
        w13.main_grad, w2.main_grad = torch.zeros(w13.shape), torch.zeros(w2.shape)
        with wgrad_pairs.paired_weight_grads(paired):
            for x, offsets, dy in batches:
                x.grad = None
                moe_ffn.ExpertFFNFunction.apply(x, offsets, w13, w2, tiles, 3, recompute).backward(dy)
                results[paired, id(x)] = x.grad.clone()
        results[paired] = (w13.main_grad.clone(), w2.main_grad.clone())
    for (plain, paired) in zip(results[False], results[True]):
        torch.testing.assert_close(paired, plain, rtol=1e-5, atol=1e-5)
    assert all(torch.equal(results[True, id(x)], results[False, id(x)]) for x, _, _ in batches)


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["pointers", "tma"])
def test_gpu_a_second_row_set_adds_both_micro_batches_rows(tma):
    """bf16 rows on the GPU (atomic and load-add-store tiles): the paired launch's main gradient against
    the two one-set launches' (fp32 rounding order only) and the fp64 reference."""
    from disagmoe.kernels import grouped_gemm as gg

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator().manual_seed(3)
    experts, k, c = 8, 512, 384
    sets = []
    for _ in range(2):
        counts = torch.randint(0, 700, (experts,), generator=gen)
        counts[2] = 0
        rows = int(counts.sum())
        sets.append((torch.randn(rows, k, generator=gen).cuda().bfloat16(),
                     torch.randn(rows, c, generator=gen).cuda().bfloat16(),
                     counts.cumsum(0).to(torch.int32).cuda()))
    want = _reference(*[t.cpu() for t in sets[0]], experts) + _reference(*[t.cpu() for t in sets[1]], experts)
    for atomic in (False, True):
        tile = TileConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, tma=tma,
                          atomic_accumulate=atomic)
        start = torch.randn(experts, k, c, generator=gen).cuda()
        paired, one_by_one = start.clone(), start.clone()
        gg.ragged_weight_grad(*sets[0], tile, out=paired, accumulate=True, weights=experts, second=sets[1])
        for rows in sets:
            gg.ragged_weight_grad(*rows, tile, out=one_by_one, accumulate=True, weights=experts)
        torch.cuda.synchronize()
        assert _rel_err((paired - start).cpu(), want) < 1e-5
        torch.testing.assert_close(paired, one_by_one, rtol=1e-5, atol=1e-3)
