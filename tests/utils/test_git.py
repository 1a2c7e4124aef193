"""The git reader on folders it cannot trust: every case is "unknown" (None), at once."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import unison.utils.git as git
from unison.utils.git import git_commit

SHA = "0123456789abcdef0123456789abcdef01234567"
FAST = pytest.mark.timeout(20)  # a reader that blocks or reads for ever fails here, not the suite


def _repo(folder: Path, head: str = "ref: refs/heads/main") -> Path:
    dot = folder / ".git"
    (dot / "refs" / "heads").mkdir(parents=True)
    (dot / "HEAD").write_text(head + "\n")
    (dot / "refs" / "heads" / "main").write_text(SHA + "\n")
    return dot


@FAST
def test_a_plain_repository_is_read(tmp_path: Path) -> None:
    _repo(tmp_path)
    (tmp_path / "src").mkdir()
    assert git_commit(tmp_path / "src") == SHA


@FAST
def test_a_fifo_head_is_unknown_and_never_waited_on(tmp_path: Path) -> None:
    dot = _repo(tmp_path)
    (dot / "HEAD").unlink()
    os.mkfifo(dot / "HEAD")  # no writer: a blocking open would wait for ever
    assert git_commit(tmp_path) is None


@FAST
def test_a_fifo_ref_or_dot_git_is_unknown(tmp_path: Path) -> None:
    dot = _repo(tmp_path / "ref")
    (dot / "refs" / "heads" / "main").unlink()
    os.mkfifo(dot / "refs" / "heads" / "main")
    assert git_commit(tmp_path / "ref") is None
    (tmp_path / "file").mkdir()
    os.mkfifo(tmp_path / "file" / ".git")
    assert git_commit(tmp_path / "file") is None


@FAST
@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="no /dev/zero here")
def test_a_head_linked_to_dev_zero_is_unknown_without_reading_it(tmp_path: Path) -> None:
    dot = _repo(tmp_path)
    (dot / "HEAD").unlink()
    (dot / "HEAD").symlink_to("/dev/zero")
    assert git_commit(tmp_path) is None


@FAST
def test_a_large_head_is_unknown(tmp_path: Path) -> None:
    dot = _repo(tmp_path)
    (dot / "HEAD").write_text("ref: refs/heads/main" + " " * (git.SMALL + 10))
    assert git_commit(tmp_path) is None


@FAST
def test_a_gitdir_link_loop_is_unknown(tmp_path: Path) -> None:
    (tmp_path / "wt").mkdir()
    os.symlink(tmp_path / "loop-b", tmp_path / "loop-a")
    os.symlink(tmp_path / "loop-a", tmp_path / "loop-b")
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {tmp_path / 'loop-a'}\n")
    assert git_commit(tmp_path / "wt") is None
    (tmp_path / "wt" / ".git").write_text("gitdir: .git\n")  # names itself
    assert git_commit(tmp_path / "wt") is None


@FAST
def test_symbolic_refs_are_followed_a_bounded_number_of_times(tmp_path: Path) -> None:
    dot = _repo(tmp_path / "loop")
    (dot / "refs" / "heads" / "main").write_text("ref: refs/heads/main\n")  # points at itself
    assert git_commit(tmp_path / "loop") is None
    dot = _repo(tmp_path / "chain")
    (dot / "refs" / "heads" / "alias").write_text("ref: refs/heads/main\n")
    (dot / "HEAD").write_text("ref: refs/heads/alias\n")
    assert git_commit(tmp_path / "chain") == SHA


@FAST
def test_a_repository_of_another_user_is_ignored_as_git_does(tmp_path: Path, monkeypatch) -> None:
    _repo(tmp_path)
    (tmp_path / "src").mkdir()
    assert git_commit(tmp_path / "src") == SHA
    owner = os.stat(tmp_path / ".git").st_uid
    monkeypatch.setattr(git, "_uid", lambda: owner + 1)  # the .git above is now someone else's
    assert git_commit(tmp_path / "src") is None


@FAST
def test_a_linked_git_folder_of_another_user_is_ignored(tmp_path: Path, monkeypatch) -> None:
    dot = _repo(tmp_path / "main")
    (tmp_path / "wt").mkdir()
    (tmp_path / "wt" / ".git").write_text(f"gitdir: {dot}\n")
    assert git_commit(tmp_path / "wt") == SHA
    mine = os.stat(tmp_path / "wt" / ".git").st_uid
    real_stat = os.stat

    def stat(path, *args, **kwargs):  # the linked folder is owned by another user
        st = real_stat(path, *args, **kwargs)
        if Path(path) == dot:
            return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, mine + 1, *st[5:10]))
        return st

    monkeypatch.setattr(git.os, "stat", stat)
    assert git_commit(tmp_path / "wt") is None


@FAST
def test_nothing_is_run(tmp_path: Path, monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a command was run")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    _repo(tmp_path)
    assert git_commit(tmp_path) == SHA
