"""Where the training data stands: the sampler's epoch and the samples its iterator handed out.

The engine's counters say how many batches an *epoch* consumed; a resume needs the position
of the *data iterator*, which is not the same thing: ignite keeps the iterator across
epochs when ``epoch_length`` is shorter than the loader, starts a new one inside an epoch
when it is longer, and starts a new one at ``terminate_epoch()``. A :class:`DataPass` is
one run of one iterator: the sampler epoch it was drawn with and the samples taken from
it. No engine here: the Checkpoint handler feeds it from the engine's events.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from ignite.engine import Events

from unison.checkpoint.state import Position, check_layout, data_length, refit_epoch_length
from unison.checkpoint.tracking_step import renumber
from unison.distributed.primitives import get_world_size
from unison.distributed.samplers import TrainSampler, samplers_with_set_epoch
from unison.utils.logging import get_logger

_log = get_logger(__name__)


class PositionUnknown(RuntimeError):
    """The samples consumed mid-epoch cannot be told, so a mid-epoch save would resume wrongly."""


def resumable_sampler(data: Any) -> Any | None:
    """The first sampler behind ``data`` that can save and load its position, or None."""
    for sampler in samplers_with_set_epoch(data):
        if callable(getattr(sampler, "load_state_dict", None)):
            return sampler
    return None


def fixed_batch_size(data: Any) -> int | None:
    """Samples in every batch but an iterator's last: the loader's ``batch_size``, else its batch
    sampler's when that is an int; None when batches may vary (a custom ``batch_sampler``).

    Example:
        >>> from torch.utils.data import DataLoader
        >>> fixed_batch_size(DataLoader(range(10), batch_size=4))
        4
    """
    size = getattr(data, "batch_size", None)
    if size is None:
        size = getattr(getattr(data, "batch_sampler", None), "batch_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None


def batch_samples(batch: Any) -> int | None:
    """The samples in a collated batch: the graphs of a graph batch (``num_graphs``), else the
    first dimension its tensors share; None when unclear.

    Example:
        >>> batch_samples((torch.zeros(3, 5), {"y": torch.zeros(3)}))
        3
        >>> batch_samples([torch.zeros(3), torch.zeros(2)]) is None
        True
    """
    graphs = getattr(batch, "num_graphs", None)  # a torch_geometric Batch: its tensors count nodes
    if isinstance(graphs, int) and not isinstance(graphs, bool):
        return graphs
    sizes = {t.shape[0] for t in _tensors(batch) if t.dim() > 0}
    return sizes.pop() if len(sizes) == 1 else None


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, Mapping):
        return [t for value in batch.values() for t in _tensors(value)]
    if isinstance(batch, (list, tuple)):
        return [t for value in batch for t in _tensors(value)]
    return []


@dataclass
class DataPass:
    """One data iterator's run: drawn with ``sampler_epoch``, started after ``start_iteration``.

    Attributes:
        start_iteration: the engine's iteration count before the pass's first batch.
        sampler_epoch: the sampler's epoch the iterator was drawn with; None until known
            (the iterator is made after the next ``EPOCH_STARTED``).
        skipped: samples a resumed sampler skips at the pass's start (already trained on).
        samples: samples taken since the start, when batches are counted; else None.
        resumed: the pass continues a saved one (its shards may start inside the epoch).
    """

    start_iteration: int
    sampler_epoch: int | None = None
    skipped: int = 0
    samples: int | None = None
    resumed: bool = False

    def consumed(self, iteration: int, batch_size: int | None) -> int | None:
        """Samples of the sampler's epoch consumed after ``iteration``; None when unknown."""
        if self.samples is not None:
            return self.skipped + self.samples
        if batch_size is None:
            return None
        return self.skipped + (iteration - self.start_iteration) * batch_size


def sampler_state(
    data: Any, current: DataPass, iteration: int, by_rank: list[int | None] | None = None
) -> dict[str, Any] | None:
    """The saved position of the resumable sampler behind ``data``; None without one.

    ``epoch`` is the sampler epoch of the current iterator and ``consumed`` the samples of it
    trained on; a finished iterator is saved as ``consumed=0`` with ``"fresh": True``: the
    resume draws the next one as the uninterrupted run does. With counted samples,
    ``by_rank`` (every rank's count) is saved as ``consumed_by_rank``: batches may differ
    in size from rank to rank.

    Raises:
        PositionUnknown: mid-iterator, when the samples consumed cannot be told.
    """
    sampler = resumable_sampler(data)
    if sampler is None:
        return None
    consumed = current.consumed(iteration, fixed_batch_size(data))
    total = len(sampler) + getattr(sampler, "start", 0)
    done = iteration == current.start_iteration and not (current.skipped or current.resumed)
    if consumed is None and not done:
        raise PositionUnknown(
            "Checkpoint: cannot save mid-epoch: the training data's batch sampler has no fixed batch_size "
            "and its batches hold no tensors to count samples from, so the sampler's position is unknown. "
            "Save at epoch ends only (every_iters=None), give the batch sampler a batch_size attribute, or "
            "collate batches into tensors."
        )
    fresh = done or (consumed is not None and consumed >= total)
    counted = by_rank is not None and current.samples is not None and not fresh
    if isinstance(sampler, TrainSampler):
        state = sampler.state_dict(
            consumed=0 if fresh else consumed,
            consumed_by_rank=[int(c or 0) for c in by_rank] if counted and by_rank is not None else None,
            epoch=current.sampler_epoch,
        )
    else:
        state = dict(sampler.state_dict(consumed=0 if fresh else consumed))
    state["epoch"] = current.sampler_epoch if current.sampler_epoch is not None else state["epoch"]
    state["fresh"] = fresh
    if counted and by_rank is not None:
        state["consumed_by_rank"] = list(by_rank)
    return state


def load_sampler(data: Any, saved: Mapping[str, Any]) -> None:
    """Puts the resumable sampler behind ``data`` at its saved position."""
    sampler = resumable_sampler(data)
    if sampler is not None:
        sampler.load_state_dict(dict(saved))


def rank_view(saved: Mapping[str, Any] | None, rank: int) -> Mapping[str, Any] | None:
    """The saved sampler state as ``rank`` resumes it: its own ``consumed`` when counted per rank
    (0 for a rank the saving run did not have: at another world size the global position counts)."""
    if saved is None or "consumed_by_rank" not in saved:
        return saved
    by_rank = saved["consumed_by_rank"]
    return {**saved, "consumed": by_rank[rank] if rank < len(by_rank) else 0}


def resumed_pass_length(data: Any, saved: Mapping[str, Any]) -> int | None:
    """The batches the training data yields once its TrainSampler is at ``saved``; None when unknown.

    The sampler is put back as it was (at no position) before returning.
    """
    sampler = resumable_sampler(data)
    if not isinstance(sampler, TrainSampler):
        return None
    before = sampler.state_dict()
    sampler.load_state_dict(dict(saved))
    try:
        return data_length(data)
    finally:
        sampler.load_state_dict({**before, "fresh": True})


def fit_resumed_epoch(at: Position, data: Any, saved: Mapping[str, Any] | None) -> Position | None:
    """The engine position that fits a mid-epoch resume to the data's layout now; None when it fits.

    The saved position counts ``at.epoch_length`` iterations an epoch, ``at.into_epoch`` of them
    done. At another world size or per-rank batch size the resumed pass yields ``k`` batches,
    not ``epoch_length - into_epoch``, and later epochs ``L = len(data)``: the resumed epoch is
    then placed at ``L - k`` of an epoch of ``L`` (iteration ``epoch * L + L - k``), so that it
    ends with its data and the next epoch is a normal one. With nothing left (``k == 0``) the
    epoch counts as completed.

    Args:
        at: the loaded position (mid-epoch).
        data: the training data of the resumed run.
        saved: this rank's view of the saved sampler state.
    """
    length = data_length(data)
    if not length or saved is None or saved.get("fresh") or at.into_epoch is None or not at.epoch_length:
        return None
    remaining = resumed_pass_length(data, saved)
    if remaining is None or (length == at.epoch_length and remaining == at.epoch_length - at.into_epoch):
        return None
    if remaining == 0:
        _log.warning(
            "The epoch the checkpoint was taken in has no batch left at this run's layout (its remaining "
            "samples were dropped by drop_last): the epoch counts as completed, without its end-of-epoch handlers."
        )
        return Position(at.epoch + 1, (at.epoch + 1) * length, length, 0)
    remaining = min(remaining, length)
    return Position(at.epoch, at.epoch * length + length - remaining, length, length - remaining)


def fit_to_data(
    engine: Any,
    at: Position,
    meta: Mapping[str, Any],
    saved: Mapping[str, Any] | None,
    *,
    layout: tuple[int | None, int],
) -> Mapping[str, Any] | None:
    """At ``STARTED`` of a resumed run: fits the engine's epochs to the data of this run.

    Reports a changed per-rank layout (:func:`~unison.checkpoint.state.check_layout`). Unless
    the run was given ``epoch_length``, the data decides the epoch length: at an epoch
    boundary through :func:`~unison.checkpoint.state.refit_epoch_length`, mid-epoch through
    :func:`fit_resumed_epoch` and :func:`place_engine`. Data without a length (a stream) at
    another world size learns its epoch length again, the resumed epoch and the next.

    Args:
        engine: the trainer (a unison Engine), with the checkpoint's state loaded.
        at: its loaded position.
        meta: the checkpoint's ``meta``.
        saved: this rank's view of the saved sampler state.
        layout: this run's per-rank batch size and accumulation steps.

    Returns:
        The sampler state to resume at: ``saved``, or None when nothing of its epoch is left.

    Raises:
        CheckpointError: for another ``accumulation_steps`` mid-epoch.
    """
    change = check_layout(meta, batch_size=layout[0], accumulation_steps=layout[1])
    if change is not None:
        where = (
            "mid-epoch: the epoch's remaining samples are batched anew"
            if meta["mid_epoch"]
            else "at an epoch boundary"
        )
        _log.warning("%s Resuming anyway %s.", change, where)
    if getattr(engine, "epoch_length_given", False):
        return saved
    data = engine.state.dataloader
    if meta.get("world_size") != get_world_size() and data_length(data) is None:
        # A stream resharded: the saved length counts another world size's batches. The
        # epoch learns its length again, as a first epoch does (EpochTracker.relearn).
        engine.state.epoch_length = None
        return saved
    if not meta["mid_epoch"]:
        fit = refit_epoch_length(at, data_length(data), warn=True)
        if fit is not None:
            engine.state.epoch_length = fit.epoch_length
            renumber(engine, fit.iteration)  # trackers' steps go on from the saved one
        return saved
    fit = fit_resumed_epoch(at, data, saved)
    if fit is None:
        return saved
    place_engine(engine, fit)
    return None if fit.epoch > at.epoch else saved  # nothing left of the saved epoch


def place_engine(engine: Any, at: Position) -> None:
    """Puts a unison Engine, at ``STARTED`` of a resumed run, at ``at`` (from :func:`fit_resumed_epoch`).

    The epoch, iteration and epoch length are ignite's public state; the position inside the
    epoch is set through the engine's ``reposition(into)``.
    """
    engine.state.epoch, engine.state.epoch_length = at.epoch, at.epoch_length
    renumber(engine, at.iteration)  # trackers' steps go on from the saved one
    engine.reposition(at.into_epoch or 0)


class DataTracker:
    """Follows the training data's iterators through a run, for :func:`sampler_state`.

    The Checkpoint handler calls :meth:`attach` once, :meth:`run_started` at ``STARTED`` and
    :meth:`epoch_started` at ``EPOCH_STARTED`` (after the engine's ``set_epoch``); the handlers
    attached call :meth:`iterator_ended` at ``DATALOADER_STOP_ITERATION`` and
    ``TERMINATE_SINGLE_EPOCH``, and :meth:`count` for each batch when the batches' sizes vary.
    """

    def __init__(self) -> None:
        self.current = DataPass(start_iteration=0)
        self.counting = False
        self._pending: Mapping[str, Any] | None = None
        self._overridden = False

    def attach(self, engine: Any) -> None:
        """Follows the ends of ``engine``'s data iterators (an ignite Engine)."""
        engine.add_event_handler(Events.DATALOADER_STOP_ITERATION, self._on_data_ran_out)
        engine.add_event_handler(Events.TERMINATE_SINGLE_EPOCH, self._on_epoch_cut)

    def _on_data_ran_out(self, engine: Any) -> None:  # a new iterator follows at once
        state = engine.state
        self.iterator_ended(state.dataloader, state.iteration, state.epoch, next_epoch_draws=False)

    def _on_epoch_cut(self, engine: Any, iter_counter: int = 0) -> None:  # ignite passes iter_counter
        state = engine.state
        self.iterator_ended(state.dataloader, state.iteration, state.epoch, next_epoch_draws=True)

    def _count_batch(self, engine: Any) -> None:
        self.count(engine.state.batch)

    def run_started(
        self, data: Any, iteration: int, saved: Mapping[str, Any] | None, *, engine: Any = None
    ) -> None:
        """A run starts at ``iteration``; ``saved`` is the sampler state to resume at, if any.
        With ``engine``, batches are counted on it when their sizes vary."""
        self.counting = resumable_sampler(data) is not None and fixed_batch_size(data) is None
        if (
            self.counting
            and engine is not None
            and not engine.has_event_handler(self._count_batch, Events.GET_BATCH_COMPLETED)
        ):
            engine.add_event_handler(Events.GET_BATCH_COMPLETED, self._count_batch)
        self.current = DataPass(start_iteration=iteration, samples=0 if self.counting else None)
        fresh = saved is None or saved.get("fresh", not int(saved.get("consumed", 0)))
        self._pending = None if fresh or resumable_sampler(data) is None else saved
        self._overridden = False
        if not fresh and resumable_sampler(data) is None:
            _log.warning(
                "The checkpoint was taken mid-epoch but the training data's sampler cannot skip samples "
                "(use unison.distributed.TrainSampler): the epoch restarts from its first batch."
            )

    def epoch_started(self, data: Any, load: Any) -> None:
        """After the engine's ``set_epoch``: applies a pending resume (``load(saved)``); notes the epoch."""
        sampler = resumable_sampler(data)
        if self._pending is not None:
            saved, self._pending = self._pending, None
            load(saved)
            self.current.skipped = int(getattr(sampler, "start", saved["consumed"]))
            self.current.sampler_epoch = int(saved["epoch"])
            self.current.resumed = True
            self._overridden = sampler is not None
        if self.current.sampler_epoch is None and sampler is not None:
            self.current.sampler_epoch = int(sampler.epoch)

    def iterator_ended(self, data: Any, iteration: int, epoch: int, *, next_epoch_draws: bool) -> None:
        """The current iterator is done; the next starts after ``iteration``.

        Args:
            data: the training data.
            iteration: the engine's iteration count.
            epoch: the engine's epoch (1-based); its sampler epoch is ``epoch - 1``.
            next_epoch_draws: the next iterator is drawn after the next ``set_epoch``
                (``terminate_epoch``), rather than now (the data ran out inside an epoch).
        """
        sampler = resumable_sampler(data)
        if self._overridden and sampler is not None:
            # The resumed iterator skipped samples of its saved epoch; the next one is drawn
            # as the uninterrupted run drew it: from the engine's epoch, nothing skipped.
            sampler.load_state_dict({**sampler.state_dict(consumed=0), "epoch": epoch - 1, "fresh": True})
            self._overridden = False
        drawn = None if next_epoch_draws or sampler is None else int(sampler.epoch)
        self.current = DataPass(iteration, drawn, samples=0 if self.counting else None)

    def count(self, batch: Any) -> None:
        """Adds the samples of ``batch``; once one cannot be counted, the position stays unknown."""
        if self.current.samples is None:
            return
        n = batch_samples(batch)
        if n is None:
            self.counting = False
        self.current.samples = None if n is None else self.current.samples + n


def step_attribute(engine: Any, name: str, default: Any) -> Any:
    """An attribute of the trainer's step (``TrainStep``), or ``default`` for another process function."""
    return getattr(getattr(engine, "_process_function", None), name, default)


def trainer_position(engine: Any) -> Position:
    """Where a trainer stands (with unison's Engine, right after ``terminate_epoch()`` too)."""
    position = getattr(engine, "epoch_position", None)  # unison's Engine: right after terminate_epoch()
    into = position[1] if isinstance(position, tuple) else None
    return Position(engine.state.epoch, engine.state.iteration, engine.state.epoch_length, into)


def trainer_layout(engine: Any) -> tuple[int | None, int]:
    """The per-rank batch size of the training data and the accumulation steps."""
    return fixed_batch_size(engine.state.dataloader), step_attribute(engine, "accumulation_steps", 1)
