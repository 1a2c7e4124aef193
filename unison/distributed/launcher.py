"""Start a function on every rank: spawned locally, under torchrun, or under SLURM.

:func:`launch` checks its arguments and picks the path: one rank of a torchrun or srun job
(its process group created here), a single process, or N ranks spawned on this machine
(:mod:`unison.distributed.spawn`, with the signal relay of :mod:`unison.distributed.signals`).
The exit codes, grace periods and :class:`RankFailedError` are importable from here too.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import ignite.distributed as idist
import torch
import torch.distributed as dist

from unison.distributed.env import default_backend, detect_launcher, device_for_local_rank
from unison.distributed.rank_setup import (
    _configure_rank,
    _hide_slurm_from_ignite,
    _is_peer_failure,
    _leave_group,
    _note_rank,
)
from unison.distributed.signals import EXIT_INTERRUPTED, EXIT_PREEMPTED, INTERRUPT_GRACE_S, PREEMPTION_GRACE_S
from unison.distributed.spawn import RankFailedError, _spawn
from unison.utils.logging import get_logger
from unison.utils.startup import mark

__all__ = [
    "DEFAULT_TIMEOUT",
    "EXIT_INTERRUPTED",
    "EXIT_PREEMPTED",
    "INTERRUPT_GRACE_S",
    "PREEMPTION_GRACE_S",
    "RankFailedError",
    "launch",
]

_log = get_logger(__name__)

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Process-group timeout: how long a collective may wait for a missing rank before failing."""


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc_per_node: int | None = None,
    backend: str | None = None,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    start_method: str | None = None,
    deadline: float | None = None,
    debug: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """Runs ``fn(*args, **kwargs)`` on every rank of a process group, through ``idist.Parallel``.

    Three situations, told apart by the environment:

    - ``nproc_per_node=N`` and no launcher: spawns N local processes, with a free port
      chosen for the rendezvous unless ``master_port`` is given.
    - Started by torchrun or by srun (SLURM): this process is one rank; the process group is
      made from the launcher's variables. ``nproc_per_node`` must then be left out: the
      launcher has already started the processes.
    - Neither: runs ``fn`` once in this process, with no process group (world size 1).

    Every rank gets logging prefixed with its rank, and on GPUs its own ``cuda:LOCAL_RANK``
    device (see :func:`unison.distributed.device`).

    Args:
        fn: the function every rank runs. When spawning it must be importable by name
            (defined at the top level of a module) and its arguments picklable.
        *args: positional arguments for ``fn``.
        nproc_per_node: how many processes to spawn on this machine.
        backend: ``"nccl"`` or ``"gloo"``; default nccl when CUDA is available, else gloo.
        timeout: how long a collective may wait for the other ranks before it fails, as a
            ``timedelta`` or seconds. The default is 10 minutes, not torch's 30.
        master_addr: rendezvous address when spawning.
        master_port: rendezvous port when spawning; default, a free port.
        start_method: multiprocessing start method when spawning. ``"forkserver"`` (the default
            where there is one: Linux, macOS): the ranks are forks of a server process that
            imported torch, ignite and unison once, started at the first launch and kept for the
            next (Python 3.14's own default on Linux); each rank then imports only the
            function's module. ``"spawn"`` (the default on Windows): each rank a new interpreter
            that imports everything itself. Both run ``fn`` with the caller's environment
            variables, working folder and ``sys.path`` of the moment of the call.
        deadline: when spawning, seconds after which a rank that has not finished prints the
            stacks of all its threads and exits, failing the job. Meant for tests.
        debug: turn on unison's lockstep checks at every sync point (``UNISON_DEBUG=1``:
            ranks at different events or iterations, or with different handlers, fail naming
            the rank that went its own way) and torch's distributed logging
            (``TORCH_DISTRIBUTED_DEBUG=INFO``; its ``DETAIL`` level crashes DDP on gloo in
            torch 2.13). Costs a collective per sync point; for diagnosing.
        **kwargs: keyword arguments for ``fn``.

    Returns:
        The return values of the ranks that ran in this process tree, in local-rank order:
        all N when spawning, else a one-element list with this process's result.

    Raises:
        RuntimeError: when asked to spawn inside torchrun or SLURM (processes would be
            duplicated), with what to run instead.
        RankFailedError: when a spawned rank raised or died; names the rank and carries
            its traceback (the rank that failed first for a reason of its own, not one that
            failed waiting for it in a collective).
        SystemExit: when spawning, with code 75 (``EXIT_PREEMPTED``) when the ranks were
            preempted and saved a checkpoint (see :class:`unison.handlers.Preemption`); with
            130 (``EXIT_INTERRUPTED``) when Ctrl-C (SIGINT) stopped them; with 128 + the
            signal's number when SIGTERM or SIGUSR1 ended them without a preemption
            checkpoint.

    Signals, when spawning (from the main thread): SIGTERM, SIGUSR1 and SIGINT sent to this
    process, or to its whole process group, are forwarded to the ranks, and this process
    waits for them instead of dying first: up to ``PREEMPTION_GRACE_S`` (SIGTERM, SIGUSR1:
    time for :class:`~unison.handlers.Preemption` to save) or ``INTERRUPT_GRACE_S`` (SIGINT)
    before it kills them. Inside an sbatch allocation without srun, SLURM's task placement
    is ignored (with a log line): the ranks are the ``nproc_per_node`` spawned here.

    Example:
        >>> from unison.distributed import launch, get_rank
        >>> def work(x):
        ...     return x + get_rank()
        >>> launch(work, 1)  # no launcher, no nproc_per_node: one process
        [1]

    Distributed:
        Call it on every process a launcher started, or once from the main process when
        spawning. The process group exists on every rank before ``fn`` runs.
    """
    if not callable(fn):
        raise TypeError(f"launch(fn=...) needs a callable, got {type(fn).__name__}: {fn!r}")
    if nproc_per_node is not None and (
        isinstance(nproc_per_node, bool) or not isinstance(nproc_per_node, int) or nproc_per_node < 1
    ):
        raise ValueError(
            f"launch(nproc_per_node=...) must be a positive int or None, got {nproc_per_node!r}."
        )
    if backend is None:
        backend = default_backend()
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"launch(backend=...) must be 'gloo' or 'nccl', got {backend!r}.")
    if backend == "nccl" and not torch.cuda.is_available():
        raise ValueError(
            "launch(backend='nccl') needs CUDA, and torch.cuda.is_available() is False here. "
            "Use backend='gloo' (or leave backend unset) to run on CPU."
        )
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc_per_node is not None and 0 < gpus < nproc_per_node:
        raise ValueError(
            f"launch(nproc_per_node={nproc_per_node}) on a machine that shows {gpus} GPU(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}): each rank takes "
            f"cuda:LOCAL_RANK as its group forms (ignite sets it on gloo too), and rank {gpus} would fail with "
            f"'invalid device ordinal'. Spawn at most {gpus}, or hide the GPUs for ranks on the CPU "
            "(CUDA_VISIBLE_DEVICES= in the environment before the process starts)."
        )
    timeout = _as_timedelta(timeout, "launch")
    if start_method is None:
        start_method = "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"
    if start_method not in ("spawn", "forkserver"):
        raise ValueError(
            f"launch(start_method=...) must be 'spawn' or 'forkserver', got {start_method!r}: "
            "'fork' is unsafe once torch has started its thread pools."
        )
    if deadline is not None and deadline <= 0:
        raise ValueError(f"launch(deadline=...) must be a positive number of seconds, got {deadline!r}.")

    # ignite's launcher logs its parameters at INFO through a handler of its own unless its
    # logger already exists; unison logs what matters itself.
    logging.getLogger("ignite.distributed.launcher.Parallel").setLevel(logging.WARNING)
    info = detect_launcher()
    with _debug_environment(debug):
        if debug:
            start_method = "spawn"  # a fork server's ranks would create their group first
        if nproc_per_node is None:
            return [
                _run_in_process(
                    fn,
                    args,
                    kwargs,
                    backend,
                    timeout,
                    launched=info.kind != "none",
                    torchrun=info.kind == "torchrun",
                )
            ]
        if info.kind != "none":
            raise RuntimeError(
                f"launch(nproc_per_node={nproc_per_node}) was called in a process that is already one rank of "
                f"a job started by {info.describe()}. Spawning here would start extra processes with "
                "duplicate ranks. " + _nested_fix(info.kind)
            )
        if idist.get_world_size() > 1:
            raise RuntimeError(
                f"launch(nproc_per_node={nproc_per_node}) was called inside a process group of "
                f"{idist.get_world_size()} ranks. Call fn directly instead."
            )
        return _spawn(
            fn,
            args,
            kwargs,
            nproc_per_node,
            backend,
            timeout,
            master_addr,
            master_port,
            start_method,
            deadline,
        )


@contextlib.contextmanager
def _debug_environment(debug: bool) -> Iterator[None]:
    """Turns on the debug variables for the job, and off again for the caller."""
    if not debug:
        yield
        return
    # Read by torch when the process group is created, and inherited by spawned ranks.
    wanted = {"TORCH_DISTRIBUTED_DEBUG": "INFO", "UNISON_DEBUG": "1"}
    saved = {k: os.environ.get(k) for k in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _nested_fix(kind: str) -> str:
    if kind == "torchrun":
        return "Leave nproc_per_node out (drop the option that asks to spawn, such as --nproc or --ranks) when running under torchrun."
    if kind == "slurm":
        return (
            "Under srun, each task is already one rank: leave nproc_per_node out, and ask SLURM for "
            "more tasks (--ntasks-per-node) instead."
        )
    return "Call fn directly: this process is already one rank of a spawned job."


def _as_timedelta(timeout: timedelta | float, fn: str) -> timedelta:
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        value = timedelta(seconds=float(timeout))
    else:
        raise TypeError(
            f"{fn}(timeout=...) must be a timedelta or seconds, got {type(timeout).__name__}: {timeout!r}"
        )
    if value.total_seconds() <= 0:
        raise ValueError(
            f"{fn}(timeout=...) must be positive, got {value.total_seconds():g} seconds: it is how long a "
            "collective waits for the other ranks."
        )
    return value


def _run_in_process(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    backend: str,
    timeout: timedelta,
    launched: bool,
    torchrun: bool = False,
) -> Any:
    """Runs fn in this process: one rank of a torchrun/SLURM job, or a single process."""
    created_group = False
    environ = dict(os.environ)  # the placement variables set for the group go once it is destroyed
    result: list[Any] = []
    try:
        with _hide_slurm_from_ignite(torchrun):
            if launched and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                # idist.Parallel(backend) would create the group without a timeout; create
                # it ourselves, then let Parallel run in the existing context.
                _create_group(backend, timeout)
                created_group = True
                mark("process_group")  # UNISON_STARTUP_TRACE (unison.utils.startup), when set
            _configure_rank()
        with idist.Parallel(backend=None) as parallel:
            parallel.run(_call_into, fn, args, kwargs, result)
    except Exception as err:
        if launched:
            _note_rank(err)
            if _is_peer_failure(err):
                # Another rank failed first and its launcher reports it; a second traceback
                # from this rank, about a broken connection, would only hide the cause.
                _log.error(
                    "rank %d stops: a collective failed because another rank is gone (%s). The failing "
                    "rank's traceback is the one to read.",
                    idist.get_rank(),
                    str(err).splitlines()[0] if str(err) else type(err).__name__,
                )
                raise SystemExit(1) from None
        raise
    # Destroying the group only after success: on failure a peer may be gone, and the
    # process ends anyway.
    if created_group:
        _leave_group()  # the group's threads end here, not in the interpreter's teardown
        os.environ.clear()
        os.environ.update(environ)
    return result[0]


def _create_group(backend: str, timeout: timedelta) -> None:
    """Creates the process group of a torchrun or srun rank.

    ``idist.initialize`` would call ``torch.cuda.set_device(LOCAL_RANK)``, an invalid
    ordinal where each task sees only its own GPU (SLURM's ``--gpus-per-task=1``, or a
    per-rank ``CUDA_VISIBLE_DEVICES``): the device comes from
    :func:`~unison.distributed.env.device_for_local_rank` instead, and ignite takes the
    group as it finds it. The placement is read as ignite reads it: torchrun's variables,
    or under srun SLURM's (``SLURM_PROCID``, ``SLURM_LOCALID``, ``SLURM_NTASKS``, the first
    host of ``SLURM_JOB_NODELIST`` as the rendezvous).
    """
    if "SLURM_JOB_ID" in os.environ:  # an srun task (under torchrun SLURM's variables are hidden here)
        missing = [k for k in ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"This srun task has no {' or '.join(missing)} in its environment, needed to find the "
                "rendezvous host and the number of nodes. Start the ranks with srun inside an sbatch or "
                "salloc allocation, or with torchrun."
            )
        # ignite's own reading of SLURM's variables: the same rendezvous as idist.initialize.
        from ignite.distributed.comp_models.native import _setup_ddp_vars_from_slurm_env

        os.environ.update({k: str(v) for k, v in _setup_ddp_vars_from_slurm_env(dict(os.environ)).items()})
    device = device_for_local_rank(int(os.environ.get("LOCAL_RANK", "0")))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method="env://", timeout=timeout)
    if backend == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()
    idist.sync()  # ignite's context, from the group: rank, local rank, nodes


def _call_into(local_rank: int, fn: Callable[..., Any], args: tuple, kwargs: dict, out: list) -> None:
    out.append(fn(*args, **kwargs))
