"""Calls ``set_epoch`` on the training data's sampler at every epoch start."""

from __future__ import annotations

from typing import Any

from ignite.engine import Engine, Events


def samplers_with_set_epoch(data: Any) -> list[Any]:
    """The distinct objects behind ``data`` that have a ``set_epoch`` method.

    Looks at a DataLoader's batch sampler, the sampler inside that batch sampler, and its
    sampler, in that order; a custom batch sampler that shuffles (bucketing, say) is found
    as well as the usual ``DataLoader(sampler=...)``.
    """
    found: list[Any] = []
    batch_sampler = getattr(data, "batch_sampler", None)
    for candidate in (batch_sampler, getattr(batch_sampler, "sampler", None), getattr(data, "sampler", None)):
        if candidate is not None and callable(getattr(candidate, "set_epoch", None)):
            if not any(candidate is f for f in found):
                found.append(candidate)
    return found


class SetSamplerEpoch:
    """At every ``EPOCH_STARTED``, calls ``set_epoch(epoch - 1)`` on the data's sampler.

    Without it a ``DistributedSampler`` yields the same order every epoch. The sampler's
    epoch is 0-based, the engine's 1-based; after a state is loaded, the first epoch run
    gets the right number too. unison's :class:`~unison.engine.Engine` attaches one in its
    constructor, so it runs before any handler of yours.

    Distributed:
        Every rank calls it with the same epoch; it is no collective.
    """

    def __call__(self, engine: Engine) -> None:
        for sampler in samplers_with_set_epoch(engine.state.dataloader):
            sampler.set_epoch(engine.state.epoch - 1)

    def attach(self, engine: Engine) -> None:
        if not engine.has_event_handler(self, Events.EPOCH_STARTED):
            engine.add_event_handler(Events.EPOCH_STARTED, self)
