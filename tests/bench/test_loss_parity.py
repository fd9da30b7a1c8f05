"""`bench.loss_parity` and `bench train --seeds`: a variant's loss read against the first variant's
spread over initialisations, on the same batches."""

import json

import pytest
from typer.testing import CliRunner

from disagmoe.bench.loss_parity import loss_parity, mean_curve, window_mean
from disagmoe.bench.train import row_label
from disagmoe.cli.app import app
from disagmoe.config import TrainConfig


def _row(variant, seed, losses, mode="single"):
    return {"mode": mode, "transport": None, "hop": None, "variant": variant, "seed": seed, "losses": losses}


def test_each_variant_is_read_against_the_first_variants_seeds():
    """Window means per seed, their mean and range; the second variant's gap to the first's mean,
    its per-seed (paired) gaps, and whether its mean lies inside the first's range of seeds."""
    rows = [_row("bf16", 0, [9.0, 2.0, 2.2]), _row("fp8", 0, [9.0, 2.1, 2.1]),
            _row("bf16", 1, [9.0, 2.4, 2.6]), _row("fp8", 1, [9.0, 2.6, 2.8]),
            {**_row("fp8", 2, []), "error": "out of memory"}]
    bf16, fp8 = loss_parity(rows, window=2)
    assert bf16["seeds"] == [0, 1] and bf16["seed_losses"] == pytest.approx([2.1, 2.5])
    assert (bf16["loss"], bf16["low"], bf16["high"]) == pytest.approx((2.3, 2.1, 2.5))
    assert bf16["spread"] == pytest.approx(0.4 / 2.3) and bf16["vs_first"] is None and bf16["paired_gaps"] is None
    assert fp8["loss"] == pytest.approx(2.4) and fp8["vs_first"] == pytest.approx(2.4 / 2.3 - 1)
    assert fp8["paired_gaps"] == pytest.approx([0.0, 2.7 / 2.5 - 1])
    assert fp8["step_gaps"] == pytest.approx([(0.1 / 2.0 + 0.1 / 2.2) / 2, (0.2 / 2.4 + 0.2 / 2.6) / 2])
    assert bf16["step_gaps"] is None and fp8["inside_reference_range"] is True
    far = loss_parity(rows[:4] + [_row("far", 0, [9.0, 3.0, 3.0]), _row("far", 1, [9.0, 3.1, 3.1])], window=2)[2]
    assert far["inside_reference_range"] is False and far["common_seeds"] == [0, 1]


def test_a_seed_one_side_lacks_is_left_out_of_the_comparison():
    """A variant whose seed-1 row failed (out of memory) is compared with the reference over seed 0
    alone: its gap is the paired one, not its seed 0 against the mean of the reference's two seeds;
    with one common seed there is no range to lie inside."""
    rows = [_row("bf16", 0, [2.0]), _row("fp8", 0, [2.0]), _row("bf16", 1, [3.0]),
            {**_row("fp8", 1, []), "error": "out of memory"}]
    bf16, fp8 = loss_parity(rows, window=1)
    assert bf16["seeds"] == [0, 1] and fp8["seeds"] == [0] and fp8["common_seeds"] == [0]
    assert fp8["vs_first"] == pytest.approx(0.0) and fp8["paired_gaps"] == [0.0]
    assert fp8["inside_reference_range"] is None
    alone = loss_parity([_row("bf16", 0, [2.0]), _row("fp8", 1, [2.5])], window=1)[1]
    assert alone["common_seeds"] == [] and alone["vs_first"] is None


def test_one_seed_gives_the_gap_without_a_range_and_layouts_have_their_own_reference():
    rows = [_row("bf16", None, [3.0, 2.0]), _row("fp8", None, [3.0, 2.2]),
            _row("bf16", None, [3.0, 4.0], mode="colocated"), _row("fp8", None, [3.0, 4.4], mode="colocated")]
    entries = loss_parity(rows, window=1)
    assert [e["vs_first"] for e in entries] == pytest.approx([None, 0.1, None, 0.1])
    assert all(e["inside_reference_range"] is None for e in entries)


def test_the_window_is_the_runs_last_steps():
    assert window_mean([5.0, 1.0, 3.0], 2) == 2.0 and window_mean([5.0, 1.0], 50) == 3.0
    assert mean_curve([{"losses": [1.0, 2.0, 3.0]}, {"losses": [3.0, 4.0]}], "loss") == [2.0, 3.0]
    with pytest.raises(ValueError, match="at least 1"):
        window_mean([1.0], 0)


def test_seeds_vary_the_initialisation_on_the_same_batches_and_a_variants_own_seed_is_refused():
    from disagmoe.bench.train import seeded_config

    cfg = TrainConfig(model="tiny", seed=5)
    runs = [seeded_config(cfg, cfg, i, None) for i in range(3)]
    assert [r.seed for r in runs] == [5, 6, 7] and {r.data_seed for r in runs} == {5}
    with pytest.raises(ValueError, match="take seed and data.seed out of --variant 'seed=3'"):
        seeded_config(cfg, cfg.model_copy(update={"seed": 3}), 1, "seed=3")


def test_cli_seeds_train_every_variant_per_seed_and_print_the_parity(tmp_path):
    """Two variants x two seeds of the tiny CPU config: four rows, seeds outermost, each compared with
    the first variant's row of its own seed; the record's parity has a range for the reference; the
    table and the plot come out."""
    png, out = tmp_path / "loss.png", tmp_path / "bench.json"
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single",
                                 "--steps", "3", "--warmup", "1", "--seeds", "2", "--loss-window", "2",
                                 "--variant", "micro_batches=1", "--variant", "micro_batches=2",
                                 "--plot", str(png), "-o", str(out)])
    assert r.exit_code == 0, r.output
    record = json.loads(out.read_text())
    rows = record["modes"]
    assert [(row["variant"], row["seed"]) for row in rows] == [
        ("micro_batches=1", 0), ("micro_batches=2", 0), ("micro_batches=1", 1), ("micro_batches=2", 1)]
    assert rows[0]["losses"] != rows[2]["losses"]  # another initialisation
    assert rows[3]["vs_variant"] == pytest.approx(rows[3]["tokens_per_s"] / rows[2]["tokens_per_s"])
    parity = record["loss_parity"]
    assert record["seeds"] == 2 and parity["window"] == 2
    reference, other = parity["groups"]
    assert reference["seeds"] == [0, 1] and reference["spread"] is not None
    assert other["inside_reference_range"] is not None and len(other["paired_gaps"]) == 2
    assert "loss parity: mean cross-entropy of the last 2 steps, over 2 seeds" in r.output
    assert row_label(rows[2]) == "single (micro_batches=1, seed 1)"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_a_variant_that_sets_its_own_seed_under_seeds():
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single",
                                 "--steps", "2", "--seeds", "2", "--variant", "seed=4"])
    assert r.exit_code != 0 and "take seed and data.seed out of --variant 'seed=4'" in r.output
    assert "Traceback" not in r.output


def _record(steps, *rows):
    return {"steps": steps, "modes": list(rows)}


def _seeded(variant, init_seed, losses, data_seed=0):
    return {"mode": "single", "variant": variant, "seed": None, "init_seed": init_seed, "data_seed": data_seed,
            "losses": losses}


def test_records_of_one_command_at_several_seeds_read_as_one_table():
    from disagmoe.bench.loss_parity import merged_rows

    a = _record(3, _seeded("bf16", 0, [9.0, 2.0, 2.2]), _seeded("fp8", 0, [9.0, 2.1, 2.1]))
    b = _record(3, _seeded("bf16", 1, [9.0, 2.4, 2.6]), _seeded("fp8", 1, [9.0, 2.6, 2.8]),
                {"mode": "single", "variant": "fp8", "error": "out of memory"})
    bf16, fp8 = loss_parity(merged_rows({"a": a, "b": b}), window=2)
    assert bf16["seeds"] == [0, 1] and bf16["loss"] == pytest.approx(2.3)
    assert fp8["paired_gaps"] == pytest.approx([0.0, 2.7 / 2.5 - 1]) and fp8["inside_reference_range"] is True


def test_seeds_each_on_their_own_data_order_read_paired_and_say_so():
    """Two calls, each a seed with its own data.seed (seed=S data.seed=S): each seed's variants share their
    batches, so the paired and per-step gaps hold seed by seed; the record says two data orders, and the
    table's caption that the batches move with the initialisation."""
    from disagmoe.bench.loss_parity import data_orders, merged_rows
    from disagmoe.cli.bench_cmd import _parity_table

    a = _record(3, _seeded("bf16", 0, [9.0, 2.0, 2.2]), _seeded("fp8", 0, [9.0, 2.1, 2.1]))
    b = _record(3, _seeded("bf16", 1, [9.0, 2.4, 2.6], data_seed=1), _seeded("fp8", 1, [9.0, 2.6, 2.8], data_seed=1))
    rows = merged_rows({"a": a, "b": b})
    bf16, fp8 = loss_parity(rows, window=2)
    assert data_orders(rows) == 2 and bf16["seeds"] == [0, 1]
    assert fp8["paired_gaps"] == pytest.approx([0.0, 2.7 / 2.5 - 1])
    title = _parity_table({"window": 2, "control": None, "data_orders": 2, "groups": [bf16, fp8]}).title
    assert "2 data orders: the initialisation and the batches both move" in title
    pinned = merged_rows({"a": a, "b": _record(3, _seeded("bf16", 1, [9.0, 2.4, 2.6]))})
    assert data_orders(pinned) == 1


def test_a_record_a_killed_call_left_partial_reads_with_the_others():
    """`bench train -o` rewrites its record as each row ends (`partial`: the call stopped before the
    last): the rows it kept read against another call's, each seed's per-step gap too."""
    from disagmoe.bench.loss_parity import merged_rows

    kept = {**_record(3, _seeded("bf16", 0, [9.0, 2.0, 2.2]), _seeded("control", 0, [9.0, 2.2, 2.2])), "partial": True}
    fp8 = _record(3, _seeded("fp8", 0, [9.0, 2.1, 2.1]))
    bf16, control, fp8 = loss_parity(merged_rows({"p1": kept, "p2": fp8}), window=2)
    assert control["step_gaps"] == pytest.approx([(0.2 / 2.0 + 0.0) / 2])
    assert fp8["vs_first"] == pytest.approx(0.0) and fp8["step_gaps"] == pytest.approx([(0.1 / 2.0 + 0.1 / 2.2) / 2])


@pytest.mark.parametrize("records, message", [
    ({"a": _record(3, _seeded("bf16", 0, [1.0])), "b": _record(4, _seeded("bf16", 1, [1.0]))}, "different --steps"),
    ({"a": _record(3, _seeded("bf16", 0, [1.0])), "b": _record(3, _seeded("fp8", 0, [1.0], data_seed=1))},
     "rows of seed 0 trained on different batches"),
    ({"a": _record(3, _seeded("bf16", 0, [1.0])), "b": _record(3, _seeded("bf16", 0, [1.0]))}, "a and b both hold"),
    ({"a": [1, 2]}, "not a `disagmoe bench train --out` record"),
    ({"a": _record(3, {"mode": "single", "variant": None, "losses": [1.0]})}, "do not say their seed"),
    ({}, "at least one"),
])
def test_records_that_cannot_be_read_together_are_refused_with_the_fix(records, message):
    from disagmoe.bench.loss_parity import merged_rows

    with pytest.raises(ValueError, match=message):
        merged_rows(records)


def test_cli_parity_reads_records_written_by_bench_train(tmp_path):
    """Two `bench train --out` records of the tiny CPU config, seed 0 and seed 1 on the data of
    seed 0 (the second call's overrides), read into one table; a bad file is a clear error."""
    paths = []
    for seed in (0, 1):
        path = tmp_path / f"seed{seed}.json"
        r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single",
                                     "--steps", "3", "--warmup", "1", "--variant", "micro_batches=1", "--variant",
                                     "micro_batches=2", f"seed={seed}", "data.seed=0", "-o", str(path)])
        assert r.exit_code == 0, r.output
        paths.append(str(path))
    r = CliRunner().invoke(app, ["bench", "parity", *paths, "--loss-window", "2", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    reference, other = result["groups"]
    assert result["window"] == 2 and reference["seeds"] == [0, 1] and reference["spread"] is not None
    assert result["data_orders"] == 1  # both calls on seed 0's batches
    assert other["variant"] == "micro_batches=2" and len(other["paired_gaps"]) == 2
    table = CliRunner().invoke(app, ["bench", "parity", *paths])
    assert table.exit_code == 0 and "loss parity: mean cross-entropy of the last 3 steps, over 2 seeds" in table.output
    assert "per-step" in table.output and len(other["step_gaps"]) == 2 and "the data order pinned" in table.output
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    r = CliRunner().invoke(app, ["bench", "parity", str(bad)])
    assert r.exit_code != 0 and "not a readable `bench train --out` record" in r.output and "Traceback" not in r.output


def test_parity_reads_the_cross_entropy_not_the_balancing_term():
    """Rows that recorded each step's cross-entropy are compared on it: the training loss adds the
    routers' load-balancing term, which here differs between the variants while the cross-entropy
    does not. Where one row lacks it (an older record, an outside baseline) every row is read in
    the training loss: one measure for the whole set, never the two mixed in one mean."""
    from disagmoe.bench.loss_parity import parity_losses, parity_metric

    bf16 = {**_row("bf16", 0, [3.0, 2.2, 2.2]), "ces": [2.9, 2.0, 2.0]}
    fp8 = {**_row("fp8", 0, [3.0, 2.5, 2.5]), "ces": [2.9, 2.0, 2.0]}
    reference, other = loss_parity([bf16, fp8], window=2)
    assert other["vs_first"] == pytest.approx(0.0) and reference["metric"] == other["metric"] == "ce"
    older = {**_row("fp8", 1, [3.0, 2.6, 2.6]), "ces": [None, None, None]}
    mixed = loss_parity([bf16, fp8, {**_row("bf16", 1, [3.0, 2.4, 2.4]), "ces": [2.9, 2.0, 2.0]}, older], 2)
    assert {e["metric"] for e in mixed} == {"loss"}
    assert mixed[1]["seed_losses"] == pytest.approx([2.5, 2.6])  # both seeds in the training loss
    assert parity_metric([bf16, fp8]) == "ce" and parity_losses(bf16, "ce") == [2.9, 2.0, 2.0]
    assert parity_metric([bf16, {"losses": [1.0]}]) == "loss"


def test_the_plot_gives_a_variant_one_colour_and_one_legend_line_and_one_measure(tmp_path, monkeypatch):
    """Under --seeds the two seeds of a variant share a colour and a legend entry, and the middle
    panel reads every row (the reference's seeds too) against the reference's mean; a row without
    cross-entropy (an outside baseline's) puts every row in the training loss, as the y label says."""
    import matplotlib.figure

    from disagmoe.bench.loss_plot import plot_losses

    figures = []
    real = matplotlib.figure.Figure.savefig

    def record(fig, *a, **k):  # per panel: its lines' colours, its legend's entries, its y label
        figures.append([([line.get_color() for line in ax.get_lines()],
                         [t.get_text() for t in (ax.get_legend().get_texts() if ax.get_legend() else [])],
                         ax.get_ylabel()) for ax in fig.axes])
        return real(fig, *a, **k)

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    ce = {"ces": [2.9, 2.0]}
    rows = [{**_row("bf16", 0, [3.0, 2.2]), **ce}, {**_row("fp8", 0, [3.0, 2.3]), **ce},
            {**_row("bf16", 1, [3.0, 2.4]), **ce}, {**_row("fp8", 1, [3.0, 2.5]), **ce}]
    plot_losses(rows, tmp_path / "a.png", "seeds", ["bf16", "fp8", "bf16", "fp8"])
    (top_colours, top_legend, top_label), (mid_colours, mid_legend, _) = figures[0][:2]
    assert top_colours[:4] == ["C0", "C1", "C0", "C1"] and top_legend == ["bf16", "fp8"] and top_label == "cross-entropy"
    assert mid_colours.count("C0") == 2 and mid_colours.count("C1") == 2  # the reference's seeds drawn too
    plot_losses(rows + [{"mode": "hf", "losses": [3.0, 2.6]}], tmp_path / "b.png", "hf", ["bf16", "fp8"] * 2 + ["hf"])
    assert figures[1][0][2] == "training loss"


def test_a_variant_is_read_against_a_control_that_changes_only_the_rounding():
    """With a control named, each other variant's mean |paired gap| and per-step gap are read as
    ratios of the control's over the seeds all three share; within where neither is larger. The
    control's own row and the reference carry none; the words of a variant match in any order."""
    rows = [_row("precision=bf16", 0, [9.0, 2.0, 2.0]), _row("optim.update_kernel=torch precision=bf16", 0, [9.0, 2.1, 1.9]),
            _row("precision=fp8", 0, [9.0, 2.05, 1.95]), _row("precision=fp8 x=1", 0, [9.0, 2.4, 2.4])]
    bf16, control, fp8, far = loss_parity(rows, window=2, control="precision=bf16 optim.update_kernel=torch")
    assert bf16["within_control"] is None and control["within_control"] is None and control["gap_vs_control"] is None
    # control: paired gap (2.0 / 2.0 - 1) = 0, per-step (0.05 + 0.05) / 2 = 0.05; its |gap| of zero gives no ratio
    assert control["paired_gaps"] == pytest.approx([0.0]) and control["step_gaps"] == pytest.approx([0.05])
    assert fp8["control_seeds"] == [0] and fp8["gap_vs_control"] is None
    assert fp8["step_gap_vs_control"] == pytest.approx(0.025 / 0.05) and fp8["within_control"] is True
    assert far["step_gap_vs_control"] == pytest.approx(0.2 / 0.05) and far["within_control"] is False
    moved = [_row("precision=bf16", 0, [9.0, 2.0, 2.0]), _row("ctl", 0, [9.0, 2.1, 2.1]), _row("fp8", 0, [9.0, 1.95, 2.0])]
    _, _, fp8 = loss_parity(moved, window=2, control="ctl")
    assert fp8["gap_vs_control"] == pytest.approx(abs(1.975 / 2.0 - 1) / (2.1 / 2.0 - 1))  # the window means' gaps
    assert fp8["within_control"] is True


@pytest.mark.parametrize("control, message", [("precision=fp16", "none of the variants compared"),
                                              ("precision=bf16", "is the first variant")])
def test_a_control_that_is_no_variant_or_the_reference_is_refused_with_the_fix(control, message):
    from disagmoe.bench.loss_parity import check_control

    with pytest.raises(ValueError, match=message):
        check_control(control, ["precision=bf16", "precision=fp8"])


def test_cli_parity_reads_each_variant_against_the_control(tmp_path):
    """`bench parity --control` on records of the tiny CPU config: the table's control column and the
    JSON's ratios, `--plot` the records' curves; a control no record ran is a clear error before
    anything is read."""
    path = tmp_path / "p.json"
    r = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single", "--steps", "3",
                                 "--warmup", "1", "--variant", "micro_batches=1", "--variant", "micro_batches=2",
                                 "--variant", "micro_batches=4", "--control", "micro_batches=2", "-o", str(path)])
    assert r.exit_code == 0, r.output
    assert "control: micro_batches=2 (rounding alone" in " ".join(r.output.split())
    assert json.loads(path.read_text())["loss_parity"]["control"] == "micro_batches=2"
    r = CliRunner().invoke(app, ["bench", "parity", str(path), "--control", "micro_batches=2", "--json"])
    assert r.exit_code == 0, r.output
    result = json.loads(r.stdout)
    first, control, other = result["groups"]
    assert result["control"] == "micro_batches=2" and control["within_control"] is None
    ratio = abs(other["paired_gaps"][0]) / abs(control["paired_gaps"][0])
    assert other["control_seeds"] == [0] and other["gap_vs_control"] == pytest.approx(ratio)
    step_ratio = other["step_gaps"][0] / control["step_gaps"][0]
    assert other["step_gap_vs_control"] == pytest.approx(step_ratio)
    assert other["within_control"] is (ratio <= 1 and step_ratio <= 1)
    table = CliRunner().invoke(app, ["bench", "parity", str(path), "--control", "micro_batches=2"], terminal_width=250)
    cell = f"{ratio:.2f}x, {step_ratio:.2f}x: {'within' if other['within_control'] else 'outside'}"
    assert cell in table.output and "reference: micro_batches=1; control: micro_batches=2" in " ".join(table.output.split())
    png = tmp_path / "parity.png"
    drawn = CliRunner().invoke(app, ["bench", "parity", str(path), "--plot", str(png)])
    assert drawn.exit_code == 0 and f"wrote {png}" in " ".join(drawn.output.split()) and png.stat().st_size > 10_000
    bad = CliRunner().invoke(app, ["bench", "parity", str(path), "--control", "micro_batches=8"])
    assert bad.exit_code != 0 and "none of the variants compared" in bad.output and "Traceback" not in bad.output
    early = CliRunner().invoke(app, ["bench", "train", "--config", "configs/tiny-cpu.yaml", "--mode", "single",
                                     "--variant", "micro_batches=1", "--variant", "micro_batches=2",
                                     "--control", "micro_batches=1"])
    assert early.exit_code != 0 and "is the first variant" in early.output


def test_a_control_whose_rows_failed_is_named_not_refused_and_a_zero_control_gap_gives_no_ratio(tmp_path):
    """`bench parity` checks the control against every row the records ran: a control whose rows
    failed (out of memory) is a variant, so the table says nothing was read against it instead of
    refusing it. A control that landed on the reference's loss has no gap to divide by: n/a."""
    from disagmoe.cli.bench_cmd import _against_control

    record = {"steps": 2, "modes": [_seeded("bf16", 0, [3.0, 2.0]), _seeded("fp8", 0, [3.0, 2.1]),
                                    {"mode": "single", "variant": "ctl", "error": "out of memory"}]}
    path = tmp_path / "r.json"
    path.write_text(json.dumps(record))
    r = CliRunner().invoke(app, ["bench", "parity", str(path), "--control", "ctl"], terminal_width=250)
    assert r.exit_code == 0, r.output
    assert "no row of the control trained" in " ".join(r.output.split())
    rows = [_row("bf16", 0, [3.0, 2.0]), _row("ctl", 0, [3.0, 2.0]), _row("fp8", 0, [3.0, 2.0])]
    fp8 = loss_parity(rows, window=1, control="ctl")[2]
    assert fp8["gap_vs_control"] is None and fp8["within_control"] is True
    assert _against_control(fp8, "ctl") == "n/a (control's 0), n/a (control's 0): within"


def test_a_control_needs_a_reference_beside_it_and_matches_quoted_words_in_any_order():
    from disagmoe.bench.loss_parity import check_control, same_variant

    with pytest.raises(ValueError, match="needs at least two variants"):
        check_control("precision=bf16", [None])
    assert same_variant("a=1 'b=x y'", "\"b=x y\" a=1") and not same_variant("a=1", "a=1 b=2")


def test_span_gaps_say_where_a_gap_opens_and_whether_it_holds():
    """Spans of the steps both ran, from step 1 (the last shorter): the mean step-by-step gap over
    the seeds and on how many steps that mean lay above the reference."""
    from disagmoe.bench.loss_parity import span_gaps

    reference = [[2.0, 2.0, 2.0, 2.0, 2.0], [4.0, 4.0, 4.0, 4.0, 4.0]]
    variant = [[2.0, 2.2, 2.1, 1.9, 2.0, 9.0], [4.0, 4.0, 4.4, 4.0, 3.6]]
    first, second, last = span_gaps(variant, reference, 2)
    assert (first["first"], first["last"], last["first"], last["last"]) == (1, 2, 5, 5)
    assert first["gap"] == pytest.approx((0.0 + 0.05) / 2) and first["above"] == 1
    assert second["gap"] == pytest.approx(((0.05 + 0.1) / 2 + (-0.05 + 0.0) / 2) / 2) and second["above"] == 1
    assert last["gap"] == pytest.approx(-0.05) and last["above"] == 0
    with pytest.raises(ValueError, match="at least 1 step"):
        span_gaps(variant, reference, 0)


def test_cli_parity_spans_table_and_json(tmp_path):
    rows = [_seeded("bf16", 0, [3.0, 2.0, 2.0, 2.0]), _seeded("fp8", 0, [3.0, 2.2, 2.1, 1.8])]
    path = tmp_path / "r.json"
    path.write_text(json.dumps(_record(4, *rows)))
    r = CliRunner().invoke(app, ["bench", "parity", str(path), "--spans", "2", "--json"])
    assert r.exit_code == 0, r.output
    bf16, fp8 = json.loads(r.stdout)["groups"]
    assert bf16["span_gaps"] is None and [(s["first"], s["last"], s["above"]) for s in fp8["span_gaps"]] == [(1, 2, 1),
                                                                                                          (3, 4, 1)]
    table = CliRunner().invoke(app, ["bench", "parity", str(path), "--spans", "2"], terminal_width=200)
    assert table.exit_code == 0 and "+5.00% (1/2)" in table.output and "-2.50% (1/2)" in table.output


def test_parity_reads_one_recipe_written_two_ways_as_one_variant(tmp_path):
    """`--same 'A | B'`: seed 0's record spelled the recipe out, seed 1's left it to the defaults (after
    the defaults became it); read as one variant over both seeds, the first's name kept. A name no
    record ran, or an entry of one name, is refused with the fix."""
    from disagmoe.bench.loss_parity import read_as_one

    def record(seed, variants):
        return {"steps": 4, "modes": [{"mode": "single", "variant": v, "init_seed": seed, "data_seed": 0,
                                       "losses": [3.0, 2.0, 1.5, 1.0 + 0.1 * i + 0.01 * seed]}
                                      for i, v in enumerate(variants)]}

    paths = []
    for seed, variants in ((0, ["precision=bf16", "precision=fp8 fp8_expert_forward=down"]),
                           (1, ["precision=bf16", "precision=fp8"])):
        path = tmp_path / f"seed{seed}.json"
        path.write_text(json.dumps(record(seed, variants)))
        paths.append(str(path))
    r = CliRunner().invoke(app, ["bench", "parity", *paths, "--loss-window", "1", "--json",
                                 "--same", "fp8_expert_forward=down precision=fp8 | precision=fp8"])
    assert r.exit_code == 0, r.output
    reference, fp8 = json.loads(r.stdout)["groups"]
    assert fp8["variant"] == "fp8_expert_forward=down precision=fp8" and fp8["seeds"] == [0, 1]
    assert len(fp8["paired_gaps"]) == 2
    for bad, match in (("precision=fp8 | precision=fp4", "no record ran the variant 'precision=fp4'"),
                       ("precision=fp8", "give two or more variants separated by ' | '")):
        r = CliRunner().invoke(app, ["bench", "parity", *paths, "--same", bad])
        assert r.exit_code != 0 and match in r.output and "Traceback" not in r.output
    original = record(1, ["precision=fp8"])
    assert read_as_one({"a": original}, ["precision=fp8 | precision=fp8"])["a"] is not original
