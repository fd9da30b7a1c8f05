"""`disagmoe bench ...`: GPU benchmarks that measure their baselines in the same run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from disagmoe.bench.loss_parity import DEFAULT_WINDOW, same_variant
from disagmoe.cli.common import console, err_console, print_error, print_json, user_errors
from disagmoe.roofline.report import memory, seconds

bench_app = typer.Typer(help="GPU benchmarks (each measures its own baselines in the same run).",
                        no_args_is_help=True)

CONTROL_HELP = ("a variant that changes the first variant's rounding alone, e.g. 'precision=bf16 "
                "optim.update_kernel=torch' beside 'precision=bf16' (as its --variant was written): every other "
                "variant's |gap| and per-step gap are then read against the control's, how far this config's runs move "
                "apart on their own")

ShapeOption = Annotated[list[str] | None, typer.Option(
    "--shape", help="mixtral-8x7b, qwen3-235b-ep8, deepseek-v3-ep8, deepseek-v3-ep8-4k or "
                    "qwen3-30b-a3b (repeatable; default: all)")]


def _shape_names(shapes: list[str] | None) -> list[str]:
    from disagmoe.bench.experts import SHAPES

    unknown = [s for s in shapes or [] if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(SHAPES)}")
    return shapes or list(SHAPES)


@bench_app.command("experts")
@user_errors
def experts(
    shape: ShapeOption = None,
    backend: Annotated[list[str] | None, typer.Option(
        help="triton | grouped_mm | loop | triton:gluon | triton:tma-store | triton-fp8 | triton-fp8:fp8-wgrad | "
             "triton-fp8:gluon-wgrad | "
             "triton-fp8:gluon | triton-fp8:gluon-256 | triton-fp8:gluon-tma-store | triton-fp8:gluon-tma-store-wgrad | "
             "triton-fp8:bf16-backward | "
             "triton-fp8:down-forward | triton-fp8:down-forward-pass | triton-fp8:down-forward-dy-pass | triton-fp8:run | "
             "triton-fp8:run-act-pass | triton-fp8:run-dy-pass | triton-fp8:run-256 | triton-fp8:gluon-256-wgrad | "
             "scaled-grouped-mm (repeatable; "
             "default: the first "
             "three; triton:gluon: our bf16 block with every launch our warp-specialised Gluon kernels can run sent "
             "there (sm_90); triton:tma-store: our bf16 block with every launch of our Triton kernel writing its "
             "results, and its weight gradients reduce-adding, by TMA (sm_90+); triton-fp8: the expert GEMMs in FP8 with training's default backward (forward and data "
             "gradients e4m3, weight gradients bf16), needs sm_89+; its variants change one choice: the weight "
             "gradients in FP8 too, they in the warp-specialised Gluon kernel (sm_90), the row GEMMs and the SwiGLU "
             "GEMMs in the Gluon kernels (sm_90: training's fp8_gluon, on by default; gluon-256 at 256-row tiles, "
             "gluon-tma-store with the row GEMM's epilogue by TMA; gluon-tma-store-wgrad that with the weight gradients "
             "in FP8 by the Gluon kernel), "
             "the whole backward in bf16, "
             "or the forward's gate/up GEMM in bf16 (only the down GEMM's forward in FP8; down-forward-pass: its "
             "act quantised in a pass, not by the gate/up GEMM's epilogue; down-forward-dy-pass: dy's rows quantised "
             "in a pass, not by the combine's backward as a run and the other FP8 backends with FP8 data gradients have "
             "them); run: every "
             "choice as a training run's default recipe makes it (the down GEMM's forward alone in FP8, bf16 weight "
             "gradients, the Gluon row GEMMs with their TMA epilogue; run-act-pass and run-dy-pass: that with act's or dy's "
             "rows quantised in a pass; run-256 that at 256-row Gluon tiles, gluon-256-wgrad the all-FP8 recipe at them); "
             "scaled-grouped-mm: the library's row-wise FP8 forward, torch._scaled_grouped_mm, sm_90, no fwd+bwd "
             "row)")] = None,
    precision: Annotated[str, typer.Option(
        help="bf16, or fp8: our FP8 experts (triton-fp8) timed beside our bf16 ones (triton) of the same build "
             "in the same run, with the ratio and the FP8 error, and our FP8 forward against the library's "
             "(scaled-grouped-mm)")] = "bf16",
    fp8_promote: Annotated[list[str] | None, typer.Option(
        "--fp8-promote", help="with --precision fp8: time the FP8 experts once per K-loop promotion named "
                              "(inline | hoisted | pipelined | pingpong; repeatable), as triton-fp8:<promote>, "
                              "each at the tuned tiles with that promotion everywhere (default: the tuned tiles "
                              "as saved)")] = None,
    warmup: Annotated[int, typer.Option(help="untimed calls before timing")] = 3,
    iters: Annotated[int, typer.Option(help="timed calls (median reported)")] = 20,
    loop_iters: Annotated[int, typer.Option(help="timed calls of the slow per-expert loop")] = 5,
    check: Annotated[bool, typer.Option(help="relative error vs an fp32 torch reference")] = True,
    main_grads: Annotated[bool, typer.Option(
        help="fwd+bwd adds each weight gradient into an fp32 main gradient, as a training step's micro-batches "
             "after its first do (our kernels in their epilogues; the torch backends by an add after autograd's "
             "gradient, as the optimizer's hook adds it): the main gradients' read and write timed as training "
             "pays them (default: fresh gradients in the weights' dtype, which no training step writes)")] = False,
    gpu_clocks: Annotated[bool, typer.Option(
        "--gpu-clocks/--no-gpu-clocks", help="sample the GPU's SM clock, power and clock-event reasons with "
        "nvidia-smi while each row is timed (every 20 ms) and print each row's median clock under the table; "
        "--no-gpu-clocks to time without it (to see whether the sampling moves the rows)")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    markdown: Annotated[bool, typer.Option(help="also print the table as Markdown")] = False,
    out: Annotated[Path | None, typer.Option(help="also write the JSON record here")] = None,
) -> None:
    """Time the routed expert block (permute -> SwiGLU expert FFN -> combine), forward and
    forward+backward, for our Triton kernels, torch._grouped_mm and a per-expert loop, plus the
    bf16 matmul ceiling, all in one run. Shapes: mixtral-8x7b, qwen3-235b-ep8, deepseek-v3-ep8,
    deepseek-v3-ep8-4k, qwen3-30b-a3b (Zipf(1.2)-skewed routing)."""
    from disagmoe.bench import experts as bench

    log = (lambda m: err_console.print(m, highlight=False)) if as_json else console.print
    record = bench.run(_shape_names(shape), bench.backends_for(backend, precision, fp8_promote), warmup, iters,
                       loop_iters, check=check, log=log, main_grads=main_grads, gpu_clocks=gpu_clocks)
    if out is not None:
        out.write_text(json.dumps(record, indent=1) + "\n")
    if as_json:
        print_json(record)
        return
    console.print(_experts_table(record))
    for line in bench.clock_lines(record):
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    notes = bench.fp8_tiles_notes(record)
    if notes:
        console.print("FP8 tiles (block_m x block_n x block_k, warps, stages, programs per SM, K-loop promotion):",
                      markup=False)
        for line in notes:
            console.print(f"  {line}", soft_wrap=True, highlight=False, markup=False)
    if markdown:
        env = record["environment"]
        ceiling = f"bf16 matmul 8192^3 {record['ceiling_tflops']:.0f} TFLOP/s"
        accumulation = "; weight gradients added into fp32 main gradients" if record.get("main_grads") else ""
        console.print(", ".join(f"{k} {v}" for k, v in env.items()) + f"; {ceiling}{accumulation}",
                      soft_wrap=True)
        console.print(bench.markdown_table(record), soft_wrap=True, highlight=False)


def _experts_table(record: dict) -> Table:
    from disagmoe.bench.experts import FP8_BACKEND, LIBRARY_FP8_BACKEND, is_fp8, table_rows

    env, ceiling = record["environment"], record["ceiling_tflops"]
    backends = list(record["shapes"][0]["tflops"]) if record["shapes"] else []
    precision = "bf16" + (f" ({FP8_BACKEND}: e4m3 GEMMs, bf16 in and out)" if any(map(is_fp8, backends)) else "") + (
        f"; {LIBRARY_FP8_BACKEND}: torch._scaled_grouped_mm, row-wise FP8, forward only"
        if LIBRARY_FP8_BACKEND in backends else "")
    if record.get("main_grads"):
        precision += "; weight gradients added into fp32 main gradients"
    table = Table(title=f"routed expert block, {precision}, {env['gpu']} (driver {env['driver']}, torch "
                        f"{env['torch']}, triton {env['triton']}); bf16 matmul ceiling "
                        f"{ceiling:.0f} TFLOP/s")
    head, rows = table_rows(record, short_fp8_names=True)
    for col in head:
        table.add_column(col.replace(" (% of ceiling)", " (% ceil)"),
                         justify="left" if col in ("shape", "pass") else "right")
    for cells in rows:
        table.add_row(*cells)
    return table


@bench_app.command("layer")
@user_errors
def layer(
    shape: Annotated[list[str] | None, typer.Option(
        "--shape", help="qwen3-30b-a3b, deepseek-v3-4k or deepseek-v3-32k (repeatable; default: all)")] = None,
    iters: Annotated[int, typer.Option(help="timed iterations per variant (median reported)")] = 20,
    warmup: Annotated[int, typer.Option(help="untimed iterations per variant first")] = 5,
    segment_tokens: Annotated[int, typer.Option(
        help="tokens per flag segment of the fused return (the combine waits per segment)")] = 256,
    combine_programs: Annotated[int, typer.Option(
        help="persistent programs of GPU 0's combine, in both variants (0: 4 per SM, training's default; "
             "nothing else runs on GPU 0 meanwhile)")] = 0,
    order: Annotated[str, typer.Option(
        help="the fused path's rows: expert (one group per expert, as the baseline and training) or segment "
             "(grouped by band of destination segments, then expert: the first segments land while later "
             "ones compute, at the price of smaller row groups)")] = "expert",
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    out: Annotated[Path | None, typer.Option(help="also write the JSON record here")] = None,
) -> None:
    """One MoE layer forward and backward on 2 GPUs: tokens, router and combine on GPU 0, every
    expert on GPU 1, every (token, expert) row returned as its own row. (a) baseline: the expert
    kernels, then NCCL send/recv after they finish; (b) fused: the last GEMM's epilogue stores rows
    into GPU 0's NVSHMEM buffer and raises per-segment flags, GPU 0 combines as segments land.
    Same run, same inputs: layer time, expert compute alone, bytes returned, achieved GB/s, GPU 0's
    wait for returned rows, and the bound max(compute, bytes / NVLink one-way bandwidth measured by
    `bench hardware`'s probe in the same run). Outputs and gradients are checked against a
    single-GPU fp32 torch reference; no speedup is reported when that check fails. Without
    nvshmem4py only (a) runs. Shapes: qwen3-30b-a3b (128 experts, 2048 -> 768, top-8, 32k tokens),
    deepseek-v3-4k and deepseek-v3-32k (32 local experts, 7168 -> 2048, top-8, 4k / 32k pairs).

    \b
    Example (on 2 x H200): disagmoe bench layer --shape qwen3-30b-a3b --iters 20
    """
    from disagmoe.bench import layer as bench

    shapes = bench.layer_shapes(shape)
    bench.check_options(iters, warmup, segment_tokens, combine_programs, order)
    log = (lambda m: err_console.print(m, highlight=False, markup=False)) if as_json else (
        lambda m: console.print(m, highlight=False, markup=False))
    record = bench.run(shapes, iters, warmup, segment_tokens, combine_programs, log=log, order=order)
    if out is not None:
        out.write_text(json.dumps(record, indent=1) + "\n")
    if as_json:
        print_json(record)
    else:
        env = record["environment"]
        console.print(", ".join(f"{k} {v}" for k, v in env.items()), soft_wrap=True, highlight=False, markup=False)
        console.print(_layer_table(record))
        for line in _layer_notes(record):
            console.print(line, soft_wrap=True, highlight=False, markup=False)
    if record["check_failed"]:
        print_error("outputs or gradients differ from the single-GPU reference beyond bf16 tolerance "
                    f"({record['tolerance']:.0e}): {'; '.join(record['check_failed'])}; no speedup reported")
        raise typer.Exit(1)


def _layer_table(record: dict) -> Table:
    env, nvlink = record["environment"], record["nvlink_gbps"]
    link = f"NVLink one way {nvlink:.0f} GB/s (bench hardware probe, this run)" if nvlink else "NVLink not measured"
    table = Table(title=f"one MoE layer, GPU 0 attention / GPU 1 experts, {env.get('gpu', '?')}: (a) compute then "
                        f"NCCL send/recv, (b) fused return; {link}; median ms")
    columns = ("shape", "pass", "MB", "compute", "(a) layer", "(a) wait", "(a) GB/s", "(b) layer", "(b) wait",
               "(b) GB/s", "(a)/(b)", "bound", "(b)/bound", "max rel err")
    for col in columns:
        table.add_column(col, justify="left" if col in ("shape", "pass") else "right")

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x:.3f}"

    def ratio(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    for s in record["shapes"]:
        for row in s["passes"]:
            a, b = row["baseline"], row["fused"] or {}
            errors = [e for errs in row["errors"].values() for e in errs.values()]
            table.add_row(s["name"], row["pass"], f"{row['bytes'] / 1e6:.0f}", ms(row["compute_ms"]), ms(a["layer_ms"]),
                          ms(a["wait_ms"]), f"{a['gbps']:.0f}", ms(b.get("layer_ms")), ms(b.get("wait_ms")),
                          "-" if not b else f"{b['gbps']:.0f}", ratio(row["speedup"]), ms(row["bound_ms"]),
                          ratio(row["fused_vs_bound"]), f"{max(errors):.1e}" if errors else "-")
    return table


def _layer_notes(record: dict) -> list[str]:
    t = record["targets"]
    notes = [f"targets (issue 11): (a)/(b) >= {t['speedup_qwen3']}x on qwen3-30b-a3b; (b)/bound <= "
             f"{1 + t['bound_slack']:.2f}x on every shape. bound = max(compute alone, bytes / NVLink one way); "
             f"fwd+bwd sums the passes' medians and bounds.",
             "bwd: input gradients returned the same way (the gate/up dgrad's epilogue); the expert weight "
             "gradients are outside the timed window (computed once, for the check)."]
    if record["fused_skipped"]:
        notes.append(f"fused path (b) not run: {record['fused_skipped']}")
    return notes


@bench_app.command("tune-experts")
@user_errors
def tune_experts(
    shape: ShapeOption = None,
    config: Annotated[Path | None, typer.Option(
        "--config", "-c", help="also tune the expert GEMMs of this train config's micro-batches (its model, "
        "tokens per micro-batch and routing, as one GPU runs them); with it, --shape adds shapes instead of "
        "defaulting to all")] = None,
    overrides: Annotated[list[str] | None, typer.Argument(
        help="key=value overrides of --config, e.g. micro_batches=2")] = None,
    precision: Annotated[str, typer.Option(
        help="bf16: the bf16 expert GEMMs' tiles, one per launch; fp8: the FP8 FFN's three tile choices "
             "(kernels.fp8_ffn.Fp8Tiles: rows, swiglu, wgrad, each with its K loop's promotion), each timed "
             "over the two launches it serves")] = "bf16",
    role: Annotated[list[str] | None, typer.Option(
        help="tune only this GEMM (repeatable; bf16: gate_up, down, down_dgrad, gate_up_dgrad, wgrad_w2, "
             "wgrad_w13; fp8: fp8_rows, fp8_swiglu, fp8_wgrad); the other classes keep their entries")] = None,
    warmup: Annotated[int, typer.Option(help="untimed launches per candidate")] = 2,
    iters: Annotated[int, typer.Option(help="timed launches per candidate (median)")] = 10,
    out: Annotated[Path | None, typer.Option(
        help="tuned table to merge into (default: disagmoe/kernels/tuned/<gpu>.json)")] = None,
    compile_workers: Annotated[int | None, typer.Option(
        help="processes that first compile every candidate kernel into Triton's cache, so the search loads them "
             "instead of compiling one after another (default: one a CPU core but this one's, at most 8, as many "
             "as the GPU's free memory holds; 0: compile each as it is first timed)")] = None,
    block_check: Annotated[bool, typer.Option(
        help="once a shape's six bf16 GEMMs are tuned, time its whole expert block (forward and backward, weight "
             "gradients into fp32 main gradients) on the new tiles and on the table's before: a GEMM whose new "
             "tile slows the block by over 1% keeps its old one (only where all six GEMMs are tuned; where a run "
             "pairs its weight gradients, the four row GEMMs only)")] = True,
) -> None:
    """Autotune the expert FFN's grouped GEMM tiles per shape class on this GPU and save them.

    The table is keyed by (GEMM, K, N, mean rows per expert rounded up to a power of 2, loads); a run
    whose class was never tuned launches the heuristic tiles (a single run names those classes as it
    starts). Loads: a `routing=balanced` config's classes are tuned on even rows (`/even` entries), the
    `--shape`s and learned routing on Zipf-skewed ones; a run reads each table's tiles for its own loads
    before those for the other.
    `--config CFG` tunes exactly the classes that run launches:
    `disagmoe bench tune-experts -c configs/h200x2-qwen3-30b.yaml micro_batches=2`;
    `--role wgrad_w13 --role wgrad_w2` only the weight gradients. Each class is saved as soon as it is
    tuned: a search stopped part-way keeps the classes it finished."""
    from disagmoe.bench import tune_experts as tuner
    from disagmoe.bench.experts import SHAPES, shape_of_run
    from disagmoe.bench.tune_compile import check_requested

    if overrides and config is None:
        raise typer.BadParameter("key=value overrides apply to --config: give --config CFG with them")
    try:
        tuner.check_roles(role, precision)
        check_requested(compile_workers)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    shapes = [SHAPES[n] for n in (_shape_names(shape) if shape or config is None else [])]
    if config is not None:
        import torch

        from disagmoe.config import load_train_config

        device = torch.device("cuda") if torch.cuda.is_available() else None
        shapes.append(shape_of_run(load_train_config(config, overrides), device))
    with TuneProgress() as progress:
        record = tuner.tune(shapes, warmup, iters, log=progress.log, precision=precision, roles=role,
                            save=lambda one: tuner.write_tuned(one, out, progress.log),  # each class as tuned
                            progress=progress.update, compile_workers=compile_workers, block_checks=block_check)
    path = tuner.write_tuned(record, out)
    console.print(f"wrote {len(record['results'])} tuned entries to {path}", markup=False)


class TuneProgress:
    """`tune-experts`' bar: the shape and GEMM being searched, its candidates checked and timed so far (each one's
    first launch compiles it: the minutes of a first tune). Redrawn only as a candidate ends, so no drawing thread
    runs beside the timed launches; the tuner's lines print above it."""

    def __init__(self) -> None:
        self.bar = Progress(TextColumn("[bold]tuning[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                            TimeElapsedColumn(), console=console, auto_refresh=False, transient=True)
        self.task = self.bar.add_task("", total=None)

    def __enter__(self) -> TuneProgress:
        self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.stop()

    def update(self, label: str, done: int, total: int) -> None:
        self.bar.update(self.task, description=label, completed=done, total=total)
        self.bar.refresh()

    def log(self, line: str) -> None:
        self.bar.console.print(line, markup=False, highlight=False)


@bench_app.command("plan")
@user_errors
def plan(
    repeats: Annotated[int, typer.Option(help="runs per case (min, median and max reported)", min=1)] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Time `disagmoe plan` end to end (a fresh process per run, imports included) for the
    presets on 8 to 1,152 GPUs. CPU only: the planner never touches a GPU."""
    from disagmoe.bench import planner

    log = (lambda m: err_console.print(m, highlight=False)) if as_json else console.print
    record = planner.run(repeats, log)
    if as_json:
        print_json(record)
        return
    env = record["environment"]
    table = Table(title=f"`disagmoe plan` wall time, {env['cores']} cores, {env['cpu']}, {env['date']}")
    for col in ("model", "hardware", "GPUs", "median s", "max s", "layout", "A+E / p / m", "vs colocated"):
        table.add_column(col, justify="left" if col in ("model", "hardware", "layout") else "right")
    for r in record["cases"]:
        split = (f"{r['attention_gpus']}+{r['expert_gpus']} / {r['pipeline_groups']} / {r['micro_batches']}"
                 if r["feasible"] else "-")
        table.add_row(r["model"], r["hardware"], str(r["gpus"]), f"{r['wall_s_median']:.2f}",
                      f"{r['wall_s_max']:.2f}", r["layout"] if r["feasible"] else "no fit", split,
                      f"{r['speedup_vs_colocated']:.2f}x" if r["speedup_vs_colocated"] else "-")
    console.print(table)


@bench_app.command("hardware")
@user_errors
def hardware(
    preset: Annotated[str, typer.Option("--hardware", help="the preset whose peaks the fractions refer to")],
    out: Annotated[Path | None, typer.Option(help="write the calibrated preset YAML here")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Measure this machine's bf16 matmul rate, HBM copy bandwidth, GPU-to-GPU copy bandwidth and
    latency, and write a calibrated hardware preset (datasheet peaks, measured fractions) that
    `disagmoe plan --hardware FILE` uses."""
    from dataclasses import asdict

    from disagmoe.bench import hardware as bench
    from disagmoe.config import load_hardware

    command = f"disagmoe bench hardware --hardware {preset}" + (f" --out {out.name}" if out else "")
    measured, hw, text = bench.run(load_hardware(preset), command)
    if out is not None:
        out.write_text(text)
    if as_json:
        print_json({"measured": asdict(measured), "hardware": hw.model_dump(mode="json")})
        return
    console.print(text, highlight=False, markup=False, soft_wrap=True)  # YAML: never wrapped


@bench_app.command("calibrate")
@user_errors
def calibrate(
    preset: Annotated[str, typer.Option("--hardware", help="the preset (or hardware YAML) whose peaks the measured "
                                        "fractions refer to; its calibration terms this machine cannot measure are kept "
                                        "(when measured by the current probe version)")],
    out: Annotated[Path, typer.Option("--out", "-o", help="write the calibrated hardware YAML here")],
    model: Annotated[str, typer.Option("--model", "-m", help="model preset whose expert and attention shapes "
                                       "are measured (hidden, expert FFN, heads)")] = "qwen3-30b-a3b",
    experts_backend: Annotated[str, typer.Option(help="the expert GEMMs to measure: grouped_mm (torch._grouped_mm) "
                                                 "or triton (our kernels), as the run's experts_backend")] = "grouped_mm",
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Measure the cost model's terms on this machine and write a hardware YAML that `plan
    --hardware FILE` and `roofline --hardware FILE` accept: bf16 matmul, HBM and GPU-to-GPU
    ceilings (as `bench hardware`), the expert GEMM rates at several rows per expert (forward,
    data gradients, weight gradients adding into fp32 main gradients, as the step runs them), with
    --experts-backend triton on an sm_89+ GPU the FP8 experts' rates at the same points (forward,
    and the whole backward; `plan --expert-precision fp8` then prices FP8 at them, not at the
    datasheet's fp8_tflops), SDPA attention forward+backward at several sequence lengths and the
    attention projections' GEMMs at several tokens per micro-batch, on the model's attention and on
    MLA's (DeepSeek-V3's 128 heads of q/k 192 and v 128 and its low-rank chains, unless the model is
    MLA itself: the curves that price MLA models' attention), each op's fixed cost, and NCCL
    send/recv, all-reduce and all-to-all latency and bandwidth when 2+ GPUs are visible. It also
    prints the SM clock the probes ran at (set it beside `bench train`'s: rates measured in short
    bursts at boost clocks price a power-capped step short).

    \b
    Example (on the GPU machine): disagmoe bench calibrate --hardware h200-sxm --out h200-calibrated.yaml
    then: disagmoe plan --model qwen3-30b-a3b --hardware h200-calibrated.yaml --gpus 2
    """
    from contextlib import nullcontext

    import torch

    from disagmoe.bench import calibrate as bench
    from disagmoe.bench.gpu_clocks import GpuClockSampler, describe
    from disagmoe.config import load_hardware
    from disagmoe.model_ref import load_model

    hw_preset = load_hardware(preset)
    if out.exists():  # refreshing a calibrated file: its terms this machine cannot measure stay
        kept = load_hardware(str(out)).calibration
        hw_preset = hw_preset.model_copy(update={"calibration": bench.merge_calibration(hw_preset.calibration, kept)
                                                 if kept else hw_preset.calibration})
    command = f"disagmoe bench calibrate --hardware {preset} --out {out.name} --model {model} --experts-backend {experts_backend}"
    clocks = GpuClockSampler.for_devices([0]) if torch.cuda.is_available() else None
    with clocks or nullcontext():  # the probes' clocks, to set beside those of the steps they price
        if clocks is not None:
            clocks.mark(0)  # the probes' start (their one 'step' ends with the last of them)
        measured, hw, text = bench.run(hw_preset, load_model(model), experts_backend, command)
        if clocks is not None:
            clocks.mark()
    bench.write_preset(text, out)
    probe_clocks = None if clocks is None else clocks.timed_summary(0)
    if as_json:
        print_json({"hardware": hw.model_dump(mode="json"), "gpu_clocks": probe_clocks})
        return
    console.print(text, highlight=False, markup=False, soft_wrap=True)  # YAML: never wrapped
    console.print(f"calibrated hardware written to {out}", highlight=False, markup=False)
    if clocks is not None:
        console.print(f"GPU clocks during the probes: {describe(probe_clocks, clocks.timed_note(0))}", markup=False)


@bench_app.command("train")
@user_errors
def train(
    config: Annotated[Path, typer.Option("--config", "-c", help="a train config YAML")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. device=cuda")] = None,
    mode: Annotated[list[str] | None, typer.Option(
        help="single | disaggregated | colocated (repeatable; default: disaggregated and colocated)")] = None,
    steps: Annotated[int, typer.Option(help="steps per mode", min=2)] = 20,
    warmup: Annotated[int, typer.Option(
        help="first steps left out of the median; a row whose step is captured in CUDA graphs warms up through "
             "its capture steps too, saying so (mode single: step 4, and under precision fp8 the next step "
             "counting its FP8 numerics, 10 by default or a shorter run's last; the distributed modes: 4 and 5): "
             "a capture leaves the GPU idle for about a step", min=0)] = 3,
    baseline: Annotated[str | None, typer.Option(
        help="also train an outside baseline on one GPU in the same run: 'hf' = Hugging Face transformers' own "
             "model of the config's family (MixtralForCausalLM, Qwen3MoeForCausalLM or DeepseekV3ForCausalLM: the "
             "first whose config.json expresses the model; bf16, sdpa, grouped_mm experts, fused AdamW), same shape "
             "and batch")] = None,
    transport: Annotated[list[str] | None, typer.Option(
        help="nccl | nvshmem (repeatable): time each distributed mode with each, in the same run "
             "(default: the config's transport)")] = None,
    hop: Annotated[list[str] | None, typer.Option(
        help="partial_sums | pair_rows (repeatable): how expert outputs return, each timed in the same run "
             "(default: the config's hop; pair rows over nccl are left out: they need nvshmem)")] = None,
    variant: Annotated[list[str] | None, typer.Option(
        help="config overrides for one more run of every mode, e.g. 'recompute=selective' or "
             "'micro_batches=2 batch_size=8' (repeatable, quoted when several): each row then also gives its "
             "tokens/s and peak memory against the same mode under the first variant, and a loss-parity table "
             "follows (see --seeds)")] = None,
    gpu_clocks: Annotated[bool, typer.Option(
        "--gpu-clocks/--no-gpu-clocks", help="sample the GPUs' SM clock, power and clock-event reasons with "
        "nvidia-smi beside the steps (every 100 ms); --no-gpu-clocks to time the steps without it (to see "
        "whether the sampling moves them)")] = True,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="also write the JSON record here (rewritten as each "
                                                               "row ends, marked partial until the run's end)")] = None,
    plot: Annotated[Path | None, typer.Option(
        help="also write the rows' loss curves as a PNG: loss per step, each row's loss relative to the first "
             "row's (%; under --seeds, to the mean of the first variant's seeds), and where a row ran FP8 the "
             "share of saturated e4m3 elements per step (a parity run: --variant precision=bf16 --variant "
             "precision=fp8 --steps 300 --seeds 2)")] = None,
    seeds: Annotated[int, typer.Option(
        help="train every row this many times, seeds seed..seed+N-1 with the data order pinned (the same "
             "batches; only the initialisation moves), and print each variant's mean loss over the last "
             "--loss-window steps against the first variant's range over those seeds: one pair of runs cannot "
             "tell a gap of a few percent from the run-to-run spread (two identical bf16 runs of the Qwen3 "
             "config once ended 7.9% apart)", min=1)] = 1,
    loss_window: Annotated[int, typer.Option(
        help="the last steps whose mean loss the parity table compares (with several variants or --seeds)",
        min=1)] = DEFAULT_WINDOW,
    control: Annotated[str | None, typer.Option(help=CONTROL_HELP)] = None,
) -> None:
    """Time whole training steps of one config in several layouts in the same run, on the same
    devices (colocated gets attention + expert ranks as one pipeline group; a config with
    mode=colocated keeps its own colocated_ranks and pipeline_groups), and report each against colocated and the
    single GPU, with MFU per GPU (bf16 dense peak, and the measured matmul ceiling), each group's
    busy fraction (compute time / step time; on GPUs each op's span on the GPU, from its first
    kernel to its last, waits inside the op included), each group's GPU wait for returned rows
    (the combine messages: how long its stream stood still for them / step time), peak memory,
    the routing used and, on GPUs, the SM clock the timed steps ran at (nvidia-smi sampled in the
    background; the JSON record holds power, temperature, clock-event reasons such as sw_power_cap,
    and each step's clock: a step time is comparable only at the clocks it ran at).

    \b
    Example: disagmoe bench train -c configs/h200x2-qwen3-30b.yaml --mode single --mode disaggregated \\
             --mode colocated --baseline hf routing=balanced
    \b
    nvshmem against nccl: disagmoe bench train -c configs/h200x2-qwen3-30b.yaml --mode disaggregated \\
             --transport nccl --transport nvshmem routing=balanced
    \b
    the pair-row return too: ... --transport nccl --transport nvshmem --hop partial_sums --hop pair_rows
    \b
    recomputation against none: disagmoe bench train -c configs/h200x2-qwen3-30b.yaml --mode single \
             --variant recompute=none --variant recompute=selective
    """
    from disagmoe.bench import train as bench
    from disagmoe.config import load_train_config

    cfg = load_train_config(config, overrides or [])
    log = (lambda m: err_console.print(m, highlight=False, markup=False)) if as_json else (
        lambda m: console.print(m, highlight=False, markup=False))
    def keep_partial(rows: list[dict]) -> None:  # a run stopped part-way leaves the rows it finished
        out.write_text(json.dumps({"partial": True, "steps": steps, "warmup": warmup, "modes": rows}, indent=1) + "\n")

    record = bench.run(cfg, mode or ["disaggregated", "colocated"], steps, warmup, log, baseline, transport, hop,
                       variant, on_row=keep_partial if out is not None else None, gpu_clocks=gpu_clocks, seeds=seeds,
                       loss_window=loss_window, control=control)
    if out is not None:
        out.write_text(json.dumps(record, indent=1) + "\n")
    if plot is not None:
        ran = [r for r in record["modes"] if not r.get("error")]
        _plot_rows(ran, plot, f"{config} ({ran[0].get('routing', 'learned')} routing), {steps} steps")
        log(f"wrote {plot}")
    if as_json:
        print_json(record)
        return
    env = record["environment"]
    failed = [r for r in record["modes"] if r.get("error")]
    record = {**record, "modes": [r for r in record["modes"] if not r.get("error")]}
    routing = record["modes"][0].get("routing", "learned")
    warmups = sorted({r.get("warmup", warmup) for r in record["modes"]})
    timed = (f"median of steps {warmups[0] + 1}-{steps}" if len(warmups) == 1 else
             "median of each row's steps after its warm-up (timed)")  # a captured row's past its capture steps
    table = Table(title=f"training steps of {config} on {env['device']} ({env['transport']} transport, "
                        f"{routing} routing), {timed}")
    base = record["modes"][0]["baseline"]
    with_single = base != "single" and any(r.get("vs_single") is not None for r in record["modes"])
    first_variant = next((r["variant_baseline"] for r in record["modes"] if r.get("variant_baseline")), None)
    variant_columns = (f"vs {first_variant}", f"memory vs {first_variant}") if first_variant else ()
    columns = ("mode", "ranks", "m", "step", *(("timed",) if len(warmups) > 1 else ()), "SM clock", "tokens/s",
               "MFU/GPU", "of ceiling", "peak memory", "predicted",
               "imbalance",
               "final loss", "busy", "combine wait", "vs " + base, *(("vs single",) if with_single else ()),
               *variant_columns)
    for col in columns:
        table.add_column(col, justify="left" if col in ("mode", "busy", "combine wait") else "right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{x:.1%}"

    def num(x: float | None, fmt: str) -> str:
        return "-" if x is None else format(x, fmt)

    def times(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}x"

    for r in record["modes"]:
        busy = " ".join(f"{group} {fraction:.0%}" for group, fraction in r["busy"].items()) or "-"
        waits = " ".join(f"{group} {w['combine']:.1%}" for group, w in r.get("gpu_wait", {}).items()
                         if "combine" in w) or "-"
        label = bench.row_label(r)
        split = "-" if r.get("micro_batches") is None else str(r["micro_batches"]) + (
            " (graph)" if r.get("cuda_graph_replays") else "")
        clocks = r.get("gpu_clocks")
        sm_clock = "-" if not clocks else f"{clocks['sm_mhz_median']:,.0f} MHz" + (
            " (partial)" if clocks.get("partial") else "")
        table.add_row(label, str(r["ranks"]), split, seconds(r['median_step_s']),
                      *((f"{r.get('warmup', warmup) + 1}-{steps}",) if len(warmups) > 1 else ()), sm_clock,
                      f"{r['tokens_per_s']:,.0f}",
                      pct(r.get("mfu")), pct(r.get("mfu_ceiling")), memory(r.get("peak_memory_gib")),
                      memory(r.get("predicted_peak_gib")),
                      num(r.get("load_imbalance"), ".2f"), f"{r['final_loss']:.4f}", busy, waits, times(r.get("speedup")),
                      *((times(r.get("vs_single")),) if with_single else ()),
                      *((times(r.get("vs_variant")), times(r.get("memory_vs_variant"))) if first_variant else ()))
    console.print(table)
    for r in failed:
        console.print(f"{bench.row_label(r)} did not run: {r['error']}", highlight=False, markup=False)
    if any(r.get("time_sliced") for r in record["modes"]):
        console.print("time-sliced rows: their ranks shared GPUs (ranks_per_gpu), so their step times test the "
                      "layout, not its speed; no speedup or MFU is quoted for them", highlight=False)
    if record.get("loss_parity"):
        console.print(_parity_table(record["loss_parity"]))


def _signed(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2%}"


def _parity_table(parity: dict) -> Table:
    """`bench train`'s or `bench parity`'s loss parity (`bench.loss_parity`) as a table: one line
    per variant and layout, each against the first of its layout over the seeds both ran (per-step
    gap: each seed's mean |gap| step by step over the window, how far the trajectories run apart)."""
    from disagmoe.bench.train import row_label

    window, seeds = parity["window"], max(len(g["seeds"]) for g in parity["groups"])
    orders = parity.get("data_orders", 1)
    moving = ("the data order pinned: the initialisation alone moves" if orders == 1 else
              f"{orders} data orders: the initialisation and the batches both move")
    seed_note = (f"over {seeds} seeds ({moving})" if seeds > 1 else
                 "one seed (more seeds read a gap against the reference's own spread)")
    metric = "cross-entropy" if all(g.get("metric") == "ce" for g in parity["groups"]) else "training loss"
    table = Table(title=f"loss parity: mean {metric} of the last {window} steps, {seed_note}; each variant against "
                        "the first of its layout")
    control = parity.get("control")
    columns = ["row", "each seed", "mean", "seeds' range", "vs first", "paired (same seed)", "per-step gap",
               "inside first's range"] + (["|gap|, per-step vs control"] if control else [])
    for col in columns:
        table.add_column(col, justify="left" if col == "row" else "right")
    for g in parity["groups"]:
        inside = g["inside_reference_range"]
        table.add_row(row_label({**g, "seed": None}), " ".join(f"{x:.4f}" for x in g["seed_losses"]),
                      f"{g['loss']:.4f}", "-" if g["spread"] is None else f"{g['spread']:.2%}", _signed(g["vs_first"]),
                      "-" if not g["paired_gaps"] else " ".join(_signed(x) for x in g["paired_gaps"]),
                      "-" if not g.get("step_gaps") else " ".join(f"{x:.2%}" for x in g["step_gaps"]),
                      "-" if inside is None else ("yes" if inside else "no"),
                      *([_against_control(g, control)] if control else []))
    if control:
        reference = parity["groups"][0]["variant"]
        trained = any(same_variant(g["variant"], control) for g in parity["groups"])
        table.caption = (f"reference: {reference}; control: {control} (rounding alone moves it from the reference); "
                         "a variant is within the control where neither its mean |gap| nor its per-step gap is larger"
                         + ("" if trained else "; no row of the control trained, so nothing is read against it"))
    return table


def _against_control(group: dict, control: str) -> str:
    """A parity row's cell against the control (`loss_parity.judge_against_control`): its two ratios
    ("n/a" where the control's gap is zero) and the verdict."""
    if same_variant(group["variant"], control):
        return "control"
    if group.get("within_control") is None:
        return "-"
    ratios = ", ".join("n/a (control's 0)" if group[k] is None else f"{group[k]:.2f}x"
                       for k in ("gap_vs_control", "step_gap_vs_control"))
    return f"{ratios}: {'within' if group['within_control'] else 'outside'}"


def _plot_rows(rows: list[dict], path: Path, title: str) -> None:
    """`--plot` of `bench train` and `bench parity`: the rows' curves (`bench.loss_plot`), each named
    by its row label without the seed (a variant's seeds share a colour), the seed count in the title."""
    from disagmoe.bench.loss_parity import seed_of
    from disagmoe.bench.loss_plot import plot_losses
    from disagmoe.bench.train import row_label

    seeds = len({seed_of(r) for r in rows})
    plot_losses(rows, path, title + (f", {seeds} seeds" if seeds > 1 else ""),
                [row_label({**r, "seed": None}) for r in rows])


@bench_app.command("parity")
@user_errors
def parity(
    records: Annotated[list[Path], typer.Argument(help="`disagmoe bench train --out` records (JSON) of one config on "
                                                       "the same batches, from separate calls: other seeds, or other "
                                                       "variants; the reference's record first")],
    loss_window: Annotated[int, typer.Option(help="the last steps whose mean loss is compared", min=1)] = DEFAULT_WINDOW,
    control: Annotated[str | None, typer.Option(help=CONTROL_HELP)] = None,
    plot: Annotated[Path | None, typer.Option(
        help="also write the records' loss curves as a PNG, as `bench train --plot` draws one call's")] = None,
    spans: Annotated[int | None, typer.Option(
        help="also cut the runs into spans of this many steps and give each variant's mean gap to the first in "
             "each, with on how many of its steps it lay above: where a gap opens and whether it holds", min=1)] = None,
    same: Annotated[list[str] | None, typer.Option(
        help="read these variants as one, the first's name kept: 'A | B' (repeatable), e.g. a recipe spelled out "
             "in one record and left to the defaults in another, after the defaults became it")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Read a loss-parity table across several `bench train` records: each variant's mean loss over
    the last --loss-window steps, per seed and on average, against the first variant's range over
    the seeds (`bench train --seeds` prints the same table for the seeds of one call). For runs too
    long to fit one call: the same command once per seed, the data order pinned to one seed (the
    seeds' range is then the initialisation's alone; a seed's own data.seed in each call works too, its
    variants still paired on the same batches, and the range then holds both). The reference is the
    first variant of the first record: give the reference's record first.

    \b
    Example (300 steps of bf16 against FP8, two seeds, two calls):
      disagmoe bench train -c CONFIG --mode single --steps 300 --variant precision=bf16 --variant precision=fp8 -o seed0.json
      disagmoe bench train (the same) seed=1 data.seed=0 -o seed1.json
      disagmoe bench parity seed0.json seed1.json
    \b
    Against a control (a variant that changes the reference's rounding alone):
      disagmoe bench train ... --variant precision=bf16 --variant 'precision=bf16 optim.update_kernel=torch' -o p1.json
      disagmoe bench train ... --variant precision=fp8 -o p2.json
      disagmoe bench parity p1.json p2.json --control 'precision=bf16 optim.update_kernel=torch'
    """
    from disagmoe.bench.loss_parity import (MODES, check_control, data_orders, loss_parity, merged_rows,
                                            read_as_one)

    loaded = {}
    for path in records:
        if str(path) in loaded:
            raise typer.BadParameter(f"{path} is given twice: give each record once")
        try:
            loaded[str(path)] = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise typer.BadParameter(f"{path}: not a readable `bench train --out` record ({err})") from err
    if same:
        try:
            loaded = read_as_one(loaded, same)
        except ValueError as err:
            raise typer.BadParameter(str(err)) from err
    rows = merged_rows(loaded)
    if control is not None:  # against every row the records ran, failed ones too (the control's own rows may have)
        check_control(control, [r.get("variant") for record in loaded.values() for r in record["modes"]
                                if r.get("mode") in MODES])
    steps = next(iter(loaded.values())).get("steps")
    groups = loss_parity(rows, loss_window, control, spans)
    result = {"records": list(loaded), "steps": steps, "window": min(loss_window, steps or loss_window),
              "control": control, "spans": spans, "data_orders": data_orders(rows), "groups": groups}
    if plot is not None:
        _plot_rows(rows, plot, f"{', '.join(Path(p).name for p in loaded)}: {steps} steps")
        (err_console if as_json else console).print(f"wrote {plot}", highlight=False, markup=False)
    if as_json:
        print_json(result)
        return
    console.print(_parity_table(result))
    if spans is not None:
        console.print(_span_table(result))


def _span_table(parity: dict) -> Table:
    """`bench parity --spans`: one line per variant but the first of each layout, one column per span
    (`loss_parity.span_gaps`): the mean gap and on how many of the span's steps it lay above."""
    from disagmoe.bench.train import row_label

    read = [g for g in parity["groups"] if g.get("span_gaps")]
    table = Table(title=f"the gap to the first of each layout, span by span of {parity['spans']} steps (mean of "
                        "loss / the first's - 1 over the span's steps; in brackets, on how many it lay above)")
    table.add_column("row")
    spans = max((g["span_gaps"] for g in read), key=len, default=[])
    for sp in spans:
        table.add_column(f"{sp['first']}-{sp['last']}", justify="right")
    for g in read:
        table.add_row(row_label({**g, "seed": None}), *(f"{sp['gap']:+.2%} ({sp['above']}/{sp['last'] - sp['first'] + 1})"
                                                         for sp in g["span_gaps"]))
    return table


@bench_app.command("first-step")
@user_errors
def first_step(
    config: Annotated[Path, typer.Option("--config", "-c", help="a train config YAML (its model, data, batch, optim)")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. optim.warmup_steps=50")] = None,
    lrs: Annotated[list[float] | None, typer.Option(
        "--lr", help="a learning rate to try (repeatable; default: optim.lr over 1,000, 300, 100, 30, 10, 3 and 1, "
        "and the warm-up's first, optim.lr / optim.warmup_steps)")] = None,
    by_group: Annotated[bool, typer.Option(
        "--by-group", help="also step each parameter family alone (a projection, the experts' w13, the norms, ...) "
        "at --group-lr: which of them moves the loss")] = False,
    group_lr: Annotated[float | None, typer.Option(
        help="the learning rate of --by-group (default: the warm-up's first)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="also write the JSON record here")] = None,
) -> None:
    """Whether a config's first optimizer step lowers its loss: AdamW's first step moves every weight
    by about the learning rate whatever the gradient (its m / sqrt(v) is g / |g|), so at a wide
    model's fan-in a warm-up's first step can overshoot (the Qwen3 config's loss jumps at step 2 at
    hidden 2,048: docs/benchmarks.md, session 30). For each learning rate: the config's model at its
    initialisation (fp32 weights, on its device), the first batch's gradient, one AdamW step, and the
    loss on the second batch against its loss before the step; a line of advice on the warm-up.

    \b
    Example (on the CPU, a 16-expert slice of the Qwen3 config):
      disagmoe bench first-step -c configs/h200x2-qwen3-30b.yaml mode=single device=cpu experts_backend=loop \\
        model.num_experts=16 model.seq_len=512 seq_len=512 batch_size=4 micro_batches=1 --by-group"""
    from disagmoe.bench import first_step as bench
    from disagmoe.config import load_train_config

    cfg = load_train_config(config, overrides or [])
    log = (lambda m: err_console.print(m, highlight=False, markup=False)) if as_json else (
        lambda m: console.print(m, highlight=False, markup=False))
    record = bench.run(cfg, lrs, by_group, group_lr, log)
    record["command"] = {"config": str(config), "overrides": overrides or []}
    if out:
        out.write_text(json.dumps(record, indent=2) + "\n")
    if as_json:
        print_json(record)
        return
    before = record["before"]["loss"]
    table = Table(title=f"batch 2's loss after one AdamW step (before it: {before:.4f})")
    for col in ("learning rate", "loss", "change", ""):
        table.add_column(col, justify="right" if col != "" else "left")
    for r in record["rows"]:
        table.add_row(f"{r['lr']:.3g}", f"{r['loss']:.4f}", f"{r['change']:+.4f}",
                      "the warm-up's first" if r["warmup_first"] else "")
    console.print(table)
    if record["groups"]:
        groups = Table(title=f"each parameter family stepped alone at lr {record['group_lr']:.3g}")
        for col in ("family", "tensors", "parameters", "loss", "change"):
            groups.add_column(col, justify="left" if col == "family" else "right")
        for g in sorted(record["groups"], key=lambda g: g["change"]):
            groups.add_row(g["group"], str(g["tensors"]), f"{g['params']:,}", f"{g['loss']:.4f}", f"{g['change']:+.4f}")
        console.print(groups)
    console.print(record["advice"], markup=False)


@bench_app.command("profile")
@user_errors
def profile(
    config: Annotated[Path, typer.Option("--config", "-c", help="a train config YAML (trained as mode single)")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. routing=balanced")] = None,
    steps: Annotated[int, typer.Option(help="profiled steps", min=1)] = 3,
    warmup: Annotated[int, typer.Option(help="steps before profiling", min=0)] = 3,
    top: Annotated[int, typer.Option(help="kernels listed", min=1)] = 25,
    trace: Annotated[Path | None, typer.Option(help="also write the profiled steps as a Chrome trace")] = None,
    shapes: Annotated[bool, typer.Option(
        "--shapes", help="name each op with its inputs' dtypes, shapes and non-contiguous strides (record_shapes: "
        "which copy is which; adds host overhead, so the wall time reads high)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Profile single-GPU training steps: GPU kernels by total time, grouped into GEMM, attention,
    optimizer, copy/cast, elementwise and NCCL, how busy the GPU was (the union of its kernels'
    intervals / wall time), where it sat idle between kernels, by the pair around each gap, and named
    kernels (the expert row GEMMs and weight gradients; the FP8 token-group quantiser and weight copies
    and the AdamW update, memory-bound) against their roofline bound under the config's hardware (a
    calibrated preset, e.g. hardware=h200-sxm-calibrated, bounds them at the measured ceilings)."""
    from disagmoe.bench import profile_step as bench
    from disagmoe.bench.gpu_clocks import describe
    from disagmoe.config import load_train_config

    cfg = load_train_config(config, overrides or [])
    log = (lambda m: err_console.print(m, highlight=False, markup=False)) if as_json else (
        lambda m: console.print(m, highlight=False, markup=False))
    record = bench.run(cfg, steps, warmup, log, trace, top, shapes)
    if as_json:
        print_json(record)
        return
    console.print(f"{seconds(record['wall_s_per_step'])}/step, GPU busy {record['gpu_busy']:.0%} "
                  f"({record['kernel_ms_per_step']:.1f} ms of kernels); by category: "
                  + ", ".join(f"{c} {share:.0%}" for c, share in record["categories"].items()), markup=False)
    console.print(f"GPU clocks of the profiled steps: {describe(record.get('gpu_clocks'), record.get('gpu_clocks_note'))}",
                  markup=False)
    table = Table(title=f"top {top} kernels of {config}")
    for col in ("kernel", "category", "ms/step", "share"):
        table.add_column(col, justify="left" if col in ("kernel", "category") else "right")
    for k in record["kernels"]:
        table.add_row(k["name"][:80], k["category"], f"{k['ms_per_step']:.2f}", f"{k['share']:.1%}")
    console.print(table)
    ops = Table(title=f"top {top} ops by the GPU time of the kernels they launched")
    for col in ("op", "ms/step", "share"):
        ops.add_column(col, justify="left" if col == "op" else "right")
    for o in record["ops"]:
        ops.add_row(o["name"][:160 if shapes else 80], f"{o['ms_per_step']:.2f}", f"{o['share']:.1%}")
    console.print(ops)
    gaps = Table(title="where the GPU sat idle between kernels (by the kernels around the gap)")
    for col in ("before", "after", "gaps/step", "ms/step"):
        gaps.add_column(col, justify="left" if col in ("before", "after") else "right")
    for g in record["idle_gaps"]:
        gaps.add_row(g["before"][:60], g["after"][:60], f"{g['per_step']:.1f}", f"{g['ms_per_step']:.2f}")
    console.print(gaps)
    split = record["step_split_ms"]
    console.print("a step as bench train times it (between the trainer's syncs): "
                  + ", ".join(f"{part} {ms:.1f} ms" for part, ms in split.items() if part != "between steps")
                  + f"; and {split['between steps']:.1f} ms between steps (the loop's host work, untimed)",
                  markup=False)
    console.print(bounds_table(record["bounds"]))
    calls = Table(title="the host's CUDA calls inside the steps, by total time")
    for col in ("call", "calls/step", "ms/step"):
        calls.add_column(col, justify="left" if col == "call" else "right")
    for c in record["runtime_calls"]:
        calls.add_row(c["name"][:60], f"{c['calls']:.1f}", f"{c['ms_per_step']:.2f}")
    console.print(calls)


def bounds_table(rows: list[dict]) -> Table:
    """`bench profile`'s kernel families against their roofline bound (`bench.kernel_bounds`)."""
    hardware = next((r["hardware"] for r in rows if "hardware" in r), None)
    table = Table(title="kernels against their roofline bound, max(FLOPs / matmul ceiling, bytes / HBM)"
                  + (f" under {hardware}" if hardware else ""))
    for col in ("kernels", "ms/step", "bound ms", "binds", "TFLOP", "GB", "measured / bound"):
        table.add_column(col, justify="left" if col in ("kernels", "binds") else "right")
    for r in rows:
        if "note" in r:
            table.add_row(r["family"], f"{r['ms_per_step']:.2f}", "-", r["note"], "-", "-", "-")
        else:
            table.add_row(r["family"], f"{r['ms_per_step']:.2f}", f"{r['bound_ms_per_step']:.2f}", r["bound"],
                          f"{r['tflop']:.1f}", f"{r['gb']:.1f}", f"{r['ratio']:.2f}x")
    return table


@bench_app.command("quantise")
@user_errors
def quantise(
    shapes: ShapeOption = None,
    warmup: Annotated[int, typer.Option(help="untimed calls first", min=0)] = 3,
    iters: Annotated[int, typer.Option(help="timed calls (kernel time, their mean)", min=1)] = 10,
    epilogues: Annotated[bool, typer.Option(
        help="also time the kernels that quantise their own output (the bf16 gate/up GEMM's SwiGLU epilogue, the "
             "combine's backward) against the same kernel writing bf16 and the row quantiser's pass after it")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Time the FP8 quantisers a precision: fp8 step runs (the expert rows, the SwiGLU output, d h13,
    the weights' block copies, a dense projection's rowwise input; with fp8_expert_backward: fp8 the
    weight gradients' 128 x 1 token-group copies of x and act, and dy's and d h13's beside their 1 x 128
    rows from one pass) at one micro-batch of each shape, its rows grouped by the shape's routing,
    without and with their Fp8Stats counters (bytes read + written over kernel time, as GB/s and as a
    share of the HBM copy rate measured in the same run, each way: they are HBM-bound passes, so how far
    from it each runs, and what the counters cost).

    \b
    Example: disagmoe bench quantise --shape mixtral-8x7b --shape qwen3-30b-a3b --epilogues"""
    from disagmoe.bench import quantise as bench

    names = _shape_names(shapes or ["mixtral-8x7b", "qwen3-30b-a3b"])
    log = (lambda m: err_console.print(m, highlight=False, markup=False)) if as_json else (
        lambda m: console.print(m, highlight=False, markup=False))
    record = bench.run(names, warmup, iters, log, epilogues=epilogues)
    if as_json:
        print_json(record)
        return
    table = Table(title=f"FP8 quantisers, kernel time (HBM copy in the same run: {record['copy_gbps']:,.0f} GB/s)")
    for col in ("shape", "quantiser", "input", "ms", "GB/s", "of copy", "ms with counters", "counters' cost",
                "of copy with counters"):
        table.add_column(col, justify="left" if col in ("shape", "quantiser", "input") else "right")
    for r in record["rows"]:
        table.add_row(r["shape"], r["quantiser"], " x ".join(map(str, r["input"])), f"{r['ms']:.3f}",
                      f"{r['gbps']:,.0f}", f"{r['of_copy_rate']:.0%}", f"{r['ms_with_counters']:.3f}",
                      f"{r['counters_cost']:.2f}x", f"{r['of_copy_rate_with_counters']:.0%}")
    console.print(table)
    if record["epilogues"]:
        fused = Table(title="Quantising epilogues: the kernel alone, quantising its output itself, and then the row "
                            "quantiser's pass (kernel ms; fused / separate below 1: the epilogue is the faster)")
        for col in ("shape", "quantised", "kernel alone", "fused", "kernel + pass", "fused / separate"):
            fused.add_column(col, justify="left" if col in ("shape", "quantised") else "right")
        for r in record["epilogues"]:
            fused.add_row(r["shape"], r["epilogue"], f"{r['plain_ms']:.3f}", f"{r['fused_ms']:.3f}",
                          f"{r['separate_ms']:.3f}", f"{r['fused_over_separate']:.2f}x")
        console.print(fused)


@bench_app.command("loss")
@user_errors
def loss(
    config: Annotated[Path, typer.Option("--config", "-c", help="a train config YAML: its model's hidden size and "
                                         "vocabulary, a micro-batch's tokens")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. micro_batches=2")] = None,
    vocab: Annotated[list[int] | None, typer.Option(
        help="also time this vocabulary at the same tokens and hidden size (repeatable), e.g. a published "
             "model's 151936", min=1)] = None,
    warmup: Annotated[int, typer.Option(help="untimed calls first", min=0)] = 2,
    iters: Annotated[int, typer.Option(help="timed calls (kernel time, their mean)", min=1)] = 5,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """Time the LM head's chunked cross-entropy, forward and backward, with the fused softmax kernel
    (kernels.cross_entropy, a GPU step's default) against torch's ops in the same run: the whole head and
    one chunk's softmax alone (GB/s against the HBM copy rate), and how far the two losses differ.

    \b
    Example: disagmoe bench loss -c configs/h200x2-qwen3-30b.yaml micro_batches=2 --vocab 151936"""
    from disagmoe.bench import loss as bench
    from disagmoe.config import load_train_config
    from disagmoe.model_ref import load_model

    cfg = load_train_config(config, overrides)
    if cfg.micro_batches == "auto":
        raise typer.BadParameter("micro_batches: auto is chosen by a run; give the split to time, e.g. "
                                 "micro_batches=2")
    model = load_model(cfg.model)
    tokens = cfg.batch_size // cfg.micro_batches * cfg.seq_len
    log = (lambda m: err_console.print(m, highlight=False, markup=False)) if as_json else (
        lambda m: console.print(m, highlight=False, markup=False))
    record = bench.run(tokens, model.hidden_size, [model.vocab_size, *(vocab or [])], warmup, iters, log)
    if as_json:
        print_json(record)
        return
    table = Table(title=f"LM head + cross-entropy, {tokens:,} tokens x hidden {model.hidden_size}, bf16, kernel ms "
                        f"(HBM copy in the same run: {record['copy_gbps']:,.0f} GB/s)")
    for col in ("vocab", "chunk torch / fused", "head torch", "head fused", "speedup", "softmax torch", "softmax fused",
                "speedup",
                "fused of copy", "loss rel diff"):
        table.add_column(col, justify="right")
    for r in record["rows"]:
        table.add_row(f"{r['vocab']:,}", f"{r['chunk']:,} / {r['fused_chunk']:,}", f"{r['head_torch_ms']:.3f}", f"{r['head_fused_ms']:.3f}",
                      f"{r['head_speedup']:.2f}x", f"{r['softmax_torch_ms']:.3f}", f"{r['softmax_fused_ms']:.3f}",
                      f"{r['softmax_speedup']:.2f}x", f"{r['softmax_fused_of_copy']:.0%}", f"{r['loss_rel_diff']:.1e}")
    console.print(table)


@bench_app.command("placement")
@user_errors
def placement(
    config: Annotated[Path, typer.Option("--config", "-c", help="a train config YAML (its model, hardware, batch)")],
    overrides: Annotated[list[str] | None, typer.Argument(help="key=value overrides, e.g. batch_size=64")] = None,
    gpus: Annotated[int | None, typer.Option(
        help="devices to place on [default: this host's GPUs with device=cuda, else attention + expert ranks]",
        min=2)] = None,
    micro_batches: Annotated[list[int] | None, typer.Option(
        "--micro-batches", "-m", help="micro-batch counts to try (repeatable; default: 2 and 4)", min=1)] = None,
    steps: Annotated[int, typer.Option(help="steps per layout", min=2)] = 12,
    warmup: Annotated[int, typer.Option(help="first steps left out of the median", min=0)] = 4,
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
    out: Annotated[Path | None, typer.Option("--out", "-o", help="also write the JSON record here")] = None,
) -> None:
    """Check the planner against measured training: price every layout of one config on N devices
    (each attention/expert split and colocated, for each micro-batch count), train each for a few
    steps, and report predicted vs measured step times, both rankings and the planner's pick
    against the best measured layout.

    \b
    Example: disagmoe bench placement --config configs/h200x2-small.yaml --gpus 2 -m 2 -m 4
    """
    import torch

    from disagmoe.bench import placement as bench
    from disagmoe.config import load_train_config

    cfg = load_train_config(config, overrides or [])
    if gpus is None:
        gpus = (torch.cuda.device_count() if cfg.device == "cuda" else cfg.attention_ranks + cfg.expert_ranks)
    log = (lambda m: err_console.print(m, highlight=False)) if as_json else console.print
    record = bench.run(cfg, gpus, micro_batches or [2, 4], steps, warmup, log)
    if out is not None:
        out.write_text(json.dumps(record, indent=2) + "\n")
    if as_json:
        print_json(record)
        return
    c, s = record["config"], record["summary"]
    table = Table(title=f"{c['model']} on {gpus} x {c['hardware']} ({c['device']}, {c['transport']}): planner vs "
                        f"measured, median of steps {warmup + 1}-{steps}")
    for col in ("layout", "predicted", "measured", "error", "rank pred/meas", "busy"):
        table.add_column(col, justify="left" if col in ("layout", "busy") else "right")
    for r in record["layouts"]:
        predicted = seconds(r['predicted_step_s']) + ("" if r["fits"] else " (no fit)")
        if "measured_step_s" not in r:
            table.add_row(r["layout"], predicted, f"failed: {r['error']}", "", "", "")
            continue
        busy = " ".join(f"{g} {f:.0%}" for g, f in r["busy"].items()) or "-"
        table.add_row(r["layout"], predicted, seconds(r['measured_step_s']), f"{r['prediction_error']:+.0%}",
                      f"{r['predicted_rank']}/{r['measured_rank']}", busy)
    console.print(table)
    if s["layouts_run"]:
        correlation = "-" if s["rank_correlation"] is None else f"{s['rank_correlation']:.2f}"
        if s["planner_pick"] is None:
            pick = "none (no layout it prices fits)"
        elif not s["planner_pick_ran"]:
            pick = f"{s['planner_pick']}, which failed to run (best measured: {s['best_measured']})"
        else:
            pick = f"{s['planner_pick']}, {s['pick_vs_best']:+.1%} against the best measured ({s['best_measured']})"
        console.print(f"planner's pick: {pick}; rank correlation {correlation}; mean |prediction error| "
                      f"{s['mean_abs_prediction_error']:.0%}")
