"""The Engine's own cost per iteration, counted exactly: Python calls (and builtin calls)
per training iteration over a raw loop, against ignite's Engine in the same process.

Counted with ``sys.setprofile`` as the difference between a run of 2n and a run of n
iterations, so each run's fixed cost cancels out: deterministic to the call, unlike a timing.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable

import pytest
import torch
from ignite.engine import Engine as IgniteEngine

from unison.engine import Engine, Events

N = 100


def _calls(run: Callable[[int], None], n: int) -> int:
    count = 0

    def profile(frame, event, arg) -> None:
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    # A garbage collection inside the run would add the calls of whatever it finalises and of
    # the gc callbacks other libraries registered (imported by earlier tests): none runs during
    # the count. No collection before it either: garbage left pending stays pending while the
    # collector is off, and a full pass over a long-lived test process's heap costs 0.5 s.
    gc.disable()
    sys.setprofile(profile)
    try:
        run(n)
    finally:
        sys.setprofile(None)
        gc.enable()
    return count


def _per_iteration(run: Callable[[int], None]) -> float:
    run(20)  # warm caches and lazy imports
    return (_calls(run, 2 * N) - _calls(run, N)) / N


def _workload() -> tuple[Callable[[object], torch.Tensor], list]:
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    data = [(torch.randn(1, 16), torch.randn(1, 1)) for _ in range(2 * N)]

    def step(batch: object) -> torch.Tensor:
        x, y = batch  # type: ignore[misc]  # a pair
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step, data


def test_the_engine_costs_at_most_half_of_ignites_calls_per_iteration() -> None:
    step, data = _workload()

    def raw(n: int) -> None:
        for batch in data[:n]:
            step(batch)

    def engine_of(cls: type) -> Callable[[int], None]:
        def run(n: int) -> None:
            cls(lambda engine, batch: step(batch)).run(data[:n], max_epochs=1)

        return run

    base = _per_iteration(raw)
    ignite_over = _per_iteration(engine_of(IgniteEngine)) - base
    unison_over = _per_iteration(engine_of(Engine)) - base
    assert ignite_over > 0
    assert unison_over <= ignite_over / 2, (
        f"unison's Engine adds {unison_over:g} calls per iteration over a raw loop, ignite's {ignite_over:g}: "
        "the budget is half of ignite's (docs/benchmarks.md)"
    )


def test_create_trainer_costs_at_most_half_of_create_supervised_trainers_calls_per_iteration() -> None:
    from ignite.engine import create_supervised_trainer

    from unison.engine import create_trainer

    step, data = _workload()
    model = torch.nn.Linear(16, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def raw(n: int) -> None:
        for batch in data[:n]:
            step(batch)

    def ignite_trainer(n: int) -> None:
        create_supervised_trainer(model, optimizer, torch.nn.functional.mse_loss).run(data[:n], max_epochs=1)

    def unison_trainer(n: int) -> None:
        # The epoch's loss tracked (the default); sync points only at the epoch's end, as a
        # world-size-1 trainer has them.
        create_trainer(model, optimizer, torch.nn.functional.mse_loss).run(data[:n], max_epochs=1)

    base = _per_iteration(raw)
    ignite_over = _per_iteration(ignite_trainer) - base
    unison_over = _per_iteration(unison_trainer) - base
    assert unison_over <= ignite_over / 2, (
        f"create_trainer adds {unison_over:g} calls per iteration over a raw loop, create_supervised_trainer "
        f"{ignite_over:g}: the budget is half (docs/benchmarks.md)"
    )


FILTERS = [
    {"every": 7},
    {"once": 5},
    {"once": [3, 11, 12]},
    {"before": 4},
    {"after": 9},
    {"before": 12, "after": 3},
    {"every": 3, "after": 2},
    {"every": 4, "before": 13, "after": 1},
]


@pytest.mark.parametrize("kwargs", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_a_filtered_handler_costs_at_most_two_calls_where_it_does_not_fire(kwargs) -> None:
    # The step does nothing: its calls would be the same in both runs and cancel out, and
    # under the profiler a real SGD step costs each of these tests 4 CPU-seconds.
    data = list(range(2 * N))

    def beyond(key: str, value):  # the filter moved past these runs, so that it never fires
        if key == "before" and "after" not in kwargs:
            return 1  # fires at iterations 0 < i < 1: none
        return [v + 10 * N for v in value] if isinstance(value, list) else value + 10 * N

    event = Events.ITERATION_COMPLETED(**{k: beyond(k, v) for k, v in kwargs.items()})

    def run_with(attach: bool) -> Callable[[int], None]:
        def run(n: int) -> None:
            engine = Engine(lambda engine, batch: None)
            if attach:
                engine.add_event_handler(event, lambda: None)
            engine.run(data[:n], max_epochs=1)

        return run

    cost = _per_iteration(run_with(True)) - _per_iteration(run_with(False))
    assert cost <= 2, f"a handler on {event!r} costs {cost:g} calls per iteration where it does not fire"


@pytest.mark.parametrize("counter", ["iteration", "epoch", "update"])
@pytest.mark.parametrize("kwargs", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_a_filtered_handler_fires_exactly_where_ignites_fires(counter, kwargs) -> None:
    """The fast wrapper against ignite's own filter, on the same events and counters."""
    from ignite.engine import State

    from unison.engine import UpdateEvents

    base = {
        "iteration": Events.ITERATION_COMPLETED,
        "epoch": Events.EPOCH_COMPLETED,
        "update": UpdateEvents.UPDATE_COMPLETED,
    }[counter]
    event = base(**kwargs)

    def fired(engine: IgniteEngine) -> list[int]:
        seen: list[int] = []
        if counter == "update":  # a trainer's step: an update every other iteration
            if not isinstance(engine, Engine):
                engine.register_events(*UpdateEvents, event_to_attr={UpdateEvents.UPDATE_COMPLETED: "update"})

            @engine.on(Events.ITERATION_COMPLETED)
            def update(e: IgniteEngine) -> None:
                if e.state.iteration % 2 == 0:
                    e.state.update = getattr(e.state, "update", 0) + 1
                    e.fire_event(UpdateEvents.UPDATE_COMPLETED)

        engine.add_event_handler(event, lambda e: seen.append(e.state.get_event_attrib_value(base)))
        engine.run(range(4), max_epochs=14)
        return seen

    ours = Engine(lambda e, b: None)
    assert ours.state.__class__ is State
    theirs = fired(IgniteEngine(lambda e, b: None))
    assert theirs, "the filter never fires in this run: the comparison would say nothing"
    assert fired(ours) == theirs
    assert ours.has_event_handler(ours._event_handlers[event][0][0]._parent(), event)
