"""Roofline reports: rows per stage (JSON-able), a rich table, and a PNG (a log-log roofline of
the stages that do arithmetic beside a bar of every stage's time, communication included).

A row is one stage in one pass on one GPU: its FLOPs, bytes per memory or link, arithmetic
intensity against HBM, its time under each ceiling, the roofline time and the binding ceiling.
matplotlib is imported only when a plot is asked for.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from disagmoe.roofline.ceilings import Ceilings
from disagmoe.roofline.stages import Work


def scalar(w: Work) -> Work:
    """The first candidate of a vectorised `Work`, as plain floats."""
    return Work(*(float(np.asarray(getattr(w, f.name)).ravel()[0]) for f in fields(Work)))


def stage_row(name: str, group: str, pass_: str, w: Work, ceil: Ceilings, repeat: float = 1.0) -> dict[str, Any]:
    """One report row; `repeat` multiplies the work (e.g. layers x micro-batches for a step)."""
    w, ceil = scalar(w).scale(repeat), ceil.first()
    times = {k: float(v) for k, v in ceil.times(w).items()}
    intensity = w.flops / w.hbm_bytes if w.hbm_bytes else None
    return {
        "stage": name, "group": group, "pass": pass_, "flops": w.flops, "hbm_bytes": w.hbm_bytes,
        "nvlink_bytes": w.nvlink_bytes, "scaleout_bytes": w.scaleout_bytes,
        "intensity_flop_per_byte": intensity, "times_s": times, "time_s": float(ceil.time(w)),
        "bound": ceil.bound(w),
    }


def _si(x: float, unit: str) -> str:
    if x == 0:
        return "-"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3g} {prefix}{unit}"
    return f"{x:.3g} {unit}"


TIME_UNITS = (("s", 1.0), ("ms", 1e-3), ("us", 1e-6), ("ns", 1e-9))
MEMORY_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10), ("B", 1))


def _in_unit(x: float, units: tuple[tuple[str, float], ...]) -> str:
    """`x` in the largest unit it reaches at least once (the smallest unit for anything below),
    three significant digits without an exponent: a non-zero value never reads as 0."""
    if not math.isfinite(x):
        return f"{x} {units[0][0]}"
    name, scale = next(((n, s) for n, s in units if abs(x) >= s), units[-1])
    v = x / scale
    return f"{v:.0f} {name}" if abs(v) >= 100 else f"{v:.3g} {name}"


def seconds(t: float | None) -> str:
    """A time in the unit that suits it (s, ms, us, ns), e.g. '10.3 us', '253 ms'; '-' for 0 or None."""
    return "-" if not t else _in_unit(t, TIME_UNITS)


def memory(gib: float | None) -> str:
    """A size given in GiB, in the unit that suits it (GiB, MiB, KiB, B); '-' for 0 or None."""
    return "-" if not gib else _in_unit(gib * 2**30, MEMORY_UNITS)


def table(rows: list[dict[str, Any]], title: str) -> Table:
    t = Table(title=title, title_justify="left")
    for col in ("stage", "pass", "FLOPs", "HBM", "NVLink", "scale-out", "FLOP/B", "time", "bound"):
        t.add_column(col, justify="left" if col in ("stage", "pass", "bound") else "right", no_wrap=True)
    for r in rows:
        ai = r["intensity_flop_per_byte"]
        t.add_row(r["stage"], r["pass"], _si(r["flops"], "F"), _si(r["hbm_bytes"], "B"),
                  _si(r["nvlink_bytes"], "B"), _si(r["scaleout_bytes"], "B"),
                  f"{ai:.0f}" if ai else "-", seconds(r["time_s"]), r["bound"])
    return t


COMM_COLOR = "tab:red"


def plot(rows: list[dict[str, Any]], ceil: Ceilings, path: str | Path, title: str,
         step_rows: list[dict[str, Any]] | None = None) -> None:
    """Write `figure(...)` as a PNG (matplotlib imported here, Agg backend)."""
    import matplotlib.pyplot as plt

    fig = figure(rows, ceil, title, step_rows)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(rows: list[dict[str, Any]], ceil: Ceilings, title: str, step_rows: list[dict[str, Any]] | None = None):
    """Two panels. Left, a log-log roofline (`roofline_points`): one point per stage and pass
    that does arithmetic, each against the intensity of the memory or link that binds it and
    drawn under that roof, forward and backward told apart by marker, the area by the stage's
    share of the step, labels in a column beside the points (no two overlap). Right, every stage
    of `step_rows` (default `rows`) as a bar of its time, communication and once-per-step stages
    included (they have no arithmetic intensity: dispatch, combine, all-reduce, the optimizer),
    those bound by a link or latency drawn in red, so a step that waits on links does not look
    compute-bound. Returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bars) = plt.subplots(1, 2, figsize=(17, 8), gridspec_kw={"width_ratios": [1.25, 1]})
    points = roofline_points(rows, ceil, step_rows if step_rows is not None else rows)
    _roofline_panel(ax, points, ceil, title)
    _time_panel(bars, step_rows if step_rows is not None else rows)
    fig.tight_layout()
    _label_column(ax, points)
    return fig


ROOF_OF = {"nvlink": "nvlink", "scale-out": "scaleout"}  # a link-bound stage's roof; any other bound: HBM
PASS_MARKER = {"fwd": "o", "bwd": "^", "step": "s"}
GROUP_COLOR = {"attention": "tab:blue", "expert": "tab:green", "link": COMM_COLOR}


def roofline_points(rows: list[dict[str, Any]], ceil: Ceilings,
                    step_rows: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """The left panel's data: per stage and pass with FLOPs, its roof (the memory or link that
    binds it, HBM unless a link does), its intensity against that roof's bytes, the TFLOP/s the
    model attains (FLOPs over the stage's time: under its roof when latency binds), and its share
    of the step's time (from `step_rows`, the same stage and pass; 0 when absent)."""
    step_time = {(r["stage"], r["pass"]): r["time_s"] for r in step_rows or []}
    total = sum(step_time.values()) or 1.0
    out = []
    for r in rows:
        roof = ROOF_OF.get(r["bound"], "hbm")
        moved = r[f"{roof}_bytes"]
        if r["flops"] <= 0 or moved <= 0 or r["time_s"] <= 0:
            continue
        out.append({"stage": r["stage"], "pass": r["pass"], "group": r["group"], "bound": r["bound"], "roof": roof,
                    "intensity": r["flops"] / moved, "tflops": r["flops"] / r["time_s"] / 1e12,
                    "share": step_time.get((r["stage"], r["pass"]), 0.0) / total})
    return out


def _roofline_panel(ax, points: list[dict[str, Any]], ceil: Ceilings, title: str) -> None:
    peak = ceil.flops_per_s / 1e12
    lo = min([p["intensity"] for p in points] + [1.0]) / 2
    hi = max([p["intensity"] for p in points] + [ceil.ridge("hbm")]) * 2
    span = np.log10(hi) - np.log10(lo)
    x_max = 10 ** (np.log10(lo) + span / 0.62)  # the right 38% holds the label column
    xs = np.logspace(np.log10(lo), np.log10(x_max), 400)
    for name, rate, style in (("HBM", ceil.hbm_bytes_per_s, "-"), ("NVLink", ceil.nvlink_bytes_per_s, "--"),
                              ("scale-out", ceil.scaleout_bytes_per_s, ":")):
        ax.plot(xs, np.minimum(peak, xs * rate / 1e12), style, color="0.35", lw=1,
                label=f"{name} roof: FLOP per {name} byte (ridge {peak * 1e12 / rate:.0f})")
    most = max([p["share"] for p in points] + [1e-12])
    for p in points:
        ax.scatter([p["intensity"]], [p["tflops"]], s=20 + 280 * p["share"] / most, marker=PASS_MARKER.get(p["pass"], "o"),
                   color=GROUP_COLOR.get(p["group"], "tab:gray"), alpha=0.75, edgecolor="black", linewidth=0.5,
                   zorder=3)
    ys = [p["tflops"] for p in points] or [peak]
    ax.set_xlim(lo, x_max)
    ax.set_ylim(min(ys) / 3, peak * 2)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity: FLOP per byte of the memory or link that binds the stage")
    ax.set_ylabel("attained TFLOP/s (the model's)")
    ax.set_title(title + "\nmarker: o forward, ^ backward; area: the stage's time per step; blue attention, "
                 "green experts", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="lower left")


LABEL_POINTS = 7  # label font size


def _label_column(ax, points: list[dict[str, Any]]) -> None:
    """A label per point in a column at the panel's right, ordered as the points' heights and
    spaced by at least a line (leader lines to the points), so no two labels overlap."""
    if not points:
        return
    fig = ax.figure
    height_pt = ax.get_position().height * fig.get_figheight() * 72
    gap = 1.35 * LABEL_POINTS / height_pt  # one line, in axes fractions
    y0, y1 = (np.log10(v) for v in ax.get_ylim())
    order = sorted(range(len(points)), key=lambda i: (points[i]["tflops"], points[i]["stage"], points[i]["pass"]))
    want = [(np.log10(points[i]["tflops"]) - y0) / (y1 - y0) for i in order]
    placed: list[float] = []
    for y in want:  # upwards, each at least a line above the one below
        placed.append(max(y, placed[-1] + gap) if placed else max(y, gap / 2))
    overflow = placed[-1] - (1 - gap / 2) if placed else 0.0
    if overflow > 0:  # shift down, keeping the spacing, as far as the bottom allows
        placed = [max(y - overflow, gap / 2 + k * gap) for k, y in enumerate(placed)]
    for i, y in zip(order, placed, strict=True):
        p = points[i]
        ax.annotate(f"{p['stage']} ({p['pass']}, {p['bound']})", (p["intensity"], p["tflops"]),
                    xytext=(0.64, y), textcoords="axes fraction", fontsize=LABEL_POINTS, va="center",
                    arrowprops=dict(arrowstyle="-", lw=0.4, alpha=0.5, color="0.4"))


def is_communication(row: dict[str, Any]) -> bool:
    """A stage that moves data between GPUs or waits on a message (no arithmetic to plot)."""
    return row["group"] == "link" or row["bound"] in ("nvlink", "scale-out", "latency")


def _time_panel(ax, rows: list[dict[str, Any]]) -> None:
    shown = sorted((r for r in rows if r["time_s"] > 0), key=lambda r: r["time_s"])
    labels = [f"{r['stage']} ({r['pass']})" for r in shown]
    colors = [COMM_COLOR if is_communication(r) else "tab:blue" for r in shown]
    bars = ax.barh(range(len(shown)), [r["time_s"] for r in shown], color=colors)
    for bar, r in zip(bars, shown, strict=True):  # once per step (all-reduce, optimizer): hatched
        bar.set_hatch("//" if r["pass"] == "step" else "")
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    for i, r in enumerate(shown):
        ax.annotate(f"{seconds(r['time_s'])} {r['bound']}", (r["time_s"], i), fontsize=6,
                    xytext=(3, -2), textcoords="offset points")
    from matplotlib.ticker import FuncFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: seconds(v) if v > 0 else "0"))
    ax.set_xlabel("time on the GPUs that run it")
    ax.set_title("every stage's time per step; red: links and latency (dispatch, combine, all-reduce); "
                 "hatched: once per step", fontsize=9)
    ax.grid(True, axis="x", alpha=0.3)


def compare_table(result: dict[str, Any], title: str) -> Table:
    """Predicted vs measured per schedule-op kind (`placement.trace_compare.compare`'s rows)."""
    t = Table(title=title, title_justify="left")
    for col in ("op kind", "ops/step", "predicted", "measured", "error", "share of step"):
        t.add_column(col, justify="left" if col == "op kind" else "right", no_wrap=True)
    for r in sorted(result["rows"], key=lambda r: -(r["measured_share"] or 0)):
        name = f"[red]{r['kind']}[/]" if r["communication"] else r["kind"]
        error = "-" if r["error"] is None else f"{r['error']:+.0%}"
        pred = "-" if r["predicted_s"] is None else seconds(r["predicted_s"])
        share = "-" if r["measured_share"] is None else f"{r['measured_share']:.0%}"
        t.add_row(name, f"{r['ops_per_step']:g}", pred, seconds(r["measured_s"]), error, share)
    s = result["step"]
    t.add_row("[bold]step[/]", "1", seconds(s["predicted_s"]), seconds(s["measured_s"]),
              "-" if s["error"] is None else f"{s['error']:+.0%}", "100%")
    return t


def compare_plot(result: dict[str, Any], path: str | Path, title: str) -> None:
    """A PNG of `compare_table`: per op kind a bar of the measured time per op and a mark of the
    predicted one (log scale), communication (message payloads) in red with its own marker."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = sorted(result["rows"], key=lambda r: r["measured_s"])
    fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 2))
    ys = range(len(rows))
    colors = [COMM_COLOR if r["communication"] else "tab:blue" for r in rows]
    ax.barh(ys, [max(r["measured_s"], 1e-9) for r in rows], color=colors, alpha=0.45, label="measured")
    for y, r in zip(ys, rows, strict=True):
        if r["predicted_s"]:
            ax.scatter([r["predicted_s"]], [y], marker="s" if r["communication"] else "D", zorder=3,
                       color=COMM_COLOR if r["communication"] else "tab:blue", edgecolor="black")
        err = "" if r["error"] is None else f" {r['error']:+.0%}"
        ax.annotate(f"{seconds(r['measured_s'])}{err}", (max(r["measured_s"], 1e-9), y), fontsize=7,
                    xytext=(3, -3), textcoords="offset points")
    ax.set_yticks(list(ys), [r["kind"] for r in rows], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("seconds per op (bar: measured, marker: predicted; red: communication)")
    s = result["step"]
    ax.set_title(f"{title}\nstep: predicted {seconds(s['predicted_s'])}, measured {seconds(s['measured_s'])}",
                 fontsize=9)
    ax.grid(True, axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
