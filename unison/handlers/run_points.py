"""What a run tracker logs and when, apart from where it goes: the points of a training run.

:class:`RunPoints` is the part a tracker (:class:`~unison.handlers.wandb.WandbLogger`) shares
with the others: on every rank it follows the trainer, the evaluators and (with ``every``) the
trainer's sync point, and gathers ``{step: {name: value}}`` points without reading anything
from the device between sync points. A subclass says where the points go: it opens its run at
``STARTED`` (:meth:`RunPoints._open`, rank 0 only), sends each epoch's points as one batch
(:meth:`RunPoints._send`) and ends the run (:meth:`RunPoints._end`).
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping

import torch
from ignite.engine import Engine, Events

from unison.checkpoint.tracking_step import tracking_step
from unison.distributed.primitives import get_rank
from unison.distributed.sync import require_sync_point
from unison.engine.closing import How, on_close
from unison.handlers.lr_record import LRRecord, used_rates
from unison.handlers.trainer_guard import own_trainer

STATUS: dict[str, str] = {"finished": "FINISHED", "terminated": "KILLED", "failed": "FAILED"}
"""How the trainer's run ended -> the status a tracker's run ends with."""

Points = dict[int, dict[str, float]]
"""Trainer step (:func:`~unison.checkpoint.tracking_step.tracking_step`) -> metric name -> value."""


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def trainer_optimizer(trainer: Engine) -> torch.optim.Optimizer | None:
    """The optimizer of a trainer built by ``create_trainer``; None for another engine."""
    optimizer = getattr(getattr(trainer, "process_function", None), "optimizer", None)
    return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None


def trainer_rates(trainer: Engine) -> dict[str, float]:
    """The learning rates the trainer's last update used (``train/lr``, or one per group)."""
    optimizer = trainer_optimizer(trainer)
    return {} if optimizer is None else used_rates(optimizer)


def loss_sync_state(trainer: Engine) -> torch.Tensor:
    """This rank's loss sum and count of the epoch so far, as a tracker adds them to the
    trainer's sync point (zeros for a trainer without a loss average)."""
    average = getattr(getattr(trainer, "process_function", None), "loss_average", None)
    if average is None:
        return torch.zeros(2, dtype=torch.float64)
    return average.sync_state().to(torch.float64).reshape(2)


def checked_tracker_arguments(
    who: str,
    trainer: Engine,
    evaluators: Mapping[str, Engine] | None,
    every: int | None,
    word: Callable[[str], bool] = str.isidentifier,
) -> dict[str, Engine]:
    """The evaluators of a tracker (``who``: its class, for errors), after checking what every
    tracker takes alike: an Engine as the trainer, evaluators named by a ``word`` other than
    ``train`` (their metrics' prefix), and ``every`` a positive int over a trainer with sync
    points inside an epoch.

    Raises:
        TypeError, ValueError: naming the argument, the value and the fix.
    """
    if not isinstance(trainer, Engine):
        raise TypeError(
            f"{who}(trainer=...) needs an Engine (from unison.engine.create_trainer), got {type(trainer).__name__}."
        )
    evaluators = dict(evaluators or {})
    for name, evaluator in evaluators.items():
        if not isinstance(name, str) or not name or name == "train" or not word(name):
            raise ValueError(
                f"{who}(evaluators={{{name!r}: ...}}): each name prefixes its metrics, so it must be a "
                "non-empty word other than 'train' (the trainer's prefix); use e.g. 'val' or 'test'."
            )
        if not isinstance(evaluator, Engine) or evaluator is trainer:
            raise TypeError(
                f"{who}(evaluators={{{name!r}: ...}}) needs an evaluation Engine other than the trainer, got "
                f"{type(evaluator).__name__}."
            )
    if every is not None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"{who}(every={every!r}) must be a positive int (iterations between loss points) or None "
                "(epoch ends only)."
            )
        require_sync_point(trainer, f"{who}(every={every})")
        if getattr(trainer, "sync_every", None) is None:
            raise ValueError(
                f"{who}(every={every}) reads the loss at the trainer's sync points, and this trainer has none "
                "inside an epoch (sync_every=None). Give the trainer sync_every, or every=None."
            )
    return evaluators


class RunPoints(ABC):
    """The points of a training run, gathered on every rank and sent by rank 0.

    - ``train/loss``, the epoch's mean loss over all ranks (``trainer.state.metrics["loss"]``),
      and ``train/lr`` (``train/lr/<i>`` per parameter group: the rate the last update used), at
      every ``EPOCH_COMPLETED``;
    - ``<name>/<metric>``: every number in an evaluator's ``state.metrics`` when it completes;
    - with ``every``: ``train/recent_loss``, the mean over all ranks of the losses since the
      previous point, and ``train/lr``, at the trainer's first sync point at or after every
      ``every`` iterations inside an epoch. The loss travels in that sync point (two numbers in
      its one all-reduce): no collective is added and nothing is read from the device between
      sync points.

    Every point's step is the trainer's iteration, continued across a resume at another world size
    (:func:`~unison.checkpoint.tracking_step.tracking_step`). An epoch's points are handed to
    :meth:`_send` in one batch after the epoch's last handler (its evaluation included).

    Args:
        who: the subclass's name, for errors.
        trainer: the training engine.
        evaluators: name -> evaluation engine; the name prefixes its metrics.
        every: iterations between loss points; None for epoch ends only.
        word: whether an evaluator's name is one the tracker takes as its metrics' prefix.
    """

    def __init__(
        self,
        who: str,
        trainer: Engine,
        evaluators: Mapping[str, Engine] | None,
        every: int | None,
        word: Callable[[str], bool] = str.isidentifier,
    ) -> None:
        evaluators = checked_tracker_arguments(who, trainer, evaluators, every, word)
        self.who = who
        self.trainer = trainer
        self.evaluators = evaluators
        self.every = every
        self._open_here = False  # rank 0 with its run open
        self._pending: Points = {}
        self._window = (0.0, 0.0)  # the epoch's loss (sum, count) over all ranks at the last point
        self._next_point = every or 0
        self.hand_over_s = 0.0
        """Inside an epoch, the points of ``every`` wait until this many seconds have passed since
        the last batch was handed over (0: each point at once); an epoch's end hands all over."""
        self._handed = time.monotonic()

    # -- where the points go (subclasses; rank 0 only) -------------------------------------

    @abstractmethod
    def _open(self) -> None:
        """Opens the run; raises when it cannot."""

    @abstractmethod
    def _send(self, points: Points) -> None:
        """Hands a batch of points over; must return at once."""

    @abstractmethod
    def _end(self, status: str) -> None:
        """Ends the run: ``FINISHED``, ``KILLED`` (stopped without ``COMPLETED``) or ``FAILED``."""

    # -- what to log (every rank; nothing read from the device between sync points) --------

    def _learning_rates(self) -> dict[str, float]:
        return trainer_rates(self.trainer)

    def _optimizer(self) -> torch.optim.Optimizer | None:
        return trainer_optimizer(self.trainer)

    def sync_state(self) -> torch.Tensor:
        """This rank's loss sum and count of the epoch so far (the trainer's sync point calls it)."""
        return loss_sync_state(self.trainer)

    def load_synced_state(self, state: torch.Tensor) -> None:
        """Every rank: the sums over all ranks; at a point, the mean since the last one."""
        engine = self.trainer
        if engine.last_event_name is Events.EPOCH_COMPLETED or engine.state.iteration < self._next_point:
            return  # the epoch's own mean is logged at its end
        total, count = state.tolist()
        assert self.every is not None  # registered only with every
        self._next_point = (engine.state.iteration // self.every + 1) * self.every
        done = count - self._window[1]
        if done > 0:
            self._point({"train/recent_loss": (total - self._window[0]) / done, **self._learning_rates()})
            if time.monotonic() - self._handed >= self.hand_over_s:
                self._flush()
        self._window = (total, count)

    def _point(self, values: Mapping[str, float]) -> None:
        if values and self._open_here:
            self._pending.setdefault(tracking_step(self.trainer), {}).update(values)

    def _flush(self) -> None:
        if self._pending and self._open_here:
            self._send(self._pending)
            self._handed = time.monotonic()
        self._pending = {}

    # -- event handlers ---------------------------------------------------------------------

    def _started(self, engine: Engine) -> None:
        if get_rank() == 0 and not self._open_here:
            self._open()
            self._open_here = True

    def _epoch_started(self, engine: Engine) -> None:
        self._window = (0.0, 0.0)

    def _epoch_completed(self, engine: Engine) -> None:
        values = dict(self._learning_rates())
        loss = engine.state.metrics.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            values["train/loss"] = float(loss)
        self._point(values)

    def _evaluation_completed(self, evaluator: Engine, name: str) -> None:
        self._point(
            {
                f"{name}/{metric}": float(value)
                for metric, value in evaluator.state.metrics.items()
                if _number(value)
            }
        )

    def _epoch_done(self, engine: Engine) -> None:
        self._flush()

    def _closed(self, how: How) -> None:
        if self._open_here:
            self._flush()
            self._open_here = False
            self._end(STATUS[how])

    # -- wiring -----------------------------------------------------------------------------

    def attach(self, engine: Engine | None = None) -> None:
        """Registers on the trainer and every evaluator (and, with ``every``, the trainer's sync
        point); attaching twice has no effect."""
        trainer = own_trainer(self.who, self.trainer, engine, evaluators=True)
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
        on_close(trainer, self._closed)
        for name, evaluator in self.evaluators.items():
            evaluator.add_event_handler(Events.COMPLETED, self._evaluation_completed, name)
        if self.every is not None:
            require_sync_point(trainer, self.who).sync_point.register(self, scope="every")
