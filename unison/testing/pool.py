"""A warm process that forks the ranks of :func:`~unison.testing.run_distributed`: a call in a few
hundredths of a second instead of a second or more.

The warm process (:mod:`unison.testing.zygote`) is started at the first call, one per calling
process (each pytest-xdist worker has its own), and ended when this process exits. A call sends it
the function (pickled by name), the arguments, and the caller's environment, working folder,
``sys.path``, stdout and stderr; its ranks, forked ahead, run the function in a process group of
their own, on a port of its own, formed ahead for the call (see :mod:`unison.testing.zygote`), and
destroy it before they exit; the call returns once every rank's function has returned. A rank is a
fork of the warm process, never of an earlier rank: module globals start as a fresh import left
them, whatever an earlier call did.

What a call cannot poison: a rank that crashes or hangs past ``timeout`` fails its call as a
spawned rank would (its traceback, or the stacks of its threads); the warm process kills the
ranks still running and serves the next call. A warm process that dies, a call abandoned midway
(a test's timeout, Ctrl-C), or one that outlives ``timeout`` by more than :data:`SLACK_S`: its
ranks are killed by process id, the warm process too, and the next call starts a new one. A
function's module that starts threads when imported is not imported in the warm process again
(forking a process with threads can deadlock): its ranks import it themselves.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from unison.distributed.env import find_free_port
from unison.distributed.spawn import _failure, _read_results
from unison.testing import wire

SLACK_S = 60.0
"""How long past ``timeout`` a call may go before its ranks and the warm process are killed: the
ranks exit on their own at ``timeout`` (with their stacks), and the others within 30 s."""

START_TIMEOUT_S = 300.0
"""How long the warm process may take to import torch, ignite and unison (minutes on a busy machine)."""

_BOOT = "import sys; sys.path[:] = {path!r}; from unison.testing.zygote import serve; serve(int(sys.argv[1]))"


class PoolDied(RuntimeError):
    """The warm process died or hung during a call; the next call starts a new one."""


class _Warm:
    """The warm process of this calling process, and the socket to it."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        ours, theirs = socket.socketpair()
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-c", _BOOT.format(path=list(sys.path)), str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C reaches the caller, which ends it
            )
        finally:
            theirs.close()
        self.sock = ours
        self.ranks: list[int] = []
        try:
            ready, _ = self._receive(START_TIMEOUT_S, "start")
        except BaseException:
            self.kill()
            raise
        self.pid: int = ready["ready"]
        self.threads: int = ready["threads"]

    def call(self, request: dict[str, Any], guard_s: float) -> dict[str, Any]:
        """Runs one call; the warm process's reply (exit codes, or why it cannot run it)."""
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        wire.send(self.sock, request, (1, 2))
        started = time.monotonic()
        reply, _ = self._receive(guard_s, "call")
        if "pids" not in reply:
            return reply
        self.ranks = reply["pids"]
        _count_formed_ahead(reply)
        reply, _ = self._receive(guard_s - (time.monotonic() - started), "call")
        self.ranks = []
        return reply

    def _receive(self, timeout_s: float, what: str) -> tuple[Any, list[int]]:
        self.sock.settimeout(max(timeout_s, 0.001))
        try:
            return wire.receive(self.sock)
        except TimeoutError:
            raise PoolDied(
                f"run_distributed's warm process (pid {self.process.pid}) did not answer within "
                f"{timeout_s:.0f} s ({what}); its ranks and it were killed. The next call starts a new one."
            ) from None
        except (EOFError, OSError) as err:
            code = self.process.poll()
            when = "as it started (its stderr above says why)" if what == "start" else "during a call"
            raise PoolDied(
                f"run_distributed's warm process (pid {self.process.pid}) died {when} (exit code {code}, "
                f"{err}); its ranks were killed. The next call starts a new one; "
                "run_distributed(..., fresh=True) starts the ranks from nothing instead."
            ) from None

    def kill(self) -> None:
        """Ends the ranks of a call in flight and the warm process, by process id."""
        for pid in [*self.ranks, self.process.pid]:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        self.ranks = []
        self.close(wait_s=10.0)

    def close(self, wait_s: float = 5.0) -> None:
        """Closes the socket (the warm process exits when it sees it closed) and waits for it."""
        self.sock.close()
        try:
            self.process.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)


_lock = threading.Lock()
_warm: _Warm | None = None
_cold_modules: set[str] = set()
started = 0
"""How many warm processes this process started (a counted check that calls reuse one)."""
formed_ahead = 0
"""How many calls ran in a group their ranks formed before the call (a counted check)."""


def _count_formed_ahead(reply: dict[str, Any]) -> None:
    global formed_ahead
    formed_ahead += bool(reply.get("formed_ahead"))


def warm_pid() -> int | None:
    """The process id of this process's warm process, None before the first call or after a failure."""
    return _warm.pid if _warm is not None and _warm.owner == os.getpid() else None


def run(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nproc: int,
    timeout: float,
    backend: str,
    start_method: str,
) -> list[Any]:
    """Runs ``fn`` on ``nproc`` ranks forked by the warm process; see :func:`run_distributed`."""
    payload = pickle.dumps((fn, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
    # A rank may still be leaving its group as the folder is removed (the call does not wait for that).
    with _lock, tempfile.TemporaryDirectory(prefix="unison-launch-", ignore_cleanup_errors=True) as tmp:
        request = {
            "module": fn.__module__,
            "name": f"run_distributed({fn.__module__}.{getattr(fn, '__qualname__', fn)})",
            "payload": payload,
            "nproc": nproc,
            "backend": backend,
            "timeout": float(timeout),
            "deadline": float(timeout),
            "master_addr": "127.0.0.1",
            "port": find_free_port("127.0.0.1"),
            "result_dir": tmp,
            "environ": dict(os.environ),
            "cwd": os.getcwd(),
            "sys_path": list(sys.path),
            "start_method": start_method,
        }
        started_at = time.monotonic()
        reply = _call(request, timeout + SLACK_S)
        if "tainted" in reply:  # that module's import started threads: its ranks import it themselves
            _cold_modules.add(fn.__module__)
            reply = _call(request, timeout + SLACK_S)
        for note in reply.get("late", ()):
            warnings.warn(f"run_distributed: {note}.", RuntimeWarning, stacklevel=3)
        failed = reply["failed"]
        if failed is None:
            return _read_results(Path(tmp), nproc)
        code = reply["exitcodes"][failed]
        name = signal.Signals(-code).name if code < 0 else None
        message = f"process {failed} terminated with " + (f"signal {name}" if name else f"exit code {code}")
        elapsed = time.monotonic() - started_at
        raise _failure(
            Path(tmp), nproc, failed, code, name, message, False, elapsed, float(timeout)
        ) from None


def _call(request: dict[str, Any], guard_s: float) -> dict[str, Any]:
    global _warm, started
    if _warm is not None and _warm.owner != os.getpid():
        _warm = None  # inherited by a fork: the parent's, not ours to use or end
    if _warm is None:
        _warm = _Warm()
        started += 1
    request["preload"] = request["module"] not in _cold_modules
    try:
        reply = _warm.call(request, guard_s)
    except BaseException:  # a dead or hung warm process, or an abandoned call: no rank outlives it
        warm, _warm = _warm, None
        warm.kill()
        raise
    if "tainted" in reply:
        warm, _warm = _warm, None
        warm.close()
    return reply


@atexit.register
def _shutdown() -> None:
    global _warm
    if _warm is not None and _warm.owner == os.getpid():
        warm, _warm = _warm, None
        warm.close()
