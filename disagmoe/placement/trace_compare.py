"""Predicted against measured, per schedule-op kind, for a real run's trace (`roofline --compare`).

The trace is the `trace.json` `disagmoe train` writes with `trace: true` (Chrome trace events,
`runtime.observe.trace`): per rank, one span per op, named as the op ('AttentionForward L1 mb0', 'Send
dispatch L0 mb1', 'Recv combine L0 mb1', 'Loss mb0', 'OptimizerStep'). A rank's spans split into
steps after each 'OptimizerStep'. Measured, per kind, over the steps after the first (the first
warms up; a one-step trace uses it) and every rank that runs the kind:

- a compute op: its span (on a GPU the op's kernels, CUDA events; on a CPU its wall time);
- a message payload: for each receive, from when both the receiver waited and the latest sender
  of that key (in that step) had posted it, to when the receive returned. On a GPU the NCCL
  receive is stream-ordered and returns at once, so this reads near zero there: the message's
  time then shows in the op that consumes it, not here.

Predicted: the cost model's time of each op (`placement.replay.op_times`) for the run's layout
on the given hardware, and its step time (replayed for a disaggregated layout). No torch.

Every hardware config describes a GPU, so `check_device` refuses a trace of a CPU run (the
trace's own `otherData.device`, else its config's `device`): a CPU's spans against a GPU's
prices would read -100% in every row. The result counts the ops per step that found a prediction.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from disagmoe.config import ClusterConfig, HardwareConfig, ModelConfig, PlanConfig, TrainConfig, priced_as_trained
from disagmoe.model_ref import load_model
from disagmoe.placement.cost import Candidates, evaluate
from disagmoe.placement.replay import op_times, replayed_step_s
from disagmoe.placement.solver import problem_of
from disagmoe.safe_io import MAX_TRACE_BYTES, read_input

Span = tuple[float, float]  # (start_us, end_us)


@dataclass(frozen=True)
class TraceSteps:
    """steps[k][rank][name] = (start_us, end_us) of that op's span in step k."""

    steps: list[dict[int, dict[str, Span]]]
    categories: dict[str, str]  # span name -> compute | send | wait
    device: str | None = None  # the run's (cpu, cuda) as the trace recorded it; None in older traces


def read_trace(path: Path) -> TraceSteps:
    """The trace's spans grouped by step (see the module docstring); ValueError naming the file if
    it is not one (not a regular file, over `MAX_TRACE_BYTES`, not JSON, or a span whose fields
    have the wrong types)."""
    what = f"--compare {path}: not a trace.json of `disagmoe train` (trace: true)"
    data = read_input(path, "--compare", MAX_TRACE_BYTES)
    try:
        parsed = json.loads(data)
        events = parsed["traceEvents"]
        device = (parsed.get("otherData") or {}).get("device")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as err:
        raise ValueError(f"{what}: {type(err).__name__} {err}") from None
    if not isinstance(events, list):
        raise ValueError(f"{what}: traceEvents is {type(events).__name__}, not a list")
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    categories: dict[str, str] = {}
    for n, e in enumerate(events):
        if isinstance(e, dict) and e.get("ph") == "X":
            _check_span(e, f"{what}: traceEvents[{n}]")
            by_rank[e["pid"]].append(e)
            categories[e["name"]] = e["cat"]
    steps: list[dict[int, dict[str, Span]]] = []
    for rank, spans in by_rank.items():
        k = 0
        for e in sorted(spans, key=lambda e: (e["ts"], e["name"] == "OptimizerStep")):
            while len(steps) <= k:
                steps.append({})
            steps[k].setdefault(rank, {})[e["name"]] = (e["ts"], e["ts"] + e["dur"])
            k += e["name"] == "OptimizerStep"
    steps = [s for s in steps if any("OptimizerStep" in ops for ops in s.values())]
    if not steps:
        raise ValueError(f"--compare {path}: the trace has no complete step (no OptimizerStep span)")
    return TraceSteps(steps, categories, device if isinstance(device, str) else None)


def check_device(trace: TraceSteps, trace_path: Path, cfg: TrainConfig, config_path: str, hw: HardwareConfig) -> None:
    """ValueError, in one line with the fix, for a trace of another device than `hw` (a GPU)."""
    device = trace.device or cfg.device
    if device == "cuda":
        return
    told = "as the trace records" if trace.device else f"the device of {config_path}"
    raise ValueError(f"--compare {trace_path}: the trace ran on {device} ({told}) but --hardware {hw.name} prices a "
                     "GPU, so every op would compare a CPU time with a GPU prediction; compare the trace of a "
                     "device: cuda run (trace: true) with the hardware it ran on")


SPAN_FIELDS = {"pid": (int,), "name": (str,), "cat": (str,), "ts": (int, float), "dur": (int, float)}


def _check_span(event: dict[str, Any], where: str) -> None:
    """ValueError naming the field of a complete span ("ph": "X") that is missing or mistyped."""
    for key, types in SPAN_FIELDS.items():
        value = event.get(key)
        if isinstance(value, bool) or not isinstance(value, types) or (
                isinstance(value, float) and not math.isfinite(value)) or (key == "name" and not value.strip()):
            raise ValueError(f"{where}: {key} is {value!r}, expected "
                             f"{'a non-empty string' if key == 'name' else ' or '.join(t.__name__ for t in types)}")


def op_kind(name: str, num_dense_layers: int) -> str | None:
    """'AttentionForward L1 mb0' -> 'AttentionForward' ('... (dense)' for a dense layer),
    'Recv dispatch L0 mb1' -> 'Send dispatch' (a message is measured at its receive); None for
    spans that are no op of their own (a send's posting, the end-of-step wait)."""
    words = name.split()
    if words[0] == "Recv":
        return f"Send {words[1]}"
    if words[0] in ("Send", "wait"):
        return None
    layer = next((int(w[1:]) for w in words[1:] if w.startswith("L")), None)
    dense = layer is not None and layer < num_dense_layers and words[0].startswith("Attention")
    return words[0] + (" (dense)" if dense else "")


def measured_by_kind(trace: TraceSteps, num_dense_layers: int) -> dict[str, list[float]]:
    """Seconds of every op of each kind in the measured steps (module docstring)."""
    steps = trace.steps[1:] or trace.steps
    out: dict[str, list[float]] = defaultdict(list)
    for step in steps:
        posted: dict[str, float] = {}  # send span name -> latest posting start of the step
        for ops in step.values():
            for name, (start, _) in ops.items():
                if name.startswith("Send "):
                    posted[name] = max(posted.get(name, start), start)
        for ops in step.values():
            for name, (start, end) in ops.items():
                kind = op_kind(name, num_dense_layers)
                if kind is None:
                    continue
                if name.startswith("Recv "):
                    start = max(start, posted.get("Send " + name[len("Recv "):], start))
                out[kind].append(max(end - start, 0.0) / 1e6)
    return out


def measured_step_s(trace: TraceSteps) -> float:
    """Median over the measured steps of first span start to last OptimizerStep end."""
    steps = trace.steps[1:] or trace.steps
    walls = [max(e for ops in s.values() for _, e in ops.values()) - min(b for ops in s.values() for b, _ in ops.values())
             for s in steps]
    return statistics.median(walls) / 1e6


def layout_gpus(cfg: TrainConfig) -> int:
    """The GPUs `cfg`'s layout trains on, one rank each (a run sharing GPUs, `ranks_per_gpu`, is a
    test of the layout: priced, as planned, on a GPU per rank)."""
    if cfg.mode == "disaggregated":
        return cfg.attention_ranks + cfg.expert_ranks
    return 1 if cfg.mode == "single" else cfg.colocated_ranks


def run_request(cfg: TrainConfig, model: ModelConfig, hw: HardwareConfig) -> tuple[PlanConfig, Candidates]:
    """The planner's request and the candidate for the layout `cfg` trained, priced as it trained
    (`config.priced_as_trained`: its expert and dense precision, recomputation and experts backend)."""
    gpus = layout_gpus(cfg)
    if cfg.mode == "disaggregated":
        dp = cfg.attention_ranks // cfg.pipeline_groups
        cand = lambda seqs: Candidates.one(cfg.attention_ranks, cfg.expert_ranks, cfg.pipeline_groups,  # noqa: E731
                                           cfg.micro_batches, seqs)
    else:
        dp = gpus
        cand = lambda seqs: Candidates.one(0, gpus, 1, cfg.micro_batches, seqs, colocated=True)  # noqa: E731
    seqs = cfg.batch_size // (cfg.micro_batches * dp)
    if seqs < 1:
        raise ValueError(f"batch_size={cfg.batch_size} gives no sequence per micro-batch per data-parallel rank")
    req = PlanConfig(model=model, cluster=ClusterConfig(hardware=hw, num_gpus=gpus), seq_len=cfg.seq_len,
                     global_batch_tokens=cfg.batch_size * cfg.seq_len, max_pipeline_groups=cfg.pipeline_groups,
                     offload_optimizer=cfg.offloads_to_host and hw.host_link_gbps is not None,
                     **priced_as_trained(cfg))
    return req, cand(seqs)


COMMUNICATION = ("Send ",)


def compare(trace_path: Path, cfg: TrainConfig, hw: HardwareConfig) -> dict[str, Any]:
    """Rows of (kind, ops per step, predicted s, measured s, error, measured share of the step),
    the ops per step and how many of them found a prediction, and the step itself, as JSON-able
    data (whatever the trace's device: the CLI calls `check_device` first)."""
    model = load_model(cfg.model)
    req, cand = run_request(cfg, model, hw)
    prob = problem_of(req)
    cost = evaluate(prob, cand)
    times = op_times(cost, prob)
    predicted = times.by_kind()
    predicted["AttentionForward (dense)"] = times.attention_forward[False]
    predicted["AttentionBackward (dense)"] = times.attention_backward[False]
    trace = read_trace(trace_path)
    measured = measured_by_kind(trace, model.num_dense_layers)
    steps = len(trace.steps[1:] or trace.steps)
    step_meas = measured_step_s(trace)
    rows = []
    for kind, seconds in sorted(measured.items()):
        mean = statistics.fmean(seconds)
        pred = predicted.get(kind)
        rows.append({"kind": kind, "communication": kind.startswith(COMMUNICATION),
                     "ops_per_step": len(seconds) / steps, "predicted_s": pred, "measured_s": mean,
                     "error": None if pred is None or mean == 0 else pred / mean - 1,
                     "measured_share": sum(seconds) / steps / step_meas if step_meas else None})
    step_pred = float(cost.step_s[0]) if cand.colocated else replayed_step_s(cost, prob, cand)
    return {"trace": str(trace_path), "mode": cfg.mode, "hardware": hw.name, "device": trace.device or cfg.device,
            "steps_measured": steps, "rows": rows,
            "ops_per_step": sum(r["ops_per_step"] for r in rows),
            "ops_matched_per_step": sum(r["ops_per_step"] for r in rows if r["predicted_s"] is not None),
            "unmatched_kinds": [r["kind"] for r in rows if r["predicted_s"] is None],
            "step": {"predicted_s": step_pred, "measured_s": step_meas,
                     "error": step_pred / step_meas - 1 if step_meas else None}}
