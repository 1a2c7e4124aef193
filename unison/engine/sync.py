"""Sync points: where per-rank state is reduced across ranks, in one collective."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from unison.distributed.primitives import all_reduce_sum


@runtime_checkable
class SyncContributor(Protocol):
    """Something that adds a vector of sums to a sync point and reads back the total.

    ``sync_state`` must return a 1-D tensor of the same length on every rank (zeros for a
    rank that has nothing to add); ``load_synced_state`` receives the sum over all ranks,
    as float64 on the CPU.
    """

    def sync_state(self) -> torch.Tensor: ...

    def load_synced_state(self, state: torch.Tensor) -> None: ...


class SyncPoint:
    """Reduces the state of every registered contributor in a single all-reduce.

    An engine owns one and calls it at the end of every epoch, before any other
    ``EPOCH_COMPLETED`` handler, so those handlers see values agreed by all ranks. Metrics
    and the epoch's training loss ride in the same collective, however many there are.

    Distributed:
        Calling it is a collective: every rank must have registered the same contributors,
        in the same order (which holds when every rank attaches every handler).
    """

    def __init__(self) -> None:
        self._contributors: list[SyncContributor] = []
        self.count = 0
        """How many times this sync point has run."""

    def register(self, contributor: SyncContributor) -> None:
        """Adds a contributor; registering the same one twice has no effect."""
        if not isinstance(contributor, SyncContributor):
            raise TypeError(
                f"{type(contributor).__name__} cannot join a sync point: it needs sync_state() and "
                "load_synced_state(state) methods."
            )
        if not any(c is contributor for c in self._contributors):
            self._contributors.append(contributor)

    def unregister(self, contributor: SyncContributor) -> None:
        """Removes a contributor, if registered."""
        self._contributors = [c for c in self._contributors if c is not contributor]

    @property
    def contributors(self) -> tuple[SyncContributor, ...]:
        return tuple(self._contributors)

    def __call__(self) -> None:
        """Collective: call on every rank. Reduces all contributions and hands back the sums."""
        self.count += 1
        if not self._contributors:
            return
        states = [c.sync_state() for c in self._contributors]
        for contributor, state in zip(self._contributors, all_reduce_sum(states)):
            contributor.load_synced_state(state)
