"""Where an engine stands within its epochs: what a checkpoint saves and a resumed run continues.

ignite derives the epoch from ``iteration // epoch_length``; that is wrong after an epoch cut
short by ``terminate_epoch()`` and loses a mid-epoch position's partial sums. The tracker
below keeps the position itself, and the sums of the epoch's additive contributors (the
epoch's mean loss) travel with a mid-epoch checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ignite.engine import State

from unison.distributed.sync import SyncPoint


class EpochTracker:
    """The engine's position within its epochs, kept by its event loop.

    Attributes:
        iteration: the current iteration's 1-based position within its epoch.
        resume_offset: iterations of the next epoch already done (after a mid-epoch resume).
        done: whether the current epoch has ended (``EPOCH_COMPLETED`` or cut short).
        fresh_iterator: the next epoch must make its data iterator after ``set_epoch``.
        relearn: the current epoch resumed mid-epoch before its length was known; the length it
            learns counts iterations of two runs (of two world sizes, for a resharded stream).
    """

    def __init__(self) -> None:
        self.iteration = 0
        self.resume_offset = 0
        self.done = True
        self.fresh_iterator = False
        self.relearn = False
        self.loaded: int | None = None
        self.tracked: State | None = None  # the state this tracker follows
        self.pending_partials: list[list[float]] | None = None

    def position(self, state: State, cut: bool) -> tuple[int, int]:
        """``(epochs completed, iterations done of the next)``; ``cut``: terminate_epoch() applied."""
        if self.loaded is not None:  # loaded, not yet run
            return state.epoch, self.loaded
        length = state.epoch_length
        if state is not self.tracked:  # a state no run of this engine made (assigned by hand): ignite's view
            return divmod(state.iteration, length) if length else (state.epoch, 0)
        if self.done or cut or state.epoch == 0 or (length is not None and self.iteration >= length):
            return state.epoch, 0
        return state.epoch - 1, self.iteration

    def start_run(self, state: State) -> int | None:
        """At ``STARTED``: where the first epoch resumes; returns the loaded position, if any,
        for ignite's loop to start from (else ignite's ``iteration % epoch_length`` holds)."""
        loaded, self.loaded = self.loaded, None
        self.tracked = state
        if loaded is not None:
            self.resume_offset = loaded
            return loaded
        length = state.epoch_length
        self.resume_offset = state.iteration % length if length else 0
        return None

    def start_epoch(self) -> bool:
        """At ``EPOCH_STARTED``; returns whether the data iterator must be made anew."""
        self.iteration, self.resume_offset = self.resume_offset, 0
        self.relearn = self.iteration > 0 and self.tracked is not None and self.tracked.epoch_length is None
        self.done = False
        fresh, self.fresh_iterator = self.fresh_iterator, False
        return fresh

    def end_epoch(self, state: State) -> None:
        """After ``EPOCH_COMPLETED``'s handlers, before the after-epoch callbacks (a checkpoint's save):
        a length learned by a resumed epoch is no later epoch's, which learns its own, from a fresh
        data iterator."""
        if self.relearn:
            self.relearn, self.fresh_iterator = False, True
            state.epoch_length = None

    def ends_here(self, state: State) -> bool:
        """Whether the current iteration is the epoch's last."""
        return state.epoch_length is not None and self.iteration >= state.epoch_length

    def load(self, saved: Mapping[str, Any], state: State) -> None:
        """Restores a saved ``position`` and ``partials`` (the engine's ``unison`` state)."""
        partials = saved.get("partials")
        self.pending_partials = [[float(v) for v in row] for row in partials] if partials else None
        if "position" in saved:
            completed, into = (int(v) for v in saved["position"])
            state.epoch = completed
            self.loaded = into


def partial_contributors(sync_point: SyncPoint) -> list[Any]:
    """The contributors whose sums carry over a mid-epoch resume (they have ``restore_partial``)."""
    return [c for c in sync_point.contributors() if callable(getattr(c, "restore_partial", None))]


def partial_sums(sync_point: SyncPoint, position: tuple[int, int]) -> list[list[float]] | None:
    """This rank's sums so far of the contributors that carry over a resume; None at a boundary.

    A checkpoint taken mid-epoch adds them up over the ranks and stores them with the
    trainer state (``unison.partials``); the resumed epoch starts from those sums, so its
    mean covers the whole epoch, as the uninterrupted run's does. A contributor takes
    part by having ``restore_partial(values)``.
    """
    if position[1] == 0:
        return None
    return [[float(v) for v in c.sync_state().tolist()] for c in partial_contributors(sync_point)]


def restore_partials(contributors: list[Any], pending: list[list[float]], first_rank: bool) -> None:
    """Starts the resumed epoch from the saved sums: one rank carries them, the others zeros."""
    if len(pending) != len(contributors):
        return
    for contributor, values in zip(contributors, pending, strict=True):
        contributor.restore_partial(values if first_rank else [0.0] * len(values))


def run_complete(
    state: State, position: tuple[int, int], max_epochs: int | None, max_iters: int | None
) -> bool:
    """Whether ``state`` has reached the run's end: ``max_epochs``/``max_iters``, or the kept limits.

    ignite restarts a finished state from epoch 0; unison's ``run`` returns a state loaded
    from a checkpoint unchanged when it is complete, so a finished run that is resumed
    neither retrains nor overwrites its checkpoints. An epoch cut by ``terminate_epoch()``
    counts as completed (``position`` is the engine's ``epoch_position``).
    """
    limit = max_iters if max_iters is not None else state.max_iters
    if limit is not None:
        return bool(state.iteration >= limit)
    if state.max_epochs is None:
        return False
    target = max_epochs if max_epochs is not None else state.max_epochs
    completed, into = position
    return completed >= target and into == 0


def is_last_epoch(state: State) -> bool:
    """Whether the epoch that just ended is the run's last (by ``max_epochs`` or ``max_iters``)."""
    if state.max_epochs is not None and state.epoch >= state.max_epochs:
        return True
    return state.max_iters is not None and state.iteration >= state.max_iters
