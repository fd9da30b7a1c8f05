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
    tc.clear_cache()
    try:
        assert tc.lookup("gate_up", 64, 32, 100, 4, "Test GPU") == tuned
        assert tc.lookup("gate_up", 64, 32, 5000, 4, "Test GPU") == tc.heuristic("gate_up")
        assert tc.lookup("gate_up", 64, 32, 100, 4, "Other GPU") == tc.heuristic("gate_up")
    finally:
        tc.clear_cache()


def test_a_gpu_without_its_own_table_reads_one_of_its_architecture_and_says_so(tmp_path, monkeypatch):
    """A GPU untuned here reads the table of a GPU with the same compute capability and SM count
    (an H100 the H200's), not one of another architecture; once it has a table of its own, that
    table's classes win and the others still come from the same architecture's; `tile_source` names
    where the tiles came from."""
    config = tc.TileConfig(block_m=64, block_n=32, block_k=16, num_warps=4, num_stages=2)
    key = tc.shape_class("gate_up", 64, 32, rows=100, experts=4)
    other = tc.shape_class("down", 32, 64, rows=100, experts=4)
    arch = tc.architecture((9, 0), 132)
    assert arch == "sm_90x132"
    table = {"entries": {key: config.to_json(), other: config.to_json()}, "environment": {"gpu": "NVIDIA H200"},
             "architecture": arch}
    (tmp_path / "nvidia-h200.json").write_text(json.dumps(table))
    monkeypatch.setattr(tc, "TUNED_DIR", tmp_path)
    tc.clear_cache()
    h100 = "NVIDIA H100 80GB HBM3"
    try:
        assert tc.lookup("gate_up", 64, 32, 100, 4, h100, arch=arch) == config
        assert tc.table_slugs(h100, arch) == ("nvidia-h200",)
        assert tc.tile_source(h100, arch) == ("tuned on NVIDIA H200 (nvidia-h200.json), the same architecture "
                                              "(sm_90x132); tune-experts here writes this GPU's own")
        pcie = tc.architecture((9, 0), 114)  # another SM count: the heuristic, and the source says so
        assert tc.lookup("gate_up", 64, 32, 100, 4, "NVIDIA H100 PCIe", arch=pcie) == tc.heuristic("gate_up")
        assert tc.tile_source("NVIDIA H100 PCIe", pcie) == ("untuned defaults (no table tuned on NVIDIA H100 PCIe "
                                                           "or on a GPU of its architecture sm_90x114)")
        assert tc.lookup("gate_up", 64, 32, 100, 4, h100) == tc.heuristic("gate_up")  # no architecture known
        own = tc.TileConfig(block_m=128, block_n=64, block_k=32, num_warps=8, num_stages=3)
        (tmp_path / "nvidia-h100-80gb-hbm3.json").write_text(json.dumps({"entries": {key: own.to_json()},
                                                                        "architecture": arch}))
        tc.clear_cache()
        assert tc.lookup("gate_up", 64, 32, 100, 4, h100, arch=arch) == own  # its own class
        assert tc.lookup("down", 32, 64, 100, 4, h100, arch=arch) == config  # a class only the H200 tuned
        assert tc.tile_source(h100, arch) == ("tuned on this GPU (nvidia-h100-80gb-hbm3.json), else tuned on "
                                              "NVIDIA H200 (nvidia-h200.json), the same architecture (sm_90x132)")
        assert tc.lookup("gate_up", 64, 32, 100, 4, "NVIDIA H200", arch=arch) == config  # the H200 keeps its own
    finally:
        tc.clear_cache()


def test_untuned_classes_names_the_launches_no_table_this_gpu_reads_has_tuned(tmp_path, monkeypatch):
    """A class tuned in the GPU's own table or in one of its architecture's counts as tuned; the others are
    named as their shape classes, in the order of the launches given; another row count is another class."""
    config = tc.TileConfig(block_m=64, block_n=32, block_k=16, num_warps=4, num_stages=2)
    dims = {"gate_up": (64, 32), "down": (32, 64), "wgrad_w2": (32, 64)}
    arch = tc.architecture((9, 0), 132)
    own = {"entries": {tc.shape_class("gate_up", 64, 32, 400, 4): config.to_json()}, "architecture": arch}
    sibling = {"entries": {tc.shape_class("down", 32, 64, 400, 4): config.to_json()}, "architecture": arch}
    (tmp_path / "test-gpu.json").write_text(json.dumps(own))
    (tmp_path / "other-gpu.json").write_text(json.dumps(sibling))
    monkeypatch.setattr(tc, "TUNED_DIR", tmp_path)
    tc.clear_cache()
    try:
        assert tc.untuned_classes(dims, 400, 4, "Test GPU", arch) == ["wgrad_w2/k32/n64/m128"]
        assert tc.untuned_classes(dims, 400, 4, "Test GPU") == ["down/k32/n64/m128", "wgrad_w2/k32/n64/m128"]
        assert tc.untuned_classes(dims, 4000, 4, "Test GPU", arch) == [
            "gate_up/k64/n32/m1024", "down/k32/n64/m1024", "wgrad_w2/k32/n64/m1024"]
    finally:
        tc.clear_cache()


def test_a_class_is_tuned_for_its_loads_and_launches_read_the_processs_loads_first(tmp_path, monkeypatch):
    """Even loads (`routing: balanced`) key `<class>/even`, routed ones the plain class; a launch reads, table by table
    (the GPU's own first, then its architecture's), the entry of the process's loads (`set_expert_loads`,
    `launching_for`) before the other loads' entry, and the heuristic only where no table tuned either."""
    assert tc.shape_class("down", 1536, 4096, 32768, 16, "even") == "down/k1536/n4096/m2048/even"
    assert tc.shape_class("down", 1536, 4096, 32768, 16, "routed") == "down/k1536/n4096/m2048"
    with pytest.raises(ValueError, match="choose routed or even"):
        tc.shape_class("down", 1, 1, 1, 1, "skewed")
    with pytest.raises(ValueError, match="choose routed or even"):
        tc.set_expert_loads("balanced")
    assert [tc.loads_of_routing(r) for r in ("learned", "balanced")] == ["routed", "even"]
    routed, even, sibling_even = (tc.TileConfig(block_m=m, block_n=32, block_k=16) for m in (16, 32, 64))
    arch = tc.architecture((9, 0), 132)
    own = {"entries": {tc.shape_class("gate_up", 64, 32, 400, 4): routed.to_json(),
                       tc.shape_class("gate_up", 64, 32, 400, 4, "even"): even.to_json(),
                       tc.shape_class("down", 32, 64, 400, 4): routed.to_json()}, "architecture": arch}
    sibling = {"entries": {tc.shape_class(role, k, n, 400, 4, "even"): sibling_even.to_json()
                           for role, k, n in (("gate_up", 64, 32), ("down", 32, 64), ("wgrad_w2", 32, 64))},
               "architecture": arch}
    (tmp_path / "test-gpu.json").write_text(json.dumps(own))
    (tmp_path / "other-gpu.json").write_text(json.dumps(sibling))
    monkeypatch.setattr(tc, "TUNED_DIR", tmp_path)
    tc.clear_cache()
    before = tc.expert_loads()
    try:
        tc.set_expert_loads("routed")
        assert tc.lookup("gate_up", 64, 32, 400, 4, "Test GPU", arch=arch) == routed
        assert tc.lookup("wgrad_w2", 32, 64, 400, 4, "Test GPU", arch=arch) == sibling_even  # only the sibling's
        with tc.launching_for("even"):
            assert tc.expert_loads() == "even"
            assert tc.lookup("gate_up", 64, 32, 400, 4, "Test GPU", arch=arch) == even
            # its own table's routed entry before the sibling's even one: a GPU's own tiles win
            assert tc.lookup("down", 32, 64, 400, 4, "Test GPU", arch=arch) == routed
            assert tc.lookup("wgrad_w2", 32, 64, 400, 4, "Test GPU", arch=arch) == sibling_even
            assert tc.tuned("gate_up", 64, 32, 400, 4, "Test GPU", arch, loads="routed") == routed  # told, not read
            assert tc.lookup("gate_up", 64, 32, 4000, 4, "Test GPU", arch=arch) == tc.heuristic("gate_up")
            dims = {"gate_up": (64, 32), "wgrad_w2": (32, 64), "down_dgrad": (32, 64)}
            assert tc.untuned_classes(dims, 400, 4, "Test GPU", arch) == ["down_dgrad/k32/n64/m128/even"]
        assert tc.expert_loads() == "routed"  # restored after the block
        assert tc.untuned_classes(dims, 400, 4, "Test GPU", arch, "even") == ["down_dgrad/k32/n64/m128/even"]
        assert tc.untuned_classes(dims, 400, 4, "Test GPU") == ["wgrad_w2/k32/n64/m128", "down_dgrad/k32/n64/m128"]
    finally:
        tc.set_expert_loads(before)
        tc.clear_cache()


def test_committed_classes_are_keyed_by_the_loads_they_were_tuned_on():
    """An entry tuned on a `routing: balanced` shape (named `...-balanced`) is its class's `/even` one, and every
    `/even` entry was tuned on such a shape: the tables say which loads each tile won on."""
    for path in tc.TUNED_DIR.glob("*.json"):
        table = json.loads(path.read_text())
        for key, measured in table["measured"].items():
            assert key.endswith("/even") == ("-balanced" in measured["shape"]), (path.name, key, measured["shape"])


def test_the_committed_h200_table_records_its_architecture():
    """The H200's table names its architecture (sm_90, 132 SMs), so an H100 SXM reads it."""
    assert "nvidia-h200" in tc.table_slugs("NVIDIA H100 80GB HBM3", tc.architecture((9, 0), 132))


def test_committed_tables_parse():
    for path in tc.TUNED_DIR.glob("*.json"):
        table = tc._tuned_table(path.stem)
        assert table, f"{path.name} has no entries"
        for key, config in table.items():
            assert key.split("/")[0] in tc.ROLES + tc.FP8_ROLES and config.block_m >= 16


def test_wider_elements_keep_the_shared_memory_footprint():
    from disagmoe.kernels.tile_configs import TileConfig

    tile = TileConfig(block_m=128, block_n=256, block_k=64)
    assert tile.for_element_size(2) == tile
    wide = tile.for_element_size(4)
    assert wide.block_k * 4 == tile.block_k * 2
    assert (wide.block_m, wide.block_n, wide.num_stages) == (tile.block_m, tile.block_n, tile.num_stages)
    # a TMA-store buffer of 4-byte outputs is twice what the tuner counted beside the ring: wider launches store
    # through pointers (a bf16 launch keeps the tile as tuned)
    stored = TileConfig(block_m=128, block_n=256, block_k=64, tma=True, tma_store=True)
    assert stored.for_element_size(2).tma_store and not stored.for_element_size(4).tma_store
    assert stored.for_element_size(4).tma


H200_SHARED_MEMORY_PER_BLOCK = 232448  # the opt-in limit Triton's launch reported on an H200


@pytest.mark.parametrize("role", ["gate_up", "down", "down_dgrad", "gate_up_dgrad", "wgrad_w2", "wgrad_w13"])
def test_every_fp32_heuristic_tile_fits_the_gpus_shared_memory_after_lookup(role):
    """The wgrad heuristic (64 x 256 x 128, 3 stages) in fp32 (K tile halved to 64) needs a 240 KiB
    operand ring, over an H200's 227 KiB: it failed at launch on untuned shapes (the shared-GPU sparse
    dispatch GPU test, fp32). lookup with the GPU's limit drops stages first, then halves the K tile,
    keeping M and N."""
    from disagmoe.kernels import tile_configs as tc

    b_tiles = 2 if role == "gate_up" else 1
    raw = tc.heuristic(role).for_element_size(4)
    fitted = tc.lookup(role, 64, 64, 100, 4, "No tuned GPU", 4, H200_SHARED_MEMORY_PER_BLOCK)
    assert fitted.shared_memory_bytes(4, b_tiles) <= H200_SHARED_MEMORY_PER_BLOCK
    assert (fitted.block_m, fitted.block_n) == (raw.block_m, raw.block_n)
    if raw.shared_memory_bytes(4, b_tiles) <= H200_SHARED_MEMORY_PER_BLOCK:
        assert fitted == raw  # a tile that fits is left as it was
    else:
        assert fitted.num_stages < raw.num_stages or fitted.block_k < raw.block_k
    assert tc.lookup("wgrad_w13", 64, 64, 100, 4, "No tuned GPU", 4, H200_SHARED_MEMORY_PER_BLOCK) != \
        tc.heuristic("wgrad_w13").for_element_size(4)


def test_the_fit_drops_stages_to_two_before_it_halves_the_k_tile():
    from disagmoe.kernels.tile_configs import TileConfig

    tile = TileConfig(block_m=128, block_n=256, block_k=128, num_stages=4)
    per_stage = tile.shared_memory_bytes(2) // 4
    assert tile.fit_shared_memory(2, 3 * per_stage).num_stages == 3
    two = tile.fit_shared_memory(2, 2 * per_stage)
    assert (two.num_stages, two.block_k) == (2, 128)
    halved = tile.fit_shared_memory(2, 2 * per_stage - 1)
    assert (halved.num_stages, halved.block_k) == (2, 64)
    assert halved.shared_memory_bytes(2) <= 2 * per_stage - 1


def test_bf16_tiles_launch_as_tuned_whatever_the_estimate():
    """Three tuned H200 wgrad winners estimate 240 KiB in bf16 and launched (A fed from registers):
    lookup leaves bf16 tiles alone."""
    from disagmoe.kernels import tile_configs as tc

    table = tc._tuned_table("nvidia-h200")
    key = "wgrad_w13/k4096/n3072/m2048"
    assert table[key].shared_memory_bytes(2) > H200_SHARED_MEMORY_PER_BLOCK
    assert tc.lookup("wgrad_w13", 4096, 3072, 2048 * 8, 8, "NVIDIA H200", 2, H200_SHARED_MEMORY_PER_BLOCK) == table[key]
