"""unison/utils/run_files.py: a run folder's files are never reached through a link nor read from a FIFO."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from unison.utils.run_files import (
    RunFileError,
    open_file,
    read_bytes,
    read_text,
    real_folder,
    replace_file,
    unsafe_entries,
    write_text,
)

SECRET = "export PATH=/usr/bin\n"


@pytest.fixture
def target(tmp_path: Path) -> Path:
    """A file outside the run folder that a link inside points to (a shell start-up file)."""
    file = tmp_path / "bashrc"
    file.write_text(SECRET)
    return file


@pytest.fixture
def run(tmp_path: Path) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    return folder


@pytest.mark.parametrize("mode", ["w", "a", "r+", "r"])
def test_a_link_in_a_files_place_is_refused_and_its_target_untouched(run, target, mode):
    (run / "config.yaml").symlink_to(target)
    with pytest.raises(RunFileError, match="config.yaml is a symbolic link") as err:
        if mode == "r":
            read_bytes(run / "config.yaml")
        else:
            open_file(run / "config.yaml", mode).close()
    assert str(target) in str(err.value) and "rm " in str(err.value)
    assert target.read_text() == SECRET


def test_a_dangling_link_is_refused_and_nothing_is_made_where_it_points(run, tmp_path):
    (run / "metrics.json").symlink_to(tmp_path / "planted")
    with pytest.raises(RunFileError, match="symbolic link"):
        write_text(run / "metrics.json", "{}")
    assert not (tmp_path / "planted").exists()


def test_a_file_in_a_linked_folder_is_refused(run, tmp_path, target):
    (run / "logs").symlink_to(tmp_path)
    with pytest.raises(RunFileError, match="logs is a symbolic link"):
        write_text(run / "logs" / "bashrc", "planted\n", "a")
    assert target.read_text() == SECRET


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["r", "w", "a"])
def test_a_fifo_is_refused_at_once(run, mode):
    os.mkfifo(run / "job.json")
    with pytest.raises(RunFileError, match="job.json is a FIFO"):
        open_file(run / "job.json", mode).close()


def test_reads_are_bounded(run):
    (run / "job.json").write_text("x" * 100)
    assert read_text(run / "job.json", limit=100) == "x" * 100
    with pytest.raises(RunFileError, match="more than 99 bytes"):
        read_bytes(run / "job.json", limit=99)


def test_regular_files_are_written_appended_and_read(run):
    write_text(run / "a.txt", "one\n")
    write_text(run / "a.txt", "two\n", "a")
    assert read_text(run / "a.txt") == "one\ntwo\n"
    write_text(run / "a.txt", "three\n")
    assert (run / "a.txt").read_text() == "three\n"
    with open_file(run / "b.bin", "w", binary=True) as fh:
        fh.write(b"\x00\x01")
    assert read_bytes(run / "b.bin") == b"\x00\x01"


def test_real_folder_makes_folders_and_refuses_links(run, tmp_path):
    assert real_folder(run / "tb" / "plugins").is_dir()
    (run / "logs").symlink_to(tmp_path)
    with pytest.raises(RunFileError, match="logs is a symbolic link"):
        real_folder(run / "logs")
    (run / "wandb").symlink_to(tmp_path / "nowhere")
    with pytest.raises(RunFileError, match="wandb is a symbolic link"):
        real_folder(run / "wandb")
    assert not (tmp_path / "nowhere").exists()
    (run / "checkpoints").write_text("")
    with pytest.raises(RunFileError, match="checkpoints is a regular file"):
        real_folder(run / "checkpoints")


def test_replace_file_replaces_a_link_itself_never_its_target(run, target):
    (run / "history.jsonl").symlink_to(target)
    (run / ".history.jsonl.tmp").symlink_to(target)  # a temporary name planted in advance: never used
    replace_file(run / "history.jsonl", b"row\n")
    assert not (run / "history.jsonl").is_symlink() and (run / "history.jsonl").read_text() == "row\n"
    assert target.read_text() == SECRET
    assert sorted(p.name for p in run.iterdir()) == [".history.jsonl.tmp", "history.jsonl"]


def test_unsafe_entries_names_every_link_and_special_file(run, tmp_path, target):
    (run / "config.yaml").symlink_to(target)
    (run / "tb").symlink_to(tmp_path)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "manifest.json").symlink_to(target)
    os.mkfifo(run / "job.json")
    (run / "wandb").mkdir()
    (run / "wandb" / "latest-run").symlink_to(run / "wandb")  # W&B's own link: not looked into
    (run / "notes.txt").symlink_to(target)  # not an entry unison writes
    found = unsafe_entries(run, ["config.yaml", "job.json", "metrics.json"], ["tb", "wandb"], ["checkpoints"])
    assert found == [
        f"{run / 'config.yaml'} is a symbolic link (to {target}), not a regular file",
        f"{run / 'job.json'} is a FIFO, not a regular file",
        f"{run / 'tb'} is a symbolic link (to {tmp_path}), not a folder",
        f"{run / 'checkpoints' / 'manifest.json'} is a symbolic link (to {target}), not a regular file",
    ]


def test_unsafe_entries_of_a_clean_or_linked_run_folder(run, tmp_path):
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "manifest.json").write_text("{}")
    assert unsafe_entries(run, ["config.yaml"], ["checkpoints"], ["checkpoints"]) == []
    (tmp_path / "linked").symlink_to(run)
    assert unsafe_entries(tmp_path / "linked", ["config.yaml"], [], []) == [
        f"{tmp_path / 'linked'} is a symbolic link (to {run}), not a folder"
    ]
