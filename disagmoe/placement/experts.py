"""Map experts to expert GPUs so that each GPU gets about the same expected load.

Loads come from a routing histogram (per MoE layer, per expert: tokens routed in a previous
run, any scale) or are uniform. Each GPU holds the same number of expert slots (memory stays
even); hot experts may take spare slots as replicas, each replica serving an equal share of
that expert's tokens (replica r serves data-parallel index mod n_replicas == r; with fewer
data-parallel ranks than replicas, each splits its rows over several, see runtime.plan_layout).
"""

from __future__ import annotations

import heapq
import json
import math
from pathlib import Path
from typing import Any

from disagmoe.safe_io import MAX_HISTOGRAM_BYTES, read_input


def map_layer(loads: list[float], gpus: int, max_replicas: int = 0) -> list[list[int]]:
    """expert -> list of GPU indices (0..gpus-1) for one layer; greedy largest-load-first.

    With at least as many GPUs as experts, every expert gets gpus // n replicas and the
    leftover GPUs replicate the hottest experts. Otherwise each GPU has ceil(n / gpus) slots;
    spare slots (and up to `max_replicas` extra replicas per expert) go to the hottest experts.
    """
    n = len(loads)
    if n == 0 or gpus <= 0:
        raise ValueError("need at least one expert and one GPU")
    if any(x < 0 for x in loads):
        raise ValueError("expert loads must be non-negative")
    total = float(sum(loads))
    loads = [x / total for x in loads] if total > 0 else [1.0 / n] * n
    slots_per_gpu = max(1, -(-n // gpus)) + (1 if max_replicas > 0 and gpus < n else 0)
    spare = slots_per_gpu * gpus - n
    replicas = [1] * n
    if gpus >= n:
        replicas = [gpus // n] * n
        spare = gpus - n * (gpus // n)
        cap = gpus // n + spare
    else:
        cap = 1 + max_replicas
    # Give spare slots, one at a time, to the expert with the largest load per replica.
    heap = [(-loads[e] / replicas[e], e) for e in range(n)]
    heapq.heapify(heap)
    while spare > 0 and heap:
        _, e = heapq.heappop(heap)
        if replicas[e] >= min(cap, gpus):
            continue
        replicas[e] += 1
        spare -= 1
        heapq.heappush(heap, (-loads[e] / replicas[e], e))
    # Largest-processing-time-first over (expert, replica) items, respecting slots per GPU and
    # never putting two replicas of one expert on the same GPU.
    items = sorted(((loads[e] / replicas[e], e) for e in range(n) for _ in range(replicas[e])),
                   key=lambda t: (-t[0], t[1]))
    owners: list[list[int]] = [[] for _ in range(n)]
    open_gpus = [(0.0, 0, g) for g in range(gpus)]  # (load, slots used, gpu): a min-heap
    for share, e in items:
        skipped = []
        while open_gpus and open_gpus[0][2] in owners[e]:
            skipped.append(heapq.heappop(open_gpus))
        if not open_gpus:  # more replicas of one expert than GPUs with a free slot
            raise AssertionError("replica cap exceeded the GPUs with free slots")
        load, used, g = heapq.heappop(open_gpus)
        owners[e].append(g)
        if used + 1 < slots_per_gpu:
            heapq.heappush(open_gpus, (load + share, used + 1, g))
        for entry in skipped:
            heapq.heappush(open_gpus, entry)
    return [sorted(o) for o in owners]


def imbalance(loads: list[float], owners: list[list[int]], gpus: int) -> float:
    """Max over GPUs of expected load, over the mean (1.0 = perfectly balanced)."""
    per_gpu = [0.0] * gpus
    for e, gs in enumerate(owners):
        for g in gs:
            per_gpu[g] += loads[e] / len(gs)
    mean = sum(per_gpu) / gpus
    return max(per_gpu) / mean if mean > 0 else 1.0


def read_histogram(path: str | Path, num_moe_layers: int, num_experts: int) -> list[list[float]]:
    """Per-layer expert loads summed over the steps of a `train` metrics JSONL (key `expert_load`);
    a ValueError naming the file and line for anything else (not a regular file, over
    `MAX_HISTOGRAM_BYTES`, a line that is not JSON, an `expert_load` that is not layers x experts
    of non-negative finite numbers)."""
    path = Path(path)
    data = read_input(path, "--load-histogram", MAX_HISTOGRAM_BYTES)
    total: list[list[float]] | None = None
    for i, raw in enumerate(data.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested past the parser
            raise ValueError(f"{path}:{i} is not JSON; expected the metrics JSONL that `disagmoe train` writes") from None
        load = record.get("expert_load") if isinstance(record, dict) else None
        if load is None:
            continue
        rows = _load_rows(load, num_moe_layers, num_experts, f"--load-histogram {path}:{i}")
        if total is None:
            total = [[0.0] * num_experts for _ in range(num_moe_layers)]
        for row_total, row in zip(total, rows):
            for e, x in enumerate(row):
                row_total[e] += x
    if total is None:
        raise ValueError(f"{path} holds no 'expert_load' records; pass the metrics.jsonl of a training run")
    return total


def _load_rows(load: Any, num_moe_layers: int, num_experts: int, where: str) -> list[list[float]]:
    """A record's `expert_load` as floats, or a ValueError naming `where` and what is wrong."""
    shape = f"the model has {num_moe_layers} MoE layers x {num_experts} experts; was it written by a run of this model?"
    if not isinstance(load, list) or not all(isinstance(row, list) for row in load):
        raise ValueError(f"{where}: expert_load is {type(load).__name__ if not isinstance(load, list) else 'a list'} "
                         f"but must be a list of per-layer lists of loads; {shape}")
    if len(load) != num_moe_layers or any(len(row) != num_experts for row in load):
        raise ValueError(f"{where}: expert_load is {len(load)} layers x {len(load[0]) if load else 0} experts, but {shape}")
    for j, row in enumerate(load):
        for e, x in enumerate(row):
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x < 0:
                raise ValueError(f"{where}: MoE layer {j}, expert {e} has load {x!r}: loads are non-negative "
                                 "finite numbers (token counts)")
    return [[float(x) for x in row] for row in load]
