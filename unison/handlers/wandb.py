"""A run's settings and metrics in Weights & Biases, written by rank 0 only."""

from __future__ import annotations

import os
import secrets
import string
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from ignite.engine import Engine

from unison.checkpoint.tracking_step import tracking_step
from unison.handlers.run_points import Points, RunPoints
from unison.handlers.wandb_files import last_written_step
from unison.handlers.wandb_writer import Checkpoint, RunWriter, read_record, write_record
from unison.utils import get_logger
from unison.utils.secrets import redact, redact_url

_log = get_logger(__name__)

__all__ = ["WandbLogger"]

Mode = Literal["online", "offline", "disabled"]
MODES = ("online", "offline", "disabled")
HAND_OVER_S = 2.0
"""Inside an epoch, ``every``'s points go to the writer thread in batches at least this many
seconds apart: each hand-over costs the training thread the writer's Python work (``wandb.log``
holds the interpreter's lock for about a millisecond a row), and W&B sends its rows in batches of
its own anyway. An epoch's end hands over all its points."""


@contextmanager
def masked_argv() -> Iterator[None]:
    """``sys.argv`` with its credentials masked (:func:`~unison.utils.secrets.redact_url`) for as
    long as the block runs: W&B records the command line in its run's metadata (the
    ``environment`` record, ``wandb-metadata.json``), read from ``sys.argv`` when the run opens,
    and a ``--set`` may carry a password."""
    given = sys.argv
    sys.argv = [redact_url(arg) for arg in given]
    try:
        yield
    finally:
        sys.argv = given


def last_possible_step(trainer: Engine) -> int | None:
    """The step the trainer reaches at its run's end (``max_iters``, or ``max_epochs`` epochs of
    a known length), continued as :func:`~unison.checkpoint.tracking_step.tracking_step`
    continues it; None when the epoch's length is not known yet (a stream's first epoch)."""
    state = trainer.state
    offset = tracking_step(trainer) - int(state.iteration)
    max_iters = getattr(state, "max_iters", None)
    if max_iters:
        return offset + int(max_iters)
    if state.max_epochs and state.epoch_length:
        return offset + int(state.max_epochs) * int(state.epoch_length)
    return None


def new_id() -> str:
    """A new W&B run id: 8 lowercase letters and digits, as W&B makes its own."""
    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))


class WandbLogger(RunPoints):
    """Records a training run in Weights & Biases: one W&B run, opened and written by rank 0 only.

    At the trainer's ``STARTED`` rank 0 opens the run (``wandb.init``) with ``config`` as the
    run's config. The metrics, all with the trainer's iteration as the step, are
    :class:`~unison.handlers.run_points.RunPoints`'s: ``train/loss`` and ``train/lr`` at every
    epoch end, ``<name>/<metric>`` for each evaluator, and with ``every`` ``train/recent_loss``
    read at the trainer's sync points (no collective added, nothing read from the device
    between sync points). An epoch's points go in one batch to a thread of rank 0 that calls
    ``wandb.log`` (:class:`~unison.handlers.wandb_writer.RunWriter`): training never waits on
    W&B. Inside an epoch, ``every``'s points are handed over at most every
    :data:`HAND_OVER_S` seconds. At ``COMPLETED`` rank 0 records ``checkpoint()`` (when given), ends the run and waits
    for the writes; a run stopped without ``COMPLETED`` (preemption) is marked preempting and
    ends with exit code 1, as a failed one does.

    With ``run_file``, rank 0 records the run's id there before opening it, and a later run given
    the same file (a resumed one) continues that W&B run (``resume="allow"``) when its project and
    entity are the same; steps up to the last one the run holds (online, the server's count;
    offline, the last one W&B wrote in its files) are not logged again, and the steps after it
    are, from the checkpoint on: rows handed to W&B but never written are not lost.

    Args:
        project: the W&B project.
        trainer: the training engine (from :func:`~unison.engine.create_trainer`).
        evaluators: name -> evaluation engine; the name prefixes its metrics (``"val"``).
        entity: the W&B team or user; None: W&B's default.
        name: the run's name; None lets W&B pick one.
        group: the run's group (a sweep's trials share one).
        tags: the run's tags.
        mode: ``"online"``, ``"offline"`` or ``"disabled"``; None: W&B's rule (``WANDB_MODE``,
            else online).
        config: the run's config, flat names -> values.
        every: iterations between loss points; None for epoch ends only. Needs a trainer with
            sync points inside its epochs (``sync_every``).
        directory: where W&B writes its files (``<directory>/wandb/``); None: W&B's default.
        run_file: a JSON file holding the run's id, for continuing it.
        checkpoint: called on rank 0 at ``COMPLETED``: the checkpoint to record (its path and
            manifest entry) or None.

    Distributed:
        Build and attach it on every rank, with the same arguments. Only rank 0 imports W&B and
        opens a run; the others never do. With ``every`` it joins the trainer's sync point on
        every rank (which is why every rank attaches it).

    Example:
        >>> from unison.handlers.wandb import WandbLogger
        >>> WandbLogger("demo", trainer=trainer, evaluators={"val": evaluator}, mode="offline").attach()  # doctest: +SKIP
    """

    def __init__(
        self,
        project: str,
        *,
        trainer: Engine,
        evaluators: Mapping[str, Engine] | None = None,
        entity: str | None = None,
        name: str | None = None,
        group: str | None = None,
        tags: Sequence[str] = (),
        mode: Mode | None = None,
        config: Mapping[str, Any] | None = None,
        every: int | None = None,
        directory: str | os.PathLike[str] | None = None,
        run_file: str | os.PathLike[str] | None = None,
        checkpoint: Callable[[], Checkpoint | None] | None = None,
    ) -> None:
        if not isinstance(project, str) or not project.strip():
            raise ValueError(f"WandbLogger(project={project!r}) must be a non-empty string.")
        if mode is not None and mode not in MODES:
            raise ValueError(
                f"WandbLogger(mode={mode!r}) must be one of {', '.join(MODES)}, or None (WANDB_MODE)."
            )
        if isinstance(tags, str) or not all(isinstance(t, str) and t for t in tags):
            raise ValueError(f"WandbLogger(tags={tags!r}) must be a list of non-empty strings.")
        super().__init__("WandbLogger", trainer, evaluators, every)
        self.hand_over_s = HAND_OVER_S
        self.project = project
        self.entity = entity
        self.name = name
        self.group = group
        self.tags = list(tags)
        self.mode = mode
        self.config = dict(config or {})
        self.directory = None if directory is None else Path(directory)
        self.run_file = None if run_file is None else Path(run_file)
        self.checkpoint = checkpoint
        self.run_id: str | None = None
        """The W&B run's id, on rank 0 once it is open (None elsewhere)."""
        self._writer: RunWriter | None = None

    def _open(self) -> None:
        import wandb

        record = {} if self.run_file is None else read_record(self.run_file)
        same = record.get("project") == self.project and record.get("entity") == self.entity
        run_id = str(record["id"]) if same else new_id()
        record = {"id": run_id, "project": self.project, "entity": self.entity}
        if self.run_file is not None:  # before the run opens: a run killed while opening is continued
            write_record(self.run_file, record)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
        with masked_argv():  # W&B records the command line, maybe a --set with a password
            run = wandb.init(
                project=self.project,
                entity=self.entity,
                name=redact(self.name),
                group=redact(self.group),
                tags=redact(self.tags) or None,
                mode=self.mode,
                dir=None if self.directory is None else str(self.directory),
                id=run_id,
                resume="allow",
                config=redact(self.config),
                # unison's own log holds the console; no Launch job (it would record sys.argv as
                # it is when the run ends)
                settings=wandb.Settings(console="off", disable_job_creation=True),
            )
        last_step = self._last_step(run)
        if same and last_step >= 0:
            _log.info(
                "W&B: continuing run %s (recorded in %s) after step %d", run_id, self.run_file, last_step
            )
        self.run_id = run.id
        self._writer = RunWriter(run, last_step)
        _log.info("W&B: run %s in project %r (%s)", run.id, self.project, self.mode or "WANDB_MODE")

    def _last_step(self, run: Any) -> int:
        """The last step the W&B run holds: online, the server's count; offline, the last step
        W&B wrote in the run's files (:func:`~unison.handlers.wandb_files.last_written_step`): a
        row handed over but never written (a job killed with W&B's service) is logged again.
        A step past the last one this run can reach is a file from elsewhere: a warning, and the
        steps after the trainer's (the checkpoint's) are all logged."""
        if not getattr(run, "offline", False):
            written, where = int(getattr(run, "starting_step", 0) or 0) - 1, "the W&B server"
        else:
            last, path = last_written_step(Path(run.settings.wandb_dir), str(run.id))
            written, where = last, str(path)
        bound = last_possible_step(self.trainer)
        if bound is not None and written > bound:
            now = tracking_step(self.trainer)
            _log.warning(
                "W&B: %s holds step %d of run %s, past the last step this run can reach (%d); it cannot "
                "be this run's: ignored, and every step after %d is logged. Remove the run folder's wandb/ "
                "and wandb-run.json to start a W&B run afresh.",
                where, written, run.id, bound, now,
            )  # fmt: skip
            written = now
        return written

    def _send(self, points: Points) -> None:
        if self._writer is not None:
            self._writer.points(points)

    def _end(self, status: str) -> None:
        writer, self._writer = self._writer, None
        if writer is None:
            return
        found = None
        if status == "FINISHED" and self.checkpoint is not None:
            try:
                found = self.checkpoint()
            except Exception as err:
                _log.warning("W&B: no checkpoint recorded: %s: %s", type(err).__name__, err)
        writer.finish(status, found)
