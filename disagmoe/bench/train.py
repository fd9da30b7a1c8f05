"""`disagmoe bench train`: whole training steps of one config, in several layouts, in one run.

Each mode trains the same model on the same data for the same number of steps on the same
devices (colocated gets as many ranks as attention + expert ranks together); the figure is the
median step time after the first `warmup` steps (a row whose step is captured in CUDA graphs: after
its capture steps too, `timed_warmup`), and every mode is set against the colocated
layout measured in the same run (or the first mode, if colocated is not among them), and against
the single GPU where `single` ran. Each row also carries MFU per GPU (model FLOPs / step time /
(GPUs x bf16 dense peak)) and against the measured matmul ceiling, peak GPU memory, the routing
(learned or forced-balanced), the mean load imbalance of the timed steps and, on GPUs, the SM clock,
power and clock-event reasons over the timed steps and each step's SM clock (`bench.gpu_clocks`:
a step time is only comparable at the clocks it ran at). `baseline="hf"` adds
Hugging Face transformers' Qwen3MoeForCausalLM on one GPU, same shape and batch
(`bench.hf_baseline`).

Variants (`variants`, e.g. ["recompute=none", "recompute=selective"]): every mode runs once per
variant (each a set of config overrides), in the same run; each row then also gives its
tokens/s and peak memory against the same mode's row of the first variant. Every row keeps its
per-step losses and, where it ran FP8 GEMMs, each step's share of saturated e4m3 elements
(`bench.loss_plot` draws them: `--plot`). `seeds` > 1 trains every row once per seed (seed ..
seed + seeds - 1, the data order pinned to the config's: the same batches), and the record's
`loss_parity` reads each variant's loss against the first variant's spread over those seeds
(`bench.loss_parity`: one pair of runs cannot tell a gap of a few percent from chaos).

Each row is logged as it ends, so a run stopped part-way keeps what it measured. A row that
cannot run (a `ValueError` naming the fix: its memory check, an out-of-memory error, a refusal of
its layout) is kept as a row with its `error`, and the run goes on to the next; only a run with no
row left fails.
"""

from __future__ import annotations

import itertools
import platform
import shlex
import statistics
import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from disagmoe.bench.gpu_clocks import GpuClockSampler, describe
from disagmoe.bench.loss_parity import DEFAULT_WINDOW, MODES, check_control, loss_parity
from disagmoe.bench.timing import warmup_past_capture
from disagmoe.config import TrainConfig, apply_overrides, validate
from disagmoe.runtime.observe.metrics import read_metrics
from disagmoe.runtime.training.loop import METRICS_FILE
from disagmoe.model_ref import load_model
from disagmoe.runtime.training.trainer import SingleProcessTrainer, resolve_device, resolve_single_micro_batches

HOPS = ("partial_sums", "pair_rows")


def variant_config(cfg: TrainConfig, variant: str | None, mode: str | None = None) -> TrainConfig:
    """`cfg` with a variant's overrides ("key=value key2=value2"; None: `cfg` itself), checked
    as the config is (ValueError naming the variant), in `mode` where given: the mode the row
    runs, so a variant only that mode takes (`cuda_graphs=on` in single mode, of a config written
    for a distributed one) is checked there, not against the config's own mode."""
    if variant is None:
        return cfg
    overrides = shlex.split(variant)
    if not overrides:
        raise ValueError("--variant '': give key=value overrides, e.g. --variant recompute=selective")
    base = cfg.model_dump() if mode is None else {**cfg.model_dump(), "mode": mode, **row_layout(cfg, mode)}
    return validate(TrainConfig, apply_overrides(base, overrides), f"--variant {variant!r}")


def seeded_config(cfg: TrainConfig, vcfg: TrainConfig, index: int, variant: str | None) -> TrainConfig:
    """The `index`-th seed's run of a variant's config `vcfg` under `--seeds`: seed `cfg.seed +
    index`, the data order pinned to `cfg`'s (`DataConfig.seed`), so that only the initialisation
    moves; ValueError where the variant sets either seed itself."""
    if (vcfg.seed, vcfg.data_seed) != (cfg.seed, cfg.data_seed):
        raise ValueError(f"--seeds gives each row its seed ({cfg.seed} and on) and pins the data order: take seed and "
                         f"data.seed out of --variant {variant!r}, or set them in the config")
    return vcfg.model_copy(update={"seed": cfg.seed + index,
                                   "data": vcfg.data.model_copy(update={"seed": cfg.data_seed})})


def row_layout(cfg: TrainConfig, mode: str) -> dict:
    """The layout fields a row of `mode` takes from `cfg`: colocated of a config written for another
    mode is its baseline, the same GPUs (attention + expert ranks) as one pipeline group; a config
    written for colocated (mode=colocated) keeps its own colocated_ranks and pipeline_groups, as
    every other mode keeps its own layout (no fields)."""
    if mode == "colocated" and cfg.mode != "colocated":
        return dict(colocated_ranks=cfg.attention_ranks + cfg.expert_ranks, pipeline_groups=1)
    return {}


def mode_config(cfg: TrainConfig, mode: str, steps: int, out_dir: Path, transport: str | None = None,
                hop: str | None = None) -> TrainConfig:
    """`cfg` for one timed mode (and transport and hop, default the config's): no trace, no
    checkpoints (a big model's takes minutes and tens of GB), fresh output."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    transport = transport or cfg.transport
    hop = hop or cfg.hop
    update = dict(mode=mode, steps=steps, out_dir=str(out_dir / f"{mode}-{transport}-{hop}"), trace=False,
                  resume=False, checkpoint_every=0, checkpoint_minutes=0, checkpoint_at_end=False, keep_checkpoints=1,
                  eval_every=0, transport=transport, hop=hop)
    update.update(row_layout(cfg, mode))  # a variant's row has it already (`variant_config`): no fields then
    return TrainConfig.model_validate({**cfg.model_dump(), **update})  # a combination the config refuses, refused


def fp8_kernels(cfg: TrainConfig) -> str | None:
    """Which kernels a run's FP8 experts ran per GEMM role (`kernels.fp8_ffn.kernel_paths` with its
    recipe and `expert_gluon`, on its device), e.g. 'rows triton | swiglu triton | wgrad bf16 triton';
    None for experts not in FP8. A row's record carries it: the Gluon row GEMM's training loss gap
    (session 28) showed that a run's figures mean little without it."""
    if cfg.expert_precision != "fp8":
        return None
    from disagmoe.kernels.fp8_ffn import kernel_paths

    model = load_model(cfg.model)
    return kernel_paths(model.hidden_size, model.expert_ffn_size, torch.device(cfg.device), rows=cfg.expert_gluon,
                        swiglu=cfg.expert_gluon, wgrad=cfg.expert_gluon, backward=cfg.expert_backward_precision,
                        forward=cfg.expert_forward_precision, tma_store=cfg.expert_gluon_tma_store,
                        block_m=cfg.expert_gluon_block_m)


def timed_warmup(cfg: TrainConfig, warmup: int, steps: int) -> tuple[int, str | None]:
    """(the first steps a row of `cfg` leaves untimed, why more than `warmup` or None): `warmup`, or
    where the row captures its step in CUDA graphs, through its capture steps
    (`timing.warmup_past_capture`): no capture step is timed. A row refusing its capture
    (`cuda_graphs: on` where it cannot apply) keeps `warmup`: it fails with that refusal as it starts."""
    try:
        return warmup_past_capture(cfg, warmup, steps)
    except ValueError:
        return warmup, None


def steps_needed(cfg: TrainConfig, warmup: int, steps: int) -> int:
    """The fewest steps, from `steps` on, that leave a row of `cfg` a step to time (`timed_warmup`)."""
    return next(n for n in itertools.count(steps) if timed_warmup(cfg, warmup, n)[0] < n)


def check_timed_steps(rows: list[tuple[str, TrainConfig]], warmup: int, steps: int) -> None:
    """ValueError naming the `--steps` needed where `steps` leaves a row (name, its config) no step to
    time after its warm-up (`timed_warmup`), before any row trains."""
    if warmup >= steps:
        raise ValueError(f"--steps {steps} leaves no step to time after --warmup {warmup}: pass --steps "
                         f"{warmup + 1} or more")
    short = [(name, why, steps_needed(cfg, warmup, steps)) for name, cfg in rows
             for row_warmup, why in [timed_warmup(cfg, warmup, steps)] if row_warmup >= steps]
    if short:
        raise ValueError(f"--steps {steps} leaves no step to time after the capture steps (never timed) of "
                         + "; ".join(f"{name}: {why}" for name, why, _ in short)
                         + f"; pass --steps {max(n for *_, n in short)} or more")


def short_rows_note(rows: list[tuple[str, TrainConfig]], warmup: int, steps: int) -> str | None:
    """A line where a row (name, its config) times fewer steps than `steps - warmup` asks, its warm-up
    running through its capture steps (`timed_warmup`): how many each such row times, and the --warmup and
    --steps that time as many as asked in every row, over the same steps (so that a ratio between rows is
    not a median of two steps against one of eight); None where every row times them all."""
    want = steps - warmup
    short = [(name, steps - row_warmup) for name, cfg in rows
             for row_warmup, _ in [timed_warmup(cfg, warmup, steps)] if steps - row_warmup < want]
    if not short:
        return None
    for n in itertools.count(steps):
        latest = max(timed_warmup(cfg, warmup, n)[0] for _, cfg in rows)
        if n - latest >= want:
            break
    return ("; ".join(f"{name} times {count} of its steps" for name, count in short)
            + f" (warm-ups through the capture steps), not the {want} that --steps {steps} --warmup {warmup} asks: "
              f"pass --warmup {latest} --steps {latest + want} to time steps {latest + 1}-{latest + want} in every row")


def median_step(records: list[dict], warmup: int) -> float:
    """Median `step_time_s` after the first `warmup` steps."""
    times = [r["step_time_s"] for r in records if r["step"] > warmup]
    if not times:
        raise ValueError(f"no steps left to time after {warmup} warm-up steps; pass more --steps")
    return statistics.median(times)


def mean_busy(records: list[dict], warmup: int) -> dict[str, float]:
    """Per group, the mean busy fraction (compute / step time) after the first `warmup` steps;
    empty for a mode without groups (single)."""
    timed = [r["busy"] for r in records if r["step"] > warmup and r.get("busy")]
    return {group: statistics.fmean(b[group] for b in timed) for group in sorted(timed[0])} if timed else {}


def mean_waits(records: list[dict], warmup: int) -> dict[str, dict[str, float]]:
    """Per group and received payload, the mean GPU wait fraction (`trace.wait_fractions`) over
    the timed steps; empty where no step recorded any."""
    timed = [r["gpu_wait"] for r in records if r["step"] > warmup and r.get("gpu_wait")]
    groups = sorted({group for waits in timed for group in waits})
    return {group: {payload: statistics.fmean(w.get(group, {}).get(payload, 0.0) for w in timed)
                    for payload in sorted({p for w in timed for p in w.get(group, {})})}
            for group in groups}


def summarise(rows: list[dict]) -> list[dict]:
    """Add each mode's speedup over the baseline (colocated if measured, else the first mode) and,
    where `single` ran, its tokens/s over the single GPU's and its mean loss over all steps
    relative to the single GPU's (the same data: a check that the layouts train alike)."""
    ran = [r for r in rows if not r.get("error")]
    if not ran:
        raise ValueError("no row of the run trained: " + "; ".join(f"{row_label(r)}: {r['error']}" for r in rows))
    base = next((r for r in ran if r["mode"] == "colocated"), ran[0])
    single = next((r for r in ran if r["mode"] == "single"), None)
    def loss_vs_single(r: dict) -> float | None:  # against the single row of the same seed (`--seeds`)
        same = next((o for o in ran if o["mode"] == "single" and o.get("seed") == r.get("seed")), single)
        if same is None or r.get("mean_loss") is None or not same.get("mean_loss"):
            return None
        return r["mean_loss"] / same["mean_loss"] - 1.0

    def label(r: dict) -> str:  # a mode timed with several transports or hops has a row per each
        return row_label(r)

    def speed(r: dict) -> bool:  # a time-sliced row (ranks sharing a GPU) is no speed figure, nor a base for one
        return not (r.get("time_sliced") or base.get("time_sliced"))

    first_variant = rows[0].get("variant")

    def same_run_of_first_variant(r: dict) -> dict | None:
        if r.get("variant") is None:
            return None
        return next((o for o in ran if o.get("variant") == first_variant and o.get("seed") == r.get("seed") and
                     (o["mode"], o.get("transport"), o.get("hop")) == (r["mode"], r.get("transport"), r.get("hop"))),
                    None)

    def vs_variant(r: dict) -> dict:
        other = same_run_of_first_variant(r)
        if other is None:
            return {}
        memory = (r["peak_memory_gib"] / other["peak_memory_gib"]
                  if r.get("peak_memory_gib") and other.get("peak_memory_gib") else None)
        return {"variant_baseline": first_variant, "memory_vs_variant": memory,
                "vs_variant": r["tokens_per_s"] / other["tokens_per_s"] if speed(r) and speed(other) else None}

    return [r if r.get("error") else
            {**r, "baseline": label(base), "speedup": base["median_step_s"] / r["median_step_s"] if speed(r) else None,
             "vs_single": None if single is None or not (speed(r) and not single.get("time_sliced"))
             else r["tokens_per_s"] / single["tokens_per_s"],
             "mean_loss_vs_single": loss_vs_single(r), **vs_variant(r)} for r in rows]


def row_name(mode: str, cfg: TrainConfig, variant: str | None, seed: int | None = None) -> str:
    """A row's name in the run's lines: its mode, with its transport and hop where distributed, its
    variant and its seed (under `--seeds`)."""
    return (f"{mode}{'' if mode == 'single' else f' ({cfg.transport}, hop {cfg.hop})'}"
            f"{f' [{variant}]' if variant else ''}{'' if seed is None else f' seed {seed}'}")


def row_label(r: dict) -> str:
    """A row's name: its mode, with its transport and hop where it has them, its variant, its seed
    (under `--seeds`), and 'time-sliced' where its ranks shared GPUs."""
    parts = [p for p in (r.get("transport"), r.get("hop") and r["hop"].replace("_", " "), r.get("variant"),
                         r.get("seed") is not None and f"seed {r['seed']}", r.get("time_sliced") and "time-sliced")
             if p]
    return f"{r['mode']} ({', '.join(parts)})" if parts else r["mode"]


def underflow_by_kind(records: list[dict]) -> dict[str, float]:
    """Per kind of FP8 operand (`fp8_stats.KINDS`), the mean over the steps that quantised it of
    the share of its quantised elements that were nonzero and became zero (the step records'
    `fp8_by_kind`: UNDERFLOW / TOTAL); {} without FP8. Small gradients lost this way shrink a step
    where saturation would show nothing."""
    steps = [r["fp8_by_kind"] for r in records if r.get("fp8_by_kind")]
    kinds = [k for k in (steps[0] if steps else {}) if any(s[k]["elements"] for s in steps)]
    return {k: statistics.fmean(s[k]["underflow_share"] for s in steps if s[k]["elements"]) for k in kinds}


def counting_note(runs: list[TrainConfig]) -> str | None:
    """A line where the rows' FP8 quantisers count on different shares of their steps (mode single every
    `counters_every`-th step, the distributed modes every step: `TrainConfig.fp8_counters_every`), which
    moves their step times apart by the counters' cost (2-6% on the Qwen3 config, session 32); None where
    they count alike."""
    every = {r.counters_every for r in runs if r.precision == "fp8"}
    if len(every) < 2:
        return None
    each = " in some, ".join("every step" if n == 1 else f"every {n}th step" for n in sorted(every))
    return (f"note: these rows' FP8 quantisers count their numerics on {each} in others (fp8_counters_every; the "
            "distributed modes count every step), which moves their step times apart by the counters' cost; "
            "fp8_counters_every=1 makes them alike")


def counted_note(shares: list[float | None]) -> str:
    """' (over the N of M steps that counted)' where a precision-fp8 row's quantisers counted on some steps
    only (`TrainConfig.fp8_counters_every`); '' where every step counted, or none (bf16)."""
    counted = sum(s is not None for s in shares)
    return f" (over the {counted} of {len(shares)} steps that counted)" if 0 < counted < len(shares) else ""


def mean_of(records: list[dict], key: str, warmup: int) -> float | None:
    """Mean of a numeric record field over the timed steps (None where absent)."""
    values = [r[key] for r in records if r["step"] > warmup and r.get(key) is not None]
    return statistics.fmean(values) if values else None


def free_device_memory() -> None:
    """Release what an in-process mode left on the GPU before the next mode claims it."""
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def baseline_split(cfg: TrainConfig, rows: list[dict]) -> TrainConfig:
    """`cfg` with the micro-batches of this run's single-mode row for the outside baseline (like with
    like), where the config says `micro_batches: auto`; with no single row, auto chosen for one GPU."""
    if cfg.micro_batches != "auto":
        return cfg
    single = next((r for r in rows if r["mode"] == "single" and r["variant"] is None and not r.get("error")), None)
    if single is not None:
        return cfg.model_copy(update={"micro_batches": single["micro_batches"]})
    one_gpu = cfg.model_copy(update={"mode": "single"})
    return resolve_single_micro_batches(one_gpu, load_model(cfg.model), resolve_device(cfg.device))[0]


def train_row(cfg: TrainConfig, clocks: GpuClockSampler | None = None):
    """One row's training run (its summary); `clocks` marked once the trainer is built, immediately
    before its first step (so that no step's window, warmup 0's included, holds the set-up), and as
    each step ends, by step number and the run's restarts so far (`GpuClockSampler.mark`: a step a
    distributed run re-ran after a restart keeps its new window, and the first step after a restart,
    whose window would span it, is left out of the clocks). A single-mode row gives its GPU memory
    back after it, whether it ended or failed, so the next row starts clean."""
    if cfg.mode == "single":
        try:
            return _marked_run(SingleProcessTrainer(cfg), clocks)
        finally:
            free_device_memory()
    from disagmoe.runtime.cluster.driver import DistributedTrainer

    return _marked_run(DistributedTrainer(cfg), clocks)


def _marked_run(trainer, clocks: GpuClockSampler | None):
    """`trainer.run()`, `clocks` marked at its start and at each step's end (`train_row`)."""
    if clocks is None:
        return trainer.run()
    clocks.mark(trainer.step, trainer.restarts)
    return trainer.run(lambda record: clocks.mark(record["step"], trainer.restarts))


def clock_sampler(cfg: TrainConfig, sample: bool = True) -> GpuClockSampler | None:
    """The sampler of the GPUs a row of `cfg` trains on (`bench.gpu_clocks`): GPU 0 in mode single (and
    for the outside baseline), every visible GPU in the distributed modes; None off CUDA or unless
    `sample`."""
    if not sample or cfg.device != "cuda" or not torch.cuda.is_available():
        return None
    devices = [0] if cfg.mode == "single" else list(range(torch.cuda.device_count()))
    return GpuClockSampler.for_devices(devices)


def clock_fields(clocks: GpuClockSampler | None, warmup: int, sampled: bool = True) -> dict:
    """A row's clock fields: the timed steps' summary (`GpuClockSampler.timed_summary`: partial where
    nvidia-smi sampled too little of them), each step's median SM clock, and why not everything was
    sampled (none, an early exit)."""
    if clocks is None:
        return {"gpu_clocks": None, "step_sm_mhz": None,
                "gpu_clocks_note": None if sampled else "not sampled (bench train --no-gpu-clocks)"}
    return {"gpu_clocks": clocks.timed_summary(warmup), "step_sm_mhz": clocks.per_step_sm_mhz(),
            "gpu_clocks_note": clocks.timed_note(warmup)}


def runs_of(modes: list[str], transports: list[str] | None,
            hops: list[str] | None = None) -> list[tuple[str, str | None, str | None]]:
    """(mode, transport, hop) to time: single once, each distributed mode per transport and hop
    (None: the config's), leaving out pair rows over nccl (refused: no one-sided stores)."""
    for transport in transports or []:
        if transport not in ("local", "nccl", "nvshmem"):
            raise ValueError(f"unknown transport {transport!r}; choose local, nccl or nvshmem")
    for hop in hops or []:
        if hop not in HOPS:
            raise ValueError(f"unknown hop {hop!r}; choose {' or '.join(HOPS)}")
    runs: list[tuple[str, str | None, str | None]] = []
    for mode in modes:
        if mode == "single":
            runs.append((mode, None, None))
            continue
        runs.extend((mode, t, h) for t in transports or [None] for h in hops or [None]
                    if not (t == "nccl" and h == "pair_rows"))
    return runs


def run(cfg: TrainConfig, modes: list[str], steps: int, warmup: int,
        log: Callable[[str], None], baseline: str | None = None, transports: list[str] | None = None,
        hops: list[str] | None = None, variants: list[str] | None = None,
        on_row: Callable[[list[dict]], None] | None = None, gpu_clocks: bool = True, seeds: int = 1,
        loss_window: int = DEFAULT_WINDOW, control: str | None = None) -> dict:
    """The record of the run (module docstring); `on_row` gets the rows so far (unsummarised) as
    each row ends, e.g. to keep a partial record on disk. `gpu_clocks=False`: no nvidia-smi beside
    the steps (each row's `gpu_clocks_note` says so), to see whether its sampling moves a step.
    `seeds`: runs of every row (each seed's rows in turn, so a run stopped part-way keeps whole
    seeds); `loss_window`: the last steps whose mean loss `loss_parity` compares; `control`: one of
    `variants` that changes the first's rounding alone, every other read against it (checked before
    any row trains, as is that `steps` leaves every row a step to time: `check_timed_steps`). The
    record's `warmup` is the one asked; each row's `warmup` the steps it left untimed, with
    `warmup_note` saying why where that is more (its capture steps: `timed_warmup`)."""
    if baseline not in (None, "hf"):
        raise ValueError(f"unknown baseline {baseline!r}; the one outside baseline is 'hf' (transformers)")
    if seeds < 1 or loss_window < 1:
        raise ValueError(f"--seeds {seeds} --loss-window {loss_window}: give at least 1 of each")
    variants = variants or [None]
    if control is not None:
        check_control(control, variants)
    # every variant checked in every mode it runs before any run starts
    checked = [(v, variant_config(cfg, v, r[0]), r) for v in variants for r in runs_of(modes, transports, hops)]
    planned = [(v, seeded_config(cfg, vcfg, index, v) if seeds > 1 else vcfg, r)
               for index in range(seeds) for v, vcfg, r in checked]
    uneven = counting_note([vcfg.model_copy(update={"mode": r[0]}) for _, vcfg, r in checked])
    if uneven:
        log(uneven)
    timed = [(v, r, mode_config(vcfg, r[0], steps, Path(), r[1], r[2])) for v, vcfg, r in checked]
    check_timed_steps([(row_name(r[0], mcfg, v), mcfg) for v, r, mcfg in timed], warmup, steps)
    short = short_rows_note([(row_name(r[0], mcfg, v), mcfg) for v, r, mcfg in timed], warmup, steps)
    if short:
        log(short)
    warmups = {(v, r): timed_warmup(mcfg, warmup, steps) for v, r, mcfg in timed}  # each row's, and why
    rows = []
    with tempfile.TemporaryDirectory(prefix="disagmoe-bench-train-") as tmp:
        for variant, vcfg, (mode, transport, hop) in planned:
            seed = vcfg.seed if seeds > 1 else None
            out = Path(tmp) / f"variant-{variants.index(variant)}" / f"seed-{vcfg.seed}"
            mcfg = mode_config(vcfg, mode, steps, out, transport, hop)
            name = row_name(mode, mcfg, variant, seed)
            log(f"{name}: {steps} steps")
            row_warmup, why = warmups[variant, (mode, transport, hop)]
            if why:
                log(f"{name}: warming up {row_warmup} steps, not {warmup}: {why}, and the timed steps are replays")
            clocks = clock_sampler(mcfg, gpu_clocks)
            try:
                with clocks or nullcontext():
                    summary = train_row(mcfg, clocks)
            except ValueError as err:  # a user error of this row (memory check, out of memory): the row's, not the run's
                log(f"{name}: did not run: {err}")
                rows.append({"mode": mode, "transport": None if mode == "single" else mcfg.transport, "hop": None,
                             "variant": variant, "seed": seed, "warmup": row_warmup, "warmup_note": why,
                             "error": str(err)})
                if on_row is not None:
                    on_row(rows)
                continue
            used_hop, time_sliced = summary.hop, summary.time_sliced
            for note in (summary.micro_batches_note, summary.cuda_graphs_note, summary.expert_wgrad_pairs_note,
                         summary.expert_tiles_note):
                if note:
                    log(note)
            records = read_metrics(Path(mcfg.out_dir) / METRICS_FILE)
            step_s = median_step(records, row_warmup)
            ranks = {"single": 1, "colocated": mcfg.colocated_ranks,
                     "disaggregated": vcfg.attention_ranks + vcfg.expert_ranks}[mode]
            flops = records[-1]["flops"]
            imbalance = [statistics.fmean(r["load_imbalance"]) for r in records
                         if r["step"] > row_warmup and r.get("load_imbalance")]
            rows.append({"mode": mode, "transport": None if mode == "single" else mcfg.transport, "hop": used_hop,
                         "variant": variant, "seed": seed, "init_seed": mcfg.seed, "data_seed": mcfg.data_seed,
                         "ranks": ranks, "time_sliced": time_sliced, "warmup": row_warmup, "warmup_note": why,
                         "micro_batches": summary.micro_batches, "cuda_graph_replays": summary.cuda_graph_replays,
                         "cuda_graphs_note": summary.cuda_graphs_note, "fp8_kernels": fp8_kernels(mcfg),
                         "expert_wgrad_pairs": summary.expert_wgrad_pairs,
                         "expert_tiles_note": summary.expert_tiles_note,
                         "dense_recipe": summary.dense_recipe,
                         "predicted_peak_gib": summary.predicted_peak_gib,
                         "median_step_s": step_s, "step_times_s": [r["step_time_s"] for r in records],
                         "gpu_wait": mean_waits(records, row_warmup),
                         "tokens_per_s": records[-1]["tokens"] / step_s, "final_loss": records[-1]["loss"],
                         "mean_loss": mean_of(records, "loss", 0), "losses": [r["loss"] for r in records],
                         "ces": [r.get("ce") for r in records],
                         "fp8_saturated_shares": [r.get("fp8_saturated_share") for r in records],
                         "max_fp8_saturated_share": max((r["fp8_saturated_share"] for r in records
                                                         if r.get("fp8_saturated_share") is not None), default=None),
                         "fp8_underflow_shares": [r.get("fp8_underflow_share") for r in records],
                         "fp8_underflow_by_kind": underflow_by_kind(records),
                         "busy": mean_busy(records, row_warmup), "routing": records[-1].get("routing", "learned"),
                         "mfu": None if time_sliced else _rate(flops, step_s, records[-1], "mfu"),
                         "mfu_ceiling": None if time_sliced else _rate(flops, step_s, records[-1], "mfu_ceiling"),
                         "peak_memory_gib": max((r["peak_memory_gib"] for r in records
                                                 if r.get("peak_memory_gib") is not None), default=None),
                         "load_imbalance": statistics.fmean(imbalance) if imbalance else None,
                         **clock_fields(clocks, row_warmup, gpu_clocks)})
            saturated = rows[-1]["max_fp8_saturated_share"]
            log(f"{name}: {step_s * 1e3:,.1f} ms/step, {rows[-1]['tokens_per_s']:,.0f} tokens/s, final loss "
                f"{rows[-1]['final_loss']:.4f}" + (f", peak {rows[-1]['peak_memory_gib']:.1f} GiB"
                                                   if rows[-1]["peak_memory_gib"] is not None else "")
                + (f", FP8 saturated share at most {saturated:.2e} a step" if saturated is not None else "")
                + counted_note(rows[-1]["fp8_saturated_shares"]))
            if rows[-1]["fp8_kernels"]:
                log(f"{name}: FP8 experts' kernels: {rows[-1]['fp8_kernels']}; dense projections: "
                    f"{rows[-1]['dense_recipe']}")
            if rows[-1]["fp8_underflow_by_kind"]:
                log(f"{name}: FP8 elements quantised to zero, mean share a step: " + ", ".join(
                    f"{kind} {share:.2e}" for kind, share in rows[-1]["fp8_underflow_by_kind"].items()))
            if clocks is not None:
                log(f"{name}: {describe(rows[-1]['gpu_clocks'], rows[-1]['gpu_clocks_note'])}")
            if on_row is not None:
                on_row(rows)
        if baseline == "hf":
            from disagmoe.bench import hf_baseline

            hf_cfg = baseline_split(cfg, rows)
            clocks = clock_sampler(hf_cfg.model_copy(update={"mode": "single"}), gpu_clocks)
            with clocks or nullcontext():
                row = hf_baseline.run(hf_cfg, steps, warmup, log, None if clocks is None else clocks.mark)
            rows.append({**row, "warmup": warmup, "warmup_note": None, "mfu": None, "mfu_ceiling": None,
                         "load_imbalance": None, "mean_loss": None,
                         **clock_fields(clocks, warmup, gpu_clocks)})
            if clocks is not None:
                log(f"{row['mode']}: {describe(rows[-1]['gpu_clocks'], rows[-1]['gpu_clocks_note'])}")
            single = next((r for r in rows if r["mode"] == "single" and not r.get("error")), None)
            if single is not None and single["mfu"] is not None:  # the same model FLOPs on one GPU
                row_mfu = single["mfu"] * single["median_step_s"] / row["median_step_s"]
                rows[-1].update(mfu=row_mfu, mfu_ceiling=single["mfu_ceiling"] * single["median_step_s"]
                                / row["median_step_s"])
    environment = {}
    if cfg.device == "cuda" and torch.cuda.is_available():
        from disagmoe.bench.timing import environment as gpu_environment

        environment = gpu_environment(torch.device("cuda", 0))
        if cfg.experts_backend == "triton":  # which tuned tiles the expert kernels read (`tile_configs`)
            from disagmoe.kernels.tile_configs import device_architecture, tile_source

            environment["tiles"] = tile_source(environment["gpu"], device_architecture(torch.device("cuda", 0)))
    device = (torch.cuda.get_device_name(0) if cfg.device == "cuda" and torch.cuda.is_available()
              else platform.processor() or platform.machine())
    parity = loss_parity(rows, loss_window, control) if seeds > 1 or len(variants) > 1 else None
    return {"environment": {"device": device, "torch": torch.__version__, "python": platform.python_version(),
                            "transport": ", ".join(dict.fromkeys(transports)) if transports else cfg.transport,
                            "experts_backend": cfg.experts_backend,
                            "precision": cfg.expert_precision, **environment},
            "steps": steps, "warmup": warmup, "seeds": seeds, "modes": summarise(rows),
            "loss_parity": None if parity is None else {"window": min(loss_window, steps), "control": control,
                                                        "groups": parity}}


def _rate(flops: float, step_s: float, record: dict, key: str) -> float | None:
    """MFU of the median step from a record's denominator (its `key` = flops / time / peak)."""
    if record.get(key) is None:
        return None
    peak = record["flops"] / record["step_time_s"] / record[key]
    return flops / step_s / peak
