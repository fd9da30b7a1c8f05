"""The output folder (disagmoe/runtime/out_dir.py): refused up front if unwritable, stale files swept."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from disagmoe.runtime.failures import RunWarning
from disagmoe.runtime.out_dir import check_out_dir, clean_stale_files, mark_writing, set_aside_earlier_run


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


def test_only_marked_half_written_folders_are_swept_complete_and_unmarked_ones_kept(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    for name in (".staging-step-00000004", "step-00000002", "step-00000003", "step-00000005", "step-00000007"):
        (checkpoints / name).mkdir(parents=True)
        (checkpoints / name / "rank-00000.pt").write_bytes(b"x")
    for name in (".staging-step-00000004", "step-00000003"):
        mark_writing(checkpoints / name)  # a run was writing them when it was killed
    (checkpoints / "step-00000002" / "manifest.json").write_text("{}")
    (checkpoints / "step-00000005" / "manifest.json").write_bytes(b"\xff")  # damaged, yet complete: kept
    (tmp_path / "elsewhere").mkdir()
    (checkpoints / "step-00000006").symlink_to(tmp_path / "elsewhere")  # not ours to delete
    (tmp_path / ".trace.json.tmp").write_text("{")
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.warns(RunWarning, match=r"left .*step-00000007 alone: a checkpoint folder without a manifest"):
        gone = clean_stale_files(tmp_path)  # step 7: lost its manifest, or not a run's: kept
    assert {p.name for p in gone} == {".staging-step-00000004", ".trace.json.tmp", "step-00000003"}
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-00000002", "step-00000005", "step-00000006",
                                                            "step-00000007"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints", "elsewhere", "metrics.jsonl"]
    assert clean_stale_files(tmp_path / "never-run") == []


def test_a_marked_folder_keeps_the_files_no_run_wrote(tmp_path):
    folder = tmp_path / "checkpoints" / "step-00000003"
    mark_writing(folder)
    (folder / "rank-00000.pt").write_bytes(b"x")
    (folder / ".rank-00001.pt.tmp-123").write_bytes(b"x")
    (folder / "notes.txt").write_text("mine")
    with pytest.warns(RunWarning, match=r"left .*step-00000003 in place: it holds notes.txt, which no run wrote"):
        assert clean_stale_files(tmp_path) == []
    assert sorted(p.name for p in folder.iterdir()) == [".disagmoe-writing", "notes.txt"]


def test_a_fresh_run_sets_an_earlier_one_aside_and_says_where(tmp_path):
    (tmp_path / "checkpoints" / "step-00000002").mkdir(parents=True)
    (tmp_path / "metrics.jsonl").write_text("{}\n")
    (tmp_path / "trace.json").write_text("{}")
    (tmp_path / "notes.txt").write_text("the user's")
    with pytest.warns(RunWarning, match=r"held an earlier run .*moved its metrics.jsonl, trace.json, checkpoints "
                                        r"to .*earlier/\d{8}-\d{6}"):
        aside = set_aside_earlier_run(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier", "notes.txt"]
    assert sorted(p.name for p in aside.iterdir()) == ["checkpoints", "metrics.jsonl", "trace.json"]
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # a second earlier run gets a folder of its own
    with pytest.warns(RunWarning):
        second = set_aside_earlier_run(tmp_path)
    assert second != aside and (second / "metrics.jsonl").is_file() and (aside / "metrics.jsonl").is_file()
    assert set_aside_earlier_run(tmp_path) is None  # nothing left to move


@pytest.mark.parametrize("out_dir, match", [
    ("", "out_dir is empty: it would write into the current folder"),
    ("   ", "out_dir is empty"),
])
def test_an_empty_out_dir_is_refused(out_dir, match):
    with pytest.raises(ValueError, match=match):
        check_out_dir(out_dir)


def test_outputs_of_the_wrong_kind_are_refused_before_the_run(tmp_path):
    (tmp_path / "checkpoints").write_text("a file")
    with pytest.raises(ValueError, match=r"checkpoints is a file, but the run writes its checkpoints into a folder"):
        check_out_dir(tmp_path)
    (tmp_path / "checkpoints").unlink()
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(ValueError, match=r"metrics.jsonl is a folder, but the run writes metrics.jsonl as a file"):
        check_out_dir(tmp_path)


def test_a_name_too_long_and_a_symlink_loop_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"cannot use that path \(File name too long\)"):
        check_out_dir(tmp_path / ("x" * 300))
    (tmp_path / "a").symlink_to(tmp_path / "b")
    (tmp_path / "b").symlink_to(tmp_path / "a")
    with pytest.raises(ValueError, match=r"symlink loop"):
        check_out_dir(tmp_path / "a" / "run")


def test_names_agree_with_the_checkpoint_module():
    from disagmoe.runtime import out_dir
    from disagmoe.runtime.state import checkpoint
    from disagmoe.runtime.training import trainer

    from disagmoe.runtime.cluster import driver, restart
    from disagmoe.runtime.training import loop

    assert (out_dir.CHECKPOINTS_DIR, out_dir.MANIFEST) == (trainer.CHECKPOINTS_DIR, checkpoint.MANIFEST)
    from disagmoe.cli import third_party

    assert out_dir.RUN_OUTPUTS == (loop.METRICS_FILE, driver.TRACE_FILE, restart.FAULT_RECORD, third_party.LOG_FILE,
                                   trainer.CHECKPOINTS_DIR)
