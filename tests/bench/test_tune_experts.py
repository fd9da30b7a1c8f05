"""`disagmoe bench tune-experts`' CPU-checkable parts: the shapes it tunes (a run's own with
`--config`), each role's launch under any tile, the command's errors, and the FP8 search loop and
the table it writes (the interpreter runs the launches; a fake timer ranks the tiles)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from disagmoe.bench import experts as bench
from disagmoe.bench import tune_experts as tuner
from disagmoe.cli.app import app
from disagmoe.config import load_train_config
from disagmoe.kernels.moe_ffn import FFNTiles
from disagmoe.kernels.tile_configs import TileConfig, heuristic, shape_class, tma_store_fits

QWEN3 = Path(__file__).resolve().parents[2] / "configs" / "h200x2-qwen3-30b.yaml"


def test_a_runs_shape_is_its_micro_batch_of_tokens_routed_as_the_run_routes():
    cfg = load_train_config(QWEN3, ["micro_batches=2", "routing=balanced"])
    shape = bench.shape_of_run(cfg)
    # 16 sequences of 4,096 tokens in 2 micro-batches, top-8 of 128 experts, every expert local
    assert shape.pairs == 8 * 4096 * 8 and shape.balanced
    assert shape.dims == (128, 2048, 768, 8)
    experts, hidden, ffn, _ = shape.dims
    keys = {shape_class(role, *FFNTiles.gemm_dims(hidden, ffn)[role], shape.pairs, experts, "even")
            for role in ("gate_up", "down")}
    # the classes the run launches, for its even loads
    assert keys == {"gate_up/k2048/n768/m2048/even", "down/k768/n2048/m2048/even"}
    learned = bench.shape_of_run(load_train_config(QWEN3, ["micro_batches=8"]))
    assert learned.pairs == 2 * 4096 * 8 and not learned.balanced


@pytest.mark.parametrize("overrides, paired", [
    (["micro_batches=2"], True),  # expert_wgrad_pairs: auto, where it applies (no GPU to resolve it on: on)
    (["micro_batches=2", "expert_wgrad_pairs=off"], False),
    (["micro_batches=1"], False),  # nothing to pair
    (["micro_batches=2", "experts_backend=grouped_mm"], False),  # no main-gradient launches to pair
])
def test_a_runs_shape_pairs_its_weight_gradients_where_the_run_does(overrides, paired):
    """`tune-experts -c` times the weight gradients as the run launches them: over two micro-batches' rows
    in one launch where it pairs them (`kernels.wgrad_pairs`), the class still keyed by one micro-batch's rows."""
    shape = bench.shape_of_run(load_train_config(QWEN3, overrides))
    assert shape.paired_wgrads is paired


def test_micro_batches_auto_needs_the_gpu_it_is_chosen_for():
    with pytest.raises(ValueError, match="micro_batches: auto is chosen from the GPU's memory.*micro_batches=N"):
        bench.shape_of_run(load_train_config(QWEN3), device=None)


def load_model_with(experts: int, top_k: int):
    from disagmoe.model_ref import load_model

    return load_model("tiny").model_copy(update={"num_experts": experts, "top_k": top_k})


@pytest.mark.parametrize("tokens, top_k, experts", [(64, 2, 8), (50, 8, 128), (7, 3, 3)])
def test_balanced_routing_gives_every_expert_its_mean_and_each_token_distinct_experts(tokens, top_k, experts):
    shape = bench.ExpertShape("t", load_model_with(experts, top_k), 1, tokens * top_k, balanced=True)
    idx_TK = shape.routing(seed=0)
    loads = torch.bincount(idx_TK.reshape(-1), minlength=experts)
    assert loads.max() - loads.min() <= 1 and int(loads.sum()) == tokens * top_k
    assert all(len(set(row.tolist())) == top_k for row in idx_TK)


@pytest.mark.slow  # 6-9 s on 2 cores (the fresh-clone CI, session 35)
def test_every_role_launches_and_computes_the_same_function_under_another_tile(interpreted):
    """What the tuner times: each role of the expert FFN, launched with a candidate tile, agrees
    with the heuristic tile's result (the tuner's own acceptance check), in the interpreter."""
    _, tuner_i = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.bench.tune_experts")
    shape = bench.ExpertShape("tiny", "tiny", 1, 48, balanced=False)
    launches = tuner_i.role_launches(shape, torch.device("cpu"))
    assert set(launches) == {"gate_up", "down", "down_dgrad", "gate_up_dgrad", "wgrad_w2", "wgrad_w13"}
    for role, launch in launches.items():
        small = TileConfig(block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2)
        if role == "gate_up":
            small = TileConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
        reset = getattr(launch, "reset", lambda: None)  # the weight gradients add into fp32 main gradients
        reset()
        want = launch(heuristic(role).for_element_size(2)).clone()
        reset()
        got = launch(small).clone()
        assert torch.isfinite(want).all() and want.abs().sum() > 0, role
        assert tuner._relative_error(got, want) < 1e-2, role
        if role.startswith("wgrad"):  # accumulating, as a step does: twice is twice, atomics the same bits
            assert launch.out.dtype == torch.float32
            twice = launch(small).clone()
            reset()
            launch(small)
            atomic = launch(dataclasses.replace(small, atomic_accumulate=True))
            assert torch.equal(atomic, twice), role


def test_micro_batches_auto_then_resolves_the_pairing_as_the_trainer_does(monkeypatch):
    """On a GPU, after `micro_batches: auto` chose its split (settling pairs only for the splits it weighed),
    `shape_of_run` resolves `expert_wgrad_pairs` on the chosen one as the trainer does: where memory turns them
    off, the shape is not paired."""
    from disagmoe.runtime.training import micro_batches, single_memory, trainer

    monkeypatch.setattr(trainer, "resolve_single_micro_batches",
                        lambda cfg, model_cfg, device: (cfg.model_copy(update={"micro_batches": 2}), None))
    monkeypatch.setattr(micro_batches, "device_capacity_bytes", lambda device: 80 * 2**30)
    monkeypatch.setattr(single_memory, "resolve_wgrad_pairs",
                        lambda cfg, model_cfg, capacity: (cfg.model_copy(update={"expert_wgrad_pairs": "off"}), None))
    shape = bench.shape_of_run(load_train_config(QWEN3), torch.device("cuda"))
    assert shape.pairs == 8 * 4096 * 8 and not shape.paired_wgrads


def test_a_paired_shapes_weight_gradients_launch_with_a_second_row_set(monkeypatch):
    """A paired shape's weight-gradient launches (what the tuner times) pass `ragged_weight_grad` a second
    micro-batch's rows (`second`: rows of their own, the same expert groups); an unpaired shape's pass none."""
    from disagmoe.bench import tune_experts as tuner

    seen = {}
    monkeypatch.setattr(tuner.gg, "ragged_weight_grad",
                        lambda a, b, offsets, config, **kw: seen.setdefault(b.shape[1], (a, b, offsets, kw)))
    shape = bench.ExpertShape("tiny", "tiny", 1, 48, balanced=False, paired_wgrads=True)
    for paired in (True, False):
        seen.clear()
        launches = tuner.role_launches(dataclasses.replace(shape, paired_wgrads=paired), torch.device("cpu"))
        launches["wgrad_w2"](heuristic("wgrad_w2"))
        launches["wgrad_w13"](heuristic("wgrad_w13"))
        assert len(seen) == 2
        for a, b, offsets, kw in seen.values():
            second = kw["second"]
            if not paired:
                assert second is None
                continue
            a2, b2, offsets2 = second
            assert offsets2 is offsets and a2.shape == a.shape and b2.shape == b.shape and not torch.equal(a2, a)


def test_the_command_refuses_overrides_without_a_config_and_needs_a_gpu(tmp_path):
    runner = CliRunner()
    bad = runner.invoke(app, ["bench", "tune-experts", "micro_batches=2"])
    assert bad.exit_code != 0 and "overrides apply to --config" in bad.output
    if torch.cuda.is_available():
        return
    no_gpu = runner.invoke(app, ["bench", "tune-experts", "-c", str(QWEN3), "micro_batches=2",
                                 "--out", str(tmp_path / "t.json")])
    assert no_gpu.exit_code != 0 and "needs a CUDA GPU" in no_gpu.output
    assert "Traceback" not in no_gpu.output and not (tmp_path / "t.json").exists()
    wrong_role = runner.invoke(app, ["bench", "tune-experts", "--shape", "qwen3-30b-a3b", "--role", "fp8_wgrad"])
    assert wrong_role.exit_code != 0 and "--precision bf16 tunes gate_up" in wrong_role.output
    assert "Traceback" not in wrong_role.output


def test_roles_limit_the_tuning_to_those_gemms(monkeypatch):
    """`tune(..., roles=[...])` searches only those roles' launches (the other classes' entries stay in
    the table as they are); the wgrad roles offer every atomic tile with TMA loads too (and on a Hopper the Gluon
    weight gradient's tiles), the row GEMMs every tile but the library's and the flattened gate/up ones."""
    from disagmoe.bench import tune_experts as tuner

    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner, "environment", lambda device: {"gpu": "test"})
    monkeypatch.setattr(tuner, "device_architecture", lambda device: "sm_90x132")
    monkeypatch.setattr(tuner, "role_launches", lambda shape, device: {role: None for role in tuner.ROLES})
    searched = []
    monkeypatch.setattr(tuner, "tune_roles", lambda launches, *a, **k: searched.append(sorted(launches)) or {})
    from disagmoe.bench.experts import SHAPES

    tuner.tune([SHAPES["qwen3-30b-a3b"]], 0, 1, log=lambda m: None, roles=["wgrad_w2", "wgrad_w13"])
    assert searched == [["wgrad_w13", "wgrad_w2"]]
    monkeypatch.setattr(tuner, "_hopper", lambda: False)
    wgrad = tuner.candidates("wgrad_w13")
    assert {(c.atomic_accumulate, c.tma, c.prefetch_accumulator) for c in wgrad} == {
        (False, False, False), (True, False, False), (True, True, False), (False, False, True), (False, True, True)}
    assert all(c.num_warps == 8 and c.block_k * c.block_n <= tuner.PREFETCH_TILE_ELEMENTS
               for c in wgrad if c.prefetch_accumulator)  # where the prior values fit beside the sum
    monkeypatch.setattr(tuner, "_hopper", lambda: False)
    down = tuner.candidates("down")
    assert any(c.tma for c in down) and not any(c.tma and c.library for c in down)
    assert not any(c.gluon for c in down)  # not on a Hopper: the Gluon tiles would be Triton tiles again
    monkeypatch.setattr(tuner, "_hopper", lambda: True)
    gluon = [c for role in tuner.LIBRARY_ROLES for c in tuner.candidates(role) if c.gluon]
    assert len(gluon) == 2 * len(tuner.GLUON_ROWS_CANDIDATES) and {c.gluon_tma_store for c in gluon} == {False, True}
    for role in tuner.LIBRARY_ROLES:  # where the Gluon kernel cannot take a launch, the heuristic's Triton tile runs
        for c in (c for c in tuner.candidates(role) if c.gluon):
            assert dataclasses.replace(c, gluon=False, gluon_block_m=128, gluon_block_n=128, gluon_stages=4,
                                       gluon_tma_store=False) == tuner.heuristic(role)
    for role in ("wgrad_w2", "wgrad_w13"):  # the Gluon weight gradient's tiles over the heuristic's Triton one
        gluon_wgrad = [c for c in tuner.candidates(role) if c.gluon]
        assert len(gluon_wgrad) == len(tuner.GLUON_WGRAD_CANDIDATES)
        assert {(c.gluon_block_n, c.gluon_stages, c.gluon_tma_store, c.atomic_accumulate) for c in gluon_wgrad} == set(
            tuner.GLUON_WGRAD_CANDIDATES)
        assert all(dataclasses.replace(c, gluon=False, gluon_block_n=128, gluon_stages=4, gluon_tma_store=False,
                                       atomic_accumulate=tuner.heuristic(role).atomic_accumulate)
                   == tuner.heuristic(role) for c in gluon_wgrad)
    swiglu = [c for c in tuner.candidates("gate_up") if c.gluon]
    assert len(swiglu) == len(tuner.GLUON_SWIGLU_CANDIDATES) and {c.gluon_tma_store for c in swiglu} == {False, True}
    split = [c for c in tuner.candidates("down_dgrad") if c.gluon]  # its SwiGLU gradient split off a Gluon GEMM
    assert len(split) == len(tuner.GLUON_ROWS_CANDIDATES) and all(c.split_epilogue for c in split)
    assert not any(c.tma and c.flatten for c in tuner.candidates("gate_up"))
    for role in ("gate_up", "down", "gate_up_dgrad"):  # TMA stores on the TMA-loading tiles their buffer fits beside
        stored = [c for c in tuner.candidates(role) if c.tma_store]
        assert stored and all(c.tma and not c.flatten and tma_store_fits(c, role) for c in stored), role
        assert {dataclasses.replace(c, tma_store=False) for c in stored} <= set(tuner.candidates(role))
    assert not tma_store_fits(TileConfig(block_m=128, block_n=256, block_k=64, num_stages=4), "down")


def test_each_class_is_saved_as_soon_as_it_is_tuned(monkeypatch, tmp_path):
    """A search stopped part-way (a timeout, ^C) keeps the classes it finished: `tune(save=...)` is handed
    each one as its search ends, and `write_tuned` merges it into the table at once."""
    from disagmoe.bench import tune_experts as tuner
    from disagmoe.bench.experts import SHAPES

    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner, "environment", lambda device: {"gpu": "test"})
    monkeypatch.setattr(tuner, "device_architecture", lambda device: "sm_90x132")
    monkeypatch.setattr(tuner, "role_launches", lambda shape, device: {"down": None, "gate_up": None})
    monkeypatch.setattr(tuner, "_hopper", lambda: False)
    best = TileConfig(block_m=64, block_n=128, block_k=64)

    def search(launch, default, configs, time_ms, log, role, progress):
        progress(1, 2)
        if role == "gate_up":
            raise KeyboardInterrupt  # the second role's search never ends
        return 1.0, best, 2.0

    monkeypatch.setattr(tuner, "search", search)
    table = tmp_path / "gpu.json"
    told = []
    with pytest.raises(KeyboardInterrupt):
        tuner.tune([SHAPES["qwen3-30b-a3b"]], 0, 1, log=lambda m: None, save=lambda one: tuner.write_tuned(one, table),
                   progress=lambda *args: told.append(args))
    assert told == [("qwen3-30b-a3b down", 1, 2), ("qwen3-30b-a3b gate_up", 1, 2)]  # each search's bar, by its label
    saved = json.loads(table.read_text())
    assert [key.split("/")[0] for key in saved["entries"]] == ["down"]
    assert TileConfig(**next(iter(saved["entries"].values()))) == best and saved["architecture"] == "sm_90x132"


def test_a_balanced_runs_classes_are_saved_for_even_loads_beside_the_routed_ones(monkeypatch, tmp_path):
    """A config's `routing: balanced` shape is tuned into its classes' `/even` entries, the Zipf-routed bench shape
    of the same classes into the plain ones: neither retune takes the other's entry (`tile_configs.LOADS`), and a
    launch reads the entry of its process's loads."""
    from disagmoe.bench.experts import SHAPES
    from disagmoe.kernels import tile_configs as tc

    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner, "environment", lambda device: {"gpu": "test"})
    monkeypatch.setattr(tuner, "device_architecture", lambda device: "sm_90x132")
    monkeypatch.setattr(tuner, "role_launches", lambda shape, device: {"down": None})
    monkeypatch.setattr(tuner, "_hopper", lambda: False)
    tiles = {True: TileConfig(block_m=64, block_n=128, block_k=64), False: TileConfig(block_m=128, block_n=64,
                                                                                      block_k=64)}
    monkeypatch.setattr(tuner, "search", lambda launch, default, configs, time_ms, log, role, progress: (
        1.0, tiles[current.balanced], 2.0))
    cfg = load_train_config(QWEN3, ["micro_batches=8", "routing=balanced"])
    balanced = bench.shape_of_run(cfg)
    routed = dataclasses.replace(SHAPES["qwen3-30b-a3b"], pairs=balanced.pairs)  # the same classes, Zipf-routed
    table, lines = tmp_path / "cpu.json", []  # the table a CPU launch reads
    for current in (balanced, routed):
        tuner.tune([current], 0, 1, log=lambda m: None, compile_workers=0,
                   save=lambda one: tuner.write_tuned(one, table, lines.append))
    saved = json.loads(table.read_text())["entries"]
    assert sorted(saved) == ["down/k768/n2048/m512", "down/k768/n2048/m512/even"] and lines == []
    assert TileConfig(**saved["down/k768/n2048/m512/even"]) == tiles[True]
    assert TileConfig(**saved["down/k768/n2048/m512"]) == tiles[False]
    monkeypatch.setattr(tc, "TUNED_DIR", tmp_path)
    tc.clear_cache()
    try:
        for loads, balanced_tile in (("even", True), ("routed", False)):
            with tc.launching_for(loads):
                assert FFNTiles.for_shape(balanced.pairs, 128, 2048, 768, torch.device("cpu")).down == tiles[
                    balanced_tile]
    finally:
        tc.clear_cache()


def test_a_failed_table_write_leaves_the_table_as_it_was(tmp_path, monkeypatch):
    """The table is written to a file of the write's own and moved over it: a write that fails part-way (a full
    disk, ^C) leaves the old table whole and no stray file beside it."""
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"entries": {"down/k1/n1/m1": {"block_m": 64}}, "measured": {}}))
    before = path.read_text()

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(tuner.os, "replace", interrupted)
    record = {"environment": {"gpu": "NVIDIA H200"}, "results": {}}
    with pytest.raises(KeyboardInterrupt):
        tuner.write_tuned(record, path)
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["gpu.json"]


def test_winners_merge_into_the_table_the_launcher_reads(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"entries": {"down/k1/n1/m1": {"block_m": 64}}, "measured": {}}))
    best = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
    record = {"environment": {"gpu": "NVIDIA H200"},
              "results": {"gate_up/k2048/n768/m2048": {"config": best.to_json(), "ms": 1.0, "tflops": 600.0,
                                                       "heuristic_ms": 1.2, "shape": "qwen3"}}}
    assert tuner.write_tuned(record, path) == path
    assert [p.name for p in tmp_path.iterdir()] == ["gpu.json"]  # its own file written whole, then moved over
    table = json.loads(path.read_text())
    assert table["entries"]["down/k1/n1/m1"] == {"block_m": 64}  # kept
    assert TileConfig(**table["entries"]["gate_up/k2048/n768/m2048"]) == best
    assert table["measured"]["gate_up/k2048/n768/m2048"]["heuristic_ms"] == 1.2


def test_a_write_names_each_class_another_shapes_search_had_tuned(tmp_path):
    """Classes are keyed by GEMM, K, N, rows an expert and loads: the Zipf-routed bench shape and a learned-routing
    config of one model share them, and the last tune wins. The write says so for each entry it takes over from another shape, and
    nothing where the same shape retunes its class or the class is new."""
    path = tmp_path / "gpu.json"
    tile = TileConfig(block_m=128, block_n=128, block_k=64).to_json()

    def record(shape, ms, *keys):
        return {"environment": {"gpu": "NVIDIA H200"},
                "results": {key: {"config": tile, "ms": ms, "tflops": 1.0, "heuristic_ms": ms, "shape": shape}
                            for key in keys}}

    lines = []
    tuner.write_tuned(record("mixtral-8x7b", 5.454, "gate_up/k4096/n14336/m2048", "down/k14336/n4096/m2048"), path,
                      lines.append)
    assert lines == []  # new classes
    tuner.write_tuned(record("mixtral-8x7b", 5.4, "gate_up/k4096/n14336/m2048"), path, lines.append)
    assert lines == []  # the same shape again
    tuner.write_tuned(record("mixtral-8x7b-3l-t8192-paired-wgrads", 5.2, "gate_up/k4096/n14336/m2048",
                             "wgrad_w2/k14336/n4096/m2048"), path, lines.append)
    assert lines == ["  gate_up/k4096/n14336/m2048: replaces the tile tuned on mixtral-8x7b (5.400 ms there) with "
                     "mixtral-8x7b-3l-t8192-paired-wgrads's (5.200 ms): both shapes launch this class's tile"]
    assert json.loads(path.read_text())["measured"]["gate_up/k4096/n14336/m2048"]["ms"] == 5.2


def _tile(m, n, k, promote="inline"):
    return TileConfig(block_m=m, block_n=n, block_k=k, group_m=2, num_warps=4, num_stages=1, promote=promote)


# FP8 role -> (default, candidates): a tile that fits, one that the launch refuses (skipped), one whose
# result the test corrupts (rejected), one that fits; the fake timer makes the last one timed fastest
DEFAULTS = {"fp8_rows": _tile(16, 32, 128), "fp8_swiglu": _tile(16, 128, 128), "fp8_wgrad": _tile(128, 32, 16)}
CANDIDATES = {
    "fp8_rows": [_tile(16, 32, 128, "pingpong"), _tile(16, 32, 32, "pipelined"), _tile(32, 32, 128, "hoisted"),
                 _tile(16, 32, 64, "pipelined")],
    "fp8_swiglu": [_tile(16, 128, 128, "hoisted"), _tile(16, 128, 32, "pipelined"), _tile(32, 128, 128, "inline"),
                   _tile(16, 128, 64, "pingpong")],
    "fp8_wgrad": [_tile(128, 32, 16, "hoisted"), _tile(32, 32, 16, "pipelined"), _tile(64, 32, 16, "inline"),
                  _tile(64, 32, 16, "pingpong")],
}
CORRUPTED = {role: configs[2] for role, configs in CANDIDATES.items()}
WINNERS = {role: configs[3] for role, configs in CANDIDATES.items()}


@pytest.mark.slow  # more than a few seconds on 2 cores (`pytest -m 'not slow'` skips it)
def test_the_fp8_search_saves_the_fastest_checked_tiles_and_the_fp8_ffn_runs_them(interpreted, tmp_path,
                                                                                   monkeypatch):
    """The tuner's FP8 roles on a tiny ragged shape in the interpreter: every candidate checked
    against the default's outputs (a refused tile skipped, a wrong result rejected, neither timed),
    the fastest saved under the FP8 roles' shape classes in the tuned table's format beside the
    bf16 entry already there; `Fp8Tiles.for_shape` on this device (slug "cpu") reads them back and
    `expert_ffn_fp8` without tiles launches them."""
    _, _, fp8_ffn, tuner = interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8",
                                       "disagmoe.kernels.fp8_ffn", "disagmoe.bench.tune_experts")
    from disagmoe.kernels import tile_configs as tc

    counts, hidden, ffn = [20, 0, 5], 64, 64
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows, experts = sum(counts), len(counts)
    launches = tuner.fp8_role_launches(offsets, hidden, ffn, dtype=torch.float32)

    def corrupting(role, launch):
        def run(config):
            out = launch(config)
            if config == CORRUPTED[role]:
                out[0].mul_(2)
            return out
        return run

    # each timing 10% faster than the last: the last timed tile wins, none close enough for a final round
    clock = iter(100 * 0.9**i for i in range(100))
    timed = []

    def time_ms(fn):
        timed.append(fn())
        return float(next(clock))

    logged: list[str] = []
    results = tuner.tune_roles({role: corrupting(role, launch) for role, launch in launches.items()},
                               {role: (hidden, ffn) for role in launches}, {role: 1e9 for role in launches},
                               rows, experts, "tiny", "routed", time_ms, logged.append,
                               configs=CANDIDATES.__getitem__, default=DEFAULTS.__getitem__)
    assert len(timed) == 3 * 3  # default, first and last candidate of each role
    assert sum("skip" in line for line in logged) == 3 and sum("reject" in line for line in logged) == 3

    table_path = tmp_path / "cpu.json"
    bf16_key = tc.shape_class("down", ffn, hidden, rows, experts)
    bf16_entry = TileConfig(block_m=32, block_n=32, block_k=32)
    table_path.write_text(json.dumps({"entries": {bf16_key: bf16_entry.to_json()}, "measured": {}}))
    tuner.write_tuned({"environment": {"gpu": "cpu"}, "results": results}, table_path)
    saved = json.loads(table_path.read_text())
    keys = {role: tc.shape_class(role, hidden, ffn, rows, experts) for role in tc.FP8_ROLES}
    assert keys["fp8_rows"] == "fp8_rows/k64/n64/m8"
    assert saved["entries"] == {bf16_key: bf16_entry.to_json(),
                                **{keys[role]: WINNERS[role].to_json() for role in tc.FP8_ROLES}}
    for role in tc.FP8_ROLES:
        measured = saved["measured"][keys[role]]
        assert measured["shape"] == "tiny" and measured["ms"] < measured["heuristic_ms"]

    monkeypatch.setattr(tc, "TUNED_DIR", tmp_path)
    tc.clear_cache()
    try:
        tiles = fp8_ffn.Fp8Tiles.for_shape(rows, experts, hidden, ffn, torch.device("cpu"))
        assert tiles == fp8_ffn.Fp8Tiles(rows=WINNERS["fp8_rows"], swiglu=WINNERS["fp8_swiglu"],
                                         wgrad=WINNERS["fp8_wgrad"])
        assert fp8_ffn.Fp8Tiles.for_shape(rows, 1, hidden, ffn, torch.device("cpu")) == fp8_ffn.Fp8Tiles()
        ran = []
        forward = fp8_ffn.fp8_ffn_forward
        monkeypatch.setattr(fp8_ffn, "fp8_ffn_forward", lambda *a, **k: ran.append(a[3]) or forward(*a, **k))
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(rows, hidden, generator=gen)
        w13 = torch.randn(experts, hidden, 2 * ffn, generator=gen) / hidden**0.5
        w2 = torch.randn(experts, ffn, hidden, generator=gen) / ffn**0.5
        y = fp8_ffn.expert_ffn_fp8(x, offsets, w13, w2, num_programs=2)
        assert ran == [tiles] and torch.isfinite(y).all()
    finally:
        tc.clear_cache()


def _timed_launches(ms_of: Callable[[TileConfig], float]):
    """(launch, time_ms, launched) for `search` on CPU: the launch records its tile, the timer times the last
    tile launched at `ms_of(tile)`."""
    launched: list[TileConfig] = []

    def launch(config):
        launched.append(config)
        return torch.ones(4)

    def time_ms(fn):
        fn()
        return ms_of(launched[-1])
    return launch, time_ms, launched


def test_the_search_logs_the_best_tile_of_each_kernel_kind_beside_the_winner():
    """Where the library's grouped GEMM and our Gluon kernel compete with our Triton tiles, the log says
    how fast each kind's best was (the winner alone would hide how far the others were)."""
    triton_tile = TileConfig(block_m=128, block_n=128, block_k=64)
    library = dataclasses.replace(triton_tile, library=True)
    gluon = dataclasses.replace(triton_tile, block_n=256, gluon=True, gluon_tma_store=True)
    slower_gluon = dataclasses.replace(gluon, gluon_tma_store=False)
    wide = dataclasses.replace(triton_tile, block_n=256)
    ms = {triton_tile: 2.0, library: 3.0, gluon: 1.5, slower_gluon: 1.8, wide: 2.5}
    launch, time_ms, _ = _timed_launches(lambda config: ms[config])

    logged = []
    best_ms, best, default_ms = tuner.search(launch, triton_tile, [library, gluon, slower_gluon], time_ms,
                                             logged.append, "down")
    assert (best_ms, best, default_ms) == (1.5, gluon, 2.0)
    assert logged == ["  down: best by kernel: gluon 1.500 ms, library 3.000 ms, triton 2.000 ms"]
    assert [tuner.kernel_kind(c) for c in (triton_tile, library, gluon)] == ["triton", "library", "gluon"]
    logged.clear()
    tuner.search(launch, triton_tile, [wide], time_ms, logged.append, "up")
    assert logged == []  # one kind: nothing beside the winner


def test_tiles_close_to_the_fastest_are_timed_again_in_turn_and_keep_their_fastest_timing():
    """A GPU warming through the search makes tiles timed late look slower: the tiles within `FINAL_ROUND_WITHIN`
    of the fastest (at most `FINAL_ROUND_SIZE`) are timed `FINAL_ROUNDS` times more in turn, each keeping its
    fastest timing, and the winner is chosen on those; a tile far behind is not timed again."""
    first = TileConfig(block_m=128, block_n=128, block_k=64)
    late, far = dataclasses.replace(first, block_n=256), dataclasses.replace(first, block_m=64)
    timings = {first: [2.00, 2.01, 2.02], late: [2.04, 1.98, 1.99], far: [3.0]}  # late: timed hot, then in turn
    launch, time_ms, launched = _timed_launches(lambda config: timings[config].pop(0))

    logged = []
    best_ms, best, default_ms = tuner.search(launch, first, [late, far], time_ms, logged.append, "down")
    assert (best_ms, best, default_ms) == (1.98, late, 2.00)
    assert timings == {first: [], late: [], far: []}  # the close two twice more each, the far one once
    assert logged == [f"  down: final round, 2 tiles within {tuner.FINAL_ROUND_WITHIN:.0%} timed "
                      f"{tuner.FINAL_ROUNDS} times more in turn: triton 2.000 ms, triton 1.980 ms"]
    only = tuner.final_round([(1.0, first), (2.0, far)], lambda config: 0.1, logged.append, "up")
    assert only == [(1.0, first), (2.0, far)]  # nothing close: no round
    assert tuner.final_round([], lambda config: 0.1, logged.append, "up") == []
    # a tile listed twice (the heuristic is also a candidate of most roles) is timed once, in the search and in
    # the round, and keeps the faster of its timings; one whose re-timing fails keeps its earlier one
    timings = {first: [2.00, 2.01, 2.02], late: [2.03, 1.99, 1.98]}
    launched.clear()
    assert tuner.search(launch, first, [first, late, late], time_ms, logged.append, "down")[:2] == (1.98, late)
    assert launched.count(late) == 1 + 1 + 2 and timings == {first: [], late: []}  # checked, timed, twice more
    logged.clear()

    def failing(config):
        raise RuntimeError("unspecified launch failure")
    assert tuner.final_round([(1.0, first), (1.01, late), (1.005, first)], failing, logged.append, "up") == [
        (1.0, first), (1.01, late), (1.0, first)]
    assert logged[0] == "  up: final round: triton tile not timed again (RuntimeError)"


def test_the_search_tells_its_progress_as_each_candidate_ends_rejected_or_not():
    """The default and each candidate, checked and timed, rejected (a wrong result) or skipped (a launch that
    fails): (done, in all) after each, so a bar can count the minutes of a first tune's compiles."""
    good = TileConfig(block_m=128, block_n=128, block_k=64)
    wrong, failing = dataclasses.replace(good, block_n=256), dataclasses.replace(good, block_m=64)

    def launch(config):
        if config == failing:
            raise RuntimeError("out of shared memory")
        return torch.full((4,), 2.0 if config == wrong else 1.0)

    told = []
    tuner.search(launch, good, [wrong, failing], lambda fn: (fn(), 1.0)[1], lambda m: None, "down",
                 lambda done, total: told.append((done, total)))
    assert told == [(1, 3), (2, 3), (3, 3)]


def test_tune_experts_bar_prints_the_tuners_lines_above_it(monkeypatch):
    """The bar redraws as it is told (no thread of its own) and the tuner's lines print through it, as text."""
    import io

    from rich.console import Console

    from disagmoe.cli import bench_cmd

    out = io.StringIO()
    monkeypatch.setattr(bench_cmd, "console", Console(file=out, width=120, force_terminal=False))
    with bench_cmd.TuneProgress() as bar:
        bar.update("qwen3-30b-a3b down", 3, 40)
        bar.log("down [best] 0.380 ms")
        assert bar.bar.tasks[0].completed == 3 and bar.bar.tasks[0].total == 40
    assert "down [best] 0.380 ms" in out.getvalue()
