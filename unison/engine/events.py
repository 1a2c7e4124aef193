"""Events unison's Engine adds to ignite's."""

from __future__ import annotations

from ignite.engine import EventEnum


class UpdateEvents(EventEnum):
    """Events of the optimizer, fired by a trainer from :func:`~unison.engine.create_trainer`.

    With gradient accumulation over ``k`` micro-batches an iteration is a micro-batch and
    an *update* is one optimizer step: ``UPDATE_COMPLETED`` fires once per update, right
    after ``optimizer.step()`` (and ``zero_grad``), inside the iteration that closes the
    accumulation window, before that iteration's ``ITERATION_COMPLETED``. Without
    accumulation it fires once per iteration. ``engine.state.update`` counts updates, and
    filters work on it as on any event: ``UPDATE_COMPLETED(every=100)``.

    Attach what belongs to the optimizer's clock here: an LR scheduler (which would
    otherwise step once per micro-batch), an EMA of the weights, logging of the learning
    rate.

    Example:
        >>> import torch
        >>> from unison.engine import UpdateEvents, create_trainer
        >>> model = torch.nn.Linear(2, 1)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> trainer = create_trainer(model, optimizer, torch.nn.functional.mse_loss, accumulation_steps=4)
        >>> updates = []
        >>> _ = trainer.add_event_handler(UpdateEvents.UPDATE_COMPLETED, lambda e: updates.append(e.state.iteration))
        >>> data = [(torch.ones(1, 2), torch.ones(1, 1))] * 8
        >>> trainer.run(data).update, updates
        (2, [4, 8])
    """

    UPDATE_COMPLETED = "update_completed"
    """After each optimizer step (once per accumulation window)."""


UPDATE_ATTR = "update"
"""The ``engine.state`` attribute counting optimizer updates."""
