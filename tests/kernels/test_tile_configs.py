"""Tile config lookup: tuned JSON data first, the heuristic otherwise."""

from __future__ import annotations

import json

import pytest

from disagmoe.kernels import tile_configs as tc


def test_shape_class_buckets_rows_per_expert_to_a_power_of_two():
    assert tc.shape_class("down", 1536, 4096, rows=32768, experts=16) == "down/k1536/n4096/m2048"
    assert tc.shape_class("down", 1536, 4096, rows=3000, experts=16) == "down/k1536/n4096/m256"
    with pytest.raises(ValueError, match="role"):
        tc.shape_class("up", 1, 1, 1, 1)


def test_lookup_reads_the_gpus_table_and_falls_back_to_the_heuristic(tmp_path, monkeypatch):
    tuned = tc.TileConfig(block_m=64, block_n=32, block_k=16, num_warps=4, num_stages=2,
                          programs_per_sm=2)
    key = tc.shape_class("gate_up", 64, 32, rows=100, experts=4)
    (tmp_path / "test-gpu.json").write_text(json.dumps({"entries": {key: tuned.to_json()}}))
    monkeypatch.setattr(tc, "TUNED_DIR", tmp_path)
    tc._tuned_table.cache_clear()
    try:
        assert tc.lookup("gate_up", 64, 32, 100, 4, "Test GPU") == tuned
        assert tc.lookup("gate_up", 64, 32, 5000, 4, "Test GPU") == tc.heuristic("gate_up")
        assert tc.lookup("gate_up", 64, 32, 100, 4, "Other GPU") == tc.heuristic("gate_up")
    finally:
        tc._tuned_table.cache_clear()


def test_committed_tables_parse():
    for path in tc.TUNED_DIR.glob("*.json"):
        table = tc._tuned_table(path.stem)
        assert table, f"{path.name} has no entries"
        for key, config in table.items():
            assert key.split("/")[0] in tc.ROLES and config.block_m >= 16


def test_wider_elements_keep_the_shared_memory_footprint():
    from disagmoe.kernels.tile_configs import TileConfig

    tile = TileConfig(block_m=128, block_n=256, block_k=64)
    assert tile.for_element_size(2) == tile
    wide = tile.for_element_size(4)
    assert wide.block_k * 4 == tile.block_k * 2
    assert (wide.block_m, wide.block_n, wide.num_stages) == (tile.block_m, tile.block_n, tile.num_stages)
