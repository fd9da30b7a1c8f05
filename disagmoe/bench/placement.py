"""`disagmoe bench placement`: the planner's predictions against measured training steps.

For one training config on `gpus` devices, every layout the runtime can run with one pipeline
group is priced by the planner (`placement.solver.price`, the same cost model `disagmoe plan`
searches) and then trained for a few steps: each attention/expert split a + e = gpus and the
colocated layout, for each micro-batch count m that divides the batch. The report sets the
planner's ranking against the measured one, each prediction against its measurement, and the
planner's pick against the best measured layout, all from one run on the same devices.

A layout that fails to run (e.g. out of memory) is reported with its error and the sweep goes on.
"""

from __future__ import annotations

import statistics
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from disagmoe.bench.train import mean_busy, median_step
from disagmoe.config import ClusterConfig, PlanConfig, TrainConfig, load_hardware, priced_as_trained
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import Candidates
from disagmoe.placement.solver import price
from disagmoe.roofline.report import seconds
from disagmoe.runtime.failures import TrainingInterrupted
from disagmoe.runtime.training.loop import METRICS_FILE
from disagmoe.runtime.observe.metrics import read_metrics


@dataclass(frozen=True)
class Layout:
    """One layout to price and time: a attention + e expert ranks (a = 0: colocated on e ranks)."""

    attention: int
    experts: int
    micro_batches: int

    @property
    def colocated(self) -> bool:
        return self.attention == 0

    def __str__(self) -> str:
        if self.colocated:
            return f"colocated {self.experts} m={self.micro_batches}"
        return f"{self.attention}A+{self.experts}E m={self.micro_batches}"

    def config(self, cfg: TrainConfig, steps: int, out_dir: Path) -> TrainConfig:
        """`cfg` with this layout, `steps` steps, no trace or eval, only the final checkpoint."""
        layout = (dict(mode="colocated", colocated_ranks=self.experts) if self.colocated else
                  dict(mode="disaggregated", attention_ranks=self.attention, expert_ranks=self.experts))
        return cfg.model_copy(update=dict(**layout, micro_batches=self.micro_batches, pipeline_groups=1,
                                          plan=None, steps=steps, out_dir=str(out_dir / str(self).replace(" ", "-")),
                                          trace=False, resume=False, checkpoint_every=0, checkpoint_minutes=0,
                                          keep_checkpoints=1, eval_every=0))


def layouts(cfg: TrainConfig, gpus: int, micro_batches: list[int]) -> list[Layout]:
    """Every split a + e = gpus (e at most the expert count) and colocated, for each m whose
    micro-batches divide the batch evenly over the data-parallel ranks."""
    if gpus < 2:
        raise ValueError(f"--gpus {gpus}: a placement needs at least 2 devices (1 attention + 1 expert)")
    experts = load_model(cfg.model).num_experts
    out = []
    for m in micro_batches:
        for a in range(1, gpus):
            if gpus - a <= experts and cfg.batch_size % (m * a) == 0:
                out.append(Layout(a, gpus - a, m))
        if cfg.batch_size % (m * gpus) == 0:
            out.append(Layout(0, gpus, m))
    if not out:
        raise ValueError(f"no layout of {gpus} devices divides batch_size={cfg.batch_size} evenly for "
                         f"micro-batches {micro_batches}; choose a batch_size that is a multiple of m * ranks")
    return out


def plan_request(cfg: TrainConfig, gpus: int) -> PlanConfig:
    """What the planner is asked for this config: its model and batch on `gpus` of its hardware, priced
    as the run trains (its optimizer, expert and dense precision, recomputation and experts backend)."""
    if cfg.hardware is None:
        raise ValueError("the config names no hardware preset; set hardware (e.g. hardware=h200-sxm) so the "
                         "planner can price the layouts")
    return PlanConfig(model=load_model(cfg.model), cluster=ClusterConfig(hardware=load_hardware(cfg.hardware),
                      num_gpus=gpus), seq_len=cfg.seq_len, global_batch_tokens=cfg.batch_size * cfg.seq_len,
                      max_pipeline_groups=1, offload_optimizer=cfg.offloads_to_host, **priced_as_trained(cfg))


def predict(request: PlanConfig, layout: Layout, batch_size: int) -> tuple[float, bool]:
    """The planner's step time for `layout` and whether it fits in memory."""
    dp = layout.experts if layout.colocated else layout.attention
    seqs = batch_size // (layout.micro_batches * dp)
    if layout.colocated:
        candidate = Candidates.one(0, layout.experts, 1, layout.micro_batches, seqs, colocated=True)
    else:
        candidate = Candidates.one(layout.attention, layout.experts, 1, layout.micro_batches, seqs)
    plan = price(request, candidate).plan
    return plan.step_time_s, plan.feasible


def measure(cfg: TrainConfig, layout: Layout, steps: int, warmup: int, out_dir: Path) -> dict:
    """Train `layout` for `steps` steps: its median step time and busy fractions, or its error."""
    from disagmoe.runtime.cluster.driver import DistributedTrainer

    lcfg = layout.config(cfg, steps, out_dir)
    try:
        DistributedTrainer(lcfg).run()
    except TrainingInterrupted:
        raise  # the user stopped the sweep
    except Exception as err:  # a layout that cannot run is a finding, not the end of the sweep
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    records = read_metrics(Path(lcfg.out_dir) / METRICS_FILE)
    return {"measured_step_s": median_step(records, warmup), "busy": mean_busy(records, warmup),
            "final_loss": records[-1]["loss"]}


def ranks_of(values: list[float]) -> list[int]:
    """1 for the smallest value, 2 for the next, ... (ties in order of appearance)."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    rank = [0] * len(values)
    for position, i in enumerate(order, start=1):
        rank[i] = position
    return rank


def spearman(a: list[float], b: list[float]) -> float | None:
    """Spearman's rank correlation of two equally long lists (None below 3 entries)."""
    n = len(a)
    if n < 3:
        return None
    ra, rb = ranks_of(a), ranks_of(b)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def summarise(rows: list[dict]) -> dict:
    """Over the layouts that ran: each prediction's error and both ranks (in place), and the
    planner's pick (the fastest predicted that it says fits) against the fastest measured."""
    ran = [r for r in rows if "measured_step_s" in r]
    if not ran:
        return {"layouts_run": 0}
    predicted, measured = [r["predicted_step_s"] for r in ran], [r["measured_step_s"] for r in ran]
    for r, predicted_rank, measured_rank in zip(ran, ranks_of(predicted), ranks_of(measured), strict=True):
        r.update(prediction_error=r["predicted_step_s"] / r["measured_step_s"] - 1,
                 predicted_rank=predicted_rank, measured_rank=measured_rank)
    best = min(ran, key=lambda r: r["measured_step_s"])
    pick = min((r for r in rows if r["fits"]), key=lambda r: r["predicted_step_s"], default=None)
    pick_ran = pick is not None and "measured_step_s" in pick
    return {
        "layouts_run": len(ran),
        "planner_pick": None if pick is None else pick["layout"],
        "planner_pick_ran": pick_ran,
        "best_measured": best["layout"],
        "pick_vs_best": pick["measured_step_s"] / best["measured_step_s"] - 1 if pick_ran else None,
        "rank_correlation": spearman(predicted, measured),
        "mean_abs_prediction_error": statistics.fmean(abs(r["prediction_error"]) for r in ran),
    }


def run(cfg: TrainConfig, gpus: int, micro_batches: list[int], steps: int, warmup: int,
        log: Callable[[str], None]) -> dict:
    """Price and train every layout (module docstring); the rows and the summary."""
    if warmup >= steps:
        raise ValueError(f"--warmup {warmup} leaves no timed step of --steps {steps}; time more steps than warm-up")
    request = plan_request(cfg, gpus)
    todo = layouts(cfg, gpus, micro_batches)
    rows = []
    with tempfile.TemporaryDirectory(prefix="disagmoe-bench-placement-") as tmp:
        for i, layout in enumerate(todo, start=1):
            predicted, fits = predict(request, layout, cfg.batch_size)
            row = {"layout": str(layout), "attention": layout.attention, "experts": layout.experts,
                   "micro_batches": layout.micro_batches, "predicted_step_s": predicted, "fits": fits}
            log(f"[{i}/{len(todo)}] {layout}: predicted {seconds(predicted)}"
                + ("" if fits else " (the planner says it does not fit; timing it anyway)"))
            row.update(measure(cfg, layout, steps, warmup, Path(tmp)))
            if "measured_step_s" in row:
                log(f"    measured {seconds(row['measured_step_s'])}")
            else:
                log(f"    failed: {row['error']}")
            rows.append(row)
    summary = summarise(rows)
    return {"config": {"model": load_model(cfg.model).name, "hardware": request.cluster.hardware.name, "gpus": gpus,
                       "device": cfg.device, "transport": cfg.transport, "batch_size": cfg.batch_size,
                       "seq_len": cfg.seq_len, "steps": steps, "warmup": warmup},
            "layouts": rows, "summary": summary}
