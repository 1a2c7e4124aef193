"""The signals the launcher of spawned ranks relays, and the exit codes that say what happened.

SIGTERM, SIGUSR1 and SIGINT reaching the launcher are forwarded to its ranks, which get a
grace period to stop (:class:`_SignalRelay`); multiprocessing's helper processes are
started with the preemption signals blocked so that a signal to the whole job does not
end them (:func:`_start_helpers`); a job a signal stopped exits with a code that says
which (:func:`_signal_exit`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import Any

import torch.multiprocessing as mp

from unison.utils.logging import get_logger

_log = get_logger(__name__)

EXIT_PREEMPTED = 75
"""Exit code of ranks that saved a checkpoint and stopped on a preemption signal."""

EXIT_INTERRUPTED = 130
"""Exit code of a spawned job stopped by Ctrl-C (SIGINT): 128 + 2, as a shell reports it."""

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
    them. Ranks forked by the fork server inherit the block. A server started by
    :func:`~unison.distributed.fork_server.start_fork_server` lifts it in each process it forks,
    at the fork (:mod:`unison.distributed.fork_server_ranks`), so that a rank still forming its
    group dies of the launcher's SIGTERM at once; for a server started otherwise the signals are
    returned, for the ranks to lift the block as they start (a signal that came meanwhile is
    then delivered, not lost). All of them, even those the calling thread had blocked
    already: a rank takes the launcher's SIGTERM and SIGUSR1 whatever its caller's mask (a
    rank forked from a server that a blocking caller started kept SIGUSR1 blocked, and a
    relayed preemption never reached it). Helpers already running are left as they are.
    """
    from multiprocessing import forkserver, resource_tracker

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, _PREEMPTION_SIGNALS)
    try:
        resource_tracker.ensure_running()
        # Starting the tracker unblocks SIGINT and SIGTERM in this thread as it ends (multiprocessing
        # blocks them around the start, then lifts them whatever the mask was): block them again,
        # or a fork server started next would run with SIGTERM deliverable.
        signal.pthread_sigmask(signal.SIG_BLOCK, _PREEMPTION_SIGNALS)
        if start_method == "forkserver":
            forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    if start_method != "forkserver":
        return ()
    return tuple(int(s) for s in _PREEMPTION_SIGNALS)
