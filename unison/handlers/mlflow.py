"""A run's parameters, metrics and artefacts in MLflow, written by rank 0 only."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from ignite.engine import Engine

from unison.handlers.mlflow_store import (
    TRUNCATED,
    StoreWriter,
    artifacts_beside,
    key,
    limited,
    logged_steps,
    make_client,
    open_experiment,
    record_run,
    recorded_run,
)
from unison.handlers.run_points import Points, RunPoints
from unison.utils import get_logger
from unison.utils.secrets import redact_url

_log = get_logger(__name__)

__all__ = ["TRUNCATED", "MLflowLogger"]

Artifacts = Callable[[], Iterable[tuple[Path, "str | None"]]]


class MLflowLogger(RunPoints):
    """Records a training run in MLflow: one MLflow run, written by rank 0 only.

    At the trainer's ``STARTED`` rank 0 opens the run (in ``experiment``, created when
    missing, nested under ``parent_run_id`` when given) and logs ``params`` and ``tags``. The
    metrics, all with the trainer's iteration as the step, are
    :class:`~unison.handlers.run_points.RunPoints`'s, named as :class:`TensorBoardLogger
    <unison.handlers.tensorboard.TensorBoardLogger>` names them: ``train/loss`` and ``train/lr``
    at every epoch end, ``<name>/<metric>`` for each evaluator (a character MLflow refuses in a
    key becomes ``_``), and with ``every`` ``train/recent_loss`` read at the trainer's sync
    points (no collective added, nothing read from the device between sync points). The points
    go to a thread of rank 0 that writes them (:class:`~unison.handlers.mlflow_store.StoreWriter`):
    training never waits on the store. When the trainer's run finishes rank 0 logs the
    ``artifacts``, ends the run FINISHED and waits for the writes; a run stopped without
    ``COMPLETED`` ends KILLED, a failed one FAILED. With ``run_file``, rank 0 records the run's id
    there, and a later run given the same file (a resumed one) continues that MLflow run: MLflow
    keeps every point and cannot delete one, so a metric's points at steps up to the last one
    the store holds (a run killed after its checkpoint logged past it) are not logged again, and
    each step appears once (a unison resume is exact: the points agree).

    Opening the run, at ``STARTED``, fails loudly (a wrong URI, a deleted experiment); once
    it is open, a store that cannot be reached costs a warning, and the points are sent with
    the next batch. The URI is used as given, and shown only with its credentials masked
    (:func:`~unison.utils.secrets.redact_url`): in log lines, errors, ``run_file``, and the
    parameters and tags.

    Args:
        tracking_uri: where the store is (``sqlite:////abs/mlflow.db``, ``https://...``).
        trainer: the training engine (from :func:`~unison.engine.create_trainer`).
        evaluators: name -> evaluation engine; the name prefixes its metrics (``"val"``).
        experiment: the MLflow experiment's name.
        run_name: the MLflow run's name; None lets MLflow pick one.
        params: parameter name -> value (strings; longer than MLflow takes are cut, ending
            with ``...[truncated]``).
        tags: tag name -> value.
        parent_run_id: an MLflow run to nest this one under (the ``mlflow.parentRunId`` tag).
        every: iterations between loss points; None for epoch ends only. Needs a trainer
            with sync points inside its epochs (``sync_every``).
        artifact_location: where a new experiment keeps its artefacts; None: beside a SQLite
            store (``mlartifacts/`` next to the file), else the store's default.
        artifacts: called on rank 0 at ``COMPLETED``: ``(local path, folder in the run's
            artefacts or None)`` pairs, files or folders.
        run_file: a JSON file holding the run's id, for continuing it.

    Distributed:
        Build and attach it on every rank, with the same arguments. Only rank 0 imports
        MLflow and talks to the store; the others never open it. With ``every`` it joins the
        trainer's sync point on every rank (which is why every rank attaches it).
    """

    def __init__(
        self,
        tracking_uri: str,
        *,
        trainer: Engine,
        experiment: str,
        evaluators: Mapping[str, Engine] | None = None,
        run_name: str | None = None,
        params: Mapping[str, str] | None = None,
        tags: Mapping[str, str] | None = None,
        parent_run_id: str | None = None,
        every: int | None = None,
        artifact_location: str | None = None,
        artifacts: Artifacts | None = None,
        run_file: str | os.PathLike[str] | None = None,
    ) -> None:
        for name, value in (("tracking_uri", tracking_uri), ("experiment", experiment)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"MLflowLogger({name}={value!r}) must be a non-empty string.")
        super().__init__("MLflowLogger", trainer, evaluators, every, word=lambda n: key(n) == n)
        self.tracking_uri = tracking_uri
        self.experiment = experiment
        self.run_name = run_name
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.parent_run_id = parent_run_id
        self.artifact_location = artifact_location or artifacts_beside(tracking_uri)
        self.artifacts = artifacts
        self.run_file = None if run_file is None else Path(run_file)
        self.run_id: str | None = None
        """The MLflow run's id, on rank 0 once it is open (None elsewhere)."""
        self._writer: StoreWriter | None = None
        self._logged: dict[str, int] = {}  # a continued run: each metric's last step in the store

    # -- the store (rank 0 only) ------------------------------------------------------------

    def _open(self) -> None:
        try:
            self._open_run()
        except Exception as err:
            shown = redact_url(self.tracking_uri)
            if shown == self.tracking_uri:
                raise
            # The store's own error may quote its URL: raised again with the credentials masked,
            # without the original (whose message and frames' values hold them).
            raise RuntimeError(
                f"MLflow: cannot open the run at {shown}: {type(err).__name__}: {redact_url(str(err))}"
            ) from None

    def _open_run(self) -> None:
        client = make_client(self.tracking_uri)
        run_id = None if self.run_file is None else recorded_run(client, self.run_file)
        tags = dict(self.tags)
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        params = limited(self.params)
        if run_id is None:
            experiment_id = open_experiment(client, self.experiment, self.artifact_location)
            run = client.create_run(experiment_id, run_name=self.run_name, tags=limited(tags, True))
            run_id = run.info.run_id
            if self.run_file is not None:
                record_run(self.run_file, run_id, self.tracking_uri)
        else:
            client.update_run(run_id, status="RUNNING")
            before = client.get_run(run_id).data.params
            # MLflow never changes a logged parameter: a value changed on resume becomes a tag.
            tags.update({f"changed_on_resume.{k}": v for k, v in params.items() if before.get(k, v) != v})
            params = {k: v for k, v in params.items() if k not in before}
            self._logged = logged_steps(client, run_id)
            _log.info("MLflow: continuing run %s (recorded in %s)", run_id, self.run_file)
        self.run_id = run_id
        from mlflow.entities import Param, RunTag

        client.log_batch(
            run_id,
            params=[Param(k, v) for k, v in params.items()],
            tags=[RunTag(k, v) for k, v in limited(tags, True).items()],
        )
        self._writer = StoreWriter(client, run_id)
        _log.info(
            "MLflow: run %s in experiment %r at %s", run_id, self.experiment, redact_url(self.tracking_uri)
        )

    def _send(self, points: Points) -> None:
        if self._writer is None:
            return
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        metrics = [
            Metric(key(name), value, stamp, step)
            for step, values in sorted(points.items())
            for name, value in values.items()
            if step
            > self._logged.get(key(name), -1)  # a step the run before a resume logged is kept, not doubled
        ]
        if metrics:
            self._writer.metrics(metrics)  # written by the writer's thread

    def _end(self, status: str) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        artifacts: list[tuple[Path, str | None]] = []
        if status == "FINISHED" and self.artifacts is not None:
            try:
                artifacts = list(self.artifacts())
            except Exception as err:
                _log.warning("MLflow: no artefacts: %s: %s", type(err).__name__, err)
        writer.finish(status, artifacts)
