"""Start a function on every rank: spawned locally, under torchrun, or under SLURM."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import pickle
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
import torch.multiprocessing as mp

from unison.distributed.env import (
    SPAWNED_VAR,
    default_backend,
    detect_launcher,
    device_for_local_rank,
    find_free_port,
    usable_cores,
)
from unison.utils.errors import add_note, has_note
from unison.utils.logging import get_logger, setup_logging

_log = get_logger(__name__)

EXIT_PREEMPTED = 75
"""Exit code of ranks that saved a checkpoint and stopped on a preemption signal."""

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Process-group timeout: how long a collective may wait for a missing rank before failing."""


class RankFailedError(RuntimeError):
    """A spawned rank raised or died; the message holds its rank and traceback."""

    def __init__(self, rank: int, world_size: int, detail: str) -> None:
        self.rank = rank
        self.world_size = world_size
        super().__init__(f"rank {rank} of {world_size} failed:\n{detail}")


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc_per_node: int | None = None,
    backend: str | None = None,
    timeout: timedelta | float = DEFAULT_TIMEOUT,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    start_method: str = "spawn",
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
        start_method: multiprocessing start method when spawning: ``"spawn"`` (safe
            everywhere) or ``"forkserver"`` (faster repeated starts).
        deadline: when spawning, seconds after which a rank that has not finished prints the
            stacks of all its threads and exits, failing the job. Meant for tests.
        debug: turn on torch's collective consistency checks
            (``TORCH_DISTRIBUTED_DEBUG=DETAIL``: a collective called with different shapes
            or in a different order on some rank fails with a description instead of
            hanging) and unison's lockstep checks at every sync point
            (``UNISON_DEBUG=1``). Costs time; for diagnosing.
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
        SystemExit: with code 75 (``EXIT_PREEMPTED``) when the spawned ranks were preempted
            and saved a checkpoint (see :class:`unison.handlers.Preemption`).

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
    timeout = _as_timedelta(timeout, "launch")
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
    wanted = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL", "UNISON_DEBUG": "1"}
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


@contextlib.contextmanager
def _hide_slurm_from_ignite(hide: bool) -> Iterator[None]:
    """Under torchrun inside an sbatch job, torchrun's variables describe the ranks.

    ignite reads SLURM's whenever SLURM_JOB_ID is set, and with several nodes refuses
    torchrun's RANK because it differs from SLURM_PROCID (one srun task per node starts
    several torchrun workers). The group is created, and ranks placed, from torchrun's
    variables alone; SLURM's are back once that is done.
    """
    if not hide:
        yield
        return
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SLURM_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def _nested_fix(kind: str) -> str:
    if kind == "torchrun":
        return "Leave nproc_per_node out (drop --nproc from the command line) when running under torchrun."
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
    result: list[Any] = []
    try:
        with _hide_slurm_from_ignite(torchrun):
            if launched and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                # idist.Parallel(backend) would create the group without a timeout; create
                # it ourselves, then let Parallel run in the existing context.
                idist.initialize(backend, timeout=timeout)
                created_group = True
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
        idist.finalize()
    return result[0]


def _note_rank(err: BaseException) -> None:
    note = f"on rank {idist.get_rank()} of {idist.get_world_size()} (pid {os.getpid()})"
    if not has_note(err, note):
        add_note(err, note)


def _is_peer_failure(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return any(marker in text for marker in _PEER_FAILURE_MARKERS)


def _call_into(local_rank: int, fn: Callable[..., Any], args: tuple, kwargs: dict, out: list) -> None:
    out.append(fn(*args, **kwargs))


def _configure_rank() -> None:
    """Per-process set-up every rank does before user code: logging and the device."""
    # Resolving rank and world size here runs idist's one-time context sync on every rank
    # at the same moment, instead of at the first rank-conditional idist call.
    rank, world_size = idist.get_rank(), idist.get_world_size()
    setup_logging(rank=rank, world_size=world_size)
    device = device_for_local_rank(idist.get_local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _spawn(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    nproc: int,
    backend: str,
    timeout: timedelta,
    master_addr: str,
    master_port: int | None,
    start_method: str,
    deadline: float | None,
) -> list[Any]:
    port = master_port if master_port is not None else find_free_port(master_addr)
    if start_method == "forkserver":
        # The fork server imports these once; each rank then starts in a fraction of a second.
        mp.get_context("forkserver").set_forkserver_preload(
            ["torch", "torch._dynamo", "ignite.engine", "unison"]
        )
    with tempfile.TemporaryDirectory(prefix="unison-launch-") as tmp:
        results = Path(tmp)
        started = time.monotonic()
        try:
            with idist.Parallel(
                backend=backend,
                nproc_per_node=nproc,
                master_addr=master_addr,
                master_port=port,
                timeout=timeout,
                start_method=start_method,
            ) as parallel:
                parallel.run(_spawned_rank, fn, args, kwargs, str(results), nproc, deadline, dict(os.environ))
        except mp.ProcessRaisedException as err:
            rank, detail = _root_cause(results, err.error_index, err.msg)
            raise RankFailedError(rank, nproc, detail) from None
        except mp.ProcessExitedException as err:
            if err.exit_code == EXIT_PREEMPTED:
                _log.warning(
                    "The job was preempted: the ranks saved a checkpoint and exited with code %d. Run it "
                    "again with resume to continue.",
                    EXIT_PREEMPTED,
                )
                raise SystemExit(EXIT_PREEMPTED) from None
            elapsed = time.monotonic() - started
            if deadline is not None and elapsed >= deadline:
                detail = (
                    f"it did not finish within deadline={deadline:g} s; the stacks of all its threads "
                    "were printed to stderr above."
                )
            else:
                how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
                detail = f"the process died with {how} before returning (see its stderr above)."
            raise RankFailedError(err.error_index, nproc, detail) from None
        out = []
        for rank in range(nproc):
            with open(results / f"rank-{rank}.pkl", "rb") as fh:
                out.append(pickle.load(fh))
        return out


_PLACEMENT_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

# Messages of errors a rank gets because another rank died while they shared a collective:
# only a lost connection says that. A backend's own errors (a gloo size mismatch, an NCCL
# error of this rank) name "ProcessGroupGloo" or "DistBackendError" too, and are this rank's
# failure, with a traceback to print.
_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)


def _root_cause(results: Path, reported: int, message: str) -> tuple[int, str]:
    """The rank whose failure started it all, and its traceback.

    When one rank raises, the ranks waiting for it in a collective fail a moment later
    with a connection error, and either may be the first the parent hears of. Each rank
    records its failure with a timestamp; the earliest that is not such a secondary
    error is the cause.
    """
    failures = []
    for path in results.glob("error-rank-*.txt"):
        stamp, _, text = path.read_text().partition("\n")
        try:
            failures.append((float(stamp), int(path.stem.rsplit("-", 1)[1]), text))
        except ValueError:
            continue
    if not failures:
        return reported, message
    failures.sort()
    primary = [f for f in failures if not any(m in f[2] for m in _PEER_FAILURE_MARKERS)]
    _, rank, text = (primary or failures)[0]
    if not primary:
        text += (
            "\n(this rank failed in a collective because a peer went away; the peer left no traceback: it "
            "was killed, ran out of memory, or exited on its own, e.g. a Watchdog abort. Look at its stderr.)"
        )
    waiting = sorted(r for _, r, t in failures if r != rank and any(m in t for m in _PEER_FAILURE_MARKERS))
    own = sorted(r for _, r, t in failures if r != rank and r not in waiting)
    if waiting:
        text += f"\n(rank(s) {waiting} then failed in a collective, waiting for rank {rank})"
    if own:
        text += f"\n(rank(s) {own} failed too, each with an error of its own)"
    return rank, text


def _spawned_rank(
    local_rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    result_dir: str,
    nproc: int,
    deadline: float | None,
    environ: dict[str, str],
) -> None:
    """Entry point of each spawned process; the process group already exists."""
    # A rank killed by a signal (a backend's abort, a segfault) prints its Python stack
    # instead of leaving only "died with signal SIGABRT".
    faulthandler.enable(all_threads=True)
    # A fork server started earlier hands out the environment of its own start: give the
    # rank the caller's, keeping the placement variables ignite set for this rank.
    placement = {k: os.environ[k] for k in _PLACEMENT_VARS if k in os.environ}
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(placement)
    os.environ[SPAWNED_VAR] = "1"
    if deadline is not None:
        faulthandler.dump_traceback_later(deadline, exit=True)
    if "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        # N ranks on one CPU: give each its share of the cores instead of N x all cores.
        torch.set_num_threads(max(1, usable_cores() // nproc))
    try:
        _configure_rank()
        try:
            result = fn(*args, **kwargs)
        except BaseException as err:
            _note_rank(err)
            # Written whole or not at all: the launcher may end this rank at any moment.
            final = Path(result_dir) / f"error-rank-{local_rank}.txt"
            partial = final.with_suffix(".part")
            partial.write_text(f"{time.time()!r}\n{traceback.format_exc()}")
            os.replace(partial, final)
            raise
        path = Path(result_dir) / f"rank-{local_rank}.pkl"
        tmp = path.with_suffix(".tmp")
        try:
            with open(tmp, "wb") as fh:
                pickle.dump(result, fh, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise TypeError(
                f"{getattr(fn, '__qualname__', fn)!r} returned a {type(result).__name__} that cannot be "
                f"pickled back to the launching process ({err}). Return plain data or tensors."
            ) from err
        os.replace(tmp, path)
    finally:
        if deadline is not None:
            faulthandler.cancel_dump_traceback_later()
