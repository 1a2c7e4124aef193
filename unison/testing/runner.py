"""Running a test function on several gloo ranks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unison.distributed.launcher import launch


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 2,
    timeout: float = 120.0,
    backend: str = "gloo",
    start_method: str = "forkserver",
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on ``nproc`` ranks and returns each rank's result.

    The ranks are spawned through ``idist.Parallel`` with a gloo process group on a free
    port, so tests can run side by side. A rank that raises fails the call with
    :class:`~unison.distributed.RankFailedError`, carrying that rank and its traceback;
    the other ranks are ended. A rank still running after ``timeout`` seconds prints the
    stacks of all its threads and exits, so a hang fails fast and shows where it was.

    Args:
        fn: a function defined at the top level of a module (it is sent by name).
        *args: positional arguments for ``fn``, picklable.
        nproc: the number of ranks.
        timeout: seconds each rank may run, process start included; it is also the
            process group's timeout.
        backend: ``"gloo"`` (CPU) or ``"nccl"``.
        start_method: ``"forkserver"`` (fast repeated starts) or ``"spawn"``.
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
