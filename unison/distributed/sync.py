"""Sync points: a collective protocol in which ranks agree on state in one all-reduce.

Contributors (metrics, the engine's stop requests, guards) each add a vector of sums; one
all-reduce carries them all; every contributor reads the same totals back, so whatever it
decides from them is decided alike on every rank. The protocol knows nothing of engines
or handlers: an engine owns a :class:`SyncPoint` and calls it; a handler or metric
registers on it through :func:`require_sync_point`.
"""

from __future__ import annotations

from typing import Literal, Protocol, runtime_checkable

import torch

from unison.distributed.primitives import all_reduce_sum, get_rank, get_world_size

Scope = Literal["epoch", "every"]


@runtime_checkable
class SyncContributor(Protocol):
    """Something that adds a vector of sums to a sync point and reads back the total.

    ``sync_state`` must return a 1-D tensor of the same length on every rank (zeros for a
    rank that has nothing to add); ``load_synced_state`` receives the sum over all ranks,
    as float64 on the CPU. Because every rank receives the same sums, any decision taken
    from them in ``load_synced_state`` is the same on every rank.
    """

    def sync_state(self) -> torch.Tensor: ...

    def load_synced_state(self, state: torch.Tensor) -> None: ...


class SyncPoint:
    """Reduces the state of registered contributors in a single all-reduce.

    Contributors have a scope. ``"epoch"`` ones (metrics, the epoch's loss) are reduced
    once per epoch, at the sync point that opens ``EPOCH_COMPLETED``. ``"every"`` ones
    (stop requests, the non-finite guard, time limits) ride in every sync point: at the
    epoch's end, after the ``EPOCH_COMPLETED`` handlers, and every ``sync_every``
    iterations. However many there are, a sync point is one collective.

    Distributed:
        Calling it is a collective: every rank must have registered the same contributors,
        in the same order (which holds when every rank attaches every handler).
    """

    def __init__(self) -> None:
        self._contributors: list[tuple[SyncContributor, Scope]] = []
        self.count = 0
        """How many collectives this sync point has issued."""

    def register(self, contributor: SyncContributor, scope: Scope = "epoch") -> None:
        """Adds a contributor; registering the same one twice has no effect."""
        if not isinstance(contributor, SyncContributor):
            raise TypeError(
                f"{type(contributor).__name__} cannot join a sync point: it needs sync_state() and "
                "load_synced_state(state) methods."
            )
        if scope not in ("epoch", "every"):
            raise ValueError(f"SyncPoint.register(scope={scope!r}) must be 'epoch' or 'every'.")
        if not any(c is contributor for c, _ in self._contributors):
            self._contributors.append((contributor, scope))

    def unregister(self, contributor: SyncContributor) -> None:
        """Removes a contributor, if registered."""
        self._contributors = [(c, s) for c, s in self._contributors if c is not contributor]

    def contributors(self, epoch_end: bool = True) -> list[SyncContributor]:
        """The contributors a sync point reduces: all at an epoch's end, else the ``"every"`` ones."""
        return [c for c, scope in self._contributors if epoch_end or scope == "every"]

    def __call__(self, epoch_end: bool = True) -> None:
        """Collective: call on every rank. Reduces the contributions and hands back the sums."""
        active = self.contributors(epoch_end)
        if not active:
            return
        self.count += 1
        states = [c.sync_state() for c in active]
        for contributor, state in zip(active, all_reduce_sum(states), strict=True):
            contributor.load_synced_state(state)


@runtime_checkable
class SyncEngine(Protocol):
    """What a handler or metric needs of an engine to take part in agreement.

    unison's :class:`~unison.engine.Engine` is one. ``stop_agreed`` is for decisions
    every rank takes alike from the sums a sync point handed back.
    """

    sync_point: SyncPoint

    def stop_agreed(self, reason: str) -> None: ...

    def at_boundary(self) -> bool: ...


def require_sync_point(engine: object, who: str, hint: str = "") -> SyncEngine:
    """``engine`` if it owns a sync point (a unison Engine); else a TypeError naming ``who``.

    The one check every handler and metric that joins a sync point makes, so they all fail
    alike, at attach time, with the fix.
    """
    if not isinstance(getattr(engine, "sync_point", None), SyncPoint) or not isinstance(engine, SyncEngine):
        raise TypeError(
            f"{who} needs a unison Engine (unison.engine.Engine, or one built by create_trainer / "
            f"create_evaluator): it acts at sync points, where ranks agree. Got {type(engine).__name__}."
            f"{' ' + hint if hint else ''}"
        )
    return engine


def rank_row(*values: float) -> torch.Tensor:
    """``len(values)`` rows of ``world_size`` zeros, this rank's column holding ``values``.

    What a contributor returns from ``sync_state`` to tell every rank what each rank saw:
    after the sum, row ``i`` column ``r`` is rank ``r``'s ``values[i]`` (see :func:`split_rows`).

    Example:
        >>> rank_row(3.0, 1.0)  # one rank: two rows of one column
        tensor([3., 1.], dtype=torch.float64)
    """
    world = get_world_size()
    state = torch.zeros(len(values) * world, dtype=torch.float64)
    for i, value in enumerate(values):
        state[i * world + get_rank()] = float(value)
    return state


def split_rows(state: torch.Tensor, rows: int) -> list[list[float]]:
    """The rows of a reduced :func:`rank_row` state, as lists indexed by rank (one host read)."""
    return state.reshape(rows, get_world_size()).tolist()
