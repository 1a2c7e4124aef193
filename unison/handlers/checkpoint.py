"""Durable, complete checkpoints written by rank 0, and exact resume on every rank."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from ignite.engine import Engine, Events

from unison.checkpoint.archive import keep_checked
from unison.checkpoint.attached import attached_states
from unison.checkpoint.data_entry import DataEntry, mid_epoch_cause
from unison.checkpoint.in_place import Into
from unison.checkpoint.io import load_checkpoint
from unison.checkpoint.loading import load_states
from unison.checkpoint.lock import hold_folder
from unison.checkpoint.manifest import Entry, Manifest, entry_for
from unison.checkpoint.per_rank import DATA, is_per_rank, local_states, rank_entries
from unison.checkpoint.positions import (
    DataTracker,
    PositionUnknown,
    fit_to_data,
    load_sampler,
    rank_view,
    sampler_state,
    step_attribute,
    trainer_layout,
    trainer_position,
)
from unison.checkpoint.ranks import choose, gather_on_first, open_folder, summed_over_ranks
from unison.checkpoint.retention import best_entry
from unison.checkpoint.sharded_save import (
    background_group,
    dcp_states,
    reserve_staging,
    save_sharded,
    sharded_names,
)
from unison.checkpoint.state import (
    build_checkpoint,
    capture_rng,
    check_checkpoint,
    check_options,
    check_to_save,
    checkpoint_meta,
    object_states,
    restore_rng,
    rng_of_rank,
    world_size_note,
)
from unison.checkpoint.step_fence import StepFence
from unison.checkpoint.verify import finite_check, to_plain
from unison.checkpoint.vetting import vetted
from unison.checkpoint.writer import CheckpointWriter
from unison.distributed.primitives import get_rank, get_world_size
from unison.distributed.replicated import agree_replicated
from unison.distributed.sync import require_sync_point
from unison.engine.closing import How, on_close
from unison.handlers.timed_saves import TimedSaves
from unison.handlers.trainer_guard import own_trainer
from unison.utils.logging import get_logger

_log = get_logger(__name__)


class Checkpoint:
    """Saves everything an exact resume needs, durably, from rank 0; resumes every rank.

    **When**: every ``every_epochs`` epochs and every ``every_iters`` iterations, after every
    handler of that event whatever their attach order (an evaluation included), at the first
    sync point ``every_seconds`` after the last save began (rank 0's clock:
    :class:`~unison.handlers.timed_saves.TimedSaves`), and at the end of the run. Inside an
    epoch, a save waits for the end of the accumulation window.

    **What**: each object of ``to_save`` (a model is saved unwrapped from DDP, without the
    ``module.`` prefix; anything else through its ``state_dict()``: optimizers, LR
    schedulers, a GradScaler, handlers such as EarlyStopping; every rank's own state of one with
    ``per_rank_state = True``: :mod:`unison.checkpoint.per_rank`), the trainer's state, the
    training data's position (its sampler's, or each rank's own data state: a loader or a stream
    in ``to_save`` is refused), every rank's generator states, the config, the world size, the
    per-rank batch size and the library versions. Everything loads with
    ``torch.load(weights_only=True)``: numpy scalars and paths become plain values, other
    values are refused at save time, naming their key. Non-finite weights are not saved.
    Mid-epoch saves (``every_iters``, ``every_seconds``, a Preemption) of data that cannot tell its position
    are refused at ``STARTED``.

    **How**: rank 0 writes durably and records the file in ``manifest.json``
    (:class:`~unison.checkpoint.writer.CheckpointWriter`). Rotation keeps the newest
    ``keep_last`` (by save sequence) and the best ``keep_best`` by ``metric``, deleting
    others only once the new file is recorded. With ``async_save=True`` training blocks
    only while the state is copied to CPU memory, into buffers allocated after the first
    iteration and kept between saves; the copy is checked and written in a background thread.

    **Resume**: :meth:`resume` (``"auto"``: the newest complete checkpoint, falling back
    to older ones with a warning when a file is damaged; or a path) loads the states on
    every rank. A run stopped at any iteration and resumed ends with the parameters of the
    uninterrupted run: the sampler skips the samples its data iterator already handed
    out, without loading them, and each rank's generators are put back.

    Args:
        dirname: the folder (shared by all ranks' view of the filesystem).
        to_save: name -> model, optimizer, scheduler, scaler, handler...
        trainer: the training engine (a unison Engine).
        every_epochs: save every this many epochs; None for never.
        every_iters: save every this many iterations; None for never.
        every_seconds: save this many seconds after the last save began (or the start); None for never.
        at_end: save when the run completes or stops.
        keep_last: how many of the newest checkpoints to keep; None keeps all.
        keep_best: how many of the best by ``metric`` to keep as well.
        metric: the score in ``metric_engine.state.metrics`` (synced: ranks agree) ranking ``keep_best``.
        mode: ``"max"`` or ``"min"``: which scores are best.
        metric_engine: the engine whose metrics hold ``metric``; default, the trainer.
        async_save: write in a background thread.
        config: the run's resolved configuration (plain data), stored for the record.
        prefix: file name prefix.
        require_empty: refuse a folder that already holds checkpoints.

    Distributed:
        Construct, attach and resume on every rank: rank 0 holds the folder against other jobs from then
        to the run's end (``FolderInUseError``), checks it, shares the answers; a save gathers all ranks' RNGs.
    """

    def __init__(
        self,
        dirname: str | os.PathLike[str],
        to_save: Mapping[str, Any],
        trainer: Engine,
        *,
        every_epochs: int | None = 1,
        every_iters: int | None = None,
        every_seconds: float | None = None,
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
        check_options(every_epochs, every_iters, keep_last, keep_best, metric, mode)
        check_to_save(to_save)  # a loader is refused: the trainer's data state is saved per rank, below
        self._agreed = require_sync_point(trainer, "Checkpoint(trainer=...)")
        self.folder = Path(dirname)
        self.to_save = dict(to_save)
        scaler = step_attribute(trainer, "scaler", None)
        if scaler is not None and not any(obj is scaler for obj in self.to_save.values()):
            # fp16 training made its own GradScaler: without its scale, a resume is not exact.
            self.to_save["grad_scaler"] = scaler
        self.trainer = trainer
        self.every_epochs = every_epochs
        self.every_iters = every_iters
        self.every_seconds = every_seconds
        self.timed = TimedSaves(self, every_seconds) if every_seconds is not None else None  # its saves
        self.at_end = at_end
        self.metric = metric
        self.mode = mode
        self.metric_engine = metric_engine
        self.config = to_plain(dict(config), "config") if config is not None else None
        self.manifest = Manifest(self.folder, prefix)
        self.writer = CheckpointWriter(
            self.manifest, keep_last=keep_last, keep_best=keep_best, mode=mode, async_save=async_save
        )
        """Writes, records and rotates the files (rank 0)."""
        self.stall_seconds: list[float] = []
        """How long each save blocked training, in seconds (rank 0): an asynchronous save's includes
        the wait of the optimizer's next step for its copy."""
        self._step_fence = StepFence(self.writer, self.stall_seconds)
        """Which tensors an asynchronous save copies beside the next iteration; the steps that wait for them."""
        self._last_saved_iteration = -1
        self._save_due = False
        self._pending_resume: dict[str, Any] | None = None
        self._resumed_from = ""  # the file the pending resume came from, for its messages
        self._pending_rng: Mapping[str, Any] | None = None
        self.data = DataTracker()
        """Where the training data's iterator stands (the sampler position of a save)."""
        self.data_entry = DataEntry()
        """Each rank's own data state, for data that keeps one (the checkpoint's ``data`` entry)."""
        self.lock = open_folder(self.manifest, require_empty=require_empty)  # held until the end of the run

    @property
    def saved(self) -> list[Path]:
        """Files this handler wrote (on rank 0), in order."""
        return self.writer.saved

    # -- attaching ------------------------------------------------------------------------

    def attach(self, engine: Engine | None = None) -> None:
        """Registers on the trainer; attaching twice has no effect."""
        trainer = own_trainer("Checkpoint", self.trainer, engine)
        if trainer.has_event_handler(self._on_started, Events.STARTED):
            return
        k = step_attribute(trainer, "accumulation_steps", 1)
        trainer.add_event_handler(Events.STARTED, self._on_started)
        trainer.add_event_handler(Events.EPOCH_STARTED, self._on_epoch_started)
        self.data.attach(trainer)  # follows the ends of the data iterators
        trainer.add_event_handler(Events.GET_BATCH_STARTED, self._restore_pending_rng)
        if self.every_epochs is not None or self.timed is not None:
            # After every handler of the epoch (an evaluation attached later included): the score
            # recorded is this epoch's.
            trainer.after_epoch(self._epoch_trigger)  # type: ignore[attr-defined]  # a unison Engine (checked above)
        if self.every_iters is not None or self.timed is not None:
            # After every handler of the iteration and its sync point: the saved state is the
            # whole iteration's, and a stop agreed at it is already applied.
            trainer.after_iteration(self._iteration_trigger)  # type: ignore[attr-defined]  # a unison Engine (checked above)
            if k > 1 and self.every_iters is not None and self.every_iters % k:
                _log.info(
                    "Checkpoint(every_iters=%d) with accumulation_steps=%d: each save waits for the end of its "
                    "accumulation window.",
                    self.every_iters,
                    k,
                )
        if self.writer.async_save:  # the copy's buffers, once the optimizer's state exists
            trainer.add_event_handler(Events.ITERATION_COMPLETED, self._reserve_copy)
        on_close(trainer, self._on_end)
        if self.timed is not None:
            self.timed.attach(trainer)  # after STARTED's handlers above: the clock starts with the run

    def _reserve_copy(self, engine: Engine) -> None:
        """Once, after the first iteration: rank 0's writer allocates the buffers of its asynchronous
        copy in its thread (:meth:`CheckpointWriter.reserve`), so that the first save only copies;
        for sharded states, every rank its copy of its shards (``sharded_save.reserve_staging``)."""
        engine.remove_event_handler(self._reserve_copy, Events.ITERATION_COMPLETED)
        objects = self._objects(engine)
        names = sharded_names(objects)  # the same on every rank
        if names:  # every rank (dcp_states may be a collective): a reservation is made once
            reserve_staging(self.writer, dcp_states(objects, names))
        elif get_rank() == 0 and not names and not self.writer.in_flight:
            rng = [capture_rng()] * get_world_size()  # every rank's generators: the same shapes
            self.writer.reserve({"rng": rng, "objects": object_states(objects)})

    def _iteration_trigger(self, engine: Engine) -> None:
        if self.every_iters is not None and engine.state.iteration % self.every_iters == 0:
            self._save_due = True
        if not self._save_due or not self._agreed.at_boundary():
            return
        completed, into = engine.epoch_position  # type: ignore[attr-defined]  # a unison Engine (checked above)
        ends_epoch = into == 0 and completed == engine.state.epoch
        if ends_epoch and self.every_epochs is not None and engine.state.epoch % self.every_epochs == 0:
            return  # the epoch's save follows, after the epoch's handlers (evaluation)
        self.save(engine)

    def request_save(self) -> None:
        """A save after this iteration's window, or this epoch's handlers; on every rank alike (agreed sums)."""
        self._save_due = True

    def _epoch_trigger(self, engine: Engine) -> None:
        if self._save_due or (self.every_epochs is not None and engine.state.epoch % self.every_epochs == 0):
            self.save(engine)

    def _on_end(self, how: How) -> None:
        if how == "failed":
            return
        engine = self.trainer
        unsaved = engine.state.iteration != self._last_saved_iteration
        if self.at_end and unsaved and self._agreed.at_boundary():
            self.save(engine)
        self.wait()
        self.lock.release()  # another job may take the folder now

    # -- saving ---------------------------------------------------------------------------

    def _score(self) -> float | None:
        if self.metric is None:
            return None
        value = (self.metric_engine or self.trainer).state.metrics.get(self.metric)
        return None if value is None else float(value)

    def _objects(self, engine: Engine) -> dict[str, Any]:
        """Every object a checkpoint holds: the handlers attached to the trainer, then ``to_save``."""
        return {**attached_states(engine, [self, *self.to_save.values()]), **self.to_save}

    def collect(self, engine: Engine, *, sharded: list[str] | None = None) -> dict[str, Any] | None:
        """Collective: call on every rank. The full checkpoint on rank 0; None elsewhere.

        Its ``meta`` gets its save sequence when :meth:`save` writes it. The objects named
        in ``sharded`` are left out (each rank writes their shards) and listed in
        ``meta["sharded"]``.
        """
        return self._collect(engine, sharded)

    def _collect(self, engine: Engine, sharded: list[str] | None) -> dict[str, Any] | None:
        """:meth:`collect`: every rank's part gathered to rank 0 in one gather."""
        pass_, iteration = self.data.current, engine.state.iteration
        partial = getattr(engine, "partial_sums", lambda: None)()  # the epoch's loss sums so far
        trainer = engine.state_dict()
        if hasattr(engine, "extra_state_dict"):  # all of it, even where ignite's keys imply it
            trainer["unison"] = engine.extra_state_dict()
        stop = trainer.get("unison", {}).get("stop")  # this rank's requests no sync point has settled
        objects = {n: o for n, o in self._objects(engine).items() if n not in (sharded or ())}
        mine = local_states(objects, self.data_entry.local())  # per-rank states (checkpoint.per_rank)
        everyone = gather_on_first((capture_rng(), pass_.consumed(iteration, None), (partial, stop), mine))
        if everyone is None:
            return None
        if "unison" in trainer:
            partials = summed_over_ranks([p for _, _, (p, _), _ in everyone])
            if partials is not None:
                trainer["unison"]["partials"] = partials
            trainer["unison"]["stop_by_rank"] = [s for _, _, (_, s), _ in everyone]
        batch_size, steps = trainer_layout(engine)
        meta = checkpoint_meta(
            trainer_position(engine),
            world_size=get_world_size(),
            batch_size=batch_size,
            accumulation_steps=steps,
            score=self._score(),
            metric=self.metric,
            saved_at=time.time(),
        )
        by_rank = [consumed for _, consumed, _, _ in everyone]
        sampled = self.data_entry.position is None or self.data_entry.position.kind == "sampler"
        if sharded:
            meta["sharded"] = list(sharded)
        return build_checkpoint(
            meta=meta,
            trainer=trainer,
            sampler=sampler_state(engine.state.dataloader, pass_, iteration, by_rank) if sampled else None,
            data=self.data_entry.entry([m[DATA] for *_, m in everyone], get_world_size()),
            rng=[rng for rng, *_ in everyone],
            objects=object_states({n: o for n, o in objects.items() if not is_per_rank(o)}),
            per_rank=rank_entries([m for *_, m in everyone], get_world_size()),  # each rank's own, by name
            config=self.config,
        )

    def save(self, engine: Engine | None = None) -> Path | None:
        """Collective: call on every rank. Writes a checkpoint now; returns its path on rank 0.

        Returns None on other ranks, and when the weights hold a NaN or an infinity: such a
        checkpoint is never written (a warning names the first bad tensor), so the last good
        one stays the newest. With ``async_save`` the writer's thread checks its copy: the path
        is returned, and the file is not written.

        Raises:
            NotPlainError: on every rank, when a state holds a value that
                ``torch.load(weights_only=True)`` would refuse; it names the key.
        """
        engine = engine or self.trainer
        self._save_due = False
        if engine.state.iteration == self._last_saved_iteration:
            return self.saved[-1] if self.saved else None  # this iteration is already on disk
        start = time.perf_counter()
        if self.timed is not None:
            self.timed.restart()  # the next interval counts from this save's start
        names = sharded_names(self._objects(engine))  # the same on every rank
        shards = dcp_states(self._objects(engine), names) if names else None
        if shards is not None:  # DCP stores one copy of each buffer: every rank's is rank 0's first
            agree_replicated(shards)
        try:
            state, problem = self._collect(engine, names or None), None
        except PositionUnknown as err:  # rank 0 only, after the collective: shared below
            state, problem = None, err
        # A file save leaves the finite check to its writer, which runs it while the file is written
        # (on its copy, for an asynchronous save): a refused file never takes its name. Each rank of a
        # sharded save checks its shards as it writes them (unison.checkpoint.dcp_files); rank 0
        # checks here the rest, which the folder's finish writes after them.
        iteration = self.trainer.state.iteration
        state, write = vetted(state, problem, self.manifest, iteration, finite=shards is not None)
        self._last_saved_iteration = engine.state.iteration
        if not write:
            return None
        self.writer.wait()  # at most one write in flight; the manifest is up to date after it
        # with async_save: what only an optimizer's step changes is copied beside the next iteration
        later = self._step_fence.later(self._objects(engine)) if self.writer.async_save else None
        entry = None
        if state is not None:
            state["meta"]["sequence"] = self.manifest.next_sequence()
            entry = entry_for(state["meta"], self.manifest.prefix, sharded=bool(names))
        if shards is not None:  # every rank writes its shards; rank 0 the rest, then records
            name = entry_for(trainer_position(engine)._asdict(), self.manifest.prefix, sharded=True).file
            path = save_sharded(
                self.writer,
                name,
                state,
                shards,
                entry,
                async_group=background_group(self.writer),
                later=later,
            )
        elif state is None or entry is None:
            return None
        else:
            path = self.folder / entry.file
            written = self.writer.write(
                state,
                path,
                entry,
                check=finite_check(self.manifest, iteration),
                later=later,
            )
            if not written:  # a synchronous save whose weights are not finite (the writer warned)
                return None
        if path is not None:
            self.stall_seconds.append(time.perf_counter() - start)
        return path

    def wait(self) -> None:
        """Blocks until an asynchronous write has finished; re-raises its error."""
        self.writer.wait()

    @property
    def best(self) -> Entry | None:
        """The best recorded checkpoint by ``metric`` (rank 0's view)."""
        return best_entry(self.manifest.entries, self.mode)

    # -- resuming -------------------------------------------------------------------------

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
        # Rank 0's check of the newest checkpoint loads it, read once; big records go straight into
        # the run's own tensors where they fit them (unison.checkpoint.in_place).
        with keep_checked(into=Into.of(self._objects(self.trainer))):
            choice = choose(self.manifest, which)
            if choice is None:
                _log.info("No checkpoint in %s: starting fresh.", self.folder)
                return None
            # choose() read a file whole on rank 0, and a sharded folder by every rank, a share each
            checked = which == "auto" and (get_rank() == 0 or Path(choice).is_dir())
            state = load_checkpoint(choice, checked=checked)
        # Raises for what does not fit; the note on another world size waits for the run's layout.
        check_checkpoint(state, source=choice, names=self.to_save, world_size=get_world_size())
        self._resumed_from = choice
        meta = state["meta"]
        load_states(self._objects(self.trainer), state, Path(choice), self.to_save)
        self.trainer.load_state_dict(state["trainer"])
        self._pending_rng = rng_of_rank(state["rng"], get_rank())
        self._pending_resume = state
        self._last_saved_iteration = meta["iteration"]
        _log.info("Resumed from %s (epoch %d, iteration %d).", choice, meta["epoch"], meta["iteration"])
        return Path(choice)

    def _on_started(self, engine: Engine) -> None:
        self.lock = hold_folder(self.folder) if self.lock.ended else self.lock  # again only after a release
        state, self._pending_resume = self._pending_resume, None
        cause = mid_epoch_cause(self, engine)  # what saves inside an epoch, if anything
        position = self.data_entry.run_started(engine.state.dataloader, refuse_mid_epoch=cause)
        saved = rank_view(state.get("sampler") if state and position.kind == "sampler" else None, get_rank())
        if state is not None:  # the data decides the epoch length, not the checkpoint
            batch_size, steps = trainer_layout(engine)
            if state["meta"]["world_size"] != get_world_size():
                _log.warning(
                    "%s",
                    world_size_note(
                        state["meta"],
                        source=self._resumed_from,
                        world_size=get_world_size(),
                        layout=(batch_size, steps),
                    ),
                )
            saved = fit_to_data(
                engine, trainer_position(engine), state["meta"], saved, layout=(batch_size, steps)
            )
            self._last_saved_iteration = engine.state.iteration  # that position is on disk
            if state["meta"]["mid_epoch"]:  # at an epoch boundary the data starts its next epoch afresh
                self.data_entry.load(state.get("data"), get_rank(), mid_epoch=True, source=str(self.folder))
        self.data.run_started(engine.state.dataloader, engine.state.iteration, saved, engine=engine)
        if state is not None and not state["meta"]["mid_epoch"]:
            # At an epoch boundary the next draw happens when the epoch's data iterator is
            # made, as in the uninterrupted run: put the generators back before that.
            self._restore_pending_rng(engine)

    def _on_epoch_started(self, engine: Engine) -> None:
        self.data.epoch_started(
            engine.state.dataloader, lambda saved: load_sampler(engine.state.dataloader, saved)
        )

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
