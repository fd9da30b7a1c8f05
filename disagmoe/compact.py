"""JSON and YAML text that a person can read: a list of numbers (or of lists of numbers) on one
line, a mapping of scalars inside a list on one line, everything else one key per line.

A plan's `expert_map` is then one line per MoE layer (Qwen3-235B on 72 GPUs: 94 lines, not
36,000) and each stage time one line. Any JSON or YAML reader reads the result as it reads the
block style (`yaml.safe_load`, `json.loads`): the layout changes, never a value. Strings stay
one per line (notes are sentences). No torch, ray or matplotlib.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

Scalar = (str, int, float, bool, type(None))


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) or x is None  # bool is an int


def inline(x: Any, in_list: bool = False) -> bool:
    """Whether `x` is written on one line: a list of numbers or of lists of numbers, or (as an
    item of a list) a mapping whose values are scalars."""
    if isinstance(x, list):
        return all(_number(v) or (isinstance(v, list) and all(_number(w) for w in v)) for v in x)
    if isinstance(x, dict):
        return in_list and all(isinstance(v, Scalar) for v in x.values())
    return False


def to_json(data: Any, indent: int = 2) -> str:
    """`json.dumps(data, indent=indent)` with `inline` values on one line; ends with a newline."""

    def dump(x: Any, level: int, in_list: bool = False) -> str:
        if isinstance(x, Scalar) or not x or (level and inline(x, in_list)):
            return json.dumps(x, separators=(", ", ": "))
        pad, inner = " " * (indent * level), " " * (indent * (level + 1))
        if isinstance(x, dict):
            items = [f"{inner}{json.dumps(str(k))}: {dump(v, level + 1)}" for k, v in x.items()]
            return "{\n" + ",\n".join(items) + f"\n{pad}}}"
        items = [inner + dump(v, level + 1, in_list=True) for v in x]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"

    return dump(data, 0) + "\n"


class _Flow(list):
    """A list written in flow style."""


class _FlowMap(dict):
    """A mapping written in flow style."""


class _Dumper(yaml.SafeDumper):
    pass


_Dumper.add_representer(_Flow, lambda d, v: d.represent_sequence("tag:yaml.org,2002:seq", v, flow_style=True))
_Dumper.add_representer(_FlowMap, lambda d, v: d.represent_mapping("tag:yaml.org,2002:map", v.items(), flow_style=True))


def _mark(x: Any, in_list: bool = False) -> Any:
    if isinstance(x, dict):
        if inline(x, in_list):
            return _FlowMap(x)
        return {k: _mark(v) for k, v in x.items()}
    if isinstance(x, list):
        return _Flow(x) if x and inline(x) else [_mark(v, in_list=True) for v in x]
    return x


def to_yaml(data: Any) -> str:
    """`yaml.safe_dump(data, sort_keys=False)` with `inline` values in flow style on one line."""
    return yaml.dump(_mark(data), Dumper=_Dumper, sort_keys=False, width=float("inf"), allow_unicode=True)
