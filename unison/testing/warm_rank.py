"""What a rank of run_distributed's warm process runs (:mod:`unison.testing.zygote` forks it).

A rank is forked either ahead of its call (:func:`wait_for_call`: it forms its process group with
the other ranks of its team, says so, then waits for the call) or at the call
(:func:`run_rank`: it forms its group then). Either way it closes the warm process's sockets, dies
with the warm process, takes the caller's streams, folder, ``sys.path`` and environment, and runs
the function through :func:`unison.distributed.spawn._spawned_rank`, as a spawned rank does.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any

from unison.distributed.env import GROUP_ENV
from unison.testing.wire import receive, send

FORMING_TIMEOUT_S = 600.0
"""The timeout of a group formed ahead, until a call gives it the call's own."""

held: list[socket.socket] = []
"""The warm process's ends of its sockets (to the caller, to the standby ranks): a forked rank
closes its copies, so that the process on the other end of one sees it closed when the warm
process closes it."""


def wait_for_call(
    sock: socket.socket, other: socket.socket, parent: int, local_rank: int, team: dict[str, Any]
) -> None:
    """A standby rank: forms its group with the others, says so, waits for its call and runs it;
    exits when the warm process closes its socket."""
    _close_held(other)
    _die_with(parent)
    problem = _form_group(local_rank, team)
    try:
        send(sock, {"formed": problem is None, "problem": problem})
        if problem is not None:
            return
        (local_rank, request), fds = receive(sock)
    except (EOFError, OSError):
        return
    run_rank(local_rank, request, fds, parent, team, sock)


def _form_group(local_rank: int, team: dict[str, Any]) -> str | None:
    """Creates this standby rank's process group (ignite's context with it); why not, if it failed."""
    for key in [key for key in os.environ if key.startswith((*GROUP_ENV, "SLURM_"))]:
        del os.environ[key]  # ignite places the ranks by SLURM's variables when it sees them
    os.environ.update(team["env"])
    os.environ.update(_placement(local_rank, team["nproc"], team["master_addr"], team["port"]))
    try:
        _debug_level_from_env()
        _initialize("gloo", timedelta(seconds=FORMING_TIMEOUT_S))
    except Exception:
        return traceback.format_exc()
    return None


def _placement(local_rank: int, nproc: int, master_addr: str, port: int) -> dict[str, str]:
    return {
        "LOCAL_RANK": str(local_rank),
        "RANK": str(local_rank),
        "WORLD_SIZE": str(nproc),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(port),
    }


def _close_held(*more: socket.socket) -> None:
    """In a forked rank: closes the copies of the warm process's sockets."""
    for sock in (*held, *more):
        sock.close()
    held.clear()


def _die_with(parent: int) -> None:
    """SIGKILL this process when ``parent`` ends (Linux), and end it now if that happened already."""
    with contextlib.suppress(AttributeError, OSError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(1)


def run_rank(
    local_rank: int,
    request: dict[str, Any],
    fds: list[int],
    parent: int,
    team: dict[str, Any] | None = None,
    sock: socket.socket | None = None,
) -> None:
    """A rank: the caller's setting, its process group (``team``'s, formed ahead, given the call's
    timeout; else a new one now), then the function, as a spawned rank runs it. A rank of a team
    tells the warm process on ``sock`` when its function returned."""
    _close_held()
    _die_with(parent)
    for target, fd in zip((1, 2), fds, strict=False):
        os.dup2(fd, target)
    for fd in fds:
        os.close(fd)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch

    from unison.distributed.spawn import _record_error, _spawned_rank

    environ, nproc, results = request["environ"], request["nproc"], Path(request["result_dir"])
    port = team["port"] if team is not None else request["port"]
    try:
        sys.path[:] = request["sys_path"]
        os.chdir(request["cwd"])
        os.environ.clear()
        # ignite places the ranks by SLURM's variables when it sees them; the ranks get them back
        # once their group exists (_spawned_rank restores the caller's environment).
        os.environ.update({k: v for k, v in environ.items() if not k.startswith("SLURM_")})
        os.environ.update(_placement(local_rank, nproc, request["master_addr"], port))
        multiprocessing.set_start_method(request["start_method"], force=True)
        threads = environ.get("OMP_NUM_THREADS", "")
        if threads.isdigit() and int(threads) > 0:  # OpenMP read it as it loaded, in the warm process
            torch.set_num_threads(int(threads))
        fn, args, kwargs = pickle.loads(request["payload"])
        timeout = timedelta(seconds=request["timeout"])
        if team is None:
            _debug_level_from_env()
            _initialize(request["backend"], timeout)
        else:
            set_group_timeout(timeout)
    except Exception:  # reported as a spawned rank's error before its function: with its traceback
        _record_error(results / f"error-rank-{local_rank}.txt")
        (results / f"raised-rank-{local_rank}").touch()
        raise SystemExit(1) from None

    def returned() -> None:
        assert sock is not None
        with contextlib.suppress(OSError):  # the warm process is gone: this rank dies with it
            send(sock, {"returned": True})
            sock.close()

    on_return = returned if sock is not None else None
    _spawned_rank(
        local_rank, fn, args, kwargs, str(results), nproc, request["deadline"], environ, on_return=on_return
    )


def _initialize(backend: str, timeout: timedelta) -> None:
    """``ignite.distributed.initialize``, told what it would otherwise count with a second group that
    it forms and destroys (about 20 ms of every rank's start here): every rank runs on this host."""
    import ignite.distributed as idist
    from ignite.distributed.comp_models.native import _NativeDistModel

    count = _NativeDistModel._compute_nproc_per_node
    _NativeDistModel._compute_nproc_per_node = lambda self: self.get_world_size()  # type: ignore[method-assign]
    try:
        idist.initialize(backend, timeout=timeout)
    finally:
        _NativeDistModel._compute_nproc_per_node = count  # type: ignore[method-assign]


def _debug_level_from_env() -> None:
    """torch reads ``TORCH_DISTRIBUTED_DEBUG`` as ``torch.distributed`` is imported, which was in the
    warm process: read it again from this rank's environment, as a process importing it now would."""
    import torch.distributed as dist

    dist.set_debug_level_from_env()


def set_group_timeout(timeout: timedelta) -> None:
    """Gives the default process group, and the store it rendezvoused through, ``timeout``: what
    ``init_process_group(timeout=timeout)`` would have given them."""
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    distributed_c10d._set_pg_timeout(timeout)
    backend = distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    if getattr(getattr(backend, "options", None), "_timeout", None) != timeout:  # a wrapped group
        raise RuntimeError(
            f"the group formed ahead ({type(backend).__name__}) did not take the timeout {timeout}"
        )
    store = distributed_c10d._get_default_store()
    while True:
        store.set_timeout(timeout)
        if not isinstance(store, dist.PrefixStore):
            break
        store = store.underlying_store
