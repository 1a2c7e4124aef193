"""The Engine's epoch loop: ignite 0.5's, event for event, at a few Python calls per iteration.

ignite's ``_run_once_on_dataset_as_gen`` spends 16 calls per iteration on itself: four calls
to ``_fire_event``, four ``_maybe_terminate_or_interrupt`` generators and six for comparing
the last event to ``DATALOADER_STOP_ITERATION`` through the event enum's Python ``__eq__``.
This loop runs the same events in the same order, with the same state updates and the same
exceptions, but it

- does for the four per-iteration events what ``Engine._fire_event`` does, inline: the event
  becomes ``last_event_name``, its handlers (if any) are called, the engine's bookkeeping is
  kept. ``_fire_event`` itself is called for them only with debug logging on or when a
  subclass overrides it (``Engine._slow_events``, decided at ``STARTED``);
- checks the stop flags inline and enters ignite's ``_maybe_terminate_or_interrupt`` only
  when one is set;
- compares events by identity.

What is left per iteration is ``next()`` on the data and the process function.
``tests/engine/test_call_budget.py`` counts it, and ignite's own engine tests run against it
(``tests/ignite_suite``).
"""

from __future__ import annotations

import math
import time
import warnings
import weakref
from collections.abc import Generator
from typing import Any

from ignite.engine import Events, State
from ignite.engine.engine import _EngineTerminateException, _EngineTerminateSingleEpochException

from unison.engine.checks import handler_name
from unison.engine.protocol import EngineParts
from unison.utils.exception_notes import add_note

_GET_BATCH_STARTED = Events.GET_BATCH_STARTED
_GET_BATCH_COMPLETED = Events.GET_BATCH_COMPLETED
_ITERATION_STARTED = Events.ITERATION_STARTED
_ITERATION_COMPLETED = Events.ITERATION_COMPLETED
_STOP_ITERATION = Events.DATALOADER_STOP_ITERATION


def call_handlers(engine: EngineParts, handlers: list, event_name: Any, event_args: tuple, event_kwargs: dict) -> None:
    """Calls an event's handlers as ignite does (a weak reference to the engine resolved as the
    first argument); an exception gets a note naming the handler and where it was raised.

    Builtins are kept out of the common path (a filtered handler that does not fire costs this
    call and its wrapper's): the reference is recognised by its exact type, as ignite makes it.
    """
    for func, args, kwargs in handlers:
        if event_kwargs:
            kwargs.update(event_kwargs)
        if args and args[0].__class__ is weakref.ref:
            target = args[0]()
            if target is None:
                raise RuntimeError("Engine reference not resolved. Cannot execute event handler.")
            first: tuple[Any, ...] = (target,)
            others = args[1:]
        else:
            first, others = (), args
        try:
            func(*first, *(event_args + others), **kwargs)
        except Exception as err:
            if event_name is not Events.EXCEPTION_RAISED:  # a re-raise is not a new failure
                add_note(err, f"raised by handler {handler_name(func)} at {engine._where(event_name)}")
            raise


def run_epoch_as_gen(engine: EngineParts) -> Generator[State, None, float]:
    """One epoch over the data: ignite's ``_run_once_on_dataset_as_gen`` (see the module's doc)."""
    start_time = time.time()
    # A resumed epoch starts from the saved position.
    iter_counter = 0 if engine._init_iter is None else engine._init_iter
    engine._init_iter = None
    should_exit = False
    state = engine.state
    epoch = engine._epoch
    try:
        if engine._dataloader_iter is None:
            raise RuntimeError(
                "Internal error, self._dataloader_iter is None. Please, file an issue if you encounter this error."
            )
        while True:
            state.batch = None
            try:
                # A restarted data iterator does not fire GET_BATCH_STARTED twice; without data
                # (run(data=None)) the GET_BATCH and DATALOADER_STOP_ITERATION events do not fire.
                if engine.last_event_name is not _STOP_ITERATION and state.dataloader is not None:
                    if engine._slow_events:
                        engine._fire_event(_GET_BATCH_STARTED)
                    else:
                        engine.last_event_name = _GET_BATCH_STARTED
                        if engine._hot[2]:
                            call_handlers(engine, engine._hot[2], _GET_BATCH_STARTED, (), {})
                    if engine.should_terminate or engine.should_terminate_single_epoch or engine.should_interrupt:
                        yield from engine._maybe_terminate_or_interrupt()

                state.batch = next(engine._dataloader_iter)
                # Reset here: with an iterable that ends an epoch the last output would survive.
                state.output = None

                if state.dataloader is not None:
                    if engine._slow_events:
                        engine._fire_event(_GET_BATCH_COMPLETED)
                    else:
                        engine.last_event_name = _GET_BATCH_COMPLETED
                        if engine._hot[3]:
                            call_handlers(engine, engine._hot[3], _GET_BATCH_COMPLETED, (), {})
                    if engine.should_terminate or engine.should_terminate_single_epoch or engine.should_interrupt:
                        yield from engine._maybe_terminate_or_interrupt()

                iter_counter += 1
                should_exit = False
            except StopIteration:
                if state.epoch_length is None:  # the first pass over data without a length
                    state.epoch_length = iter_counter
                    if state.max_iters is not None:
                        state.max_epochs = math.ceil(state.max_iters / state.epoch_length)
                    break

                if should_exit:  # a fresh iterator gave nothing either
                    if not engine._is_done(state):
                        total_iters = (
                            state.epoch_length * state.max_epochs if state.max_epochs is not None else state.max_iters
                        )
                        warnings.warn(
                            "Data iterator can not provide data anymore but required total number of "
                            "iterations to run is not reached. "
                            f"Current iteration: {state.iteration} vs Total iterations to run : {total_iters}",
                            stacklevel=2,
                        )
                    break

                if state.dataloader is not None:
                    engine._fire_event(_STOP_ITERATION)
                    if engine.should_terminate or engine.should_terminate_single_epoch or engine.should_interrupt:
                        yield from engine._maybe_terminate_or_interrupt()

                engine._setup_dataloader_iter()
                should_exit = True
                continue

            state.iteration += 1
            if engine._slow_events:
                engine._fire_event(_ITERATION_STARTED)
            else:
                engine.last_event_name = _ITERATION_STARTED
                epoch.iteration += 1
                if engine._hot[0]:
                    call_handlers(engine, engine._hot[0], _ITERATION_STARTED, (), {})
            if engine.should_terminate or engine.should_terminate_single_epoch or engine.should_interrupt:
                yield from engine._maybe_terminate_or_interrupt()

            state.output = engine._process_function(engine, state.batch)

            if engine._slow_events:
                engine._fire_event(_ITERATION_COMPLETED)
            else:
                engine.last_event_name = _ITERATION_COMPLETED
                if engine._hot[1]:
                    call_handlers(engine, engine._hot[1], _ITERATION_COMPLETED, (), {})
                if engine._waiting_boundary or engine._iteration_syncs or engine._after_iteration:
                    engine._iteration_tail()
            if engine.should_terminate or engine.should_terminate_single_epoch or engine.should_interrupt:
                yield from engine._maybe_terminate_or_interrupt()

            if state.epoch_length is not None and iter_counter == state.epoch_length:
                break

            if state.max_iters is not None and state.iteration == state.max_iters:
                engine.should_terminate = True
                raise _EngineTerminateException()

    except _EngineTerminateSingleEpochException:
        engine._fire_event(Events.TERMINATE_SINGLE_EPOCH, iter_counter=iter_counter)
        engine._setup_dataloader_iter()

    except _EngineTerminateException:
        raise  # not a failure: ignite's run loop handles it

    except Exception as e:
        engine.logger.error(f"Current run is terminating due to exception: {e}")
        engine._handle_exception(e)

    return time.time() - start_time
