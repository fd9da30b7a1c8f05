"""`disagmoe bench plan`: how fast the planner answers, for every preset and cluster size.

Runs `disagmoe plan ... --json` as a user would (a fresh process: imports included) for each
case and reports the median wall time, the chosen layout and its predicted speedup. CPU only.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

CASES = [  # (model, hardware, GPUs)
    ("deepseek-v3", "gb200-nvl72", 1152),
    ("deepseek-v3", "gb200-nvl72", 72),
    ("qwen3-235b-a22b", "gb200-nvl72", 72),
    ("qwen3-235b-a22b", "h200-sxm", 64),
    ("qwen3-30b-a3b", "h200-sxm", 8),
    ("mixtral-8x7b", "h200-sxm", 16),
    ("mixtral-8x22b", "b200", 64),
]


def time_plan(model: str, hardware: str, gpus: int, repeats: int) -> dict:
    cmd = [sys.executable, "-m", "disagmoe", "plan", "--model", model, "--hardware", hardware,
           "--gpus", str(gpus), "--json"]
    walls, plan = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        walls.append(time.perf_counter() - start)
        if proc.returncode not in (0, 1):
            raise RuntimeError(f"{' '.join(cmd[2:])} failed: {proc.stderr.strip()}")
        plan = json.loads(proc.stdout)
    return {
        "command": "disagmoe " + " ".join(cmd[3:]), "model": model, "hardware": hardware, "gpus": gpus,
        "wall_s_median": statistics.median(walls), "wall_s_max": max(walls), "repeats": repeats,
        "feasible": plan["feasible"], "layout": plan["layout"], "attention_gpus": plan["attention_gpus"],
        "expert_gpus": plan["expert_gpus"], "pipeline_groups": plan["pipeline_groups"],
        "micro_batches": plan["micro_batches"], "step_time_s": plan["step_time_s"],
        "speedup_vs_colocated": plan["speedup_vs_colocated"],
    }


def run(repeats: int, log: Callable[[str], None]) -> dict:
    rows = []
    for model, hardware, gpus in CASES:
        log(f"planning {model} on {gpus} x {hardware} ({repeats} runs)")
        rows.append(time_plan(model, hardware, gpus, repeats))
    return {
        "environment": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                        "python": platform.python_version(),
                        "date": time.strftime("%Y-%m-%d")},
        "cases": rows,
    }
