"""unison's Engine: ignite's Engine, with the distributed defaults every run needs."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from ignite.engine import Engine as IgniteEngine
from ignite.engine import Events, State
from torch.utils.data import DataLoader, RandomSampler

from unison.distributed.primitives import get_world_size
from unison.engine.sync import SyncPoint
from unison.handlers.sampler_epoch import SetSamplerEpoch


class Engine(IgniteEngine):
    """An ignite ``Engine`` that keeps every rank in step.

    It runs the same loop and fires the same events as ``ignite.engine.Engine``, so ignite's
    handlers and metrics attach to it unchanged. On top of that it:

    - calls ``set_epoch(epoch - 1)`` on the data's sampler at every ``EPOCH_STARTED``
      (ignite never does), before any handler of yours;
    - owns a :class:`~unison.engine.sync.SyncPoint` that runs first at every
      ``EPOCH_COMPLETED``: unison's metrics and the epoch's loss are reduced across ranks
      there, in one collective, so later handlers see agreed values;
    - runs the events of an epoch on a rank whose data shard is empty (an evaluation shard
      of 2 samples on 3 ranks), where ignite raises, so that rank still joins the sync;
    - refuses, with more than one rank, a DataLoader whose ``RandomSampler`` would make each
      rank draw its own permutation of the whole dataset.

    The loop, as pseudocode (``*`` marks what unison adds)::

        fire STARTED
        while epoch < max_epochs and not terminated:
            epoch += 1
            * sampler.set_epoch(epoch - 1)
            fire EPOCH_STARTED
            for batch in data:                      # GET_BATCH_STARTED / _COMPLETED around next()
                iteration += 1
                fire ITERATION_STARTED
                output = process_function(engine, batch)
                fire ITERATION_COMPLETED
            * sync point: one all-reduce of every registered contributor
            fire EPOCH_COMPLETED
        fire COMPLETED

    Args:
        process_function: ``fn(engine, batch) -> output``, as in ignite.

    Example:
        >>> from unison.engine import Engine, Events
        >>> engine = Engine(lambda engine, batch: batch * 2)
        >>> state = engine.run([1, 2, 3], max_epochs=2)
        >>> state.iteration, state.output
        (6, 6)

    Distributed:
        Build the same engine, with the same handlers, on every rank.
    """

    def __init__(self, process_function: Callable[[IgniteEngine, Any], Any]) -> None:
        super().__init__(process_function)
        self.sync_point = SyncPoint()
        SetSamplerEpoch().attach(self)
        self.add_event_handler(Events.EPOCH_COMPLETED, self._run_sync_point)

    def _run_sync_point(self, _: IgniteEngine) -> None:
        self.sync_point()

    def run(
        self,
        data: Iterable | None = None,
        max_epochs: int | None = None,
        max_iters: int | None = None,
        epoch_length: int | None = None,
    ) -> State:
        """Runs ``process_function`` over ``data``; see ``ignite.engine.Engine.run``.

        Raises:
            ValueError: with more than one rank, when ``data`` is a DataLoader drawing from
                a ``RandomSampler``.
        """
        if data is not None:
            _check_sharded(data)
            if epoch_length is None and _is_empty(data) and max_iters is None:
                return self._run_empty(data, max_epochs)
        return super().run(data, max_epochs=max_epochs, max_iters=max_iters, epoch_length=epoch_length)

    def _run_empty(self, data: Iterable, max_epochs: int | None) -> State:
        """Fires an epoch's events without iterations, for a rank that holds no samples."""
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"Argument max_epochs should be greater than or equal to 1, got {max_epochs}.")
        self.state = State()
        self.state.dataloader = data
        self.state.max_epochs = max_epochs or 1
        self.state.epoch_length = 0
        self.should_terminate = self.should_terminate_single_epoch = self.should_interrupt = False
        self._init_timers(self.state)
        try:
            self._fire_event(Events.STARTED)
            while self.state.epoch < self.state.max_epochs and not self.should_terminate:
                self.state.epoch += 1
                self._fire_event(Events.EPOCH_STARTED)
                self._fire_event(Events.EPOCH_COMPLETED)
            self._fire_event(Events.COMPLETED)
        except BaseException as err:
            self._handle_exception(err)
        return self.state


def _is_empty(data: Iterable) -> bool:
    try:
        return len(data) == 0  # type: ignore[arg-type]
    except TypeError:
        return False


def _check_sharded(data: Iterable) -> None:
    if not isinstance(data, DataLoader) or get_world_size() == 1:
        return
    if isinstance(data.sampler, RandomSampler) and data.batch_sampler is not None:
        raise ValueError(
            f"The DataLoader given to Engine.run uses a RandomSampler while {get_world_size()} ranks run: "
            "each rank would shuffle the whole dataset on its own, so ranks would train on overlapping "
            "samples. Build the loader with unison.distributed.prepare_loaders(...), or pass "
            "sampler=unison.distributed.TrainSampler(dataset) instead of shuffle=True."
        )
