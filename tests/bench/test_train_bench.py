"""`disagmoe bench train`: per-mode configs, the median and the same-run ratio, the CLI."""

import json

import pytest
from typer.testing import CliRunner

from disagmoe.bench.train import (fp8_kernels, mean_busy, mean_waits, median_step, mode_config, row_label, runs_of,
                                  summarise)
from disagmoe.cli.app import app
from disagmoe.config import TrainConfig


def test_mode_config_gives_colocated_the_same_devices(tmp_path):
    cfg = TrainConfig(model="tiny", attention_ranks=2, expert_ranks=3, colocated_ranks=2)
    col = mode_config(cfg, "colocated", 5, tmp_path)
    assert col.colocated_ranks == 5 and col.steps == 5 and not col.trace and col.eval_every == 0
    deep = TrainConfig(model="tiny", attention_ranks=2, expert_ranks=2, pipeline_groups=2)
    assert mode_config(deep, "colocated", 5, tmp_path).pipeline_groups == 1  # the one-group baseline
    own = TrainConfig(model="tiny", mode="colocated", colocated_ranks=2, pipeline_groups=2)
    assert (mode_config(own, "colocated", 5, tmp_path).pipeline_groups,
            mode_config(own, "colocated", 5, tmp_path).colocated_ranks) == (2, 2)  # a colocated config's own layout
    assert mode_config(cfg, "disaggregated", 5, tmp_path).out_dir != col.out_dir
    with pytest.raises(ValueError, match="unknown mode"):
        mode_config(cfg, "diagonal", 5, tmp_path)


def test_a_variants_colocated_row_is_the_same_baseline_as_the_plain_one(tmp_path):
    """`--variant` with `--mode colocated` of a disaggregated config: the row is the baseline of the
    same GPUs as one pipeline group, as without a variant (validated in that layout: pipeline_groups 4
    over the default colocated_ranks 2 would not split), and the variant's overrides still win."""
    from disagmoe.bench.train import variant_config

    cfg = TrainConfig(model="tiny", attention_ranks=2, expert_ranks=2, pipeline_groups=2)
    plain = mode_config(cfg, "colocated", 5, tmp_path)
    varied = mode_config(variant_config(cfg, "seed=3", "colocated"), "colocated", 5, tmp_path)
    assert (plain.colocated_ranks, plain.pipeline_groups) == (varied.colocated_ranks, varied.pipeline_groups) == (4, 1)
    assert varied.seed == 3
    deep = TrainConfig(model="tiny", attention_ranks=4, expert_ranks=4, pipeline_groups=4)
    assert variant_config(deep, "seed=3", "colocated").colocated_ranks == 8
    assert variant_config(cfg, "pipeline_groups=2", "colocated").pipeline_groups == 2  # the variant wins


def test_each_distributed_mode_runs_once_per_transport_asked_for(tmp_path):
    assert runs_of(["single", "disaggregated"], ["nccl", "nvshmem"]) == [
        ("single", None, None), ("disaggregated", "nccl", None), ("disaggregated", "nvshmem", None)]
    assert runs_of(["colocated"], None) == [("colocated", None, None)]
    assert runs_of(["disaggregated"], ["nccl", "nvshmem"], ["partial_sums", "pair_rows"]) == [
        ("disaggregated", "nccl", "partial_sums"), ("disaggregated", "nvshmem", "partial_sums"),
        ("disaggregated", "nvshmem", "pair_rows")]  # no pair rows over nccl
    with pytest.raises(ValueError, match="unknown hop 'rows'"):
        runs_of(["disaggregated"], None, ["rows"])
    with pytest.raises(ValueError, match="unknown transport 'ib'"):
        runs_of(["disaggregated"], ["ib"])
    cfg = TrainConfig(model="tiny", transport="nccl", device="cuda")
    nv = mode_config(cfg, "disaggregated", 5, tmp_path, "nvshmem")
    assert nv.transport == "nvshmem" and nv.out_dir != mode_config(cfg, "disaggregated", 5, tmp_path).out_dir
    pairs = mode_config(cfg.model_copy(update={"experts_backend": "triton"}), "disaggregated", 5, tmp_path,
                        "nvshmem", "pair_rows")
    assert pairs.hop == "pair_rows" and pairs.out_dir != nv.out_dir
    with pytest.raises(ValueError, match="needs transport: nvshmem"):  # the config's own refusal
        mode_config(cfg, "disaggregated", 5, tmp_path, "nccl", "pair_rows")


def test_an_fp8_rows_record_names_the_kernels_its_experts_ran():
    """Each FP8 row says which kernels its experts ran per GEMM role (`fp8_kernels`: the recipe and
    `fp8_gluon`, on the row's device; on a CPU every role is Triton's), a bf16 row None."""
    assert fp8_kernels(TrainConfig(model="tiny")) is None
    gate_up = TrainConfig(model="tiny", device="cuda", experts_backend="triton", precision="fp8",
                          fp8_expert_forward="gate-up", fp8_expert_backward="bf16", fp8_gluon=True)
    assert fp8_kernels(gate_up.model_copy(update={"device": "cpu"})) == (
        "rows triton | swiglu triton | wgrad bf16 triton | backward bf16 triton | forward down bf16 triton")
    default = TrainConfig(model="tiny", device="cuda", experts_backend="triton", precision="fp8")
    assert fp8_kernels(default.model_copy(update={"device": "cpu"})) == (
        "rows triton | swiglu triton | wgrad bf16 triton | forward gate/up bf16 triton")  # forward down: the default


def test_gpu_waits_are_averaged_per_group_and_payload_after_the_warmup():
    records = [{"step": 1, "gpu_wait": {"A0": {"combine": 0.5}}},
               {"step": 2, "gpu_wait": {"A0": {"combine": 0.04}, "E0": {"dispatch": 0.1}}},
               {"step": 3, "gpu_wait": {"A0": {"combine": 0.02, "dispatch_grad": 0.01}, "E0": {"dispatch": 0.3}}}]
    waits = mean_waits(records, warmup=1)
    assert set(waits) == {"A0", "E0"} and waits["E0"] == pytest.approx({"dispatch": 0.2})
    assert waits["A0"] == pytest.approx({"combine": 0.03, "dispatch_grad": 0.005})
    assert mean_waits([{"step": 2, "gpu_wait": {}}], warmup=1) == {}


def test_median_skips_warmup_and_ratio_is_against_colocated():
    records = [{"step": i, "step_time_s": t} for i, t in enumerate([9.0, 9.0, 1.0, 2.0, 3.0], start=1)]
    assert median_step(records, warmup=2) == 2.0
    with pytest.raises(ValueError, match="more --steps"):
        median_step(records, warmup=5)
    rows = summarise([{"mode": "disaggregated", "median_step_s": 1.0}, {"mode": "colocated", "median_step_s": 1.5}])
    assert [r["speedup"] for r in rows] == [1.5, 1.0] and rows[0]["baseline"] == "colocated"


def test_two_transports_of_one_mode_name_the_baseline_row_with_its_transport():
    rows = summarise([{"mode": "disaggregated", "transport": "nccl", "median_step_s": 2.0},
                      {"mode": "disaggregated", "transport": "nvshmem", "median_step_s": 1.0}])
    assert [r["speedup"] for r in rows] == [1.0, 2.0]
    assert {r["baseline"] for r in rows} == {"disaggregated (nccl)"}


def test_busy_fractions_are_averaged_per_group_after_the_warmup():
    records = [{"step": 1, "busy": {"A0": 0.1, "E0": 0.1}}, {"step": 2, "busy": {"A0": 0.6, "E0": 0.4}},
               {"step": 3, "busy": {"A0": 0.8, "E0": 0.5}}]
    assert mean_busy(records, warmup=1) == pytest.approx({"A0": 0.7, "E0": 0.45})
    assert mean_busy([{"step": 2}], warmup=1) == {}  # single mode: no groups


def test_cli_times_the_single_mode():
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single",
                                 "--steps", "4", "--warmup", "1", "--json"])
    assert r.exit_code == 0, r.output
    record = json.loads(r.stdout)
    (row,) = record["modes"]
    assert row["mode"] == "single" and row["median_step_s"] > 0 and row["speedup"] == 1.0 and row["busy"] == {}
    assert len(row["step_times_s"]) == 4 and sorted(row["step_times_s"][1:])[1] == row["median_step_s"]


def test_variants_run_every_mode_again_and_compare_with_the_first():
    """Two variants of the tiny CPU config in one run (CPU: no memory figure, so no memory ratio):
    a row per variant, labelled, each against the same mode under the first variant."""
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single",
                                 "--steps", "3", "--warmup", "1", "--variant", "micro_batches=1",
                                 "--variant", "micro_batches=2 optim.lr=1e-3", "--json"])
    assert r.exit_code == 0, r.output
    first, second = json.loads(r.stdout)["modes"]
    assert (first["variant"], second["variant"]) == ("micro_batches=1", "micro_batches=2 optim.lr=1e-3")
    assert first["vs_variant"] == 1.0 and second["variant_baseline"] == "micro_batches=1"
    assert second["vs_variant"] == pytest.approx(second["tokens_per_s"] / first["tokens_per_s"])
    assert first["memory_vs_variant"] is None  # CPU runs record no peak memory
    assert row_label(second) == "single (micro_batches=2 optim.lr=1e-3)"


@pytest.mark.parametrize("variant, message", [
    ("micro_batches", "override 'micro_batches' must look like key=value"),
    ("recompute=sometimes", "--variant 'recompute=sometimes': recompute"),
    ("", "give key=value overrides"),
])
def test_a_variant_that_cannot_run_is_refused_before_any_step(variant, message):
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single",
                                 "--steps", "3", "--variant", "micro_batches=1", "--variant", variant])
    assert r.exit_code != 0 and message in r.output and "Traceback" not in r.output, r.output
    assert ": 3 steps" not in r.output  # refused before the first variant's run started


def test_a_variant_is_checked_in_the_mode_its_row_runs():
    """`--mode single --variant cuda_graphs=on` of a config written for a distributed mode: the
    variant is checked as the single row runs it (accepted), and refused in a distributed mode
    with the config's reason (its transport, nccl, is not captured) (was: refused against the config's own mode before any row ran)."""
    from disagmoe.bench.train import variant_config
    from disagmoe.config import load_train_config

    cfg = load_train_config("configs/h200x2-qwen3-30b.yaml", [])
    assert cfg.mode == "disaggregated"
    assert variant_config(cfg, "cuda_graphs=on", "single").cuda_graphs == "on"
    with pytest.raises(ValueError, match="--variant 'cuda_graphs=on'.*only over transport nvshmem"):
        variant_config(cfg, "cuda_graphs=on", "disaggregated")  # the config's transport is nccl


def _out_of_memory_at(micro_batches: int, monkeypatch) -> None:
    """Rows of `micro_batches` fail as a CUDA out-of-memory error does (`metrics.OutOfMemory`)."""
    from disagmoe.bench import train as bench
    from disagmoe.runtime.observe.metrics import OutOfMemory

    real = bench.train_row

    def train_row(cfg, clocks=None):
        if cfg.micro_batches == micro_batches:
            raise OutOfMemory(f"this GPU ran out of memory; ... micro_batches={micro_batches} does not fit")
        return real(cfg, clocks)

    monkeypatch.setattr(bench, "train_row", train_row)


def test_a_row_that_runs_out_of_memory_is_kept_and_the_next_rows_run(monkeypatch):
    """The first variant fails (a variant that does not fit); the second still trains, each row is
    logged as it ends, and the failed row stays in the record with its one-line error."""
    _out_of_memory_at(1, monkeypatch)
    args = ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps", "3", "--warmup", "1",
            "--variant", "micro_batches=1", "--variant", "micro_batches=2"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    failed, ran = json.loads(r.stdout)["modes"]
    assert failed["variant"] == "micro_batches=1" and "micro_batches=1 does not fit" in failed["error"]
    assert ran["variant"] == "micro_batches=2" and ran["median_step_s"] > 0 and ran["speedup"] == 1.0
    assert "vs_variant" not in ran  # its first variant has no figure to compare with
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "single [micro_batches=1]: did not run: this GPU ran out of memory" in r.output
    assert "single [micro_batches=2]: " in r.output and " ms/step, " in r.output  # logged as the row ended
    assert "single (micro_batches=1) did not run" in r.output  # under the table


def test_the_out_file_holds_each_finished_row_while_the_run_goes_on(tmp_path, monkeypatch):
    """-o is rewritten as each row ends (marked partial), so a run stopped in its second row keeps
    the first; at the end it is the whole record."""
    from disagmoe.bench import train as bench

    out = tmp_path / "bench.json"
    real, seen = bench.train_row, []

    def train_row(cfg, clocks=None):
        if out.exists():
            seen.append(json.loads(out.read_text()))
        return real(cfg, clocks)

    monkeypatch.setattr(bench, "train_row", train_row)
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps", "3",
                                 "--warmup", "1", "--variant", "micro_batches=1", "--variant", "micro_batches=2",
                                 "-o", str(out)])
    assert r.exit_code == 0, r.output
    (partial,) = seen  # before the second row: the first row's record
    assert partial["partial"] is True and [row["variant"] for row in partial["modes"]] == ["micro_batches=1"]
    final = json.loads(out.read_text())
    assert "partial" not in final and [row["variant"] for row in final["modes"]] == ["micro_batches=1", "micro_batches=2"]


def test_a_run_whose_every_row_fails_exits_with_their_errors(monkeypatch):
    _out_of_memory_at(2, monkeypatch)
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single",
                                 "--steps", "3", "--warmup", "1", "--variant", "micro_batches=2"])
    assert r.exit_code != 0 and "no row of the run trained" in r.output and "Traceback" not in r.output, r.output


def test_plot_draws_every_rows_losses_and_their_distance_from_the_first(tmp_path):
    """`--plot`: a PNG of the two variants' curves; each row keeps its per-step losses and, having
    run no FP8 GEMM, no saturation shares (the FP8 panel is drawn only for rows that have them)."""
    png = tmp_path / "loss.png"
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single",
                                 "--steps", "3", "--warmup", "1", "--variant", "micro_batches=1",
                                 "--variant", "micro_batches=2", "--plot", str(png), "--json"])
    assert r.exit_code == 0, r.output
    rows = json.loads(r.stdout)["modes"]
    assert all(len(row["losses"]) == 3 and row["max_fp8_saturated_share"] is None for row in rows)
    assert all(share is None for row in rows for share in row["fp8_saturated_shares"])
    assert all(row["fp8_underflow_by_kind"] == {} for row in rows)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_rows_fp8_underflow_is_each_kinds_mean_share_over_its_steps():
    """The step records' per-kind counters (`Fp8Stats.fields`' fp8_by_kind) become a row's mean share
    of elements quantised to zero per kind; a kind no step quantised is left out."""
    from disagmoe.bench.train import underflow_by_kind

    def kinds(grad, dense_elements):
        return {"fp8_by_kind": {"activations": {"underflow_share": 0.0, "elements": 10},
                                "gradients": {"underflow_share": grad, "elements": 10},
                                "dense": {"underflow_share": 0.0, "elements": dense_elements}}}

    records = [kinds(1e-3, 0), kinds(3e-3, 0), {"loss": 2.0}]
    assert underflow_by_kind(records) == pytest.approx({"activations": 0.0, "gradients": 2e-3})
    some = [kinds(1e-3, 0), {"fp8_by_kind": {**kinds(1e-3, 0)["fp8_by_kind"],
                                             "dense": {"underflow_share": 4e-3, "elements": 10}}}]
    assert underflow_by_kind(some)["dense"] == pytest.approx(4e-3)  # over the one step that quantised it
    assert underflow_by_kind([{"loss": 2.0}]) == {}


def test_the_loss_plot_adds_the_fp8_panel_and_reads_parity_in_percent(tmp_path, monkeypatch):
    """Rows with FP8 saturation shares get the third panel (its bar 1e-4); the middle panel is each
    row's loss relative to the first row's, in percent."""
    import matplotlib.figure

    from disagmoe.bench.loss_plot import SATURATION_BAR, plot_losses, relative_percent

    assert relative_percent([2.02, 3.0], [2.0, 3.0, 4.0]) == pytest.approx([1.0, 0.0])
    panels = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig",
                        lambda fig, *a, **k: (panels.append(len(fig.axes)), real(fig, *a, **k))[1])
    bf16 = {"losses": [3.0, 2.5, 2.2], "fp8_saturated_shares": [None] * 3}
    fp8 = {"losses": [3.0, 2.52, 2.21], "fp8_saturated_shares": [0.0, 2e-6, 5e-5]}
    plot_losses([bf16, fp8], tmp_path / "a.png", "parity", ["bf16", "fp8"])
    plot_losses([bf16], tmp_path / "b.png", "plain", ["bf16"])
    assert panels == [3, 2] and SATURATION_BAR == 1e-4
    with pytest.raises(ValueError, match="no row has losses"):
        plot_losses([{"losses": []}], tmp_path / "c.png", "none", ["x"])


def test_the_loss_plots_long_variant_names_wrap_in_its_legends_and_titles(tmp_path, monkeypatch):
    """A variant's overrides (`precision=fp8 fp8_dense=false fp8_expert_backward=bf16 ...`) name a row:
    every legend entry and title line is at most LABEL_WIDTH characters, and the middle panel's
    y label is short (the first row is named in its title), so nothing runs off the figure."""
    import matplotlib.figure

    from disagmoe.bench.loss_plot import LABEL_WIDTH, plot_losses

    texts = []
    real = matplotlib.figure.Figure.savefig

    def record(fig, *a, **k):
        for ax in fig.axes:
            legend = ax.get_legend()
            texts.extend(t.get_text() for t in (legend.get_texts() if legend else []))
            texts.extend([ax.get_title(), ax.get_ylabel()])
        return real(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    long = "single (precision=fp8 fp8_dense=false fp8_expert_backward=bf16-wgrad fp8_expert_forward=down routing=learned)"
    rows = [{"losses": [3.0, 2.5]}, {"losses": [3.0, 2.6], "fp8_saturated_shares": [0.0, 1e-6]}]
    plot_losses(rows, tmp_path / "a.png", "parity", ["single (precision=bf16)", long])
    assert any("fp8_expert_forward=down" in t for t in texts)
    assert all(len(line) <= LABEL_WIDTH for t in texts for line in t.splitlines())


def test_a_row_whose_fp8_counters_skipped_steps_says_over_how_many_it_read_them():
    from disagmoe.bench.train import counted_note

    assert counted_note([0.0, None, None, 0.0, None]) == " (over the 2 of 5 steps that counted)"
    assert counted_note([0.0, 0.0]) == "" and counted_note([None, None]) == "" and counted_note([]) == ""


def test_rows_whose_fp8_counters_count_unalike_get_a_line_saying_so():
    from disagmoe.bench.train import counting_note

    fp8 = TrainConfig(model="tiny", device="cuda", experts_backend="triton", precision="fp8", hop="partial_sums")
    single, split = fp8.model_copy(update={"mode": "single"}), fp8.model_copy(update={"mode": "disaggregated"})
    assert "count their numerics on every step in some, every 10th step in others" in counting_note([single, split])
    assert counting_note([single, single]) is None and counting_note([split, TrainConfig(model="tiny")]) is None
    assert counting_note([single.model_copy(update={"fp8_counters_every": 1}), split]) is None


def test_a_captured_rows_warm_up_runs_through_its_capture_steps(tmp_path):
    """`timed_warmup`: a row whose step is captured (single on CUDA, cuda_graphs auto) times no capture
    step: bf16 warms up through step 4, precision fp8 (counting every 10th step) through 10; more
    warm-up is kept; an eager row, and one whose `cuda_graphs: on` its layout refuses (it fails as it
    starts), keep --warmup."""
    from disagmoe.bench.train import timed_warmup

    cfg = TrainConfig(model="tiny", device="cuda", experts_backend="triton")
    bf16 = mode_config(cfg, "single", 20, tmp_path)
    assert timed_warmup(bf16, 3, 20) == (4, "the step is captured on step 4")
    assert timed_warmup(bf16, 6, 20) == (6, None)
    fp8 = mode_config(cfg.model_copy(update={"precision": "fp8"}), "single", 20, tmp_path)
    warmup, why = timed_warmup(fp8, 3, 20)
    assert warmup == 10 and why.startswith("the step is captured on steps 4 and 10")
    assert timed_warmup(bf16.model_copy(update={"cuda_graphs": "off"}), 3, 20) == (3, None)
    refused = mode_config(cfg.model_copy(update={"transport": "nccl"}), "disaggregated", 20, tmp_path)
    assert timed_warmup(refused.model_copy(update={"cuda_graphs": "on"}), 3, 20) == (3, None)


def test_too_few_steps_for_a_captured_row_are_refused_naming_the_steps_needed():
    """`--steps 6 --warmup 3` of a bf16 and an fp8 row on CUDA: the fp8 row captures on steps 4 and 6 (its
    last step counts: the counting graph's capture), leaving none to time; refused before any row trains,
    naming the row and the --steps that leaves it one (11: captures on 4 and 10, step 11 a replay)."""
    from disagmoe.bench.train import check_timed_steps, steps_needed

    args = ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps", "6", "--warmup", "3",
            "--variant", "precision=bf16", "--variant", "precision=fp8", "device=cuda", "experts_backend=triton"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code != 0 and "Traceback" not in r.output, r.output
    assert ("--steps 6 leaves no step to time after the capture steps (never timed) of single [precision=fp8]: the "
            "step is captured on steps 4 and 6") in r.output and "pass --steps 11 or more" in r.output
    assert ": 6 steps" not in r.output  # refused before the first row trained
    cfg = TrainConfig(model="tiny", mode="single", device="cuda", experts_backend="triton")
    assert steps_needed(cfg, 3, 2) == 5 and steps_needed(cfg, 3, 5) == 5 and steps_needed(cfg, 7, 2) == 8
    with pytest.raises(ValueError, match="--steps 3 leaves no step to time after --warmup 3: pass --steps 4 or more"):
        check_timed_steps([("single", cfg.model_copy(update={"cuda_graphs": "off"}))], 3, 3)
    check_timed_steps([("single", cfg)], 3, 5)  # step 5 a replay


def _captured_at(micro_batches: int, step: int, monkeypatch) -> None:
    """Rows of `micro_batches` read as captured on `step` (a CPU run: the timing's side of a GPU's
    captured row), the others as eager."""
    from disagmoe.bench import train as bench

    def past(cfg, warmup, steps=None):
        if cfg.micro_batches != micro_batches or warmup >= step:
            return warmup, None
        return step, f"the step is captured on step {step}"

    monkeypatch.setattr(bench, "warmup_past_capture", past)


def test_a_captured_row_times_the_steps_after_its_capture_and_records_its_warm_up(monkeypatch):
    """A row captured on step 2 (`--warmup 1`) warms up 2 steps and says so in one line; its median is
    of steps 3-4, and its record keeps the warm-up it used and why; an uncaptured row keeps --warmup,
    and the table then gives each row's timed steps."""
    _captured_at(2, 2, monkeypatch)
    args = ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps", "4", "--warmup", "1",
            "--variant", "micro_batches=1", "--variant", "micro_batches=2", "--no-gpu-clocks"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    record = json.loads(r.stdout)
    plain, captured = record["modes"]
    assert record["warmup"] == 1 and (plain["warmup"], plain["warmup_note"]) == (1, None)
    assert (captured["warmup"], captured["warmup_note"]) == (2, "the step is captured on step 2")
    assert captured["median_step_s"] == pytest.approx(sum(captured["step_times_s"][2:]) / 2)
    assert plain["median_step_s"] == sorted(plain["step_times_s"][1:])[1]
    assert ("single [micro_batches=2]: warming up 2 steps, not 1: the step is captured on step 2, and the timed "
            "steps are replays") in r.stderr
    assert "single [micro_batches=1]: warming up" not in r.stderr
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "median of each row's steps after its warm-up (timed)" in r.output and "3-4" in r.output


def test_rows_timing_fewer_steps_than_asked_are_named_with_the_steps_that_time_them_all(monkeypatch, tmp_path):
    """A captured row warms up through its capture steps, so it times fewer steps than `--steps - --warmup`:
    one line before the rows train names each such row's count and the --warmup and --steps that time as many
    as asked in every row over the same steps (an FP8 row on CUDA at --steps 12 --warmup 4 times 2 steps, 11-12;
    --warmup 10 --steps 18 times steps 11-18 in every row), after which no line."""
    from disagmoe.bench.train import short_rows_note

    _captured_at(2, 2, monkeypatch)
    args = ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps", "4", "--warmup", "1",
            "--variant", "micro_batches=1", "--variant", "micro_batches=2", "--no-gpu-clocks", "--json"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    said = " ".join(r.stderr.split())  # the console wraps long lines
    assert ("single [micro_batches=2] times 2 of its steps (warm-ups through the capture steps), not the 3 that "
            "--steps 4 --warmup 1 asks: pass --warmup 2 --steps 5 to time steps 3-5 in every row") in said
    assert said.index("times 2 of its steps") < said.index("single [micro_batches=1]: 4 steps")
    again = CliRunner().invoke(app, [*args[:7], "5", "--warmup", "2", *args[10:]])
    assert again.exit_code == 0 and "of its steps" not in again.stderr, again.stderr
    monkeypatch.undo()
    cfg = TrainConfig(model="tiny", device="cuda", experts_backend="triton")
    bf16 = mode_config(cfg, "single", 12, tmp_path)
    fp8 = mode_config(cfg.model_copy(update={"precision": "fp8"}), "single", 12, tmp_path)
    note = short_rows_note([("bf16", bf16), ("fp8", fp8)], 4, 12)
    assert note.startswith("fp8 times 2 of its steps") and note.endswith(
        "pass --warmup 10 --steps 18 to time steps 11-18 in every row")
    assert short_rows_note([("bf16", bf16), ("fp8", fp8)], 10, 18) is None


def test_a_single_rows_record_says_whether_its_expert_weight_gradients_ran_paired(monkeypatch):
    """Each row records `expert_wgrad_pairs` as its trainer resolved it (auto decides against the device's memory:
    the variant's text alone does not say) and logs the trainer's line saying so, as it logs the split's."""
    import dataclasses

    from disagmoe.bench import train as bench

    real = bench.train_row
    note = "expert_wgrad_pairs: auto -> on: each expert weight gradient runs 1 times a step"

    def train_row(cfg, clocks=None):
        summary = real(cfg, clocks)
        return dataclasses.replace(summary, expert_wgrad_pairs=True, expert_wgrad_pairs_note=note)

    monkeypatch.setattr(bench, "train_row", train_row)
    args = ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps", "2", "--warmup", "1"]
    r = CliRunner().invoke(app, [*args, "--json"])
    assert r.exit_code == 0, r.output
    (row,) = json.loads(r.stdout)["modes"]
    assert row["expert_wgrad_pairs"] is True
    assert note in r.stderr
