"""`disagmoe bench layer` (disagmoe/bench/layer.py): the shape table, the reference math of the
per-pair return (CPU, fp32, against a plain torch MoE layer), the report from injected
measurements, the CLI's errors without GPUs; end to end on 2 GPUs with nvshmem4py (`gpu`)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from typer.testing import CliRunner

from disagmoe.bench import layer as bench
from disagmoe.cli.app import app
from disagmoe.comm.symmetric import ALIGN, align
from disagmoe.model_ref import load_model
from disagmoe.kernels import fused_return as fr
from disagmoe.kernels.moe_ffn import expert_ffn_reference
from disagmoe.kernels.permute import permute_reference

TINY = bench.LayerShape("tiny", experts=6, hidden=24, ffn=16, top_k=3, tokens=40)


def test_shapes_are_the_issue_s_from_the_presets():
    qwen, ds4, ds32 = (bench.SHAPES[n] for n in ("qwen3-30b-a3b", "deepseek-v3-4k", "deepseek-v3-32k"))
    assert (qwen.experts, qwen.hidden, qwen.ffn, qwen.top_k, qwen.tokens) == (128, 2048, 768, 8, 32 * 1024)
    ds = load_model("deepseek-v3")
    for shape, pairs in ((ds4, 4 * 1024), (ds32, 32 * 1024)):
        assert (shape.experts, shape.hidden, shape.ffn, shape.top_k) == (ds.num_experts // 8, 7168, 2048, 8)
        assert shape.pairs == pairs and shape.bytes_returned == pairs * 7168 * 2
    assert qwen.flops == 6 * qwen.pairs * 2048 * 768
    assert bench.layer_shapes(None) == list(bench.SHAPES.values())
    assert bench.layer_shapes(["deepseek-v3-4k"]) == [ds4]
    with pytest.raises(ValueError, match="unknown shape.*choose from qwen3-30b-a3b"):
        bench.layer_shapes(["qwen3-30b"])


def test_the_expert_gpu_reads_the_tiles_tuned_on_even_loads(tmp_path, monkeypatch):
    """Uniformly random top-k gives every expert close to the mean of rows: GPU 1 launches the `/even` classes
    (`tile_configs.LOADS`), whatever loads the process launches for otherwise."""
    from disagmoe.kernels import tile_configs as tc
    from disagmoe.kernels.moe_ffn import FFNTiles

    routed, even = tc.TileConfig(block_m=16, block_n=32, block_k=16), tc.TileConfig(block_m=32, block_n=32, block_k=16)
    dims = FFNTiles.gemm_dims(TINY.hidden, TINY.ffn)
    entries = {tc.shape_class(role, k, n, TINY.pairs, TINY.experts, loads): tile.to_json()
               for role, (k, n) in dims.items() for loads, tile in (("routed", routed), ("even", even))}
    (tmp_path / f"{tc.gpu_slug('cpu')}.json").write_text(json.dumps({"entries": entries}))
    monkeypatch.setattr(tc, "TUNED_DIR", tmp_path)
    tc.clear_cache()
    before = tc.expert_loads()
    try:
        tc.set_expert_loads("routed")
        tiles = bench.expert_tiles(TINY, torch.device("cpu"))
        assert all(getattr(tiles, role).block_m == even.block_m for role in dims)
        assert tc.expert_loads() == "routed"  # the process's own loads are left as they were
    finally:
        tc.set_expert_loads(before)
        tc.clear_cache()


def _fp32(inputs: bench.LayerInputs) -> bench.LayerInputs:
    return bench.LayerInputs(*(t.float() if t.is_floating_point() else t for t in (
        inputs.x_TH, inputs.topk_TK, inputs.weights_TK, inputs.w13_EH2F, inputs.w2_EFH, inputs.dy_TH)))


def test_routing_is_seeded_with_distinct_experts_and_grouped_stably():
    inputs = bench.make_inputs(TINY, torch.device("cpu"), seed=3)
    assert torch.equal(inputs.topk_TK, bench.make_inputs(TINY, torch.device("cpu"), seed=3).topk_TK)
    assert all(len(set(row.tolist())) == TINY.top_k for row in inputs.topk_TK)
    torch.testing.assert_close(inputs.weights_TK.sum(1), torch.ones(TINY.tokens))
    pairs_N, offsets_E = bench.group_pairs(inputs.topk_TK, TINY.experts)
    rows, want_offsets, dest_TK = permute_reference(inputs.x_TH, inputs.topk_TK, TINY.experts)
    assert torch.equal(offsets_E, want_offsets)
    assert torch.equal(dest_TK.flatten()[pairs_N.long()], torch.arange(TINY.pairs, dtype=torch.int32))
    assert torch.equal(bench.expert_rows(inputs, pairs_N)[0], rows)
    with pytest.raises(ValueError, match="top_k 7"):
        bench.make_inputs(bench.LayerShape("bad", 6, 8, 8, 7, 4), torch.device("cpu"))


def test_per_pair_rows_and_combine_are_the_plain_moe_layer_forward_and_backward():
    """What the bench moves: rows per pair at p = t K + j, combined weighted (forward) or summed
    (the input gradients of d rows = w dy); against autograd through a plain per-expert layer."""
    inputs = _fp32(bench.make_inputs(TINY, torch.device("cpu"), seed=1))
    K = TINY.top_k
    want = bench.reference_results(inputs)
    pairs_N, offsets_E = bench.group_pairs(inputs.topk_TK, TINY.experts)
    x_NH, dy_NH = bench.expert_rows(inputs, pairs_N)
    leaves = [t.clone().requires_grad_() for t in (x_NH, inputs.w13_EH2F, inputs.w2_EFH)]
    rows_NH = expert_ffn_reference(leaves[0], offsets_E, leaves[1], leaves[2])
    dx_NH, dw13, dw2 = torch.autograd.grad(rows_NH, leaves, dy_NH)
    rows_PH, dx_PH = torch.empty(TINY.pairs, TINY.hidden), torch.empty(TINY.pairs, TINY.hidden)
    rows_PH[pairs_N.long()], dx_PH[pairs_N.long()] = rows_NH.detach(), dx_NH
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fr.combine_reference(rows_PH, inputs.weights_TK, K), want["y"], **close)
    torch.testing.assert_close(fr.combine_reference(dx_PH, None, K), want["dx"], **close)
    torch.testing.assert_close(bench.router_grad(inputs.dy_TH, rows_PH, K), want["d_weights"], **close)
    torch.testing.assert_close(dw13, want["dw13"], **close)
    torch.testing.assert_close(dw2, want["dw2"], **close)
    assert bench.relative_error(want["y"], want["y"]) == 0.0


TIMES = bench.PassTimes(compute_ms=4.0, pure_combine_ms=0.5, baseline_layer_ms=8.0, baseline_wait_ms=7.5,
                        baseline_expert_ms=4.1, fused_layer_ms=5.0, fused_expert_ms=4.6)
GOOD = {"baseline": {"y": 3e-3}, "fused": {"y": 4e-3}}


def test_the_summary_computes_wait_rates_bound_and_ratios():
    nbytes = 10**9  # 1 GB: at 400 GB/s 2.5 ms on the link, below the 4 ms of compute
    row = bench.summarise("fwd", nbytes, TIMES, GOOD, nvlink_gbps=400.0)
    assert row["link_ms"] == pytest.approx(2.5) and row["bound_ms"] == 4.0
    assert row["baseline"]["gbps"] == pytest.approx(125.0) and row["fused"]["gbps"] == pytest.approx(200.0)
    assert row["baseline"]["wait_ms"] == 7.5 and row["fused"]["wait_ms"] == pytest.approx(4.5)  # 5.0 - 0.5
    assert row["speedup"] == pytest.approx(1.6) and row["fused_vs_bound"] == pytest.approx(1.25)
    assert row["check_failed"] == []
    link_bound = bench.summarise("fwd", 4 * nbytes, TIMES, GOOD, nvlink_gbps=400.0)
    assert link_bound["bound_ms"] == pytest.approx(10.0)  # the link dominates
    assert bench.summarise("fwd", nbytes, TIMES, GOOD, None)["bound_ms"] is None


def test_no_speedup_is_reported_when_a_check_fails_or_b_did_not_run():
    for bad in (5e-2, math.nan):
        row = bench.summarise("fwd", 10**9, TIMES, {**GOOD, "fused": {"y": bad}}, 400.0)
        assert row["speedup"] is None and row["fused_vs_bound"] is None
        assert row["check_failed"] and row["check_failed"][0].startswith("fused y")
        assert row["fused"]["layer_ms"] == 5.0  # the times are still shown
    baseline_only = bench.PassTimes(4.0, 0.5, 8.0, 7.5, 4.1)
    row = bench.summarise("fwd", 10**9, baseline_only, {"baseline": {"y": 1e-3}}, 400.0)
    assert row["fused"] is None and row["speedup"] is None and row["baseline"]["layer_ms"] == 8.0


def _reports(fused: bool, y_err: float = 3e-3) -> dict[int, dict]:
    per_pass = lambda value: {p: value for p in bench.PASSES}  # noqa: E731
    errors = {"fwd": {"baseline": {"y": 2e-3}}, "bwd": {"baseline": {"dx": 2e-3, "d_weights": 2e-3},
                                                        "experts": {"dw13": 3e-3, "dw2": 3e-3}}}
    if fused:
        errors["fwd"]["fused"] = {"y": y_err}
        errors["bwd"]["fused"] = {"dx": 3e-3, "d_weights": 3e-3}
    rank0 = {"pure_combine": per_pass(0.5), "baseline": per_pass({"wait": 7.5, "layer": 8.0}),
             "fused": per_pass({"layer": 5.0}) if fused else None, "errors": errors}
    rank1 = {"compute": per_pass(4.0), "baseline": per_pass({"expert": 4.1}),
             "fused": per_pass({"expert": 4.6}) if fused else None, "tiles": {}}
    return {0: {"rank": 0, "shapes": [rank0], "environment": {"gpu": "test"}},
            1: {"rank": 1, "shapes": [rank1]}}


OPTIONS = {"iters": 3, "warmup": 1, "segment_tokens": 8, "combine_programs": 2, "seed": 0}


def test_the_record_adds_a_fwd_bwd_row_and_collects_failed_checks():
    record = bench.build_record([TINY], _reports(True), {"nvlink_gbps": 400.0}, OPTIONS, None)
    json.dumps(record)
    (shape,) = record["shapes"]
    assert [r["pass"] for r in shape["passes"]] == ["fwd", "bwd", "fwd+bwd"]
    fwd, bwd, total = shape["passes"]
    assert fwd["speedup"] == pytest.approx(1.6) and bwd["errors"]["experts"]["dw13"] == 3e-3
    assert total["baseline"]["layer_ms"] == 16.0 and total["bytes"] == 2 * TINY.bytes_returned
    assert total["bound_ms"] == pytest.approx(fwd["bound_ms"] + bwd["bound_ms"])
    assert total["speedup"] == pytest.approx(1.6) and shape["segments"] == fr.num_segments(TINY.tokens, 8)
    assert record["check_failed"] == [] and record["fused"] and record["nvlink_gbps"] == 400.0

    failing = bench.build_record([TINY], _reports(True, y_err=0.3), {"nvlink_gbps": 400.0}, OPTIONS, None)
    assert failing["check_failed"] == ["tiny fwd fused y 3.00e-01"]
    assert [r["speedup"] for r in failing["shapes"][0]["passes"]][0::2] == [None, None]  # fwd and the total

    skipped = bench.build_record([TINY], _reports(False), {"nvlink_gbps": 400.0}, OPTIONS, "no nvshmem4py")
    assert not skipped["fused"] and skipped["fused_skipped"] == "no nvshmem4py"
    assert all(r["fused"] is None and r["speedup"] is None for r in skipped["shapes"][0]["passes"])


def test_arena_holds_both_directions_of_the_largest_shape():
    small = bench.LayerShape("s", 4, 16, 8, 2, 10)
    segments, rows_bytes, total = bench.arena_layout([TINY, small], segment_tokens=8)
    assert segments == fr.num_segments(TINY.tokens, 8)
    assert rows_bytes >= TINY.bytes_returned and rows_bytes % ALIGN == 0
    assert total == align(2 * segments * 8) + 2 * rows_bytes


def test_options_and_gpus_are_checked_with_the_fix(monkeypatch):
    with pytest.raises(ValueError, match="--segment-tokens 0"):
        bench.check_options(3, 1, 0, 16)
    with pytest.raises(ValueError, match="--combine-programs -1"):
        bench.check_options(3, 1, 8, -1)
    with pytest.raises(ValueError, match="--iters >= 1"):
        bench.check_options(0, 1, 8, 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="needs 2 CUDA GPUs.*1 is visible"):
        bench.check_gpus()


def test_without_nvshmem4py_the_fused_path_is_skipped_saying_why(monkeypatch):
    import disagmoe.comm.nvshmem as nvshmem

    monkeypatch.setattr(nvshmem, "available", lambda: False)
    assert "nvshmem4py is not installed" in bench.fused_unavailable()
    assert "baseline (a) only" in bench.fused_unavailable()
    monkeypatch.setattr(nvshmem, "available", lambda: True)
    assert bench.fused_unavailable() is None


def invoke(*args: str):
    return CliRunner().invoke(app, ["bench", "layer", *args])


def test_cli_a_failed_check_is_one_error_line_and_exit_1(monkeypatch):
    """The run's record names the checks that failed: the command prints it, then one error line
    and no speedup (this path once raised NameError: print_error was not imported)."""
    record = {"check_failed": ["qwen3-30b-a3b fused: outputs differ"], "tolerance": 2e-2}
    monkeypatch.setattr(bench, "run", lambda *args, **kwargs: record)
    result = invoke("--shape", "qwen3-30b-a3b", "--json")
    assert result.exit_code == 1
    assert "outputs or gradients differ from the single-GPU reference beyond bf16 tolerance (2e-02)" in result.output
    assert "no speedup reported" in result.output and "Traceback" not in result.output


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks the message without 2 GPUs")
def test_cli_without_two_gpus_is_one_clear_line():
    result = invoke("--shape", "deepseek-v3-4k")
    assert result.exit_code == 2
    assert "needs 2 CUDA GPUs" in result.output and "Traceback" not in result.output


@pytest.mark.parametrize(("args", "message"), [
    (["--shape", "mixtral"], "unknown shape(s) mixtral"),
    (["--segment-tokens", "0"], "--segment-tokens 0"),
    (["--combine-programs", "-1"], "--combine-programs -1"),
    (["--order", "random"], "--order 'random': choose segment"),
    (["--iters", "0"], "--iters >= 1"),
    (["--warmup", "0"], "--warmup >= 1 (the first iteration of each variant compiles"),
])
def test_cli_bad_options_exit_2_with_the_fix(args, message):
    result = invoke(*args)
    assert result.exit_code == 2 and message in result.output and "Traceback" not in result.output


def test_cli_help_names_the_knobs_and_its_defaults_are_the_module_s():
    result = invoke("--help")
    assert result.exit_code == 0
    for knob in ("--shape", "--iters", "--warmup", "--segment-tokens", "--combine-programs", "--order", "--json", "--out"):
        assert knob in result.output
    assert f"[default: {bench.DEFAULT_SEGMENT_TOKENS}]" in result.output
    assert "[default: 0]" in result.output and "[default: expert]" in result.output  # training's choices


needs_two_gpus_and_nvshmem = pytest.mark.skipif(
    torch.cuda.device_count() < 2 or bench.fused_unavailable() is not None,
    reason="needs 2 CUDA GPUs and nvshmem4py")


@pytest.mark.gpu
@needs_two_gpus_and_nvshmem
def test_gpu_a_tiny_layer_end_to_end_on_two_gpus():
    """Both variants on a small shape (two segments, random routing): every check within bf16
    tolerance, so (a)/(b) and (b)/bound are reported."""
    shape = bench.LayerShape("tiny-gpu", experts=8, hidden=256, ffn=128, top_k=4, tokens=512)
    record = bench.run([shape], iters=3, warmup=1, segment_tokens=256, combine_programs=4, log=lambda _: None)
    assert record["fused"] and record["check_failed"] == [], record["check_failed"]
    assert record["nvlink_gbps"] > 10
    for row in record["shapes"][0]["passes"]:
        assert row["baseline"]["layer_ms"] > 0 and row["fused"]["layer_ms"] > 0
        assert row["speedup"] is not None and row["fused_vs_bound"] is not None
        assert max(e for errs in row["errors"].values() for e in errs.values()) < bench.TOLERANCE
