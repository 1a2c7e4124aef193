"""The git commit a folder is checked out at, read from the ``.git`` files; nothing is run.

The reader is made for a folder it does not trust (a shared file system, a copied tree):
it opens regular files only, without blocking (a FIFO named ``HEAD`` is refused, not
waited on), reads a few KB of each (``HEAD -> /dev/zero`` is refused at once), follows a
bounded number of indirections (``gitdir:``, ``commondir``, symbolic refs), and, as git
does since its ``safe.directory`` rule, ignores a repository owned by another user. Any
failure (a link loop, a permission, a malformed file) means "unknown": :func:`git_commit`
returns None and never raises.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

__all__ = ["git_commit"]

SMALL = 4096
"""The most bytes read of ``HEAD``, a ref, ``commondir`` or a ``.git`` file."""
PACKED_LIMIT = 16 << 20
"""The most bytes read of ``packed-refs``, line by line."""
MAX_SYMREFS = 5
"""Symbolic refs followed from ``HEAD`` (``ref: refs/...`` in a ref file) before giving up."""

_SHA = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")


class _Unknown(Exception):
    """Nothing can be said about the commit."""


def _uid() -> int:
    return os.geteuid() if hasattr(os, "geteuid") else -1


def _owned(st: os.stat_result) -> bool:
    """Whether a repository file is the current user's (git refuses another user's)."""
    uid = _uid()
    return uid < 0 or st.st_uid == uid


def _open_regular(path: Path) -> int | None:
    """A descriptor of ``path`` if it is a regular file (opened without blocking), else None."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _Unknown(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_small(path: Path) -> str | None:
    """The text of a small regular file; None when it does not exist.

    Raises:
        _Unknown: not a regular file, larger than :data:`SMALL`, or not text.
    """
    fd = _open_regular(path)
    if fd is None:
        return None
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(SMALL + 1)
    if len(data) > SMALL:
        raise _Unknown(f"{path} is larger than {SMALL} bytes")
    return data.decode("utf-8").strip()


def _packed(common: Path, ref: str) -> str | None:
    fd = _open_regular(common / "packed-refs")
    if fd is None:
        return None
    read = 0
    with os.fdopen(fd, "rb") as fh:
        for raw in fh:
            read += len(raw)
            if read > PACKED_LIMIT:
                raise _Unknown("packed-refs is too large")
            sha, _, name = raw.decode("utf-8").strip().partition(" ")
            if name == ref and _SHA.fullmatch(sha):
                return sha
    return None


def _gitdir_of(folder: Path) -> Path | None:
    """The git folder of the work tree at ``folder``; None when ``folder`` holds no ``.git``.

    Raises:
        _Unknown: a ``.git`` that is not the current user's, not a folder nor a regular file,
            or a ``gitdir:`` file that does not name a folder of the current user's.
    """
    dot = folder / ".git"
    try:
        st = os.stat(dot)
    except FileNotFoundError:
        return None
    if not _owned(st):
        raise _Unknown(f"{dot} belongs to another user")
    if stat.S_ISDIR(st.st_mode):
        return dot
    text = _read_small(dot)  # a linked work tree or a submodule: "gitdir: <path>"
    if text is None or not text.startswith("gitdir:"):
        raise _Unknown(f"{dot} names no git folder")
    gitdir = folder / text[len("gitdir:") :].strip()
    target = os.stat(gitdir)
    if not stat.S_ISDIR(target.st_mode) or not _owned(target):
        raise _Unknown(f"{gitdir} is not a git folder of this user")
    return gitdir


def _head(gitdir: Path) -> str | None:
    common = gitdir
    pointer = _read_small(gitdir / "commondir")
    if pointer:
        common = gitdir / pointer
    head = _read_small(gitdir / "HEAD")
    for _ in range(MAX_SYMREFS):
        if head is None:
            return None
        if not head.startswith("ref:"):
            return head if _SHA.fullmatch(head) else None  # a detached HEAD, or the ref's commit
        ref = head[len("ref:") :].strip()
        if not ref.startswith("refs/") or ".." in ref.split("/"):
            return None
        head = _read_small(gitdir / ref)
        if head is None and common != gitdir:
            head = _read_small(common / ref)
        if head is None:
            return _packed(common, ref)  # packed, or a branch without commits yet
    return None


def git_commit(start: Path) -> str | None:
    """The commit checked out in the git work tree holding ``start`` (the nearest ``.git``
    at or above it); None outside a work tree, and whenever it cannot be read safely
    (the module's notes say what is refused)."""
    try:
        start = Path(os.path.abspath(start))
        for folder in (start, *start.parents):
            gitdir = _gitdir_of(folder)
            if gitdir is not None:
                return _head(gitdir)
    except Exception:  # a loop, a permission, a refusal, a malformed file: unknown
        return None
    return None
