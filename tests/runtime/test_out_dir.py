"""The output folder (disagmoe/runtime/out_dir.py): refused up front if unwritable, stale files swept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from disagmoe.runtime.out_dir import check_out_dir, clean_stale_files


def test_a_new_nested_out_dir_is_fine_and_nothing_is_created(tmp_path):
    check_out_dir(tmp_path / "a" / "b" / "run")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_out_dir_is_fine(tmp_path):
    check_out_dir(tmp_path)
    assert list(tmp_path.iterdir()) == []  # the probe file is gone


def test_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("x")
    with pytest.raises(ValueError, match=r"out_dir .*run is a file, not a directory; choose another out_dir"):
        check_out_dir(tmp_path / "run")


def test_a_path_under_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=rf"is under {tmp_path / 'f'}, which is a file"):
        check_out_dir(tmp_path / "f" / "sub" / "run")


def test_a_dangling_symlink_is_refused(tmp_path):
    (tmp_path / "link").symlink_to(tmp_path / "gone")
    with pytest.raises(ValueError, match="dangling symlink"):
        check_out_dir(tmp_path / "link" / "run")


def test_a_place_without_write_permission_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root writes anyway; /proc takes no new files from anyone
            locked = Path("/proc")
        with pytest.raises(ValueError, match=rf"cannot write in {locked}"):
            check_out_dir(locked / "run")
    finally:
        (tmp_path / "locked").chmod(0o700)


def test_stale_staging_deleting_and_trace_files_are_swept_complete_checkpoints_kept(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for name in (".staging-step-00000004", ".step-00000001.deleting", "step-00000002", "step-00000003",
                 "step-00000005"):
        (checkpoints / name).mkdir(parents=True)
        (checkpoints / name / "rank-00000.pt").write_bytes(b"x")
    (checkpoints / "step-00000002" / "manifest.json").write_text("{}")
    (checkpoints / "step-00000005" / "manifest.json").write_bytes(b"\xff")  # damaged, yet complete: kept
    (tmp_path / "elsewhere").mkdir()
    (checkpoints / "step-00000006").symlink_to(tmp_path / "elsewhere")  # not ours to delete
    (tmp_path / ".trace.json.tmp").write_text("{")
    (tmp_path / "metrics.jsonl").write_text("")
    gone = clean_stale_files(tmp_path)
    assert {p.name for p in gone} == {".staging-step-00000004", ".step-00000001.deleting", ".trace.json.tmp",
                                      "step-00000003"}  # step 3: written without its manifest (killed)
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000005", "step-00000006"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "elsewhere", "metrics.jsonl"]
    assert clean_stale_files(tmp_path / "never-run") == []


def test_names_agree_with_the_checkpoint_module():
    from disagmoe.runtime import out_dir
    from disagmoe.runtime.state import checkpoint
    from disagmoe.runtime.training import trainer

    assert (out_dir.CHECKPOINTS_DIR, out_dir.MANIFEST) == (trainer.CHECKPOINTS_DIR, checkpoint.MANIFEST)
