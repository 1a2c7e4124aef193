"""unison's Engine: ignite's Engine, with every control decision agreed by all ranks.

Compatibility note. ignite has no public hook for what the Engine adds, so it touches
these members of ignite 0.5's ``Engine`` (pinned ``>=0.5.5,<0.6`` in pyproject.toml):

- owns the epoch loop, ``_run_once_on_dataset_as_gen`` (``engine/loop.py``: ignite's events
  and exceptions, at two Python calls per iteration), which reads ``_init_iter``,
  ``_dataloader_iter``, ``_setup_dataloader_iter``, ``_maybe_terminate_or_interrupt`` and
  ``_is_done`` as ignite's own loop does;
- overrides ``_fire_event`` (no debug f-string per event, the failing handler named in
  errors, ``set_epoch`` before any ``EPOCH_STARTED`` handler, the engine's own work at
  ``STARTED`` and ``EPOCH_COMPLETED`` kept out of the handler registry, sync points after the
  last handler of an event) and reads ``_event_handlers``, holding the lists of the
  per-iteration events (ignite appends to them in place; ``remove_event_handler``, which
  replaces one, is overridden to pick the new list up);
- overrides ``_handler_wrapper``, so that ignite's ``every``/``once``/``before``/``after``
  filters cost one call where they do not fire (``engine/filters.py``);
- overrides ``_handle_exception`` (the rank and iteration of a failure, the close callbacks:
  ``engine/closing.py``) and clears ``_internal_run_generator``, so a failed engine can run again;
- calls ``_init_timers`` when it runs the epoch events of a rank with no data, and sets
  ``_init_iter`` where a loaded state says where the epoch stood;
- reads ``_process_function`` (exposed as the public :attr:`Engine.process_function`);
- overrides the public ``terminate``, ``terminate_epoch`` and ``interrupt`` (agreed, in
  ``engine/control.py``), which calls ignite's own versions to apply a decision.

ignite's own tests of the Engine run against this class (``tests/ignite_suite``).
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ignite.engine import Engine as IgniteEngine
from ignite.engine import Events, State

from unison.distributed.primitives import get_rank, get_world_size, is_distributed
from unison.distributed.samplers import set_sampler_epoch
from unison.distributed.sync import SyncPoint
from unison.engine.checks import check_sharded, check_sync_every, is_empty, note_failure, run_after, run_empty
from unison.engine.closing import CloseCallback, RunClose
from unison.engine.control import StopControl
from unison.engine.empty_epochs import EmptyEpochs
from unison.engine.events import UPDATE_ATTR, UpdateEvents
from unison.engine.filters import filtered_handler
from unison.engine.lockstep import agree_on_layout, check_lockstep
from unison.engine.loop import call_handlers, run_epoch_as_gen
from unison.engine.position import (
    EpochTracker,
    is_last_epoch,
    partial_contributors,
    partial_sums,
    restore_partials,
    run_complete,
)
from unison.engine.saved import STATE_KEY, extra_state, ignite_keys, load_extra_state, says_more
from unison.engine.stopping import AgreedStops
from unison.utils.logging import get_logger, ignite_logger

_log = get_logger(__name__)

DEFAULT_SYNC_EVERY = 100
"""Iterations between two sync points inside an epoch (see ``benchmarks/``: under 1% of a step)."""


class Engine(AgreedStops):
    """An ignite ``Engine`` that keeps every rank in step.

    It runs ignite's loop and fires ignite's events, so ignite's handlers and metrics
    attach to it unchanged; at world size 1 it behaves as ignite's Engine, event for event.
    On top of that:

    - **set_epoch** on the data's sampler at every ``EPOCH_STARTED``, before your handlers.
    - **Sync points** at every epoch's end and every ``sync_every`` iterations: one small
      all-reduce carries all ranks must agree on; nothing else in the loop is a collective.
    - **Agreed stopping**: :meth:`terminate`, :meth:`terminate_epoch`, :meth:`interrupt` and
      :meth:`request_stop` from any subset of ranks stop every rank after one iteration.
    - **Uneven data**: a rank with an empty evaluation shard still joins the sync; a
      ``RandomSampler`` loader is refused with several ranks.
    - **Errors** in a handler or the step name the handler, event, iteration and rank.

    The loop, as pseudocode, is in docs/concepts.md ("The loop").

    Args:
        process_function: ``fn(engine, batch) -> output``, as in ignite.
        sync_every: iterations between sync points inside an epoch; None for epoch ends
            only. Needs the same epoch length on every rank: when ranks report different
            lengths at the start of a run (an unpadded evaluation), the run keeps to epoch
            ends.
        name: used in logs and error notes (``"trainer"``, ``"evaluator"``).
        debug: at every sync point, also check that all ranks are at the same event and
            iteration with the same handlers, and say which rank went its own way. One
            extra collective per sync point. Default: the ``UNISON_DEBUG`` variable.

    Example:
        >>> from unison.engine import Engine, Events
        >>> engine = Engine(lambda engine, batch: batch * 2)
        >>> state = engine.run([1, 2, 3], max_epochs=2)
        >>> state.iteration, state.output
        (6, 6)

    Distributed:
        Build the same engine, with the same handlers, on every rank.
    """

    def __init__(
        self,
        process_function: Callable[[IgniteEngine, Any], Any],
        *,
        sync_every: int | None = DEFAULT_SYNC_EVERY,
        name: str = "engine",
        debug: bool | None = None,
    ) -> None:
        super().__init__(process_function)
        self.name = name
        self.logger = ignite_logger(name)
        self.sync_every = check_sync_every(sync_every)
        self.debug = os.environ.get("UNISON_DEBUG", "0") not in ("", "0") if debug is None else bool(debug)
        self.sync_point = SyncPoint()
        self._control = StopControl(name)
        self._waiting_boundary = self._in_sync = self._iteration_syncs = self._sync_due = False
        self._control_contributors = True
        self.epoch_length_given = False
        """Whether the last ``run`` was given ``epoch_length`` (else the data's length decides)."""
        self._epoch = EpochTracker()
        self._after_iteration: list[Callable[[Engine], None]] = []
        self._log_debug = self._slow_events = False
        self._hot: tuple[list, ...] = ()
        self._refresh_hot()
        self._after_epoch: list[Callable[[Engine], None]] = []
        self._closing = RunClose(name)
        self.sync_point.register(self._control, scope="every")
        self.sync_point.register(EmptyEpochs(self))  # an epoch no rank got a batch of fails on all
        self._loaded = False
        self.register_events(*UpdateEvents, event_to_attr={UpdateEvents.UPDATE_COMPLETED: UPDATE_ATTR})

    @property
    def process_function(self) -> Callable[[IgniteEngine, Any], Any]:
        """The function run on every batch (a trainer's :class:`~unison.engine.TrainStep`)."""
        return self._process_function

    # -- sync points ------------------------------------------------------------------

    _HOT = (
        Events.ITERATION_STARTED,
        Events.ITERATION_COMPLETED,
        Events.GET_BATCH_STARTED,
        Events.GET_BATCH_COMPLETED,
        UpdateEvents.UPDATE_COMPLETED,
    )

    def _refresh_hot(self) -> None:
        self._hot = tuple(self._event_handlers[event] for event in self._HOT)

    def remove_event_handler(self, handler: Callable, event_name: Any) -> None:
        super().remove_event_handler(handler, event_name)
        self._refresh_hot()  # ignite replaces the list it removed from

    def _on_started(self) -> None:
        self._log_debug = self.logger.isEnabledFor(logging.DEBUG)
        self._closing.start()  # the run's end is said once, however it ends
        # The epoch loop fires per-iteration events inline unless this must see each (loop.py).
        self._slow_events = (
            self._log_debug or type(self)._fire_event is not Engine._fire_event or "_fire_event" in vars(self)
        )
        self._refresh_hot()
        if not self._loaded:  # a state loaded from a checkpoint keeps its pending requests
            self._control.clear()
        self._loaded = False
        self._control.agreed.clear()
        self._sync_due = self._waiting_boundary = False
        if self.state.iteration == 0:
            setattr(self.state, UPDATE_ATTR, 0)  # a fresh run (ignite keeps custom counters)
        loaded = self._epoch.start_run(self.state)
        if loaded is not None:
            # The saved position, not iteration % epoch_length: an epoch cut short by
            # terminate_epoch() leaves the counters out of step with the epochs.
            self._init_iter = loaded
        # With one rank a stop request acts at once; sync points inside an epoch (and after
        # its handlers) only serve the other contributors (guards, time limits, votes).
        self._control_contributors = is_distributed() or any(
            c is not self._control for c in self.sync_point.contributors(epoch_end=False)
        )
        self._iteration_syncs = (
            self.sync_every is not None and self._control_contributors and agree_on_layout(self)
        )

    def _sync(self, epoch_end: bool) -> None:
        """Collective: every rank runs it at the same event and iteration."""
        self._sync_due = False
        if self.debug and is_distributed():
            check_lockstep(self, epoch_end)
        self._in_sync = True
        try:
            self.sync_point(epoch_end=epoch_end)
        finally:
            self._in_sync = False
        self._control.apply(self)

    # -- the event loop -----------------------------------------------------------------

    def _fire_event(self, event_name: Any, *event_args: Any, **event_kwargs: Any) -> None:
        # ignite's contract; handlers named in errors, sync points after an event's handlers.
        # The epoch loop (engine/loop.py) calls it only for events with handlers.
        if self._log_debug:  # read once per run: a call per event is a quarter of ignite's overhead
            self.logger.debug(f"{self.state.epoch} | {self.state.iteration}, Firing handlers for event {event_name}")
        self.last_event_name = event_name
        hot = self._hot  # per-iteration events: handlers found by identity, not by hashing the enum
        if event_name is Events.ITERATION_STARTED:
            self._epoch.iteration += 1
            handlers = hot[0]
        elif event_name is Events.ITERATION_COMPLETED:
            handlers = hot[1]
        elif event_name is Events.GET_BATCH_STARTED:
            handlers = hot[2]
        elif event_name is Events.GET_BATCH_COMPLETED:
            handlers = hot[3]
        elif event_name is UpdateEvents.UPDATE_COMPLETED:
            handlers = hot[4]
        else:
            handlers = self._event_handlers[event_name]
            # The engine's own work at these events comes before any handler and is not one:
            # the handler registry holds the user's handlers only, as in ignite.
            if event_name is Events.STARTED:
                self._on_started()
            elif event_name is Events.EPOCH_STARTED:
                fresh = self._epoch.start_epoch()
                # Engine behaviour, before any handler: without it every epoch repeats one order.
                set_sampler_epoch(self.state.dataloader, self.state.epoch - 1)
                if fresh:
                    # ignite remade the data iterator when terminate_epoch() cut the last epoch,
                    # before this set_epoch: loader workers had already drawn the old order.
                    self._setup_dataloader_iter()
            elif event_name is Events.EPOCH_COMPLETED:
                self._epoch.done = True
                self._sync(epoch_end=True)  # handlers see the epoch's values agreed by all ranks
            elif event_name is Events.TERMINATE_SINGLE_EPOCH:
                self._epoch.done = self._epoch.fresh_iterator = True
        if handlers:
            call_handlers(self, handlers, event_name, event_args, event_kwargs)
        if event_name is Events.ITERATION_COMPLETED:
            if self._waiting_boundary or self._iteration_syncs or self._after_iteration:
                self._iteration_tail()
        elif event_name is Events.EPOCH_STARTED and self._epoch.pending_partials is not None:
            pending, self._epoch.pending_partials = self._epoch.pending_partials, None
            # After the handlers, which reset the epoch's sums.
            restore_partials(partial_contributors(self.sync_point), pending, get_rank() == 0)
        elif event_name is Events.EPOCH_COMPLETED:
            if self._control_contributors and not is_last_epoch(self.state) and not self.should_terminate:
                self._sync(epoch_end=False)
            self._epoch.end_epoch(self.state)
            run_after(self, self._after_epoch, event_name)
        elif event_name is Events.COMPLETED or event_name is Events.TERMINATE:
            self._closing.at_end(event_name, self.should_terminate, self._where(event_name))

    def _iteration_tail(self) -> None:
        """After ``ITERATION_COMPLETED``'s handlers: a stop waiting for the end of an accumulation
        window, the sync point inside the epoch, the after-iteration callbacks."""
        if self._waiting_boundary and self.at_boundary():
            self._waiting_boundary = False
            self._control.apply(self)
        if self._iteration_syncs:
            if self.state.iteration % self.sync_every == 0:  # type: ignore[operator]  # _iteration_syncs implies an int
                self._sync_due = True
            if self._sync_due and not self._epoch_ends_here() and self.at_boundary():
                self._sync(epoch_end=False)
        if self._after_iteration:
            run_after(self, self._after_iteration, Events.ITERATION_COMPLETED)

    _run_once_on_dataset_as_gen = run_epoch_as_gen  # ignite's epoch loop, owned: see engine/loop.py

    def _handler_wrapper(self, handler: Callable, event_name: Any, event_filter: Callable) -> Callable:
        # ignite's filters (every, once, before, after) cost one call where they do not fire.
        return filtered_handler(self, handler, event_name, event_filter) or super()._handler_wrapper(
            handler, event_name, event_filter
        )

    def update_completed(self) -> None:
        """Counts an optimizer update in ``state.update`` and fires ``UPDATE_COMPLETED``: what a
        trainer's step (:class:`~unison.engine.TrainStep`) calls after ``optimizer.step()``."""
        self.state.update += 1  # type: ignore[attr-defined]  # UPDATE_ATTR, set at STARTED
        if self._slow_events:
            self._fire_event(UpdateEvents.UPDATE_COMPLETED)
        else:  # what _fire_event does for it, inline (a call per update saved, see loop.py)
            self.last_event_name = UpdateEvents.UPDATE_COMPLETED  # type: ignore[assignment]  # as ignite sets it
            if self._hot[4]:
                call_handlers(self, self._hot[4], UpdateEvents.UPDATE_COMPLETED, (), {})

    def after_iteration(self, callback: Callable[[Engine], None]) -> None:
        """Calls ``callback(engine)`` at the very end of every ``ITERATION_COMPLETED``: after all its
        handlers, whatever their attach order, and the sync point that follows them (a stop agreed
        there is applied). For work that must see the iteration whole, such as a mid-epoch
        checkpoint. Adding a callback twice has no effect; :meth:`after_epoch` is the same for epochs.
        """
        if callback not in self._after_iteration:
            self._after_iteration.append(callback)

    def after_epoch(self, callback: Callable[[Engine], None]) -> None:
        """Calls ``callback(engine)`` at the very end of every ``EPOCH_COMPLETED`` (see :meth:`after_iteration`):
        after every handler of the epoch, an evaluation attached after it included."""
        if callback not in self._after_epoch:
            self._after_epoch.append(callback)

    def partial_sums(self) -> list[list[float]] | None:
        """This rank's sums so far of the epoch's additive contributors (the epoch's mean loss),
        inside an epoch; None at an epoch boundary. See :func:`unison.engine.position.partial_sums`."""
        return partial_sums(self.sync_point, self.epoch_position)

    def reposition(self, into: int) -> None:
        """At ``STARTED`` of a resumed run, the first epoch starts ``into`` iterations in: for a
        checkpoint that refits the epoch to new data (``state`` holds epoch, iteration, length)."""
        self._init_iter = self._epoch.resume_offset = int(into)

    @property
    def epoch_position(self) -> tuple[int, int]:
        """``(epochs completed, iterations done of the next)``: where a resumed run continues.

        Unlike ``divmod(iteration, epoch_length)`` it is right after an epoch was cut short
        by ``terminate_epoch()`` (that epoch counts as completed) and after a mid-epoch resume.
        Checkpoints save it; ``(e, 0)`` is an epoch boundary.
        """
        # terminate_epoch() applied: the current epoch is over
        return self._epoch.position(self.state, cut=bool(self.should_terminate_single_epoch))

    @property
    def epoch_iteration(self) -> int:
        """The current iteration's 1-based position within its epoch (right after a
        ``terminate_epoch()`` and a mid-epoch resume, unlike ``iteration % epoch_length``)."""
        return self._epoch.iteration

    def _epoch_ends_here(self) -> bool:
        return self._epoch.ends_here(self.state)

    def _where(self, event_name: Any) -> str:
        event = getattr(event_name, "name", str(event_name))
        return (
            f"{self.name} {event}, epoch {self.state.epoch}, iteration {self.state.iteration}, "
            f"rank {get_rank()} of {get_world_size()}"
        )

    def add_close_callback(self, callback: CloseCallback) -> None:
        """Calls ``callback(how)`` once at the end of every run, with how it ended: ``"finished"``,
        ``"terminated"`` (no ``COMPLETED``) or ``"failed"``; see :mod:`unison.engine.closing`."""
        self._closing.add(callback)

    def add_failure_callback(self, callback: Callable[[], None]) -> None:
        """Calls ``callback()`` when a run fails: :meth:`add_close_callback`, ``"failed"`` only."""
        self._closing.add_on_failure(callback)

    def _handle_exception(self, e: BaseException) -> None:
        self._closing.close("failed", self._where(self.last_event_name))
        # ignite keeps the dead run generator, and the next run() would return None
        # without running; a failed run must leave the engine ready to run again.
        self._internal_run_generator = None
        note_failure(self, e)
        super()._handle_exception(e)

    # -- running ----------------------------------------------------------------------

    def run(
        self,
        data: Iterable | None = None,
        max_epochs: int | None = None,
        max_iters: int | None = None,
        epoch_length: int | None = None,
    ) -> State:
        """Runs ``process_function`` over ``data``; see ``ignite.engine.Engine.run``.

        Raises:
            ValueError: for data every rank or loader worker would read whole (``check_sharded``).
        """
        self.epoch_length_given = epoch_length is not None
        # A loaded state that is complete returns at once (ignite would start again from
        # scratch); a max_epochs below the loaded epoch goes on to ignite's own error.
        below = max_epochs is not None and max_epochs < self.state.epoch
        if self._loaded and not below and self.is_complete(max_epochs, max_iters):
            _log.info(
                "%s: the state loaded from the checkpoint is already complete (epoch %s, iteration %s); nothing "
                "to run. Give a larger max_epochs (or max_iters) to train further.",
                self.name, self.state.epoch, self.state.iteration,
            )  # fmt: skip
            return self.state
        if data is not None:
            check_sharded(data, trains=not getattr(self._process_function, "evaluates", False))
            if epoch_length is None and is_empty(data) and max_iters is None and is_distributed():
                return run_empty(self, data, max_epochs)  # a rank with an empty shard still joins the syncs
        return super().run(data, max_epochs=max_epochs, max_iters=max_iters, epoch_length=epoch_length)

    def is_complete(self, max_epochs: int | None = None, max_iters: int | None = None) -> bool:
        """Whether the state has reached the run's end (see :func:`unison.engine.position.run_complete`)."""
        return run_complete(self.state, self.epoch_position, max_epochs, max_iters)

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> OrderedDict:
        """ignite's engine state, key for key; plus a ``"unison"`` entry when there is something
        ignite's keys cannot say (stop requests, the update count, an epoch cut short): see
        :mod:`unison.engine.saved`."""
        state = super().state_dict()
        extra = extra_state(self)
        if says_more(extra, state):
            state[STATE_KEY] = extra
        return state

    def extra_state_dict(self) -> dict[str, Any]:
        """The ``"unison"`` entry of :meth:`state_dict`, even where ignite's keys imply it."""
        return extra_state(self)

    def load_state_dict(self, state_dict: Mapping) -> None:
        if not isinstance(state_dict, Mapping):
            raise TypeError(  # ignite's words first: code matching them keeps working
                f"Argument state_dict should be a dictionary, but given {type(state_dict)}: "
                "Engine.load_state_dict needs what Engine.state_dict() returns."
            )
        super().load_state_dict(ignite_keys(state_dict))  # a stream's first epoch too (no length yet)
        load_extra_state(self, state_dict.get(STATE_KEY), iteration=state_dict.get("iteration"))
        self._loaded = True
