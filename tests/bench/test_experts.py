"""The benchmark's CPU-checkable parts: shapes, routing, the torch baseline's permute/combine."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from disagmoe.bench import experts as bench
from disagmoe.model_ref import load_model
from disagmoe.kernels.permute import combine_reference, permute_reference


def test_shapes_come_from_the_presets_split_over_expert_parallel_ranks():
    shape = bench.SHAPES["deepseek-v3-ep8"]
    model = load_model("deepseek-v3")
    assert shape.dims == (model.num_experts // 8, model.hidden_size, model.expert_ffn_size,
                          model.top_k)
    experts, hidden, ffn, _ = shape.dims
    assert shape.flops("fwd") == 3 * 2 * shape.pairs * hidden * ffn
    assert shape.flops("fwd+bwd") == 3 * shape.flops("fwd")


def test_zipf_routing_is_seeded_and_skewed():
    a = bench.zipf_routing(2048, 4, 16, seed=3)
    assert torch.equal(a, bench.zipf_routing(2048, 4, 16, seed=3))
    loads = torch.bincount(a.reshape(-1), minlength=16).float()
    assert a.min() >= 0 and a.max() < 16
    assert loads.max() / loads.mean() > 3  # Zipf(1.2) over 16 experts: the top one takes > 3x mean


def test_torch_baseline_permute_and_combine_match_the_references():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 24, generator=gen)
    idx = torch.randint(0, 6, (50, 3), generator=gen)
    weights = torch.rand(50, 3, generator=gen)
    rows, offsets, dest = bench.torch_permute(x, idx, 6)
    want_rows, want_offsets, want_dest = permute_reference(x, idx, 6)
    assert torch.equal(rows, want_rows) and torch.equal(offsets, want_offsets)
    assert torch.equal(dest.int(), want_dest)
    torch.testing.assert_close(bench.torch_combine(rows, dest, weights),
                               combine_reference(rows, want_dest, weights))


def test_markdown_table_has_a_row_per_shape_and_pass():
    record = {"ceiling_tflops": 800.0, "shapes": [{
        "name": "s", "experts": 2, "hidden": 8, "ffn": 4, "pairs": 16, "load_max_over_mean": 1.5,
        "tflops": {b: {p: 400.0 + i for p in bench.PASSES} for i, b in enumerate(bench.BACKENDS)},
        "rel_err": {"triton": {"y": 1e-3, "dx": 2e-3}}}]}
    json.dumps(record)
    lines = bench.markdown_table(record).splitlines()
    assert len(lines) == 2 + len(bench.PASSES)
    assert "400 (50%)" in lines[2] and "1.00x" in lines[2]  # 400 / 401
    assert lines[3].endswith("2.0e-03 |")


def test_markdown_table_adds_the_fp8_ratio_and_error_when_asked_for():
    backends = (*bench.BACKENDS, bench.FP8_BACKEND)
    record = {"ceiling_tflops": 800.0, "shapes": [{
        "name": "s", "experts": 2, "hidden": 8, "ffn": 4, "pairs": 16, "load_max_over_mean": 1.5,
        "tflops": {b: {p: 400.0 * (1.5 if b == bench.FP8_BACKEND else 1.0) for p in bench.PASSES} for b in backends},
        "rel_err": {"triton": {"y": 1e-3, "dx": 2e-3}, bench.FP8_BACKEND: {"y": 4e-2, "dx": 6e-2}}}]}
    lines = bench.markdown_table(record).splitlines()
    assert f"{bench.FP8_BACKEND} / triton" in lines[0] and f"{bench.FP8_BACKEND} rel err" in lines[0]
    assert lines[2].endswith("| 1.50x | 4.0e-02 |") and lines[3].endswith("| 1.50x | 6.0e-02 |")


def test_the_gluon_bf16_block_is_set_against_our_triton_one_before_the_fp8_backends():
    """`triton:gluon` (our bf16 block on the Gluon kernels): its rate, and its ratio to `triton` and its error
    in columns of their own, ahead of the FP8 backends'."""
    backends = (*bench.BACKENDS, bench.GLUON_BACKEND, bench.FP8_BACKEND)
    rates = {bench.GLUON_BACKEND: 500.0, bench.FP8_BACKEND: 600.0}
    record = {"ceiling_tflops": 800.0, "shapes": [{
        "name": "s", "experts": 2, "hidden": 8, "ffn": 4, "pairs": 16, "load_max_over_mean": 1.5,
        "tflops": {b: {p: rates.get(b, 400.0) for p in bench.PASSES} for b in backends},
        "rel_err": {"triton": {"y": 1e-3, "dx": 2e-3}, bench.GLUON_BACKEND: {"y": 1e-3, "dx": 3e-3},
                    bench.FP8_BACKEND: {"y": 4e-2, "dx": 6e-2}}}]}
    head, rows = bench.table_rows(record)
    at = head.index(f"{bench.GLUON_BACKEND} / triton")
    assert head[at + 1] == f"{bench.GLUON_BACKEND} rel err" and head[at + 2] == f"{bench.FP8_BACKEND} / triton"
    fwd, both = (dict(zip(head, r, strict=True)) for r in rows)
    assert fwd[f"{bench.GLUON_BACKEND} TFLOP/s (% of ceiling)"] == "500 (62%)"
    assert fwd[f"{bench.GLUON_BACKEND} / triton"] == "1.25x" and both[f"{bench.GLUON_BACKEND} rel err"] == "3.0e-03"


def test_the_tma_store_tiles_write_every_launch_of_our_triton_kernel_by_tma():
    """`FFNTiles.on_tma_store` (`triton:tma-store`): every launch on our Triton kernel (never the library's or the
    Gluon kernels) with TMA loads and stores at its own tile, down dgrad on its split epilogue's plain GEMM, the
    weight gradients reduce-adding atomically; a tile whose store buffer does not fit beside its ring (the
    heuristic's 128 x 256 x 64 down tile at 4 stages) loses a stage, one whose ring never makes room keeps pointer
    stores. Set against `triton` in the table, as the Gluon block is."""
    from disagmoe.kernels.tile_configs import TileConfig, heuristic, tma_store_fits

    tiles = bench.FFNTiles(**{role: dataclasses.replace(heuristic(role), library=role == "down", gluon=role == "gate_up")
                              for role in ("gate_up", "down", "down_dgrad", "gate_up_dgrad", "wgrad_w2",
                                           "wgrad_w13")})
    stored = tiles.on_tma_store()
    for role in ("gate_up", "down", "down_dgrad", "gate_up_dgrad", "wgrad_w2", "wgrad_w13"):
        got, before = getattr(stored, role), getattr(tiles, role)
        fit_role = "down" if role == "down_dgrad" else role
        assert got.tma and got.tma_store and not got.library and not got.gluon and tma_store_fits(got, fit_role), role
        assert (got.block_m, got.block_n, got.block_k) == (before.block_m, before.block_n, before.block_k)
    assert (tiles.down.num_stages, stored.down.num_stages) == (4, 3)  # 48 KiB a stage and a 64 KiB buffer
    assert stored.gate_up.num_stages == tiles.gate_up.num_stages and stored.down_dgrad.split_epilogue
    assert stored.wgrad_w13.atomic_accumulate and stored.wgrad_w2.atomic_accumulate
    huge = TileConfig(block_m=256, block_n=256, block_k=128, num_stages=3)  # 192 KiB a stage: never fits
    assert not bench.FFNTiles.uniform(huge).on_tma_store().down.tma_store
    assert bench.TMA_STORE_BACKEND in bench.ALL_BACKENDS
    backends = (*bench.BACKENDS, bench.TMA_STORE_BACKEND)
    record = {"ceiling_tflops": 800.0, "shapes": [{
        "name": "s", "experts": 2, "hidden": 8, "ffn": 4, "pairs": 16, "load_max_over_mean": 1.5,
        "tflops": {b: {p: 440.0 if b == bench.TMA_STORE_BACKEND else 400.0 for p in bench.PASSES} for b in backends},
        "rel_err": {"triton": {"y": 1e-3}, bench.TMA_STORE_BACKEND: {"y": 1e-3}}}]}
    head, rows = bench.table_rows(record)
    assert dict(zip(head, rows[0], strict=True))[f"{bench.TMA_STORE_BACKEND} / triton"] == "1.10x"


def test_the_tma_store_block_is_refused_before_hopper_with_the_fix(monkeypatch):
    """`triton:tma-store` on a GPU older than Hopper (no TMA): a ValueError that says to leave it out, before any
    timing (the device is faked: the check reads only its compute capability)."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"triton:tma-store .*needs Hopper .*sm_80: leave it out of --backend"):
        bench.run(["mixtral-8x7b"], ["grouped_mm", "triton", bench.TMA_STORE_BACKEND], 1, 1, 1)


def test_the_gluon_tiles_send_every_launch_the_gluon_kernels_take_there():
    """`FFNTiles.on_gluon`: gate/up, down and the gate/up data gradient on the Gluon kernels (TMA stores, never the
    library's), down dgrad on its split epilogue's Gluon plain GEMM, the weight gradients on the Gluon weight
    gradient (128-column tiles, 4 stages, the main gradient reduce-added by TMA, atomically from registers where
    not), every Triton field as it was."""
    from disagmoe.kernels.tile_configs import heuristic

    tiles = bench.FFNTiles(**{role: dataclasses.replace(heuristic(role), library=role == "down")
                              for role in ("gate_up", "down", "down_dgrad", "gate_up_dgrad", "wgrad_w2",
                                           "wgrad_w13")})
    gluon = tiles.on_gluon()
    for role in ("gate_up", "down", "gate_up_dgrad", "down_dgrad"):
        got = getattr(gluon, role)
        assert got.gluon and got.gluon_tma_store and not got.library
        assert (got.block_m, got.block_n, got.num_stages) == (getattr(tiles, role).block_m,
                                                             getattr(tiles, role).block_n,
                                                             getattr(tiles, role).num_stages)
    assert gluon.down_dgrad.split_epilogue and not tiles.on_gluon(tma_store=False).down.gluon_tma_store
    for role in ("wgrad_w2", "wgrad_w13"):
        got, before = getattr(gluon, role), getattr(tiles, role)
        assert got.gluon and got.gluon_tma_store and got.atomic_accumulate and not got.library
        assert (got.gluon_block_n, got.gluon_stages) == (128, 4)
        assert (got.block_m, got.block_n, got.block_k, got.num_stages) == (before.block_m, before.block_n,
                                                                            before.block_k, before.num_stages)


def test_the_librarys_fp8_forward_gets_its_own_columns_and_no_backward_row():
    """With scaled-grouped-mm in the record: its forward rate, '-' for the fwd+bwd it has not, each
    FP8 backend of ours against it (forward only) and its forward error."""
    backends = (*bench.BACKENDS, bench.FP8_BACKEND, bench.LIBRARY_FP8_BACKEND)
    tflops = {b: {p: 400.0 for p in bench.passes_of(b)} for b in backends}
    tflops[bench.FP8_BACKEND] = {"fwd": 600.0, "fwd+bwd": 500.0}
    tflops[bench.LIBRARY_FP8_BACKEND] = {"fwd": 300.0}
    record = {"ceiling_tflops": 800.0, "shapes": [{
        "name": "s", "experts": 2, "hidden": 8, "ffn": 4, "pairs": 16, "load_max_over_mean": 1.5, "tflops": tflops,
        "rel_err": {"triton": {"y": 1e-3, "dx": 2e-3}, bench.FP8_BACKEND: {"y": 4e-2, "dx": 6e-2},
                    bench.LIBRARY_FP8_BACKEND: {"y": 3e-2}}}]}
    head, rows = bench.table_rows(record)
    assert head[-2:] == [f"{bench.FP8_BACKEND} / {bench.LIBRARY_FP8_BACKEND}", f"{bench.LIBRARY_FP8_BACKEND} rel err"]
    fwd, both = (dict(zip(head, r, strict=True)) for r in rows)
    assert fwd[f"{bench.LIBRARY_FP8_BACKEND} TFLOP/s (% of ceiling)"] == "300 (38%)"
    assert fwd[f"{bench.FP8_BACKEND} / {bench.LIBRARY_FP8_BACKEND}"] == "2.00x"
    assert fwd[f"{bench.LIBRARY_FP8_BACKEND} rel err"] == "3.0e-02"
    assert both[f"{bench.LIBRARY_FP8_BACKEND} TFLOP/s (% of ceiling)"] == "-"
    assert both[f"{bench.FP8_BACKEND} / {bench.LIBRARY_FP8_BACKEND}"] == "-"
    assert both[f"{bench.LIBRARY_FP8_BACKEND} rel err"] == "-"
    assert bench.markdown_table(record).count("\n") == 3


def test_the_librarys_fp8_layout_aligns_every_group_to_16_rows_without_a_host_sync():
    """Rows of ragged groups (an empty one, one of exactly 16, one past it) placed at 16-aligned
    group starts, in order, inside a capacity that holds any routing; the gaps stay unused."""
    offsets = torch.tensor([5, 5, 21, 38], dtype=torch.int32)  # counts 5, 0, 16, 17
    dest, aligned, capacity = bench.library_fp8_layout(offsets, 38)
    assert aligned.tolist() == [16, 16, 32, 64] and aligned.dtype == torch.int32
    assert capacity == 38 + 15 * 4 and int(aligned[-1]) <= capacity
    want = [*range(0, 5), *range(16, 32), *range(32, 49)]
    assert dest.tolist() == want and dest.dtype == torch.int64


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                    reason="torch._scaled_grouped_mm runs on sm_90")
def test_cuda_the_librarys_fp8_block_tracks_the_reference():
    """The scaled-grouped-mm block's forward on ragged Zipf routing (bf16) within row-wise FP8's
    error of the fp32 reference block, and its weights quantised once."""
    shape = bench.ExpertShape("t", "qwen3-30b-a3b", 4, 4096)
    inputs = bench.make_inputs(shape, torch.device("cuda"))
    dy = torch.randn(inputs[0].shape, device="cuda", dtype=torch.bfloat16)
    block = bench.make_block(bench.LIBRARY_FP8_BACKEND)
    err = bench.forward_error(block, inputs, dy)["y"]
    assert err < 0.1, err
    with torch.no_grad():
        assert torch.equal(block(*inputs), block(*inputs))


def _interpreted_fp8_block(interpreted):
    """(kernels.fp8_ffn, bench.experts, small FP8 tiles) for the FP8 block under the CPU interpreter."""
    *_, fp8_ffn, experts = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                       "disagmoe.kernels.permute", "disagmoe.kernels.fp8_ffn",
                                       "disagmoe.bench.experts")
    from disagmoe.kernels.tile_configs import TileConfig

    small = TileConfig(block_m=16, block_n=32, block_k=128, group_m=2, num_warps=4, num_stages=1)
    return fp8_ffn, experts, fp8_ffn.Fp8Tiles(rows=small, swiglu=TileConfig(block_m=16, block_n=128, block_k=128),
                                              wgrad=TileConfig(block_m=128, block_n=32, block_k=32))


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
def test_the_fp8_block_matches_the_reference_and_quantises_each_weight_once(interpreted):
    """The triton-fp8 block (our permute and combine around the all-FP8 expert FFN) forward and
    backward against the fp32 reference block, within the FP8 FFN's stated bounds (worst rows of
    y and dx, kernels/fp8_ffn tests); the weights' FP8 copies are made at the first call only."""
    fp8_ffn, experts, tiles = _interpreted_fp8_block(interpreted)
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(9, 32, generator=gen), torch.randn(3, 32, 48, generator=gen) / 32**0.5, \
        torch.randn(3, 24, 32, generator=gen) / 24**0.5
    idx, weights = torch.randint(0, 2, (9, 2), generator=gen), torch.rand(9, 2, generator=gen)
    calls = []
    quantize = fp8_ffn.Fp8ExpertWeights.quantize
    block = experts.make_block(experts.FP8_BACKEND, fp8_tiles=tiles)
    leaves = [x.clone().requires_grad_(), w13.clone().requires_grad_(), w2.clone().requires_grad_()]

    def counted(cls, a, b, **recipe):
        calls.append(recipe)
        return quantize(a, b, **recipe)

    try:
        fp8_ffn.Fp8ExpertWeights.quantize = classmethod(counted)
        y = block(leaves[0], idx, weights, leaves[1], leaves[2])
        block(x, idx, weights, leaves[1], leaves[2])
    finally:
        fp8_ffn.Fp8ExpertWeights.quantize = quantize
    assert calls == [{"forward": "both", "backward": "bf16-wgrad"}]  # once, for the default recipe
    dy = torch.randn(y.shape, generator=gen)
    y.backward(dy)
    ref = [t.double().clone().requires_grad_() for t in (x, w13, w2)]
    y_ref = experts.reference_block(ref[0], idx, weights.double(), ref[1], ref[2])
    y_ref.backward(dy.double())
    row = lambda a, b: ((a.double() - b).norm(dim=1) / b.norm(dim=1)).max().item()  # noqa: E731
    assert row(y, y_ref) < 0.15 and row(leaves[0].grad, ref[0].grad) < 0.2
    assert ((leaves[1].grad.double() - ref[1].grad).norm() / ref[1].grad.norm()).item() < 0.12


def test_precision_fp8_times_our_fp8_experts_beside_our_bf16_ones():
    from disagmoe.bench.experts import BACKENDS, FP8_BACKEND, LIBRARY_FP8_BACKEND, backends_for

    assert backends_for(None, "bf16") == list(BACKENDS)
    assert backends_for(None, "fp8") == [*BACKENDS, FP8_BACKEND, LIBRARY_FP8_BACKEND]
    assert backends_for(["grouped_mm"], "fp8") == ["grouped_mm", "triton", FP8_BACKEND, LIBRARY_FP8_BACKEND]
    with pytest.raises(ValueError, match="choose bf16 or fp8"):
        backends_for(None, "fp4")


def test_the_variant_backends_run_the_fp8_block_with_their_one_choice_changed(monkeypatch):
    """`--backend triton-fp8:fp8-wgrad | gluon-wgrad | gluon | gluon-256 | gluon-tma-store |
    gluon-tma-store-wgrad | bf16-backward | down-forward | down-forward-pass | run... | run-256 | gluon-256-wgrad`: FP8 backends at the tuned tiles whose
    forwards run with one choice changed from the FFN's defaults (a Gluon path through `fp8_ffn.gluon_paths`, which
    their backward keeps; which
    backward GEMMs run in FP8; or which forward ones), the defaults restored after each call, each
    making the weight copies its recipe reads; plain `triton-fp8` runs the defaults."""
    from disagmoe.kernels import fp8_ffn
    from disagmoe.kernels.fp8_ffn import Fp8Tiles

    assert bench.variant_of(f"{bench.FP8_BACKEND}:gluon-tma-store") == (
        {"rows": True, "swiglu": True, "tma_store": True}, fp8_ffn.DEFAULT_BACKWARD, fp8_ffn.DEFAULT_FORWARD)
    from disagmoe.config import DEFAULT_FP8_EXPERT_BACKWARD, RUN_FP8_EXPERT_FORWARD, RUN_FP8_GLUON, RUN_FP8_GLUON_STORE

    # `run`: a training run's defaults, whatever they become
    tma = RUN_FP8_GLUON and RUN_FP8_GLUON_STORE == "tma"
    assert bench.variant_of(f"{bench.FP8_BACKEND}:run") == (
        {"rows": RUN_FP8_GLUON, "swiglu": RUN_FP8_GLUON, "tma_store": tma, **({"block_m": 128} if tma else {})},
        DEFAULT_FP8_EXPERT_BACKWARD, RUN_FP8_EXPERT_FORWARD)
    from disagmoe.bench.calibrate import fp8_probe_recipe

    recipe, gluon = fp8_probe_recipe()  # what the planner's FP8 curve measures: the same block
    assert bench.FP8_VARIANTS["run"] == {**gluon, **recipe}
    tiles = Fp8Tiles()
    for backend in bench.VARIANT_BACKENDS:
        assert bench.is_fp8(backend) and bench.needs_fp8(backend)
        assert bench.fp8_tiles_for(backend, tiles) is tiles
    seen = []
    monkeypatch.setattr(bench, "expert_ffn_fp8", lambda rows, *a, backward, forward, **k: seen.append(
        (fp8_ffn._gluon.rows, fp8_ffn._gluon.wgrad, fp8_ffn._gluon.swiglu, fp8_ffn._gluon.block_m,
         fp8_ffn._gluon.tma_store, fp8_ffn._gluon.act_epilogue, backward, forward)) or rows)
    made = []
    monkeypatch.setattr(bench.Fp8ExpertWeights, "quantize", classmethod(
        lambda cls, a, b, *, forward, backward: made.append((forward, backward))))
    monkeypatch.setattr(bench, "permute_tokens", lambda x, idx, experts: (x, None, None))
    slots = []  # whether the combine was handed a slot for dy's e4m3 rows (`permute.Fp8RowGradSlot`)
    monkeypatch.setattr(bench, "combine_rows", lambda rows, dest, weights, grad_slot=None: slots.append(
        grad_slot is not None) or rows)
    x, idx, weights = torch.randn(6, 8), torch.randint(0, 2, (6, 2)), torch.rand(6, 2)
    w13, w2 = torch.randn(2, 8, 16), torch.randn(2, 8, 8)
    choices = lambda: (fp8_ffn._gluon.rows, fp8_ffn._gluon.wgrad, fp8_ffn._gluon.swiglu,  # noqa: E731
                       fp8_ffn._gluon.block_m, fp8_ffn._gluon.tma_store, fp8_ffn._gluon.act_epilogue)
    defaults = choices()
    assert defaults == (False, False, False, 128, False, True)  # the FFN's own defaults (`fp8_ffn._GluonChoices`)
    for backend in (*bench.VARIANT_BACKENDS, bench.FP8_BACKEND):
        bench.make_block(backend, fp8_tiles=tiles)(x, idx, weights, w13, w2)
        assert choices() == defaults
    assert seen == [(False, False, False, 128, False, True, "fp8", "both"),
                    (False, True, False, 128, False, True, "fp8", "both"),
                    (True, False, True, 128, False, True, "bf16-wgrad", "both"),
                    (True, False, True, 256, False, True, "bf16-wgrad", "both"),
                    (True, False, True, 128, True, True, "bf16-wgrad", "both"),
                    (True, True, True, 128, True, True, "fp8", "both"),
                    (False, False, False, 128, False, True, "bf16", "both"),
                    (False, False, False, 128, False, True, "bf16-wgrad", "down"),
                    (False, False, False, 128, False, False, "bf16-wgrad", "down"),
                    (False, False, False, 128, False, True, "bf16-wgrad", "down"),
                    (True, False, True, 128, True, True, "bf16-wgrad", "down"),  # run: a run's defaults
                    (True, False, True, 128, True, False, "bf16-wgrad", "down"),  # run-act-pass
                    (True, False, True, 128, True, True, "bf16-wgrad", "down"),  # run-dy-pass
                    (True, False, True, 256, False, True, "bf16-wgrad", "down"),  # run-256
                    (True, True, True, 256, False, True, "fp8", "both"),  # gluon-256-wgrad
                    (False, False, False, 128, False, True, "bf16-wgrad", "both")]
    # dy from the combine as a run has it, but for the bf16 backward (no FP8 data gradient) and its A/B variants
    assert slots == [True] * 6 + [False, True, True, False, True, True, False, True, True, True]
    assert made == [(forward, backward) for *_, backward, forward in seen]  # each the copies its recipe reads
    for bad in (dict(block_m=192), dict(rows=256), dict(tma_store=1)):
        with pytest.raises(ValueError, match="rows, wgrad, swiglu, tma_store and act_epilogue take True or False, "
                                             "block_m one of"):
            with fp8_ffn.gluon_paths(**bad):
                pass
    with pytest.raises(ValueError, match="choose from rows, wgrad, swiglu, block_m, tma_store, act_epilogue"):
        with fp8_ffn.gluon_paths(epilogue=True):
            pass
    # the TMA store at 128-row tiles only (at 256 x 128 its epilogue spills: `fp8_gluon.TMA_STORE_TILES`),
    # asked for at once or inside a 256-row choice
    with pytest.raises(ValueError, match="tma_store=True runs the row GEMM at block_m=128"):
        with fp8_ffn.gluon_paths(block_m=256, tma_store=True):
            pass
    with fp8_ffn.gluon_paths(block_m=256):
        with pytest.raises(ValueError, match="ask for block_m=128 or tma_store=False"):
            with fp8_ffn.gluon_paths(tma_store=True):
                pass
    assert choices() == defaults


def test_fp8_promote_times_one_fp8_backend_per_k_loop_and_says_which_tiles_ran():
    """`--fp8-promote` A/Bs the FP8 K loops in one run: one backend per promotion, each at the
    tuned tiles with that promotion everywhere; the table gets a ratio and error per FP8 backend,
    and the notes the tiles each ran."""
    import dataclasses

    from disagmoe.kernels.fp8_ffn import Fp8Tiles

    fp8 = bench.FP8_BACKEND
    chosen = bench.backends_for(["grouped_mm"], "fp8", ["inline", "pingpong", "inline"])
    assert chosen == ["grouped_mm", "triton", f"{fp8}:inline", f"{fp8}:pingpong", bench.LIBRARY_FP8_BACKEND]
    assert all(bench.is_fp8(b) for b in chosen[2:4]) and not bench.is_fp8(f"{fp8}:overlapped")
    assert bench.needs_fp8(chosen[4]) and not bench.is_fp8(chosen[4])  # the library's FP8, not ours
    chosen = chosen[:4]
    with pytest.raises(ValueError, match="choose from inline, hoisted, pipelined, pingpong"):
        bench.backends_for(None, "fp8", ["overlapped"])
    with pytest.raises(ValueError, match="--precision fp8"):
        bench.backends_for(None, "bf16", ["pingpong"])
    tiles = Fp8Tiles()
    assert bench.fp8_tiles_for(fp8, tiles) is tiles
    ran = bench.fp8_tiles_for(f"{fp8}:pingpong", tiles)
    assert (ran.rows.promote, ran.swiglu.promote, ran.wgrad.promote) == ("pingpong",) * 3
    assert ran.rows.block_m == tiles.rows.block_m

    rates = {"grouped_mm": 400.0, "triton": 400.0, chosen[2]: 600.0, chosen[3]: 800.0}
    record = {"ceiling_tflops": 800.0, "shapes": [{
        "name": "s", "experts": 2, "hidden": 8, "ffn": 4, "pairs": 16, "load_max_over_mean": 1.5,
        "tflops": {b: {p: rate for p in bench.PASSES} for b, rate in rates.items()},
        "rel_err": {b: {"y": 4e-2} for b in chosen[2:]},
        "fp8_tiles": {b: dataclasses.asdict(bench.fp8_tiles_for(b, tiles)) for b in chosen[2:]}}]}
    json.dumps(record)
    lines = bench.markdown_table(record).splitlines()
    assert f"{chosen[3]} / triton" in lines[0] and f"{chosen[2]} rel err" in lines[0]
    assert lines[2].endswith("| 1.50x | 4.0e-02 | 2.00x | 4.0e-02 |")
    notes = bench.fp8_tiles_notes(record)
    assert notes == [f"s {chosen[2]}: {tiles.with_promote('inline').describe()}",
                     f"s {chosen[3]}: {tiles.with_promote('pingpong').describe()}"]
    assert "rows 128x128x128 w8 s3 p1 pingpong" in notes[1]
    record["shapes"][0]["fp8_kernels"] = {chosen[2]: "rows gluon | swiglu triton | wgrad triton"}
    assert bench.fp8_tiles_notes(record)[0].endswith("(kernels: rows gluon | swiglu triton | wgrad triton)")


def test_the_kernel_paths_say_which_roles_run_gluon_where():
    """`fp8_ffn.kernel_paths`: on the CPU every role is Triton's; a Hopper GPU with K and N multiples
    of 128 runs each role in Gluon as set (all off by default: `fp8_ffn._GluonChoices`)."""
    from disagmoe.kernels import fp8_ffn

    cpu = torch.device("cpu")
    triton_only = "rows triton | swiglu triton | wgrad triton"
    assert fp8_ffn.kernel_paths(4096, 14336, cpu, wgrad=True, swiglu=True, backward="fp8") == triton_only
    assert bench.fp8_kernel_paths(f"{bench.FP8_BACKEND}:gluon-wgrad", 4096, 14336, cpu) == triton_only
    for gluon in ("gluon", "gluon-256", "gluon-tma-store"):
        assert bench.fp8_kernel_paths(f"{bench.FP8_BACKEND}:{gluon}", 4096, 14336, cpu).startswith(
            "rows triton | swiglu triton")
    assert bench.fp8_kernel_paths(bench.FP8_BACKEND, 4096, 14336, cpu).endswith("wgrad bf16 triton")
    assert bench.fp8_kernel_paths(f"{bench.FP8_BACKEND}:down-forward", 4096, 14336, cpu).endswith(
        "wgrad bf16 triton | forward gate/up bf16 triton")
    assert bench.fp8_kernel_paths(f"{bench.FP8_BACKEND}:down-forward-pass", 4096, 14336, cpu).endswith(
        "forward gate/up bf16 triton, act quantised in a pass")
    assert bench.fp8_kernel_paths(f"{bench.FP8_BACKEND}:bf16-backward", 4096, 14336, cpu).endswith(
        "wgrad bf16 triton | backward bf16 triton")
    for variant in ("down-forward-dy-pass", "run-dy-pass"):  # the rows' record tells them from their base
        assert bench.fp8_kernel_paths(f"{bench.FP8_BACKEND}:{variant}", 4096, 14336, cpu).endswith(
            "forward gate/up bf16 triton, dy quantised in a pass")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="needs a Hopper GPU (the Gluon kernels)")
def test_cuda_hopper_kernel_paths_follow_the_settings_and_the_shape():
    from disagmoe.kernels import fp8_ffn

    cuda = torch.device("cuda")
    paths = lambda ffn, on: fp8_ffn.kernel_paths(4096, ffn, cuda, wgrad=on, swiglu=on, backward="fp8")  # noqa: E731
    assert fp8_ffn.kernel_paths(4096, 14336, cuda) == "rows triton | swiglu triton | wgrad bf16 triton"
    assert bench.fp8_kernel_paths(f"{bench.FP8_BACKEND}:gluon", 4096, 14336, cuda) == (
        "rows gluon | swiglu gluon | wgrad bf16 triton")
    assert bench.fp8_kernel_paths(f"{bench.FP8_BACKEND}:gluon-256", 4096, 14336, cuda) == (
        "rows gluon-256 | swiglu gluon-256 | wgrad bf16 triton")
    assert bench.fp8_kernel_paths(f"{bench.FP8_BACKEND}:gluon-tma-store", 4096, 14336, cuda) == (
        "rows gluon-tma-store | swiglu gluon-tma-store | wgrad bf16 triton")
    assert paths(14336, False) == "rows triton | swiglu triton | wgrad triton"
    assert paths(14336, True) == "rows triton | swiglu gluon | wgrad gluon"
    assert paths(1408, True) == "rows triton | swiglu triton | wgrad gluon"


def test_the_help_names_every_backend_the_command_accepts():
    """`bench experts --help` lists each backend by the name `--backend` takes (the FP8 variants too)."""
    from typer.testing import CliRunner

    from disagmoe.cli.app import app

    result = CliRunner().invoke(app, ["bench", "experts", "--help"])
    assert result.exit_code == 0
    help_text = "".join(result.output.replace("│", "").split())  # a name may wrap at its hyphen
    for name in (*bench.BACKENDS, bench.FP8_BACKEND, *bench.VARIANT_BACKENDS, bench.LIBRARY_FP8_BACKEND):
        assert name in help_text, name


@pytest.mark.slow
def test_main_grads_add_the_weight_gradients_into_fp32_main_gradients(interpreted):
    """`--main-grads`: our FP8 block's kernels (bf16 or FP8 weight gradients) add the weight gradients into the
    parameters' fp32 main gradients and return none (as in a training step after its first micro-batch); the torch
    loop's autograd gradients are added by the benchmark, so both end with main = what was there +
    the block's weight gradient (the fresh-gradient run's, within the FP8 block's own rounding)."""
    fp8_ffn, experts, tiles = _interpreted_fp8_block(interpreted)
    gen = torch.Generator().manual_seed(3)
    inputs = (torch.randn(9, 32, generator=gen), torch.randint(0, 3, (9, 2), generator=gen),
              torch.rand(9, 2, generator=gen), torch.randn(3, 32, 48, generator=gen) / 32**0.5,
              torch.randn(3, 24, 32, generator=gen) / 24**0.5)
    dy = torch.randn(9, 32, generator=gen)
    all_fp8 = f"{experts.FP8_BACKEND}:fp8-wgrad"  # the weight gradients by the FP8 kernel, accumulating
    for backend, block in (("loop", experts.make_block("loop")),
                           (experts.FP8_BACKEND, experts.make_block(experts.FP8_BACKEND, fp8_tiles=tiles)),
                           (all_fp8, experts.make_block(all_fp8, fp8_tiles=tiles))):
        _, fresh = experts._forward_backward(block, experts._grad_inputs(inputs), dy)
        leaves = experts._grad_inputs(inputs, main_grads=True)
        w13, w2 = leaves[3], leaves[4]
        assert isinstance(w13, torch.nn.Parameter) and w13.data_ptr() == inputs[3].data_ptr()
        assert w13.main_grad.dtype == torch.float32 and not w13.main_grad.any()
        w2.main_grad.fill_(0.5)  # what earlier micro-batches left: added to, not overwritten
        _, grads = experts._forward_backward(block, leaves, dy)
        if backend == "loop":
            assert torch.equal(grads[2], fresh[2]) and torch.equal(grads[3], fresh[3])
        else:
            assert grads[2] is None and grads[3] is None
        assert torch.allclose(grads[0], fresh[0], rtol=0, atol=1e-6)
        assert torch.allclose(w13.main_grad, fresh[2].float(), rtol=1e-5, atol=1e-6)
        assert torch.allclose(w2.main_grad, fresh[3].float() + 0.5, rtol=1e-5, atol=1e-6)


def test_the_experts_command_says_when_it_times_main_gradients(monkeypatch):
    from typer.testing import CliRunner

    from disagmoe.cli.app import app
    from disagmoe.cli.bench_cmd import _experts_table

    help_text = CliRunner().invoke(app, ["bench", "experts", "--help"], env={"COLUMNS": "200"}).output
    assert "--main-grads" in help_text
    from disagmoe.bench import experts as bench

    asked = {}

    def run(*args, **kwargs):  # what the command hands the benchmark (no GPU here)
        asked.update(kwargs)
        return {"environment": {"gpu": "g", "driver": "d", "torch": "t", "triton": "tr"}, "ceiling_tflops": 1.0,
                "shapes": [], "main_grads": kwargs["main_grads"]}

    monkeypatch.setattr(bench, "run", run)
    result = CliRunner().invoke(app, ["bench", "experts", "--shape", "mixtral-8x7b", "--main-grads", "--markdown"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0 and asked["main_grads"] is True, result.output
    assert "weight gradients added into fp32 main gradients" in result.output
    CliRunner().invoke(app, ["bench", "experts", "--shape", "mixtral-8x7b"])
    assert asked["main_grads"] is False
    record = {"environment": {"gpu": "g", "driver": "d", "torch": "t", "triton": "tr"}, "ceiling_tflops": 1.0,
              "shapes": [], "main_grads": True}
    assert "added into fp32 main gradients" in _experts_table(record).title
    assert "main gradients" not in _experts_table({**record, "main_grads": False}).title


def test_every_row_says_the_sm_clock_it_was_timed_at_beside_the_ceiling_probes(monkeypatch):
    """A rate is a share of a ceiling timed in a short burst at the boost clock; the command prints the median SM
    clock of each row's timing beside the probe's (power-cap share where the driver reported one), and says why
    where nothing was sampled."""
    from typer.testing import CliRunner

    from disagmoe.bench import experts as bench
    from disagmoe.cli.app import app

    def clocks(mhz, capped=0.0):
        return {"sm_mhz_median": mhz, "reasons": {"sw_power_cap": capped} if capped else {}}

    record = {"environment": {"gpu": "g", "driver": "d", "torch": "t", "triton": "tr"}, "ceiling_tflops": 800.0,
              "main_grads": True, "gpu_clocks_note": None, "ceiling_clocks": clocks(1980),
              "shapes": [{"name": "mixtral-8x7b", "experts": 8, "hidden": 4096, "ffn": 14336, "pairs": 16384,
                          "load_max_over_mean": 3.44, "ms": {"grouped_mm": {"fwd": 1.0, "fwd+bwd": 3.0}},
                          "tflops": {"grouped_mm": {"fwd": 560.0, "fwd+bwd": 430.0}},
                          "clocks": {"grouped_mm": {"fwd": clocks(1830), "fwd+bwd": clocks(1755, 0.62)}}}]}
    assert bench.clock_lines(record) == [
        "SM clock while timed, median MHz: ceiling probe 1,980",
        "  mixtral-8x7b: grouped_mm fwd 1,830 / fwd+bwd 1,755 (power cap 62%)"]
    unsampled = {**record, "gpu_clocks_note": "nvidia-smi not found", "ceiling_clocks": None,
                 "shapes": [{**record["shapes"][0], "clocks": {"grouped_mm": {"fwd": None, "fwd+bwd": None}}}]}
    assert bench.clock_lines(unsampled) == ["SM clock while timed, median MHz: ceiling probe -",
                                            "  mixtral-8x7b: grouped_mm fwd - / fwd+bwd -", "  (nvidia-smi not found)"]
    assert bench.clock_lines({k: v for k, v in record.items() if k != "ceiling_clocks"}) == []  # an older record
    short = {**record, "ceiling_clocks": {**clocks(1980), "samples": 1}}  # a timing of a few sampling intervals
    assert bench.clock_lines(short)[0] == "SM clock while timed, median MHz: ceiling probe 1,980 (1 sample)"
    asked = []
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: asked.append(kwargs["gpu_clocks"]) or record)
    result = CliRunner().invoke(app, ["bench", "experts", "--shape", "mixtral-8x7b", "--backend", "grouped_mm"],
                                env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert "ceiling probe 1,980" in result.output and "fwd+bwd 1,755 (power cap 62%)" in result.output
    CliRunner().invoke(app, ["bench", "experts", "--shape", "mixtral-8x7b", "--no-gpu-clocks"])
    assert asked == [True, False]  # sampled unless told not to (to see whether the sampling moves the rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_the_record_holds_the_clocks_of_every_timed_row():
    from disagmoe.bench import experts as bench

    unsampled = bench.run(["qwen3-30b-a3b"], ["grouped_mm"], 1, 2, 1, check=False, log=lambda line: None,
                          gpu_clocks=False)
    assert unsampled["gpu_clocks_note"] == "not sampled (--no-gpu-clocks)" and unsampled["ceiling_clocks"] is None
    record = bench.run(["qwen3-30b-a3b"], ["grouped_mm", "triton"], 2, 20, 1, check=False, log=lambda line: None)
    entry = record["shapes"][0]
    assert {b: set(p) for b, p in entry["clocks"].items()} == {b: set(p) for b, p in entry["ms"].items()}
    sampled = [c for passes in entry["clocks"].values() for c in passes.values() if c is not None]
    assert record["gpu_clocks_note"] or sampled, "nvidia-smi ran but no row's timing was sampled"
    assert all(c["sm_mhz_median"] > 0 for c in sampled)
    assert len(bench.clock_lines(record)) >= 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 tensor cores (sm_89+)")
def test_cuda_main_grads_hold_the_blocks_weight_gradients():
    """`--main-grads` on the GPU, bf16, a Qwen3-layer shape with Zipf routing: each block's fp32 main gradients
    end holding the weight gradients its fresh run returns (ours added by the kernels' epilogues, in fp32 where
    the fresh ones are rounded to bf16: within bf16's rounding; the torch baseline's added after autograd)."""
    shape = bench.ExpertShape("t", "qwen3-30b-a3b", 4, 4096)
    inputs = bench.make_inputs(shape, torch.device("cuda"))
    dy = torch.randn(inputs[0].shape, device="cuda", dtype=torch.bfloat16)
    for backend in ("grouped_mm", "triton", bench.FP8_BACKEND, f"{bench.FP8_BACKEND}:gluon-tma-store-wgrad"):
        if backend.endswith("wgrad") and torch.cuda.get_device_capability() != (9, 0):
            continue  # the Gluon kernels: Hopper only
        block = bench.make_block(backend)
        _, fresh = bench._forward_backward(block, bench._grad_inputs(inputs), dy)
        leaves = bench._grad_inputs(inputs, main_grads=True)
        _, grads = bench._forward_backward(block, leaves, dy)
        torch.cuda.synchronize()
        for weight, fresh_grad in zip(leaves[3:5], fresh[2:]):
            gap = (weight.main_grad - fresh_grad.float()).norm() / fresh_grad.float().norm()
            assert gap < 1e-2, (backend, gap.item())
        assert all((g is None) == (backend != "grouped_mm") for g in grads[2:])
