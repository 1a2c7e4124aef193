"""What :class:`~unison.handlers.mlflow.MLflowLogger` does with an MLflow store, on rank 0 only.

The client, the experiment, the record of a run to continue, MLflow's limits on names and
values, and :class:`StoreWriter`: the thread that writes, so training never waits on the store.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from unison.handlers.queued_writer import QueuedWriter
from unison.utils import get_logger
from unison.utils.run_files import read_bytes, replace_file
from unison.utils.secrets import redact_url

_log = get_logger("unison.handlers.mlflow")

TRUNCATED = "...[truncated]"
"""Ends a parameter or tag value cut to MLflow's length limit."""

KEEP_AT_MOST = 100_000
"""Metric points kept for a later try while the store cannot be reached; older ones are dropped."""

_NAME = re.compile(r"[^\w\-. /:]")  # what MLflow accepts in a key; anything else becomes "_"


class StoreWriter(QueuedWriter):
    """Rank 0's writes to one MLflow run, made in order by a thread of their own
    (:class:`~unison.handlers.queued_writer.QueuedWriter`).

    The training thread hands over batches of metric points (:meth:`metrics`) and the run's
    end (:meth:`finish`, which waits for everything handed over). A store that is slow or away
    never stalls training: points it refuses are kept (at most :data:`KEEP_AT_MOST`) and sent
    with the next batch, and a warning says so once until they go through.

    Args:
        client: an ``MlflowClient``; only this writer's thread uses it from now on.
        run_id: the run written to.
    """

    def __init__(self, client: Any, run_id: str) -> None:
        self.client = client
        self._unsent: list[Any] = []
        self._warned = False
        super().__init__("MLflow", run_id, "unison.handlers.mlflow")

    def metrics(self, points: list[Any]) -> None:
        """Queues ``mlflow.entities.Metric`` points for the store; returns at once."""
        self._queue_write(points)

    def finish(self, status: str, artifacts: list[tuple[Path, str | None]], timeout: float = 600.0) -> bool:
        """Queues the artefacts (``(local path, folder in the run or None)``) and the run's end
        with ``status``, then waits up to ``timeout`` seconds for all queued writes; whether
        everything was done in time (else a warning says what is left)."""
        return self._queue_end(status, artifacts, timeout)

    def _write(self, points: list[Any]) -> None:
        batch = self._unsent + points
        if not batch:
            return
        try:
            self.client.log_batch(self.run_id, metrics=batch)
        except Exception as err:  # a server away: keep the points for the next try
            self._unsent = batch[-KEEP_AT_MOST:]
            if not self._warned:
                _log.warning(
                    "MLflow: metric points not written yet, kept for the next try: %s: %s",
                    type(err).__name__,
                    redact_url(str(err)),
                )
            self._warned = True
            return
        if self._warned:
            _log.info("MLflow: the metric points kept are written")
        self._unsent, self._warned = [], False

    def _end(self, status: str, artifacts: list[tuple[Path, str | None]]) -> None:
        self._write([])
        for path, folder in artifacts:
            try:
                if path.is_dir():
                    self.client.log_artifacts(self.run_id, str(path), folder)
                elif path.is_file():
                    self.client.log_artifact(self.run_id, str(path), folder)
            except Exception as err:
                _log.warning(
                    "MLflow: %s was not logged: %s: %s", path, type(err).__name__, redact_url(str(err))
                )
        try:
            self.client.set_terminated(self.run_id, status)
        except Exception as err:
            _log.warning(
                "MLflow: run %s not marked %s: %s: %s",
                self.run_id,
                status,
                type(err).__name__,
                redact_url(str(err)),
            )


LOCK_SUFFIX = ".lock"
"""Beside a SQLite store (``mlflow.db.lock``): the lock held while a client opens the store."""


@contextlib.contextmanager
def _exclusive(lock_file: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``lock_file`` (made when missing) for the block; a no-op where
    the platform has no ``fcntl``."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: no advisory locks here
        yield
        return
    fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def make_client(tracking_uri: str) -> Any:
    """An ``MlflowClient`` of ``tracking_uri``; a SQLite store's folder is made first.

    Opening a SQLite store that does not exist yet creates its tables, and two processes doing
    so at once collide (``table ... already exists``): for a SQLite store the client is made
    (which opens the store, and creates it when new) under an exclusive lock on
    ``<store>.lock`` beside it, so the first creates it and the others find it made. Other
    stores (a server, a database) make their schema themselves.
    """
    from mlflow.tracking import MlflowClient

    if not tracking_uri.startswith("sqlite:////"):
        return MlflowClient(tracking_uri=tracking_uri)
    db = Path(tracking_uri[len("sqlite:///") :])
    db.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(db.with_name(db.name + LOCK_SUFFIX)):
        return MlflowClient(tracking_uri=tracking_uri)


def artifacts_beside(tracking_uri: str) -> str | None:
    """For a SQLite store (``sqlite:////abs/mlflow.db``), the folder beside it for a new experiment's
    artefacts (``file:///abs/mlartifacts``); None for any other store (it decides)."""
    if not tracking_uri.startswith("sqlite:////"):
        return None
    return (Path(tracking_uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri()


def open_experiment(client: Any, name: str, artifact_location: str | None = None) -> str:
    """The id of the experiment ``name``, created (with ``artifact_location``) when missing.

    Raises:
        ValueError: the experiment exists but is deleted.
    """
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return str(client.create_experiment(name, artifact_location=artifact_location))
        except MlflowException:  # made meanwhile by another run
            found = client.get_experiment_by_name(name)
            if found is None:
                raise
    if found.lifecycle_stage == "deleted":
        raise ValueError(
            f"the MLflow experiment {name!r} at {redact_url(client.tracking_uri)} is deleted; restore it (mlflow "
            "experiments restore) or give another experiment name."
        )
    return str(found.experiment_id)


def recorded_run(client: Any, run_file: Path) -> str | None:
    """The run recorded in ``run_file`` (:func:`record_run`) if it is in ``client``'s store and
    not deleted; else None. The record names the store with its credentials masked, and so is
    compared with the client's URI masked alike."""
    try:
        record = json.loads(read_bytes(run_file, limit=2**16))  # never through a link, nor a FIFO
        if redact_url(str(record.get("tracking_uri"))) != redact_url(client.tracking_uri):
            return None
        run = client.get_run(str(record["run_id"]))
    except Exception:  # no record, an unreadable one, or no such run in this store
        return None
    return None if run.info.lifecycle_stage == "deleted" else str(run.info.run_id)


def logged_steps(client: Any, run_id: str) -> dict[str, int]:
    """Each metric of run ``run_id`` and the last step the store holds for it."""
    metrics = client.get_run(run_id).data.metrics
    return {
        name: max((m.step for m in client.get_metric_history(run_id, name)), default=-1) for name in metrics
    }


def record_run(run_file: Path, run_id: str, tracking_uri: str) -> None:
    """Writes ``run_file`` (atomically): the run's id and its store, the store's URL with its
    credentials masked (:func:`~unison.utils.secrets.redact_url`)."""
    text = json.dumps({"run_id": run_id, "tracking_uri": redact_url(tracking_uri)}) + "\n"
    replace_file(run_file, text.encode(), sync=False)  # a new temporary file, never a link


def key(name: str) -> str:
    """``name`` with the characters MLflow refuses in a key replaced by ``_``, at most 250 long."""
    return _NAME.sub("_", str(name))[:250]


def limited(values: Mapping[str, str], tag: bool = False) -> dict[str, str]:
    """Keys MLflow accepts, and values cut to its limits (ending with :data:`TRUNCATED`), a URL's
    credentials in a value masked (:func:`~unison.utils.secrets.redact_url`): every parameter and
    tag a run or a sweep logs goes through here."""
    try:
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH
    except ImportError:  # pragma: no cover - the limits of MLflow 2 and 3
        MAX_PARAM_VAL_LENGTH, MAX_TAG_VAL_LENGTH = 6000, 8000
    limit = MAX_TAG_VAL_LENGTH if tag else MAX_PARAM_VAL_LENGTH
    masked = {key(k): redact_url(v) for k, v in values.items()}
    return {k: v if len(v) <= limit else v[: limit - len(TRUNCATED)] + TRUNCATED for k, v in masked.items()}
