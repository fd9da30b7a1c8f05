"""Reading a user's input file, bounded; writing JSON that strict parsers accept.

- `read_input(path, setting, max_bytes)`: the bytes of a regular file, or a ValueError naming the
  setting (`--config`, `--plan`, ...): a FIFO, a device, a socket or a folder is refused before
  any read (opened non-blocking, so a FIFO without a writer does not wait), a file over
  `max_bytes` is refused from its size, and no more than `max_bytes` + 1 bytes are ever read
  (a file that grows while read is caught too).
- `check_depth(data, setting)`: a ValueError for lists and mappings nested deeper than
  `MAX_DEPTH` (what a parser of such a file would otherwise overflow the recursion limit on).
- `finite_or_none(obj)`: NaN and infinities become None, so `json.dumps(..., allow_nan=False)`
  holds (strict JSON has no NaN or Infinity).

Light (no torch, no yaml): the lowest layer of the package.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any

MIB = 1 << 20
MAX_CONFIG_BYTES = 16 * MIB  # a config, model, hardware YAML or a config.json
MAX_PLAN_BYTES = 64 * MIB  # a plan of a 100k-GPU job with its expert map
MAX_HISTOGRAM_BYTES = 1 << 30  # a long run's metrics.jsonl
MAX_TRACE_BYTES = 1 << 30  # a trace.json (the trainer keeps its first 100 steps)
MAX_DEPTH = 64  # nesting of lists and mappings; every file of ours stays under 10
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def read_input(path: Path | str, setting: str, max_bytes: int) -> bytes:
    """The bytes of the regular file `path` (module docstring); ValueError naming `setting`."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as err:
        raise ValueError(f"{setting} {path}: cannot read it ({err.strerror or err})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{setting} {path} is {_kind(info.st_mode)}, not a regular file; give a file")
        if info.st_size > max_bytes:
            raise ValueError(f"{setting} {path} is {info.st_size / MIB:,.1f} MiB, over the {max_bytes / MIB:,.0f} MiB "
                             "such a file can be; is it the right file?")
        os.set_blocking(fd, True)
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(MIB, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise ValueError(f"{setting} {path} grew past {max_bytes / MIB:,.0f} MiB while read; give a finished file")
        return b"".join(chunks)
    except OSError as err:
        raise ValueError(f"{setting} {path}: cannot read it ({err.strerror or err})") from None
    finally:
        os.close(fd)


def read_input_text(path: Path | str, setting: str, max_bytes: int) -> str:
    """`read_input` decoded as UTF-8 (ValueError naming the byte that is not)."""
    data = read_input(path, setting, max_bytes)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{setting} {path} is not UTF-8 text (byte {err.start}: {err.reason})") from None


def check_depth(data: Any, setting: str, max_depth: int = MAX_DEPTH) -> None:
    """ValueError if `data`'s lists and mappings nest deeper than `max_depth` (walked without recursion)."""
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > max_depth:
            raise ValueError(f"{setting}: lists and mappings nested deeper than {max_depth} levels; "
                             "no input of disagmoe nests so deep")
        stack.extend((child, depth + 1) for child in children)


def finite_or_none(obj: Any) -> Any:
    """`obj` with every non-finite float (NaN, +-inf), at any depth of dicts, lists and tuples, as None."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj
