"""`bench.probe`: the recorded fingerprint is the probe's code, edits that cannot change a
measurement leave it, and `plan` / `roofline` warn about a file another probe version measured."""

import pytest
import yaml
from typer.testing import CliRunner

from disagmoe.bench import probe
from disagmoe.cli.app import app
from disagmoe.config import PRESETS_DIR, Calibration, RatePoint, load_hardware, preset_names

runner = CliRunner()


def _regenerate_commands() -> str:
    """The exact command that re-measures each committed calibrated preset (run from the repository root)."""
    return "; ".join(f"`{probe.regenerate_command(load_hardware(name), name)}`" for name in preset_names("hardware")
                     if load_hardware(name).calibration is not None)


def test_the_recorded_fingerprint_is_the_probes_code():
    now = probe.code_fingerprint()
    assert now == probe.PROBE_FINGERPRINT, (
        f"the code that measures a calibration changed (bench.probe.PROBE_PARTS; fingerprint {now}, recorded "
        f"{probe.PROBE_FINGERPRINT}). If what is measured or how changed: bump PROBE_VERSION in "
        f"disagmoe/bench/probe.py (say what changed in the comment beside it), set PROBE_FINGERPRINT = {now!r}, "
        f"re-run on a GPU, from the repository root, {_regenerate_commands()} and commit the new YAML. Only if "
        "no measured number "
        f"can move (a rename, a refactor): set PROBE_FINGERPRINT = {now!r} alone.")


def test_every_committed_calibration_says_which_probe_measured_it():
    """Whether it is the current one `plan` and `roofline` say (a warning line with the command that
    re-measures it, `probe.stale_note`), not this test: a probe change is committed with its version
    bump, and the file it makes stale waits for a GPU (the committed h200-sxm-calibrated.yaml was
    measured by probe version 2; version 3 re-measures it)."""
    for name in preset_names("hardware"):
        hw = load_hardware(name)
        if hw.calibration is not None:
            assert hw.calibration.probe_version is not None and hw.calibration.probe_version <= probe.PROBE_VERSION, (
                f"{name}: probe version {hw.calibration.probe_version}, current {probe.PROBE_VERSION}; re-measure on "
                f"a GPU from the repository root with `{probe.regenerate_command(hw, name)}`")


def test_a_stale_preset_is_named_with_the_exact_command_that_re_measures_it(tmp_path):
    """The command keeps the file's recorded --model and --experts-backend and writes the file itself."""
    hw = load_hardware("h200-sxm").model_copy(update={"name": "h200-sxm-calibrated", "calibration": Calibration(
        source="made up", probe_version=probe.PROBE_VERSION - 1)})
    path = tmp_path / "cal.yaml"
    path.write_text("# Calibrated by `disagmoe bench calibrate --hardware h200-sxm --out cal.yaml --model "
                    "qwen3-30b-a3b --experts-backend triton` on 2026-12-02:\n"
                    + yaml.safe_dump(hw.model_dump(mode="json"), sort_keys=False))
    note = probe.stale_note(load_hardware(str(path)), str(path))
    assert note.endswith(f"`disagmoe bench calibrate --hardware h200-sxm --out {path} --model qwen3-30b-a3b "
                         "--experts-backend triton`"), note
    assert f"probe version {probe.PROBE_VERSION - 1}" in note and f"now at version {probe.PROBE_VERSION}" in note


def _edited(path: str, old: str, new: str) -> dict[str, str]:
    sources = probe.probe_sources()
    assert old in sources[path], f"the test's anchor {old!r} is gone from {path}: pick another"
    sources[path] = sources[path].replace(old, new, 1)
    return sources


def test_docstrings_comments_and_formatting_do_not_move_the_fingerprint():
    now = probe.code_fingerprint()
    docstring = _edited("bench/calibrate.py", '"""The expert curve\'s point at', '"""The expert curve\'s RatePoint at')
    assert probe.fingerprint(docstring) == now
    timing_doc = _edited("bench/timing.py", '"""Mean GPU kernel time per call', '"""The mean GPU kernel time per call')
    assert probe.fingerprint(timing_doc) == now
    layout = _edited("bench/calibrate.py", "ROWS_PER_EXPERT = (16, 64, 256, 512, 1024, 2048, 4096)",
                     "ROWS_PER_EXPERT = (  # rows per expert of the expert curve\n    16, 64, 256, 512, 1024, 2048, 4096,\n)\n")
    assert probe.fingerprint(layout) == now


def test_a_change_to_what_is_measured_or_how_moves_the_fingerprint():
    now = probe.code_fingerprint()
    sizes = _edited("bench/calibrate.py", "ROWS_PER_EXPERT = (16, 64, 256, 512, 1024, 2048, 4096)",
                    "ROWS_PER_EXPERT = (16, 64, 256, 1024)")
    timing = _edited("bench/calibrate.py", "kernel_ms(lambda _: forward(), warmup, iters)",
                     "median_ms(lambda _: forward(), warmup, iters)")
    arithmetic = _edited("roofline/stages.py", "ATTN_CORE_BWD = 2.5", "ATTN_CORE_BWD = 2.0")
    # the fp32 main-gradient traffic the weight-gradient rate is fitted against (the planner's stage)
    main_grads = _edited("roofline/stages.py", "+ (2 * main_grad_passes - stored_share) * FP32 * weights)",
                         "+ (0 * main_grad_passes - stored_share) * FP32 * weights)")
    fit = _edited("roofline/calibration.py", 'other = max(t["hbm"], t["nvlink"], t["scale-out"])', "other = 0.0")
    assert len({now, *(probe.fingerprint(s) for s in (sizes, timing, arithmetic, main_grads, fit))}) == 6


def test_a_part_that_is_gone_is_named():
    sources = _edited("bench/calibrate.py", "def curve_experts(", "def experts_in_curve(")
    with pytest.raises(ValueError, match="PROBE_PARTS names curve_experts in disagmoe/bench/calibrate.py"):
        probe.fingerprint(sources)


def _calibrated_file(tmp_path, version: int | None):
    """The h200-sxm preset with a small calibration block that `version` measured."""
    hw = load_hardware("h200-sxm")
    cal = Calibration(source="made up", probe_version=version, expert_gemm=[RatePoint(at=256, fwd=0.5, bwd=0.4)],
                      op_fixed_us={"ExpertForward": 30.0})
    path = tmp_path / f"h200-v{version}.yaml"
    path.write_text(yaml.safe_dump(hw.model_copy(update={"name": "h200-sxm-calibrated", "calibration": cal})
                                   .model_dump(mode="json"), sort_keys=False))
    return path


PLAN = ["plan", "--model", "qwen3-30b-a3b", "--gpus", "8", "--seq-len", "4096", "--global-batch-tokens",
        str(32 * 4096), "--json", "--hardware"]
ROOFLINE = ["roofline", "--model", "qwen3-30b-a3b", "--gpus", "8", "--json", "--hardware"]


@pytest.mark.parametrize("command", [PLAN, ROOFLINE], ids=["plan", "roofline"])
def test_a_file_another_probe_measured_plans_with_one_warning_line(tmp_path, command):
    stale = _calibrated_file(tmp_path, probe.PROBE_VERSION - 1)
    r = runner.invoke(app, [*command, str(stale)])
    assert r.exit_code == 0, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"warning: {stale}: its calibration was measured by probe "
                                                   f"version {probe.PROBE_VERSION - 1} "), lines
    assert f"now at version {probe.PROBE_VERSION}" in lines[0]
    assert f"disagmoe bench calibrate --hardware h200-sxm --out {stale}" in lines[0]
    assert r.stdout.lstrip().startswith("{")  # the JSON on stdout stays JSON


def test_a_current_file_and_an_uncalibrated_preset_plan_without_a_warning(tmp_path):
    for hardware in (str(_calibrated_file(tmp_path, probe.PROBE_VERSION)), "h200-sxm"):
        r = runner.invoke(app, [*PLAN, hardware])
        assert r.exit_code == 0 and r.stderr == "", r.output


def test_a_file_older_than_versions_and_a_preset_are_named_with_their_file(tmp_path):
    old = load_hardware(str(_calibrated_file(tmp_path, None)))
    assert "records no probe version" in probe.stale_note(old, "x/old.yaml")
    preset = load_hardware("h200-sxm").model_copy(update={"name": "mine", "calibration": old.calibration})
    note = probe.stale_note(preset, "h200-sxm")
    assert note.startswith(f"{probe._shown(PRESETS_DIR / 'hardware' / 'h200-sxm.yaml')}: ")
    assert "--hardware PRESET" in note  # "mine" names no preset to calibrate over
