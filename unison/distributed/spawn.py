"""The local spawn: ``launch(nproc_per_node=N)`` starts N ranks on this machine.

:func:`_spawn` starts the ranks through ``idist.Parallel`` and turns how they ended into a
result, a :class:`RankFailedError` or an exit code. Each rank runs :func:`_spawned_rank`,
which writes its result (or its traceback, with a timestamp) to a file in a temporary
folder; :func:`_root_cause` reads those files to name the rank whose failure started it
all, not one that failed waiting for it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, NoReturn

import ignite.distributed as idist
import torch
import torch.multiprocessing as mp

from unison.distributed.env import SPAWNED_VAR, find_free_port, slurm_batch_placement, usable_cores
from unison.distributed.fork_server import start_fork_server
from unison.distributed.rank_setup import (
    _PEER_FAILURE_MARKERS,
    _configure_rank,
    _hide_slurm_from_ignite,
    _is_peer_failure,
    _leave_group,
    _note_rank,
)
from unison.distributed.signals import (
    _PREEMPTION_SIGNALS,
    EXIT_PREEMPTED,
    _signal_exit,
    _SignalRelay,
    _start_helpers,
)
from unison.utils.exception_notes import format_exception
from unison.utils.logging import get_logger
from unison.utils.startup import mark

_log = get_logger(__name__)

_PLACEMENT_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class RankFailedError(RuntimeError):
    """A spawned rank raised or died; the message holds its rank and traceback."""

    def __init__(self, rank: int, world_size: int, detail: str) -> None:
        self.rank = rank
        self.world_size = world_size
        super().__init__(f"rank {rank} of {world_size} failed:\n{detail}")


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
    environ = dict(os.environ)  # each rank's, once its group exists: SLURM's variables included
    with (
        tempfile.TemporaryDirectory(prefix="unison-launch-") as tmp,
        _SignalRelay() as relay,
        _without_slurm_placement(nproc),
    ):
        results = Path(tmp)
        started = time.monotonic()
        unblock = start_fork_server() if start_method == "forkserver" else _start_helpers(start_method)
        tries = 1 if master_port is not None else _PORT_TRIES
        for attempt in range(1, tries + 1):
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
                if attempt < tries and relay.received is None and _port_was_taken(err, results):
                    # The port was free when chosen and taken before rank 0's store bound it;
                    # no rank ran anything yet, so the ranks start again on another port.
                    _log.info("port %d was taken before the ranks' store bound it; trying another", port)
                    port = find_free_port(master_addr)
                    continue
                failed: mp.ProcessRaisedException | mp.ProcessExitedException = err
            except mp.ProcessExitedException as err:
                failed = err
            else:
                break
            _raise_failure(failed, relay, results, nproc, started, deadline)
        relay.stop()
        if relay.received is not None:
            if any(not (results / f"rank-{rank}.pkl").exists() for rank in range(nproc)):
                raise _signal_exit(relay.received)
            _log.warning(
                "%s arrived as the ranks were finishing; they all returned, and so does launch.",
                signal.Signals(relay.received).name,
            )
        return _read_results(results, nproc)


_PORT_TRIES = 3


def _port_was_taken(err: mp.ProcessRaisedException, results: Path) -> bool:
    """Whether rank 0's store failed to bind its port before any rank reached its function:
    every rank that starts opens its fault file first (see :func:`_spawned_rank`)."""
    return "EADDRINUSE" in err.msg and not any(results.glob("fault-rank-*.txt"))


def _raise_failure(
    err: mp.ProcessRaisedException | mp.ProcessExitedException,
    relay: _SignalRelay,
    results: Path,
    nproc: int,
    started: float,
    deadline: float | None,
) -> NoReturn:
    """Raise what the ranks' end means: a signal's exit, or the root cause's error."""
    relay.stop()
    # A rank that raised exits with code 1 and a marker (see _spawned_rank); torch's
    # own report of a raise (ProcessRaisedException) remains for an error before it.
    raised = isinstance(err, mp.ProcessRaisedException)
    exit_code = getattr(err, "exit_code", 1)
    if relay.received is not None:
        if raised or (results / f"raised-rank-{err.error_index}").exists():
            _, detail = _root_cause(results, err.error_index, err.msg)
            if relay.received == signal.SIGINT or _is_peer_failure(Exception(detail)):
                raise _signal_exit(relay.received) from None
        elif exit_code != EXIT_PREEMPTED:
            raise _signal_exit(relay.received) from None
    raise _failure(
        results,
        nproc,
        err.error_index,
        exit_code,
        getattr(err, "signal_name", None),
        err.msg,
        raised,
        time.monotonic() - started,
        deadline,
    ) from None


def _failure(
    results: Path,
    nproc: int,
    index: int,
    exit_code: int,
    signal_name: str | None,
    message: str,
    raised: bool,
    elapsed: float,
    deadline: float | None,
) -> BaseException:
    """What a job whose rank ``index`` exited first with ``exit_code`` raises.

    ``raised``: the rank is known to have raised (torch reported it) even without its marker.
    ``elapsed``: seconds since the ranks started, to tell a deadline's exit from another death.
    """
    if raised or (results / f"raised-rank-{index}").exists():
        rank, detail = _root_cause(results, index, message)
        return RankFailedError(rank, nproc, detail)
    if exit_code == EXIT_PREEMPTED:
        _log.warning(
            "The job was preempted: the ranks saved a checkpoint and exited with code %d. Run it "
            "again with resume to continue.",
            EXIT_PREEMPTED,
        )
        return SystemExit(EXIT_PREEMPTED)
    if deadline is not None and elapsed >= deadline:
        detail = (
            f"it did not finish within deadline={deadline:g} s; the stacks of all its threads "
            "were printed to stderr above."
        )
    else:
        how = f"signal {signal_name}" if signal_name else f"exit code {exit_code}"
        detail = f"the process died with {how} before returning (see its stderr above)."
        detail += _own_traceback(results, index) + _fatal_stack(results, index)
    return RankFailedError(index, nproc, detail)


def _read_results(results: Path, nproc: int) -> list[Any]:
    """Every rank's result, in rank order, once all exited with 0."""
    missing = [rank for rank in range(nproc) if not (results / f"rank-{rank}.pkl").exists()]
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
    out = []
    for rank in range(nproc):
        with open(results / f"rank-{rank}.pkl", "rb") as fh:
            out.append(pickle.load(fh))
    return out


def _record_error(path: Path) -> None:
    """Writes the exception being handled, with a timestamp, to ``path`` (for _root_cause)."""
    # Written whole or not at all: the launcher may end this rank at any moment.
    partial = path.with_suffix(".part")
    err = sys.exc_info()[1]
    partial.write_text(f"{time.time()!r}\n{format_exception(err) if err else traceback.format_exc()}")
    os.replace(partial, path)


def _own_traceback(results: Path, rank: int) -> str:
    """What rank ``rank`` recorded as it left its function by an exception, if it did."""
    path = results / f"error-rank-{rank}.txt"
    if not path.exists():
        return ""
    _, _, text = path.read_text().partition("\n")
    return f"\nIt left its function with:\n{text}"


_FAULTS: Any = None
"""A spawned rank's file for faulthandler (kept open for the life of the process)."""


def _fatal_stack(results: Path, rank: int) -> str:
    """The Python stack rank ``rank`` was in when a signal killed it, with what it likely means."""
    path = results / f"fault-rank-{rank}.txt"
    stack = path.read_text(errors="replace").split("\nExtension modules:")[0].strip() if path.exists() else ""
    if not stack:
        return ""
    text = f"\nIts Python stack when the signal hit:\n{stack}"
    if "torch/distributed/" in stack:
        text += (
            "\nIt died inside a collective: the backend aborts when ranks call a collective with different "
            "sizes or types, or call different collectives (a branch on the rank around a collective, a "
            "handler attached on some ranks only; the stack above shows where this rank was). With "
            "UNISON_DEBUG=1 (or launch(..., debug=True)) the ranks also compare where they are at every "
            "sync point and name the one that went its own way."
        )
    return text


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
    returned = sorted(int(p.stem.rsplit("-", 1)[1]) for p in results.glob("rank-*.pkl"))
    if not primary and returned:
        text += (
            f"\n(this rank failed in a collective because rank(s) {returned} had already returned from the "
            "function and left: those ranks skipped a collective the others called, e.g. a collective "
            "inside a rank-conditional branch, or a loop that ran more steps on some ranks.)"
        )
    elif not primary:
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
    on_return: Callable[[], None] | None = None,
) -> None:
    """Entry point of each spawned process; the process group already exists.

    ``on_return`` is called once the function's result is written, before the rank leaves its
    group (:mod:`unison.testing.zygote` tells its caller then, so that the call does not wait for
    the leave and the exit)."""
    mark("process_group")  # UNISON_STARTUP_TRACE (unison.utils.startup): a line per phase, when set
    # A rank killed by a signal (a backend's abort, a segfault) records its Python stack,
    # which the launcher reports, instead of leaving only "died with signal SIGABRT".
    global _FAULTS
    _FAULTS = open(Path(result_dir) / f"fault-rank-{local_rank}.txt", "w")  # noqa: SIM115  # open until exit
    faulthandler.enable(file=_FAULTS, all_threads=True)
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
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # a fork server read it as it imported torch, at its start
        torch.set_num_threads(int(threads))
    elif "OMP_NUM_THREADS" not in os.environ and not torch.cuda.is_available():
        # N ranks on one CPU: give each its share of the cores instead of N x all cores.
        torch.set_num_threads(max(1, usable_cores() // nproc))
    error = Path(result_dir) / f"error-rank-{local_rank}.txt"
    try:
        try:
            _configure_rank()
            try:
                result = fn(*args, **kwargs)
            except BaseException as err:
                _note_rank(err)
                _record_error(error)
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
            del result  # it may hold a model, and the process group with it
            if on_return is not None:
                on_return()
        finally:
            # This rank is leaving. When another rank exits first with a non-zero code (every
            # rank of a preempted job exits with 75), the launcher SIGTERMs the others at once;
            # a rank killed while it tears down skips its finalizers, and the named semaphores
            # it holds (tqdm's lock, a DataLoader's queues: a spawned rank's multiprocessing
            # objects are named) are left for the resource tracker, which warns of "leaked
            # semaphore objects" at exit. It exits on its own instead; the launcher still
            # SIGKILLs it if it has not done so 30 seconds later.
            for sig in _PREEMPTION_SIGNALS:
                signal.signal(sig, signal.SIG_IGN)
        _leave_group()  # the group's threads end here, not in the interpreter's teardown
    except Exception:
        # Raised on, torch's spawn wrapper would pickle the traceback into a
        # pytorch-errorfile-*.pickle in the temp folder, which nothing deletes. It is recorded
        # here instead, and the marker tells the launcher that this rank raised.
        if not error.exists():
            _record_error(error)
        (Path(result_dir) / f"raised-rank-{local_rank}").touch()
        raise SystemExit(1) from None
    finally:
        if deadline is not None:
            faulthandler.cancel_dump_traceback_later()
