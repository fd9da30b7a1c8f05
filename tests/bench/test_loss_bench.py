"""`disagmoe bench loss` (disagmoe/bench/loss.py): its refusals on the CPU, and a small run on a GPU."""

import pytest
import torch
from typer.testing import CliRunner

from disagmoe.cli.app import app

QWEN3 = "configs/h200x2-qwen3-30b.yaml"


def test_the_command_asks_for_a_split_and_a_gpu_without_a_traceback():
    runner = CliRunner()
    auto = runner.invoke(app, ["bench", "loss", "-c", QWEN3])
    assert auto.exit_code != 0 and "give the split to time, e.g. micro_batches=2" in auto.output
    assert "Traceback" not in auto.output
    if torch.cuda.is_available():
        return
    no_gpu = runner.invoke(app, ["bench", "loss", "-c", QWEN3, "micro_batches=2"])
    assert no_gpu.exit_code != 0 and "run it on a machine with a CUDA GPU" in no_gpu.output
    assert "Traceback" not in no_gpu.output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_small_run_times_both_ways_and_their_losses_agree():
    from disagmoe.bench import loss as bench

    record = bench.run(2048, 256, [4096, 50_000], warmup=1, iters=2, log=lambda m: None)
    assert [r["vocab"] for r in record["rows"]] == [4096, 50_000] and record["copy_gbps"] > 0
    for r in record["rows"]:
        assert r["head_fused_ms"] > 0 and r["head_torch_ms"] > 0 and r["softmax_fused_ms"] > 0
        assert r["loss_rel_diff"] < 1e-5
