"""Saving at an agreed iteration when the scheduler is about to end the job."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

from ignite.engine import Engine, Events

from unison.distributed.launcher import EXIT_PREEMPTED  # 75, EX_TEMPFAIL: try again later
from unison.distributed.primitives import barrier, get_rank
from unison.engine.closing import How, on_close
from unison.handlers.checkpoint import Checkpoint
from unison.handlers.synced import SyncedHandler
from unison.utils.logging import get_logger

_log = get_logger(__name__)

__all__ = ["EXIT_PREEMPTED", "Preemption"]


class Preemption(SyncedHandler):
    """Turns SIGTERM or SIGUSR1 on any rank into a checkpoint at an agreed iteration.

    The signal handler only sets a flag: no I/O, no lock, nothing that could deadlock
    inside a signal handler. The flag rides in the trainer's next sync point; once any
    rank has been signalled, every rank saves a checkpoint at that same iteration and the
    run stops. Then, with ``exit=True``, the process exits with :data:`EXIT_PREEMPTED`
    (75); with ``requeue=True`` under SLURM, rank 0 first asks SLURM to requeue the job
    (``scontrol requeue $SLURM_JOB_ID``), and the requeued job resumes with
    ``checkpoint.resume("auto")``.

    SLURM sends SIGTERM at the end of a job's time (after its grace period) and, with
    ``#SBATCH --signal=USR1@120``, SIGUSR1 two minutes before; both are handled. However
    many ranks receive the signal, and whichever first (SLURM and Kubernetes signal every
    process of the job), the ranks save once, at one iteration. Ranks spawned by
    :func:`~unison.distributed.launch` are covered too when only their launcher is
    signalled: it forwards the signal to them, waits while they save, and exits with 75
    once they have.

    Args:
        checkpoint: the Checkpoint handler that saves.
        signals: which signals to catch.
        exit: raise ``SystemExit(EXIT_PREEMPTED)`` once saved.
        requeue: under SLURM, requeue the job before exiting.

    Distributed:
        Attach it on every rank of a unison trainer; a signal to any one rank is enough.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        signals: Sequence[signal.Signals] = (signal.SIGTERM, signal.SIGUSR1),
        exit: bool = True,
        requeue: bool = False,
    ) -> None:
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"Preemption(checkpoint=...) needs a unison Checkpoint, got {type(checkpoint).__name__}."
            )
        super().__init__()
        self.checkpoint = checkpoint
        self.signals = tuple(signals)
        self.exit = exit
        self.requeue = requeue
        self.signalled: int | None = None
        """The signal number this rank received, if any."""
        self.triggered = False
        """Whether the ranks agreed to stop for a preemption."""
        self._previous: dict[int, Any] = {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.signalled = signum  # only a flag: the sync point does the rest

    def _install(self, engine: Engine) -> None:
        self.triggered = False
        if threading.current_thread() is not threading.main_thread():
            _log.warning(
                "Preemption: the run is not in the main thread, where Python delivers signals; not installed."
            )
            return
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._on_signal)

    def _uninstall(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def local_values(self) -> tuple[float]:
        return (float(self.signalled or 0),)

    def on_agreed(self, values: list[list[float]]) -> str | None:
        (signals,) = values
        hit = {rank: int(s) for rank, s in enumerate(signals) if s}
        if not hit or self.engine is None or self.triggered:
            return None
        self.triggered = True
        names = ", ".join(f"rank {r}: {signal.Signals(s).name}" for r, s in sorted(hit.items()))
        self.checkpoint.save()
        self.checkpoint.wait()
        barrier()  # no rank exits (and gets its launcher to end the others) before the file is durable
        return f"preempted ({names}); checkpoint saved"

    def _closed(self, how: How) -> None:
        self._uninstall()  # a later signal in this process reaches its previous handler
        if how != "finished" or not self.triggered:
            return
        if self.requeue and get_rank() == 0 and "SLURM_JOB_ID" in os.environ:
            job = os.environ["SLURM_JOB_ID"]
            result = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
            if result.returncode != 0:
                _log.error("scontrol requeue %s failed: %s", job, result.stderr.strip())
            else:
                _log.warning("Requeued SLURM job %s.", job)
        if self.exit:
            raise SystemExit(EXIT_PREEMPTED)

    def attach_events(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self._install)
        on_close(engine, self._closed)
