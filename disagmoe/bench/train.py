"""`disagmoe bench train`: whole training steps of one config, in several layouts, in one run.

Each mode trains the same model on the same data for the same number of steps on the same
devices (colocated gets as many ranks as attention + expert ranks together); the figure is the
median step time after the first `warmup` steps, and every mode is set against the colocated
layout measured in the same run (or the first mode, if colocated is not among them).
"""

from __future__ import annotations

import platform
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from disagmoe.config import TrainConfig
from disagmoe.runtime.metrics import read_metrics
from disagmoe.runtime.loop import METRICS_FILE
from disagmoe.runtime.trainer import SingleProcessTrainer

MODES = ("single", "disaggregated", "colocated")


def mode_config(cfg: TrainConfig, mode: str, steps: int, out_dir: Path) -> TrainConfig:
    """`cfg` for one timed mode: no trace, no checkpoints beyond the final one, fresh output."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    update = dict(mode=mode, steps=steps, out_dir=str(out_dir / mode), trace=False, resume=False,
                  checkpoint_every=0, checkpoint_minutes=0, keep_checkpoints=1, eval_every=0)
    if mode == "colocated":
        update["colocated_ranks"] = cfg.attention_ranks + cfg.expert_ranks
    return cfg.model_copy(update=update)


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


def summarise(rows: list[dict]) -> list[dict]:
    """Add each mode's speedup over the baseline (colocated if measured, else the first mode)."""
    base = next((r for r in rows if r["mode"] == "colocated"), rows[0])
    return [{**r, "baseline": base["mode"], "speedup": base["median_step_s"] / r["median_step_s"]} for r in rows]


def run(cfg: TrainConfig, modes: list[str], steps: int, warmup: int,
        log: Callable[[str], None]) -> dict:
    rows = []
    with tempfile.TemporaryDirectory(prefix="disagmoe-bench-train-") as tmp:
        for mode in modes:
            mcfg = mode_config(cfg, mode, steps, Path(tmp))
            log(f"{mode}: {steps} steps")
            if mode == "single":
                SingleProcessTrainer(mcfg).run()
            else:
                from disagmoe.runtime.driver import DistributedTrainer

                DistributedTrainer(mcfg).run()
            records = read_metrics(Path(mcfg.out_dir) / METRICS_FILE)
            step_s = median_step(records, warmup)
            ranks = {"single": 1, "colocated": mcfg.colocated_ranks,
                     "disaggregated": cfg.attention_ranks + cfg.expert_ranks}[mode]
            rows.append({"mode": mode, "ranks": ranks, "median_step_s": step_s,
                         "tokens_per_s": records[-1]["tokens"] / step_s, "final_loss": records[-1]["loss"],
                         "busy": mean_busy(records, warmup)})
    device = (torch.cuda.get_device_name(0) if cfg.device == "cuda" and torch.cuda.is_available()
              else platform.processor() or platform.machine())
    return {"environment": {"device": device, "torch": torch.__version__, "python": platform.python_version(),
                            "transport": cfg.transport, "experts_backend": cfg.experts_backend},
            "steps": steps, "warmup": warmup, "modes": summarise(rows)}
