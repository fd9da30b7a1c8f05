"""The keys of a config class as rows a person reads (`disagmoe config schema`): dotted name,
type, default and meaning, sections (a nested config) expanded in place after their own row.

Types read as written in YAML: `int > 0`, `'gqa' | 'mla'`, `float in (0, 1]`, `list[RatePoint]`;
bounds that only guard against typos (100,000 or more) are left out.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

TYPO_GUARD = 10**5  # upper bounds at or above this are sanity limits, not part of the meaning


def _bounds(metadata: list[Any]) -> str:
    parts = []
    for m in metadata:
        for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            v = getattr(m, attr, None)
            if v is not None and not (op in ("<", "<=") and v >= TYPO_GUARD) and not (op == ">=" and v < -TYPO_GUARD):
                parts.append(f"{op} {v:g}")
    return ", ".join(parts)


def type_text(tp: Any, metadata: list[Any] | None = None) -> str:
    """`tp` as a YAML writer thinks of it (module docstring)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        inner = [m for a in args[1:] for m in (a.metadata if isinstance(a, FieldInfo) else [a])]
        return type_text(args[0], [*inner, *(metadata or [])])
    bounds = _bounds(metadata or [])
    if bounds and origin in (Union, types.UnionType) and type(None) in args and len(args) == 2:
        inner = next(a for a in args if a is not type(None))
        return f"{type_text(inner, metadata)} | null"  # the bounds are the value's, not null's
    if origin is Literal:
        text = " | ".join(repr(a) for a in args)
    elif origin in (Union, types.UnionType):
        text = " | ".join("null" if a is type(None) else type_text(a) for a in args)
    elif origin in (list, tuple):
        text = f"list[{type_text(args[0])}]" if args else "list"
    elif origin is dict:
        text = f"dict[{type_text(args[0])}, {type_text(args[1])}]" if args else "dict"
    elif isinstance(tp, type):
        text = tp.__name__
    else:
        text = str(tp)
    return f"{text} {bounds}" if bounds else text


def _section(tp: Any) -> type[BaseModel] | None:
    """The config class a field holds (alone or or-None): a section to expand."""
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    if get_origin(tp) in (Union, types.UnionType):
        models = [a for a in get_args(tp) if a is not type(None)]
        if len(models) == 1:
            return _section(models[0])
    return None


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
        return "(section)" if isinstance(value, BaseModel) else repr(value)
    if field.default is PydanticUndefined:
        return "required"
    return "null" if field.default is None else repr(field.default)


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n\n")[0].replace("\n", " ")


def schema_rows(cls: type[BaseModel], prefix: str = "") -> list[dict[str, str]]:
    """One row per key of `cls` and of its sections (key, type, default, meaning)."""
    rows = []
    for name, field in cls.model_fields.items():
        section = _section(field.annotation)
        meaning = field.description or (_first_line(section.__doc__) if section else "") or "-"
        rows.append({"key": prefix + name, "type": type_text(field.annotation, field.metadata),
                     "default": _default(field), "meaning": meaning})
        if section is not None:
            rows.extend(schema_rows(section, f"{prefix}{name}."))
    return rows
