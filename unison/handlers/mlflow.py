"""A run's parameters, metrics and artefacts in MLflow, written by rank 0 only."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events

from unison.checkpoint.tracking_step import tracking_step
from unison.distributed.primitives import get_rank
from unison.distributed.sync import require_sync_point
from unison.handlers.lr_record import LRRecord
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
from unison.handlers.run_points import (
    checked_tracker_arguments,
    loss_sync_state,
    trainer_optimizer,
    trainer_rates,
)
from unison.utils import get_logger
from unison.utils.secrets import redact_url

_log = get_logger(__name__)

__all__ = ["TRUNCATED", "MLflowLogger"]

Artifacts = Callable[[], Iterable[tuple[Path, "str | None"]]]


class MLflowLogger:
    """Records a training run in MLflow: one MLflow run, written by rank 0 only.

    At the trainer's ``STARTED`` rank 0 opens the run (in ``experiment``, created when
    missing, nested under ``parent_run_id`` when given) and logs ``params`` and ``tags``.
    Metrics, all with the trainer's iteration as the step (continued across a resume at another
    world size: :func:`~unison.checkpoint.tracking_step.tracking_step`), as :class:`TensorBoardLogger
    <unison.handlers.tensorboard.TensorBoardLogger>` names them:

    - ``train/loss``: the epoch's mean loss over all ranks (``trainer.state.metrics["loss"]``)
      and ``train/lr`` (``train/lr/<i>`` per parameter group: the rate the last update used,
      as :class:`TensorBoardLogger <unison.handlers.tensorboard.TensorBoardLogger>` logs it),
      at every ``EPOCH_COMPLETED``;
    - ``<name>/<metric>``: every number in ``evaluator.state.metrics``, when each evaluator's
      run completes;
    - with ``every``: ``train/recent_loss``, the mean over all ranks of the losses since the
      previous point, and ``train/lr``, at the first sync point of the trainer at or after
      every ``every`` iterations inside an epoch (so never closer than ``sync_every``).

    The loss points travel in the trainer's sync point (two numbers in its one all-reduce):
    nothing is read from the device between sync points, and no collective is added. The
    epoch's points are handed over in one batch after the epoch's last handler, to a thread
    of rank 0 that writes them (:class:`~unison.handlers.mlflow_store.StoreWriter`): training
    never waits on the store. At ``COMPLETED`` rank 0 logs the ``artifacts``, ends the run
    FINISHED and waits for the writes; a run stopped without ``COMPLETED`` (preemption) ends
    KILLED, a failed one FAILED. With ``run_file``, rank 0 records the run's id there, and a
    later run given the same file (a resumed one) continues that MLflow run: MLflow keeps every
    point and cannot delete one, so a metric's points at steps up to the last one the store
    holds (a run killed after its checkpoint logged past it) are not logged again, and each
    step appears once (a unison resume is exact: the points agree).

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
        evaluators = checked_tracker_arguments(
            "MLflowLogger", trainer, evaluators, every, word=lambda n: key(n) == n
        )
        self.tracking_uri = tracking_uri
        self.trainer = trainer
        self.evaluators = evaluators
        self.experiment = experiment
        self.run_name = run_name
        self.params = {str(k): str(v) for k, v in (params or {}).items()}
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.parent_run_id = parent_run_id
        self.every = every
        self.artifact_location = artifact_location or artifacts_beside(tracking_uri)
        self.artifacts = artifacts
        self.run_file = None if run_file is None else Path(run_file)
        self.run_id: str | None = None
        """The MLflow run's id, on rank 0 once it is open (None elsewhere)."""
        self._writer: StoreWriter | None = None
        self._pending: list[Any] = []
        self._window = (0.0, 0.0)  # the epoch's loss (sum, count) over all ranks at the last point
        self._next_point = every or 0
        self._logged: dict[str, int] = {}  # a continued run: each metric's last step in the store

    # -- what to log (every rank; nothing read from the device between sync points) --------

    def _learning_rates(self) -> dict[str, float]:
        return trainer_rates(self.trainer)

    def _optimizer(self) -> torch.optim.Optimizer | None:
        return trainer_optimizer(self.trainer)

    def sync_state(self) -> torch.Tensor:
        """This rank's loss sum and count of the epoch so far (the trainer's sync point calls it)."""
        return loss_sync_state(self.trainer)

    def load_synced_state(self, state: torch.Tensor) -> None:
        """Every rank: the sums over all ranks; at a point, rank 0 logs the mean since the last one."""
        engine = self.trainer
        if engine.last_event_name is Events.EPOCH_COMPLETED or engine.state.iteration < self._next_point:
            return  # the epoch's own mean is logged at its end
        total, count = state.tolist()
        assert self.every is not None  # registered only with every
        self._next_point = (engine.state.iteration // self.every + 1) * self.every
        done = count - self._window[1]
        if done > 0:
            values = {"train/recent_loss": (total - self._window[0]) / done, **self._learning_rates()}
            self._log_metrics(values, tracking_step(engine))
            self._flush()
        self._window = (total, count)

    # -- event handlers ---------------------------------------------------------------------

    def _started(self, engine: Engine) -> None:
        if get_rank() != 0:
            return
        try:
            self._open()
        except Exception as err:
            shown = redact_url(self.tracking_uri)
            if shown == self.tracking_uri:
                raise
            # The store's own error may quote its URL: raised again with the credentials masked,
            # without the original (whose message and frames' values hold them).
            raise RuntimeError(
                f"MLflow: cannot open the run at {shown}: {type(err).__name__}: {redact_url(str(err))}"
            ) from None

    def _epoch_started(self, engine: Engine) -> None:
        self._window = (0.0, 0.0)

    def _epoch_completed(self, engine: Engine) -> None:
        values = dict(self._learning_rates())
        loss = engine.state.metrics.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            values["train/loss"] = float(loss)
        self._log_metrics(values, tracking_step(engine))

    def _evaluation_completed(self, evaluator: Engine, name: str) -> None:
        values = {
            f"{name}/{key(metric)}": float(value)
            for metric, value in evaluator.state.metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        self._log_metrics(values, tracking_step(self.trainer))

    def _epoch_done(self, engine: Engine) -> None:
        self._flush()

    def _completed(self, engine: Engine) -> None:
        self._end("FINISHED", with_artifacts=True)

    def _terminated(self, engine: Engine) -> None:
        if getattr(engine, "should_terminate", None) == "skip_completed":  # no COMPLETED follows
            self._end("KILLED", with_artifacts=False)

    def _failed(self) -> None:
        self._end("FAILED", with_artifacts=False)

    # -- the store (rank 0 only) ------------------------------------------------------------

    def _open(self) -> None:
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

    def _log_metrics(self, values: Mapping[str, float], step: int) -> None:
        if not values or self._writer is None:  # rank 0 with its run open only
            return
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        self._pending.extend(
            Metric(name, value, stamp, step)
            for name, value in values.items()
            if step > self._logged.get(name, -1)  # a step the run before a resume logged is kept, not doubled
        )

    def _flush(self) -> None:
        if self._pending and self._writer is not None:
            self._writer.metrics(self._pending)  # written by the writer's thread
            self._pending = []

    def _end(self, status: str, with_artifacts: bool) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        if self._pending:
            writer.metrics(self._pending)
            self._pending = []
        artifacts: list[tuple[Path, str | None]] = []
        if with_artifacts and self.artifacts is not None:
            try:
                artifacts = list(self.artifacts())
            except Exception as err:
                _log.warning("MLflow: no artefacts: %s: %s", type(err).__name__, err)
        writer.finish(status, artifacts)

    # -- wiring -----------------------------------------------------------------------------

    def attach(self, engine: Engine | None = None) -> None:
        """Registers on the trainer and every evaluator (and, with ``every``, the trainer's sync
        point); attaching twice has no effect."""
        trainer = self.trainer
        if engine is not None and engine is not trainer:
            raise ValueError(
                "MLflowLogger.attach(engine) got an engine other than its trainer; pass evaluators as "
                "MLflowLogger(..., evaluators={'val': evaluator})."
            )
        if trainer.has_event_handler(self._started, Events.STARTED):
            return
        optimizer = self._optimizer()
        if optimizer is not None:
            LRRecord.of(optimizer)  # train/lr: the rate each update used
        trainer.add_event_handler(Events.STARTED, self._started)
        trainer.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)
        after_epoch = getattr(trainer, "after_epoch", None)
        if callable(after_epoch):
            after_epoch(self._epoch_done)  # after the epoch's evaluation: one batch per epoch
        else:
            trainer.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_done)
        trainer.add_event_handler(Events.COMPLETED, self._completed)
        trainer.add_event_handler(Events.TERMINATE, self._terminated)
        add_failure_callback = getattr(trainer, "add_failure_callback", None)
        if callable(add_failure_callback):
            add_failure_callback(self._failed)
        for name, evaluator in self.evaluators.items():
            evaluator.add_event_handler(Events.COMPLETED, self._evaluation_completed, name)
        if self.every is not None:
            require_sync_point(trainer, "MLflowLogger").sync_point.register(self, scope="every")
