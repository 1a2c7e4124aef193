"""Running a test function on several gloo ranks."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

from unison.distributed.env import detect_launcher
from unison.distributed.launcher import launch
from unison.testing import pool


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 2,
    timeout: float = 120.0,
    backend: str = "gloo",
    start_method: str = "forkserver",
    fresh: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``nproc`` ranks and returns each rank's result.

    Each rank has a gloo process group of its own on a free port, so tests can run side by
    side, and destroys it before it exits. The call returns once every rank's function has
    returned and its result is back: the ranks leave their group and exit after that, and a
    rank that fails there is reported as a ``RuntimeWarning`` by a later call. A rank that
    raises fails the call with :class:`~unison.distributed.RankFailedError`, carrying that
    rank and its traceback; the other ranks are ended. A rank still running after
    ``timeout`` seconds prints the stacks of all its threads and exits, so a hang fails fast
    and shows where it was.

    The ranks are forked by a warm process that imported torch, ignite and unison once
    (:mod:`unison.testing.pool`; one per calling process, ended at exit), ahead of the call,
    and form their group ahead too, on a port of their own; the call gives the group its
    timeout (a group that ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` wraps is formed at the call, and
    so is one for a call whose number of ranks, or whose ``TORCH_``, ``GLOO_``, ``NCCL_`` or
    ``PYTORCH_`` variables, differ from the last call's). After the first call, a call costs a
    few hundredths of a second, not the second or more of starting processes. Every rank is
    still a new process, in a new group, forked from a state no call has touched: a module
    global one call sets is not there in the next, and a crashed or hung call leaves nothing
    behind. The ranks get the caller's environment variables, working folder, ``sys.path``,
    stdout and stderr of the moment of the call. The function's module is imported once in
    the warm process, with the environment of the first call that needed it (a module that
    reads a variable as it is imported sees that one); a module that starts threads as it is
    imported is imported by each rank instead. With ``fresh=True``, with ``backend="nccl"``,
    for a function defined in ``__main__`` (a script) and off Linux, the ranks are spawned
    anew through :func:`~unison.distributed.launch`, as before the pool: each imports
    everything itself.

    Args:
        fn: a function defined at the top level of a module (it is sent by name).
        *args: positional arguments for ``fn``, picklable.
        nproc: the number of ranks.
        timeout: seconds each rank may run, process start included; it is also the
            process group's timeout.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        start_method: the ranks' multiprocessing start method (what their own processes
            use); with ``fresh=True``, how they start: ``"forkserver"`` or ``"spawn"``.
        fresh: start the ranks from nothing (spawned, importing everything themselves) instead
            of forking them from the warm process: for a test of what a new process does.
        **kwargs: keyword arguments for ``fn``, picklable.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Example:
        .. code-block:: python

            import torch.distributed as dist
            from unison.testing import run_distributed

            def total_rank():
                t = torch.tensor([float(dist.get_rank())])
                dist.all_reduce(t)
                return t.item()

            def test_all_reduce():
                assert run_distributed(total_rank, nproc=3) == [3.0, 3.0, 3.0]
    """
    if not fresh and _poolable(fn, nproc, timeout, backend, start_method):
        return pool.run(fn, args, kwargs, nproc, float(timeout), backend, start_method)
    return launch(
        fn,
        *args,
        nproc_per_node=nproc,
        backend=backend,
        timeout=timeout,
        start_method=start_method,
        deadline=timeout,
        **kwargs,
    )


def _poolable(fn: Callable[..., Any], nproc: Any, timeout: Any, backend: str, start_method: str) -> bool:
    """Whether the warm process can run the call; launch checks, and refuses, everything else."""
    return (
        sys.platform.startswith("linux")
        and backend == "gloo"
        and start_method in ("forkserver", "spawn")
        and isinstance(nproc, int)
        and not isinstance(nproc, bool)
        and nproc >= 1
        and isinstance(timeout, (int, float))
        and not isinstance(timeout, bool)
        and timeout > 0
        and getattr(fn, "__module__", "__main__") not in ("__main__", "__mp_main__", None)
        and detect_launcher().kind == "none"
    )
