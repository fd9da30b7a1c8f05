"""A run's output folder: refused up front if it cannot be written.

`check_out_dir` runs before Ray, the actors or the model start, so a bad out_dir is one line and
exit code 2, not a traceback after start-up.

Light (no torch): the CLI imports it.
"""

from __future__ import annotations

import tempfile
from pathlib import Path


def check_out_dir(out_dir: Path) -> None:
    """ValueError for an out_dir the run could not write: a file, a path under a file, or a place
    without write permission. Creates nothing: the deepest existing folder on the path must take
    a file (probed with a temporary one: permission bits alone do not tell, for root or on a
    read-only mount)."""
    out_dir = Path(out_dir)
    fix = "choose another out_dir (or --out-dir)"
    existing = out_dir
    while not existing.exists():
        if existing.is_symlink():
            raise ValueError(f"out_dir {out_dir}: {existing} is a dangling symlink; {fix}")
        existing = existing.parent
    if not existing.is_dir():
        where = "is a file" if existing == out_dir else f"is under {existing}, which is a file"
        raise ValueError(f"out_dir {out_dir} {where}, not a directory; {fix}")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        raise ValueError(f"out_dir {out_dir}: cannot write in {existing} ({err.strerror or err}); {fix}") from None
