"""Files unison writes or reads in a run folder, never through a link, never from a special file.

A run folder is data: one unpacked from a tarball, copied from a colleague or dropped into a
group-writable run root may hold a symbolic link where unison writes (``config.yaml`` linking to
a shell start-up file, ``logs/`` linking to a folder elsewhere: a resume would overwrite or
append to what they point to) or a FIFO where it reads (``job.json``: a reader would wait for
good). Every file unison writes or reads in a run folder goes through this module:

- a file is opened with ``O_NOFOLLOW`` (a link in its place is refused, not followed) and
  ``O_NONBLOCK`` (a FIFO does not block the open), then ``fstat`` must say it is a regular file;
  a file opened for writing is truncated only then;
- the folder a file is in, and every folder unison makes, is checked with ``lstat``: a real
  directory, not a link to one;
- a file read is bounded in size;
- a file replaced atomically is written to a temporary file created with ``O_CREAT | O_EXCL |
  O_NOFOLLOW`` (``tempfile.mkstemp``) and renamed over the old one (a rename replaces a link
  itself, never what it points to);
- :func:`unsafe_entries` lists the entries of a run folder that are links or special files,
  so a run can refuse the folder before any rank starts.
"""

from __future__ import annotations

import os
import shlex
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "MAX_READ",
    "RunFileError",
    "open_fd",
    "open_file",
    "read_bytes",
    "read_text",
    "real_folder",
    "replace_file",
    "unsafe_entries",
    "write_text",
]

MAX_READ = 16 * 2**20
"""The most bytes :func:`read_bytes` reads from a run folder's file (16 MiB) unless told otherwise."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_FLAGS = {
    "r": os.O_RDONLY,
    "w": os.O_WRONLY | os.O_CREAT,  # truncated once it is known to be a regular file
    "a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
    "x": os.O_WRONLY | os.O_CREAT | os.O_EXCL,
    "r+": os.O_RDWR | os.O_CREAT,  # read and write, never truncated (a lock file)
}


class RunFileError(OSError):
    """A run folder's entry that is a link, a special file or too large; the message names it and the fix."""


def _kind(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISDIR(mode):
        return "a folder"
    return "a regular file" if stat.S_ISREG(mode) else "a special file"


def _refusal(path: Path, found: str, expected: str) -> RunFileError:
    target = f" (to {os.readlink(path)})" if found == "a symbolic link" and os.path.islink(path) else ""
    return RunFileError(
        f"{path} is {found}{target}, where unison expects {expected}: unison reads and writes a run "
        "folder's files only in place, never through a link nor from a special file, so that a run folder "
        "from elsewhere (a tarball, a copy, a shared run root) cannot make it overwrite, append to or read "
        f"what the entry points to. Remove it (rm {shlex.quote(str(path))}) or put a real {expected.split(' ', 1)[1]} in its "
        "place, or start a new run (leave out --resume)."
    )


def real_folder(path: str | os.PathLike[str]) -> Path:
    """Makes the folder ``path`` when missing (its parents too) and checks it is a real directory.

    Raises:
        RunFileError: ``path`` is a link (to a folder or not) or some other non-folder.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> real_folder(root / "logs").is_dir()
        True
        >>> (root / "tb").symlink_to(root / "logs")
        >>> real_folder(root / "tb")
        Traceback (most recent call last):
        ...
        unison.utils.run_files.RunFileError: ... is a symbolic link (to ...logs), where unison expects a folder: ...
    """
    folder = Path(path)
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:  # a dangling link, or a file: named below
        pass
    mode = os.lstat(folder).st_mode
    if not stat.S_ISDIR(mode):
        raise _refusal(folder, _kind(mode), "a folder")
    return folder


def _in_real_folder(path: Path) -> None:
    """The folder holding ``path`` is a real directory (when it exists: opening then says it is missing)."""
    try:
        mode = os.lstat(path.parent).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(mode):
        raise _refusal(path.parent, _kind(mode), "a folder")


def open_fd(path: str | os.PathLike[str], mode: str = "r", perms: int = 0o644) -> int:
    """A descriptor of the regular file ``path``, opened without following a link (``mode``: ``r``,
    ``w``, ``a``, ``x`` or ``r+``, as :func:`open` reads them; ``w`` truncates, only a regular file).

    Raises:
        RunFileError: ``path`` or its folder is a link, or ``path`` is not a regular file.
        OSError: it cannot be opened (missing, no permission).
    """
    file = Path(path)
    _in_real_folder(file)
    try:
        fd = os.open(file, _FLAGS[mode] | _NOFOLLOW | _NONBLOCK | _CLOEXEC, perms)
    except OSError as err:
        if os.path.islink(file):  # ELOOP from O_NOFOLLOW; ENXIO: a FIFO nobody reads
            raise _refusal(file, "a symbolic link", "a regular file") from None
        try:
            found = os.lstat(file).st_mode
        except OSError:
            raise err from None
        if not stat.S_ISREG(found):
            raise _refusal(file, _kind(found), "a regular file") from None
        raise
    try:
        found = os.fstat(fd).st_mode
        if not stat.S_ISREG(found):
            raise _refusal(file, _kind(found), "a regular file")
        if _NONBLOCK:
            os.set_blocking(fd, True)
        if mode == "w":
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_file(path: str | os.PathLike[str], mode: str = "r", *, binary: bool = False) -> IO[Any]:
    """:func:`open_fd` as a file object (text in UTF-8 unless ``binary``); use it in a ``with`` block."""
    fd = open_fd(path, mode)
    py_mode = {"r": "r", "w": "w", "a": "a", "x": "x", "r+": "r+"}[mode] + ("b" if binary else "")
    return os.fdopen(fd, py_mode) if binary else os.fdopen(fd, py_mode, encoding="utf-8")


def read_bytes(path: str | os.PathLike[str], limit: int = MAX_READ) -> bytes:
    """The bytes of the regular file ``path``, read without following a link; at most ``limit``.

    Raises:
        RunFileError: ``path`` is a link or not a regular file, or holds more than ``limit`` bytes.
        OSError: it cannot be opened (missing, no permission).
    """
    with open_file(path, "r", binary=True) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise RunFileError(
            f"{path} holds more than {limit} bytes, more than unison reads from a run folder's file of this "
            "kind: it is not a file unison wrote. Remove it, or start a new run (leave out --resume)."
        )
    return bytes(data)


def read_text(path: str | os.PathLike[str], limit: int = MAX_READ) -> str:
    """:func:`read_bytes` decoded as UTF-8."""
    return read_bytes(path, limit).decode("utf-8")


def write_text(path: str | os.PathLike[str], text: str, mode: str = "w") -> None:
    """Writes (``mode="w"``) or appends (``"a"``) ``text`` to the regular file ``path``, in place."""
    with open_file(path, mode) as fh:
        fh.write(text)


def replace_file(path: str | os.PathLike[str], data: bytes, *, sync: bool = True) -> None:
    """Replaces ``path`` with ``data`` atomically: a temporary file beside it (``O_EXCL``, never a
    link), flushed (and fsynced with ``sync``), then renamed over ``path``."""
    target = Path(path)
    folder = real_folder(target.parent)
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if sync:
                os.fsync(fh.fileno())
        os.replace(name, target)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


def unsafe_entries(
    folder: Path, files: Iterable[str], folders: Iterable[str], deep: Iterable[str] = ()
) -> list[str]:
    """What in the run folder ``folder`` is not as unison writes it: one line per entry, naming it.

    ``folder`` itself must be a real directory; each name in ``files`` (when present) a regular
    file; each in ``folders`` a real directory; and inside each folder of ``deep``, at any depth,
    every entry a regular file or a real directory. An empty list: nothing to refuse.
    """
    found: list[str] = []

    def check(path: Path, expected: str) -> None:
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        ok = stat.S_ISDIR(mode) if expected == "a folder" else stat.S_ISREG(mode)
        if not ok:
            target = f" (to {os.readlink(path)})" if stat.S_ISLNK(mode) else ""
            found.append(f"{path} is {_kind(mode)}{target}, not {expected}")

    check(folder, "a folder")
    if found:
        return found
    for name in files:
        check(folder / name, "a regular file")
    for name in folders:
        check(folder / name, "a folder")
    for name in deep:
        top = folder / name
        if os.path.isdir(top) and not os.path.islink(top):
            for parent, dirs, names in os.walk(top):  # never follows links to folders
                for entry in dirs:
                    check(Path(parent) / entry, "a folder")
                for entry in names:
                    check(Path(parent) / entry, "a regular file")
    return found
