"""`disagmoe train`: run a training config in one of the layouts (single, disaggregated, colocated)."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from disagmoe.config import ModelConfig, TrainConfig, load_train_config
from disagmoe.model_ref import load_model
from disagmoe.cli.common import auto_split, console, literal, print_json, user_errors
from disagmoe.cli.third_party import quiet_ray
from disagmoe.roofline.optimizer_state import state_bytes
from disagmoe.roofline.params import count_params
from disagmoe.runtime.activation_memory import single_activation_bytes
from disagmoe.runtime.observe.throughput import Throughput
from disagmoe.runtime.out_dir import check_out_dir, set_aside_earlier_run
from disagmoe.runtime.plan_layout import apply_plan, replaced_fields
from disagmoe.runtime.run_lock import run_lock


StepCallback = Callable[[dict[str, Any]], None]
Run = Callable[[StepCallback | None], dict[str, Any]]  # runs the steps, returns the summary
MAX_THREADS_PER_CORE = 4  # more intra-op threads than this only thrash (and millions abort torch)


def prepare_single(cfg: TrainConfig) -> Run:
    """The whole model in this process: the correctness oracle."""
    from disagmoe.runtime.training.trainer import SingleProcessTrainer  # torch loads only when training

    return _runner(SingleProcessTrainer(cfg))


def prepare_distributed(cfg: TrainConfig) -> Run:
    """Ray actors (attention and expert ranks, or colocated ranks) talking over the transport."""
    from disagmoe.runtime.cluster.driver import DistributedTrainer

    return _runner(DistributedTrainer(cfg))


def _runner(trainer: Any) -> Run:
    """A built trainer's `Run`, with the start lines its settings decided as it was built (`_run` says them)."""

    def run(on_step: StepCallback | None) -> dict[str, Any]:
        return trainer.run(on_step).to_dict()

    run.notes = [note for note in (trainer.wgrad_pairs_note, trainer.tiles_note) if note]
    return run


# Each mode sets everything up (and reports user errors) before the progress bar starts.
PREPARE = {"single": prepare_single, "disaggregated": prepare_distributed, "colocated": prepare_distributed}


@user_errors
def train(
    config: Annotated[str, typer.Option("--config", "-c", help="training config YAML")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="config overrides key=value, e.g. optim.lr=1e-3 data.kind=text")
    ] = None,
    mode: Annotated[str | None, typer.Option(
        help="single | disaggregated | colocated (default: the config's; a --plan sets it)")] = None,
    steps: Annotated[int | None, typer.Option(help="optimizer steps (default: the config's)")] = None,
    out_dir: Annotated[str | None, typer.Option("--out-dir", help="metrics and checkpoints go here")] = None,
    plan: Annotated[str | None, typer.Option(
        "--plan", help="a `disagmoe plan --out` file: its layout and expert map replace the config's mode, "
        "rank counts, pipeline groups and micro-batches, and the recomputation, optimizer and precision settings it "
        "was priced with (precision: fp8 where it priced FP8 experts)")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="print the final summary as JSON only")] = False,
) -> None:
    """Train a model. Writes <out-dir>/metrics.jsonl (one JSON object per step) and checkpoints."""
    flags = [f"{k}={v}" for k, v in (("mode", mode), ("steps", steps), ("out_dir", out_dir)) if v is not None]
    cfg = load_train_config(config, [*(overrides or []), *flags])
    if plan is not None:
        cfg.plan = plan
    if cfg.plan is not None:
        planned = apply_plan(cfg, load_model(cfg.model))
        if not as_json:
            console.print(literal(_plan_note(cfg, planned)), highlight=False)
        cfg = planned
    cfg, split_note = auto_split(cfg)
    if split_note and not as_json:
        console.print(literal(split_note), highlight=False)
    if cfg.cuda_graphs == "auto" and cfg.device == "cuda" and not as_json:  # a CPU run: in the summary only
        from disagmoe.runtime.training.graphed_step import resolve_cuda_graphs  # torch: only once training

        console.print(literal(resolve_cuda_graphs(cfg)[1]), highlight=False)
    if cfg.fp8_emulate and not as_json:
        console.print(literal(fp8_emulate_note(cfg)), highlight=False)
    check_host_memory(cfg, load_model(cfg.model))
    if cfg.offload_optimizer and not as_json:
        console.print(literal(offload_note(cfg)), highlight=False)
    check_out_dir(cfg.out_dir)  # before Ray, the actors or the model start
    with run_lock(Path(cfg.out_dir)):  # one run per out_dir, from here to the end
        if not cfg.resume:
            set_aside_earlier_run(Path(cfg.out_dir))
        if cfg.mode != "single":
            quiet_ray(Path(cfg.out_dir))  # Ray's start-up notices go to <out_dir>/ray-driver.log
        summary = _run(cfg, as_json)
    if split_note:
        summary["micro_batches_note"] = split_note
    if as_json:
        print_json(summary)
        return
    console.print(_summary_table(cfg, summary))
    busy = summary.get("busy")
    if busy:
        console.print("busy fraction (compute time / step time, mean over the run): "
                      + ", ".join(f"{group} {fraction:.0%}" for group, fraction in busy.items()))
    if cfg.mode != "single" and cfg.trace:
        console.print(literal(f"trace: {Path(cfg.out_dir) / 'trace.json'} (open in https://ui.perfetto.dev)"),
                      highlight=False)


def _run(cfg: TrainConfig, as_json: bool) -> dict[str, Any]:
    """Set the run up (user errors surface here), then train, with a progress bar unless `as_json`."""
    run = PREPARE[cfg.mode](cfg)
    if cfg.mode != "single" and not as_json:
        console.print(literal(_hop_note(cfg)), highlight=False)
    for note in [] if as_json else getattr(run, "notes", []):  # the trainer's start lines
        console.print(literal(note), highlight=False)
    if as_json:
        # stdout holds the JSON only: Ray prints a dead actor's report (and actors' prints) to the
        # driver's stdout, from a thread of its own, so while the run lasts stdout is stderr
        with contextlib.redirect_stdout(sys.stderr):
            return run(None)  # a failed or stopped run: one message and exit 1 / 130 (`user_errors`)
    with TrainProgress(cfg.steps) as on_step:
        return run(on_step)


def check_host_memory(cfg: TrainConfig, model_cfg: ModelConfig) -> None:
    """ValueError, before anything is allocated, for a CPU run on this host whose parameters, with
    their gradients and AdamW moments (`roofline.optimizer_state.state_bytes`: 16 bytes each in fp32,
    12 with bf16 moments), and the activations of one micro-batch
    (`runtime.activation_memory.single_activation_bytes`) exceed the host's memory, or whose cpu_threads
    exceed its cores: a model too large for CPU training (or a typo in a size) fails in one line
    instead of swapping, meeting the OOM killer or aborting in torch."""
    if cfg.device != "cpu" or cfg.ray_address is not None:
        return  # GPU memory: per rank before the actors start (cluster/driver.py), single in its trainer
    cores = os.cpu_count() or 1
    if cfg.cpu_threads is not None and cfg.cpu_threads > MAX_THREADS_PER_CORE * cores:
        raise ValueError(f"cpu_threads={cfg.cpu_threads} but this host has {cores} cores; use at most {cores} "
                         "(or leave cpu_threads unset for torch's default)")
    params = count_params(model_cfg).total
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    tokens = cfg.batch_size // cfg.micro_batches * cfg.seq_len
    acts = single_activation_bytes(cfg, model_cfg)
    state = params * state_bytes(cfg.optim.state_dtype, cfg.compute_dtype_name).total
    if state + acts > host:
        raise ValueError(
            f"model {model_cfg.name!r} has {params:,} parameters: {state / 2**30:,.1f} GiB "
            f"of weights, gradients and AdamW moments, and a micro-batch of {tokens:,} tokens (batch_size="
            f"{cfg.batch_size} / micro_batches={cfg.micro_batches} x seq_len={cfg.seq_len}) keeps about "
            f"{acts / 2**30:,.1f} GiB of activations, but this host has {host / 2**30:,.1f} GiB; lower batch_size "
            "or seq_len, raise micro_batches, train a smaller model on CPU, or use device=cuda")


class TrainProgress:
    """A rich progress bar showing step, loss and tokens/s (the run's so far, as the summary
    defines it: `Throughput`); `with` yields the per-step callback."""

    def __init__(self, total_steps: int):
        self.throughput = Throughput()
        self.progress = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
            TextColumn("{task.fields[busy]}"), TimeElapsedColumn(), console=console, transient=False,
        )
        self.task = self.progress.add_task("train", total=total_steps, loss="-", tps="-", busy="")

    def __enter__(self) -> StepCallback:
        self.progress.start()
        return self.on_step

    def on_step(self, record: dict[str, Any]) -> None:
        busy = " ".join(f"{group} {fraction:.0%}" for group, fraction in record.get("busy", {}).items())
        self.throughput.add(record)
        self.progress.update(
            self.task, completed=record["step"], loss=f"{record['loss']:.4f}", tps=_fmt(self.throughput.tokens_per_s, ",.0f"),
            busy=f"busy {busy}" if busy else "",
        )

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()


def fp8_emulate_note(cfg: TrainConfig) -> str:
    """One line at start under fp8_emulate: what runs emulated, and that it is a check, not a speed."""
    dense = " and the dense projections' (in fp64)" if cfg.dense_precision == "fp8" else ""
    return (f"precision: FP8 emulated (quantise-dequantise into the bf16 GEMMs): the routed experts' FP8 forward "
            f"GEMMs (fp8_expert_forward: {cfg.expert_forward_precision}){dense} on their e4m3 operands' "
            "dequantised images, the same quantisers and counters; a numerics check at bf16's speed or slower "
            "(the planner and the memory check price it as FP8)")


def offload_note(cfg: TrainConfig) -> str:
    """One line at start: where offload_optimizer puts the optimizer state and the host memory it needs."""
    from disagmoe.runtime.state.offload import available_host_bytes

    if not cfg.offloads_to_host:
        return (f"offload_optimizer on {cfg.device}: the same bucketed update through two staging buckets of "
                f"{cfg.offload_bucket_mib} MiB, with nothing moved (a test path; it saves no memory)")
    model_cfg = load_model(cfg.model)
    if cfg.mode == "single":
        from disagmoe.runtime.training.trainer import single_host_bytes
        host, whose = single_host_bytes(cfg, model_cfg), "the GPU"
    else:
        from disagmoe.runtime.cluster.driver import host_state_bytes
        from disagmoe.runtime.topology import Topology
        topology = Topology.from_config(cfg, model_cfg)
        host, whose = host_state_bytes(cfg, model_cfg, topology), f"all {topology.world_size} ranks"
    return (f"offload_optimizer: {host / 2**30:.1f} GiB of fp32 masters and {cfg.optim.state_dtype} AdamW moments of "
            f"{whose} in pinned host memory (this host has {available_host_bytes() / 2**30:.1f} GiB available), "
            f"streamed through two {cfg.offload_bucket_mib} MiB staging buckets per GPU each step")


def _hop_note(cfg: TrainConfig) -> str:
    """Two lines: how tokens go to the expert ranks and how expert outputs return in this run, and why."""
    from disagmoe.runtime.stages.messages import dispatch_mode, hop_mode
    from disagmoe.runtime.topology import Topology

    model_cfg = load_model(cfg.model)
    topology = Topology.from_config(cfg, model_cfg)
    hop, why = hop_mode(cfg, model_cfg, topology)
    dispatch, dispatch_why = dispatch_mode(cfg, model_cfg, topology)
    return (f"tokens dispatch {dispatch} ({dispatch_why})\n"
            f"expert outputs return as {hop.replace('_', ' ')} ({why})\n"
            f"{_transport_line(cfg, model_cfg, topology)}")


def _transport_line(cfg: TrainConfig, model_cfg: ModelConfig, topology) -> str:
    """e.g. 'transport buffers: 3.01 GiB per rank at most (nccl receive buffers, in the memory check)'."""
    from disagmoe.runtime.cluster.sharing import stream_sum_width
    from disagmoe.runtime.stages.messages import MessageShapes, transport_buffer_bytes

    per_rank = transport_buffer_bytes(cfg, MessageShapes.of_run(cfg, model_cfg, topology), topology,
                                      stream_sum_width(cfg, topology))
    what = "the symmetric nvshmem arena, on every rank" if cfg.transport == "nvshmem" else (
        f"{cfg.transport} receive buffers, the largest rank's")
    return f"transport buffers: {max(per_rank, default=0) / 2**30:.2f} GiB per rank ({what}; in the memory check)"


def _plan_note(cfg: TrainConfig, planned: TrainConfig) -> str:
    """e.g. 'plan plan.yaml: attention_ranks=1, expert_ranks=2 (config: 1), ...'."""
    changed = replaced_fields(cfg, planned)
    fields = ("mode", "colocated_ranks", "micro_batches") if planned.mode == "colocated" else (
        "mode", "attention_ranks", "expert_ranks", "pipeline_groups", "micro_batches")
    shown = [f"{name}={getattr(planned, name)}" + (f" (config: {changed[name][0]})" if name in changed else "")
             for name in fields]
    source = cfg.plan if isinstance(cfg.plan, str) else "inline"
    note = f"plan {source}: {', '.join(shown)}; experts placed by its expert_map"
    also = [f"{name}={new} (config: {old})" for name, (old, new) in changed.items() if name not in fields]
    if also:
        note += f"; as it was priced: {', '.join(also)}"
    plan, tokens = planned.plan, planned.batch_size * planned.seq_len
    if plan.layout == "single" and plan.accumulation_rounds > 1:  # `planned_micro_batches`
        note += (f"; its micro-batches are the plan's {plan.micro_batches} x {plan.accumulation_rounds} rounds "
                 f"(one accumulation; priced at {plan.sequences_per_micro_batch} sequences each)")
    if plan.layout != "single" and plan.accumulation_rounds > 1:  # `check_rounds`: batch_size is one round
        note += (f"; one of its {plan.accumulation_rounds} rounds per step (the {plan.layout} runtime accumulates "
                 "no rounds: each round steps the optimizer)")
        if planned.seq_len != plan.seq_len:
            note += f"; it was made for seq_len {plan.seq_len}, this run trains {planned.seq_len}: set seq_len to match"
    elif (tokens, planned.seq_len) != (plan.global_batch_tokens, plan.seq_len):
        note += (f"; it was made for {plan.global_batch_tokens:,} tokens per step at seq_len {plan.seq_len}, this run "
                 f"trains {tokens:,} ({planned.batch_size} x {planned.seq_len}): set batch_size and seq_len to match")
    return note


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _summary_table(cfg: TrainConfig, summary: dict[str, Any]) -> Table:
    table = Table(title=f"train ({cfg.mode})", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    rows = [
        ("steps", str(summary["steps"])),
        ("final loss", _fmt(summary["final_loss"], ".4f")),
        ("final val loss", _fmt(summary["final_val_loss"], ".4f")),
        ("tokens/s", _fmt(summary["tokens_per_s"], ",.0f")),
        ("MFU", "n/a (set hardware: for a peak)" if summary["mfu"] is None else f"{summary['mfu']:.2%}"),
        ("metrics", summary["metrics_path"]),
        ("checkpoint", summary["checkpoint_path"] or "-"),
    ]
    if summary.get("dispatch"):
        rows.append(("dispatch", summary["dispatch"]))
    traffic = summary.get("traffic") or {}
    for name in ("dispatch", "combine", "combine_grad", "dispatch_grad"):  # the hop messages counted
        if name in traffic:
            rows.append((f"{name.replace('_', ' ')} bytes/step",
                         f"{traffic[name]:,.0f} (dense: {traffic[f'{name}_dense']:,.0f})"))
    if summary.get("hop"):
        rows.append(("expert return", summary["hop"].replace("_", " ")))
    if summary.get("transport_gib_per_rank"):
        rows.append(("transport buffers", f"{max(summary['transport_gib_per_rank']):.2f} GiB per rank at most "
                                          f"({summary.get('transport')})"))
    if summary.get("time_sliced"):
        ranks = len(summary.get("processes") or [])
        rows.append(("GPUs", f"{ranks} ranks on {summary['gpus']}: time-sliced, not a speed measurement"))
    if summary.get("restarts"):
        rows.append(("restarts", f"{summary['restarts']} (max_restarts={cfg.max_restarts})"))
    for what, value in rows:
        table.add_row(what, literal(value))  # paths may hold [brackets]
    return table
