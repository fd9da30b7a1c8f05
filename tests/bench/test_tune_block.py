"""`bench tune-experts`' block check (`bench.tune_block`): the whole block on the new tiles against the table's,
a GEMM whose new tile slows it given its old one back, and the tuner saving what the check kept."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from disagmoe.bench import tune_experts as tuner
from disagmoe.bench.experts import SHAPES
from disagmoe.bench.tune_block import MARGIN, block_check
from disagmoe.kernels.moe_ffn import FFNTiles
from disagmoe.kernels.tile_configs import ROLES, TileConfig, heuristic


def _tiles(**changes: TileConfig) -> FFNTiles:
    return FFNTiles(**{role: changes.get(role, heuristic(role)) for role in ROLES})


NEW = {role: dataclasses.replace(heuristic(role), num_stages=heuristic(role).num_stages + 1) for role in ROLES}


def _timer(penalty_ms: dict[str, float], base_ms: float = 100.0):
    """A fake block: `base_ms` plus each role's penalty where it runs its new tile (`NEW`); counts its calls."""
    calls = []

    def block_ms(tiles: FFNTiles) -> float:
        calls.append(tiles)
        return base_ms + sum(ms for role, ms in penalty_ms.items() if getattr(tiles, role) == NEW[role])
    return block_ms, calls


def test_new_tiles_that_do_not_slow_the_block_all_stay():
    before, after = _tiles(), _tiles(down=NEW["down"], wgrad_w2=NEW["wgrad_w2"])
    block_ms, calls = _timer({"down": -3.0, "wgrad_w2": 0.5})  # 2.5 ms faster together
    verdict = block_check(before, after, block_ms)
    assert verdict.tiles == after and verdict.kept_old == () and calls == [after, before, after, before]  # in turn
    assert verdict.lines[0] == "  block check: fwd+bwd 97.500 ms on the new tiles, 100.000 ms on the table's " \
                               "(down, wgrad_w2 changed)"
    unchanged = block_check(before, before, block_ms)  # nothing to time where the search kept every tile
    assert unchanged.tiles == before and len(calls) == 4


def test_one_slow_timing_of_the_new_tiles_does_not_undo_the_tune():
    """Each tile set is timed twice in turn and the faster of each pair counts: a single slow median (a clock
    dip) leaves the new tiles in place."""
    before, after = _tiles(), _tiles(down=NEW["down"])
    times = iter([110.0, 100.0, 99.5, 100.2])  # new, old, new, old: the first new one slow

    verdict = block_check(before, after, lambda tiles: next(times))
    assert verdict.tiles == after and verdict.kept_old == () and verdict.lines[-1].endswith("the new tiles stay")


def test_the_gemm_whose_new_tile_slows_the_block_keeps_its_old_one():
    """down's new tile is faster alone but the block runs 5 ms slower with it (session 49's down data gradient):
    it alone goes back; a change within the margin (gate_up's) stays."""
    before = _tiles()
    after = _tiles(**{role: NEW[role] for role in ("gate_up", "down", "down_dgrad")})
    block_ms, calls = _timer({"down_dgrad": 5.0, "gate_up": -0.5, "down": 0.5 * MARGIN * 100})
    verdict = block_check(before, after, block_ms)
    assert verdict.kept_old == ("down_dgrad",)
    assert verdict.tiles == dataclasses.replace(after, down_dgrad=before.down_dgrad)
    assert len(calls) == 4 + 3  # new and old twice, then each changed GEMM's old tile back in turn
    assert not verdict.together
    assert verdict.lines[-1] == "  block check: the old tile kept for down_dgrad (100.000 ms)"


def test_where_no_single_gemm_explains_the_slower_block_the_tables_tiles_stay():
    before, after = _tiles(), _tiles(down=NEW["down"], gate_up_dgrad=NEW["gate_up_dgrad"])

    def block_ms(tiles: FFNTiles) -> float:  # slower only with both new tiles: an interaction
        both = tiles.down == NEW["down"] and tiles.gate_up_dgrad == NEW["gate_up_dgrad"]
        return 105.0 if both else 104.5 if tiles != before else 100.0
    verdict = block_check(before, after, block_ms)
    assert verdict.tiles == before and verdict.kept_old == ("down", "gate_up_dgrad") and verdict.together
    assert verdict.lines[-1].endswith("no single GEMM's new tile explained the slower block")


def _tuner_without_a_gpu(monkeypatch) -> None:
    """`tune` on CPU: every search's winner the `NEW` tile (1 ms against the heuristic's 2), the table's tiles the
    heuristics; the block timer and the kept tile's timing are the test's."""
    monkeypatch.setattr(tuner.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(tuner, "environment", lambda device: {"gpu": "test"})
    monkeypatch.setattr(tuner, "device_architecture", lambda device: "sm_90x132")
    monkeypatch.setattr(tuner, "_hopper", lambda: False)
    monkeypatch.setattr(tuner, "role_launches", lambda shape, device: {role: lambda tile: tile for role in ROLES})
    monkeypatch.setattr(tuner, "search", lambda launch, default, configs, time_ms, log, role, progress: (
        1.0, NEW[role], 2.0))
    monkeypatch.setattr(tuner, "table_tiles", lambda shape, device: _tiles())


def test_the_tuner_saves_the_old_tile_of_a_gemm_the_block_check_kept(monkeypatch, tmp_path):
    """`tune` checks a shape whose six GEMMs it tuned: the search's winners are saved as each ends, then the block
    check's kept tile replaces its GEMM's entry, timed on its own launch and marked; `--role` tunes are unchecked."""
    _tuner_without_a_gpu(monkeypatch)
    monkeypatch.setattr(tuner, "block_timer", lambda shape, device, warmup, iters: _timer({"down": 4.0})[0])
    monkeypatch.setattr(tuner, "median_ms", lambda fn, warmup, iters: fn(0) and 1.5)
    table, lines = tmp_path / "test.json", []
    record = tuner.tune([SHAPES["mixtral-8x7b"]], 0, 1, log=lines.append,
                        save=lambda one: tuner.write_tuned(one, table))
    saved = json.loads(table.read_text())
    down = "down/k14336/n4096/m2048"
    assert TileConfig(**saved["entries"][down]) == heuristic("down") == TileConfig(**record["results"][down]["config"])
    assert saved["measured"][down]["ms"] == 1.5 and "slowed the block" in saved["measured"][down]["block_check"]
    assert all(TileConfig(**entry) == NEW[key.split("/")[0]] for key, entry in saved["entries"].items() if key != down)
    assert "  block check: the old tile kept for down (100.000 ms)" in lines
    assert saved["measured"][down]["block_check"] == "kept over the search's 1.000 ms tile: that tile slowed the block"

    def out_of_memory(tiles):
        raise tuner.torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    monkeypatch.setattr(tuner, "block_timer", lambda shape, device, warmup, iters: out_of_memory)
    lines.clear()
    record = tuner.tune([SHAPES["mixtral-8x7b"]], 0, 1, log=lines.append)  # the check fails: the winners stand
    assert all(TileConfig(**r["config"]) == NEW[key.split("/")[0]] for key, r in record["results"].items())
    assert ("  block check skipped (OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB): the search's "
            "tiles stand") in lines
    checked = []
    monkeypatch.setattr(tuner, "block_timer", lambda *args: checked.append(args))
    tuner.tune([SHAPES["mixtral-8x7b"]], 0, 1, log=lines.append, roles=["down"])
    tuner.tune([SHAPES["mixtral-8x7b"]], 0, 1, log=lines.append, block_checks=False)
    assert checked == []


def test_a_shape_whose_run_pairs_its_weight_gradients_is_checked_on_its_row_gemms_only(monkeypatch):
    """The block runs the weight gradients unpaired, so for a paired shape (a config of 2+ micro-batches) both sides
    of the check hold the search's weight-gradient tiles, ranked on paired launches: a slow new wgrad tile in the
    block is not the check's to undo, a slow new row-GEMM tile is."""
    _tuner_without_a_gpu(monkeypatch)
    block_ms, calls = _timer({"down": 4.0, "wgrad_w2": 9.0})
    monkeypatch.setattr(tuner, "block_timer", lambda shape, device, warmup, iters: block_ms)
    monkeypatch.setattr(tuner, "median_ms", lambda fn, warmup, iters: fn(0) and 1.5)
    lines = []
    paired = dataclasses.replace(SHAPES["mixtral-8x7b"], paired_wgrads=True)
    record = tuner.tune([paired], 0, 1, log=lines.append)
    kept = {key.split("/")[0]: TileConfig(**r["config"]) for key, r in record["results"].items()}
    assert kept["down"] == heuristic("down") and "block_check" in record["results"]["down/k14336/n4096/m2048"]
    assert all(kept[role] == NEW[role] for role in ROLES if role != "down")
    assert all(tiles.wgrad_w2 == NEW["wgrad_w2"] and tiles.wgrad_w13 == NEW["wgrad_w13"] for tiles in calls)
    assert any("weight gradients run paired" in line for line in lines)
    assert any(line.startswith("  block check: fwd+bwd") and "wgrad" not in line for line in lines)
    rows = tuple(role for role in ROLES if not role.startswith("wgrad"))
    only_wgrads = block_check(_tiles(wgrad_w2=NEW["wgrad_w2"]), _tiles(wgrad_w2=NEW["wgrad_w2"]), block_ms, roles=rows)
    assert only_wgrads.lines == (f"  block check: the search kept every tile of {', '.join(rows)} the table had",)


@pytest.mark.parametrize("flag", ["--no-block-check", "--block-check"])
def test_the_command_passes_its_block_check_flag(monkeypatch, flag):
    from typer.testing import CliRunner

    from disagmoe.cli.app import app

    told = {}
    monkeypatch.setattr(tuner, "tune", lambda *args, **kwargs: told.update(kwargs) or {
        "environment": {"gpu": "test"}, "results": {}})
    monkeypatch.setattr(tuner, "write_tuned", lambda record, out, log=None: "table")
    result = CliRunner().invoke(app, ["bench", "tune-experts", "--shape", "mixtral-8x7b", flag])
    assert result.exit_code == 0, result.output
    assert told["block_checks"] is (flag == "--block-check")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_the_block_timer_times_the_block_at_the_tiles_it_is_given():
    """On the GPU: the table's tiles for a shape (`table_tiles`, its loads'), and the block forward and backward
    into fp32 main gradients timed at them and at the heuristics, each a positive median."""
    from disagmoe.bench.experts import ExpertShape
    from disagmoe.bench.tune_block import block_timer

    shape = ExpertShape("t", "qwen3-30b-a3b", 16, 2048)
    device = torch.device("cuda")
    table = tuner.table_tiles(shape, device)
    block_ms = block_timer(shape, device, 1, 3)
    assert block_ms(table) > 0 and block_ms(_tiles()) > 0
