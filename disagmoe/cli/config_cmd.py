"""`disagmoe config ...` and `disagmoe presets`: inspect the configuration vocabulary."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from disagmoe import config as cfg
from disagmoe.model_ref import load_model
from disagmoe.cli.common import console, literal, print_json, user_errors
from disagmoe.cli.schema_table import schema_rows
from disagmoe.roofline.params import count_params

config_app = typer.Typer(help="Configuration schemas and validation.", no_args_is_help=True)

SCHEMAS = {
    "train": cfg.TrainConfig,
    "model": cfg.ModelConfig,
    "hardware": cfg.HardwareConfig,
    "plan": cfg.Plan,
}


@config_app.command("schema")
@user_errors
def schema(
    kind: Annotated[str, typer.Argument(help=f"which schema: {', '.join(SCHEMAS)}")] = "train",
    as_json: Annotated[bool, typer.Option("--json", help="print the JSON Schema instead (for machines)")] = False,
) -> None:
    """List the keys of a config file kind: name (sections dotted, e.g. optim.lr), type, default
    and meaning; --json prints the JSON Schema."""
    if kind not in SCHEMAS:
        raise ValueError(f"unknown schema {kind!r}; choose one of: {', '.join(SCHEMAS)}")
    if as_json:
        print_json(SCHEMAS[kind].model_json_schema())
        return
    t = Table(title=f"keys of a {kind} config (`disagmoe config schema {kind} --json`: the JSON Schema)",
              title_justify="left")
    rows = schema_rows(SCHEMAS[kind])
    t.add_column("key", no_wrap=True, min_width=max(len(r["key"]) for r in rows))
    t.add_column("type", max_width=36, overflow="fold")
    t.add_column("default", max_width=18, overflow="fold")
    t.add_column("meaning", ratio=1)
    for row in rows:
        t.add_row(*(literal(row[k]) for k in ("key", "type", "default", "meaning")))
    console.print(t)


@user_errors
def presets(
    as_json: Annotated[bool, typer.Option("--json", help="machine-readable output")] = False,
) -> None:
    """List the model and hardware presets (names usable with --model / --hardware)."""
    models = {name: load_model(name) for name in cfg.preset_names("models")}
    hardware = {name: cfg.load_hardware(name) for name in cfg.preset_names("hardware")}
    if as_json:
        print_json({
            "models": {
                n: {**m.model_dump(mode="json"), "total_params": count_params(m).total,
                    "active_params": count_params(m).active}
                for n, m in models.items()
            },
            "hardware": {n: h.model_dump(mode="json") for n, h in hardware.items()},
        })
        return
    t = Table(title="model presets")
    for col in ("name", "layers", "hidden", "attention", "experts", "top-k", "total", "active", "source"):
        t.add_column(col, justify="left" if col in ("name", "attention", "source") else "right",
                     no_wrap=col != "source", ratio=1 if col == "source" else None)
    for n, m in models.items():
        c = count_params(m)
        t.add_row(n, str(m.num_layers), str(m.hidden_size), m.attention, str(m.num_experts),
                  str(m.top_k), _human(c.total), _human(c.active), literal(m.source or "-"))
    console.print(t)
    t = Table(title="hardware presets")
    for col in ("name", "bf16 TF/s", "HBM GB/s", "HBM GiB", "NVLink GB/s", "NVLink domain",
                "scale-out GB/s", "source"):
        t.add_column(col, justify="left" if col in ("name", "source") else "right",
                     no_wrap=col != "source", ratio=1 if col == "source" else None)
    for n, h in hardware.items():
        t.add_row(n, f"{h.bf16_tflops:g}", f"{h.hbm_gbps:g}", f"{h.hbm_gib:g}",
                  f"{h.nvlink_gbps:g}", str(h.nvlink_domain), f"{h.scaleout_gbps:g}", literal(h.source or "-"))
    console.print(t)


def _human(n: float) -> str:
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(int(n))


@config_app.command("check")
@user_errors
def check(path: Annotated[str, typer.Argument(help="a train config YAML")]) -> None:
    """Validate a training config file and print it with every default filled in."""
    conf = cfg.load_train_config(path)
    console.print(conf.to_yaml(), highlight=False, markup=False)  # values may hold [brackets]


__all__ = ["config_app", "presets"]
