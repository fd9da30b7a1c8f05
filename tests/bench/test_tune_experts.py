"""`disagmoe bench tune-experts`: the search loop and the table it writes, on the CPU (the
interpreter runs the launches; a fake timer ranks the tiles)."""

from __future__ import annotations

import json

import pytest
import torch

from disagmoe.kernels.tile_configs import TileConfig


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

    clock = iter(range(100, 0, -1))  # each timing faster than the last: the last timed tile wins
    timed = []

    def time_ms(fn):
        timed.append(fn())
        return float(next(clock))

    logged: list[str] = []
    results = tuner.tune_roles({role: corrupting(role, launch) for role, launch in launches.items()},
                               {role: (hidden, ffn) for role in launches}, {role: 1e9 for role in launches},
                               rows, experts, "tiny", time_ms, logged.append,
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
    tc._tuned_table.cache_clear()
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
        tc._tuned_table.cache_clear()
