"""The benchmark's CPU-checkable parts: shapes, routing, the torch baseline's permute/combine."""

from __future__ import annotations

import json

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
