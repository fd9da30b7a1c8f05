"""`disagmoe bench tune-experts`' CPU-checkable parts: the shapes it tunes (a run's own with
`--config`), each role's launch under any tile, and the command's errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from disagmoe.bench import experts as bench
from disagmoe.bench import tune_experts as tuner
from disagmoe.cli.app import app
from disagmoe.config import load_train_config
from disagmoe.kernels.moe_ffn import FFNTiles
from disagmoe.kernels.tile_configs import TileConfig, heuristic, shape_class

QWEN3 = Path(__file__).resolve().parents[2] / "configs" / "h200x2-qwen3-30b.yaml"


def test_a_runs_shape_is_its_micro_batch_of_tokens_routed_as_the_run_routes():
    cfg = load_train_config(QWEN3, ["micro_batches=2", "routing=balanced"])
    shape = bench.shape_of_run(cfg)
    # 16 sequences of 4,096 tokens in 2 micro-batches, top-8 of 128 experts, every expert local
    assert shape.pairs == 8 * 4096 * 8 and shape.balanced
    assert shape.dims == (128, 2048, 768, 8)
    experts, hidden, ffn, _ = shape.dims
    keys = {shape_class(role, *FFNTiles.gemm_dims(hidden, ffn)[role], shape.pairs, experts)
            for role in ("gate_up", "down")}
    assert keys == {"gate_up/k2048/n768/m2048", "down/k768/n2048/m2048"}  # the classes the run launches
    learned = bench.shape_of_run(load_train_config(QWEN3, ["micro_batches=8"]))
    assert learned.pairs == 2 * 4096 * 8 and not learned.balanced


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
        want = launch(heuristic(role).for_element_size(2)).clone()
        got = launch(small)
        assert torch.isfinite(want).all() and want.abs().sum() > 0, role
        assert tuner._relative_error(got, want) < 1e-2, role


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


def test_winners_merge_into_the_table_the_launcher_reads(tmp_path):
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"entries": {"down/k1/n1/m1": {"block_m": 64}}, "measured": {}}))
    best = TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4)
    record = {"environment": {"gpu": "NVIDIA H200"},
              "results": {"gate_up/k2048/n768/m2048": {"config": best.to_json(), "ms": 1.0, "tflops": 600.0,
                                                       "heuristic_ms": 1.2, "shape": "qwen3"}}}
    assert tuner.write_tuned(record, path) == path
    table = json.loads(path.read_text())
    assert table["entries"]["down/k1/n1/m1"] == {"block_m": 64}  # kept
    assert TileConfig(**table["entries"]["gate_up/k2048/n768/m2048"]) == best
    assert table["measured"]["gate_up/k2048/n768/m2048"]["heuristic_ms"] == 1.2
