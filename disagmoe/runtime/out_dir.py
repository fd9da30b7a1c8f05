"""A run's output folder: refused up front if it cannot be written; only what a run wrote is removed.

- `check_out_dir` runs before Ray, the actors or the model start: a bad out_dir is one line and
  exit code 2, not a traceback after start-up (nor a lost checkpoint at the first save).
- `set_aside_earlier_run`: a fresh run (`resume=false`) into a folder holding an earlier run's
  outputs moves them into `<out_dir>/earlier/<time>/` first (one warning line saying where), so
  two runs never mix and nothing is overwritten.
- Every folder a run writes a checkpoint into carries `WRITING` (a marker written first, removed
  once the checkpoint is sealed). `clean_stale_files` (as the step loop starts) removes folders
  that carry it and lack a manifest (a run killed mid-write), and of them only the files a run
  writes (`remove_run_files`); a folder without the marker and without a manifest (not written
  by a run, or a checkpoint that lost its manifest) is left alone with a warning.

Light (no torch): the CLI imports it.
"""

from __future__ import annotations

import errno
import os
import tempfile
import time
import warnings
from pathlib import Path

from disagmoe.runtime.failures import RunWarning

CHECKPOINTS_DIR = "checkpoints"  # = runtime.training.trainer.CHECKPOINTS_DIR
MANIFEST = "manifest.json"  # = runtime.state.checkpoint.MANIFEST
WRITING = ".disagmoe-writing"  # in a checkpoint folder while a run writes it
EARLIER_DIR = "earlier"  # <out_dir>/earlier/<time>/: earlier runs, set aside by a fresh one
RAY_DRIVER_LOG = "ray-driver.log"  # Ray's start-up notices of a distributed run (`cli.third_party`)
# What a run writes into out_dir (= loop.METRICS_FILE, driver.TRACE_FILE, restart.FAULT_RECORD),
# Ray's driver log and the checkpoints folder.
RUN_OUTPUTS = ("metrics.jsonl", "trace.json", "fault_injection.json", RAY_DRIVER_LOG, CHECKPOINTS_DIR)
# Checkpoint folders as writers name them (sharded_checkpoint.staging_dir, old prune renames).
CHECKPOINT_FOLDERS = ("step-*", ".staging-step-*", ".step-*.deleting")
RUN_FILES_IN_CHECKPOINT = ("*.pt", MANIFEST, ".*.tmp-*", WRITING)  # shards, temporaries (_atomic_write)
STALE_IN_OUT_DIR = (".trace.json.tmp",)  # trace.write_chrome_trace's temporary
FIX = "choose another out_dir (or --out-dir)"


def check_out_dir(out_dir: Path | str) -> None:
    """ValueError naming out_dir for a place the run could not write: an empty name (it would
    write into the current folder), a file, a path under a file, a dangling or looping symlink, a
    name the file system refuses, no write permission, or a run output that has the wrong kind
    (`checkpoints` a file, `metrics.jsonl` a folder). Creates nothing: the deepest existing folder
    on the path must take a file (probed with a temporary one: permission bits alone do not tell,
    for root or on a read-only mount)."""
    if not str(out_dir).strip():
        raise ValueError(f"out_dir is empty: it would write into the current folder; {FIX}")
    out_dir = Path(out_dir)
    try:
        existing = _deepest_existing(out_dir)
        if not existing.is_dir():
            where = "is a file" if existing == out_dir else f"is under {existing}, which is a file"
            raise ValueError(f"out_dir {out_dir} {where}, not a directory; {FIX}")
    except OSError as err:
        raise ValueError(f"out_dir {out_dir}: cannot use that path ({err.strerror or err}); {FIX}") from None
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        raise ValueError(f"out_dir {out_dir}: cannot write in {existing} ({err.strerror or err}); {FIX}") from None
    if existing == out_dir:
        _check_outputs(out_dir)


def _deepest_existing(out_dir: Path) -> Path:
    """The deepest folder (or file) of `out_dir`'s path that exists; OSError for a name the file
    system refuses (ENAMETOOLONG), ValueError for a dangling or looping symlink on the way."""
    existing = out_dir
    while True:
        try:
            os.stat(existing)
            return existing
        except OSError as err:
            if err.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):  # ELOOP: a symlink loop, said below
                raise
        if existing.is_symlink():
            raise ValueError(f"out_dir {out_dir}: {existing} is a dangling symlink (or a symlink loop); {FIX}")
        if existing.parent == existing:
            return existing
        existing = existing.parent


def _check_outputs(out_dir: Path) -> None:
    """ValueError for a run output in `out_dir` of the wrong kind (the checkpoints folder a file,
    a file output a folder): found now, not at the first checkpoint after steps are lost."""
    for name in RUN_OUTPUTS:
        path = out_dir / name
        if not path.exists():
            continue
        if name == CHECKPOINTS_DIR and not path.is_dir():
            wrong = f"{path} is a file, but the run writes its checkpoints into a folder there"
        elif name != CHECKPOINTS_DIR and path.is_dir():
            wrong = f"{path} is a folder, but the run writes {name} as a file there"
        else:
            continue
        raise ValueError(f"out_dir {out_dir}: {wrong}; move it away or {FIX}")


def earlier_outputs(out_dir: Path) -> list[Path]:
    """The run outputs (`RUN_OUTPUTS`) present in `out_dir`."""
    return [out_dir / name for name in RUN_OUTPUTS if (out_dir / name).exists() or (out_dir / name).is_symlink()]


def set_aside_earlier_run(out_dir: Path) -> Path | None:
    """Move an earlier run's outputs into `<out_dir>/earlier/<UTC time of its last write>/`
    (a RunWarning line says where); returns that folder, None if there was nothing to move."""
    out_dir = Path(out_dir)
    found = earlier_outputs(out_dir)
    if not found:
        return None
    newest = max(p.lstat().st_mtime for p in found)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(newest))
    target = out_dir / EARLIER_DIR / stamp
    n = 1
    while target.exists():
        n += 1
        target = out_dir / EARLIER_DIR / f"{stamp}-{n}"
    target.mkdir(parents=True)
    for path in found:
        path.rename(target / path.name)
    warnings.warn(f"out_dir {out_dir} held an earlier run and this one starts fresh (resume=false): moved its "
                  f"{', '.join(p.name for p in found)} to {target} (resume=true continues a run instead)",
                  RunWarning, stacklevel=2)
    return target


def mark_writing(folder: Path) -> None:
    """Create `folder` (and parents) holding the `WRITING` marker: a run is writing it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / WRITING).touch()


def is_run_folder(folder: Path) -> bool:
    """Whether a run wrote `folder`: a real folder holding the marker or a manifest."""
    return (folder.is_dir() and not folder.is_symlink()
            and any((folder / name).exists() or (folder / name).is_symlink() for name in (WRITING, MANIFEST)))


def remove_run_files(folder: Path) -> list[Path]:
    """Delete the files a run writes into a checkpoint folder (`RUN_FILES_IN_CHECKPOINT`), the
    manifest before the shards (so what an interrupted call leaves never looks complete) and the
    marker last, then the folder if it is empty. Anything else stays, with a RunWarning naming it;
    returns what is left (empty: the folder is gone)."""
    (folder / WRITING).touch()
    (folder / MANIFEST).unlink(missing_ok=True)
    for pattern in RUN_FILES_IN_CHECKPOINT:
        for path in folder.glob(pattern):
            if path.name != WRITING and (path.is_file() or path.is_symlink()):
                path.unlink()
    left = sorted(p for p in folder.iterdir() if p.name != WRITING)
    if not left:
        (folder / WRITING).unlink(missing_ok=True)
        folder.rmdir()
        return []
    warnings.warn(f"left {folder} in place: it holds {', '.join(p.name for p in left[:5])}"
                  f"{' ...' if len(left) > 5 else ''}, which no run wrote; move or delete them yourself",
                  RunWarning, stacklevel=2)
    return left


def clean_stale_files(out_dir: Path) -> list[Path]:
    """Remove what an earlier, killed run left half-written (module docstring); returns the
    folders and files that went. A folder with a manifest is a complete checkpoint (if damaged,
    resume skips it with a warning) and stays; one with neither marker nor manifest stays with a
    RunWarning."""
    out_dir = Path(out_dir)
    checkpoints = out_dir / CHECKPOINTS_DIR
    gone: list[Path] = []
    folders = sorted({p for pattern in CHECKPOINT_FOLDERS for p in checkpoints.glob(pattern)})
    for folder in folders:
        if not folder.is_dir() or folder.is_symlink():
            continue
        complete = folder.name.startswith("step-") and (folder / MANIFEST).exists()
        if complete:
            continue
        if not (folder / WRITING).exists():
            warnings.warn(f"left {folder} alone: a checkpoint folder without a manifest that no run marked as "
                          f"its own (a checkpoint that lost its manifest, or files put there); restore its "
                          f"{MANIFEST} or move it away", RunWarning, stacklevel=2)
            continue
        if not remove_run_files(folder):
            gone.append(folder)
    for pattern in STALE_IN_OUT_DIR:
        for path in out_dir.glob(pattern):
            if path.is_file():
                path.unlink()
                gone.append(path)
    return gone
