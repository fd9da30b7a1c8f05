"""The `disagmoe` command: one typer app, a module per command group."""

from __future__ import annotations

import typer

from disagmoe.cli.bench_cmd import bench_app
from disagmoe.cli.common import OneLineErrors
from disagmoe.cli.config_cmd import config_app, presets
from disagmoe.cli.plan_cmd import plan, roofline
from disagmoe.cli.train_cmd import train

HELP = """\
Train Mixture-of-Experts models with attention and expert layers on disjoint GPU groups.

\b
Concepts:
  attention group  GPUs running embeddings, attention, norms, routers and the LM head
                   (data-parallel replicas of the non-expert weights).
  expert group     GPUs holding the routed experts (expert-parallel shards).
  micro-batch      a slice of the step's batch; while the expert group works on micro-batch i
                   the attention group works on i+1, so both stay busy.
  pipeline group   with p > 1 groups, group g owns layers g, g+p, g+2p, ... of both pools:
                   tokens travel a ring A_0 -> E_0 -> A_1 -> E_1 -> ... forward, reversed backward.

\b
Start with `disagmoe presets`, then `disagmoe plan --model mixtral-8x7b --hardware h200-sxm --gpus 16`.
"""

app = typer.Typer(
    name="disagmoe",
    cls=OneLineErrors,
    help=HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    add_completion=False,
)
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")
app.command("presets")(presets)
app.command("plan")(plan)
app.command("roofline")(roofline)
app.command("train")(train)


def main() -> None:
    app()
