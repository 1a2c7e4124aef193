"""Functions that run on every rank of the lockstep and failure tests, and what they share.

Each worker builds tiny engines (``Engine(lambda e, b: torch.tensor(1.0))`` over a
``range``), injects a fault on one rank, and returns plain data that the test asserts on
in the parent process.
"""

from __future__ import annotations

import io
import os
import threading
from collections.abc import Callable
from typing import Any

import torch
from _collective_probe import count_collectives
from _log_capture import LogRecords
from torch.utils.data import DataLoader, Dataset

from unison.distributed import get_rank, get_world_size
from unison.engine import Engine, Events
from unison.handlers import NonFiniteGuard
from unison.metrics import EpochAverage

RECORDED_EVENTS = (
    Events.STARTED,
    Events.EPOCH_STARTED,
    Events.EPOCH_COMPLETED,
    Events.TERMINATE_SINGLE_EPOCH,
    Events.TERMINATE,
    Events.COMPLETED,
)
"""The events whose (name, epoch, iteration) every rank records: ranks in lockstep record the same."""


def ones(engine: Any, batch: Any) -> torch.Tensor:
    """The process function of the tiny engines: a constant loss."""
    return torch.tensor(1.0)


def record_events(engine: Engine, into: list, events: tuple = RECORDED_EVENTS) -> None:
    """Appends ``(event name, epoch, iteration)`` to ``into`` each time one of ``events`` fires."""
    for event in events:
        # TERMINATE_SINGLE_EPOCH handlers also receive iter_counter.
        engine.add_event_handler(
            event, lambda e, *_, name=event.name, **__: into.append((name, e.state.epoch, e.state.iteration))
        )


# --- agreed stopping ------------------------------------------------------------------------------


def _request(engine: Engine, how: str, reason: str) -> None:
    if how == "terminate":
        engine.terminate()
    elif how == "request_stop":
        engine.request_stop(reason)
    elif how == "terminate_epoch":
        engine.terminate_epoch()
    else:  # pragma: no cover - a typo in a scenario
        raise ValueError(how)


def run_stop_scenario(scenario: dict) -> dict:
    """Runs one tiny engine in which the ranks of ``scenario["requests"]`` ask to stop.

    ``scenario``: ``sync_every``, ``length`` (epoch length), ``max_epochs`` and
    ``requests``, a list of ``(rank, how, event, at, reason)``: on ``rank``, at the
    ``ITERATION_COMPLETED`` of iteration ``at`` (``event="iteration"``) or the
    ``EPOCH_COMPLETED`` of epoch ``at`` (``event="epoch"``), call ``terminate()``,
    ``request_stop(reason)`` or ``terminate_epoch()`` (``how``).
    """
    rank = get_rank()
    engine = Engine(ones, sync_every=scenario["sync_every"])
    events: list = []
    record_events(engine, events)
    for who, how, event, at, reason in scenario["requests"]:
        if who != rank:
            continue
        if event == "iteration":
            engine.add_event_handler(
                Events.ITERATION_COMPLETED(once=at),
                lambda e, how=how, reason=reason: _request(e, how, reason),
            )
        else:
            engine.add_event_handler(
                Events.EPOCH_COMPLETED(once=at), lambda e, how=how, reason=reason: _request(e, how, reason)
            )
    with LogRecords() as logs:
        state = engine.run(range(scenario["length"]), max_epochs=scenario["max_epochs"])
    return {
        "iteration": state.iteration,
        "epoch": state.epoch,
        "events": events,
        "logs": logs.messages,
        "pending": engine.stop_requested,
    }


def stop_scenarios_worker(scenarios: list[dict]) -> list[dict]:
    """Runs every scenario in turn on this rank."""
    return [run_stop_scenario(s) for s in scenarios]


# --- pending requests across state_dict ---------------------------------------------------------


def state_dict_worker(
    asking_rank: int, request_at: int, sync_every: int, length: int, max_epochs: int
) -> dict:
    """Saves the engine right after ``asking_rank`` asked to stop (before the ranks agreed),
    through ``torch.save`` / ``torch.load(weights_only=True)``, and resumes a new engine from it.
    """
    rank = get_rank()
    saved: dict = {}
    first = Engine(ones, sync_every=sync_every)

    def ask_then_save(engine: Engine) -> None:
        if rank == asking_rank:
            engine.request_stop("saved while pending")
        buffer = io.BytesIO()
        torch.save(engine.state_dict(), buffer)
        saved["bytes"] = buffer.getvalue()
        saved["syncs"] = engine.sync_point.count
        saved["pending"] = engine.stop_requested
        # Leave this run here on every rank, together, without an agreed stop: the first run
        # only exists to produce the checkpoint.
        raise _Checkpointed

    first.add_event_handler(Events.ITERATION_COMPLETED(once=request_at), ask_then_save)
    try:
        first.run(range(length), max_epochs=max_epochs)
    except _Checkpointed:
        pass
    state = torch.load(io.BytesIO(saved["bytes"]), weights_only=True)

    resumed = Engine(ones, sync_every=sync_every)
    resumed.load_state_dict(state)
    loaded = {"syncs": resumed.sync_point.count, "pending": resumed.stop_requested}
    events: list = []
    record_events(resumed, events)
    resumed.run(range(length), max_epochs=max_epochs)

    # The same checkpoint without unison's part: ignite's counters alone.
    control = Engine(ones, sync_every=sync_every)
    control.load_state_dict({k: v for k, v in state.items() if k != "unison"})
    control.run(range(length), max_epochs=max_epochs)
    return {
        "saved_syncs": saved["syncs"],
        "saved_pending": saved["pending"],
        "loaded": loaded,
        "resumed": (resumed.state.iteration, resumed.state.epoch),
        "resumed_syncs": resumed.sync_point.count,
        "resumed_events": events,
        "control": (control.state.iteration, control.state.epoch),
    }


class _Checkpointed(Exception):
    """Ends the first run of :func:`state_dict_worker` once its checkpoint is taken."""


# --- collectives ------------------------------------------------------------------------------------


def collective_count_worker(
    length: int, max_epochs: int, sync_every: int | None, stop_rank: int | None = None, stop_at: int = 0
) -> dict:
    """Counts every torch.distributed collective issued during a run with an EpochAverage,
    where ``stop_rank`` (if any) asks to stop at iteration ``stop_at``.

    Returns the cumulative count at each of the run's events, so the test can tell where
    each collective was issued: ``[(event, epoch, iteration, count), ...]``.
    """
    engine = Engine(ones, sync_every=sync_every)
    EpochAverage("loss").attach(engine)
    if stop_rank == get_rank():
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=stop_at), lambda e: e.request_stop("enough"))
    timeline: list = []
    collectives: dict = {}

    def mark(name: str) -> Callable[[Engine], None]:
        return lambda e: timeline.append(
            (name, e.state.epoch, e.state.iteration, sum(collectives["calls"].values()))
        )

    # ITERATION_STARTED handlers run before the step; a mark at every GET_BATCH_STARTED closes
    # the previous iteration, after the engine's own sync point at ITERATION_COMPLETED.
    for event in (
        Events.STARTED,
        Events.EPOCH_STARTED,
        Events.GET_BATCH_STARTED,
        Events.ITERATION_STARTED,
        Events.ITERATION_COMPLETED,
        Events.EPOCH_COMPLETED,
        Events.COMPLETED,
    ):
        engine.add_event_handler(event, mark(event.name))
    with count_collectives() as calls:
        collectives["calls"] = calls
        engine.run(range(length), max_epochs=max_epochs)
        metrics = dict(engine.state.metrics)
    return {
        "timeline": timeline,
        "totals": dict(calls),
        "metrics": metrics,
        "end": (engine.state.iteration, engine.state.epoch),
    }


# --- debug: a rank-local handler ------------------------------------------------------------------


def rank_local_handler_worker(kind: str, sync_every: int | None) -> None:
    """Attaches ``kind`` (an EpochAverage or a NonFiniteGuard) on rank 0 only, with debug on."""
    engine = Engine(ones, sync_every=sync_every, debug=True)
    if get_rank() == 0:
        (EpochAverage("loss") if kind == "EpochAverage" else NonFiniteGuard()).attach(engine)
    engine.run(range(10), max_epochs=2)


def debug_env_worker() -> dict:
    """What a rank sees of the debug switches, after training a DDP model with them on."""
    from unison.distributed import prepare_model
    from unison.engine import create_trainer

    model = prepare_model(torch.nn.Linear(3, 1))  # DDP at 2 ranks: torch's DETAIL level crashed here
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), torch.nn.functional.mse_loss)
    trainer.run([(torch.randn(2, 3), torch.randn(2, 1))] * 4, max_epochs=2)
    return {
        "TORCH_DISTRIBUTED_DEBUG": os.environ.get("TORCH_DISTRIBUTED_DEBUG"),
        "UNISON_DEBUG": os.environ.get("UNISON_DEBUG"),
        "engine_debug": Engine(ones).debug,
    }


# --- failures -----------------------------------------------------------------------------------------


class Boom(RuntimeError):
    """The exception injected on one rank; its message names the rank and the iteration."""


def boom_message(where: str, rank: int, iteration: int) -> str:
    return f"injected failure in the {where} on rank {rank} at iteration {iteration}"


def explode(engine: Engine) -> None:
    """A handler that raises (attached with a ``once=`` filter on the failing rank)."""
    raise Boom(boom_message("handler", get_rank(), engine.state.iteration))


class ExplodingDataset(Dataset):
    """``range(length)``, except that reading item ``bad_index`` raises on ``bad_rank``."""

    def __init__(self, length: int, bad_rank: int, bad_index: int) -> None:
        self.length = length
        self.bad_rank = bad_rank
        self.bad_index = bad_index

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> torch.Tensor:
        if get_rank() == self.bad_rank and index == self.bad_index:
            raise Boom(boom_message("data", get_rank(), index + 1))
        return torch.tensor(float(index))


def failing_run(where: str, bad_rank: int, at: int, length: int = 10, sync_every: int = 3) -> None:
    """Runs a tiny engine in which ``bad_rank`` raises at iteration ``at``, in the step
    (``where="step"``), in a handler (``"handler"``) or while reading a batch (``"data"``)."""
    rank = get_rank()

    def step(engine: Engine, batch: Any) -> torch.Tensor:
        if where == "step" and rank == bad_rank and engine.state.iteration == at:
            raise Boom(boom_message("step", rank, engine.state.iteration))
        return torch.tensor(1.0)

    engine = Engine(step, sync_every=sync_every)
    if where == "handler" and rank == bad_rank:
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=at), explode)
    data: Any = range(length)
    if where == "data":
        # batch_size=None: one item per iteration, so item at-1 is read for iteration at.
        data = DataLoader(ExplodingDataset(length, bad_rank, at - 1), batch_size=None, shuffle=False)
    engine.run(data, max_epochs=2)


def watchdog_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "unison-watchdog"]


def world() -> tuple[int, int]:
    return get_rank(), get_world_size()
