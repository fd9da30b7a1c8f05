"""`disagmoe bench train --plot PATH`: the rows' loss curves in one PNG, for parity runs (e.g.
`--variant precision=bf16 --variant precision=fp8`, 300 steps).

Top panel: each row's loss per step: the cross-entropy where every row recorded it, else every
row's training loss (`loss_parity.parity_metric`: one measure for the figure; the training loss
adds the routers' balancing term, which moves with the routing). Middle panel: each row's loss
relative to the first row's at the same step, in percent (the parity a bar like "within 1% at
step 300" reads). Under `--seeds` the rows of one variant share a colour and a legend line, and
the middle panel reads every row, the first variant's own seeds among them (its spread: the noise
a gap is read against), against the mean of the first variant's seeds (`loss_parity.mean_curve`).
Bottom panel, where a row ran FP8 GEMMs: the share of its quantised elements that saturated e4m3
each step (log scale), with the bar a parity run is held to (`SATURATION_BAR`). matplotlib is
imported only when a plot is asked for (Agg backend: no display).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

from disagmoe.bench.loss_parity import group_key, mean_curve, parity_losses, parity_metric, relative_gaps

SATURATION_BAR = 1e-4  # issue 21's per-step bar for the share of saturated FP8 elements
LABEL_WIDTH = 80  # characters a legend line or panel title holds before it wraps (a variant's overrides run long)


def _wrapped(text: str) -> str:
    return textwrap.fill(text, LABEL_WIDTH)


def relative_percent(losses: list[float], reference: list[float]) -> list[float]:
    """100 (loss / reference - 1) per step, over the steps both have."""
    return [100.0 * g for g in relative_gaps(losses, reference)]


def plot_losses(rows: list[dict[str, Any]], path: str | Path, title: str, labels: list[str]) -> None:
    """Write the figure (module docstring) for `rows` (bench train's rows with `losses`, and
    `fp8_saturated_shares` where FP8 ran), each named by its entry of `labels`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows_labels = [(r, name) for r, name in zip(rows, labels, strict=True) if r.get("losses")]
    if not rows_labels:
        raise ValueError("--plot: no row has losses to plot (every row failed)")
    metric = parity_metric([r for r, _ in rows_labels])
    curves = {id(r): parity_losses(r, metric) for r, _ in rows_labels}
    fp8 = [(r, name) for r, name in rows_labels if any(s is not None for s in r.get("fp8_saturated_shares") or [])]
    panels = 3 if fp8 else 2
    fig, axes = plt.subplots(panels, 1, figsize=(9, 3.2 * panels), sharex=True)
    first, first_name = rows_labels[0]
    keys = list(dict.fromkeys(group_key(r) for r, _ in rows_labels))  # a colour per variant (its seeds share it)
    first_group = [r for r, _ in rows_labels if group_key(r) == group_key(first)]
    seeded = len(first_group) > 1
    reference = mean_curve(first_group, metric) if seeded else curves[id(first)]
    named: set[tuple] = set()
    for r, name in rows_labels:
        key = group_key(r)
        colour, label = f"C{keys.index(key) % 10}", None if key in named else _wrapped(name)
        named.add(key)
        steps = range(1, len(curves[id(r)]) + 1)
        axes[0].plot(steps, curves[id(r)], label=label, linewidth=1.2, color=colour)
        if seeded or r is not first:
            rel = relative_percent(curves[id(r)], reference)
            axes[1].plot(range(1, len(rel) + 1), rel, label=label, linewidth=1.0, color=colour)
    axes[0].set_ylabel("cross-entropy" if metric == "ce" else "training loss")
    axes[0].set_title(_wrapped(title), fontsize=10)
    axes[0].legend(fontsize=8)
    axes[1].axhline(0.0, color="grey", linewidth=0.8)
    for bar in (-1.0, 1.0):
        axes[1].axhline(bar, color="grey", linewidth=0.6, linestyle="--")
    axes[1].set_ylabel("loss vs the first row (%)")
    axes[1].set_title(_wrapped(f"relative to the mean of the first row's {len(first_group)} seeds: {first_name}"
                               if seeded else f"relative to the first row: {first_name}"), fontsize=8)
    if len(rows_labels) > 1:
        axes[1].legend(fontsize=8)
    if fp8:
        named.clear()
        for r, name in fp8:
            key = group_key(r)
            shares = [(i + 1, s) for i, s in enumerate(r["fp8_saturated_shares"]) if s is not None]
            axes[2].plot([i for i, _ in shares], [max(s, 1e-12) for _, s in shares],
                         label=None if key in named else _wrapped(name), linewidth=1.0,
                         color=f"C{keys.index(key) % 10}")
            named.add(key)
        axes[2].axhline(SATURATION_BAR, color="red", linewidth=0.8, linestyle="--", label=f"{SATURATION_BAR:g}")
        axes[2].set_yscale("log")
        axes[2].set_ylabel("FP8 saturated share")
        axes[2].legend(fontsize=8)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
