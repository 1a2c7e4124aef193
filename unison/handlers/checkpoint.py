"""Durable, complete checkpoints written by rank 0, and exact resume on every rank."""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from ignite.engine import Engine, Events
from torch import nn

import unison
from unison.checkpoint.io import CheckpointError, atomic_save, is_complete, load_checkpoint
from unison.checkpoint.manifest import Entry, Manifest, checkpoint_name
from unison.checkpoint.state import capture_rng, load_model_state, model_state, restore_rng, to_cpu_copy
from unison.distributed.primitives import broadcast_object, get_rank, get_world_size, is_distributed
from unison.handlers.sampler_epoch import samplers_with_set_epoch
from unison.utils.logging import get_logger

_log = get_logger(__name__)
FORMAT = 1


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
        for name, value in (
            ("every_epochs", every_epochs),
            ("every_iters", every_iters),
            ("keep_last", keep_last),
        ):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Checkpoint({name}={value!r}) must be a positive int or None.")
        if isinstance(keep_best, bool) or not isinstance(keep_best, int) or keep_best < 0:
            raise ValueError(f"Checkpoint(keep_best={keep_best!r}) must be an int >= 0.")
        if keep_best and metric is None:
            raise ValueError(
                f"Checkpoint(keep_best={keep_best}) needs metric=<name of a score> to rank checkpoints by."
            )
        if mode not in ("max", "min"):
            raise ValueError(f"Checkpoint(mode={mode!r}) must be 'max' or 'min'.")
        if not isinstance(to_save, Mapping) or not to_save:
            raise ValueError("Checkpoint(to_save=...) needs a non-empty mapping of name -> object to save.")
        for name, obj in to_save.items():
            if name in _RESERVED:
                raise ValueError(
                    f"Checkpoint(to_save={{{name!r}: ...}}): {name!r} is reserved; use another name."
                )
            if not isinstance(obj, nn.Module) and not callable(getattr(obj, "state_dict", None)):
                raise TypeError(
                    f"Checkpoint(to_save={{{name!r}: ...}}): a {type(obj).__name__} has no state_dict(); pass "
                    "models, optimizers, schedulers, scalers or handlers with state_dict()/load_state_dict()."
                )
        if getattr(trainer, "sync_point", None) is None:
            raise TypeError(f"Checkpoint(trainer=...) needs a unison Engine, got {type(trainer).__name__}.")
        self.folder = Path(dirname)
        self.to_save = dict(to_save)
        scaler = getattr(getattr(trainer, "_process_function", None), "scaler", None)
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
        self._pending_rng: dict[str, Any] | None = None
        self._snapshot: Any = None

        # Rank 0 reads the folder; every rank gets its answer, so they fail or go on together.
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
        step = getattr(trainer, "_process_function", None)
        k = getattr(step, "accumulation_steps", 1)
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
        if engine.state.iteration % self.every_iters == 0:  # type: ignore[operator]
            self._save_due = True
        if not self._save_due or not engine.at_boundary():  # type: ignore[attr-defined]
            return
        length = engine.state.epoch_length
        ends_epoch = length is not None and engine.state.iteration % length == 0
        if ends_epoch and self.every_epochs is not None and engine.state.epoch % self.every_epochs == 0:
            return  # the epoch's save follows, after the epoch's handlers (evaluation)
        self.save(engine)

    def _save_event(self, engine: Engine) -> None:
        self.save(engine)

    def _on_end(self, engine: Engine) -> None:
        if self.at_end and engine.state.iteration != self._last_saved_iteration and engine.at_boundary():  # type: ignore[attr-defined]
            self.save(engine)
        self.wait()

    # -- saving ---------------------------------------------------------------------------

    def _score(self) -> float | None:
        if self.metric is None:
            return None
        engine = self.metric_engine or self.trainer
        value = engine.state.metrics.get(self.metric)
        return None if value is None else float(value)

    def _sampler_state(self, engine: Engine) -> dict[str, Any] | None:
        samplers = [
            s
            for s in samplers_with_set_epoch(engine.state.dataloader)
            if callable(getattr(s, "load_state_dict", None))
        ]
        if not samplers:
            return None
        length = engine.state.epoch_length or 0
        done = engine.state.iteration % length if length else 0
        batch_size = getattr(engine.state.dataloader, "batch_size", None) or 1
        epoch = engine.state.iteration // length if length else engine.state.epoch
        state = samplers[0].state_dict(consumed=done * batch_size)
        state["epoch"] = epoch
        return state

    def collect(self, engine: Engine) -> dict[str, Any] | None:
        """Collective: call on every rank. The full checkpoint on rank 0; None elsewhere."""
        rng = capture_rng()
        if is_distributed():
            everyone: list[Any] | None = [None] * get_world_size() if get_rank() == 0 else None
            dist.gather_object(rng, everyone, dst=0)
        else:
            everyone = [rng]
        if get_rank() != 0:
            return None
        length = engine.state.epoch_length
        step = getattr(engine, "_process_function", None)
        import ignite

        objects = {
            name: model_state(obj) if isinstance(obj, nn.Module) else obj.state_dict()
            for name, obj in self.to_save.items()
        }
        return {
            "meta": {
                "format": FORMAT,
                "epoch": engine.state.epoch,
                "iteration": engine.state.iteration,
                "mid_epoch": bool(length and engine.state.iteration % length),
                "world_size": get_world_size(),
                "batch_size": getattr(engine.state.dataloader, "batch_size", None),
                "accumulation_steps": getattr(step, "accumulation_steps", 1),
                "score": self._score(),
                "metric": self.metric,
                "saved_at": time.time(),
                "versions": {
                    "unison": unison.__version__,
                    "torch": str(torch.__version__),
                    "ignite": str(ignite.__version__),
                },
            },
            "trainer": dict(engine.state_dict()),
            "sampler": self._sampler_state(engine),
            "rng": everyone,
            "objects": objects,
            "config": self.config,
        }

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
        meta = state["meta"]
        path = self.folder / checkpoint_name(self.manifest.prefix, meta["epoch"], meta["iteration"])
        score = meta["score"]
        if score is not None and not math.isfinite(score):
            score = None  # never the best; and manifest.json stays strict JSON
        entry = Entry(file=path.name, epoch=meta["epoch"], iteration=meta["iteration"], score=score)
        if self.async_save:
            # The previous write has finished (wait() above): its buffers are free to reuse.
            snapshot = to_cpu_copy(state, reuse=self._snapshot)
            self._snapshot = snapshot
            self._writer = threading.Thread(
                target=self._write, args=(snapshot, path, entry), name="unison-ckpt", daemon=False
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
            self.manifest.add(entry)
            doomed = self._rotate()
            self.manifest.remove(doomed)
            self.manifest.write()  # durable before anything is deleted
            for name in doomed:
                (self.folder / name).unlink(missing_ok=True)
            self.saved.append(path)
            _log.info("Saved checkpoint %s", path)
        except BaseException as err:
            self._writer_error = err
            if threading.current_thread() is threading.main_thread():
                raise

    def _rotate(self) -> set[str]:
        entries = self.manifest.entries
        keep: set[str] = set()
        if self.keep_last is None:
            keep.update(e.file for e in entries)
        else:
            keep.update(e.file for e in entries[-self.keep_last :])
        if self.keep_best:
            scored = [e for e in entries if e.score is not None and not math.isnan(e.score)]
            scored.sort(key=lambda e: e.score, reverse=self.mode == "max")  # type: ignore[arg-type, return-value]
            keep.update(e.file for e in scored[: self.keep_best])
        return {e.file for e in entries if e.file not in keep}

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
        scored = [e for e in self.manifest.entries if e.score is not None and not math.isnan(e.score)]
        if not scored:
            return None
        return (max if self.mode == "max" else min)(scored, key=lambda e: e.score)  # type: ignore[arg-type, return-value]

    # -- resuming -------------------------------------------------------------------------

    def _choose(self, which: str | os.PathLike[str]) -> str | None:
        """Rank 0: the file to resume from."""
        if which != "auto":
            return str(which)
        self.manifest.rebuild()
        for entry in self.manifest.newest():
            path = self.folder / entry.file
            if is_complete(path):
                return str(path)
            _log.warning(
                "Checkpoint %s is damaged (truncated or corrupt); falling back to an older one.", path
            )
        return None

    def resume(self, which: str | os.PathLike[str] = "auto") -> Path | None:
        """Collective: call on every rank, before ``trainer.run``. Loads a checkpoint.

        Args:
            which: ``"auto"`` for the newest complete checkpoint in the folder (None, and
                a fresh start, when there is none), or a file path.

        Returns:
            The file resumed from, or None.

        Raises:
            CheckpointError: naming the file, when it is missing, truncated or corrupt.
        """
        choice = self._choose(which) if get_rank() == 0 else None
        choice = broadcast_object(choice)
        if choice is None:
            _log.info("No checkpoint in %s: starting fresh.", self.folder)
            return None
        state = load_checkpoint(choice)
        meta = state.get("meta", {})
        if meta.get("format") != FORMAT:
            raise CheckpointError(
                f"Checkpoint {choice} has format {meta.get('format')!r}; this unison reads {FORMAT}."
            )
        missing = [name for name in self.to_save if name not in state["objects"]]
        if missing:
            raise CheckpointError(
                f"Checkpoint {choice} holds no state for {missing} (it has {sorted(state['objects'])}). "
                "Use the same to_save names as the run that wrote it."
            )
        if meta["world_size"] != get_world_size():
            if meta["mid_epoch"]:
                raise CheckpointError(
                    f"Checkpoint {choice} was taken mid-epoch (iteration {meta['iteration']}) with world size "
                    f"{meta['world_size']}; this run has {get_world_size()}. Resume with {meta['world_size']} ranks, "
                    "or from a checkpoint taken at an epoch's end."
                )
            _log.warning(
                "Resuming %s, saved with world size %d, on %d ranks: the global batch changes from here on.",
                choice,
                meta["world_size"],
                get_world_size(),
            )
        for name, obj in self.to_save.items():
            if isinstance(obj, nn.Module):
                load_model_state(obj, state["objects"][name])
            else:
                obj.load_state_dict(state["objects"][name])
        self.trainer.load_state_dict(state["trainer"])
        rng = state["rng"]
        self._pending_rng = rng[get_rank()] if get_rank() < len(rng) else None
        self._pending_resume = state
        self._last_saved_iteration = meta["iteration"]
        _log.info("Resumed from %s (epoch %d, iteration %d).", choice, meta["epoch"], meta["iteration"])
        return Path(choice)

    def _on_started(self, engine: Engine) -> None:
        state, self._pending_resume = self._pending_resume, None
        if state is None:
            return
        meta = state["meta"]
        self._check_layout(engine, meta)
        if not meta["mid_epoch"] and not getattr(engine, "epoch_length_given", False):
            self._refit_epoch_length(engine)
        sampler_state = state.get("sampler")
        if sampler_state is not None:
            samplers = [
                s
                for s in samplers_with_set_epoch(engine.state.dataloader)
                if callable(getattr(s, "load_state_dict", None))
            ]
            if samplers:
                samplers[0].load_state_dict(sampler_state)
            elif meta["mid_epoch"]:
                _log.warning(
                    "The checkpoint was taken mid-epoch but the training data's sampler cannot skip samples "
                    "(use unison.distributed.TrainSampler): the epoch restarts from its first batch."
                )
        if not meta["mid_epoch"] and self._pending_rng is not None:
            # At an epoch boundary the next draw happens when the epoch's data iterator is
            # made, as in the uninterrupted run: put the generators back before that.
            restore_rng(self._pending_rng)
            self._pending_rng = None

    def _restore_pending_rng(self, _: Engine) -> None:
        # Mid-epoch: the uninterrupted run had already made its data iterator when it
        # saved; restoring after the resumed run makes its own keeps the draws aligned.
        if self._pending_rng is not None:
            restore_rng(self._pending_rng)
            self._pending_rng = None

    @staticmethod
    def _refit_epoch_length(engine: Engine) -> None:
        """At an epoch boundary the data decides the epoch length, not the checkpoint."""
        try:
            length = len(engine.state.dataloader)  # type: ignore[arg-type]
        except TypeError:
            return
        if length and length != engine.state.epoch_length:
            _log.warning(
                "The epoch length changed from %s to %d batches since the checkpoint (another world size or "
                "batch size); epochs from here on cover the whole data again.",
                engine.state.epoch_length,
                length,
            )
            engine.state.epoch_length = length
            engine.state.iteration = engine.state.epoch * length

    def _check_layout(self, engine: Engine, meta: Mapping[str, Any]) -> None:
        step = getattr(engine, "_process_function", None)
        now = {
            "batch_size": getattr(engine.state.dataloader, "batch_size", None),
            "accumulation_steps": getattr(step, "accumulation_steps", 1),
        }
        changed = [
            f"{k} {meta.get(k)} -> {v}"
            for k, v in now.items()
            if meta.get(k) is not None and meta.get(k) != v
        ]
        if not changed:
            return
        message = f"The run differs from its checkpoint: {', '.join(changed)} (per rank)."
        if meta["mid_epoch"]:
            raise CheckpointError(
                message
                + " A mid-epoch position is only exact with the same layout; resume with the saved values, "
                "or from a checkpoint taken at an epoch's end."
            )
        _log.warning("%s Resuming anyway at an epoch boundary.", message)

    def state_dict(self) -> dict[str, Any]:
        return {"manifest": self.manifest.to_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Rotation is rebuilt from the folder, which is the truth; nothing to load."""


_RESERVED = {"meta", "trainer", "sampler", "rng", "config"}
