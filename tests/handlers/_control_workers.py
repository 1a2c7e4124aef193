"""Functions that run on every rank of the control-handler tests (early stopping, the
non-finite guard, the time limit, the watchdog), and what they share.

Each builds tiny engines over a ``range``, makes one rank behave differently, and returns
plain data for the test to assert on in the parent process.
"""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import torch
from _log_capture import LogRecords

from unison.distributed import get_rank
from unison.distributed.sync import split_rows
from unison.engine import Engine, Events
from unison.handlers import EarlyStopping, NonFiniteGuard, TimeLimit, Watchdog


def ones(engine: Any, batch: Any) -> torch.Tensor:
    return torch.tensor(1.0)


# --- NonFiniteGuard -------------------------------------------------------------------------------


def non_finite_worker(scenarios: list[dict]) -> list[dict]:
    """Each scenario: ``sync_every``, ``length``, ``max_epochs`` and ``bad``, a list of
    ``(rank, iteration, value)``: the loss ``value`` (nan, inf, -inf) on ``rank`` at ``iteration``."""
    rank = get_rank()
    out = []
    for scenario in scenarios:
        bad = {it: value for r, it, value in scenario["bad"] if r == rank}

        def step(engine: Engine, batch: Any, bad: dict = bad) -> torch.Tensor:
            return torch.tensor(bad.get(engine.state.iteration, 1.0))

        engine = Engine(step, sync_every=scenario["sync_every"])
        guard = NonFiniteGuard()
        guard.attach(engine)
        completed: list[int] = []
        engine.add_event_handler(Events.COMPLETED, lambda e, into=completed: into.append(e.state.iteration))
        with LogRecords() as logs:
            state = engine.run(range(scenario["length"]), max_epochs=scenario["max_epochs"])
        out.append(
            {
                "iteration": state.iteration,
                "epoch": state.epoch,
                "report": dict(guard.report),
                "logs": logs.messages,
                "completed": completed,
            }
        )
    return out


# --- TimeLimit ----------------------------------------------------------------------------------


class RecordingTimeLimit(TimeLimit):
    """A TimeLimit that keeps what every sync point told it: ``(iteration, elapsed per rank)``."""

    def __init__(self, seconds: float) -> None:
        super().__init__(seconds)
        self.seen: list[tuple[int, list[float]]] = []

    def load_synced_state(self, state: torch.Tensor) -> None:
        (elapsed,) = split_rows(state, 1)
        self.seen.append((self.engine.state.iteration if self.engine is not None else -1, elapsed))
        super().load_synced_state(state)


def time_limit_worker(seconds: float, pace: float, length: int, sync_every: int) -> dict:
    """Rank r spends ``pace * (r + 1)`` seconds in every step; runs once with a
    ``TimeLimit(seconds)`` and once without."""
    rank = get_rank()

    def slow(engine: Engine, batch: Any) -> torch.Tensor:
        time.sleep(pace * (rank + 1))
        return torch.tensor(1.0)

    limited = Engine(slow, sync_every=sync_every)
    limit = RecordingTimeLimit(seconds)
    limit.attach(limited)
    limited.run(range(length), max_epochs=1)

    unlimited = Engine(slow, sync_every=sync_every)
    unlimited.run(range(length), max_epochs=1)
    return {
        "iteration": limited.state.iteration,
        "seen": limit.seen,
        "unlimited": unlimited.state.iteration,
    }


# --- EarlyStopping ------------------------------------------------------------------------------


def early_stopping_worker(sequences: list[list[float]], patience: int, max_epochs: int) -> dict:
    """Every rank scores epoch e with ``sequences[rank][e - 1]`` (a rank-local score), for each
    agreement and both ways of attaching (to the trainer, to an evaluator).

    Returns ``{(agreement, attached_to): {"epoch", "iteration", "evaluations", "logs"}}``.
    """
    rank = get_rank()
    mine = sequences[rank]
    out: dict = {}
    for agreement in ("rank_zero", "any", "all"):
        for attached_to in ("trainer", "evaluator"):
            trainer = Engine(ones, sync_every=3, name="trainer")
            evaluations: list[int] = []
            if attached_to == "trainer":
                stopper = EarlyStopping(
                    trainer,
                    lambda e: mine[e.state.epoch - 1],
                    patience=patience,
                    mode="max",
                    agreement=agreement,
                )
                stopper.attach(trainer)
            else:
                evaluator = Engine(ones, sync_every=None, name="evaluator")

                def score(e: Engine, trainer: Engine = trainer) -> None:
                    e.state.metrics["score"] = mine[trainer.state.epoch - 1]

                evaluator.add_event_handler(Events.COMPLETED, score)
                stopper = EarlyStopping(trainer, "score", patience=patience, mode="max", agreement=agreement)
                stopper.attach(evaluator)

                def evaluate(t: Engine, evaluator: Engine = evaluator, into: list = evaluations) -> None:
                    evaluator.run(range(4))
                    into.append(t.state.epoch)

                trainer.add_event_handler(Events.EPOCH_COMPLETED, evaluate)
            with LogRecords() as logs:
                state = trainer.run(range(5), max_epochs=max_epochs)
            out[(agreement, attached_to)] = {
                "epoch": state.epoch,
                "iteration": state.iteration,
                "evaluations": evaluations,
                "logs": logs.messages,
            }
    return out


# --- Watchdog -------------------------------------------------------------------------------------


def sleep_in_handler(seconds: float) -> None:
    """What the stuck rank does; its name must show in the watchdog's dump."""
    time.sleep(seconds)


def watchdog_worker(sleeper: int, run_dir: str, hang_timeout: float, stall: float, length: int) -> dict:
    """``sleeper`` stalls for ``stall`` seconds in a handler at iteration 2, while the other
    ranks work through the epoch at a pace that brings them to its end-of-epoch sync point
    about when the sleeper gets there: they keep completing iterations all along, so only
    the sleeper goes ``hang_timeout`` seconds without one."""
    rank = get_rank()
    pace = stall / length  # the others spend the sleeper's stall over the whole epoch

    def step(engine: Engine, batch: Any) -> torch.Tensor:
        if rank != sleeper:
            time.sleep(pace)
        return torch.tensor(1.0)

    engine = Engine(step, sync_every=None)
    if rank == sleeper:
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda e: sleep_in_handler(stall))
    stream = io.StringIO()
    watchdog = Watchdog(hang_timeout, run_dir=run_dir, stream=stream)
    watchdog.attach(engine)
    state = engine.run(range(length), max_epochs=1)
    return {
        "stream": stream.getvalue(),
        "reports": watchdog.reports,
        "iteration": state.iteration,
        "threads_after": [t.name for t in threading.enumerate() if t.name == "unison-watchdog"],
    }


def watchdog_abort_worker(sleeper: int, hang_timeout: float) -> None:
    """``sleeper`` stalls far longer than ``hang_timeout`` with ``abort=True``: the watchdog ends it."""
    engine = Engine(ones, sync_every=3)
    if get_rank() == sleeper:
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda e: sleep_in_handler(600.0))
    Watchdog(hang_timeout, abort=True, stream=io.StringIO()).attach(engine)
    engine.run(range(10), max_epochs=1)
