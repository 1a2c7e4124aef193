"""How rank 0 of a trial reaches the study: the sweep process answers, the ranks agree.

The process that runs ``unison tune`` owns the study and the running trial: only it ever
opens the storage (see :mod:`unison.cli.tune`). During a trial it serves a
:class:`DecisionServer` on a local socket, with a random key for this trial only. After
each evaluation rank 0's :class:`AgreedPruning <unison.handlers.pruning.AgreedPruning>`
asks :class:`AskSweep`, which sends ``(epoch, value)``; the server calls
``trial.report(value, step=epoch)`` and ``trial.should_prune()`` once, and answers. Rank 0
then votes in the trainer's sync point, and every rank stops, or goes on, together.
"""

from __future__ import annotations

import contextlib
import math
import secrets
import socket
import threading
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from unison.cli.steps import RunParts
from unison.handlers.pruning import AgreedPruning
from unison.utils import get_logger

_log = get_logger("unison.cli.tune")


class DecisionServer:
    """Serves the pruner's decisions for one trial to its rank 0, from a thread of the sweep process.

    Args:
        trial: the running ``optuna.Trial``.
        metric: the metric's name, for messages.

    Attributes:
        reported: ``{epoch: value}`` as reported to the trial.
        pruned_at: the epoch after which the pruner said to prune, or None.
    """

    def __init__(self, trial: Any, metric: str) -> None:
        self.trial = trial
        self.metric = metric
        self.reported: dict[int, float] = {}
        self.pruned_at: int | None = None
        self.authkey = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=self.authkey)
        self.address: tuple[str, int] = self._listener.address  # AF_INET: (host, port)
        self._closing = False
        self._thread = threading.Thread(target=self._serve, name="unison-tune-decisions", daemon=True)

    def __enter__(self) -> DecisionServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def judge(self, timeout: float) -> AskSweep:
        """What rank 0 calls to reach this server (picklable: it travels to the spawned ranks)."""
        return AskSweep(self.address, self.authkey, timeout)

    def decide(self, step: int, value: float) -> tuple[str, str]:
        """Reports ``value`` at ``step`` to the trial and asks its pruner, once: ``("prune", why)``
        or ``("continue", "")``."""
        self.trial.report(value, step=step)
        self.reported[step] = value
        if not self.trial.should_prune():
            return "continue", ""
        self.pruned_at = step
        pruner = type(self.trial.study.pruner).__name__
        shown = f"{value:.6g}" if math.isfinite(value) else str(value)
        return "prune", f"{pruner} pruned trial {self.trial.number} ({self.metric} {shown} at epoch {step})"

    def _serve(self) -> None:
        while not self._closing:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, AuthenticationError):
                continue  # closed (the loop ends), a caller without the key, or close()'s wake-up call
            with conn:
                self._answer(conn)

    def _answer(self, conn: Connection) -> None:
        while not self._closing:
            try:
                if not conn.poll(0.2):
                    continue  # a question may take an epoch to come: look at _closing meanwhile
                step, value = conn.recv()
            except (EOFError, OSError):
                return  # rank 0 finished (or died): its connection closed
            try:
                reply = self.decide(int(step), float(value))
            except Exception as err:  # the storage failed: rank 0 raises it, and the trial fails
                reply = ("error", f"{type(err).__name__}: {err}")
            conn.send(reply)

    def close(self) -> None:
        """Stops serving; a rank still connected gets an error on its next question."""
        if self._closing:
            return
        self._closing = True
        if self._thread.is_alive():
            # accept() does not wake when its socket closes: a bare connection wakes it (and is
            # refused for want of the key); nothing here waits on the thread, which may be gone.
            with contextlib.suppress(OSError), socket.create_connection(self.address, timeout=5):
                pass
            self._thread.join(timeout=5)
        self._listener.close()


class AskSweep:
    """Rank 0's judge: asks the sweep process for the pruner's verdict (see :class:`DecisionServer`).

    Picklable; the connection opens at the first question and stays open for the trial.
    """

    def __init__(self, address: tuple[str, int], authkey: bytes, timeout: float) -> None:
        self.address = address
        self.authkey = authkey
        self.timeout = timeout
        self._conn: Connection | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "authkey": self.authkey, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._conn = None

    def __call__(self, value: float, step: int) -> str | None:
        if self._conn is None:
            self._conn = Client(self.address, authkey=self.authkey)
        self._conn.send((step, value))
        if not self._conn.poll(self.timeout):
            raise TimeoutError(
                f"the sweep process did not answer in {self.timeout:g} s whether to prune after epoch {step} "
                "(is its storage reachable?); parallel.timeout sets how long to wait"
            )
        verdict, detail = self._conn.recv()
        if verdict == "error":
            raise RuntimeError(f"the study could not take the value of epoch {step}: {detail}")
        return detail if verdict == "prune" else None


@dataclass(frozen=True)
class AttachPruning:
    """``attach`` of :func:`~unison.cli.run.train_from_config`: every rank attaches
    :class:`~unison.handlers.pruning.AgreedPruning` to its evaluator; rank 0's judge asks the sweep."""

    metric: str
    judge: AskSweep

    def __call__(self, parts: RunParts) -> None:
        AgreedPruning(parts.trainer, self.metric, self.judge).attach(parts.evaluator)
