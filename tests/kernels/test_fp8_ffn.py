"""The all-FP8 expert FFN (kernels/fp8_ffn.py) against fp32 autograd through the reference FFN:
interpreter (CPU, e4m3 values exact, fp32 accumulation) and GPU (tensor cores, bf16)."""

from __future__ import annotations

import itertools

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig

SMALL = dict(rows=TileConfig(block_m=16, block_n=32, block_k=128, group_m=2, num_warps=4, num_stages=1),
             swiglu=TileConfig(block_m=16, block_n=128, block_k=128, group_m=2, num_warps=4, num_stages=1),
             wgrad=TileConfig(block_m=128, block_n=32, block_k=32, group_m=2, num_warps=4, num_stages=1))


def _inputs(counts, hidden, ffn, seed, device="cpu", dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    rows = sum(counts)
    x = torch.randn(rows, hidden, generator=gen) * torch.exp2(torch.randn(rows, 1, generator=gen))
    w13 = torch.randn(len(counts), hidden, 2 * ffn, generator=gen) / hidden**0.5
    w2 = torch.randn(len(counts), ffn, hidden, generator=gen) / ffn**0.5
    dy = torch.randn(rows, hidden, generator=gen) * torch.exp2(torch.randn(rows, 1, generator=gen) * 2)
    offsets = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32)
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(x), offsets.to(device), cast(w13), cast(w2), cast(dy)


def _row_rel_err(got, want):
    got, want = got.double().flatten(0, -2), want.double().flatten(0, -2)
    keep = want.norm(dim=1) > 0
    return ((got - want).norm(dim=1)[keep] / want.norm(dim=1)[keep]).max().item()


def _reference_grads(x, offsets, w13, w2, dy):
    from disagmoe.kernels.moe_ffn import expert_ffn_reference

    leaves = [t.double().clone().requires_grad_() for t in (x, w13, w2)]
    y = expert_ffn_reference(leaves[0], offsets, leaves[1], leaves[2])
    y.backward(dy.double())
    return y.detach(), *(t.grad for t in leaves)


def _assert_the_bf16_backward_from(h13, y, leaves, counts, x, offsets, w13, w2, dy):
    """The gradients the FFN's `leaves` (x, w13, w2) took are the bf16 experts' backward
    (`moe_ffn_backward`) from the forward's saved `h13`, bit for bit, and y with them tracks the
    fp32 reference (`_check`); returns that backward's (dx, dw13, dw2)."""
    from disagmoe.kernels.moe_ffn import FFNTiles, moe_ffn_backward

    hidden, ffn = w13.shape[1], w2.shape[1]
    bf16_tiles = FFNTiles.for_shape(len(x), len(counts), hidden, ffn, x.device, x.dtype)
    want = moe_ffn_backward(dy, x, offsets, w13, w2, None, h13, bf16_tiles, num_programs=3)
    for got, expected in zip((t.grad for t in leaves), want, strict=True):
        assert torch.equal(got, expected)
    _check(counts, (y, *(t.grad for t in leaves)), _reference_grads(x, offsets, w13, w2, dy))
    return want


@pytest.fixture
def ffn8(interpreted):
    _, _, ffn8 = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.fp8_ffn")
    return ffn8


def _errors(counts, got, want):
    """(y, dx: worst row; dw13, dw2: worst expert) relative errors. Weight gradients are judged per
    expert: a row of dW2 = sum_t act[t, f] dy[t] inherits the relative error of act's elements
    near zero (silu(gate) * up from FP8 pre-activations), which is large where act is tiny."""
    (y, dx, dw13, dw2), (y_ref, dx_ref, dw13_ref, dw2_ref) = got, want
    per_expert = [max(((g[e].double() - r[e]).norm() / r[e].norm()).item() for e in range(len(counts)) if counts[e])
                  for g, r in ((dw13, dw13_ref), (dw2, dw2_ref))]
    return _row_rel_err(y, y_ref), _row_rel_err(dx, dx_ref), *per_expert


# Stated bounds against fp64 autograd through the reference FFN, on rows whose magnitudes spread
# by 2^N(0, 1) (x) and 2^(2 N(0, 1)) (dy). Measured on 6 interpreter cases: y 0.115, dx 0.141 (worst
# row), dw13 0.082, dw2 0.070 (worst expert).
Y_ROW_REL_ERR = 0.15
DX_ROW_REL_ERR = 0.2
DW_REL_ERR = 0.12


def _check(counts, got, want):
    y_err, dx_err, dw13_err, dw2_err = _errors(counts, got, want)
    assert y_err < Y_ROW_REL_ERR and dx_err < DX_ROW_REL_ERR
    assert dw13_err < DW_REL_ERR and dw2_err < DW_REL_ERR


@pytest.mark.parametrize("backward", ["fp8", "bf16-wgrad", "bf16"])
def test_fp8_ffn_forward_and_backward_against_fp32(ffn8, backward):
    """Autograd through every FP8 launch, each backward recipe: y, dx, dw13, dw2 within the stated
    bounds; the empty expert's weight gradients are zeros."""
    counts, hidden, ffn = [4, 0, 11, 1], 32, 40
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=1)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = ffn8.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], tiles=ffn8.Fp8Tiles(**SMALL), num_programs=3,
                            backward=backward)
    y.backward(dy)
    _check(counts, (y, *(t.grad for t in leaves)), _reference_grads(x, offsets, w13, w2, dy))
    assert not leaves[1].grad[1].any() and not leaves[2].grad[1].any()


def test_a_worst_case_buffers_padding_rows_reach_neither_the_results_nor_the_counters(ffn8):
    """Rows past offsets_E[-1] (a distributed expert rank's worst-case buffer, `local_experts`)
    holding NaN and inf in x and dy, and the saved pre-activations' padding left as garbage: the
    data rows' y and dx and the weight gradients are those of the unpadded buffer, bit for bit, and
    no counter saw a non-finite value (it would skip the optimizer's update)."""
    from disagmoe.kernels.fp8_stats import NONFINITE, Fp8Stats

    counts, hidden, ffn, pad = [4, 0, 11, 1], 32, 40, 9
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=4)
    garbage = torch.full((pad, hidden), float("nan"))
    garbage[::2] = float("inf")
    tiles, weights = ffn8.Fp8Tiles(**SMALL), ffn8.Fp8ExpertWeights.quantize(w13, w2)
    results = []
    for rows_x, rows_dy in ((x, dy), (torch.cat([x, garbage]), torch.cat([dy, garbage]))):
        stats = Fp8Stats("cpu")
        y, h13 = ffn8.fp8_ffn_forward(rows_x, offsets, weights, tiles, save_for_backward=True, num_programs=3,
                                      stats=stats)
        h13[len(x):] = float("nan")  # new_empty's rows past the data: never written by the GEMM
        dx, dw13, dw2 = ffn8.fp8_ffn_backward(rows_dy, rows_x, offsets, weights, h13, tiles, num_programs=3,
                                              stats=stats)
        results.append((y[:len(x)], dx[:len(x)], dw13, dw2, stats.buffer))
    for plain, padded in zip(*results, strict=True):
        assert torch.equal(plain, padded)
    assert results[1][4][:, NONFINITE].eq(0).all()


@pytest.mark.slow  # two FP8 backwards in the interpreter: ~4 s alone, more on 2 busy cores
def test_the_one_pass_backward_is_the_two_pass_backwards_bits_and_counters(ffn8, monkeypatch):
    """dy and d h13 quantised both ways by one pass each (`fp8.quantize_rows_and_token_groups`, which the
    backward would take if it measured faster), against the backward as it runs, each quantised by
    `quantize_rows` and `quantize_token_groups` (`_quantize_both_ways`):
    dx, both weight gradients (one into a main gradient) and every counter bit for bit, on a
    worst-case buffer (padding rows of x and dy NaN and inf, h13's NaN) with an expert over 128
    rows and an empty one."""
    from disagmoe.kernels.fp8_stats import NONFINITE, Fp8Stats

    fp8 = ffn8.fp8
    counts, hidden, ffn, pad = [4, 0, 130, 1], 32, 40, 9
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=7)
    garbage = torch.full((pad, hidden), float("nan"))
    garbage[::2] = float("inf")
    x, dy = torch.cat([x, garbage]), torch.cat([dy, garbage])
    tiles, weights = ffn8.Fp8Tiles(**SMALL), ffn8.Fp8ExpertWeights.quantize(w13, w2)
    _, h13 = ffn8.fp8_ffn_forward(x, offsets, weights, tiles, save_for_backward=True, num_programs=3)
    h13[sum(counts):] = float("nan")
    two_passes = ffn8._quantize_both_ways
    results = []
    for quantise in (fp8.quantize_rows_and_token_groups, two_passes):
        monkeypatch.setattr(ffn8, "_quantize_both_ways", quantise)
        stats, main = Fp8Stats("cpu"), torch.ones(w2.shape)
        dx, dw13, none = ffn8.fp8_ffn_backward(dy, x, offsets, weights, h13, tiles, main_grads=(None, main),
                                               num_programs=3, stats=stats)
        assert none is None
        results.append((dx[:sum(counts)], dw13, main, stats.buffer))
    for got, want in zip(*results, strict=True):
        assert torch.equal(got, want)
    assert results[0][3][:, NONFINITE].eq(0).all()


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("counts,hidden,ffn", [([5, 0, 37, 1], 96, 72), ([0, 130, 3], 64, 128)])
def test_fp8_ffn_bounds_over_ragged_cases(ffn8, counts, hidden, ffn, seed):
    """The bounds over the cases they were measured on (an expert over 128 rows: two token chunks)."""
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=hidden + seed)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = ffn8.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], tiles=ffn8.Fp8Tiles(**SMALL), num_programs=3)
    y.backward(dy)
    _check(counts, (y, *(t.grad for t in leaves)), _reference_grads(x, offsets, w13, w2, dy))


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
def test_weight_gradients_add_into_main_gradients_and_weights_made_once(ffn8):
    """Weights quantised once (`Fp8ExpertWeights.quantize`) and passed in give the same y as
    weights quantised inside; with fp32 main gradients the weight-gradient GEMMs add exactly what
    they return otherwise, and None is returned for them."""
    counts, hidden, ffn = [9, 0, 14], 48, 40
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=2)
    tiles = ffn8.Fp8Tiles(**SMALL)
    weights = ffn8.Fp8ExpertWeights.quantize(w13, w2)
    y_inside = ffn8.expert_ffn_fp8(x, offsets, w13, w2, tiles=tiles, num_programs=2)
    y, h13 = ffn8.fp8_ffn_forward(x, offsets, weights, tiles, save_for_backward=True, num_programs=2)
    assert torch.equal(y, y_inside)
    dx, dw13, dw2 = ffn8.fp8_ffn_backward(dy, x, offsets, weights, h13, tiles, num_programs=2)
    main = (torch.randn(w13.shape), torch.randn(w2.shape))
    start = tuple(m.clone() for m in main)
    dx_main, none13, none2 = ffn8.fp8_ffn_backward(dy, x, offsets, weights, h13, tiles, main_grads=main,
                                                   num_programs=3)
    assert none13 is None and none2 is None and torch.equal(dx_main, dx)
    for m, s0, g in zip(main, start, (dw13, dw2)):
        torch.testing.assert_close(m - s0, g, rtol=1e-5, atol=1e-5)


def test_weight_gradients_without_main_gradients_are_written_in_their_weights_dtype(ffn8):
    """The all-FP8 backward's weight gradients returned (no main gradient) in `grad_dtypes`: the GEMMs
    round their fp32 sums once, with no fp32 tensor between: on a GPU the bits of the fp32 gradients cast
    (tests/kernels/test_fp8_gluon.py); the interpreter truncates fp32 to bf16 (numpy has no bf16), so here
    within one bf16 step of them."""
    counts, hidden, ffn = [7, 0, 10], 32, 40
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=4)
    tiles = ffn8.Fp8Tiles(**SMALL)
    weights = ffn8.Fp8ExpertWeights.quantize(w13, w2)
    _, h13 = ffn8.fp8_ffn_forward(x, offsets, weights, tiles, save_for_backward=True, num_programs=2)
    _, dw13, dw2 = ffn8.fp8_ffn_backward(dy, x, offsets, weights, h13, tiles, num_programs=2)
    _, half13, half2 = ffn8.fp8_ffn_backward(dy, x, offsets, weights, h13, tiles, num_programs=2,
                                             grad_dtypes=(torch.bfloat16, torch.bfloat16))
    assert half13.dtype == half2.dtype == torch.bfloat16
    for half, full in ((half13, dw13), (half2, dw2)):
        torch.testing.assert_close(half.float(), full, rtol=2**-7, atol=0)


@pytest.mark.parametrize("backward", ["fp8", "bf16-wgrad"])
def test_parameters_with_main_gradients_get_theirs_added_by_the_kernels_through_autograd(ffn8, backward):
    """Expert weights that are parameters carrying FlatAdamW's fp32 `main_grad`: autograd leaves
    their `.grad` None (nothing for AccumulateGrad or the optimizer's hook to add) and each main
    gradient gains exactly the weight gradient the plain call returns (before its bf16 cast);
    dx is unchanged."""
    counts, hidden, ffn = [5, 0, 12], 32, 40
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=6)
    tiles = ffn8.Fp8Tiles(**SMALL)
    plain = [t.clone().requires_grad_() for t in (x, w13, w2)]
    ffn8.expert_ffn_fp8(plain[0], offsets, plain[1], plain[2], tiles=tiles, num_programs=2,
                        backward=backward).backward(dy)
    x_leaf = x.clone().requires_grad_()
    params = [torch.nn.Parameter(w.clone()) for w in (w13, w2)]
    starts = [torch.randn(w.shape) for w in (w13, w2)]
    for p, s in zip(params, starts, strict=True):
        p.main_grad = s.clone()
    ffn8.expert_ffn_fp8(x_leaf, offsets, *params, tiles=tiles, num_programs=2, backward=backward).backward(dy)
    assert params[0].grad is None and params[1].grad is None
    torch.testing.assert_close(x_leaf.grad, plain[0].grad, rtol=0, atol=0)
    for p, s, leaf in zip(params, starts, plain[1:], strict=True):
        torch.testing.assert_close(p.main_grad - s, leaf.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # 5-8 s a case on 2 cores
@pytest.mark.parametrize("micro_batches", [2, 3])
def test_the_fp8_backwards_weight_gradients_pair_over_micro_batches_as_unpaired(ffn8, micro_batches, monkeypatch):
    """The all-FP8 backward inside `wgrad_pairs.paired_weight_grads`: each weight gradient's token-group
    copies wait for the next micro-batch's launch into the same main gradient and run with it as its
    second row set (an odd count's last alone at the block's end); the main gradients equal the unpaired
    run's (the interpreter's Triton kernel adds the second set by a second launch: the same order) and
    dx is the same bits."""
    from disagmoe.kernels import wgrad_pairs

    counts, hidden, ffn = [5, 0, 12], 32, 40
    tiles = ffn8.Fp8Tiles(**SMALL)
    batches = [_inputs(counts, hidden, ffn, seed=10 + i) for i in range(micro_batches)]
    w13, w2 = batches[0][2], batches[0][3]
    weights = ffn8.Fp8ExpertWeights.quantize(w13, w2)
    seconds = []
    launch = ffn8._weight_grad
    monkeypatch.setattr(ffn8, "_weight_grad", lambda *a, second=None, **k: seconds.append(second is not None)
                        or launch(*a, second=second, **k))
    results = {}
    for paired in (False, True):
        main = (torch.zeros(w13.shape), torch.zeros(w2.shape))
        seconds.clear()
        with wgrad_pairs.paired_weight_grads(paired):
            for i, (x, offsets, _, _, dy) in enumerate(batches):
                _, h13 = ffn8.fp8_ffn_forward(x, offsets, weights, tiles, save_for_backward=True, num_programs=2)
                dx, _, _ = ffn8.fp8_ffn_backward(dy, x, offsets, weights, h13, tiles, main_grads=main, num_programs=2)
                results[paired, i] = dx
        results[paired] = main
        # two weight gradients a micro-batch: unpaired each alone; paired, one launch a pair and the odd ones alone
        want = [False] * 2 * micro_batches if not paired else [True] * 2 * (micro_batches // 2) + [False] * 2 * (
            micro_batches % 2)
        assert seconds == want
    for plain, pair in zip(results[False], results[True], strict=True):
        assert torch.equal(pair, plain)
    assert all(torch.equal(results[True, i], results[False, i]) for i in range(micro_batches))


@pytest.mark.slow  # 5-7 s a case on 2 cores (the fresh-clone CI, session 35)
@pytest.mark.parametrize("backward", ["fp8", "bf16-wgrad"])
def test_first_touch_stores_the_steps_first_weight_gradient_bit_for_bit(ffn8, backward):
    """Main gradients left stale (NaN) and marked untouched by the optimizer (`kernels.first_touch`):
    the step's first FP8 weight-gradient launch into each stores, the next micro-batch's adds, and
    the result equals zero-filled main gradients accumulated twice, bit for bit; an expert without
    rows in every micro-batch gets zeros, not the stale NaN."""
    from disagmoe.kernels.first_touch import is_untouched, mark_untouched

    counts, hidden, ffn = [6, 0, 9], 32, 40
    tiles = ffn8.Fp8Tiles(**SMALL)
    batches = [_inputs(counts, hidden, ffn, seed=s) for s in (7, 8)]
    _, _, w13, w2, _ = batches[0]
    results = []
    for first_touch in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in (w13, w2)]
        for p in params:
            p.main_grad = torch.full(p.shape, float("nan")) if first_touch else torch.zeros(p.shape)
            if first_touch:
                mark_untouched(p.main_grad)
        for x, offsets, _, _, dy in batches:
            ffn8.expert_ffn_fp8(x.clone().requires_grad_(), offsets, *params, tiles=tiles, num_programs=2,
                                backward=backward).backward(dy)
        assert not any(is_untouched(p.main_grad) for p in params)
        results.append([p.main_grad for p in params])
    for zeroed, touched in zip(*results, strict=True):
        assert torch.equal(zeroed, touched)
    assert not results[1][0][1].any() and not results[1][1][1].any()


def _through_row_source_into_main_grads(ffn8, x, offsets, w13, w2, dy, tiles, backward):
    """Forward and backward with the rows read from shuffled tokens (`expert_input` recomputed) and
    weights carrying zeroed fp32 main gradients: (x's leaf, the two weight parameters)."""
    from disagmoe.kernels.recompute import EXPERT_INPUT, RowSource

    token_N = torch.randperm(len(x), generator=torch.Generator().manual_seed(2))
    x_TH = torch.empty_like(x)
    x_TH[token_N] = x
    params = [torch.nn.Parameter(w.clone()) for w in (w13, w2)]
    for p in params:
        p.main_grad = torch.zeros(p.shape)
    x_leaf = x.clone().requires_grad_()
    ffn8.expert_ffn_fp8(x_leaf, offsets, *params, tiles=tiles, num_programs=3, backward=backward,
                        recompute=frozenset({EXPERT_INPUT}), source=RowSource(x_TH, token_N)).backward(dy)
    return x_leaf, params


@pytest.mark.slow  # 7-15 s a case on 2 cores (the fresh-clone CI, session 35)
@pytest.mark.parametrize("counts,hidden,ffn", [([4, 0, 11, 1], 32, 40), ([0, 130, 3], 64, 128)])
def test_bf16_weight_grads_are_the_plain_gemm_of_the_rows_beside_the_fp8_data_gradient(ffn8, counts, hidden, ffn):
    """backward="bf16": y and dx are the FP8 run's bits (the same forward and data-gradient
    launches); dw2 is the plain GEMM act^T dy per expert over the rows as they are (act = silu(gate)
    * up of the saved pre-activations; no token-group quantisation), zeros for an empty expert; both
    weight gradients within the stated bounds of fp64 autograd; with main gradients they are added
    there, and through a RowSource (expert_input recomputed) the same."""
    import torch.nn.functional as F

    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=11)
    tiles = ffn8.Fp8Tiles(**SMALL)
    got = {}
    for precision in ("fp8", "bf16-wgrad"):
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
        y = ffn8.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles, num_programs=3,
                                backward=precision)
        y.backward(dy)
        got[precision] = (y, *(t.grad for t in leaves))
    got["bf16"] = got.pop("bf16-wgrad")
    assert torch.equal(got["bf16"][0], got["fp8"][0]) and torch.equal(got["bf16"][1], got["fp8"][1])
    _check(counts, got["bf16"], _reference_grads(x, offsets, w13, w2, dy))
    _, h13 = ffn8.fp8_ffn_forward(x, offsets, ffn8.Fp8ExpertWeights.quantize(w13, w2), tiles, save_for_backward=True,
                                  num_programs=3)
    act = F.silu(h13[:, :ffn]) * h13[:, ffn:]
    starts = [0, *offsets.tolist()]
    for e in range(len(counts)):
        rows = slice(starts[e], starts[e + 1])
        want = act[rows].T @ dy[rows]  # fp32 sums in another order: compared as a whole per expert
        assert (got["bf16"][3][e] - want).norm() <= 1e-5 * want.norm() + 1e-30
        if not counts[e]:
            assert not got["bf16"][2][e].any() and not got["bf16"][3][e].any()
    _, params = _through_row_source_into_main_grads(ffn8, x, offsets, w13, w2, dy, tiles, "bf16-wgrad")
    assert params[0].grad is None and params[1].grad is None
    torch.testing.assert_close(params[0].main_grad, got["bf16"][2], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(params[1].main_grad, got["bf16"][3], rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="backward 'fp16': choose one of fp8, bf16-wgrad, bf16"):
        ffn8.expert_ffn_fp8(x, offsets, w13, w2, backward="fp16")


def test_a_bf16_backward_is_the_bf16_experts_backward_from_the_fp8_forwards_pre_activations(ffn8):
    """backward="bf16": y is the FP8 run's; dx, dw13 and dw2 are `moe_ffn.moe_ffn_backward`'s from
    the saved rows and the FP8 gate/up output h13 against the bf16 weights (no FP8 in the backward),
    bit for bit; into main gradients where the weights carry them, through a RowSource the same."""

    counts, hidden, ffn = [5, 0, 12, 3], 32, 40
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=12)
    tiles = ffn8.Fp8Tiles(**SMALL)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = ffn8.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles, num_programs=3, backward="bf16")
    y.backward(dy)
    y_fp8, h13 = ffn8.fp8_ffn_forward(x, offsets, ffn8.Fp8ExpertWeights.quantize(w13, w2), tiles,
                                      save_for_backward=True, num_programs=3)
    assert torch.equal(y, y_fp8)
    want = _assert_the_bf16_backward_from(h13, y, leaves, counts, x, offsets, w13, w2, dy)
    x_leaf, params = _through_row_source_into_main_grads(ffn8, x, offsets, w13, w2, dy, tiles, "bf16")
    assert params[0].grad is None and params[1].grad is None and torch.equal(x_leaf.grad, want[0])
    assert torch.equal(params[0].main_grad, want[1]) and torch.equal(params[1].main_grad, want[2])


@pytest.mark.parametrize("forward", ["gate-up", "down"])
def test_one_forward_gemm_in_fp8_is_that_gemm_beside_the_bf16_experts_other(ffn8, forward):
    """forward "gate-up" / "down" (backward bf16): y is the FP8 GEMM of the one and the bf16 experts'
    GEMM of the other, bit for bit against the same kernels called one by one; the saved h13 is what
    the backward reads (the bf16 experts' backward from it, bit for bit); y and the gradients within
    the stated bounds; each one-GEMM forward closer to fp64 than the recipe's two FP8 GEMMs."""
    from disagmoe.kernels import fp8
    from disagmoe.kernels import grouped_gemm as gg
    from disagmoe.kernels.moe_ffn import FFNTiles, moe_ffn_backward

    counts, hidden, ffn = [6, 0, 13, 4], 32, 40
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=21)
    tiles, weights = ffn8.Fp8Tiles(**SMALL), ffn8.Fp8ExpertWeights.quantize(w13, w2)
    bf16_tiles = FFNTiles.for_shape(len(x), len(counts), hidden, ffn, x.device, x.dtype)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = ffn8.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles, num_programs=3, backward="bf16",
                            forward=forward)
    y.backward(dy)
    if forward == "gate-up":
        h13 = fp8.fp8_rows_gemm(*fp8.quantize_rows(x), offsets, *weights.w13, tiles.rows, out_dtype=x.dtype,
                                num_programs=3)
        gate, up = h13.chunk(2, dim=1)
        want_y = gg.ragged_rows_gemm((torch.nn.functional.silu(gate) * up), offsets, w2, bf16_tiles.down,
                                     num_programs=3)
    else:
        h13 = torch.empty(len(x), 2 * ffn)
        act = gg.ragged_rows_gemm(x, offsets, w13, bf16_tiles.gate_up, epilogue=gg.EPILOGUE_SWIGLU, h13_N2C=h13,
                                  num_programs=3)
        want_y = fp8.fp8_rows_gemm(*fp8.quantize_rows(act), offsets, *weights.w2, tiles.rows, out_dtype=x.dtype,
                                   num_programs=3)
    assert torch.equal(y, want_y)
    if forward == "down":  # the act quantised by the gate/up GEMM's epilogue, or (the A/B's) in a pass: the same y
        with ffn8.gluon_paths(act_epilogue=False):
            in_a_pass = ffn8.expert_ffn_fp8(x, offsets, w13, w2, tiles=tiles, num_programs=3, backward="bf16",
                                            forward=forward)
        assert torch.equal(in_a_pass, y)
    want = moe_ffn_backward(dy, x, offsets, w13, w2, None, h13, bf16_tiles, num_programs=3)
    for got, expected in zip((t.grad for t in leaves), want, strict=True):
        assert torch.equal(got, expected)
    reference = _reference_grads(x, offsets, w13, w2, dy)
    _check(counts, (y, *(t.grad for t in leaves)), reference)
    both = ffn8.expert_ffn_fp8(x, offsets, w13, w2, tiles=tiles, num_programs=3, backward="bf16")
    mean_err = lambda got: ((got.double() - reference[0]).norm() / reference[0].norm()).item()  # noqa: E731
    assert mean_err(y) < mean_err(both)


@pytest.mark.parametrize("backward", ["fp8", "bf16-wgrad"])
def test_one_forward_gemm_in_fp8_takes_the_fp8_backwards_from_its_pre_activations(ffn8, backward):
    """forward "down" (the gate/up GEMM bf16) with an FP8 backward: the gradients are
    `fp8_ffn_backward`'s from the rows and the saved bf16 h13, bit for bit, within the stated
    bounds; an unknown forward is refused with the choices."""
    counts, hidden, ffn = [5, 0, 9, 4], 32, 40
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=22)
    tiles, weights = ffn8.Fp8Tiles(**SMALL), ffn8.Fp8ExpertWeights.quantize(w13, w2)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = ffn8.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles, num_programs=3, backward=backward,
                            forward="down")
    y.backward(dy)
    _, h13 = ffn8.fp8_ffn_forward(x, offsets, weights, tiles, save_for_backward=True, num_programs=3,
                                  forward="down", bf16_weights=(w13, w2))
    want = ffn8.fp8_ffn_backward(dy, x, offsets, weights, h13, tiles, num_programs=3, backward=backward)
    for got, expected in zip((t.grad for t in leaves), want, strict=True):
        assert torch.equal(got, expected)
    _check(counts, (y, *(t.grad for t in leaves)), _reference_grads(x, offsets, w13, w2, dy))
    with pytest.raises(ValueError, match="forward GEMMs 'up': choose one of both, gate-up, down"):
        ffn8.expert_ffn_fp8(x, offsets, w13, w2, forward="up")


# The emulated forward (`fp8_ffn._emulated_forward`, `TrainConfig.fp8_emulate`) against the FP8 kernels
# in fp32: each dequantised operand is its e4m3 value times its scale, one fp32 rounding (2^-24
# relative) from the exact product the kernels scale their sums by, so y and h13 differ only by
# those roundings, where the scales are applied and the summation order: measured 3.2e-7 at most
# relative to the row's largest magnitude. 1e-5 stays two decades under an e4m3 step (2^-4) of one
# element: a scale or block read wrongly breaks it.
EMULATED_REL_ERR = 1e-5


def _row_max_rel(got, want):
    """The largest |got - want| of each row over the row's largest |want|, worst row."""
    got, want = got.double(), want.double()
    scale = want.abs().amax(dim=1).clamp_min(1e-30)
    return ((got - want).abs().amax(dim=1) / scale).max().item()


@pytest.mark.parametrize("forward", ["both", "gate-up", "down"])
def test_the_emulated_forward_is_the_fp8_kernels_up_to_summation_order(ffn8, forward):
    """`fp8_ffn_forward(emulate=True)`: the FP8 GEMMs of each forward as their operands'
    quantise-dequantise images in the bf16 experts' GEMMs give the FP8 kernels' y and h13 within
    `EMULATED_REL_ERR` (fp32; an empty expert; H and F past one 128-block, the last ones partial),
    counting the same activation elements (the same quantisers); on a worst-case buffer (padding
    rows NaN and inf past offsets_E[-1]) the data rows are the unpadded buffer's, bit for bit, and
    no counter sees the padding."""
    from disagmoe.kernels.fp8_stats import ACTIVATIONS, AMAX, NONFINITE, SATURATED, TOTAL, UNDERFLOW, Fp8Stats

    counts, hidden, ffn = [5, 0, 12, 3], 160, 136
    x, offsets, w13, w2, _ = _inputs(counts, hidden, ffn, seed=31)
    tiles = ffn8.Fp8Tiles(**SMALL)
    weights = ffn8.Fp8ExpertWeights.quantize(w13, w2, forward=forward, backward="bf16")  # the forward's copies alone
    runs = {}
    for emulate in (False, True):
        stats = Fp8Stats("cpu")
        y, h13 = ffn8.fp8_ffn_forward(x, offsets, weights, tiles, save_for_backward=True, num_programs=3,
                                      stats=stats, forward=forward, bf16_weights=(w13, w2), emulate=emulate)
        runs[emulate] = (y, h13, stats.row(ACTIVATIONS).clone())
    (y, h13, acts), (y_emu, h13_emu, acts_emu) = runs[False], runs[True]
    assert _row_max_rel(y_emu, y) < EMULATED_REL_ERR and _row_max_rel(h13_emu, h13) < EMULATED_REL_ERR
    quantised = {"both": hidden + ffn, "gate-up": hidden, "down": ffn}[forward]  # x's and act's row widths
    assert acts[TOTAL] == acts_emu[TOTAL] == sum(counts) * quantised
    assert [acts[f] for f in (SATURATED, UNDERFLOW, NONFINITE)] == [acts_emu[f] for f in (SATURATED, UNDERFLOW,
                                                                                        NONFINITE)]
    as_float = lambda row: row[AMAX:AMAX + 1].to(torch.int32).view(torch.float32).item()  # noqa: E731
    assert as_float(acts_emu) == pytest.approx(as_float(acts), rel=1e-6)
    garbage = torch.full((7, hidden), float("nan"))
    garbage[::2] = float("inf")
    stats = Fp8Stats("cpu")
    y_pad, _ = ffn8.fp8_ffn_forward(torch.cat([x, garbage]), offsets, weights, tiles, save_for_backward=True,
                                    num_programs=3, stats=stats, forward=forward, bf16_weights=(w13, w2),
                                    emulate=True)
    assert torch.equal(y_pad[:len(x)], y_emu) and stats.row(ACTIVATIONS)[NONFINITE] == 0
    assert torch.equal(stats.row(ACTIVATIONS), acts_emu)


def test_the_emulated_operands_are_dequantised_in_pieces_as_they_are_whole(monkeypatch):
    """`_dequantized_rows` and `_dequantized_blocks` with pieces far smaller than an expert (a piece of
    one 128-row block row) and of two whole experts, K and N ending in partial blocks, a transposed view as the FP8 copies hand
    it over, an expert of zero rows) equal one whole `fp8.dequantize_*` rounded to the dtype."""
    from disagmoe.kernels import fp8, fp8_ffn

    gen = torch.Generator().manual_seed(3)
    w_EKN = torch.randn(3, 300, 200, generator=gen) * torch.exp2(torch.randn(3, 1, 1, generator=gen))
    q_EKN, s_EGB = fp8.quantize_blocks_reference(w_EKN)
    x_NK = torch.randn(9, 300, generator=gen)
    q_NK, s_NG = fp8.quantize_rows_reference(x_NK)
    for piece, dtype in itertools.product((128 * 200, 2 * 300 * 200), (torch.float32, torch.bfloat16)):
        monkeypatch.setattr(fp8_ffn, "DEQUANTIZE_PIECE", piece)  # one block row of K a piece; two experts a piece
        assert torch.equal(fp8_ffn._dequantized_blocks(q_EKN, s_EGB, dtype), fp8.dequantize_blocks(q_EKN, s_EGB).to(dtype))
        view_ENK = q_EKN.transpose(1, 2).contiguous().transpose(1, 2)  # the same values through a transposed view
        assert torch.equal(fp8_ffn._dequantized_blocks(view_ENK, s_EGB, dtype), fp8.dequantize_blocks(q_EKN, s_EGB).to(dtype))
        assert torch.equal(fp8_ffn._dequantized_rows(q_NK, s_NG, dtype), fp8.dequantize_rows(q_NK, s_NG).to(dtype))
    assert fp8_ffn._dequantized_blocks(q_EKN[:0], s_EGB[:0], torch.bfloat16).shape == (0, 300, 200)


@pytest.mark.gpu
@pytest.mark.parametrize("forward", ["both", "gate-up", "down"])
def test_gpu_the_emulated_forward_in_bf16_is_the_fp8_kernels(forward):
    """On the GPU, in bf16 as the A/B runs it: the emulated forward (`emulate=True`) against the FP8
    kernels at Qwen3-30B's expert shape (128 experts, H 2,048, F 768, ragged loads with an empty
    expert), h13 within 2e-2 of each row's norm, and y too where one GEMM is FP8: the dequantised
    operands' bf16 rounding (2^-9 each) and bf16 outputs, an order under one e4m3 step (2^-4), so a
    wrong scale or block breaks it. With both GEMMs FP8 y within 6e-2: the emulated path rounds act
    to bf16 before quantising it, the kernels quantise it from fp32 sums (or from bf16 h13), and that
    2^-9 moves some elements' e4m3 rounding by a step; the reference quantisers in plain torch at this
    shape (12 experts, 2,699 rows, CPU) put the two 1.5e-2 apart on a mean row and 3.3e-2 on the
    worst, and the H100 measured 3.7e-2 over ~38,000 rows (session 28). And both within 0.15 of the
    bf16 experts' own y on every row (the format's error: on random operands about 6e-2 of the whole
    output for both GEMMs, session 19; 0.15 the worst of ~38,000 rows with room)."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs a CUDA GPU with FP8 tensor cores")
    from disagmoe.kernels import fp8_ffn
    from disagmoe.kernels.moe_ffn import expert_ffn_triton

    gen = torch.Generator().manual_seed(5)
    counts = torch.randint(0, 600, (128,), generator=gen)
    counts[7] = 0
    x, offsets, w13, w2, _ = _inputs(counts.tolist(), 2048, 768, seed=6, device="cuda", dtype=torch.bfloat16)
    weights = fp8_ffn.Fp8ExpertWeights.quantize(w13, w2)
    tiles = fp8_ffn.Fp8Tiles.for_shape(len(x), 128, 2048, 768, x.device)
    runs = [fp8_ffn.fp8_ffn_forward(x, offsets, weights, tiles, save_for_backward=True, forward=forward,
                                    bf16_weights=(w13, w2), emulate=emulate) for emulate in (False, True)]
    (y, h13), (y_emu, h13_emu) = runs
    assert _row_rel_err(y_emu, y) < (6e-2 if forward == "both" else 2e-2) and _row_rel_err(h13_emu, h13) < 2e-2
    plain = expert_ffn_triton(x, offsets, w13, w2)
    assert _row_rel_err(y_emu, plain) < 0.15 and _row_rel_err(y, plain) < 0.15


def test_the_emulated_experts_train_from_their_own_pre_activations_and_refuse_an_fp8_backward(ffn8):
    """`expert_ffn_fp8(emulate=True, backward="bf16")`: y is the emulated forward's and every gradient
    the bf16 experts' backward from the emulated pre-activations, bit for bit (an empty expert), within
    the FFN's stated bounds of fp64; given x's e4m3 rows (`x_fp8`) it dequantises those, the same bits.
    An FP8 backward is not emulated: refused with the fix."""
    from disagmoe.kernels import fp8

    counts, hidden, ffn = [6, 0, 9, 4], 32, 40
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=32)
    tiles, weights = ffn8.Fp8Tiles(**SMALL), ffn8.Fp8ExpertWeights.quantize(w13, w2)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = ffn8.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles, num_programs=3, backward="bf16",
                            forward="gate-up", emulate=True)
    y.backward(dy)
    want_y, h13 = ffn8.fp8_ffn_forward(x, offsets, weights, tiles, save_for_backward=True, num_programs=3,
                                       forward="gate-up", bf16_weights=(w13, w2), emulate=True)
    assert torch.equal(y, want_y)
    _assert_the_bf16_backward_from(h13, y, leaves, counts, x, offsets, w13, w2, dy)
    given = ffn8.expert_ffn_fp8(x, offsets, w13, w2, tiles=tiles, num_programs=3, backward="bf16",
                                forward="gate-up", emulate=True, x_fp8=fp8.quantize_rows(x))
    assert torch.equal(given, y)
    with pytest.raises(ValueError, match="not emulated: set fp8_expert_backward: bf16"):
        ffn8.expert_ffn_fp8(x, offsets, w13, w2, backward="bf16-wgrad", emulate=True)


# The e4m3 weight copies each recipe (forward, backward) reads: the FP8 gate/up GEMM w13, the FP8
# down GEMM w2, an FP8 data gradient (backward fp8 or bf16-wgrad, whatever the forward) both transposes.
COPIES_READ = {
    ("both", "fp8"): {"w13", "w2", "w13_t", "w2_t"}, ("both", "bf16-wgrad"): {"w13", "w2", "w13_t", "w2_t"},
    ("both", "bf16"): {"w13", "w2"},
    ("gate-up", "fp8"): {"w13", "w13_t", "w2_t"}, ("gate-up", "bf16-wgrad"): {"w13", "w13_t", "w2_t"},
    ("gate-up", "bf16"): {"w13"},
    ("down", "fp8"): {"w2", "w13_t", "w2_t"}, ("down", "bf16-wgrad"): {"w2", "w13_t", "w2_t"},
    ("down", "bf16"): {"w2"},
}


def test_each_recipes_weight_copies_are_those_it_reads_and_no_other(ffn8):
    """`Fp8ExpertWeights.quantize(forward=, backward=)` makes the copies the recipe reads
    (`COPIES_READ`, `config.fp8_weight_copies`) and allocates no other: one byte a value each, no
    [E, K, N] storage behind a forward copy alone. Each is the default recipe's copy bit for bit, as
    K-major; reading another is a ValueError naming the recipe, and `check_serves` (what
    `expert_ffn_fp8` runs on given copies) refuses a recipe they do not serve, with the fix. Edge
    blocks in both dimensions (H 136, F 24)."""
    from disagmoe.config import FP8_EXPERT_BACKWARDS, FP8_EXPERT_FORWARDS, fp8_weight_copies

    x, offsets, w13, w2, _ = _inputs([3], 136, 24, seed=41)
    full = ffn8.Fp8ExpertWeights.quantize(w13, w2)
    assert set(full.copies) == {"w13", "w13_t", "w2", "w2_t"} and full.shape_EHF == (1, 136, 24)
    numel = {"w13": w13.numel(), "w13_t": w13.numel(), "w2": w2.numel(), "w2_t": w2.numel()}
    assert COPIES_READ.keys() == {(f, b) for f in FP8_EXPERT_FORWARDS for b in FP8_EXPERT_BACKWARDS}
    for (forward, backward), names in COPIES_READ.items():
        assert set(fp8_weight_copies(forward, backward)) == names
        weights = ffn8.Fp8ExpertWeights.quantize(w13, w2, forward=forward, backward=backward)
        assert set(weights.copies) == names and weights.shape_EHF == full.shape_EHF
        storages = {q.untyped_storage().data_ptr(): q.untyped_storage().nbytes() for q, _ in weights.copies.values()}
        assert sum(storages.values()) == sum(numel[name] for name in names), (forward, backward)
        for name in names:
            (q, s), (q_full, s_full) = getattr(weights, name), getattr(full, name)
            assert q.stride() == q_full.stride() and q.stride()[1] == 1  # K-major, as the GEMMs read B
            assert torch.equal(q.view(torch.uint8), q_full.view(torch.uint8)) and torch.equal(s, s_full)
        for name in {"w13", "w13_t", "w2", "w2_t"} - names:
            with pytest.raises(ValueError, match=f"made for forward {forward}, backward {backward}, which reads no "
                                                 f"{name} copy"):
                getattr(weights, name)
        weights.check_serves(forward, backward)
        full.check_serves(forward, backward)  # the default recipe's four serve any
    gate_up = ffn8.Fp8ExpertWeights.quantize(w13, w2, forward="gate-up", backward="bf16")
    with pytest.raises(ValueError, match=r"forward both, backward bf16 read the w2 weight copies, which these \(made "
                                         r"for forward gate-up, backward bf16\) lack: .*forward='both'"):
        ffn8.expert_ffn_fp8(x, offsets, w13, w2, weights=gate_up, forward="both", backward="bf16")
    with pytest.raises(ValueError, match="backward 'bf17'"):
        ffn8.Fp8ExpertWeights.quantize(w13, w2, backward="bf17")


@pytest.mark.slow  # every recipe's quantiser launches in the interpreter: ~5 s
def test_each_recipes_copies_are_requantised_in_place_to_the_fresh_copies_bits(ffn8):
    """`Fp8ExpertWeights.quantize(into=)`, what `RoutedExperts.prepare_fp8` runs once a step: every recipe's
    copies of new weights written into the tensors made before (the same addresses, no new copy), the bits a
    fresh quantisation makes; copies of another recipe or shape are refused, naming the fix."""
    _, _, w13, w2, _ = _inputs([3], 136, 24, seed=43)
    for forward, backward in COPIES_READ:
        kept = ffn8.Fp8ExpertWeights.quantize(w13, w2, forward=forward, backward=backward)
        addresses = [t.data_ptr() for t in kept.tensors()]
        new13, new2 = w13 * 3.0 + 0.01, w2 * 0.5 - 0.02
        fresh = ffn8.Fp8ExpertWeights.quantize(new13, new2, forward=forward, backward=backward)
        written = ffn8.Fp8ExpertWeights.quantize(new13, new2, forward=forward, backward=backward, into=kept)
        assert written is kept and [t.data_ptr() for t in kept.tensors()] == addresses, (forward, backward)
        for a, b in zip(kept.tensors(), fresh.tensors(), strict=True):
            same = torch.equal(a.view(torch.uint8), b.view(torch.uint8)) if a.dtype == torch.float8_e4m3fn else \
                torch.equal(a, b)  # e4m3 values by their bits, fp32 scales by value
            assert a.stride() == b.stride() and same, (forward, backward)
    other = ffn8.Fp8ExpertWeights.quantize(w13, w2, forward="down", backward="bf16")
    with pytest.raises(ValueError, match="into holds copies for forward down, backward bf16.*into=None"):
        ffn8.Fp8ExpertWeights.quantize(w13, w2, forward="both", backward="bf16", into=other)
    with pytest.raises(ValueError, match="into holds copies"):
        ffn8.Fp8ExpertWeights.quantize(w13[:, :128], w2[:, :, :128], forward="down", backward="bf16", into=other)


def test_mismatched_weights_are_refused(ffn8):
    x, offsets, w13, w2, _ = _inputs([3, 4], 16, 16, seed=0)
    with pytest.raises(ValueError, match="w2"):
        ffn8.expert_ffn_fp8(x, offsets, w13, w2[:, :8])


@pytest.mark.parametrize("bad", ["bf16 scales", "strided rows", "short scales", "down forward"])
def test_quantised_input_rows_of_the_wrong_kind_are_refused_with_what_makes_them(ffn8, bad):
    """`x_fp8` must be e4m3 rows shaped as x with contiguous fp32 scales on x's device, for a forward
    whose gate/up GEMM is FP8: anything else is refused before a launch, naming what makes them."""
    x, offsets, w13, w2, _ = _inputs([3, 0, 4], 256, 128, seed=0)
    q = torch.zeros(7, 256, dtype=torch.float8_e4m3fn)
    s = torch.ones(7, 2)
    forward = "both"
    if bad == "bf16 scales":
        s = s.bfloat16()
    elif bad == "strided rows":
        q = torch.zeros(256, 7, dtype=torch.float8_e4m3fn).t()
    elif bad == "short scales":
        s = s[:, :1]
    else:
        forward = "down"
    with pytest.raises(ValueError, match="quantize_then_permute"):
        ffn8.expert_ffn_fp8(x, offsets, w13, w2, x_fp8=(q, s), forward=forward)


@pytest.mark.slow  # two FP8 forwards and backwards with the permute kernels in the interpreter
@pytest.mark.parametrize("forward, backward", [("both", "fp8"), ("both", "bf16-wgrad"), ("both", "bf16"),
                                               ("gate-up", "bf16-wgrad")])
def test_unwritten_rows_give_the_written_rows_bits_and_their_tokens_the_permutes_gradient(interpreted, forward,
                                                                                           backward):
    """Given the tokens' e4m3 rows (`permute.quantize_then_permute`) and expert_input recomputed from
    their `RowSource`, the FFN reads no bf16 row: `UnwrittenRows` (the tokens and their destinations)
    in place of the permuted rows give the same y and weight gradients and, summed per token as the
    permute's backward sums them, the same token gradient, bit for bit (an expert without rows)."""
    _, _, ffn8, permute = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                      "disagmoe.kernels.fp8_ffn", "disagmoe.kernels.permute")
    from disagmoe.kernels.recompute import EXPERT_INPUT, RowSource, UnwrittenRows

    tokens, top_k, experts, hidden, ffn = 10, 3, 4, 32, 40
    gen = torch.Generator().manual_seed(13)
    x_TH = torch.randn(tokens, hidden, generator=gen)
    topk_TK = torch.randint(0, experts, (tokens, top_k), generator=gen)
    topk_TK[topk_TK == 1] = 2  # expert 1 gets no row
    w13 = torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5
    dy = torch.randn(tokens * top_k, hidden, generator=gen)
    offsets, dest = permute.pair_destinations(topk_TK, experts)
    source, x_fp8 = RowSource.of_permute(x_TH, dest), permute.quantize_then_permute(x_TH, dest)
    results = []
    for written in (True, False):
        leaves = [t.clone().requires_grad_() for t in (x_TH, w13, w2)]
        rows = (permute.permute_tokens(leaves[0], topk_TK, experts, destinations=(offsets, dest))[0] if written
                else UnwrittenRows(leaves[0], dest))
        y = ffn8.expert_ffn_fp8(rows, offsets, leaves[1], leaves[2], tiles=ffn8.Fp8Tiles(**SMALL), num_programs=3,
                                recompute=frozenset({EXPERT_INPUT}), source=source, backward=backward,
                                forward=forward, x_fp8=x_fp8)
        y.backward(dy)
        results.append((y.detach(), *(t.grad for t in leaves)))
    for written, unwritten in zip(*results, strict=True):
        assert torch.equal(written, unwritten)


@pytest.mark.parametrize("change, reader", [("x_fp8", "the forward's quantiser"),
                                            ("forward", "the bf16 gate/up GEMM"),
                                            ("source", "the backward"), ("recompute", "the backward")])
def test_unwritten_rows_are_refused_where_something_reads_the_rows(ffn8, change, reader):
    """`UnwrittenRows` without the e4m3 rows, under a bf16 gate/up GEMM, or with the rows kept for the
    backward (no source, or expert_input not recomputed) are refused before a launch, naming the
    reader; so are the rows' `RowSource` given to a forward that reads them."""
    from disagmoe.kernels.recompute import EXPERT_INPUT, RowSource, UnwrittenRows

    x_TH, dest = torch.zeros(4, 32), torch.arange(12, dtype=torch.int32).view(4, 3)
    offsets = torch.tensor([4, 8, 12], dtype=torch.int32)
    w13, w2 = torch.zeros(3, 32, 80), torch.zeros(3, 40, 32)
    source = RowSource.of_permute(x_TH, dest)
    call = dict(recompute=frozenset({EXPERT_INPUT}), source=source, forward="both",
                x_fp8=(torch.zeros(12, 32, dtype=torch.float8_e4m3fn), torch.ones(12, 1)))
    call[change] = {"x_fp8": None, "forward": "down", "source": None, "recompute": frozenset()}[change]
    with pytest.raises(ValueError, match=f"not written \\(UnwrittenRows\\) but {reader}"):
        ffn8.expert_ffn_fp8(UnwrittenRows(x_TH, dest), offsets, w13, w2, **call)
    if change in ("x_fp8", "forward"):
        with pytest.raises(ValueError, match=f"given as their RowSource but {reader}"):
            ffn8.fp8_ffn_forward(source, offsets, None, ffn8.Fp8Tiles(), x_fp8=call["x_fp8"], forward=call["forward"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 (sm_89+)")
@pytest.mark.parametrize("counts,hidden,ffn", [([300, 0, 1000, 7], 512, 384), ([129, 511, 64, 3, 900], 1024, 256)])
@pytest.mark.parametrize("backward,forward", [("fp8", "both"), ("bf16-wgrad", "both"), ("bf16", "both"),
                                              ("bf16", "gate-up"), ("bf16", "down"), ("bf16-wgrad", "down")])
def test_gpu_fp8_ffn_forward_backward(counts, hidden, ffn, backward, forward):
    """bf16 operands on tensor cores, default tiles, each backward recipe and each forward's FP8
    GEMMs: within the stated bounds of fp64 autograd."""
    from disagmoe.kernels import fp8_ffn

    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=3, device="cuda", dtype=torch.bfloat16)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    y = fp8_ffn.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], backward=backward, forward=forward)
    y.backward(dy)
    assert y.dtype == torch.bfloat16 and leaves[1].grad.dtype == torch.bfloat16
    _check(counts, (y, *(t.grad for t in leaves)), _reference_grads(x, offsets, w13, w2, dy))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper GPU (sm_90: the Gluon kernel)")
def test_gpu_the_gluon_kernels_give_the_triton_kernels_results(monkeypatch):
    """On Hopper the plain row GEMMs (down, gate/up data gradient) and, switched on, the weight
    gradients and the split SwiGLU GEMMs run the Gluon kernels where their operands fit (K and N
    multiples of 128 here): y, dx and the weight gradients within 2e-2 of the FFN with the Triton
    kernels throughout (the same sums per 128-deep slice, but the split SwiGLU quantises act from h13
    rounded to bf16 where the fused epilogue reads the fp32 sums: about one e4m3 value in 64 lands a
    step apart, some 1e-2 of the FP8 error's 6e-2), and the Gluon kernels were launched
    (rows: twice plain plus twice for the split SwiGLU GEMMs; weight gradient: twice)."""
    from disagmoe.kernels import fp8_ffn, fp8_gluon

    counts, hidden, ffn = [300, 0, 1000, 7, 129], 512, 384
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=4, device="cuda", dtype=torch.bfloat16)
    calls = []
    for name in ("gluon_fp8_rows_gemm", "gluon_fp8_weight_grad"):
        kernel = getattr(fp8_gluon, name)
        monkeypatch.setattr(fp8_gluon, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw))
    results = {}
    for enabled in (True, False):
        with fp8_ffn.gluon_paths(rows=enabled, wgrad=enabled, swiglu=enabled):
            leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
            y = fp8_ffn.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], backward="fp8")
            y.backward(dy)
            results[enabled] = (y, *(t.grad for t in leaves))
    assert sorted(calls) == ["gluon_fp8_rows_gemm"] * 4 + ["gluon_fp8_weight_grad"] * 2
    for got, want in zip(results[True], results[False], strict=True):
        assert torch.isfinite(got).all()
        assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 2e-2


def test_the_backward_drops_each_e4m3_copy_after_its_last_reader(ffn8, monkeypatch):
    """The backward's quantised copies die as soon as their last GEMM has read them (what
    `roofline.memory.expert_row_grad_bytes` counts under fp8): d y and d h13 are each quantised
    both ways (`_quantize_both_ways`: rows, then token groups), so their two copies are alive together
    before their first GEMM; d y's rows die after the d h13 GEMM, d y's token groups with act's after the
    w2 gradient, before d h13 is quantised; d h13's rows after dx, its token groups with x's after
    the w13 gradient. No other quantiser runs. At most 2 max(H, 2F) e4m3 values per row are
    alive at a launch. Observed by weak references taken as each copy is made."""
    import weakref

    fp8 = ffn8.fp8
    counts, hidden, ffn = [4, 0, 11, 1], 32, 40
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=5)
    tiles, weights = ffn8.Fp8Tiles(**SMALL), ffn8.Fp8ExpertWeights.quantize(w13, w2)
    _, h13 = ffn8.fp8_ffn_forward(x, offsets, weights, tiles, save_for_backward=True, num_programs=3)
    copies, seen = [], []  # (name, weakrefs of values and scales); at each launch, the names alive

    def alive():
        return [name for name, refs in copies if any(ref() is not None for ref in refs)]

    def recording(function, names, parts):
        def wrapper(*args, **kwargs):
            seen.append((function.__name__, alive()))
            out = function(*args, **kwargs)
            for part in parts(out):
                copies.append((names.pop(0), [weakref.ref(t) for t in part]))
            return out
        return wrapper

    def launching(function):
        def wrapper(*args, **kwargs):
            seen.append((function.__name__, alive()))
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(fp8, "quantize_rows", recording(fp8.quantize_rows, ["dy rows", "dh13 rows"], lambda out: (out,)))
    monkeypatch.setattr(fp8, "quantize_token_groups", recording(
        fp8.quantize_token_groups, ["dy tokens", "act tokens", "dh13 tokens", "x tokens"], lambda out: (out[:2],)))
    for name in ("quantize_rows_and_token_groups", "fp8_swiglu_grad_gemm", "fp8_rows_gemm", "fp8_weight_grad"):
        monkeypatch.setattr(fp8, name, launching(getattr(fp8, name)))
    dx, dw13, dw2 = ffn8.fp8_ffn_backward(dy, x, offsets, weights, h13, tiles, num_programs=3)
    assert seen == [
        ("quantize_rows", []),
        ("quantize_token_groups", ["dy rows"]),
        ("fp8_swiglu_grad_gemm", ["dy rows", "dy tokens"]),
        ("quantize_token_groups", ["dy tokens"]),
        ("fp8_weight_grad", ["dy tokens", "act tokens"]),
        ("quantize_rows", []),
        ("quantize_token_groups", ["dh13 rows"]),
        ("fp8_rows_gemm", ["dh13 rows", "dh13 tokens"]),
        ("quantize_token_groups", ["dh13 tokens"]),
        ("fp8_weight_grad", ["dh13 tokens", "x tokens"]),
    ], seen
    assert alive() == []  # nothing quantised outlives the backward either
    assert dx.shape == x.shape and dw13.shape == w13.shape and dw2.shape == w2.shape
    values = {"dy rows": hidden, "dy tokens": hidden, "act tokens": ffn, "x tokens": hidden,
              "dh13 rows": 2 * ffn, "dh13 tokens": 2 * ffn}
    peak = max(sum(values[name] for name in names) for _, names in seen)
    assert peak == 2 * max(hidden, 2 * ffn)


@pytest.mark.slow  # interpreted FFN forward and backward
@pytest.mark.parametrize("choice,ran", [(dict(block_m=256), (256, False)), (dict(tma_store=True), (128, True))],
                         ids=["256-rows", "tma-store"])
def test_a_forwards_gluon_row_gemm_choices_reach_its_backward(ffn8, monkeypatch, choice, ran):
    """`gluon_paths(block_m=256)` or `gluon_paths(tma_store=True)` around the forward alone (as `bench
    experts` times the backward outside it): every Gluon row GEMM of the forward and of its backward
    runs at the forward's tile and epilogue, the ones the forward's saved choices hold (a stand-in
    records the launches: the CPU runs no Gluon); both restored on the way out."""
    from disagmoe.kernels import fp8_gluon

    fp8 = ffn8.fp8
    kernels_seen = []

    def stand_in(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, *, out=None, out_dtype=torch.bfloat16, block_m=128,
                 tma_store=False, **_):
        kernels_seen.append((block_m, tma_store))
        result = fp8.fp8_rows_gemm_reference(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB)
        if out is None:
            return result.to(out_dtype)
        out.copy_(result)
        return out

    monkeypatch.setattr(fp8_gluon, "gluon_fp8_rows_gemm", stand_in)
    monkeypatch.setattr(ffn8, "_gluon_rows_take", lambda a, b, num_programs: True)
    counts, hidden, ffn = [5, 0, 9], 128, 128
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=6)
    tiles = ffn8.Fp8Tiles(**SMALL)
    leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
    with ffn8.gluon_paths(rows=True, swiglu=True, **choice):
        y = ffn8.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles, num_programs=3)
    forward = len(kernels_seen)
    y.backward(dy)
    assert forward == 2 and len(kernels_seen) == 4 and set(kernels_seen) == {ran}
    assert (ffn8._gluon.block_m, ffn8._gluon.tma_store) == (128, False)  # restored on the way out


@pytest.mark.slow  # interpreted FFN forward and backward, twice
@pytest.mark.parametrize("backward", ["bf16-wgrad", "fp8"])
def test_the_split_swiglu_pass_quantises_d_h13_unless_the_step_counts(ffn8, monkeypatch, backward):
    """Both backwards with FP8 data gradients on the split SwiGLU path (a stand-in for the Gluon row GEMM:
    the CPU runs no Gluon): without counters the SwiGLU-gradient pass quantises d h13's rows as it writes
    them (`fp8.swiglu_grad_rows_quantized`, no `quantize_rows` of d h13; the all-FP8 backward quantises
    its token groups alone after), with counters d h13 is quantised on its own (counted); the gradients
    are the same bits either way."""
    from disagmoe.kernels import fp8_gluon
    from disagmoe.kernels.fp8_stats import Fp8Stats

    fp8 = ffn8.fp8

    def stand_in(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB, *, out=None, out_dtype=torch.bfloat16, block_m=128, **_):
        result = fp8.fp8_rows_gemm_reference(a_MK, sa_MG, offsets_E, b_EKN, sb_EGB)
        return result.to(out_dtype) if out is None else out.copy_(result)

    fused, quantised = [], []
    plain_pass, plain_quantise = fp8.swiglu_grad_rows_quantized, fp8.quantize_rows
    monkeypatch.setattr(fp8, "swiglu_grad_rows_quantized", lambda *a, **k: fused.append(1) or plain_pass(*a, **k))
    monkeypatch.setattr(fp8, "quantize_rows", lambda x, *a, **k: quantised.append(x.shape[1]) or plain_quantise(x, *a, **k))
    monkeypatch.setattr(fp8_gluon, "gluon_fp8_rows_gemm", stand_in)
    monkeypatch.setattr(ffn8, "_gluon_rows_take", lambda a, b, num_programs: True)
    counts, hidden, ffn = [5, 0, 9], 128, 128
    x, offsets, w13, w2, dy = _inputs(counts, hidden, ffn, seed=8)
    tiles = ffn8.Fp8Tiles(**SMALL)
    grads = []
    for stats in (None, Fp8Stats("cpu")):
        fused.clear(), quantised.clear()
        leaves = [t.clone().requires_grad_() for t in (x, w13, w2)]
        with ffn8.gluon_paths(rows=True, swiglu=True):
            y = ffn8.expert_ffn_fp8(leaves[0], offsets, leaves[1], leaves[2], tiles=tiles, num_programs=3,
                                    stats=stats, backward=backward)
            quantised.clear()  # the forward's
            y.backward(dy)
        grads.append([t.grad for t in leaves])
        assert (len(fused), 2 * ffn in quantised) == ((1, False) if stats is None else (0, True)), (fused, quantised)
    for plain, counted in zip(*grads, strict=True):
        assert torch.equal(plain, counted)
