"""unison's Engine: ignite's Engine, with every control decision agreed by all ranks.

Compatibility note. ignite has no public hook for what the Engine adds, so it touches
these members of ignite 0.5's ``Engine`` (pinned ``>=0.5.5,<0.6`` in pyproject.toml):

- overrides ``_fire_event`` (no debug f-string per event, the failing handler named in
  errors, ``set_epoch`` before any ``EPOCH_STARTED`` handler, sync points after the last
  handler of an event) and reads ``_event_handlers`` there, holding the lists of the four
  per-iteration events (ignite appends to them in place; ``remove_event_handler``, which
  replaces one, is overridden to pick the new list up);
- overrides ``_handle_exception`` (the rank and iteration of a failure, failure callbacks)
  and clears ``_internal_run_generator`` there, so that a failed engine can run again;
- calls ``_init_timers`` when it runs the epoch events of a rank with no data;
- sets ``_init_iter`` (the position ignite's epoch loop starts from) when a state loaded
  from a checkpoint says where the epoch stood, and calls ``_setup_dataloader_iter`` at the
  epoch after a ``terminate_epoch()``, so the new iterator is made after ``set_epoch``;
- reads ``_process_function`` (exposed as the public :attr:`Engine.process_function`);
- overrides the public ``terminate``, ``terminate_epoch`` and ``interrupt`` (agreed, in
  ``engine/control.py``), which calls ignite's own versions to apply a decision.

``tests/engine/test_engine.py`` checks the event sequence against ignite's own Engine, so
an upstream change breaks a test rather than a run.
"""
from __future__ import annotations

import logging
import os
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ignite.engine import Engine as IgniteEngine
from ignite.engine import Events, State

from unison.distributed.primitives import get_rank, get_world_size, is_distributed
from unison.distributed.samplers import set_sampler_epoch
from unison.distributed.sync import SyncPoint
from unison.engine.checks import check_sharded, handler_name, is_empty, run_after, run_empty
from unison.engine.control import StopControl
from unison.engine.events import UPDATE_ATTR, UpdateEvents
from unison.engine.lockstep import agree_on_layout, check_lockstep, requests_settle_here
from unison.engine.position import (
    EpochTracker,
    partial_contributors,
    partial_sums,
    restore_partials,
    run_complete,
)
from unison.engine.stopping import AgreedStops
from unison.utils.errors import add_note, has_note
from unison.utils.logging import get_logger

_log = get_logger(__name__)

DEFAULT_SYNC_EVERY = 100
"""Iterations between two sync points inside an epoch (see ``benchmarks/``: under 1% of a step)."""

_STATE_KEY = "unison"


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
        if sync_every is not None and (
            isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1
        ):
            raise ValueError(
                f"Engine(sync_every={sync_every!r}) must be a positive int (iterations between sync points) "
                "or None (sync at epoch ends only)."
            )
        self.name = name
        # ignite's loop logs each run's start and end at INFO and repeats every exception
        # at ERROR before it propagates; unison's exceptions carry their context in notes.
        # ``logging.getLogger("unison.ignite").setLevel(logging.INFO)`` shows them again.
        self.logger = logging.getLogger(f"unison.ignite.{name}")
        if logging.getLogger("unison.ignite").level == logging.NOTSET:
            logging.getLogger("unison.ignite").setLevel(logging.CRITICAL)
        self.sync_every = sync_every
        self.debug = os.environ.get("UNISON_DEBUG", "0") not in ("", "0") if debug is None else bool(debug)
        self.sync_point = SyncPoint()
        self._control = StopControl(name)
        self._waiting_boundary = False
        self._in_sync = False
        self._iteration_syncs = False
        self._sync_due = False
        self._control_contributors = True
        self.epoch_length_given = False
        """Whether the last ``run`` was given ``epoch_length`` (else the data's length decides)."""
        self._epoch = EpochTracker()
        self._after_iteration: list[Callable[[Engine], None]] = []
        self._log_debug = False
        self._hot: tuple[list, ...] = ()
        self._refresh_hot()
        self._after_epoch: list[Callable[[Engine], None]] = []
        self._failure_callbacks: list[Callable[[], None]] = []
        self.sync_point.register(self._control, scope="every")
        self._loaded = False
        self.register_events(*UpdateEvents, event_to_attr={UpdateEvents.UPDATE_COMPLETED: UPDATE_ATTR})
        self.add_event_handler(Events.STARTED, self._on_started)
        self.add_event_handler(Events.EPOCH_COMPLETED, self._sync_epoch)

    @property
    def process_function(self) -> Callable[[IgniteEngine, Any], Any]:
        """The function run on every batch (a trainer's :class:`~unison.engine.TrainStep`)."""
        return self._process_function

    # -- sync points ------------------------------------------------------------------

    _HOT = (Events.ITERATION_STARTED, Events.ITERATION_COMPLETED, Events.GET_BATCH_STARTED, Events.GET_BATCH_COMPLETED)

    def _refresh_hot(self) -> None:
        self._hot = tuple(self._event_handlers[event] for event in self._HOT)

    def remove_event_handler(self, handler: Callable, event_name: Any) -> None:
        super().remove_event_handler(handler, event_name)
        self._refresh_hot()  # ignite replaces the list it removed from

    def _on_started(self, _: IgniteEngine) -> None:
        self._log_debug = self.logger.isEnabledFor(logging.DEBUG)
        self._refresh_hot()
        if not self._loaded:  # a state loaded from a checkpoint keeps its pending requests
            self._control.clear()
        self._loaded = False
        self._control.agreed.clear()
        self._sync_due = False
        self._waiting_boundary = False
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

    def _sync_epoch(self, _: IgniteEngine) -> None:
        self._sync(epoch_end=True)

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

    def _is_last_epoch(self) -> bool:
        state = self.state
        if state.max_epochs is not None and state.epoch >= state.max_epochs:
            return True
        if state.max_iters is not None and state.iteration >= state.max_iters:
            return True
        return False

    # -- the event loop -----------------------------------------------------------------

    def _fire_event(self, event_name: Any, *event_args: Any, **event_kwargs: Any) -> None:
        # ignite's contract; handlers named in errors, sync points after an event's handlers.
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
        else:
            handlers = self._event_handlers[event_name]
            if event_name is Events.EPOCH_STARTED:
                fresh = self._epoch.start_epoch()
                # Engine behaviour, before any handler: without it every epoch repeats one order.
                set_sampler_epoch(self.state.dataloader, self.state.epoch - 1)
                if fresh:
                    # ignite remade the data iterator when terminate_epoch() cut the last epoch,
                    # before this set_epoch: loader workers had already drawn the old order.
                    self._setup_dataloader_iter()
            elif event_name is Events.EPOCH_COMPLETED:
                self._epoch.done = True
            elif event_name is Events.TERMINATE_SINGLE_EPOCH:
                self._epoch.done = self._epoch.fresh_iterator = True
        for func, args, kwargs in handlers:
            kwargs.update(event_kwargs)
            if args and isinstance(args[0], weakref.ref):
                engine = args[0]()
                if engine is None:
                    raise RuntimeError("Engine reference not resolved. Cannot execute event handler.")
                first: tuple[Any, ...] = (engine,)
                others = args[1:]
            else:
                first, others = (), args
            try:
                func(*first, *(event_args + others), **kwargs)
            except Exception as err:
                if event_name is not Events.EXCEPTION_RAISED:  # a re-raise is not a new failure
                    add_note(err, f"raised by handler {handler_name(func)} at {self._where(event_name)}")
                raise
        if event_name is Events.ITERATION_COMPLETED:
            if self._waiting_boundary and self.at_boundary():
                self._waiting_boundary = False
                self._control.apply(self)
            if self._iteration_syncs:
                if self.state.iteration % self.sync_every == 0:  # type: ignore[operator]  # _iteration_syncs implies an int
                    self._sync_due = True
                if self._sync_due and not self._epoch_ends_here() and self.at_boundary():
                    self._sync(epoch_end=False)
            if self._after_iteration:
                run_after(self, self._after_iteration, event_name)
        elif event_name is Events.EPOCH_STARTED and self._epoch.pending_partials is not None:
            pending, self._epoch.pending_partials = self._epoch.pending_partials, None
            # After the handlers, which reset the epoch's sums.
            restore_partials(partial_contributors(self.sync_point), pending, get_rank() == 0)
        elif event_name is Events.EPOCH_COMPLETED:
            if self._control_contributors and not self._is_last_epoch() and not self.should_terminate:
                self._sync(epoch_end=False)
            run_after(self, self._after_epoch, event_name)

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

    def add_failure_callback(self, callback: Callable[[], None]) -> None:
        """Calls ``callback()`` when a run fails, before the exception propagates: for handlers
        that own a resource (a thread, a file). Unlike ``EXCEPTION_RAISED``, it cannot swallow it."""
        if callback not in self._failure_callbacks:
            self._failure_callbacks.append(callback)

    def _handle_exception(self, e: BaseException) -> None:
        for callback in self._failure_callbacks:
            callback()
        # ignite keeps the dead run generator, and the next run() would return None
        # without running; a failed run must leave the engine ready to run again.
        self._internal_run_generator = None
        if isinstance(e, Exception) and not has_note(e):
            if self.last_event_name is Events.GET_BATCH_STARTED:
                add_note(
                    e,
                    f"raised while fetching the batch of iteration {self.state.iteration + 1} from the data, at "
                    f"{self._where('GET_BATCH_STARTED')}",
                )
            elif self.last_event_name is Events.ITERATION_STARTED:
                add_note(e, f"raised by the process function (the step) at {self._where('ITERATION')}")
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
            ValueError: with more than one rank, when ``data`` is a DataLoader drawing from
                a ``RandomSampler``.
        """
        self.epoch_length_given = epoch_length is not None
        if self._loaded and self.is_complete(max_epochs, max_iters):
            _log.info(
                "%s: the state loaded from the checkpoint is already complete (epoch %s, iteration %s); nothing "
                "to run. Give a larger max_epochs (or max_iters) to train further.",
                self.name,
                self.state.epoch,
                self.state.iteration,
            )
            return self.state
        if data is not None:
            check_sharded(data)
            if epoch_length is None and is_empty(data) and max_iters is None:
                return run_empty(self, data, max_epochs)
        return super().run(data, max_epochs=max_epochs, max_iters=max_iters, epoch_length=epoch_length)

    def is_complete(self, max_epochs: int | None = None, max_iters: int | None = None) -> bool:
        """Whether the state has reached the run's end (see :func:`unison.engine.position.run_complete`)."""
        return run_complete(self.state, self.epoch_position, max_epochs, max_iters)

    # -- state --------------------------------------------------------------------------

    def state_dict(self) -> OrderedDict:
        """ignite's engine state, plus the update count, the sync count and this rank's stop
        requests that no sync point will have settled before the next iteration."""
        state = super().state_dict()
        stop = StopControl(self.name) if requests_settle_here(self) else self._control
        state[_STATE_KEY] = {
            "stop": stop.state_dict(),
            "syncs": self.sync_point.count,
            UPDATE_ATTR: int(getattr(self.state, UPDATE_ATTR, 0)),
            "position": list(self.epoch_position),
        }
        return state

    def load_state_dict(self, state_dict: Mapping) -> None:
        ours = state_dict.get(_STATE_KEY)
        super().load_state_dict({k: v for k, v in state_dict.items() if k != _STATE_KEY})
        if ours is not None:
            by_rank = ours.get("stop_by_rank")  # a checkpoint holds every rank's own requests
            if by_rank is not None:
                self._control.load_state_dict(by_rank[get_rank()] if get_rank() < len(by_rank) else {})
            else:
                self._control.load_state_dict(ours.get("stop", {}))
            self.sync_point.count = int(ours.get("syncs", 0))
            setattr(self.state, UPDATE_ATTR, int(ours.get(UPDATE_ATTR, 0)))
            self._epoch.load(ours, self.state)
        else:
            self._control.clear()
        self._loaded = True
