"""The warm process behind :func:`~unison.testing.run_distributed`: it forks the ranks of each call.

It runs as a program of its own, started by :mod:`unison.testing.pool`: it imports torch, ignite
and unison once, runs no torch operation (so torch's thread pools and OpenMP have not started)
and no thread of its own, freezes what it imported out of the garbage collector's way, and then
serves calls. For each call it imports the module of the function to run (once: a later call of
the same module finds it), forks one process per rank, reports their process ids, waits for them
as torch's spawn does (the first rank that fails ends the others: SIGTERM, then SIGKILL 30 s
later) and reports their exit codes. Each rank is a fork of this state, so it starts with the
module globals of a fresh import, whatever an earlier call did; it takes the caller's environment,
working folder, ``sys.path``, stdout and stderr, creates its own process group and leaves through
:func:`unison.distributed.spawn._spawned_rank`, like a spawned rank.

Messages are pickles with a length in front, over a Unix socket; the caller's stdout and stderr
come with each call as file descriptors. A rank dies with this process (``PR_SET_PDEATHSIG``),
and this process ends its ranks and exits when the caller goes away.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import importlib
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import struct
import sys
import threading
import time
from datetime import timedelta
from multiprocessing import connection
from pathlib import Path
from typing import Any

from unison.distributed.rank_setup import freeze_heap

PRELOAD = ("torch", "ignite.engine", "ignite.distributed", "unison")
"""What the warm process imports before serving: what every rank would import anyway."""

GRACE_S = 30.0
"""After a rank failed, how long the others have to exit on SIGTERM before SIGKILL (as torch's spawn)."""

_HEADER = struct.Struct("!Q")

_held: list[socket.socket] = []
"""This process's ends of its sockets (to the caller, to the standby ranks): a forked rank closes
its copies, so that the rank on the other end of one sees it closed when this process closes it."""


def send(sock: socket.socket, message: Any, fds: tuple[int, ...] = ()) -> None:
    """Sends ``message`` (a pickle) and, with it, duplicates of the file descriptors ``fds``."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    if fds:
        sock.sendmsg([header], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(header)
    sock.sendall(data)


def receive(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and the file descriptors that came with it; EOFError when the peer is gone."""
    header, fds = b"", []
    while len(header) < _HEADER.size:
        chunk, ancillary, _, _ = sock.recvmsg(_HEADER.size - len(header), socket.CMSG_SPACE(8 * 4))
        if not chunk:
            raise EOFError("the other end of the pool's socket closed")
        header += chunk
        for level, kind, passed in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", passed[: len(passed) - len(passed) % 4]).tolist()
    (size,) = _HEADER.unpack(header)
    data = bytearray(size)
    view, got = memoryview(data), 0
    while got < size:
        n = sock.recv_into(view[got:])
        if not n:
            raise EOFError("the other end of the pool's socket closed")
        got += n
    return pickle.loads(data), fds


FORK_SAFE_THREADS = ("jemalloc_bg_thd",)
"""Threads of a library that makes a fork safe itself (it holds its locks across the fork and
starts its threads again in the child as needed): jemalloc's, which pyarrow loads."""


def thread_count() -> int:
    """This process's threads, C++ ones included, but for those of :data:`FORK_SAFE_THREADS` (Linux)."""
    count = 0
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(OSError):
            count += comm.read_text().strip() not in FORK_SAFE_THREADS
    return count


def serve(fd: int) -> None:
    """The warm process's main loop, on the socket ``fd`` its caller passed."""
    sock = socket.socket(fileno=fd)
    _held.append(sock)
    for name in PRELOAD:
        importlib.import_module(name)
    logging.getLogger("ignite.distributed.launcher.Parallel").setLevel(logging.WARNING)
    import torch

    _settle()
    baseline = thread_count()
    freeze_heap()  # a rank's collections then skip these objects, and leave their pages shared
    standby = _Standby()
    send(sock, {"ready": os.getpid(), "threads": baseline, "torch_threads": torch.get_num_threads()})
    try:
        while True:
            standby.fill()
            try:
                request, fds = receive(sock)
            except (EOFError, OSError):
                return
            try:
                reply = _call(sock, request, fds, baseline, standby)
            finally:
                for fd_ in fds:
                    os.close(fd_)
            if reply is None:  # the caller went away during the call
                return
            send(sock, reply)
            if "tainted" in reply:
                return
    finally:
        standby.clear()


def _settle() -> None:
    """Forks once, so that libraries with fork handlers stop their threads (OpenBLAS's, started by
    numpy as it loads, stop before a fork and start again at their next use, which a rank makes)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


class _Standby:
    """Ranks forked ahead of the next call, each waiting for its request on a socket of its own.

    Forking is the most of what starting a rank costs here (tens of milliseconds for a process
    with torch imported); forked while the caller runs the rest of its test, the ranks of the
    next call are ready when it comes. They are forks of this process's state as it is between
    calls, as a rank forked at the call would be; they are replaced when that state changes (a
    module imported for a call).
    """

    def __init__(self) -> None:
        self.size = 2
        self.ranks: list[tuple[Any, socket.socket]] = []

    def fill(self) -> None:
        context = multiprocessing.get_context("fork")
        while len(self.ranks) < self.size:
            ours, theirs = socket.socketpair()
            process = context.Process(target=_wait_for_call, args=(theirs, ours, os.getpid()), name="rank")
            process.start()
            theirs.close()
            _held.append(ours)
            self.ranks.append((process, ours))

    def take(self, count: int) -> list[tuple[Any, socket.socket]]:
        self.size = max(count, 1)
        taken, self.ranks = self.ranks[:count], self.ranks[count:]
        for _, sock in taken:
            _held.remove(sock)
        return taken

    def clear(self) -> None:
        """Ends the standby ranks (they hold nothing yet)."""
        for process, sock in self.ranks:
            process.kill()
            _held.remove(sock)
            sock.close()
        for process, _ in self.ranks:
            process.join()
        self.ranks = []


def _wait_for_call(sock: socket.socket, other: socket.socket, parent: int) -> None:
    """A standby rank: waits for its call, then runs it; exits when the warm process closes its socket."""
    _close_held(other)
    _die_with(parent)
    try:
        (local_rank, request), fds = receive(sock)
    except (EOFError, OSError):
        return
    sock.close()
    _rank(local_rank, request, fds, parent)


def _call(
    sock: socket.socket, request: dict[str, Any], fds: list[int], baseline: int, standby: _Standby
) -> dict[str, Any] | None:
    if request.get("preload"):
        problem, imported = _preload(request, baseline)
        if problem:
            return {"tainted": problem}
        if imported:  # ranks forked before the import would import it again
            standby.clear()
    nproc = request["nproc"]
    ranks = []
    for local_rank, (process, rank_sock) in enumerate(standby.take(nproc)):
        send(rank_sock, (local_rank, request), tuple(fds))
        rank_sock.close()
        ranks.append(process)
    context = multiprocessing.get_context("fork")
    for local_rank in range(len(ranks), nproc):
        process = context.Process(target=_rank, args=(local_rank, request, fds, os.getpid()), name="rank")
        process.start()
        ranks.append(process)
    send(sock, {"pids": [process.pid for process in ranks]})
    return _wait(sock, ranks)


def _preload(request: dict[str, Any], baseline: int) -> tuple[str | None, bool]:
    """Imports the module of the call's function here, once: what makes this process unfit to fork
    (if anything), and whether the module was imported now."""
    module = request["module"]
    if module in sys.modules:
        return None, False
    sys.path[:] = request["sys_path"]
    os.environ.clear()
    os.environ.update(request["environ"])
    with contextlib.suppress(OSError):
        os.chdir(request["cwd"])
    try:
        importlib.import_module(module)
    except BaseException:  # the ranks import it again, and report the error with its traceback
        sys.modules.pop(module, None)
    import torch.distributed as dist

    if threading.active_count() > 1 or thread_count() > baseline or dist.is_initialized():
        return (
            f"importing {module} started threads or a process group ({thread_count()} threads, "
            f"{baseline} before); a process forked from it could deadlock"
        ), True
    freeze_heap()
    return None, True


def _wait(sock: socket.socket, ranks: list[Any]) -> dict[str, Any] | None:
    """Waits for the ranks as torch's spawn does; None when the caller went away meanwhile."""
    sentinels = {process.sentinel: index for index, process in enumerate(ranks)}
    failed = None
    while sentinels and failed is None:
        ready = connection.wait([*sentinels, sock])
        if sock in ready:  # nothing is sent during a call: the caller is gone
            _end(ranks, signal.SIGKILL, 5.0)
            return None
        for sentinel in ready:
            index = sentinels.pop(sentinel)
            ranks[index].join()
            if ranks[index].exitcode != 0:
                failed = index
                break
    if failed is not None:
        _end(ranks, signal.SIGTERM, GRACE_S)
        _end(ranks, signal.SIGKILL, 5.0)
    return {"exitcodes": [process.exitcode for process in ranks], "failed": failed}


def _end(ranks: list[Any], sig: int, wait_s: float) -> None:
    """Sends ``sig`` to the ranks still running and waits up to ``wait_s`` for them to exit."""
    alive = [process for process in ranks if process.is_alive()]
    for process in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(process.pid, sig)
    until = time.monotonic() + wait_s
    for process in alive:
        process.join(max(0.0, until - time.monotonic()))


def _close_held(*more: socket.socket) -> None:
    """In a forked rank: closes the copies of the warm process's sockets."""
    for sock in (*_held, *more):
        sock.close()
    _held.clear()


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` ends (Linux), and end it now if that happened already."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def _rank(local_rank: int, request: dict[str, Any], fds: list[int], parent: int) -> None:
    """A rank: the caller's setting, a new process group, then the function, as a spawned rank runs it."""
    _close_held()
    _die_with(parent)
    for target, fd in zip((1, 2), fds, strict=False):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import ignite.distributed as idist
    import torch

    from unison.distributed.spawn import _record_error, _spawned_rank

    environ, nproc, results = request["environ"], request["nproc"], Path(request["result_dir"])
    try:
        sys.path[:] = request["sys_path"]
        os.chdir(request["cwd"])
        os.environ.clear()
        # ignite places the ranks by SLURM's variables when it sees them; the ranks get them back
        # once their group exists (_spawned_rank restores the caller's environment).
        os.environ.update({k: v for k, v in environ.items() if not k.startswith("SLURM_")})
        os.environ.update(
            LOCAL_RANK=str(local_rank),
            RANK=str(local_rank),
            WORLD_SIZE=str(nproc),
            MASTER_ADDR=request["master_addr"],
            MASTER_PORT=str(request["port"]),
        )
        multiprocessing.set_start_method(request["start_method"], force=True)
        threads = environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # OpenMP read it as it loaded, in the warm process
            torch.set_num_threads(int(threads))
        fn, args, kwargs = pickle.loads(request["payload"])
        idist.initialize(request["backend"], timeout=timedelta(seconds=request["timeout"]))
    except Exception:  # reported as a spawned rank's error before its function: with its traceback
        _record_error(results / f"error-rank-{local_rank}.txt")
        (results / f"raised-rank-{local_rank}").touch()
        raise SystemExit(1) from None
    _spawned_rank(local_rank, fn, args, kwargs, str(results), nproc, request["deadline"], environ)


if __name__ == "__main__":
    serve(int(sys.argv[1]))
