"""Start a function on every rank: spawned locally, under torchrun, or under SLURM."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import ignite.distributed as idist
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unison.distributed.env import (
    SPAWNED_VAR,
    default_backend,
    detect_launcher,
    device_for_local_rank,
    find_free_port,
    slurm_batch_placement,
    usable_cores,
)
from unison.utils.errors import add_note, has_note
from unison.utils.logging import get_logger, setup_logging

_log = get_logger(__name__)

EXIT_PREEMPTED = 75
"""Exit code of ranks that saved a checkpoint and stopped on a preemption signal."""

EXIT_INTERRUPTED = 130
"""Exit code of a spawned job stopped by Ctrl-C (SIGINT): 128 + 2, as a shell reports it."""

DEFAULT_TIMEOUT = timedelta(minutes=10)
"""Process-group timeout: how long a collective may wait for a missing rank before failing."""

PREEMPTION_GRACE_S = 120.0
"""After SIGTERM or SIGUSR1 reaches the launcher of spawned ranks, how long it waits for them to
save and exit (see :class:`unison.handlers.Preemption`) before it kills them: SLURM's
``--signal=USR1@120`` leaves two minutes."""

INTERRUPT_GRACE_S = 5.0
"""After Ctrl-C (SIGINT) reaches the launcher of spawned ranks, how long they get to stop before
they are killed. A second Ctrl-C kills them at once."""

# Signals the launcher of spawned ranks holds for them: it forwards each to the ranks, waits for
# them, and exits with the code that says what happened.
_RELAYED = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
# Signals a scheduler sends to every process of a job (process group, cgroup): the helper
# processes multiprocessing starts (its resource tracker, the fork server) must outlive them.
_PREEMPTION_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


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
    environ = dict(os.environ)  # the placement variables set for the group go once it is destroyed
    result: list[Any] = []
    try:
        with _hide_slurm_from_ignite(torchrun):
            if launched and not (torch.distributed.is_available() and torch.distributed.is_initialized()):
                # idist.Parallel(backend) would create the group without a timeout; create
                # it ourselves, then let Parallel run in the existing context.
                _create_group(backend, timeout)
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
    environ = dict(os.environ)  # each rank's, once its group exists: SLURM's variables included
    with (
        tempfile.TemporaryDirectory(prefix="unison-launch-") as tmp,
        _SignalRelay() as relay,
        _without_slurm_placement(nproc),
    ):
        results = Path(tmp)
        started = time.monotonic()
        unblock = _start_helpers(start_method)
        try:
            with idist.Parallel(
                backend=backend,
                nproc_per_node=nproc,
                master_addr=master_addr,
                master_port=port,
                timeout=timeout,
                start_method=start_method,
            ) as parallel:
                parallel.run(
                    _spawned_rank, fn, args, kwargs, str(results), nproc, deadline, environ, unblock
                )
        except mp.ProcessRaisedException as err:
            relay.stop()
            rank, detail = _root_cause(results, err.error_index, err.msg)
            if relay.received == signal.SIGINT or (
                relay.received is not None and _is_peer_failure(Exception(detail))
            ):
                raise _signal_exit(relay.received) from None
            raise RankFailedError(rank, nproc, detail) from None
        except mp.ProcessExitedException as err:
            relay.stop()
            if err.exit_code == EXIT_PREEMPTED:
                _log.warning(
                    "The job was preempted: the ranks saved a checkpoint and exited with code %d. Run it "
                    "again with resume to continue.",
                    EXIT_PREEMPTED,
                )
                raise SystemExit(EXIT_PREEMPTED) from None
            if relay.received is not None:
                raise _signal_exit(relay.received) from None
            elapsed = time.monotonic() - started
            if deadline is not None and elapsed >= deadline:
                detail = (
                    f"it did not finish within deadline={deadline:g} s; the stacks of all its threads "
                    "were printed to stderr above."
                )
            else:
                how = f"signal {err.signal_name}" if err.signal_name else f"exit code {err.exit_code}"
                detail = f"the process died with {how} before returning (see its stderr above)."
                detail += _own_traceback(results, err.error_index)
            raise RankFailedError(err.error_index, nproc, detail) from None
        relay.stop()
        missing = [rank for rank in range(nproc) if not (results / f"rank-{rank}.pkl").exists()]
        if missing and relay.received is not None:
            raise _signal_exit(relay.received)
        if missing:
            rank = missing[0]
            raise RankFailedError(
                rank,
                nproc,
                f"rank {rank} exited with code 0 before returning a result: its function called "
                "sys.exit(0) (or exit(), or raised SystemExit(None)), or ended its process some other "
                "way. A rank's function must return (every rank, the same way) for launch to return; "
                "to stop a run early, stop the trainer (engine.terminate()) and return."
                + _own_traceback(results, rank),
            )
        if relay.received is not None:
            _log.warning(
                "%s arrived as the ranks were finishing; they all returned, and so does launch.",
                signal.Signals(relay.received).name,
            )
        out = []
        for rank in range(nproc):
            with open(results / f"rank-{rank}.pkl", "rb") as fh:
                out.append(pickle.load(fh))
        return out


def _own_traceback(results: Path, rank: int) -> str:
    """What rank ``rank`` recorded as it left its function by an exception, if it did."""
    path = results / f"error-rank-{rank}.txt"
    if not path.exists():
        return ""
    _, _, text = path.read_text().partition("\n")
    return f"\nIt left its function with:\n{text}"


def _signal_exit(signum: int) -> SystemExit:
    """The exit of a launcher whose ranks a signal stopped, without a preemption checkpoint."""
    name = signal.Signals(signum).name
    if signum == signal.SIGINT:
        _log.warning(
            "Interrupted (SIGINT): the ranks were stopped. Checkpoints are written whole or not at all; "
            "resume continues from the last complete one."
        )
        return SystemExit(EXIT_INTERRUPTED)
    _log.warning(
        "%s reached the job: the ranks stopped without a preemption checkpoint. To save one at an agreed "
        "iteration and exit with %d instead, attach unison.handlers.Preemption to the trainer.",
        name,
        EXIT_PREEMPTED,
    )
    return SystemExit(128 + signum)


class _SignalRelay:
    """Holds SIGTERM, SIGUSR1 and SIGINT in the launcher of spawned ranks while they run.

    A scheduler (SLURM, Kubernetes) or torchrun signals every process of the job, or only
    the one it started; a terminal's Ctrl-C reaches the foreground process group. Left to
    their default action these signals would end the launcher first, and the ranks would
    go on, orphaned, or lose the exit code that says they saved. Instead the launcher
    forwards the first signal to the ranks it started (a rank also signalled directly only
    sets :class:`~unison.handlers.Preemption`'s flag again) and waits for them, up to a
    bound after which it kills them. Installed only in the main thread, where Python
    delivers signals; the previous handlers are back on exit.
    """

    def __init__(self) -> None:
        self.received: int | None = None
        """The first relayed signal this process received, if any."""
        self._previous: dict[int, Any] = {}
        self._others: set[int] = set()
        self._timer: threading.Timer | None = None

    def __enter__(self) -> _SignalRelay:
        if threading.current_thread() is not threading.main_thread():
            return self
        self._others = {p.pid for p in mp.active_children() if p.pid is not None}  # not ours to signal
        for sig in _RELAYED:
            self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def stop(self) -> None:
        """The ranks are gone: no kill after the grace period."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _ranks(self) -> list[Any]:
        return [p for p in mp.active_children() if p.pid not in self._others]

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.received is not None:
            if signum == signal.SIGINT:  # a second Ctrl-C: no more waiting
                self._kill()
            return
        self.received = signum
        for process in self._ranks():
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)
        grace = INTERRUPT_GRACE_S if signum == signal.SIGINT else PREEMPTION_GRACE_S
        self._timer = threading.Timer(grace, self._kill)
        self._timer.daemon = True
        self._timer.start()

    def _kill(self) -> None:
        for process in self._ranks():
            with contextlib.suppress(ProcessLookupError):
                process.kill()


def _start_helpers(start_method: str) -> tuple[int, ...]:
    """Starts multiprocessing's helper processes with SIGTERM and SIGUSR1 blocked.

    The resource tracker and the fork server are started once per process and serve
    every later spawn; a SIGTERM or SIGUSR1 sent to the whole job would end them (the
    tracker ignores SIGTERM and SIGINT only, the fork server SIGINT only), and a dead
    fork server makes every rank it forked look as if it had exited with 255. Started
    with the signals blocked (in this thread, whose mask they inherit), they never receive
    them. Ranks forked by the fork server inherit the block: returned, for them to lift it
    (a signal that came meanwhile is then delivered, not lost). Helpers already running
    are left as they are.
    """
    from multiprocessing import forkserver, resource_tracker

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _PREEMPTION_SIGNALS)
    try:
        resource_tracker.ensure_running()
        if start_method == "forkserver":
            forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    if start_method != "forkserver":
        return ()
    return tuple(int(s) for s in _PREEMPTION_SIGNALS if s not in previous)


@contextlib.contextmanager
def _without_slurm_placement(nproc: int) -> Iterator[None]:
    """Hides SLURM's variables from the spawned ranks while their group is created.

    Inside an sbatch allocation, without srun, the batch script inherits ``SLURM_*``
    variables that describe the allocation's tasks, not the ``nproc`` ranks asked for
    here; ignite would place the ranks by them (every rank ``SLURM_PROCID``, a world of
    ``SLURM_NTASKS``) and fail. The ranks get them back once their group exists
    (``SLURM_JOB_ID`` is how :class:`~unison.handlers.Preemption` requeues the job).
    """
    placement = slurm_batch_placement()
    if placement is None:
        yield
        return
    _log.warning(
        "launch(nproc_per_node=%d) inside SLURM job %s without srun: ignoring SLURM's task placement "
        "(%s); the %d ranks are placed on this machine.",
        nproc,
        os.environ.get("SLURM_JOB_ID", "?"),
        placement,
        nproc,
    )
    with _hide_slurm_from_ignite(True):
        yield


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
    unblock: tuple[int, ...] = (),
) -> None:
    """Entry point of each spawned process; the process group already exists."""
    # A rank killed by a signal (a backend's abort, a segfault) prints its Python stack
    # instead of leaving only "died with signal SIGABRT".
    faulthandler.enable(all_threads=True)
    if unblock:  # forked by a fork server started with them blocked (see _start_helpers)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, unblock)
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
        # This rank is leaving. When another rank exits first with a non-zero code (every
        # rank of a preempted job exits with 75), the launcher SIGTERMs the others at once;
        # a rank killed while it tears down skips its finalizers, and the named semaphores
        # it holds (tqdm's lock, a DataLoader's queues: a spawned rank's multiprocessing
        # objects are named) are left for the resource tracker, which warns of "leaked
        # semaphore objects" at exit. It exits on its own instead; the launcher still
        # SIGKILLs it if it has not done so 30 seconds later.
        for sig in _PREEMPTION_SIGNALS:
            signal.signal(sig, signal.SIG_IGN)
