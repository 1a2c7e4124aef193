"""The fork server that spawned ranks fork from, and how it starts.

multiprocessing's fork server is a process that imported torch, ignite and unison once; each
rank is a fork of it. Python starts that server by running a fresh interpreter, which then
imports those modules again: about 4 CPU-seconds per run, paid again in every process that
launches ranks, while the launching process has imported them all already.

Where the launching process is in a state that forks safely, the server is instead a fork of
it (:func:`start_fork_server`): it starts in milliseconds, holding every module the launching
process imported, a config's modules included, and the ranks import none of them again. The
server still runs multiprocessing's own loop (``multiprocessing.forkserver.main``), and ranks
reach it as they reach a started one. The state that forks safely is one Python thread, no
CUDA driver loaded, and no open file beyond the standard streams and those the server is
handed; anything else, and on platforms other than Linux, the server starts as Python starts
it. The server's process is then, as a started one, free of the launching process's files
and signal handlers.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import re
import signal
import sys
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from multiprocessing import forkserver, resource_tracker, util
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from unison.distributed.env import group_env
from unison.distributed.signals import _start_helpers
from unison.utils.logging import get_logger

_log = get_logger(__name__)

PRELOAD = ["torch", "torch._dynamo", "ignite.engine", "unison"]
_SERVER_ONLY = "unison.distributed.fork_server_ranks"  # the server's own preload: never a launcher's import
_SERVER_CODE = "from multiprocessing.forkserver import main"  # the -c code Python starts it with
_CUDA_DRIVER = re.compile(r"/libcuda\.so")

_served: tuple[int, dict[str, str]] | None = None
"""The process id of the last fork server this process started, and the torch variables
(:func:`~unison.distributed.env.group_env`) of the environment it started in."""


def start_fork_server() -> tuple[int, ...]:
    """Starts the fork server that a ``start_method="forkserver"`` launch forks its ranks from,
    if it is not running yet, and returns the signals its ranks unblock (see ``_start_helpers``).

    The server holds torch, ignite and unison imported; each rank is a fork of it and starts in
    a fraction of a second instead of importing them again. Where this process forks safely
    (see the module's docs), the server is a fork of it, with everything it imported; else a
    fresh interpreter that imports them in the background (started early, those imports overlap
    the caller's work: see :func:`fork_server_ahead`).
    """
    mp.get_context("forkserver").set_forkserver_preload([*PRELOAD, _SERVER_ONLY])
    if _server_running():
        served = _server_env()
        if served is None or served == group_env():
            return _start_helpers("forkserver")
        # Its ranks would import torch.distributed and create their group in the environment of
        # its start, not the caller's (TORCH_DISTRIBUTED_DEBUG, GLOO_SOCKET_IFNAME, ...).
        _log.debug("the fork server's torch variables differ from this process's now: starting a new one")
        _stop_server()
    try:
        return _start_server()
    finally:
        _remember_server(group_env())


def _start_server() -> tuple[int, ...]:
    hazard = fork_hazard()
    if hazard is None:
        for name in PRELOAD:  # what the server would import, and this process needs anyway
            importlib.import_module(name)
        with _servers_forked_from_here() as forked:
            unblock = _start_helpers("forkserver")
        if forked:
            _log.debug("the fork server is a fork of this process (pid %d)", forked[0])
        return unblock
    _log.debug("the fork server starts as a new interpreter: %s", hazard)
    return _start_helpers("forkserver")


def _remember_server(env: dict[str, str]) -> None:
    global _served
    pid = server_pid()
    _served = (pid, env) if pid is not None else None


def _server_env() -> dict[str, str] | None:
    """The torch variables of the environment the running server started in; None if unknown. A
    server this process did not start (multiprocessing started it for a DataLoader, say) was
    started as a new interpreter, whose starting environment Linux keeps in ``/proc``."""
    pid = server_pid()
    if pid is None:
        return None
    if _served is not None and _served[0] == pid:
        return _served[1]
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return group_env({key: value for key, _, value in pairs})


def fork_server_now() -> None:
    """Starts the fork server now if it is not running and can be a fork of this process, for a
    caller that is about to open files or start threads and launches ranks only later (a sweep,
    before its study's storage and its trials' decision servers)."""
    if not _server_running() and fork_hazard() is None:
        start_fork_server()


@contextlib.contextmanager
def fork_server_ahead(start: bool) -> Iterator[Callable[[], None]]:
    """The fork server (when ``start``) for a block that plans and checks a run before its ranks
    start. Where this process cannot fork it, a new interpreter starts at once, so that its
    imports overlap the block; else the block calls the function it is given once it has
    imported what the ranks need (the config's modules), and the server is forked then. If the
    block raises (the run is refused) and this call started the server, ends it at once (a new
    interpreter would otherwise import on, orphaned, after the refusal's exit)."""
    started = start and not _server_running()
    forked = started and fork_hazard() is None
    if started and not forked:
        start_fork_server()

    def ready() -> None:
        if forked and not _server_running():
            start_fork_server()  # a fork, or a new interpreter if the block left this process unsafe

    try:
        yield ready
    except BaseException:
        if started:
            _stop_server()
        raise


def _stop_server() -> None:
    """Ends the running fork server now (SIGKILL: it holds nothing but its imports); the next
    start is a fresh one."""
    server = forkserver._forkserver
    pid = getattr(server, "_forkserver_pid", None)
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    stop = getattr(server, "_stop", None)
    if callable(stop):  # closes its pipe, reaps it, removes its socket: the next start is fresh
        stop()


def server_pid() -> int | None:
    """The running fork server's process id, or None."""
    return getattr(forkserver._forkserver, "_forkserver_pid", None)


def fork_hazard(keep_fds: Sequence[int] = ()) -> str | None:
    """What keeps this process from forking a long-lived child that goes on running Python, or
    None: a platform other than Linux, another Python thread, CUDA initialized or its driver
    loaded (a CUDA context does not survive a fork), or a file this process opened still open beyond the
    standard streams and ``keep_fds`` (the child closes it, and an object that holds it would
    hold a stale number that a later open reuses)."""
    if not sys.platform.startswith("linux"):
        return f"the platform is {sys.platform}, not Linux"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "CUDA is initialized"
    if threading.active_count() != 1:
        names = [thread.name for thread in threading.enumerate() if thread is not threading.current_thread()]
        return f"other Python threads run: {names}"
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            # the driver, loaded by the first CUDA call (torch's CUDA build maps libcudart at import)
            if _CUDA_DRIVER.search(maps.read()):
                return "the CUDA driver is loaded"
        opened = _opened_here(keep_fds)
    except OSError as err:
        return f"/proc/self is unreadable: {err}"
    if opened:
        return "files opened here are open: " + ", ".join(f"{fd} ({_link(fd)})" for fd in opened)
    return None


def _server_running() -> bool:
    return server_pid() is not None


def _opened_here(keep_fds: Sequence[int]) -> list[int]:
    """File descriptors this process opened, other than the standard streams, ``keep_fds``, the
    resource tracker's pipe and the other end of a pipe in ``keep_fds`` (the fork server's
    ``alive`` pipe, whose write end stays with this process). Python opens every file
    close-on-exec; one without that flag was inherited from the process that started this
    one, is held by no object here, and the server closes it as a fresh interpreter's start would."""
    known = {0, 1, 2, *keep_fds}
    tracker_fd = getattr(resource_tracker._resource_tracker, "_fd", None)
    if tracker_fd is not None:
        known.add(tracker_fd)
    kept_pipes = {_link(fd) for fd in keep_fds}
    opened = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd in known:
            continue
        link = _link(fd)
        if link is None:  # the descriptor of the listing itself, closed meanwhile
            continue
        if link.startswith("pipe:") and link in kept_pipes:
            continue
        with contextlib.suppress(OSError):
            if not os.get_inheritable(fd):  # close-on-exec: opened by this process
                opened.append(fd)
    return opened


def _link(fd: int) -> str | None:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


@contextlib.contextmanager
def _servers_forked_from_here() -> Iterator[list[int]]:
    """While inside, multiprocessing starts a fork server by forking this process (see
    :func:`_fork_server_process`) instead of running a fresh interpreter; any other process it
    starts, and a server it starts in a form not recognised, as before. Yields the list that
    receives the forked server's process id."""
    original = util.spawnv_passfds
    forked: list[int] = []

    def spawnv_passfds(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
        code = args[-1] if len(args) >= 2 and args[-2] == "-c" and isinstance(args[-1], str) else ""
        hazard = fork_hazard(passfds) if code.startswith(_SERVER_CODE) else "not the fork server"
        if hazard is not None:
            if code.startswith(_SERVER_CODE):
                _log.debug("the fork server starts as a new interpreter: %s", hazard)
            return original(path, args, passfds)
        forked.append(_fork_server_process(code, passfds))
        return forked[-1]

    util.spawnv_passfds = spawnv_passfds
    try:
        yield forked
    finally:
        util.spawnv_passfds = original


def _fork_server_process(code: str, passfds: Sequence[int]) -> int:
    """Forks the fork server: the child runs ``code``, multiprocessing's own start of the
    server, as a fresh interpreter would, and never returns to this process's code."""
    for stream in (sys.stdout, sys.stderr):  # else the child writes what is buffered a second time
        with contextlib.suppress(Exception):
            stream.flush()
    with warnings.catch_warnings():
        # Python 3.12+ warns of any fork of a process with more than one thread: here the others
        # are native pools of torch's libraries (BLAS, the allocator), which handle a fork, as in
        # the fork server Python starts, which forks every rank after importing torch.
        warnings.filterwarnings(
            "ignore", message=r"This process .* is multi-threaded", category=DeprecationWarning
        )
        pid = os.fork()
    if pid != 0:
        return pid
    status = 1
    try:
        _become_fresh(passfds)
        exec(code, {"__name__": "__mp_fork_server__"})  # noqa: S102 - multiprocessing's own -c code
        status = 0
    except SystemExit as end:  # the server's loop ends with SystemExit once its parent is gone
        status = end.code if isinstance(end.code, int) else 0
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(status)  # never this process's exit handlers, buffers or finalizers


def _become_fresh(passfds: Sequence[int]) -> None:
    """What a fresh interpreter would not have: the parent's other files (closed), its Python
    signal handlers (back to Python's defaults; ignored signals stay ignored, as across exec),
    and multiprocessing's record of its fork server, whose lock the parent held as it forked.
    The parent's exit handlers stay registered and never run: the server and every rank it
    forks end with ``os._exit``."""
    keep = sorted({0, 1, 2, *passfds})
    for low, high in zip([-1, *keep], [*keep, os.sysconf("SC_OPEN_MAX")], strict=True):
        if high > low + 1:  # closerange of an empty range closes every descriptor on some Pythons
            os.closerange(low + 1, high)
    for sig in signal.valid_signals():
        with contextlib.suppress(OSError, ValueError, RuntimeError, TypeError):
            handler = signal.getsignal(sig)
            if callable(handler) and handler is not signal.default_int_handler:
                signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    forkserver._forkserver.__init__()  # type: ignore[misc]  # unlocked, no server, no preload
    importlib.import_module(_SERVER_ONLY).install()  # its ranks take SIGTERM and SIGUSR1 at once
