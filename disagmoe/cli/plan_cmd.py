"""`disagmoe plan` and `disagmoe roofline`: where each layer runs, and why."""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import Annotated, Literal, Optional

import typer
from rich.markup import escape
from rich.panel import Panel
from rich.table import Table

from disagmoe import compact
from disagmoe.bench.probe import stale_note
from disagmoe.cli.common import auto_split, console, literal, print_json, user_errors
from disagmoe.config import (FP8_DENSE_SCALING, RUN_FP8_EXPERT_FORWARD, ClusterConfig, HardwareConfig, Plan,
                             PlanConfig, load_hardware, write_text_file)
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import Candidates
from disagmoe.placement.experts import read_histogram
from disagmoe.placement.solver import Choice, choose, fp8_note, price, roofline_rows
from disagmoe.roofline import report
from disagmoe.roofline.params import params_text
from disagmoe.runtime.failures import RunWarning

ModelOpt = Annotated[str, typer.Option("--model", "-m", help="model preset (see `disagmoe presets`), "
                                       "a model YAML, or a Hugging Face config.json")]
HardwareOpt = Annotated[str, typer.Option("--hardware", "-hw", help="hardware preset or YAML file")]
GpusOpt = Annotated[int, typer.Option("--gpus", "-n", help="GPUs in the job", min=1)]
SeqOpt = Annotated[Optional[int], typer.Option("--seq-len", help="sequence length [default: the model's]", min=1)]
BatchOpt = Annotated[int, typer.Option("--global-batch-tokens", help="tokens per optimizer step", min=1)]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON only (for machines)")]
HistOpt = Annotated[Optional[Path], typer.Option(
    "--load-histogram", help="metrics.jsonl of a previous `disagmoe train`: place experts by their load")]


ShardOpt = Annotated[bool, typer.Option(
    "--shard-optimizer-states", help="the attention side's AdamW moments split over each data-parallel group "
    "(ZeRO-1; train with optim.shard_states=true)")]
StateDtypeOpt = Annotated[Literal["fp32", "bf16"], typer.Option(
    "--optimizer-state-dtype", help="the dtype of AdamW's two moments: fp32 (8 bytes per parameter) or bf16 (4; "
    "train with optim.state_dtype=bf16)")]
UpdateKernelOpt = Annotated[Literal["torch", "triton"], typer.Option(
    "--optimizer-update-kernel", help="what runs AdamW's update, priced by its passes: triton (one pass over "
    "master, gradient and moments that writes the bf16 parameters too) or torch (its fused AdamW, then a pass for "
    "the parameters; with bf16 moments through fp32 copies of them); train with optim.update_kernel set the same")]
PrecisionOpt = Annotated[Literal["bf16", "fp8"], typer.Option(
    "--expert-precision", help="the routed experts' GEMMs: bf16, or fp8 priced at the FP8 expert curve a calibrated "
    "hardware file measured (`bench calibrate` on an sm_89+ GPU with the triton experts), else at the hardware's "
    "fp8_tflops (the datasheet ratio, unmeasured) with the quantisation passes' traffic; the FP8 weight copies' memory "
    "either way (the plan records it and a note says which rate; train --plan sets precision: fp8)")]
Fp8DenseOpt = Annotated[Optional[bool], typer.Option(
    "--fp8-dense/--no-fp8-dense", help="with --expert-precision fp8: price the dense projections (attention, shared "
    "experts, dense FFN layers) in FP8 too (as precision: fp8 trains them by default), or in bf16 (train with "
    "fp8_dense: false); neither flag: FP8 (a plan request's fp8_dense: auto prices both ways and keeps the faster); "
    "the plan records it and train --plan sets it", show_default=False)]
Fp8DenseScalingOpt = Annotated[Literal["blockwise", "rowwise"], typer.Option(
    "--fp8-dense-scaling", help="with the dense projections in FP8: the recipe to price them as (train with the same "
    "fp8_dense_scaling): blockwise (the default, as precision: fp8 trains on a Hopper GPU: 1 x 128 activation "
    "groups, 128 x 128 weight blocks, a linear off the 512 grid such as MLA's kv_a in bf16) or rowwise (one scale "
    "per token or feature: what a run off Hopper asks for). A calibrated hardware file's measured FP8 projection "
    "curve prices only the recipe it measured (probe version 7: rowwise; 8: blockwise on Hopper), the other at "
    "the datasheet ratio: the plan's note says which; the plan records it and train --plan sets it")]
Fp8BackwardOpt = Annotated[Literal["fp8", "bf16-wgrad", "bf16"], typer.Option(
    "--fp8-expert-backward", help="with --expert-precision fp8: which of the experts' backward GEMMs to price in FP8: "
    "bf16-wgrad (the default, as precision: fp8 trains: the data gradients FP8, the weight gradients bf16), fp8 "
    "(both) or bf16 (the forward alone); train with the same fp8_expert_backward")]
Fp8ForwardOpt = Annotated[Literal["both", "gate-up", "down"], typer.Option(
    "--fp8-expert-forward", help="with --expert-precision fp8: which of the experts' two forward GEMMs to price in "
    "FP8: down (the default, as precision: fp8 trains), gate-up or both (the other at the bf16 rate); train with the "
    "same fp8_expert_forward")]
OffloadOpt = Annotated[Literal["auto", "on", "off"], typer.Option(
    "--offload-optimizer", help="the fp32 masters and AdamW moments in host memory: on (two staging buckets on "
    "each GPU instead, their copies in and out each step over the hardware's host_link_gbps, within its "
    "host_memory_gib per GPU; train with offload_optimizer: true), off, or auto (every layout priced both ways, "
    "the faster plan that fits kept, a note says why); the bare flag still means on; the plan records it and "
    "train --plan sets it")]
CudaGraphsOpt = Annotated[Literal["auto", "on", "off"], typer.Option(
    "--cuda-graphs", help="the run's cuda_graphs (train with the same): a distributed layout whose rank steps it "
    "captures (one attention GPU per pipeline group, no replicated experts; auto only once a GPU test checked them) "
    "has its nvshmem receive rings priced rounded up to a step's messages; on plans only such layouts, which train "
    "then captures; the plan says whether its rank steps are captured (rank_steps_captured)")]
WgradPairsOpt = Annotated[Literal["auto", "on", "off"], typer.Option(
    "--expert-wgrad-pairs", help="the run's expert_wgrad_pairs (train with the same): the one-GPU layout with 2+ "
    "micro-batches and the triton experts priced with each expert weight gradient once per two micro-batches "
    "(half the fp32 main-gradient passes) and one micro-batch's expert rows per MoE layer held beside the next; "
    "auto (the default): on for each split whose predicted peak with those rows is within 85% of the GPU, as the "
    "trainer settles it, else off (the plan says which); off: a weight-gradient pass per micro-batch")]
FusedLossOpt = Annotated[bool, typer.Option(
    "--fused-loss/--no-fused-loss", help="the run's fused_loss (train with the same): the LM head's loss priced as "
    "the fused kernel runs it on a GPU (about 12 bytes of HBM traffic a logit, each chunk's logits held once in "
    "bf16; the default) or as torch's ops (about 50, beside an fp32 copy); the plan records it and train --plan "
    "sets it")]
RecomputeOpt = Annotated[Literal["none", "selective", "full", "auto"], typer.Option(
    "--recompute", help="activation recomputation to price: none, selective (the expert FFN's input, output and "
    "SwiGLU rows recomputed in the backward: leaner expert GPUs, a little more HBM traffic; train with "
    "experts_backend: triton), full (every block keeps its input and routing and runs again in the backward: "
    "the least memory, about one more forward of every block) or auto (per layout the least that fits: the expert "
    "modules, and the attention block where only that lets the attention side fit, its q/k/v projections "
    "once more per layer (the attention core's output is kept); chosen only where a faster layout fits only so; never full); the plan records it and its "
    "modules, and train --plan sets them")]


def build_request(model: str, hardware: str, gpus: int, seq_len: int | None, global_batch_tokens: int,
                  load_histogram: Path | None = None, max_pipeline_groups: int = 8,
                  max_expert_replicas: int = 0, shard_optimizer_states: bool = False,
                  optimizer_state_dtype: str = "fp32", recompute: str = "auto",
                  expert_precision: str = "bf16", offload_optimizer: str = "off",
                  optimizer_update_kernel: str = "triton", fp8_dense: bool | None = None,
                  fp8_expert_backward: str = "bf16-wgrad", fp8_expert_forward: str = RUN_FP8_EXPERT_FORWARD,
                  cuda_graphs: str = "auto", fp8_dense_scaling: str = FP8_DENSE_SCALING,
                  expert_wgrad_pairs: str = "auto", fused_loss: bool = True) -> PlanConfig:
    mcfg = load_model(model)
    hist = read_histogram(load_histogram, mcfg.num_moe_layers, mcfg.num_experts) if load_histogram else None
    return PlanConfig(model=mcfg, cluster=ClusterConfig(hardware=checked_hardware(hardware), num_gpus=gpus),
                      seq_len=seq_len or mcfg.seq_len, global_batch_tokens=global_batch_tokens,
                      load_histogram=hist, max_pipeline_groups=max_pipeline_groups,
                      max_expert_replicas=max_expert_replicas, shard_optimizer_states=shard_optimizer_states,
                      optimizer_state_dtype=optimizer_state_dtype, recompute=recompute,
                      expert_precision=expert_precision, offload_optimizer=offload_optimizer,
                      optimizer_update_kernel=optimizer_update_kernel,
                      fp8_dense="on" if fp8_dense is None else fp8_dense,  # unset: as precision fp8 trains
                      fp8_dense_scaling=fp8_dense_scaling,
                      fp8_expert_backward=fp8_expert_backward, fp8_expert_forward=fp8_expert_forward,
                      cuda_graphs=cuda_graphs, expert_wgrad_pairs=expert_wgrad_pairs, fused_loss=fused_loss)


def checked_hardware(ref: str) -> HardwareConfig:
    """The hardware preset or YAML `ref`, with a warning line if its calibration was measured by
    another version of `bench calibrate`'s probe (`bench.probe.stale_note`)."""
    hw = load_hardware(ref)
    note = stale_note(hw, ref)
    if note:
        warnings.warn(note, RunWarning, stacklevel=2)
    return hw


RUN_FIELDS = {  # plan's flags that a train config sets under --config: flag -> the config's key
    "model": "model", "seq_len": "seq_len", "global_batch_tokens": "batch_size (tokens = batch_size x seq_len)",
    "shard_optimizer_states": "optim.shard_states", "optimizer_state_dtype": "optim.state_dtype",
    "optimizer_update_kernel": "optim.update_kernel", "expert_precision": "precision", "fp8_dense": "fp8_dense",
    "fp8_dense_scaling": "fp8_dense_scaling", "fp8_expert_backward": "fp8_expert_backward",
    "fp8_expert_forward": "fp8_expert_forward", "cuda_graphs": "cuda_graphs", "expert_wgrad_pairs": "expert_wgrad_pairs",
    "fused_loss": "fused_loss"}
PlanConfigOpt = Annotated[Optional[Path], typer.Option(
    "--config", "-c", help="a train config: plan for its run (its model, seq_len, batch_size x seq_len tokens a step, "
    "optimizer, precision, experts backend and cuda_graphs, priced as it trains), on --gpus GPUs (default: its "
    "layout's) of --hardware (default: its hardware); then `train -c CONFIG --plan PLAN`")]
PlanOverridesArg = Annotated[Optional[list[str]], typer.Argument(
    help="key=value overrides of --config, as `train` takes them (e.g. optim.state_dtype=bf16 precision=fp8)")]


@user_errors
def plan(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="model preset (see `disagmoe presets`), a "
                                                 "model YAML, or a Hugging Face config.json (or --config)")] = None,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-hw", help="hardware preset or YAML file "
                                                    "(with --config: default the config's)")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", "-n", help="GPUs in the job (with --config: default "
                                                "its layout's)", min=1)] = None,
    seq_len: SeqOpt = None,
    global_batch_tokens: BatchOpt = 4 * 1024 * 1024,
    load_histogram: HistOpt = None,
    max_pipeline_groups: Annotated[int, typer.Option(help="largest p to consider", min=1)] = 8,
    max_expert_replicas: Annotated[int, typer.Option(help="extra replicas per hot expert", min=0)] = 0,
    shard_optimizer_states: ShardOpt = False,
    optimizer_state_dtype: StateDtypeOpt = "fp32",
    optimizer_update_kernel: UpdateKernelOpt = "triton",
    recompute: RecomputeOpt = "auto",
    expert_precision: PrecisionOpt = "bf16",
    fp8_dense: Fp8DenseOpt = None,
    fp8_dense_scaling: Fp8DenseScalingOpt = FP8_DENSE_SCALING,
    fp8_expert_backward: Fp8BackwardOpt = "bf16-wgrad",
    fp8_expert_forward: Fp8ForwardOpt = RUN_FP8_EXPERT_FORWARD,
    offload_optimizer: OffloadOpt = "off",
    cuda_graphs: CudaGraphsOpt = "auto",
    expert_wgrad_pairs: WgradPairsOpt = "auto",
    fused_loss: FusedLossOpt = True,
    as_json: JsonOpt = False,
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="write the plan (.yaml or .json)")] = None,
    config: PlanConfigOpt = None,
    overrides: PlanOverridesArg = None,
) -> None:
    """Choose a placement: attention GPUs vs expert GPUs, pipeline groups, micro-batches, expert map.

    \b
    The solver prices every split with the roofline model (compute, HBM, NVLink, scale-out),
    a ring-pipeline model for micro-batches in flight, and a memory check (weights, grads, AdamW
    state, activations), and compares against the colocated expert-parallel layout on the same GPUs.
    Example: disagmoe plan --model deepseek-v3 --hardware gb200-nvl72 --gpus 1152
    With --config CONFIG it plans for that run (key=value overrides change it as `train` would);
    the flags the config sets are refused beside it (set them in the config or as overrides).
    Example: disagmoe plan -c configs/h200x2-qwen3-30b.yaml --gpus 16 --out plan.yaml
    """
    if config is not None:
        req = config_request(config, overrides or [], _given(ctx, RUN_FIELDS), hardware, gpus, load_histogram,
                             max_pipeline_groups, max_expert_replicas,
                             recompute if _given(ctx, ["recompute"]) else None,
                             offload_optimizer if _given(ctx, ["offload_optimizer"]) else None)
    else:
        if overrides:
            raise typer.BadParameter(f"key=value overrides ({' '.join(overrides)}) apply to a --config: give "
                                     "--config CONFIG with them")
        missing = [flag for flag, v in (("--model", model), ("--hardware", hardware), ("--gpus", gpus)) if v is None]
        if missing:
            raise typer.BadParameter(f"plan needs {', '.join(missing)} (or --config CONFIG: plan for a train "
                                     "config's run)")
        req = build_request(model, hardware, gpus, seq_len, global_batch_tokens, load_histogram,
                            max_pipeline_groups, max_expert_replicas, shard_optimizer_states, optimizer_state_dtype,
                            recompute, expert_precision, offload_optimizer, optimizer_update_kernel, fp8_dense,
                            fp8_expert_backward, fp8_expert_forward, cuda_graphs, fp8_dense_scaling,
                            expert_wgrad_pairs, fused_loss)
    result = choose(req).plan
    if load_histogram is not None:
        result.notes.insert(0, histogram_note(load_histogram, req.load_histogram, result))
    if out:
        write_plan(result, out)
    if as_json:
        print_json(result.model_dump(mode="json"))
    else:
        show_plan(result, out)
    if not result.feasible:
        raise typer.Exit(1)


def _given(ctx: typer.Context, names) -> list[str]:
    """The parameters among `names` given on the command line (or the environment), not defaulted
    (by the source's name: typer carries its own copy of click's `ParameterSource`)."""
    sources = {name: ctx.get_parameter_source(name) for name in names}
    return [name for name, source in sources.items()
            if source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")]


def config_request(config: Path, overrides: list[str], given: list[str], hardware: str | None, gpus: int | None,
                   load_histogram: Path | None, max_pipeline_groups: int, max_expert_replicas: int,
                   recompute: str | None, offload_optimizer: str | None) -> PlanConfig:
    """`plan --config CONFIG [key=value ...]`: the request for that run, priced as it trains
    (`config.priced_as_trained`), on `gpus` (default: its layout's, `trace_compare.layout_gpus`) of
    `hardware` (default: its own), its recomputation and offload as the config sets them unless
    `recompute` / `offload_optimizer` (the flags, given: e.g. auto, the planner's choice per layout).
    `given`: the flags the config sets that the command line gave too (refused: say where they go)."""
    from disagmoe.config import load_train_config, priced_as_trained
    from disagmoe.placement.trace_compare import layout_gpus

    if given:
        where = "; ".join(f"--{name.replace('_', '-')}: {RUN_FIELDS[name]}" for name in given)
        raise typer.BadParameter(f"with --config the run's config sets these ({where}); set them in {config} or "
                                 "as key=value overrides after it")
    cfg = load_train_config(config, overrides)
    hw = _run_hardware(cfg, config, hardware)
    mcfg = load_model(cfg.model)
    hist = read_histogram(load_histogram, mcfg.num_moe_layers, mcfg.num_experts) if load_histogram else None
    run = priced_as_trained(cfg)
    if recompute is not None:
        run["recompute"] = recompute
    offload = offload_optimizer or ("on" if cfg.offloads_to_host else "off")
    return PlanConfig(model=mcfg, cluster=ClusterConfig(hardware=hw, num_gpus=gpus or layout_gpus(cfg)),
                      seq_len=cfg.seq_len, global_batch_tokens=cfg.batch_size * cfg.seq_len, load_histogram=hist,
                      max_pipeline_groups=max_pipeline_groups, max_expert_replicas=max_expert_replicas,
                      offload_optimizer=offload, **run)


def histogram_note(path: Path, loads: list[list[float]], p: Plan) -> str:
    """One line saying the histogram was read, how skewed it is, and what it moved."""
    peaks = [max(row) * len(row) / sum(row) if sum(row) else 1.0 for row in loads]
    j = max(range(len(peaks)), key=peaks.__getitem__)
    head = f"expert loads read from {path}: the hottest expert carries {peaks[j]:.2f}x the mean load (MoE layer {j})"
    if p.layout != "disaggregated":
        return head + f"; a {p.layout} layout holds experts in fixed blocks, so the loads only price its imbalance"
    return head + (f"; experts placed by that load (expected imbalance over the expert GPUs of a set "
                   f"{p.expert_imbalance:.3f})")


def write_plan(result: Plan, out: Path) -> None:
    """The plan as `out`'s suffix says, compactly (`disagmoe.compact`: an expert_map row per MoE
    layer, a stage per line); `load_plan` reads it as it reads the block style of older files."""
    data = result.model_dump(mode="json")
    if out.suffix == ".json":
        text = compact.to_json(data)
    elif out.suffix in (".yaml", ".yml"):
        text = compact.to_yaml(data)
    else:
        raise ValueError(f"--out {out}: use a .yaml or .json file name")
    with contextlib.suppress(OSError):  # a name the file system refuses: write_text_file says so
        if out.is_dir():
            raise ValueError(f"--out {out} is a directory; give a file name, e.g. {out / 'plan.yaml'}")
    write_text_file(out, text)


def show_plan(p, out: Path | None) -> None:
    head = f"{p.model} on {p.gpus} x {p.hardware}, seq {p.seq_len}, {p.global_batch_tokens:,} tokens/step"
    if not p.feasible and not p.memory_per_gpu:
        console.print(Panel(p.reason, title=f"[red]no plan[/]: {head}", title_align="left"))
        for n in p.notes:
            console.print(f"  note: {n}", markup=False, highlight=False)
        return
    if p.layout == "disaggregated":
        layout = (f"[bold]disaggregated[/]: {p.attention_gpus} attention GPUs + {p.expert_gpus} expert GPUs "
                  f"({p.expert_replica_sets} expert replica set(s) per group)")
    elif p.layout == "single":
        layout = "[bold]single[/]: one GPU runs attention and every expert, no transfers"
    else:
        layout = f"[bold]colocated[/]: {p.expert_gpus} GPUs, each attention + experts"
    if p.idle_gpus:
        layout += f"; {p.idle_gpus} of {p.gpus} GPUs idle"
    lines = [
        layout,
        f"pipeline groups p={p.pipeline_groups}, micro-batches m={p.micro_batches} of "
        f"{p.sequences_per_micro_batch} sequences, {p.accumulation_rounds} round(s) per step" + _rounds_text(p),
        f"predicted step {report.seconds(p.step_time_s)}, {p.tflops_per_gpu:.0f} TFLOP/s per GPU (MFU {p.mfu:.1%}); "
        f"colocated baseline {_baseline(p)}",
        f"params {params_text(p.total_params)} total, {params_text(p.active_params)} active; "
        f"expert load imbalance {p.expert_imbalance:.2f}",
        *_rank_steps_line(p),
        *_wgrad_pairs_line(p),
        f"[italic]{p.reason}[/]",
    ]
    console.print(Panel("\n".join(lines), title=head, title_align="left"))
    mem = Table(title="memory per GPU", title_justify="left")
    for col in ("GPU", "weights", "grads", "optimizer", "activations", "transport", "total", "capacity"):
        mem.add_column(col, justify="left" if col == "GPU" else "right")
    for kind, e in p.memory_per_gpu.items():
        over = "[red]" if e.total_gib > e.capacity_gib else ""
        mem.add_row(kind, *(report.memory(g) for g in (e.weights_gib, e.grads_gib, e.optimizer_gib, e.activations_gib,
                                                       e.transport_gib)),
                    f"{over}{report.memory(e.total_gib)}", report.memory(e.capacity_gib))
    console.print(mem)
    st = Table(title="stage time per step, on the GPUs that run it", title_justify="left")
    for col in ("stage", "group", "time", "bound"):
        st.add_column(col, justify="right" if col == "time" else "left")
    for s in sorted(p.stage_times, key=lambda s: -s.time_s):
        st.add_row(s.name, s.group, report.seconds(s.time_s), s.bound)
    console.print(st)
    for n in p.notes:
        console.print(f"note: {n}", markup=False, highlight=False)
    if out:
        console.print(f"plan written to {out}", markup=False, highlight=False)


def _rank_steps_line(p: Plan) -> list[str]:
    """A distributed layout's line: whether its rank steps are captured, and why (none for one GPU)."""
    if p.rank_steps_captured is None:
        return []
    return [f"rank steps {'captured' if p.rank_steps_captured else 'eager'}: {escape(p.rank_steps_note)}"]


def _wgrad_pairs_line(p: Plan) -> list[str]:
    """How the plan priced each GPU holding experts' weight gradients (`Plan.expert_wgrad_pairs`; none in a plan
    written before it was recorded)."""
    if p.expert_wgrad_pairs is None:
        return []
    gpus = {"disaggregated": "each expert GPU", "colocated": "each GPU", "single": "the GPU"}[p.layout]
    how = ("over pairs of micro-batches" if p.expert_wgrad_pairs == "on" else "once per micro-batch")
    return [f"expert weight gradients priced {how} on {gpus} (expert_wgrad_pairs: {p.expert_wgrad_pairs})"]


def _rounds_text(p: Plan) -> str:
    """How `train --plan` runs a plan's rounds (`runtime.plan_layout`); '' for one round."""
    m, r = p.micro_batches, p.accumulation_rounds
    if r <= 1:
        return ""
    if p.layout == "single":
        return f" (train --plan: micro_batches={m * r}, one accumulation)"
    return f" (train --plan runs one round per step: batch_size={m * p.sequences_per_micro_batch})"


def _baseline(p: Plan) -> str:
    """The colocated baseline as the plan knows it: its time, or why there is none."""
    if p.colocated_step_time_s is not None:
        return f"{report.seconds(p.colocated_step_time_s)} -> speedup {p.speedup_vs_colocated:.2f}x"
    if p.layout == "single":
        return "n/a (one GPU)"
    if p.layout == "colocated":
        return "is this layout (a fixed one)"
    if any("baseline does not fit" in n for n in p.notes):
        return "does not fit"
    return "not priced (a fixed layout)"


@user_errors
def roofline(
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="model preset (see `disagmoe presets`), "
                                                 "a model YAML, or a Hugging Face config.json")] = None,
    hardware: Annotated[Optional[str], typer.Option("--hardware", "-hw", help="hardware preset or YAML file "
                                                    "(with --compare: default the run config's)")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", "-n", help="GPUs in the job", min=1)] = None,
    seq_len: SeqOpt = None,
    global_batch_tokens: BatchOpt = 4 * 1024 * 1024,
    layout: Annotated[str, typer.Option(help="auto (the planner's choice), disaggregated or colocated; with "
                                        "--config alone: single, disaggregated or colocated (default: the "
                                        "config's mode)")] = "auto",
    attention_gpus: Annotated[Optional[int], typer.Option(help="fix the attention GPU count (disaggregated)", min=1)] = None,
    pipeline_groups: Annotated[int, typer.Option("--pipeline-groups", "-p", help="with a fixed layout", min=1)] = 1,
    micro_batches: Annotated[int, typer.Option("--micro-batches", help="with a fixed layout", min=1)] = 4,
    sequences_per_gpu: Annotated[int, typer.Option(help="sequences per attention GPU per micro-batch", min=1)] = 1,
    replica_sets: Annotated[int, typer.Option(help="expert replica sets per group (disaggregated)", min=1)] = 1,
    shard_optimizer_states: ShardOpt = False,
    optimizer_state_dtype: StateDtypeOpt = "fp32",
    optimizer_update_kernel: UpdateKernelOpt = "triton",
    offload_optimizer: OffloadOpt = "off",
    as_json: JsonOpt = False,
    plot_path: Annotated[Optional[Path], typer.Option("--plot", help="write a log-log roofline PNG")] = None,
    compare_trace: Annotated[Optional[Path], typer.Option(
        "--compare", help="a run's trace.json (`disagmoe train` with trace: true): predicted vs measured per "
        "schedule-op kind; needs --config")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config", "-c", help="a train config: price its run's own layout (model, mode, ranks, micro-batches, "
        "batch); with --compare, the config the trace came from")] = None,
    overrides: Annotated[Optional[list[str]], typer.Argument(
        help="key=value overrides of --config, as `train` and `bench train` take them (e.g. precision=fp8 "
             "micro_batches=2)")] = None,
) -> None:
    """Per-stage roofline of one layer and of a whole step: FLOPs, bytes per memory and link,
    arithmetic intensity, time under each ceiling and the one that binds.

    \b
    By default it reports the layout `disagmoe plan` would choose; --layout with --attention-gpus,
    -p, --micro-batches, --sequences-per-gpu and --replica-sets fixes one instead.
    Example: disagmoe roofline --model qwen3-235b-a22b --hardware h200-sxm --gpus 8 --plot roof.png
    With --compare TRACE --config CONFIG it prices the run's own layout and sets each op kind's
    predicted time beside the trace's (compute spans; messages from post to receipt), with the error.
    Example: disagmoe roofline --compare runs/tiny-cpu/trace.json -c configs/tiny-cpu.yaml -hw h200-sxm
    With --config CONFIG alone it prices that run's layout (--layout picks another mode for it).
    Example: disagmoe roofline -c configs/h200x2-qwen3-30b.yaml --layout single -hw h200-sxm-calibrated
    key=value overrides change that config as `train` would (e.g. precision=fp8 micro_batches=2).
    """
    if overrides and (config is None or compare_trace is not None):
        raise typer.BadParameter("key=value overrides apply to --config alone (not --compare): give --config CFG "
                                 "with them")
    if compare_trace is not None:
        _compare(compare_trace, config, hardware, as_json, plot_path)
        return
    if config is not None:
        choice = _config_choice(config, hardware, layout, overrides or [])
    else:
        missing = [flag for flag, v in (("--model", model), ("--hardware", hardware), ("--gpus", gpus)) if v is None]
        if missing:
            raise ValueError(f"roofline needs {', '.join(missing)} (or --config CONFIG for a run's own layout, "
                             "--compare TRACE --config CONFIG for a run's trace)")
        req = build_request(model, hardware, gpus, seq_len, global_batch_tokens,
                            shard_optimizer_states=shard_optimizer_states,
                            optimizer_state_dtype=optimizer_state_dtype, offload_optimizer=offload_optimizer,
                            optimizer_update_kernel=optimizer_update_kernel)
        choice = _layout_choice(req, layout, attention_gpus, pipeline_groups, micro_batches,
                                sequences_per_gpu, replica_sets)
    if choice.cost is None:
        raise ValueError(choice.plan.reason)
    rows_layer, rows_step = roofline_rows(choice.cost, choice.problem, choice.candidate)
    title = f"{choice.plan.model} on {choice.plan.gpus} x {choice.plan.hardware} ({choice.plan.layout})"
    if plot_path:
        if plot_path.suffix.lower() != ".png":
            raise ValueError(f"--plot {plot_path}: give a .png file name")
        report.plot(rows_layer, choice.problem.ceilings, plot_path, title + ": one MoE layer, one micro-batch",
                    step_rows=rows_step)
    if as_json:
        print_json({"plan": choice.plan.model_dump(mode="json"), "layer": rows_layer, "step": rows_step})
        return
    console.print(report.table(rows_layer, f"{title}: one layer, one micro-batch, per GPU"))
    console.print(report.table(rows_step, f"{title}: whole step, per GPU"))
    plan = choice.plan
    console.print(f"predicted step {report.seconds(plan.step_time_s)}, {plan.tflops_per_gpu:.0f} TFLOP/s per GPU "
                  f"(MFU {plan.mfu:.1%})", highlight=False)
    if choice.problem.expert_precision == "fp8":  # which FP8 rate the expert stages above are priced at
        console.print(literal("note: " + fp8_note(choice.problem, choice.cost)))
    c = choice.problem.ceilings
    console.print(f"ceilings per GPU: {c.flops_per_s / 1e12:.0f} TFLOP/s, HBM {c.hbm_bytes_per_s / 1e9:.0f} GB/s "
                  f"(ridge {c.ridge('hbm'):.0f} FLOP/B), NVLink {c.nvlink_bytes_per_s / 1e9:.0f} GB/s, "
                  f"scale-out {c.scaleout_bytes_per_s / 1e9:.0f} GB/s", highlight=False)
    if plot_path:
        console.print(f"plot written to {plot_path}")


def _layout_choice(req: PlanConfig, layout: str, attention_gpus, p, m, seqs, sets) -> Choice:
    if layout == "auto":
        return choose(req)
    gpus = req.cluster.num_gpus
    if not 1 <= p <= min(gpus, req.model.num_layers):
        raise ValueError(f"-p {p}: pipeline groups must be between 1 and min(GPUs, layers) = "
                         f"{min(gpus, req.model.num_layers)}")
    if layout == "colocated":
        return price(req, Candidates.one(0, gpus // p * p, p, m, seqs, colocated=True))
    if layout != "disaggregated":
        raise ValueError(f"--layout {layout!r}: choose auto, disaggregated or colocated")
    if attention_gpus is None:
        raise ValueError("--layout disaggregated needs --attention-gpus (the rest become expert GPUs)")
    expert = gpus - attention_gpus
    if expert < 1 or attention_gpus % p or expert % (p * sets):
        raise ValueError(f"--attention-gpus {attention_gpus} leaves {expert} expert GPUs; both counts must "
                         f"divide into p={p} groups and the expert GPUs into {sets} replica set(s) per group")
    return price(req, Candidates.one(attention_gpus, expert, p, m, seqs, sets))


RUN_MODES = ("single", "disaggregated", "colocated")


def _config_choice(config: Path, hardware: str | None, layout: str, overrides: list[str]) -> Choice:
    """`roofline --config CONFIG [key=value ...]`: the run's own layout priced, in `layout`'s mode
    unless auto; `micro_batches` and, one GPU, `expert_wgrad_pairs` settled as a run on that hardware
    settles them."""
    from disagmoe.config import load_train_config
    from disagmoe.placement.trace_compare import run_request

    if layout != "auto" and layout not in RUN_MODES:
        raise ValueError(f"--layout {layout!r} with --config: choose {', '.join(RUN_MODES)} (or leave it out "
                         "for the config's mode)")
    cfg = load_train_config(config, [*overrides, *([] if layout == "auto" else [f"mode={layout}"])])
    hw = _run_hardware(cfg, config, hardware)
    cfg, _ = auto_split(cfg, hw.hbm_gib * 2**30)  # micro_batches: auto as a run on that hardware picks it
    model = load_model(cfg.model)
    if cfg.mode == "single":  # expert_wgrad_pairs: auto as the trainer settles it on that hardware's memory
        from disagmoe.runtime.training.single_memory import resolve_wgrad_pairs

        cfg, _ = resolve_wgrad_pairs(cfg, model, hw.hbm_gib * 2**30)
    req, cand = run_request(cfg, model, hw)
    return price(req, cand)


def _run_hardware(cfg, config: Path, hardware: str | None):
    """--hardware, else the train config's own hardware."""
    ref = hardware or cfg.hardware
    if ref is None:
        raise ValueError(f"{config} names no hardware; pass --hardware (a preset or a calibrated YAML) to price it on")
    return checked_hardware(ref)


def _compare(trace: Path, config: Path | None, hardware: str | None, as_json: bool, plot_path: Path | None) -> None:
    """`roofline --compare`: the table, JSON or PNG of `placement.trace_compare.compare`."""
    from disagmoe.config import load_train_config
    from disagmoe.placement.trace_compare import check_device, compare, read_trace

    if config is None:
        raise ValueError("--compare needs --config: the train config the trace came from (model, layout, batch)")
    cfg = load_train_config(config)
    if cfg.micro_batches == "auto":
        raise ValueError(f"{config} says micro_batches: auto, which the run resolved on its own device; give the "
                         "config the number it ran (its summary's micro_batches, or its start line) to compare")
    if plot_path and plot_path.suffix.lower() != ".png":
        raise ValueError(f"--plot {plot_path}: give a .png file name")
    hw = _run_hardware(cfg, config, hardware)
    check_device(read_trace(trace), trace, cfg, str(config), hw)
    result = compare(trace, cfg, hw)
    title = f"{trace}: {cfg.mode} run predicted on {hw.name}"
    if plot_path:
        report.compare_plot(result, plot_path, title)
    if as_json:
        print_json(result)
        return
    console.print(report.compare_table(result, title + " (per op; red: messages)"))
    unmatched = f" (no prediction for: {', '.join(result['unmatched_kinds'])})" if result["unmatched_kinds"] else ""
    console.print(literal(f"matched {result['ops_matched_per_step']:g} of {result['ops_per_step']:g} ops per step to a "
                          f"predicted op time, over {result['steps_measured']} measured step(s){unmatched}"))
    if plot_path:
        console.print(f"plot written to {plot_path}", markup=False, highlight=False)
