"""One job per folder: a lock that a run folder (or a checkpoint folder) is held by.

Two processes writing one folder replace each other's checkpoints, and a rebuild of the
manifest by one deletes the other's temporary files. The holder takes an exclusive
``fcntl.flock`` on ``<folder>/.unison-lock`` and writes its host, PID and start time
there; the kernel drops the lock when the holder's file is closed, so it ends with the
holder however it ends (an exception, an exit, SIGKILL): a stale lock cannot outlive its
process. Another process is refused, and told who holds the folder.

Inside one process a folder is held once: a second claim shares the first (a resumed
:class:`~unison.handlers.Checkpoint` built beside the one that wrote the folder, a run
folder and its ``checkpoints/``), and the file is released with the last claim.

Distributed:
    :func:`hold_folder` is a collective: rank 0 takes the lock and every rank gets its
    answer, so a refusal fails every rank together.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import threading
import time
import weakref
from pathlib import Path
from types import TracebackType
from typing import Any

from unison.distributed.primitives import broadcast_object, get_rank
from unison.utils.logging import get_logger
from unison.utils.run_files import RunFileError, open_fd, read_bytes

_log = get_logger(__name__)

LOCK_FILE = ".unison-lock"
"""The file in a held folder: its lock, and who holds it (JSON: host, pid, started)."""

_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)


class FolderInUseError(RuntimeError):
    """Another process holds the folder; the message names it (host, PID, since when) and the fix."""


class _Held:
    """This process's hold on one folder: the open lock file, and how many claims share it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.claims = 0


_held: dict[str, _Held] = {}
_guard = threading.RLock()
_claiming = threading.local()
_deferred: list[str] = []
"""Claims that ended while this thread was taking one: a claim left unreleased ends by its
finalizer, which the garbage collector may run at any allocation, the claiming code included."""


def holder_of(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """What the lock file of ``folder`` says of its holder (empty when it says nothing readable)."""
    try:
        found = json.loads(read_bytes(Path(folder) / LOCK_FILE, limit=4096) or b"{}")
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def _refusal(folder: Path) -> str:
    holder = holder_of(folder)
    if holder.get("pid") is not None:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(holder.get("started", 0))))
        who = f"PID {holder['pid']} on host {holder.get('host', '?')} (since {started})"
        stop = f"stop it (on {holder.get('host', '?')}: kill {holder['pid']})"
    else:
        who, stop = "a process that is starting", "stop it"
    return (
        f"{folder} is in use by {who}: another unison job writes this folder (a second run of it, or a "
        "requeued job whose earlier job still runs), and two jobs in one folder replace each other's "
        f"checkpoints. Wait for that job to end or {stop}, then start this one again; the lock "
        f"({folder / LOCK_FILE}) is released as soon as that process ends, even when it is killed. To train "
        "beside it, start a new run (leave out --resume)."
    )


def _take(folder: Path) -> int | None:
    """Opens and locks ``folder``'s lock file; its descriptor, None where the file system has no locks.

    The file is opened without following a link, and emptied only when it is a regular file
    that unison wrote (empty, or a holder's record), with no other name (one hard link).

    Raises:
        FolderInUseError: another process holds it.
        RunFileError: the lock file is a link, a special file, or a file unison did not write.
    """
    fd = open_fd(folder / LOCK_FILE, "r+")
    try:
        _check_ours(folder, fd)
    except BaseException:
        os.close(fd)
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise FolderInUseError(_refusal(folder)) from None
        if err.errno in _UNSUPPORTED:
            _log.warning(
                "%s: this file system does not support file locks (%s): nothing stops a second job from "
                "writing this folder at the same time; make sure only one runs.",
                folder,
                err.strerror,
            )
            return None
        raise
    record = {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(record).encode(), 0)
    return fd


def _check_ours(folder: Path, fd: int) -> None:
    """Raises RunFileError unless the open lock file is one unison wrote: a single name, and empty
    or a holder's record, so that truncating it destroys nothing else."""
    path = folder / LOCK_FILE
    size = os.fstat(fd).st_size
    text = os.pread(fd, 4097, 0) if size <= 4096 else b""
    try:
        record = json.loads(text) if text else {}
    except ValueError:
        record = None
    ours = (
        os.fstat(fd).st_nlink == 1
        and size <= 4096
        and (not text or (isinstance(record, dict) and "pid" in record))
    )
    if not ours:
        raise RunFileError(
            f"{path} is not a lock file unison wrote (it holds other data, or has another name: a hard link), "
            "and unison empties its lock file when it takes it. Move it away if it is yours, or remove it, "
            "then run again."
        )


def _give_back(key: str) -> None:
    if getattr(_claiming, "active", False):  # run by the collector inside FolderLock's own claim
        _deferred.append(key)  # ended when that claim is counted, so its count stays right
        return
    with _guard:
        _end_claim(key)


def _end_claim(key: str) -> None:
    """Ends one claim on ``key``; the caller holds ``_guard``."""
    held = _held.get(key)
    if held is None:
        return
    held.claims -= 1
    if held.claims > 0:
        return
    del _held[key]
    try:
        os.ftruncate(held.fd, 0)  # no holder named while nobody holds it
    except OSError:
        pass
    os.close(held.fd)  # closing the last descriptor drops the lock


class Claim:
    """What :func:`hold_folder` gives ranks other than 0: a claim that holds nothing."""

    held = False
    ended = False
    """Whether :meth:`release` was called: the same answer on every rank."""

    def release(self) -> None:
        """Ends this claim."""
        self.ended = True

    def __enter__(self) -> Claim:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


class FolderLock(Claim):
    """One claim on a folder, by this process; :meth:`release` (or leaving a ``with`` block) ends it.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder, FolderLock(folder) as lock:
        ...     lock.held
        True

    Raises:
        FolderInUseError: another process holds the folder.
    """

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)  # the folder named; the file in it is never a link
        key = os.path.realpath(self.folder)
        with _guard:
            _claiming.active = True
            try:
                held = _held.get(key)
                if held is None:
                    fd = _take(Path(key))
                    held = _Held(fd) if fd is not None else None
                    if held is not None:
                        _held[key] = held
                if held is not None:
                    held.claims += 1
            finally:
                _claiming.active = False
                while _deferred:
                    _end_claim(_deferred.pop())
        self.held = held is not None
        """Whether the folder is locked (False where the file system has no locks)."""
        self._release = weakref.finalize(self, _give_back, key) if self.held else None

    def release(self) -> None:
        """Ends this claim; the folder is free once every claim of this process has ended."""
        self.ended = True
        if self._release is not None:
            self._release()


def hold_folder(folder: str | os.PathLike[str]) -> Claim:
    """Collective: call on every rank. Rank 0 claims ``folder`` (made if missing); every rank gets its answer.

    Returns:
        The claim: rank 0's lock (release it, or use it as a context manager, when the job
        is done with the folder), and a claim that holds nothing on the other ranks.

    Raises:
        FolderInUseError: on every rank, when another process holds the folder.
        OSError: on every rank, when rank 0 cannot make or open the lock file (its message).
    """
    claim: Claim = Claim()
    problem: tuple[str, str] | None = None
    if get_rank() == 0:
        try:
            claim = FolderLock(folder)
        except FolderInUseError as err:
            problem = ("in use", str(err))
        except OSError as err:
            problem = ("os", f"cannot lock {folder}: {err}")
    problem = broadcast_object(problem)
    if problem is not None:
        raise FolderInUseError(problem[1]) if problem[0] == "in use" else OSError(problem[1])
    return claim
