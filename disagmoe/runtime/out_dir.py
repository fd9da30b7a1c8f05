"""A run's output folder: refused up front if it cannot be written, swept of stale temporary files.

`check_out_dir` runs before Ray, the actors or the model start, so a bad out_dir is one line and
exit code 2, not a traceback after start-up. `clean_stale_files` runs as the step loop starts: it
removes what an earlier run of the same out_dir left when it was killed mid-write (a checkpoint
still being staged, written or deleted, a half-written trace); complete checkpoints (those with a
manifest) are never touched.

Light (no torch): the CLI imports it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

CHECKPOINTS_DIR = "checkpoints"  # = runtime.training.trainer.CHECKPOINTS_DIR
MANIFEST = "manifest.json"  # = runtime.state.checkpoint.MANIFEST
# What writers leave while they work (sharded_checkpoint.staging_dir, checkpoint.prune_checkpoints,
# trace.write_chrome_trace); none of it is ever read back.
STALE_IN_CHECKPOINTS = (".staging-step-*", ".step-*.deleting")
STALE_IN_OUT_DIR = (".trace.json.tmp",)


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


def clean_stale_files(out_dir: Path) -> list[Path]:
    """Remove the temporary files and folders of an earlier, killed run, and step folders without
    a manifest (a single-mode checkpoint killed mid-write: the manifest is written last); returns
    what went. A folder holding a manifest is a complete checkpoint (if damaged, resume skips it
    with a warning) and stays."""
    out_dir = Path(out_dir)
    checkpoints = out_dir / CHECKPOINTS_DIR
    stale = [p for pattern in STALE_IN_CHECKPOINTS for p in checkpoints.glob(pattern)]
    stale += [p for p in checkpoints.glob("step-*")
              if p.is_dir() and not p.is_symlink() and not (p / MANIFEST).exists() and not (p / MANIFEST).is_symlink()]
    stale += [p for pattern in STALE_IN_OUT_DIR for p in out_dir.glob(pattern)]
    for path in stale:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return stale
