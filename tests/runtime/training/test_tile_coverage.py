"""The start line naming the expert GEMM classes a single run launches with the heuristic tiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from disagmoe.config import load_train_config
from disagmoe.kernels import tile_configs as tc
from disagmoe.kernels.moe_ffn import FFNTiles
from disagmoe.model_ref import load_model
from disagmoe.runtime.training.tile_coverage import launch_rows, untuned_tiles_note

REPO = Path(__file__).resolve().parents[3]
ARCH = tc.architecture((9, 0), 132)


@pytest.fixture
def tables(tmp_path, monkeypatch):
    """An empty tuned-table folder; `write(gpu, keys)` adds a table with those classes tuned."""
    monkeypatch.setattr(tc, "TUNED_DIR", tmp_path)
    tc.clear_cache()
    config = tc.TileConfig(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4).to_json()

    def write(slug: str, keys: list[str]) -> None:
        (tmp_path / f"{slug}.json").write_text(json.dumps({"entries": {k: config for k in keys}, "architecture": ARCH}))
        tc.clear_cache()

    yield write
    tc.clear_cache()


def _deepseek(*overrides: str):
    cfg = load_train_config(REPO / "configs/h200-deepseek-v3.yaml", list(overrides))
    return cfg, load_model(cfg.model)


def test_a_run_whose_classes_no_table_holds_is_told_which_and_how_to_tune_them(tables):
    """The DeepSeek config (4 micro-batches of 8,192 tokens, top-8 over 32 experts: 2,048 rows an expert) on a GPU
    whose architecture's table holds only other row counts: all six classes named, with the command; once a
    sibling GPU's table holds four of them, the other two."""
    cfg, model = _deepseek()
    dims = FFNTiles.gemm_dims(model.hidden_size, model.expert_ffn_size)
    tables("nvidia-h200", [tc.shape_class(role, k, n, 32 * 1024, 32) for role, (k, n) in dims.items()])  # m1024
    note = untuned_tiles_note(cfg, model, "NVIDIA H200", ARCH)
    assert note.startswith("expert tiles: 6 of the 6 expert GEMM classes this run launches were never tuned on "
                           "NVIDIA H200 or a GPU of its architecture (gate_up/k7168/n2048/m2048, "
                           "down/k2048/n7168/m2048")
    assert "`disagmoe bench tune-experts -c CONFIG` with this run's overrides (micro_batches=4)" in note
    rows = 8 * 4096 // 4 * 8
    tables("nvidia-h100-80gb-hbm3", [tc.shape_class(role, k, n, rows, 32) for role, (k, n) in list(dims.items())[:4]])
    note = untuned_tiles_note(cfg, model, "NVIDIA H200", ARCH)
    assert note.startswith("expert tiles: 2 of the 6")
    assert "(wgrad_w2/k2048/n7168/m2048, wgrad_w13/k7168/n4096/m2048)" in note
    assert "`disagmoe bench tune-experts -c CONFIG --role wgrad_w2 --role wgrad_w13` with" in note  # only those
    balanced, _ = _deepseek("routing=balanced")  # its even loads' classes, and the override that tunes them
    note = untuned_tiles_note(balanced, model, "NVIDIA H200", ARCH)
    assert "(wgrad_w2/k2048/n7168/m2048/even, wgrad_w13/k7168/n4096/m2048/even)" in note
    assert "with this run's overrides (micro_batches=4 routing=balanced)" in note


@pytest.mark.parametrize("config, overrides", [("h200-deepseek-v3.yaml", []), ("h200-mixtral-8x7b.yaml", []),
                                               ("h200x2-qwen3-30b.yaml", ["micro_batches=2"])])
def test_the_note_reads_the_rows_the_tuner_tunes(config, overrides):
    """The rows of a launch as the note counts them are the tuner's (`bench tune-experts -c`: `shape_of_run`), so
    the classes it names are the ones that command writes."""
    from disagmoe.bench.experts import shape_of_run

    cfg = load_train_config(REPO / "configs" / config, overrides)
    assert launch_rows(cfg, load_model(cfg.model)) == shape_of_run(cfg, None).pairs


def test_a_run_whose_classes_are_all_tuned_or_that_launches_no_tuned_kernel_says_nothing(tables):
    cfg, model = _deepseek()
    rows = launch_rows(cfg, model)
    dims = FFNTiles.gemm_dims(model.hidden_size, model.expert_ffn_size)
    tables("nvidia-h200", [tc.shape_class(role, k, n, rows, 32) for role, (k, n) in dims.items()])
    assert untuned_tiles_note(cfg, model, "NVIDIA H200", ARCH) is None
    assert untuned_tiles_note(cfg, model, "NVIDIA H200", ARCH.replace("132", "114")) is None  # its own table
    other, _ = _deepseek("micro_batches=2")  # 4,096 rows an expert: another class
    assert untuned_tiles_note(other, model, "NVIDIA H200", ARCH).startswith("expert tiles: 6 of the 6")
    for overrides in (["precision=fp8"], ["experts_backend=grouped_mm"]):
        assert untuned_tiles_note(_deepseek("micro_batches=2", *overrides)[0], model, "NVIDIA H200", ARCH) is None
    fp32 = _deepseek("micro_batches=2", "precision=fp32")[0]  # fp32 launches read the same table
    assert untuned_tiles_note(fp32, model, "NVIDIA H200", ARCH).startswith("expert tiles: 6 of the 6")


def test_an_unsettled_split_is_refused():
    cfg, model = _deepseek("micro_batches=auto")
    with pytest.raises(ValueError, match="settled split"):
        untuned_tiles_note(cfg, model, "NVIDIA H200", ARCH)


@pytest.mark.gpu
def test_a_cuda_single_trainer_names_its_untuned_classes_in_its_summary(tmp_path, tables):
    """The trainer settles the split, then asks for the note on its own GPU: with no table at all, every class of
    the tiny model's launches is named, and the summary keeps the line."""
    import torch

    from disagmoe.config import TrainConfig
    from disagmoe.runtime.training.trainer import SingleProcessTrainer

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model = load_model("tiny").model_copy(update={"hidden_size": 256, "expert_ffn_size": 256})
    cfg = TrainConfig(model=model, mode="single", steps=1, batch_size=8, seq_len=128, micro_batches=2, eval_every=0,
                      device="cuda", experts_backend="triton", checkpoint_at_end=False, out_dir=str(tmp_path / "run"))
    trainer = SingleProcessTrainer(cfg)
    assert trainer.tiles_note.startswith("expert tiles: 6 of the 6 expert GEMM classes this run launches")
    assert trainer.run(None).expert_tiles_note == trainer.tiles_note
