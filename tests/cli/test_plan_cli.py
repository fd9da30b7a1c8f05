"""`disagmoe plan`, `roofline`, `presets`, `config schema`: output, JSON, files, bad input."""

import json
import subprocess
import sys

import pytest
import yaml
from typer.testing import CliRunner

from disagmoe.cli.app import app
from disagmoe.config import Plan, preset_names

runner = CliRunner()


def run(*args):
    result = runner.invoke(app, list(args))
    return result


def test_plan_json_is_a_plan():
    r = run("plan", "--model", "qwen3-235b-a22b", "--hardware", "gb200-nvl72", "--gpus", "72", "--json")
    assert r.exit_code == 0, r.output
    plan = Plan.model_validate(json.loads(r.stdout))
    assert plan.feasible and plan.gpus == 72
    for key in ("layout", "attention_gpus", "expert_gpus", "pipeline_groups", "micro_batches", "expert_map",
                "total_params", "active_params", "memory_per_gpu", "stage_times", "colocated_step_time_s", "reason"):
        assert key in json.loads(r.stdout)


def test_plan_reports_the_achieved_tflops_per_gpu_beside_the_mfu():
    r = run("plan", "--model", "qwen3-235b-a22b", "--hardware", "gb200-nvl72", "--gpus", "72", "--json")
    plan = Plan.model_validate(json.loads(r.stdout))
    assert plan.tflops_per_gpu == pytest.approx(plan.mfu * 2500)  # the preset's bf16 peak, TFLOP/s
    text = run("plan", "--model", "qwen3-235b-a22b", "--hardware", "gb200-nvl72", "--gpus", "72").stdout
    assert f"{plan.tflops_per_gpu:.0f} TFLOP/s per GPU" in text


def test_roofline_prices_a_train_configs_own_layout_in_any_mode():
    """`roofline --config`: the run's model, ranks, micro-batches and batch; --layout picks the mode."""
    config = "configs/h200x2-qwen3-30b.yaml"
    r = run("roofline", "--config", config, "--layout", "single", "--json")
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)["plan"]
    assert (plan["layout"], plan["gpus"], plan["micro_batches"], plan["global_batch_tokens"]) == (
        "single", 1, 2, 16 * 4096)  # micro_batches: auto as a run on the preset's 139.8 GiB picks it
    assert plan["hardware"] == "h200-sxm"  # the config's own
    dis = json.loads(run("roofline", "-c", config, "-hw", "h200-sxm-calibrated", "--json").stdout)["plan"]
    assert (dis["layout"], dis["attention_gpus"], dis["expert_gpus"]) == ("disaggregated", 1, 1)
    assert dis["hardware"] == "h200-sxm-calibrated"
    r = run("roofline", "-c", config, "--layout", "diagonal")
    assert r.exit_code == 2 and "single, disaggregated, colocated" in r.output


def test_roofline_config_overrides_change_the_priced_run_as_train_would():
    """`roofline -c CFG key=value ...`: the overrides reach the priced run (micro-batches, FP8 and
    its backward recipe, which the note names); an unknown key is refused with the config's error,
    and overrides without --config are refused."""
    config = "configs/h200x2-qwen3-30b.yaml"
    price = lambda *extra: run("roofline", "-c", config, "--layout", "single", "-hw", "h200-sxm-calibrated",  # noqa: E731
                               "--json", *extra)
    plain = json.loads(price().stdout)["plan"]
    four = json.loads(price("micro_batches=4").stdout)["plan"]
    assert (plain["micro_batches"], four["micro_batches"]) == (2, 4)
    steps = {b: json.loads(price("precision=fp8", f"fp8_expert_backward={b}").stdout)["plan"]
             for b in ("fp8", "bf16-wgrad", "bf16")}
    assert all(p["expert_precision"] == "fp8" for p in steps.values())
    # each recipe priced as its own (their order follows the measured FP8 curve, which the file's next
    # calibration may change: probe v6 measured it under the default bf16-wgrad backward)
    assert len({round(p["step_time_s"], 9) for p in steps.values()}) == 3
    assert any("fp8_expert_backward: bf16-wgrad, the default" in n for n in
               json.loads(price("precision=fp8").stdout)["plan"]["notes"])
    forward = {f: json.loads(price("precision=fp8", f"fp8_expert_forward={f}").stdout)["plan"]
               for f in ("both", "down")}
    assert forward["down"]["step_time_s"] != forward["both"]["step_time_s"]
    assert any("fp8_expert_forward: down" in n for n in forward["down"]["notes"])
    bad = price("no_such_key=1")
    assert bad.exit_code != 0 and "no_such_key" in bad.output
    alone = run("roofline", "-m", "tiny", "-hw", "h200-sxm", "-n", "1", "precision=fp8")
    assert alone.exit_code == 2 and "apply to --config alone" in alone.output


def test_roofline_of_an_fp8_run_says_which_fp8_rate_it_priced(tmp_path):
    """`roofline --config` of an FP8 run prints the FP8 pricing: the datasheet ratio (unmeasured) on a
    file without an FP8 expert curve, the measured curve and its source on one with it."""
    from disagmoe.bench.probe import PROBE_VERSION
    from disagmoe.config import Fp8RatePoint, load_hardware

    config = tmp_path / "fp8.yaml"
    data = yaml.safe_load(open("configs/h200x2-qwen3-30b.yaml"))
    config.write_text(yaml.safe_dump({**data, "precision": "fp8", "micro_batches": 2}))
    hw = load_hardware("h200-sxm-calibrated")
    curve = [Fp8RatePoint(at=p.at, fwd=0.5 * p.fwd, bwd=0.3) for p in hw.calibration.expert_gemm]
    measured = tmp_path / "fp8-calibrated.yaml"
    measured.write_text(hw.model_copy(update={"calibration": hw.calibration.model_copy(update={
        "expert_gemm_fp8": curve, "probe_version": PROBE_VERSION, "source": "made-up FP8 probe"})}).to_yaml())
    text = lambda hardware: " ".join(run("roofline", "-c", str(config), "--layout", "single", "-hw",  # noqa: E731
                                         hardware).stdout.split())
    datasheet, curve_text = text("h200-sxm"), text(str(measured))
    assert "note: routed experts priced in FP8 (train with precision: fp8) at the datasheet ratio, unmeasured" \
        in datasheet
    assert ("note: routed experts priced in FP8 (train with precision: fp8) from the measured FP8 expert curve "
            "(calibration.expert_gemm_fp8, made-up FP8 probe, probe version") in curve_text
    bf16 = " ".join(run("roofline", "-c", "configs/h200x2-qwen3-30b.yaml", "--layout", "single").stdout.split())
    assert "priced in FP8" not in bf16


def test_sharded_optimizer_states_are_said_and_cost_at_most_their_all_gather():
    """384 H200s: with the attention side's AdamW moments split over data parallel (ZeRO-1) the
    plan says what it assumed. (Before the transport's buffers were counted the freed attention
    memory bought DeepSeek-V3 a faster layout here; now the nvshmem arena, as large on every GPU as
    the largest rank's, binds both kinds of GPU and the layout stays.) The same layout then pays
    the updated slices' all-gather after the update (session 16: priced as the runtime runs it),
    a few hundredths of a percent here."""
    args = ("plan", "--model", "deepseek-v3", "--hardware", "h200-sxm", "--json")
    plain, sharded = (Plan.model_validate(json.loads(run(*args, "--gpus", "384", *extra).stdout))
                      for extra in ((), ("--shard-optimizer-states",)))
    assert plain.feasible and sharded.feasible and sharded.step_time_s <= plain.step_time_s * 1.001
    assert any("ZeRO-1" in note for note in sharded.notes) and not any("ZeRO-1" in note for note in plain.notes)
    assert all(e.transport_gib > 0 for e in plain.memory_per_gpu.values())


def test_plan_that_cannot_fit_says_why_and_exits_1():
    r = run("plan", "--model", "deepseek-v3", "--hardware", "h200-sxm", "--gpus", "8")
    assert r.exit_code == 1
    assert "no layout fits" in r.stdout and "fewest" in r.stdout
    r = run("plan", "--model", "deepseek-v3", "--hardware", "h200-sxm", "--gpus", "8", "--json")
    assert json.loads(r.stdout)["feasible"] is False


def test_plan_reads_a_load_histogram(tmp_path):
    path = tmp_path / "metrics.jsonl"
    loads = [[12, 9, 10, 11, 8, 10, 9, 11], [10] * 8]  # tiny: 2 MoE layers x 8 experts, a mild skew as trained
    path.write_text(json.dumps({"step": 1, "expert_load": loads}) + "\n")
    args = ("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "56", "--seq-len", "64", "--global-batch-tokens", "131072")
    r = run(*args, "--load-histogram", str(path), "--json")
    assert r.exit_code == 0, r.output
    skewed, uniform = json.loads(r.stdout), json.loads(run(*args, "--json").stdout)
    assert skewed["layout"] == uniform["layout"] == "disaggregated"  # 2 expert GPUs per replica set
    assert skewed["expert_map"] != uniform["expert_map"]  # balanced by load: experts 5 and 6 trade GPUs
    assert skewed["notes"][0].startswith(f"expert loads read from {path}: the hottest expert carries 1.20x")
    assert f"expert loads read from {path}" in " ".join(run(*args, "--load-histogram", str(path)).stdout.split())


def test_roofline_json_table_and_plot(tmp_path):
    png = tmp_path / "roof.png"
    r = run("roofline", "-m", "deepseek-v3", "-hw", "gb200-nvl72", "-n", "1152", "--json", "--plot", str(png))
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    stages = {row["stage"] for row in data["layer"]}
    assert {"attention projections", "attention core", "router", "routed experts", "dispatch", "combine"} <= stages
    for row in data["layer"]:
        assert row["bound"] in ("compute", "hbm", "nvlink", "scale-out", "latency")
        assert row["time_s"] >= max(v for k, v in row["times_s"].items() if k != "latency")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = run("roofline", "-m", "qwen3-30b-a3b", "-hw", "h200-sxm", "-n", "8", "--layout", "disaggregated",
            "--attention-gpus", "3", "--micro-batches", "2")
    assert r.exit_code == 0, r.output
    assert "one layer, one micro-batch" in r.stdout and "whole step" in r.stdout


def test_presets_and_schema():
    r = run("presets", "--json")
    data = json.loads(r.stdout)
    assert set(data["models"]) == set(preset_names("models"))
    assert data["models"]["deepseek-v3"]["total_params"] > 6e11
    assert "deepseek-v3" in run("presets").stdout
    schema = json.loads(run("config", "schema", "train", "--json").stdout)
    assert "properties" in schema and "model" in schema["properties"]


@pytest.mark.parametrize("args, needle", [
    (["plan", "--model", "gpt-5", "--hardware", "h200-sxm", "--gpus", "8"], "valid names"),
    (["plan", "--model", "tiny", "--hardware", "tpu-v9", "--gpus", "8"], "unknown hardware preset"),
    (["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "-3"], "--gpus"),
    (["plan", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "eight"], "--gpus"),
    (["roofline", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "4", "--layout", "diagonal"], "diagonal"),
    (["roofline", "--model", "tiny", "--hardware", "h200-sxm", "--gpus", "4", "--layout", "disaggregated"],
     "--attention-gpus"),
    (["config", "schema", "nope"], "unknown schema"),
])
def test_bad_input_is_one_line_and_exit_2(args, needle):
    r = run(*args)
    assert r.exit_code == 2, r.output
    assert needle in r.output
    assert "Traceback" not in r.output


@pytest.mark.parametrize("content, needle", [
    ("hidden_size: 64\nvocab_size: 10\nbogus_key: 1\n", "unknown key"),
    ('{"model_type": "gpt2", "n_embd": 64}', "not supported"),
])
def test_bad_model_files_exit_2_without_traceback(tmp_path, content, needle):
    path = tmp_path / ("m.json" if content.startswith("{") else "m.yaml")
    path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", "disagmoe", "plan", "--model", str(path), "--hardware", "h200-sxm",
                           "--gpus", "8"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_plan_imports_no_torch_ray_or_matplotlib():
    code = ("import sys; from disagmoe.cli import plan_cmd; "
            "print(','.join(m for m in ('torch', 'ray', 'matplotlib') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == ""


def test_a_fixed_layout_does_not_claim_the_baseline_failed():
    r = run("roofline", "-m", "qwen3-30b-a3b", "-hw", "h200-sxm", "-n", "8", "--layout", "disaggregated",
            "--attention-gpus", "3", "--json")
    plan = json.loads(r.stdout)["plan"]
    assert "not priced" in plan["reason"]
    assert not any("baseline does not fit" in n for n in plan["notes"])


def test_a_small_model_prints_its_parameters_with_a_unit():
    r = run("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "2")
    assert r.exit_code == 0, r.output
    assert "0.0B" not in r.stdout and "K total" in r.stdout
    r = run("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "2", "--json")
    assert json.loads(r.stdout)["total_params"] > 0


def test_a_fixed_layout_prints_no_baseline_it_did_not_price():
    r = run("roofline", "-m", "qwen3-30b-a3b", "-hw", "h200-sxm", "-n", "8", "--layout", "disaggregated",
            "--attention-gpus", "3", "--json")
    plan = json.loads(r.stdout)["plan"]
    assert plan["colocated_step_time_s"] is None and plan["speedup_vs_colocated"] is None


def test_the_roofline_png_draws_communication_and_once_per_step_stages():
    """Dispatch, combine, the gradient all-reduce and the optimizer do no arithmetic, so the
    roofline panel cannot show them; the time panel draws them, links in red."""
    from matplotlib.colors import to_rgba

    from disagmoe.cli.plan_cmd import build_request
    from disagmoe.placement.solver import choose, roofline_rows
    from disagmoe.roofline import report

    choice = choose(build_request("qwen3-30b-a3b", "h200-sxm", 8, None, 4 * 1024 * 1024))
    layer, step = roofline_rows(choice.cost, choice.problem, choice.candidate)
    fig = report.figure(layer, choice.problem.ceilings, "t", step_rows=step)
    bars = fig.axes[1]
    labels = [t.get_text() for t in bars.get_yticklabels()]
    for name in ("dispatch (fwd)", "combine (bwd)", "grad all-reduce (attention) (step)", "optimizer (experts) (step)"):
        assert name in labels
    red = {labels[i] for i, patch in enumerate(bars.patches) if patch.get_facecolor() == to_rgba(report.COMM_COLOR)}
    assert {"dispatch (fwd)", "combine (fwd)"} <= red and "routed experts (bwd)" not in red


def test_a_small_models_plan_prints_every_time_and_size_in_a_unit_that_shows_it():
    """The tiny model's stages take nanoseconds and its states a few MiB: no row reads 0.0."""
    r = run("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "3", "--seq-len", "64", "--global-batch-tokens", "512")
    assert r.exit_code == 0, r.output
    plan = Plan.model_validate(json.loads(run("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "3", "--seq-len", "64",
                                              "--global-batch-tokens", "512", "--json").stdout))
    assert " 0.0 " not in r.stdout and "e-0" not in r.stdout
    from disagmoe.roofline.report import memory, seconds

    for s in plan.stage_times:
        assert seconds(s.time_s) in r.stdout
    for e in plan.memory_per_gpu.values():
        assert all(memory(g) in r.stdout for g in (e.weights_gib, e.total_gib, e.capacity_gib))
    assert "MiB" in r.stdout and "ns" in r.stdout


def test_plans_are_written_compactly_and_read_back_with_older_block_style_files(tmp_path):
    """Qwen3-235B on 72 GPUs: an expert_map row per MoE layer, a stage per line, in YAML and in
    JSON; `load_plan` (what `train --plan` reads) takes these and the block style older files used."""
    from disagmoe.runtime.plan_layout import load_plan

    args = ("plan", "-m", "qwen3-235b-a22b", "-hw", "gb200-nvl72", "-n", "72")
    printed = run(*args, "--json").stdout
    plan = Plan.model_validate_json(printed)
    layers = len(plan.expert_map)
    assert len(printed.splitlines()) < layers + 110
    for name in ("plan.yaml", "plan.json"):
        out = tmp_path / name
        assert run(*args, "--out", str(out)).exit_code == 0
        lines = out.read_text().splitlines()
        assert len(lines) < layers + 110, (name, len(lines))
        assert sum(line.lstrip("- ").startswith("[[") for line in lines) == layers  # one line per MoE layer
        assert load_plan(str(out)) == plan
    old_yaml, old_json = tmp_path / "old.yaml", tmp_path / "old.json"
    old_yaml.write_text(yaml.safe_dump(plan.model_dump(mode="json"), sort_keys=False))
    old_json.write_text(plan.model_dump_json(indent=2))
    assert len(old_yaml.read_text().splitlines()) > 10 * layers  # the block style, one integer per line
    assert load_plan(str(old_yaml)) == plan and load_plan(str(old_json)) == plan


def test_bf16_optimizer_states_halve_the_moments_the_plan_prices():
    """`--optimizer-state-dtype bf16` prices the moments at 2 bytes each (roofline.optimizer_state),
    leaves weights and gradients alone, says so in the notes, and is refused for any other dtype."""
    args = ("plan", "--model", "qwen3-30b-a3b", "--hardware", "h200-sxm", "--gpus", "8", "--json")
    plain, bf16 = (Plan.model_validate(json.loads(run(*args, *extra).stdout))
                   for extra in ((), ("--optimizer-state-dtype", "bf16")))
    assert plain.feasible and bf16.feasible
    assert any("fp32 master weights and bf16 moments" in n for n in bf16.notes)
    assert any("fp32 master weights and fp32 moments" in n for n in plain.notes)
    for group, memory in bf16.memory_per_gpu.items():
        params_gib = memory.grads_gib / 4  # one fp32 main gradient per parameter (no ZeRO-1 here)
        assert memory.optimizer_gib == pytest.approx(4 * params_gib, rel=1e-9), group
        assert memory.weights_gib == pytest.approx(6 * params_gib, rel=1e-9), group
    r = run(*args, "--optimizer-state-dtype", "fp16")
    assert r.exit_code == 2 and "fp32" in r.output and "bf16" in r.output
    assert "--optimizer-state-dtype" in run("plan", "--help").output


def test_the_optimizer_update_kernel_prices_the_optimizer_stage_with_its_passes():
    """`--optimizer-update-kernel` (plan and roofline; default triton) reaches the optimizer's stage
    rows: torch's fused AdamW and copy pass move more bytes than the one Triton pass, the memory is
    the same; any other kernel is refused."""
    from disagmoe.roofline import stages as st

    args = ("roofline", "--model", "qwen3-30b-a3b", "--hardware", "h200-sxm", "--gpus", "8", "--json",
            "--layout", "disaggregated", "--attention-gpus", "4")  # one layout: only the optimizer's rows move
    default, triton, torch_rows = (json.loads(run(*args, *extra).stdout)
                                   for extra in ((), ("--optimizer-update-kernel", "triton"),
                                                 ("--optimizer-update-kernel", "torch")))
    assert default == triton
    optimizer = lambda out: {r["stage"]: r for r in out["step"] if r["stage"].startswith("optimizer")}  # noqa: E731
    fast, slow = optimizer(triton), optimizer(torch_rows)
    assert fast and set(fast) == set(slow)
    extra = (st.optimizer_step(1.0, "fp32", "torch", True).hbm_bytes
             - st.optimizer_step(1.0, "fp32", "triton", True).hbm_bytes)  # torch's more bytes per parameter
    for name in fast:
        params = (slow[name]["hbm_bytes"] - fast[name]["hbm_bytes"]) / extra
        touched = params if name == "optimizer (experts)" else 0  # first touch: the experts' not zeroed
        assert fast[name]["hbm_bytes"] == pytest.approx(
            st.optimizer_step(params, "fp32", "triton", True, touched).hbm_bytes, rel=1e-9), name
        assert params > 1e8, name
    assert triton["plan"]["memory_per_gpu"] == torch_rows["plan"]["memory_per_gpu"]
    plan_args = ("plan", "--model", "qwen3-30b-a3b", "--hardware", "h200-sxm", "--gpus", "8")
    r = run(*plan_args, "--optimizer-update-kernel", "cuda")
    assert r.exit_code == 2 and "torch" in r.output and "triton" in r.output
    assert "--optimizer-update-kernel" in run("plan", "--help").output


def test_config_schema_lists_every_key_with_type_default_and_meaning():
    """The table a person reads: every key (sections dotted), its type, default and meaning;
    --json keeps the JSON Schema for machines."""
    from disagmoe.cli.schema_table import schema_rows
    from disagmoe.config import OptimConfig, TrainConfig

    text = run("config", "schema", "train").stdout
    assert not text.lstrip().startswith("{") and "$defs" not in text
    keys = [r["key"] for r in schema_rows(TrainConfig)]
    assert set(TrainConfig.model_fields) <= set(keys)
    assert {f"optim.{k}" for k in OptimConfig.model_fields} <= set(keys)
    for key in ("steps", "optim.lr", "optim.state_dtype", "data.kind", "fault_injection.rank"):
        assert any(line.startswith(f"│ {key} ") for line in text.splitlines()), key
    rows = {r["key"]: r for r in schema_rows(TrainConfig)}
    assert rows["mode"]["type"] == "'single' | 'disaggregated' | 'colocated'" and rows["mode"]["default"] == "'disaggregated'"
    assert rows["batch_size"] == {"key": "batch_size", "type": "int > 0", "default": "8",
                                  "meaning": "sequences per step (global)"}
    assert rows["model"]["default"] == "required" and rows["optim.min_lr_ratio"]["type"] == "float >= 0, <= 1"
    assert rows["optim.state_dtype"]["type"] == "'fp32' | 'bf16'" and rows["optim.state_dtype"]["default"] == "'fp32'"
    assert "bf16 saves 4 bytes per parameter" in rows["optim.state_dtype"]["meaning"]
    from disagmoe.config import ModelConfig

    model_rows = {r["key"]: r for r in schema_rows(ModelConfig)}
    assert model_rows["top_k"]["meaning"] != "-" and "router.score" in model_rows
    schema = json.loads(run("config", "schema", "model", "--json").stdout)
    assert "top_k" in schema["properties"]


def test_presets_show_each_presets_source_from_its_source_field():
    from disagmoe.config import load_hardware
    from disagmoe.model_ref import load_model

    text = run("presets").stdout.replace("│", " ")
    flat = " ".join(text.split())
    for name in preset_names("models"):
        source = load_model(name).source
        assert source and " ".join(source.split()[:4]) in flat, name
    for name in preset_names("hardware"):
        source = load_hardware(name).source
        assert source and " ".join(source.split()[:4]) in flat, name
    data = json.loads(run("presets", "--json").stdout)
    assert data["hardware"]["h200-sxm"]["source"].startswith("NVIDIA H200 datasheet")


def test_recompute_is_a_plan_option_the_plan_records():
    """`--recompute none|selective|full|auto` (default auto): the help names it, the JSON plan
    records the choice, and another value is refused."""
    assert "--recompute" in run("plan", "--help").output
    args = ("plan", "--model", "qwen3-30b-a3b", "--hardware", "h200-sxm", "--gpus", "8", "--json")
    for choice in ("none", "selective", "full"):
        plan = Plan.model_validate(json.loads(run(*args, "--recompute", choice).stdout))
        assert plan.recompute == choice
    r = run(*args, "--recompute", "everything")
    assert r.exit_code == 2 and "selective" in r.output


def test_offload_optimizer_is_auto_on_or_off_and_the_bare_flag_still_means_on():
    """`--offload-optimizer auto|on|off` (default off): the help names the values; the bare flag
    of before still means on (anywhere on the line); auto's choice is recorded and said in a note;
    another value is refused."""
    help_text = " ".join(run("plan", "--help").output.split())
    assert "--offload-optimizer" in help_text and "auto|on|off" in help_text.replace("<", "").replace(">", "")
    assert "the bare flag still means on" in help_text.replace("│ ", "")
    args = ("plan", "--model", "qwen3-30b-a3b", "--hardware", "h200-sxm", "--gpus", "8",
            "--global-batch-tokens", "262144")

    def plan_of(*extra):
        r = run(*args, *extra)
        assert r.exit_code == 0, r.output
        return Plan.model_validate(json.loads(r.stdout))

    assert not plan_of("--json").offload_optimizer
    assert plan_of("--json", "--offload-optimizer", "on").offload_optimizer
    assert plan_of("--offload-optimizer", "--json").offload_optimizer  # bare, before another option
    assert plan_of("--json", "--offload-optimizer").offload_optimizer  # bare, last
    assert not plan_of("--json", "--offload-optimizer=off").offload_optimizer
    auto = plan_of("--json", "--offload-optimizer", "auto")
    assert not auto.offload_optimizer and any(n.startswith("offload auto chose off: ") for n in auto.notes)
    r = run(*args, "--offload-optimizer", "maybe")
    assert r.exit_code == 2 and "auto" in r.output


def test_notes_print_their_brackets_as_written():
    """A note naming `recompute_modules: [...]` (a YAML list) is printed as is: rich would read the
    brackets as a style tag and drop them and the list."""
    out = " ".join(run("plan", "--model", "deepseek-v3", "--hardware", "gb200-nvl72", "--gpus", "256", "--seq-len",
                       "4096", "--global-batch-tokens", "33554432").output.split())
    assert "recompute_modules: [expert_input, expert_output, expert_swiglu]" in out


def test_no_fp8_dense_prices_the_dense_projections_in_bf16_and_the_plan_records_it():
    """`--expert-precision fp8 --fp8-dense`, or neither flag (as precision: fp8 trains by default):
    the experts and the attention projections and other dense GEMMs in FP8; `--no-fp8-dense` the
    dense GEMMs in bf16 (at the datasheet ratio a slower plan), recorded as fp8_dense false for
    `train --plan`; under bf16 the flag changes nothing."""
    args = ("plan", "--model", "qwen3-30b-a3b", "--hardware", "h200-sxm", "--gpus", "8", "--json")
    dense, lean, unset = (Plan.model_validate(json.loads(run(*args, "--expert-precision", "fp8", *extra).stdout))
                          for extra in (("--fp8-dense",), ("--no-fp8-dense",), ()))
    assert (dense.expert_precision, dense.fp8_dense, lean.expert_precision, lean.fp8_dense) == ("fp8", True, "fp8", False)
    assert lean.step_time_s > dense.step_time_s
    assert (unset.fp8_dense, unset.step_time_s) == (True, dense.step_time_s)
    plain, plain_lean = (json.loads(run(*args, *extra).stdout)["step_time_s"] for extra in ((), ("--no-fp8-dense",)))
    assert plain == plain_lean
    assert "--no-fp8-dense" in run("plan", "--help").output


def test_fp8_dense_scaling_prices_the_recipe_asked_and_the_plan_records_it():
    """`plan --fp8-dense-scaling`: blockwise (the default, as precision: fp8 trains on Hopper) or
    rowwise, recorded in the plan for `train --plan`. On the committed H100 file, whose FP8 projection
    curve probe version 9 measured blockwise (Hopper), a blockwise plan prices at that curve and a rowwise
    one at the datasheet ratio, its note naming the curve it left out; --help teaches the choice; another
    word is refused; beside --config the run's config sets it."""
    base = ("plan", "-m", "qwen3-30b-a3b", "-hw", "h100-sxm-calibrated", "-n", "16", "--expert-precision", "fp8",
            "--json")
    blockwise, rowwise = (Plan.model_validate_json(run(*base, *extra).stdout)
                          for extra in ((), ("--fp8-dense-scaling", "rowwise")))
    assert (blockwise.fp8_dense_scaling, rowwise.fp8_dense_scaling) == ("blockwise", "rowwise")
    assert blockwise.step_time_s != rowwise.step_time_s
    note = lambda plan: next(n for n in plan.notes if n.startswith("routed experts priced in FP8"))  # noqa: E731
    assert "measured the blockwise recipe, another's GEMMs and quantisers, and is left out" in note(rowwise)
    assert "from the measured FP8 projection curve over the bf16 one (calibration.projections_fp8, measured " \
        "blockwise, probe version 9)" in note(blockwise)
    helped = " ".join(run("plan", "--help").output.split())
    assert "--fp8-dense-scaling" in helped and "prices only the recipe it measured" in helped
    assert run(*base, "--fp8-dense-scaling", "tensorwise").exit_code == 2
    beside = run("plan", "-c", TINY, "-hw", "h200-sxm", "--fp8-dense-scaling", "rowwise")
    assert beside.exit_code == 2 and "--fp8-dense-scaling: fp8_dense_scaling" in beside.output


def test_plan_prices_the_fp8_forward_gemms_it_is_told():
    """`plan --fp8-expert-forward`: down (the default, as precision: fp8 trains) prices the experts'
    gate/up forward GEMM at the bf16 rate, which the plan's note names; both prices it in FP8 and says
    nothing of it; an unknown choice is refused."""
    base = ("plan", "-m", "qwen3-30b-a3b", "-hw", "h200-sxm", "-n", "8", "--expert-precision", "fp8", "--json")
    down = json.loads(run(*base).stdout)
    both = json.loads(run(*base, "--fp8-expert-forward", "both").stdout)
    assert down["step_time_s"] != both["step_time_s"] or down["layout"] != both["layout"]
    assert down["fp8_expert_forward"] == "down" and both["fp8_expert_forward"] == "both"
    assert any("gate/up GEMM at the bf16 rate (fp8_expert_forward: down)" in n for n in down["notes"])
    assert not any("fp8_expert_forward" in n for n in both["notes"])
    assert run(*base, "--fp8-expert-forward", "up").exit_code == 2


def test_plan_says_whether_a_distributed_layouts_rank_steps_are_captured():
    """`--cuda-graphs` (default auto, as train's): the plan's `rank_steps_captured` and
    `rank_steps_note` (train's line for them) for a distributed layout, a line in the table, none for
    one GPU; on plans a layout whose rank steps it captures; on with an offloaded optimizer: refused."""
    args = ("plan", "-m", "qwen3-30b-a3b", "-hw", "h200-sxm", "-n", "8", "--max-pipeline-groups", "1",
            "--global-batch-tokens", "262144")
    auto = Plan.model_validate_json(run(*args, "--json").stdout)
    assert (auto.layout, auto.attention_gpus, auto.rank_steps_captured) == ("disaggregated", 2, False)
    assert auto.rank_steps_note.startswith("cuda_graphs: auto -> eager: the 2 attention replicas per pipeline group")
    on = Plan.model_validate_json(run(*args, "--json", "--cuda-graphs", "on").stdout)
    assert (on.layout, on.attention_gpus, on.rank_steps_captured) == ("disaggregated", 1, True)
    assert on.rank_steps_note.startswith("cuda_graphs: on: every rank's step is captured")
    text = " ".join(run(*args, "--cuda-graphs", "on").stdout.replace("│", " ").split())
    assert "rank steps captured: cuda_graphs: on: every rank's step is captured" in text
    single = Plan.model_validate_json(run("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "1", "--json").stdout)
    assert single.layout == "single" and single.rank_steps_captured is None and single.rank_steps_note is None
    assert "rank steps" not in run("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "1").stdout
    refused = run(*args, "--cuda-graphs", "on", "--offload-optimizer", "on")
    assert refused.exit_code == 2 and "offload_optimizer on with cuda_graphs: on" in refused.output


def test_plan_says_how_each_expert_gpus_weight_gradients_were_priced():
    """A distributed plan records `expert_wgrad_pairs` as its expert GPUs were priced (auto settled per split, as
    the driver settles it) and says so in its table and note; asked off, once per micro-batch."""
    args = ("plan", "-m", "qwen3-30b-a3b", "-hw", "h200-sxm", "-n", "8", "--max-pipeline-groups", "1",
            "--global-batch-tokens", "262144")
    auto = Plan.model_validate_json(run(*args, "--json").stdout)
    assert auto.layout == "disaggregated" and auto.micro_batches >= 2 and auto.expert_wgrad_pairs == "on"
    assert any(n.startswith("expert_wgrad_pairs: auto -> on: each expert GPU's expert weight gradients priced ")
               for n in auto.notes), auto.notes
    text = " ".join(run(*args).stdout.replace("│", " ").split())
    priced = "expert weight gradients priced over pairs of micro-batches on each expert GPU"
    assert f"{priced} (expert_wgrad_pairs: on)" in text
    off = " ".join(run(*args, "--expert-wgrad-pairs", "off").stdout.replace("│", " ").split())
    assert "expert weight gradients priced once per micro-batch on each expert GPU (expert_wgrad_pairs: off)" in off


TINY = "configs/tiny-cpu.yaml"


def test_plan_for_a_train_configs_run_takes_its_model_batch_and_settings_and_train_runs_the_plan(tmp_path):
    """`plan --config CFG [key=value ...]`: the run's model, seq_len, batch_size x seq_len tokens and
    settings (priced as it trains), on its layout's GPUs unless --gpus, on --hardware (it names none);
    `train -c CFG --plan` takes the plan it writes."""
    from disagmoe.config import ClusterConfig, PlanConfig, load_hardware, load_train_config, priced_as_trained
    from disagmoe.model_ref import load_model
    from disagmoe.placement.solver import solve
    from disagmoe.runtime.plan_layout import apply_plan

    cfg = load_train_config(TINY)
    out = tmp_path / "plan.yaml"
    r = run("plan", "-c", TINY, "-hw", "h200-sxm", "--gpus", "3", "--json", "--out", str(out))
    assert r.exit_code == 0, r.output
    planned = Plan.model_validate_json(r.stdout)
    request = PlanConfig(model=load_model("tiny"), cluster=ClusterConfig(hardware=load_hardware("h200-sxm"),
                                                                         num_gpus=3),
                         seq_len=64, global_batch_tokens=cfg.batch_size * cfg.seq_len, **priced_as_trained(cfg))
    assert (planned.model, planned.gpus, planned.seq_len, planned.global_batch_tokens) == ("tiny", 3, 64, 512)
    assert planned == solve(request)  # priced as the run trains
    trained = apply_plan(cfg.model_copy(update={"plan": str(out)}), load_model("tiny"))
    assert trained.mode == planned.layout == "single"
    default = Plan.model_validate_json(run("plan", "-c", TINY, "-hw", "h200-sxm", "--json",
                                           "optim.state_dtype=bf16", "batch_size=64").stdout)
    assert default.gpus == cfg.attention_ranks + cfg.expert_ranks  # its layout's GPUs
    assert default.optimizer_state_dtype == "bf16" and default.global_batch_tokens == 64 * 64  # the overrides
    auto = Plan.model_validate_json(run("plan", "-c", TINY, "-hw", "h200-sxm", "--recompute", "auto", "--json").stdout)
    assert auto.feasible  # the search's own choices stay flags


def test_plan_prices_the_loss_it_is_told_and_a_config_sets_it():
    """`--no-fused-loss` prices the LM head as torch's ops (the plan records it); beside --config it is refused
    like the other run fields (the config's fused_loss says it)."""
    fused = Plan.model_validate_json(run("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "1", "--json").stdout)
    ops = run("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "1", "--no-fused-loss", "--json")
    assert ops.exit_code == 0, ops.output
    assert fused.fused_loss is True and Plan.model_validate_json(ops.stdout).fused_loss is False
    both = run("plan", "-c", TINY, "-hw", "h200-sxm", "--no-fused-loss")
    assert both.exit_code == 2 and "--fused-loss: fused_loss" in both.output


def test_plan_refuses_beside_a_config_the_flags_it_sets_and_says_where_they_go():
    both = run("plan", "-c", TINY, "-hw", "h200-sxm", "--seq-len", "128", "--optimizer-state-dtype", "bf16")
    assert both.exit_code == 2
    assert "--seq-len: seq_len" in both.output and "--optimizer-state-dtype: optim.state_dtype" in both.output
    assert "as key=value overrides" in both.output and "Traceback" not in both.output
    loose = run("plan", "-m", "tiny", "-hw", "h200-sxm", "-n", "2", "optim.state_dtype=bf16")
    assert loose.exit_code == 2 and "apply to a --config" in loose.output
    missing = run("plan", "-m", "tiny")
    assert missing.exit_code == 2 and "plan needs --hardware, --gpus (or --config CONFIG" in missing.output
    nameless = run("plan", "-c", TINY)
    assert nameless.exit_code != 0 and "names no hardware; pass --hardware" in nameless.output


def test_plan_prices_the_dense_projections_in_fp8_unless_told():
    """`plan --expert-precision fp8` with neither --fp8-dense nor --no-fp8-dense prices the dense
    projections in FP8, as precision: fp8 trains them by default (no `fp8_dense auto` note: auto is a
    request's choice, `PlanConfig.fp8_dense`); either flag fixes it."""
    base = ["plan", "--model", "qwen3-30b-a3b", "--hardware", "h200-sxm", "--gpus", "8", "--expert-precision", "fp8",
            "--json"]
    plans = {flag: json.loads(CliRunner().invoke(app, base + ([flag] if flag else [])).stdout)
             for flag in (None, "--fp8-dense", "--no-fp8-dense")}
    assert (plans[None]["fp8_dense"], plans["--fp8-dense"]["fp8_dense"], plans["--no-fp8-dense"]["fp8_dense"]) == (
        True, True, False)
    assert not any(n.startswith("fp8_dense auto") for plan in plans.values() for n in plan["notes"])


def test_plan_of_a_config_prices_its_fp8_dense_as_it_trains_and_train_plan_keeps_it(tmp_path):
    """`plan -c CFG precision=fp8`: a run without fp8_dense is priced with the dense projections in
    FP8 (as it trains), one that sets it as it says, each in the scaling it trains; `train --plan`
    then trains what was priced."""
    from disagmoe.config import load_train_config
    from disagmoe.model_ref import load_model
    from disagmoe.runtime.plan_layout import apply_plan

    base = ["plan", "-c", "configs/h200x2-qwen3-30b.yaml", "--json", "precision=fp8"]
    unset = json.loads(run(*base, "--out", str(tmp_path / "plan.json")).stdout)
    assert unset["fp8_dense"] is True and not any(n.startswith("fp8_dense auto") for n in unset["notes"])
    assert unset["fp8_dense_scaling"] == "blockwise"  # the run's unset scaling (config.FP8_DENSE_SCALING)
    assert json.loads(run(*base, "fp8_dense_scaling=rowwise").stdout)["fp8_dense_scaling"] == "rowwise"
    for fixed in (True, False):
        plan = json.loads(run(*base, f"fp8_dense={str(fixed).lower()}").stdout)
        assert plan["fp8_dense"] is fixed and not any(n.startswith("fp8_dense auto") for n in plan["notes"])
    cfg = load_train_config("configs/h200x2-qwen3-30b.yaml", ["precision=fp8", f"plan={tmp_path / 'plan.json'}"])
    assert apply_plan(cfg, load_model(cfg.model)).dense_precision == "fp8"


def test_the_expert_weight_gradient_pairs_flag_reaches_the_priced_problem():
    """`plan --expert-wgrad-pairs` (auto, the default: on for each split within 85% of the GPU's memory; on; off)
    reaches the planner's problem, and beside --config it is refused with where to set it (the config's
    expert_wgrad_pairs)."""
    import math

    from disagmoe.cli.plan_cmd import build_request
    from disagmoe.placement.solver import problem_of
    from disagmoe.roofline.memory import MEMORY_HEADROOM

    for pairs, priced in (("auto", True), ("on", True), ("off", False)):
        req = build_request("qwen3-30b-a3b", "h200-sxm", 1, 4096, 65536, expert_wgrad_pairs=pairs)
        prob = problem_of(req)
        assert req.expert_wgrad_pairs == pairs and prob.wgrad_pairs is priced
        budget = req.cluster.hardware.hbm_gib * 2**30 * MEMORY_HEADROOM if pairs == "auto" else math.inf
        assert prob.wgrad_pairs_budget == budget
    assert "--expert-wgrad-pairs" in run("plan", "--help").output
    r = run("plan", "-c", "configs/h200x2-qwen3-30b.yaml", "--expert-wgrad-pairs", "off")
    assert r.exit_code == 2 and "--expert-wgrad-pairs: expert_wgrad_pairs" in r.output


MIXTRAL = "configs/h200-mixtral-8x7b.yaml"


@pytest.mark.parametrize(("hardware", "overrides", "settled"), [
    ("h100-sxm", ["optim.state_dtype=bf16", "precision=fp8"], ["off", "off", "off"]),  # 74.5 GiB at 4 > 67.7
    ("h100-sxm", ["optim.state_dtype=bf16"], ["off", "off", "on"]),
    ("h200-sxm", ["precision=fp8"], ["on", "on", "on"]),
])
def test_plan_of_a_one_gpu_config_settles_auto_weight_gradient_pairs_per_split_as_the_trainer_does(
        hardware, overrides, settled):
    """`plan -c` of the Mixtral-shaped config (`expert_wgrad_pairs: auto`) prices each micro-batch split of the
    one-GPU layout (2, 4, 8) with the paired weight gradients the trainer settles for that split
    (`single_memory.resolve_wgrad_pairs` on the hardware's memory: on where the predicted peak with the waiting
    rows is within 85% of it), where the planner once priced every split paired; its plan says which it priced
    (`Plan.expert_wgrad_pairs`, which `train --plan` sets), and prices it as that setting asked outright."""
    from pathlib import Path

    from disagmoe.cli.plan_cmd import config_request
    from disagmoe.config import load_hardware, load_train_config
    from disagmoe.model_ref import load_model
    from disagmoe.placement.cost import Candidates
    from disagmoe.placement.solver import price
    from disagmoe.runtime.training.single_memory import resolve_wgrad_pairs

    req = config_request(Path(MIXTRAL), overrides, [], hardware, None, None, 8, 0, None, None)
    assert req.expert_wgrad_pairs == "auto"
    capacity = load_hardware(hardware).hbm_gib * 2**30
    decided = []
    for m in (2, 4, 8):
        cfg = load_train_config(MIXTRAL, [*overrides, f"micro_batches={m}"])
        trainer = resolve_wgrad_pairs(cfg, load_model(cfg.model), capacity)[0].expert_wgrad_pairs
        split = Candidates.one(0, 1, 1, m, cfg.batch_size // m, colocated=True)
        plan = price(req, split).plan
        assert plan.expert_wgrad_pairs == trainer, (m, plan.notes)
        asked = price(req.model_copy(update={"expert_wgrad_pairs": trainer}), split).plan
        assert (plan.step_time_s, plan.memory_per_gpu) == (asked.step_time_s, asked.memory_per_gpu)
        assert any(n.startswith(f"expert_wgrad_pairs: auto -> {trainer}: ") for n in plan.notes), plan.notes
        decided.append(trainer)
    assert decided == settled


def test_roofline_of_a_one_gpu_config_settles_its_weight_gradient_pairs_as_the_trainer_would():
    """`roofline -c` of the Mixtral-shaped config in FP8 (bf16 moments, 4 micro-batches): on an H100's 80 GiB its
    waiting rows would pass 85% (`single_memory.resolve_wgrad_pairs`: the trainer trains it unpaired there, as it
    did in session 35), so it is priced as expert_wgrad_pairs: off; on an H200's 141 GiB as on."""
    args = ("roofline", "-c", "configs/h200-mixtral-8x7b.yaml", "--layout", "single", "--json", "optim.state_dtype=bf16",
            "precision=fp8")

    def step(hardware: str, *extra: str) -> float:
        r = run(*args, "--hardware", hardware, *extra)
        assert r.exit_code == 0, r.output
        return json.loads(r.stdout)["plan"]["step_time_s"]

    assert step("h100-sxm-calibrated") == step("h100-sxm-calibrated", "expert_wgrad_pairs=off")
    assert step("h100-sxm-calibrated", "expert_wgrad_pairs=on") < step("h100-sxm-calibrated")
    assert step("h200-sxm-calibrated") == step("h200-sxm-calibrated", "expert_wgrad_pairs=on")
