"""Training and evaluation scalars in TensorBoard event files, written by rank 0."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from ignite.engine import Engine, Events

from unison.checkpoint.tracking_step import tracking_step
from unison.distributed.primitives import get_rank, get_world_size
from unison.engine.closing import How, on_close
from unison.handlers.lr_record import LRRecord, used_rates
from unison.handlers.trainer_guard import own_trainer

if TYPE_CHECKING:
    from tensorboardX import SummaryWriter


class TensorBoardLogger:
    """Writes the trainer's and evaluators' scalars to TensorBoard event files on rank 0.

    Scalars, all with the trainer's iteration as the global step (continued across a resume at
    another world size: :func:`~unison.checkpoint.tracking_step.tracking_step`), so training and
    validation curves share an x axis:

    - ``train/loss``: the epoch's mean loss over all ranks,
      ``trainer.state.metrics["loss"]``, at every ``EPOCH_COMPLETED``.
    - ``train/lr``: the learning rate the last update of the trainer's optimizer
      (``trainer.process_function.optimizer``) used, at every ``EPOCH_COMPLETED`` and every
      ``log_every`` iterations; ``train/lr/<i>`` for each group when the optimizer has
      several parameter groups. A warmup's factor is included, and a scheduler that has
      already stepped for the next epoch does not show (:mod:`unison.handlers.lr_record`);
      before the first update, the groups' value.
    - ``train/grad_norm``: with ``create_trainer(clip_grad_norm=...)``, the gradient norm
      before clipping of the epoch's **last** update (not a mean over the epoch: reading
      the norm more often would stall the device), at ``EPOCH_COMPLETED``.
    - ``train/samples_per_second``: iterations in the epoch x per-rank batch size x world
      size, over the epoch's wall time. The last batch counts as full.
    - ``train/epoch_time_s``: the epoch's wall time, from ``EPOCH_STARTED`` to the
      logger's ``EPOCH_COMPLETED`` handler (it includes the epoch's sync point, so on a
      GPU it includes waiting for the epoch's queued work).
    - ``<name>/<metric>``: every number in ``evaluator.state.metrics`` of each
      evaluator, when that evaluator's run completes.

    Nothing is read from the device between sync points: the learning rate is a Python
    float, and the loss and the gradient norm are read at the epoch's end. The file is
    flushed at every epoch's end and after every evaluation, and closed when the trainer
    completes, terminates or fails (a later write opens a new file).

    Args:
        log_dir: the folder for the event files; created by rank 0 when it first writes.
        trainer: the training engine (from :func:`~unison.engine.create_trainer`, or any
            engine: the scalars it cannot find are left out).
        evaluators: name -> evaluation engine; the name is the tag prefix (``"val"``).
        log_every: iterations between two ``train/lr`` points inside an epoch; None for
            epoch ends only.
        batch_size: the per-rank batch size for ``train/samples_per_second``; default,
            the ``batch_size`` of the trainer's DataLoader. Without either, the scalar is
            left out.

    Example:
        >>> import tempfile, torch
        >>> from unison.engine import create_trainer
        >>> from unison.utils.event_files import read_scalars
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> trainer = create_trainer(model, opt, torch.nn.functional.mse_loss)
        >>> folder = tempfile.mkdtemp()
        >>> TensorBoardLogger(folder, trainer=trainer, batch_size=4).attach(trainer)
        >>> _ = trainer.run([(torch.ones(4, 2), torch.zeros(4, 1))] * 3, max_epochs=2)
        >>> [step for step, _ in read_scalars(folder)["train/loss"]]
        [3, 6]

    Distributed:
        Build and attach it on every rank, with the same arguments. Only rank 0 creates
        ``log_dir`` and writes to it; the other ranks never touch the folder. It issues
        no collective: the loss it logs was agreed at the trainer's sync point.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        trainer: Engine,
        evaluators: Mapping[str, Engine] | None = None,
        log_every: int | None = 50,
        batch_size: int | None = None,
    ) -> None:
        if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
            raise TypeError(f"TensorBoardLogger(log_dir={log_dir!r}) must be a folder path (str or Path).")
        if not isinstance(trainer, Engine):
            raise TypeError(
                f"TensorBoardLogger(trainer=...) needs an Engine (from unison.engine.create_trainer), "
                f"got {type(trainer).__name__}."
            )
        evaluators = dict(evaluators or {})
        for name, evaluator in evaluators.items():
            if not isinstance(name, str) or not name or name.startswith("/") or name == "train":
                raise ValueError(
                    f"TensorBoardLogger(evaluators={{{name!r}: ...}}): each name is a tag prefix, so it "
                    "must be a non-empty string, not starting with '/', and not 'train' (the trainer's "
                    "prefix); use e.g. 'val' or 'test'."
                )
            if not isinstance(evaluator, Engine):
                raise TypeError(
                    f"TensorBoardLogger(evaluators={{{name!r}: ...}}) needs an Engine (from "
                    f"unison.engine.create_evaluator), got {type(evaluator).__name__}."
                )
            if evaluator is trainer:
                raise ValueError(
                    f"TensorBoardLogger(evaluators={{{name!r}: trainer}}): the trainer is logged already."
                )
        if log_every is not None and (
            isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1
        ):
            raise ValueError(
                f"TensorBoardLogger(log_every={log_every!r}) must be a positive int (iterations between two "
                "learning-rate points) or None (epoch ends only)."
            )
        if batch_size is not None and (
            isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1
        ):
            raise ValueError(
                f"TensorBoardLogger(batch_size={batch_size!r}) must be a positive int (samples per rank per "
                "iteration) or None (read it from the trainer's DataLoader)."
            )
        self.log_dir = Path(log_dir)
        self.trainer = trainer
        self.evaluators = evaluators
        self.log_every = log_every
        self.batch_size = batch_size
        self._writer: SummaryWriter | None = None
        self._epoch_start: float | None = None
        self._epoch_start_iteration = 0
        self._resumed_at = 0  # the trainer's step when its run started (a resume: past 0)

    # -- what to log --------------------------------------------------------------------

    def _optimizer(self) -> torch.optim.Optimizer | None:
        optimizer = getattr(getattr(self.trainer, "process_function", None), "optimizer", None)
        return optimizer if isinstance(optimizer, torch.optim.Optimizer) else None

    def _learning_rates(self, device_ok: bool) -> dict[str, float]:
        """The rates the last update used; a device tensor lr is read only when ``device_ok``."""
        optimizer = self._optimizer()
        return {} if optimizer is None else used_rates(optimizer, device_ok=device_ok)

    def _per_rank_batch_size(self) -> int | None:
        if self.batch_size is not None:
            return self.batch_size
        size = getattr(self.trainer.state.dataloader, "batch_size", None)
        return size if isinstance(size, int) and size > 0 else None

    def _epoch_scalars(self) -> dict[str, float]:
        state = self.trainer.state
        scalars: dict[str, float] = {}
        loss = state.metrics.get("loss")
        if isinstance(loss, (int, float)) and not isinstance(loss, bool):
            scalars["train/loss"] = float(loss)
        scalars.update(self._learning_rates(device_ok=True))
        grad_norm = getattr(getattr(self.trainer, "process_function", None), "grad_norm", None)
        if isinstance(grad_norm, torch.Tensor):
            scalars["train/grad_norm"] = float(grad_norm)  # epoch end: the device has been synced
        if self._epoch_start is not None:
            elapsed = time.perf_counter() - self._epoch_start
            scalars["train/epoch_time_s"] = elapsed
            iterations = state.iteration - self._epoch_start_iteration
            batch = self._per_rank_batch_size()
            if batch is not None and iterations > 0 and elapsed > 0:
                scalars["train/samples_per_second"] = iterations * batch * get_world_size() / elapsed
        return scalars

    # -- event handlers -----------------------------------------------------------------

    def _epoch_started(self, engine: Engine) -> None:
        self._epoch_start = time.perf_counter()
        self._epoch_start_iteration = engine.state.iteration

    def _iteration_completed(self, engine: Engine) -> None:
        length = engine.state.epoch_length
        if length and engine.state.iteration % length == 0:
            return  # the epoch's end writes it
        self._write(self._learning_rates(device_ok=False), tracking_step(engine))

    def _epoch_completed(self, engine: Engine) -> None:
        self._write(self._epoch_scalars(), tracking_step(engine))
        self._epoch_start = None
        self.flush()

    def _evaluation_completed(self, evaluator: Engine, name: str) -> None:
        scalars = {
            f"{name}/{key}": float(value)
            for key, value in evaluator.state.metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        self._write(scalars, tracking_step(self.trainer))
        self.flush()

    def _closed(self, how: How) -> None:
        self.close()

    def _started(self, engine: Engine) -> None:
        self._resumed_at = tracking_step(engine)  # the same before and after a resume renumbers

    # -- the writer (rank 0 only) -------------------------------------------------------

    def _write(self, scalars: Mapping[str, float], step: int) -> None:
        if not scalars or get_rank() != 0:
            return
        if self._writer is None:
            from tensorboardX import SummaryWriter

            # tensorboardX names event files by the second and opens them with 'wb': a second writer in
            # the same second (a trainer run again, a resumed run) would overwrite the first's file
            # A resumed run purges what a run killed after its checkpoint wrote past it: TensorBoard
            # drops the earlier files' points at steps >= purge_step, so each step shows once.
            purge = self._resumed_at + 1 if self._resumed_at > 0 else None
            self._writer = SummaryWriter(
                str(self.log_dir), filename_suffix=f".{os.getpid()}.{time.time_ns()}", purge_step=purge
            )
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step)

    def flush(self) -> None:
        """Writes the pending scalars to disk (rank 0; a no-op elsewhere)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Flushes and closes the event file; a later scalar opens a new one. Idempotent."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.close()

    # -- wiring -------------------------------------------------------------------------

    def attach(self, engine: Engine | None = None) -> None:
        """Registers on the trainer and on every evaluator; attaching twice has no effect.

        Args:
            engine: the trainer given to the constructor (the default). Evaluators are
                given to the constructor, not attached one by one.

        Raises:
            ValueError: ``engine`` is not the logger's trainer.
        """
        trainer = own_trainer("TensorBoardLogger", self.trainer, engine, evaluators=True)
        if trainer.has_event_handler(self._epoch_completed, Events.EPOCH_COMPLETED):
            return
        trainer.add_event_handler(Events.STARTED, self._started)
        optimizer = self._optimizer()
        if optimizer is not None:
            LRRecord.of(optimizer)  # train/lr: the rate each update used
        trainer.add_event_handler(Events.EPOCH_STARTED, self._epoch_started)
        if self.log_every is not None:
            trainer.add_event_handler(
                Events.ITERATION_COMPLETED(every=self.log_every), self._iteration_completed
            )
        trainer.add_event_handler(Events.EPOCH_COMPLETED, self._epoch_completed)
        on_close(trainer, self._closed)
        for name, evaluator in self.evaluators.items():
            evaluator.add_event_handler(Events.COMPLETED, self._evaluation_completed, name)
