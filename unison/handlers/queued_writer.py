"""A tracker's writes on rank 0, made in order by a thread of their own: training never waits.

:class:`QueuedWriter` is the queue and the thread both trackers' writers share
(:class:`~unison.handlers.mlflow_store.StoreWriter` for MLflow,
:class:`~unison.handlers.wandb_writer.RunWriter` for W&B): the training thread queues batches
(:meth:`QueuedWriter._queue_write`) and the run's end (:meth:`QueuedWriter._queue_end`, which
waits for everything queued); the thread calls the subclass's :meth:`~QueuedWriter._write` and
:meth:`~QueuedWriter._end` in that order. A write the tracker refuses costs one warning, and
training goes on.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from typing import Any

from unison.utils import get_logger
from unison.utils.secrets import redact_url


class QueuedWriter(ABC):
    """The thread and queue of one tracker run's writes.

    Args:
        who: the tracker, for log lines (``"MLflow"``, ``"W&B"``).
        run_id: the run written to, for log lines.
        logger: the name of the logger its warnings go to.
    """

    def __init__(self, who: str, run_id: str, logger: str) -> None:
        self.who = who
        self.run_id = run_id
        self._log = get_logger(logger)
        self._queue: queue.SimpleQueue[tuple[str, Any] | None] = queue.SimpleQueue()
        self._refused = False
        name = "unison-" + "".join(c for c in who.lower() if c.isalnum())
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    @abstractmethod
    def _write(self, payload: Any) -> None:
        """On the thread: writes one queued batch."""

    @abstractmethod
    def _end(self, status: str, detail: Any) -> None:
        """On the thread, after every batch: ends the run with ``status`` (and what the
        subclass records at the end: ``detail``)."""

    def _queue_write(self, payload: Any) -> None:
        self._queue.put(("write", payload))

    def _queue_end(self, status: str, detail: Any, timeout: float) -> bool:
        """Queues the run's end (``_end(status, detail)``), then waits up to ``timeout`` seconds for all
        queued writes; whether they were done in time (else a warning says what is left)."""
        self._queue.put(("end", (status, detail)))
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._log.warning(
                "%s: run %s: writes still pending after %g s; leaving them", self.who, self.run_id, timeout
            )
            return False
        return True

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            kind, payload = item
            try:
                if kind == "write":
                    self._write(payload)
                else:
                    self._end(*payload)
            except Exception as err:  # the tracker refused: training goes on, the warning says so once
                if not self._refused:
                    self._log.warning(
                        "%s: run %s: %s not written: %s: %s",
                        self.who, self.run_id, kind, type(err).__name__, redact_url(str(err)),
                    )  # fmt: skip
                self._refused = True
