"""`disagmoe bench train --seeds N`: whether a variant trains to the first variant's loss, read
against the first variant's own spread over initialisations.

One pair of runs cannot say it. Two bf16 runs of the same 200-step command on an H100 (the Qwen3
config, text corpus), one before and one after a change of the expert kernels' tile shapes, ended
7.9% apart over their last 50 steps (docs/benchmarks.md, session 29): the early steps' loss spikes
amplify any difference of rounding, so a precision's gap of a few percent is only a gap where it
lies outside the spread of the reference's own runs.

The loss compared is the language model's cross-entropy (a row's `ces`) where every row compared
recorded it, else every row's training loss (`parity_metric`: one measure for the whole set),
which adds the routers' load-balancing term (0.02 a layer at uniform loads on the Qwen3 config,
more as loads skew: a tenth of the loss late in a run, moving with the routing, not with what the
model predicts).

`--seeds N` trains every row N times, seeds seed..seed+N-1 with the data order pinned
(`DataConfig.seed`: the same batches in every run), and this module groups those rows by what
they vary (mode, transport, hop, variant) and gives, per group, each seed's mean loss over the
last `window` steps, their mean and range, and against the first variant's group of the same
mode, over the seeds both ran: the gap of the means, the per-seed (paired: the same
initialisation and batches) gaps, and whether the mean lies inside the first variant's range.

A 300-step run of the Qwen3 config takes about three minutes a row on one GPU, so its seeds may
come from several calls: `disagmoe bench parity A.json B.json` reads the rows of several
`bench train --out` records (`merged_rows`: each row's own seed, the rows of a seed on the same
batches) into the same table. Pinning one data order for every seed reads the initialisation's
spread alone; seeds with their own data orders are still paired seed by seed, and their range
then holds both.
"""

from __future__ import annotations

import shlex
import statistics
from typing import Any

DEFAULT_WINDOW = 50  # steps at the end of each run whose losses are averaged (one step's loss is one batch's)
MODES = ("single", "disaggregated", "colocated")  # bench train's layouts (an outside baseline's row is none)


def has_cross_entropy(row: dict[str, Any]) -> bool:
    """Whether `row` recorded every step's cross-entropy (`ces`: rows of `bench train` since it did)."""
    ces = row.get("ces")
    return bool(ces) and all(c is not None for c in ces)


def parity_metric(rows: list[dict[str, Any]]) -> str:
    """"ce" where every row recorded its cross-entropy, else "loss" (the training loss) for all."""
    return "ce" if rows and all(has_cross_entropy(r) for r in rows) else "loss"


def parity_losses(row: dict[str, Any], metric: str) -> list[float]:
    """A row's per-step losses in `metric` ("ce": its `ces`; "loss": its training `losses`)."""
    return row["ces"] if metric == "ce" else row["losses"]


def seed_of(row: dict[str, Any]) -> int | None:
    """The seed a row was initialised from: its `--seeds` seed, or the run's (`init_seed`)."""
    return row["seed"] if row.get("seed") is not None else row.get("init_seed")


def group_key(row: dict[str, Any]) -> tuple:
    """What a row varies apart from its seed: its mode, transport, hop and variant."""
    return row.get("mode"), row.get("transport"), row.get("hop"), row.get("variant")


def window_mean(losses: list[float], window: int) -> float:
    """The mean of the last `window` losses (all of them where the run is shorter)."""
    if window < 1:
        raise ValueError(f"--loss-window {window}: give at least 1 step")
    return statistics.fmean(losses[-window:])


def compared_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The rows a parity reads: bench train's own rows that trained and kept their losses."""
    return [r for r in rows if r.get("mode") in MODES and not r.get("error") and r.get("losses")]


def loss_parity(rows: list[dict[str, Any]], window: int = DEFAULT_WINDOW,
                control: str | None = None, span: int | None = None) -> list[dict[str, Any]]:
    """One entry per group of `compared_rows(rows)`, in the order the groups first appear:
    `metric` (`parity_metric` of them all), `seeds`, `seed_losses` (each seed's window mean), `loss`
    (their mean), `low` / `high`, `spread` ((high - low) / loss; None for one seed), and against the
    first group of the same mode, transport and hop (the reference; its own entry has None), over
    the seeds both ran (`common_seeds`; a seed one of them lacks, e.g. a row that ran out of memory,
    would set one seed's loss against another's): `vs_first` (the mean / the reference's mean - 1),
    `paired_gaps` (each common seed's window mean against the reference's),
    `step_gaps` (each common seed's mean over the window's steps of |loss / the reference's - 1|,
    step by step: how far apart the two trajectories run, which window means average out) and
    `inside_reference_range` (within the reference's low..high over those seeds; None under two).
    `control`: a variant that differs from the reference in rounding alone (`judge_against_control`);
    every other entry is then also read against it, else those fields stay None. `span`: each
    non-reference entry also gets `span_gaps` (`span_gaps`: the run cut into spans of that many
    steps, where a gap opens and whether it stays); None without."""
    compared = compared_rows(rows)
    metric = parity_metric(compared)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for row in compared:
        groups.setdefault(group_key(row), []).append(row)
    entries: list[dict[str, Any]] = []
    references: dict[tuple, tuple[dict, dict]] = {}
    for key, members in groups.items():
        by_seed = {seed_of(r): window_mean(parity_losses(r, metric), window) for r in members}
        curves = {seed_of(r): parity_losses(r, metric) for r in members}
        losses = list(by_seed.values())
        loss, low, high = statistics.fmean(losses), min(losses), max(losses)
        entry: dict[str, Any] = {"mode": key[0], "transport": key[1], "hop": key[2], "variant": key[3],
                                 "metric": metric, "seeds": list(by_seed), "seed_losses": losses, "loss": loss,
                                 "low": low, "high": high, "spread": (high - low) / loss if len(losses) > 1 else None,
                                 "common_seeds": None, "vs_first": None, "paired_gaps": None, "step_gaps": None,
                                 "inside_reference_range": None, "control_seeds": None, "gap_vs_control": None,
                                 "step_gap_vs_control": None, "within_control": None, "span_gaps": None}
        reference, reference_curves = references.setdefault(key[:3], (by_seed, curves))
        if reference is not by_seed:
            entry.update(_against(by_seed, reference))
            entry["step_gaps"] = [step_gap(curves[s], reference_curves[s], window) for s in entry["common_seeds"]]
            if span is not None and entry["common_seeds"]:
                entry["span_gaps"] = span_gaps([curves[s] for s in entry["common_seeds"]],
                                               [reference_curves[s] for s in entry["common_seeds"]], span)
        entries.append(entry)
    if control is not None:
        judge_against_control(entries, control)
    return entries


def same_variant(a: str | None, b: str | None) -> bool:
    """Whether two --variant strings set the same overrides: their key=value words, split as
    `bench train` parses a variant (shell quoting), in any order."""
    return sorted(shlex.split(a or "")) == sorted(shlex.split(b or ""))


def check_control(control: str, variants: list[str | None]) -> None:
    """ValueError, with the fix, unless `control` is one of `variants` (in run order, failed rows
    included) other than the first (the reference: the control is read against it like any
    variant)."""
    named = ", ".join(repr(v) for v in dict.fromkeys(variants))
    if len(set(variants)) < 2:
        raise ValueError(f"--control {control!r} needs at least two variants, the reference first and the control: "
                         "e.g. --variant precision=bf16 --variant 'precision=bf16 optim.update_kernel=torch'"
                         + (f" (the runs compared have {named} alone)" if variants else ""))
    if same_variant(control, variants[0]):
        raise ValueError(f"--control {control!r} is the first variant, the reference every variant is read against: "
                         "name another variant that differs from it in rounding alone, e.g. "
                         "'precision=bf16 optim.update_kernel=torch' beside 'precision=bf16'")
    if not any(same_variant(control, v) for v in variants):
        raise ValueError(f"--control {control!r} is none of the variants compared ({named}): give one of them as its "
                         "--variant was written")


def judge_against_control(entries: list[dict[str, Any]], control: str) -> None:
    """Read each variant's gap against a control's, in place (`loss_parity`'s entries).

    A control is a variant that changes only the rounding of the reference (e.g. torch's AdamW
    update in place of ours: a few ulps a step), so its gap is how far this config's runs move
    apart on their own. Over the seeds both the variant and the control share with the reference
    (`control_seeds`): `gap_vs_control`, the variant's mean |paired gap| over the control's;
    `step_gap_vs_control`, the same of the per-step gaps; `within_control`, both no larger (the
    variant trains as close to the reference as a change of rounding does). A ratio is None where
    the control's gap is zero. Nothing is read where no row of the control trained (`check_control`
    says beforehand whether it is a variant at all)."""
    controls = {_layout(e): e for e in entries if same_variant(e["variant"], control)}
    for entry in entries:
        reference_of_layout = entry["common_seeds"] is None
        ctrl = controls.get(_layout(entry))
        if ctrl is None or ctrl is entry or reference_of_layout:
            continue
        if not ctrl["common_seeds"]:  # the control shares no seed with the reference: nothing to read
            entry["control_seeds"] = []
            continue
        mine = dict(zip(entry["common_seeds"], zip(entry["paired_gaps"] or [], entry["step_gaps"] or [])))
        theirs = dict(zip(ctrl["common_seeds"], zip(ctrl["paired_gaps"], ctrl["step_gaps"])))
        seeds = [s for s in mine if s in theirs]
        entry["control_seeds"] = seeds
        if not seeds:
            continue
        gap, ctrl_gap = (statistics.fmean(abs(side[s][0]) for s in seeds) for side in (mine, theirs))
        step, ctrl_step = (statistics.fmean(side[s][1] for s in seeds) for side in (mine, theirs))
        entry.update(gap_vs_control=gap / ctrl_gap if ctrl_gap else None,
                     step_gap_vs_control=step / ctrl_step if ctrl_step else None,
                     within_control=gap <= ctrl_gap and step <= ctrl_step)


def _layout(entry: dict[str, Any]) -> tuple:
    return entry["mode"], entry["transport"], entry["hop"]


def span_gaps(curves: list[list[float]], references: list[list[float]], span: int) -> list[dict[str, Any]]:
    """A variant's per-step gap to its reference, span by span: the steps both ran (every seed's
    pair of curves; seeds paired in order) cut into spans of `span` steps from step 1, the last
    possibly shorter; per span `first` and `last` (1-based steps), `gap` (the mean over its steps of
    loss / the reference's - 1, averaged over the seeds step by step) and `above` (its steps where
    that seed-mean gap is positive). A gap that opens early and holds at one sign is a recipe's;
    one that grows slowly from zero, of either sign, is also what rounding alone does (a control's)."""
    if span < 1:
        raise ValueError(f"--spans {span}: give at least 1 step a span")
    gaps = [statistics.fmean(seeds) for seeds in zip(*(relative_gaps(c, r) for c, r in zip(curves, references,
                                                                                         strict=True)))]
    steps = len(gaps)
    return [{"first": start + 1, "last": min(start + span, steps), "gap": statistics.fmean(gaps[start:start + span]),
             "above": sum(g > 0 for g in gaps[start:start + span])} for start in range(0, steps, span)]


def relative_gaps(losses: list[float], reference: list[float]) -> list[float]:
    """loss / the reference's loss - 1, step by step, over the steps both ran."""
    return [a / b - 1.0 for a, b in zip(losses, reference)]  # zip stops at the shorter run


def step_gap(losses: list[float], reference: list[float], window: int) -> float:
    """The mean over the last `window` steps both ran of |loss / the reference's loss - 1|, step by step."""
    return statistics.fmean(abs(g) for g in relative_gaps(losses, reference)[-window:])


def _against(by_seed: dict, reference: dict) -> dict[str, Any]:
    """`loss_parity`'s comparison of one group's window means (seed -> mean) with its reference's,
    over the seeds both have."""
    common = [s for s in by_seed if s in reference]
    if not common:
        return {"common_seeds": []}
    mine, theirs = [by_seed[s] for s in common], [reference[s] for s in common]
    mean = statistics.fmean(mine)
    return {"common_seeds": common, "vs_first": mean / statistics.fmean(theirs) - 1.0,
            "paired_gaps": [a / b - 1.0 for a, b in zip(mine, theirs, strict=True)],
            "inside_reference_range": min(theirs) <= mean <= max(theirs) if len(common) > 1 else None}


def mean_curve(rows: list[dict[str, Any]], metric: str) -> list[float]:
    """The per-step mean of `rows`' losses in `metric` (a group's seeds), over the steps all have."""
    losses = [parity_losses(r, metric) for r in rows]
    steps = min(len(x) for x in losses)
    return [statistics.fmean(x[i] for x in losses) for i in range(steps)]


def read_as_one(records: dict[str, dict[str, Any]], same: list[str]) -> dict[str, dict[str, Any]]:
    """`records` with each `same` entry's variants ("A | B | ...": one recipe written several ways, e.g.
    spelled out before a default changed and left to the default after) read as its first: every
    row of one of them renamed to the first (copies; the records given stay as they are). ValueError,
    with the fix, for an entry of one variant or a variant no record ran."""
    ran = {r.get("variant") for record in records.values() for r in record.get("modes", [])}
    renames: list[tuple[str, str]] = []
    for entry in same:
        names = [name.strip() for name in entry.split("|")]
        if len(names) < 2 or not all(names):
            raise ValueError(f"--same {entry!r}: give two or more variants separated by ' | ', e.g. "
                             "'precision=fp8 fp8_expert_forward=down | precision=fp8'")
        for name in names:
            if not any(same_variant(name, v) for v in ran):
                listed = ", ".join(repr(v) for v in sorted(ran, key=str))
                raise ValueError(f"--same: no record ran the variant {name!r}; they ran {listed}")
        renames += [(name, names[0]) for name in names]  # the first too: one spelling for the group

    def renamed(row: dict[str, Any]) -> dict[str, Any]:
        for name, first in renames:
            if same_variant(row.get("variant"), name):
                return {**row, "variant": first}
        return row

    return {name: {**record, "modes": [renamed(r) for r in record["modes"]]} for name, record in records.items()}


def merged_rows(records: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The compared rows of several `bench train` records (name -> record), for `loss_parity`:
    ValueError, with the fix, where they cannot be read together: not a record, a record of another
    length (`steps`), rows of one seed on other batches (`data_seed`: their paired gaps would compare
    different batches), or one variant and seed twice. Seeds may each have their own data order
    (`data_orders` says how many there are): the seeds' range then counts both moving."""
    if not records:
        raise ValueError("give at least one `disagmoe bench train --out` record")
    for name, record in records.items():
        if not isinstance(record, dict) or not isinstance(record.get("modes"), list):
            raise ValueError(f"{name}: not a `disagmoe bench train --out` record (no list of `modes`)")
    steps = {name: record.get("steps") for name, record in records.items()}
    if len(set(steps.values())) > 1:
        raise ValueError(f"the records ran different --steps ({steps}): compare runs of one length")
    rows, seen = [], {}
    for name, record in records.items():
        for row in compared_rows(record["modes"]):
            if "init_seed" not in row and row.get("seed") is None:
                raise ValueError(f"{name}: its rows do not say their seed (a record from before `--seeds`): run it "
                                 "again")
            key = (*group_key(row), seed_of(row))
            if key in seen:
                raise ValueError(f"{seen[key]} and {name} both hold {group_key(row)[0]} [{row.get('variant')}] at seed "
                                 f"{seed_of(row)}: give each seed once (another seed: `seed=N data.seed=M` on the "
                                 "command line)")
            seen[key] = name
            rows.append(row)
    data_seeds: dict[Any, set] = {}
    for row in rows:
        data_seeds.setdefault(seed_of(row), set()).add(row.get("data_seed"))
    for seed, orders in data_seeds.items():
        if len(orders) > 1:
            raise ValueError(f"the rows of seed {seed} trained on different batches (data seeds "
                             f"{sorted(orders, key=str)}): a seed's variants are compared step by step, so give them "
                             "one data order (the same data.seed in every call of that seed)")
    if not rows:
        raise ValueError("no row of these records trained")
    return rows


def data_orders(rows: list[dict[str, Any]]) -> int:
    """How many data orders (`data_seed`s) the rows trained on: 1 where the order is pinned (`--seeds`),
    more where each seed came with its own (`merged_rows` lets a seed's rows share theirs)."""
    return len({row.get("data_seed") for row in rows})
