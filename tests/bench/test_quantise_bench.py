"""`disagmoe bench quantise`: its cases and their bytes (CPU), the refusal without an FP8 GPU, and a
GPU run's record."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

from disagmoe.bench import quantise
from disagmoe.cli.app import app


def test_the_cases_are_one_micro_batchs_quantisers_with_their_bytes():
    """mixtral-8x7b (8 experts, H 4096, F 14336, top-2, 16k rows): x, act from h13, d h13, w13's two
    copies, a dense input, and the weight gradients' token-group copies (dy and d h13 with their rows
    from one pass, act, x), each with the bytes it reads and writes (bf16 in, e4m3 out, fp32 scales; a
    token-group copy all P = 16,384 + 8 x 127 rounded up to 128 padded rows of each column)."""
    by_kind = {}
    for case in quantise.cases("mixtral-8x7b"):
        by_kind.setdefault(case.kind, []).append(case)
    rows, h, f, e = 16 * 1024, 4096, 14336, 8
    p = 17408
    x, dh13 = by_kind["rows"]
    assert x.shape == (rows, h) and x.bytes == rows * h * 3 + rows * h // 32
    assert dh13.shape == (rows, 2 * f) and dh13.bytes == rows * 2 * f * 3 + rows * 2 * f // 32
    (act,) = by_kind["swiglu"]
    assert act.bytes == rows * 2 * f * 2 + rows * f + rows * f // 32
    (w13,) = by_kind["blocks"]
    assert w13.shape == (e, h, 2 * f) and w13.bytes == e * h * 2 * f * 4 + 2 * (e * h * 2 * f // 32)
    (dense,) = by_kind["rowwise"]
    assert dense.shape == (rows // 2, h) and dense.bytes == rows // 2 * h * 3 + 4 * rows // 2
    act, x = by_kind["token_groups"]
    assert act.shape == (rows, f) and act.bytes == rows * f * 2 + f * p + f * p // 32
    assert x.shape == (rows, h) and x.bytes == rows * h * 2 + h * p + h * p // 32
    dy, dh13 = by_kind["rows_and_token_groups"]
    assert dy.shape == (rows, h) and dy.bytes == rows * h * 3 + rows * h // 32 + h * p + h * p // 32
    assert dh13.shape == (rows, 2 * f)
    assert dh13.bytes == rows * 2 * f * 3 + rows * 2 * f // 32 + 2 * f * p + 2 * f * p // 32


@pytest.mark.slow  # the gate/up GEMM and the combine in Triton's interpreter
def test_each_epilogues_fused_and_separate_launches_write_the_same_e4m3_rows(interpreted, monkeypatch):
    """`--epilogues`' A/B (`epilogue_launches`) on a small shape in the interpreter: for the gate/up GEMM's
    SwiGLU epilogue and the combine's backward, the fused launch and the kernel-then-pass one write the same
    e4m3 rows and scales (so their times compare like with like), and the plain kernel quantises nothing."""
    from disagmoe.bench.experts import ExpertShape
    from disagmoe.config import ModelConfig
    from disagmoe.kernels.tile_configs import TileConfig

    interpreted("disagmoe.kernels.grouped_gemm", "disagmoe.kernels.fp8", "disagmoe.kernels.permute")
    from disagmoe.kernels import moe_ffn

    model = ModelConfig(name="tiny", vocab_size=64, hidden_size=256, num_layers=1, num_heads=2, num_kv_heads=2,
                        head_dim=64, num_experts=4, top_k=2, expert_ffn_size=128, seq_len=64)
    monkeypatch.setitem(quantise.SHAPES, "tiny", ExpertShape("tiny", model, 1, 64))
    tile = TileConfig(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=1)
    monkeypatch.setattr(moe_ffn.FFNTiles, "for_shape", classmethod(lambda cls, *a, **k: cls.uniform(tile)))
    gen = torch.Generator().manual_seed(0)
    launches = quantise.epilogue_launches("tiny", torch.device("cpu"), gen)
    assert [name for name, *_ in launches] == ["act by the gate/up GEMM's SwiGLU epilogue",
                                               "dy by the weighted combine's backward"]
    for name, plain, fused, separate in launches:
        got, (want_q, want_s) = fused(0), separate(0)
        q, s = got[2] if "combine" in name else got  # the combine's (d rows, d weights, (q, s)); the GEMM's (q, s)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s), name
        assert (q.float() != 0).any(), name
        assert not isinstance(plain(0), tuple) or len(plain(0)) == 2  # the plain combine: (d rows, d weights)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for a machine without an FP8 GPU")
def test_without_an_fp8_gpu_the_command_says_so_and_exits_non_zero():
    result = CliRunner().invoke(app, ["bench", "quantise", "--shape", "qwen3-30b-a3b"])
    assert result.exit_code != 0 and "FP8 tensor cores" in result.output
    assert "Traceback" not in result.output
    assert CliRunner().invoke(app, ["bench", "quantise", "--shape", "nope"]).exit_code != 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a GPU with FP8 tensor cores")
def test_gpu_every_quantiser_is_timed_both_ways_against_the_copy_rate():
    record = quantise.run(["qwen3-30b-a3b"], warmup=1, iters=2, log=lambda _: None, epilogues=True)
    assert record["copy_gbps"] > 100 and len(record["rows"]) == 9
    assert [r["epilogue"] for r in record["epilogues"]] == ["act by the gate/up GEMM's SwiGLU epilogue",
                                                            "dy by the weighted combine's backward"]
    for row in record["epilogues"]:  # the kernel alone is the least of the three; the ratio is of the two others
        assert 0 < row["plain_ms"] < row["separate_ms"]
        assert row["fused_over_separate"] == pytest.approx(row["fused_ms"] / row["separate_ms"])
    for row in record["rows"]:
        assert row["ms"] > 0 and row["ms_with_counters"] > 0 and 0 < row["of_copy_rate"] < 1.5
        # each way over its own time: the plain pass's share of the copy rate, and the counting one's
        assert row["of_copy_rate"] == pytest.approx(row["gbps"] / record["copy_gbps"])
        assert row["of_copy_rate_with_counters"] == pytest.approx(row["of_copy_rate"] / row["counters_cost"])
