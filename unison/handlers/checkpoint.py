"""Durable, complete checkpoints written by rank 0, and exact resume on every rank."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch.distributed as dist
from ignite.engine import Engine, Events

from unison.checkpoint.io import atomic_save, load_checkpoint
from unison.checkpoint.manifest import Entry, Manifest, entry_for
from unison.checkpoint.retention import best_entry, check_options, retain
from unison.checkpoint.state import (
    Position,
    build_checkpoint,
    capture_rng,
    check_checkpoint,
    check_layout,
    check_to_save,
    checkpoint_meta,
    data_length,
    load_object_states,
    object_states,
    refit_epoch_length,
    restore_rng,
    resumable_sampler,
    rng_of_rank,
    sampler_state,
    to_cpu_copy,
)
from unison.distributed.primitives import broadcast_object, get_rank, get_world_size, is_distributed
from unison.distributed.sync import require_sync_point
from unison.utils.logging import get_logger

_log = get_logger(__name__)


class Checkpoint:
    """Saves everything an exact resume needs, durably, from rank 0; resumes every rank.

    **When**: every ``every_epochs`` epochs (after the other ``EPOCH_COMPLETED`` handlers
    attached before it, such as an evaluation), every ``every_iters`` iterations, and at
    the end of the run. Inside an epoch, a save waits for the end of the current gradient
    accumulation window.

    **What**: each object of ``to_save`` (a model is saved unwrapped from DDP, without the
    ``module.`` prefix; anything else through its ``state_dict()``: optimizers, LR
    schedulers, a GradScaler, handlers such as EarlyStopping), the trainer's state, the
    training sampler's position, the random generator states of every rank, the config,
    the world size, the per-rank batch size and the library versions. Everything loads with
    ``torch.load(weights_only=True)``.

    **How**: rank 0 writes a temp file, fsyncs it, renames it, fsyncs the folder, and only
    then records it in ``manifest.json``. Rotation keeps the newest ``keep_last`` and the
    best ``keep_best`` by ``metric``, and deletes others only after the new file is
    recorded; the manifest is rebuilt from the folder after a crash. With
    ``async_save=True`` training is blocked only while the state is copied to CPU memory;
    a background thread writes it, at most one write is in flight, and the manifest
    records it once durable.

    **Resume**: :meth:`resume` (``"auto"``: the newest complete checkpoint, falling back
    to older ones with a warning when a file is damaged; or a path) loads the states on
    every rank. A run stopped at any iteration and resumed ends with the parameters of the
    uninterrupted run: the sampler skips the samples already trained on without loading
    them, and each rank's generators are put back.

    Args:
        dirname: the folder (shared by all ranks' view of the filesystem).
        to_save: name -> model, optimizer, scheduler, scaler, handler...
        trainer: the training engine (a unison Engine).
        every_epochs: save every this many epochs; None for never.
        every_iters: save every this many iterations; None for never.
        at_end: save when the run completes or stops.
        keep_last: how many of the newest checkpoints to keep; None keeps all.
        keep_best: how many of the best by ``metric`` to keep as well.
        metric: name of the score in ``metric_engine.state.metrics`` (synced, so every
            rank agrees) used for ``keep_best``.
        mode: ``"max"`` or ``"min"``: which scores are best.
        metric_engine: the engine whose metrics hold ``metric``; default, the trainer.
        async_save: write in a background thread.
        config: the run's resolved configuration (plain data), stored for the record.
        prefix: file name prefix.
        require_empty: refuse a folder that already holds checkpoints.

    Distributed:
        Construct, attach and resume on every rank: the folder checks are made on rank 0
        and shared, and a save gathers every rank's generator states.
    """

    def __init__(
        self,
        dirname: str | os.PathLike[str],
        to_save: Mapping[str, Any],
        trainer: Engine,
        *,
        every_epochs: int | None = 1,
        every_iters: int | None = None,
        at_end: bool = True,
        keep_last: int | None = 2,
        keep_best: int = 0,
        metric: str | None = None,
        mode: Literal["max", "min"] = "max",
        metric_engine: Engine | None = None,
        async_save: bool = False,
        config: Mapping[str, Any] | None = None,
        prefix: str = "ckpt",
        require_empty: bool = False,
    ) -> None:
        _check_options(every_epochs, every_iters, keep_last, keep_best, metric, mode)
        check_to_save(to_save)
        self._agreed = require_sync_point(trainer, "Checkpoint(trainer=...)")
        self.folder = Path(dirname)
        self.to_save = dict(to_save)
        scaler = _step_attribute(trainer, "scaler", None)
        if scaler is not None and not any(obj is scaler for obj in self.to_save.values()):
            # fp16 training made its own GradScaler: without its scale, a resume is not exact.
            self.to_save["grad_scaler"] = scaler
        self.trainer = trainer
        self.every_epochs = every_epochs
        self.every_iters = every_iters
        self.at_end = at_end
        self.keep_last = keep_last
        self.keep_best = keep_best
        self.metric = metric
        self.mode = mode
        self.metric_engine = metric_engine
        self.async_save = async_save
        self.config = dict(config) if config is not None else None
        self.manifest = Manifest(self.folder, prefix)
        self.saved: list[Path] = []
        """Files this handler wrote (on rank 0), in order."""
        self.stall_seconds: list[float] = []
        """How long each save blocked training, in seconds (rank 0)."""
        self._last_saved_iteration = -1
        self._save_due = False
        self._writer: threading.Thread | None = None
        self._writer_error: BaseException | None = None
        self._pending_resume: dict[str, Any] | None = None
        self._pending_rng: Mapping[str, Any] | None = None
        self._snapshot: Any = None
        self._refuse_a_used_folder(require_empty)

    def _refuse_a_used_folder(self, require_empty: bool) -> None:
        """Rank 0 reads the folder; every rank gets its answer, so they fail or go on together."""
        problem = None
        if get_rank() == 0:
            self.manifest.rebuild()
            if require_empty and self.manifest.entries:
                problem = (
                    f"Checkpoint(require_empty=True): {self.folder} already holds {len(self.manifest.entries)} "
                    "checkpoint(s). Choose a new folder, remove them, or resume from them."
                )
        problem = broadcast_object(problem)
        if problem:
            raise FileExistsError(problem)

    # -- attaching ------------------------------------------------------------------------

    def attach(self, engine: Engine | None = None) -> None:
        """Registers on the trainer; attaching twice has no effect."""
        trainer = engine or self.trainer
        if trainer is not self.trainer:
            raise ValueError("Checkpoint.attach: attach to the trainer given to the constructor.")
        if trainer.has_event_handler(self._on_started, Events.STARTED):
            return
        k = _step_attribute(trainer, "accumulation_steps", 1)
        trainer.add_event_handler(Events.STARTED, self._on_started)
        trainer.add_event_handler(Events.GET_BATCH_STARTED, self._restore_pending_rng)
        if self.every_epochs is not None:
            trainer.add_event_handler(Events.EPOCH_COMPLETED(every=self.every_epochs), self._save_event)
        if self.every_iters is not None:
            trainer.add_event_handler(Events.ITERATION_COMPLETED, self._iteration_trigger)
            if k > 1 and self.every_iters % k:
                _log.info(
                    "Checkpoint(every_iters=%d) with accumulation_steps=%d: each save waits for the end of its "
                    "accumulation window.",
                    self.every_iters,
                    k,
                )
        trainer.add_event_handler(Events.COMPLETED, self._on_end)
        trainer.add_event_handler(Events.TERMINATE, self._on_end)

    def _iteration_trigger(self, engine: Engine) -> None:
        if self.every_iters is not None and engine.state.iteration % self.every_iters == 0:
            self._save_due = True
        if not self._save_due or not self._agreed.at_boundary():
            return
        length = engine.state.epoch_length
        ends_epoch = length is not None and engine.state.iteration % length == 0
        if ends_epoch and self.every_epochs is not None and engine.state.epoch % self.every_epochs == 0:
            return  # the epoch's save follows, after the epoch's handlers (evaluation)
        self.save(engine)

    def _save_event(self, engine: Engine) -> None:
        self.save(engine)

    def _on_end(self, engine: Engine) -> None:
        unsaved = engine.state.iteration != self._last_saved_iteration
        if self.at_end and unsaved and self._agreed.at_boundary():
            self.save(engine)
        self.wait()

    # -- saving ---------------------------------------------------------------------------

    def _score(self) -> float | None:
        if self.metric is None:
            return None
        value = (self.metric_engine or self.trainer).state.metrics.get(self.metric)
        return None if value is None else float(value)

    def collect(self, engine: Engine) -> dict[str, Any] | None:
        """Collective: call on every rank. The full checkpoint on rank 0; None elsewhere."""
        everyone = _gather_rng()
        if everyone is None:
            return None
        at = _position(engine)
        batch_size, accumulation_steps = _layout(engine)
        meta = checkpoint_meta(
            at,
            world_size=get_world_size(),
            batch_size=batch_size,
            accumulation_steps=accumulation_steps,
            score=self._score(),
            metric=self.metric,
            saved_at=time.time(),
        )
        return build_checkpoint(
            meta=meta,
            trainer=engine.state_dict(),
            sampler=sampler_state(engine.state.dataloader, at, batch_size),
            rng=everyone,
            objects=object_states(self.to_save),
            config=self.config,
        )

    def save(self, engine: Engine | None = None) -> Path | None:
        """Collective: call on every rank. Writes a checkpoint now; returns its path on rank 0."""
        engine = engine or self.trainer
        self._save_due = False
        if engine.state.iteration == self._last_saved_iteration:
            return self.saved[-1] if self.saved else None  # this iteration is already on disk
        start = time.perf_counter()
        state = self.collect(engine)
        self._last_saved_iteration = engine.state.iteration
        if state is None:
            return None
        self.wait()  # at most one write in flight
        entry = entry_for(state["meta"], self.manifest.prefix)
        path = self.folder / entry.file
        if self.async_save:
            # The previous write has finished (wait() above): its buffers are free to reuse.
            self._snapshot = to_cpu_copy(state, reuse=self._snapshot)
            self._writer = threading.Thread(
                target=self._write, args=(self._snapshot, path, entry), name="unison-ckpt", daemon=False
            )
            self._writer.start()
        else:
            self._write(state, path, entry)
        self.stall_seconds.append(time.perf_counter() - start)
        return path

    def _write(self, state: dict[str, Any], path: Path, entry: Entry) -> None:
        try:
            atomic_save(state, path)
            entry.saved_at = time.time()
            entry.size = path.stat().st_size
            self._record(entry)
            self.saved.append(path)
            _log.info("Saved checkpoint %s", path)
        except BaseException as err:
            self._writer_error = err
            if threading.current_thread() is threading.main_thread():
                raise

    def _record(self, entry: Entry) -> None:
        """Adds a durable file to the manifest, then rotates: nothing is deleted before the manifest is."""
        self.manifest.add(entry)
        plan = retain(
            self.manifest.entries, keep_last=self.keep_last, keep_best=self.keep_best, mode=self.mode
        )
        self.manifest.remove(set(plan.delete))
        self.manifest.write()  # durable before anything is deleted
        for name in plan.delete:
            (self.folder / name).unlink(missing_ok=True)

    def wait(self) -> None:
        """Blocks until an asynchronous write has finished; re-raises its error."""
        writer, self._writer = self._writer, None
        if writer is not None:
            writer.join()
        if self._writer_error is not None:
            err, self._writer_error = self._writer_error, None
            raise RuntimeError(f"Writing a checkpoint to {self.folder} failed: {err}") from err

    @property
    def best(self) -> Entry | None:
        """The best recorded checkpoint by ``metric`` (rank 0's view)."""
        return best_entry(self.manifest.entries, self.mode)

    # -- resuming -------------------------------------------------------------------------

    def _choose(self, which: str | os.PathLike[str]) -> str | None:
        """Rank 0: the file to resume from."""
        if which != "auto":
            return str(which)
        path = self.manifest.rebuild().newest_complete()
        return None if path is None else str(path)

    def resume(self, which: str | os.PathLike[str] = "auto") -> Path | None:
        """Collective: call on every rank, before ``trainer.run``. Loads a checkpoint.

        Args:
            which: ``"auto"`` for the newest complete checkpoint in the folder (None, and
                a fresh start, when there is none), or a file path.

        Returns:
            The file resumed from, or None.

        Raises:
            CheckpointError: naming the file, when it is missing, truncated or corrupt, or
                does not fit this run.
        """
        choice = broadcast_object(self._choose(which) if get_rank() == 0 else None)
        if choice is None:
            _log.info("No checkpoint in %s: starting fresh.", self.folder)
            return None
        state = load_checkpoint(choice)
        change = check_checkpoint(state, source=choice, names=self.to_save, world_size=get_world_size())
        if change is not None:
            _log.warning("%s", change)
        meta = state["meta"]
        load_object_states(self.to_save, state["objects"])
        self.trainer.load_state_dict(state["trainer"])
        self._pending_rng = rng_of_rank(state["rng"], get_rank())
        self._pending_resume = state
        self._last_saved_iteration = meta["iteration"]
        _log.info("Resumed from %s (epoch %d, iteration %d).", choice, meta["epoch"], meta["iteration"])
        return Path(choice)

    def _on_started(self, engine: Engine) -> None:
        state, self._pending_resume = self._pending_resume, None
        if state is None:
            return
        meta = state["meta"]
        batch_size, accumulation_steps = _layout(engine)
        change = check_layout(meta, batch_size=batch_size, accumulation_steps=accumulation_steps)
        if change is not None:
            _log.warning("%s Resuming anyway at an epoch boundary.", change)
        if not meta["mid_epoch"] and not getattr(engine, "epoch_length_given", False):
            _refit_epoch_length(engine)
        if state.get("sampler") is not None:
            _load_sampler(engine, state["sampler"], mid_epoch=meta["mid_epoch"])
        if not meta["mid_epoch"]:
            # At an epoch boundary the next draw happens when the epoch's data iterator is
            # made, as in the uninterrupted run: put the generators back before that.
            self._restore_pending_rng(engine)

    def _restore_pending_rng(self, _: Engine) -> None:
        # Mid-epoch: the uninterrupted run had already made its data iterator when it
        # saved; restoring after the resumed run makes its own keeps the draws aligned.
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None

    def state_dict(self) -> dict[str, Any]:
        """The manifest as this rank knows it, for the record."""
        return {"manifest": self.manifest.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Rotation is rebuilt from the folder, which is the truth; nothing to load."""


# -- helpers -------------------------------------------------------------------------------------


def _check_options(
    every_epochs: int | None,
    every_iters: int | None,
    keep_last: int | None,
    keep_best: int,
    metric: str | None,
    mode: str,
) -> None:
    for name, value in (("every_epochs", every_epochs), ("every_iters", every_iters)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"Checkpoint({name}={value!r}) must be a positive int or None.")
    check_options(keep_last=keep_last, keep_best=keep_best, mode=mode, who="Checkpoint")
    if keep_best and metric is None:
        raise ValueError(
            f"Checkpoint(keep_best={keep_best}) needs metric=<name of a score> to rank checkpoints by."
        )


def _step_attribute(engine: Engine, name: str, default: Any) -> Any:
    """An attribute of the trainer's step (``TrainStep``), or ``default`` for another process function."""
    return getattr(getattr(engine, "_process_function", None), name, default)


def _position(engine: Engine) -> Position:
    return Position(engine.state.epoch, engine.state.iteration, engine.state.epoch_length)


def _layout(engine: Engine) -> tuple[int | None, int]:
    """The per-rank batch size of the training data and the accumulation steps."""
    return getattr(engine.state.dataloader, "batch_size", None), _step_attribute(
        engine, "accumulation_steps", 1
    )


def _gather_rng() -> list[Any] | None:
    """Collective: call on every rank. Every rank's generator states on rank 0; None elsewhere."""
    rng = capture_rng()
    if not is_distributed():
        return [rng]
    everyone: list[Any] | None = [None] * get_world_size() if get_rank() == 0 else None
    dist.gather_object(rng, everyone, dst=0)
    return everyone


def _refit_epoch_length(engine: Engine) -> None:
    """At an epoch boundary the data decides the epoch length, not the checkpoint."""
    fit = refit_epoch_length(_position(engine), data_length(engine.state.dataloader))
    if fit is None:
        return
    _log.warning(
        "The epoch length changed from %s to %d batches since the checkpoint (another world size or "
        "batch size); epochs from here on cover the whole data again.",
        engine.state.epoch_length,
        fit.epoch_length,
    )
    engine.state.epoch_length, engine.state.iteration = fit.epoch_length, fit.iteration


def _load_sampler(engine: Engine, saved: Mapping[str, Any], *, mid_epoch: bool) -> None:
    """Puts the training sampler back at its saved position, or warns that it cannot skip."""
    sampler = resumable_sampler(engine.state.dataloader)
    if sampler is not None:
        sampler.load_state_dict(saved)
    elif mid_epoch:
        _log.warning(
            "The checkpoint was taken mid-epoch but the training data's sampler cannot skip samples "
            "(use unison.distributed.TrainSampler): the epoch restarts from its first batch."
        )
