"""Helpers of the Engine's run: checks on the data it is given, the epoch events of a rank
without data, and the names its errors use."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from ignite.engine import Events, State
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

from unison.distributed.primitives import get_world_size
from unison.distributed.stream_sources import stream_problem
from unison.engine.protocol import EngineParts
from unison.utils.exception_notes import add_note, has_note

E = TypeVar("E", bound=EngineParts)
"""An engine's own type, so that its callbacks take it as they were written."""


def handler_name(func: Callable[..., Any]) -> str:
    """A readable name for a handler in an error note: ``Class.method`` or the function's."""
    target = getattr(func, "_parent", None)
    handler = target() if callable(target) else func
    owner = getattr(handler, "__self__", None)
    if owner is not None:
        return f"{type(owner).__name__}.{getattr(handler, '__name__', '?')}"
    return getattr(handler, "__qualname__", None) or type(handler).__name__


def check_sync_every(sync_every: int | None) -> int | None:
    """``Engine(sync_every=...)``: a positive int, or None."""
    if sync_every is not None and (isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1):
        raise ValueError(
            f"Engine(sync_every={sync_every!r}) must be a positive int (iterations between sync points) "
            "or None (sync at epoch ends only)."
        )
    return sync_every


def is_empty(data: Iterable) -> bool:
    """Whether ``data`` has a length of 0 (data without a length is not empty)."""
    try:
        return len(data) == 0  # type: ignore[arg-type]  # probing: no __len__ raises TypeError, handled below
    except TypeError:
        return False


def check_sharded(data: Iterable, *, trains: bool = True) -> None:
    """Refuses data every rank (or every loader worker) would read whole: with more than one rank,
    a DataLoader that shuffles the whole dataset on each rank; for a trainer, a DataLoader over a
    stream that splits by neither rank nor worker
    (:func:`~unison.distributed.stream_sources.stream_problem`, the rule of ``prepare_loaders``).

    The answer depends on the loader's type and settings and the world size only: every rank
    raises at once, before the run's first event, with no collective to wait in.
    """
    if not isinstance(data, DataLoader):
        return
    world = get_world_size()
    if trains and isinstance(data.dataset, IterableDataset):
        problem = stream_problem(data.dataset, world, data.num_workers)
        if problem is not None:
            raise ValueError(
                f"The DataLoader given to Engine.run reads {problem}. Build the loader with "
                "unison.distributed.prepare_loaders(train=stream, ...), which checks this, after the fix."
            )
    if world == 1:
        return
    samplers = (data.sampler, getattr(data.batch_sampler, "sampler", None))
    if any(isinstance(sampler, RandomSampler) for sampler in samplers):
        raise ValueError(
            f"The DataLoader given to Engine.run uses a RandomSampler while {world} ranks run: "
            "each rank would shuffle the whole dataset on its own, so ranks would train on overlapping "
            "samples. Build the loader with unison.distributed.prepare_loaders(...), or pass "
            "sampler=unison.distributed.TrainSampler(dataset) instead of shuffle=True."
        )


def run_empty(engine: EngineParts, data: Iterable, max_epochs: int | None) -> State:
    """Fires an epoch's events without iterations, for a rank that holds no samples."""
    if max_epochs is not None and max_epochs < 1:
        raise ValueError(f"Argument max_epochs should be greater than or equal to 1, got {max_epochs}.")
    engine.state = State()
    engine.state.dataloader = data
    engine.state.max_epochs = max_epochs or 1
    engine.state.epoch_length = 0
    engine.should_terminate = engine.should_terminate_single_epoch = engine.should_interrupt = False
    engine._init_timers(engine.state)
    try:
        engine._fire_event(Events.STARTED)
        while engine.state.epoch < engine.state.max_epochs and not engine.should_terminate:
            engine.state.epoch += 1
            engine._fire_event(Events.EPOCH_STARTED)
            engine._fire_event(Events.EPOCH_COMPLETED)
        engine._fire_event(Events.COMPLETED)
    except BaseException as err:
        engine._handle_exception(err)
    return engine.state


def run_after(engine: E, callbacks: list[Callable[[E], None]], event_name: Any) -> None:
    """Runs the engine's after-event callbacks; an error names the callback and where."""
    for callback in callbacks:
        try:
            callback(engine)
        except Exception as err:
            add_note(err, f"raised by {handler_name(callback)} after {engine._where(event_name)}")
            raise


def note_failure(engine: EngineParts, err: BaseException) -> None:
    """Says where in the loop an exception without a note of its own came from: the data or the step."""
    if not isinstance(err, Exception) or has_note(err):
        return
    if engine.last_event_name is Events.GET_BATCH_STARTED:
        where = engine._where("GET_BATCH_STARTED")
        add_note(err, f"raised while fetching the batch of iteration {engine.state.iteration + 1} from the data, at {where}")
    elif engine.last_event_name is Events.ITERATION_STARTED:
        add_note(err, f"raised by the process function (the step) at {engine._where('ITERATION')}")
