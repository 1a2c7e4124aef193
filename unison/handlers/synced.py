"""The base of synced handlers: contribute to the sync point, act on the agreed result."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from ignite.engine import Engine

from unison.distributed.sync import Scope, SyncEngine, rank_row, require_sync_point, split_rows


class SyncedHandler(ABC):
    """A handler whose decision every rank takes alike, from values all ranks shared.

    The second of the two handler shapes (the first is a plain event handler). At every
    sync point of the trainer each rank contributes :attr:`rows` numbers
    (:meth:`local_values`: its own view, a flag, a clock, a vote); one all-reduce later
    every rank holds every rank's numbers and :meth:`on_agreed` decides from them. Because
    every rank sees the same numbers, every rank takes the same decision, and a stop it
    returns is applied on all ranks after the same iteration. Early stopping, the
    non-finite guard, the time limit and preemption are written this way.

    Subclasses implement :meth:`local_values` and :meth:`on_agreed`, and may override
    :meth:`attach_events` (their own event handlers) and :meth:`sync_engine` (when they
    attach to one engine but stop another, as early stopping attaches to the evaluator).

    Example:
        >>> from unison.engine import Engine
        >>> class StopAtIteration(SyncedHandler):
        ...     def __init__(self, at: int) -> None:
        ...         super().__init__()
        ...         self.at = at
        ...     def local_values(self) -> tuple[float]:
        ...         return (float(self.engine.state.iteration >= self.at),)
        ...     def on_agreed(self, values: list[list[float]]) -> str | None:
        ...         return "far enough" if any(values[0]) else None
        >>> engine = Engine(lambda e, b: None, sync_every=2)
        >>> StopAtIteration(4).attach(engine)
        >>> engine.run(range(10)).iteration
        4

    Distributed:
        Build and attach it on every rank: its values travel in the engine's collective,
        which every rank must join with the same contributors.
    """

    scope: Scope = "every"
    """``"every"``: at every sync point; ``"epoch"``: at epoch ends only."""
    rows: int = 1
    """How many numbers each rank contributes."""

    def __init__(self) -> None:
        self.engine: SyncEngine | None = None
        """The engine whose sync point this handler joined (set by :meth:`attach`)."""

    @abstractmethod
    def local_values(self) -> Sequence[float]:
        """This rank's :attr:`rows` numbers, read at each sync point."""

    @abstractmethod
    def on_agreed(self, values: list[list[float]]) -> str | None:
        """Decides from every rank's numbers: ``values[i][r]`` is rank ``r``'s i-th number.

        Returns:
            A reason to stop every rank (logged by rank 0), or None to go on.
        """

    def sync_engine(self, engine: Engine) -> Engine:
        """The engine whose sync point to join, given the one attached to (default: the same)."""
        return engine

    def attach_events(self, engine: Engine) -> None:
        """Adds this handler's own event handlers to ``engine``; called once per engine."""
        return None  # a handler that only reads the sync point needs no events of its own

    def attach(self, engine: Engine) -> None:
        """Joins ``engine``'s sync point (a unison Engine's); attaching twice has no effect."""
        target = require_sync_point(self.sync_engine(engine), type(self).__name__)
        if any(c is self for c in target.sync_point.contributors()):
            return
        self.engine = target
        self.attach_events(engine)
        target.sync_point.register(self, scope=self.scope)

    # -- the SyncContributor protocol: what the sync point calls --------------------------

    def sync_state(self) -> torch.Tensor:
        values = tuple(self.local_values())
        if len(values) != self.rows:
            raise ValueError(
                f"{type(self).__name__}.local_values() returned {len(values)} numbers; its rows is {self.rows}. "
                "Every rank must contribute the same count at every sync point."
            )
        return rank_row(*values)

    def load_synced_state(self, state: torch.Tensor) -> None:
        reason = self.on_agreed(split_rows(state, self.rows))
        if reason is not None and self.engine is not None:
            self.engine.stop_agreed(reason)
