"""The warm process behind :func:`~unison.testing.run_distributed`: it forks the ranks of each call.

It runs as a program of its own, started by :mod:`unison.testing.pool`: it imports torch, ignite
and unison once, runs no torch operation (so torch's thread pools and OpenMP have not started)
and no thread of its own, freezes what it imported out of the garbage collector's way, and then
serves calls. For each call it imports the module of the function to run (once: a later call of
the same module finds it), hands the call to its ranks, reports their process ids, waits for them
as torch's spawn does (the first rank that fails ends the others: SIGTERM, then SIGKILL 30 s
later) and reports how they ended. Each rank is a fork of this state, so it starts with the
module globals of a fresh import, whatever an earlier call did; it takes the caller's environment,
working folder, ``sys.path``, stdout and stderr, runs the function and leaves its process group
through :func:`unison.distributed.spawn._spawned_rank`, like a spawned rank.

What a call does not wait for (:class:`_Standby`, :class:`_Leaving`): the ranks of the next call
are forked, and form a new process group of their own on a new port, while the caller runs the
rest of its test; the call gives that group its timeout, and uses it only if its environment
agrees with the call's in every variable a group reads as it is created
(:data:`~unison.distributed.env.GROUP_ENV`; otherwise the call's ranks are forked and form their
group at the call). A call returns once every rank's function has returned and its result is
written; the ranks then destroy their group and exit on their own, and one that fails there, or
is still running :data:`GRACE_S` later, is reported with the next reply (a warning in the caller).

What a rank runs is :mod:`unison.testing.warm_rank`. Messages (:mod:`unison.testing.wire`) are
pickles over a Unix socket; the caller's stdout and stderr come with each call as file
descriptors. A rank dies with this process (``PR_SET_PDEATHSIG``), and this process ends its
ranks and exits when the caller goes away.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from multiprocessing import connection
from pathlib import Path
from typing import Any

from unison.distributed.env import find_free_port, group_env
from unison.distributed.rank_setup import freeze_heap
from unison.testing.warm_rank import held, run_rank, wait_for_call
from unison.testing.wire import receive, send

PRELOAD = ("torch", "ignite.engine", "ignite.distributed", "unison")
"""What the warm process imports before serving: what every rank would import anyway."""

GRACE_S = 30.0
"""After a rank failed, how long the others have to exit on SIGTERM before SIGKILL (as torch's spawn);
also how long a rank whose function returned may take to leave its group and exit."""

FORM_WAIT_S = 60.0
"""How long a call waits for the group its standby ranks are forming (they form it while the caller
runs the rest of its test); past it, or if forming it failed, the call forms its own."""

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
    held.append(sock)
    for name in PRELOAD:
        importlib.import_module(name)
    logging.getLogger("ignite.distributed.launcher.Parallel").setLevel(logging.WARNING)
    import torch

    _settle()
    baseline = thread_count()
    freeze_heap()  # a rank's collections then skip these objects, and leave their pages shared
    standby, leaving = _Standby(), _Leaving()
    send(sock, {"ready": os.getpid(), "threads": baseline, "torch_threads": torch.get_num_threads()})
    try:
        while True:
            standby.fill()
            try:
                request, fds = receive(sock)
            except (EOFError, OSError):
                return
            try:
                reply = _call(sock, request, fds, baseline, standby, leaving)
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
        leaving.end()


def _settle() -> None:
    """Forks once, so that libraries with fork handlers stop their threads (OpenBLAS's, started by
    numpy as it loads, stop before a fork and start again at their next use, which a rank makes)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _formable(env: dict[str, str]) -> bool:
    """Whether a group formed ahead in ``env`` can take a call's timeout: not one that
    ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps in torch's checking group (whose helper group keeps
    the timeout it was created with)."""
    return env.get("TORCH_DISTRIBUTED_DEBUG", "").upper() != "DETAIL"


class _Standby:
    """The ranks of the next call, forked ahead, in a process group they formed ahead.

    Forking a rank and creating its group are most of what starting the ranks costs here (tens of
    milliseconds each, for processes with torch imported); done while the caller runs the rest of
    its test, the ranks of the next call are ready when it comes. They are forks of this process's
    state as it is between calls, as ranks forked at the call would be, and their group is new, on
    a port chosen for it; they are replaced when that state changes (a module imported for a
    call). They are formed for the shape of the last call (its number of ranks, and the variables
    of :data:`~unison.distributed.env.GROUP_ENV` in its environment): a call of another shape ends
    them and forms its own.
    """

    def __init__(self) -> None:
        self.size = 2
        self.env = group_env()
        self.ranks: list[tuple[Any, socket.socket]] = []
        self.team: dict[str, Any] = {}

    def fill(self) -> None:
        if len(self.ranks) == self.size or not _formable(self.env):
            return
        self.clear()
        context = multiprocessing.get_context("fork")
        self.team = {"nproc": self.size, "master_addr": "127.0.0.1", "env": self.env}
        self.team["port"] = find_free_port(self.team["master_addr"])
        for local_rank in range(self.size):
            ours, theirs = socket.socketpair()
            process = context.Process(
                target=wait_for_call, args=(theirs, ours, os.getpid(), local_rank, self.team), name="rank"
            )
            process.start()
            theirs.close()
            held.append(ours)
            self.ranks.append((process, ours))

    def take(self, request: dict[str, Any]) -> tuple[list[tuple[Any, socket.socket]], dict[str, Any]]:
        """The standby ranks and their group's settings, if they can serve ``request``; else none
        (they are ended). The next ones are formed for this request's shape."""
        env = group_env(request["environ"])
        fits = (
            len(self.ranks) == request["nproc"]
            and request["backend"] == "gloo"
            and request["master_addr"] == self.team.get("master_addr")
            and env == self.team.get("env")
            and _formable(env)
        )
        self.size, self.env = max(request["nproc"], 1), env
        if fits and all(_formed(sock) for _, sock in self.ranks):
            taken, self.ranks, team = self.ranks, [], self.team
            return taken, team
        self.clear()
        return [], {}

    def clear(self) -> None:
        """Ends the standby ranks (they ran nothing but their group)."""
        for process, sock in self.ranks:
            process.kill()
            held.remove(sock)
            sock.close()
        for process, _ in self.ranks:
            process.join()
        self.ranks = []


def _formed(sock: socket.socket) -> bool:
    """Whether the standby rank at the other end of ``sock`` says its group is formed."""
    sock.settimeout(FORM_WAIT_S)
    try:
        message, _ = receive(sock)
    except (EOFError, OSError):
        return False
    finally:
        sock.settimeout(None)
    return bool(message.get("formed"))


class _Leaving:
    """Ranks whose call returned (every rank's function did), now leaving their group and exiting.

    The call does not wait for them. One that exits with an error, or is still running
    :data:`GRACE_S` after its call returned (it is then killed), is reported with the next reply.
    """

    def __init__(self) -> None:
        self.ranks: list[tuple[Any, float, str]] = []

    def add(self, processes: list[Any], name: str) -> None:
        now = time.monotonic()
        self.ranks += [(process, now, name) for process in processes]

    def reap(self) -> list[str]:
        """What went wrong with the ranks that have exited since the last reap (or outlived the grace)."""
        notes, running = [], []
        for process, since, name in self.ranks:
            if process.is_alive() and time.monotonic() - since > GRACE_S:
                process.kill()
                process.join()
                notes.append(
                    f"a rank of {name} (pid {process.pid}) was still leaving its group {GRACE_S:.0f} s "
                    "after the call returned, and was killed"
                )
            elif process.is_alive():
                running.append((process, since, name))
            else:
                process.join()
                if process.exitcode != 0:
                    notes.append(
                        f"a rank of {name} (pid {process.pid}) exited with code {process.exitcode} "
                        "as it left its group, after the call returned (its stderr says why)"
                    )
        self.ranks = running
        return notes

    def end(self) -> None:
        """This process is ending: the ranks still leaving get a moment, then are killed."""
        until = time.monotonic() + 5.0
        for process, _, _ in self.ranks:
            process.join(max(0.0, until - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        self.ranks = []


def _call(
    sock: socket.socket,
    request: dict[str, Any],
    fds: list[int],
    baseline: int,
    standby: _Standby,
    leaving: _Leaving,
) -> dict[str, Any] | None:
    late = leaving.reap()
    if request.get("preload"):
        problem, imported = _preload(request, baseline)
        if problem:
            return {"tainted": problem, "late": late}
        if imported:  # ranks forked before the import would import it again
            standby.clear()
    nproc = request["nproc"]
    taken, team = standby.take(request)
    ranks, socks = [], {}
    for local_rank, (process, rank_sock) in enumerate(taken):
        send(rank_sock, (local_rank, request), tuple(fds))
        ranks.append(process)
        socks[rank_sock] = local_rank
    context = multiprocessing.get_context("fork")
    for local_rank in range(len(ranks), nproc):
        process = context.Process(target=run_rank, args=(local_rank, request, fds, os.getpid()), name="rank")
        process.start()
        ranks.append(process)
    send(sock, {"pids": [process.pid for process in ranks], "formed_ahead": bool(team)})
    try:
        reply = _wait(sock, ranks, socks)
    finally:
        for rank_sock in socks:
            held.remove(rank_sock)
            rank_sock.close()
    if reply is None:
        return None
    if reply["failed"] is None:  # the ranks still leave their group and exit: reaped later
        leaving.add(ranks, request.get("name", "a call"))
    reply["late"] = late + leaving.reap()
    return reply


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


def _wait(sock: socket.socket, ranks: list[Any], socks: dict[socket.socket, int]) -> dict[str, Any] | None:
    """Waits for the ranks as torch's spawn does, until every rank's function returned (it says so
    on its socket in ``socks``, or exits with 0); None when the caller went away meanwhile."""
    sentinels = {process.sentinel: index for index, process in enumerate(ranks)}
    socks = dict(socks)
    returned: set[int] = set()
    failed = None
    while len(returned) < len(ranks) and failed is None:
        ready = connection.wait([*socks, *sentinels, sock])
        if sock in ready:  # nothing is sent during a call: the caller is gone
            _end(ranks, signal.SIGKILL, 5.0)
            return None
        for rank_sock in [ready_ for ready_ in ready if ready_ in socks]:  # before the exits they precede
            index = socks.pop(rank_sock)
            with contextlib.suppress(EOFError, OSError):  # a rank that died: its exit code says how
                if receive(rank_sock)[0].get("returned"):
                    returned.add(index)
        for sentinel in [ready_ for ready_ in ready if ready_ in sentinels]:
            index = sentinels.pop(sentinel)
            ranks[index].join()
            if ranks[index].exitcode == 0 or index in returned:
                returned.add(index)  # one that fails as it leaves, after its function returned, is late
            else:
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


if __name__ == "__main__":
    serve(int(sys.argv[1]))
