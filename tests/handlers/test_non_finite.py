"""NonFiniteGuard: a NaN or Inf loss on one rank stops every rank at the same sync point."""

from __future__ import annotations

import math

import pytest
import torch
from _control_workers import non_finite_worker
from _sync_probe import count_host_syncs

from unison.engine import Engine, Events
from unison.handlers import NonFiniteGuard
from unison.testing import run_distributed

SYNC_EVERY = 3
LENGTH = 10
MAX_EPOCHS = 2
WORLD_SIZES = (2, 3)
BAD_AT = (4, 9, 10, 13, 20)  # between sync points, on one, the epoch's end, epoch 2, the run's last iteration
VALUES = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def ceil_to(value: int, step: int) -> int:
    return -(-value // step) * step


def first_sync_at_or_after(iteration: int) -> int:
    return min(ceil_to(iteration, SYNC_EVERY), ceil_to(iteration, LENGTH))


def _scenario(bad: list[tuple[int, int, float]]) -> dict:
    return {"sync_every": SYNC_EVERY, "length": LENGTH, "max_epochs": MAX_EPOCHS, "bad": bad}


def _scenarios(world_size: int) -> dict:
    out = {}
    for k in range(world_size):
        for at in BAD_AT:
            out[("nan", k, at)] = _scenario([(k, at, math.nan)])
        for name in ("inf", "-inf"):
            out[(name, k, 4)] = _scenario([(k, 4, VALUES[name])])
    # Two ranks go bad in the same stretch between sync points, and one of them twice: the
    # report holds each rank's first bad iteration.
    out[("two ranks",)] = _scenario([(0, 5, math.inf), (1, 4, math.nan), (1, 6, math.nan)])
    out[("clean",)] = _scenario([])
    return out


SCENARIOS = {n: _scenarios(n) for n in WORLD_SIZES}


@pytest.fixture(scope="module")
def guard_runs():
    cache: dict = {}

    def get(world_size: int) -> dict:
        if world_size not in cache:
            keys = list(SCENARIOS[world_size])
            per_rank = run_distributed(
                non_finite_worker, [SCENARIOS[world_size][k] for k in keys], nproc=world_size, timeout=60
            )
            cache[world_size] = {key: [ranks[i] for ranks in per_rank] for i, key in enumerate(keys)}
        return cache[world_size]

    return get


def _cases(names: tuple, ats: tuple) -> list:
    return [
        pytest.param(n, k, name, at, id=f"{n}ranks-rank{k}-{name}@{at}")
        for n in WORLD_SIZES
        for k in range(n)
        for name in names
        for at in ats
    ]


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("world_size", "rank", "value", "at"), _cases(("nan",), BAD_AT) + _cases(("inf", "-inf"), (4,))
)
def test_a_non_finite_loss_on_one_rank_stops_every_rank_at_the_next_sync_point(
    guard_runs, world_size, rank, value, at
):
    results = guard_runs(world_size)[(value, rank, at)]
    stop = first_sync_at_or_after(at)
    epoch = ceil_to(stop, LENGTH) // LENGTH
    assert [(r["iteration"], r["epoch"]) for r in results] == [(stop, epoch)] * world_size
    assert [r["report"] for r in results] == [{rank: at}] * world_size
    (logged,) = [m for m in results[0]["logs"] if "non-finite" in m]
    assert f"rank {rank} at iteration {at}" in logged and f"after iteration {stop}" in logged
    assert [r["completed"] for r in results] == [[stop]] * world_size  # COMPLETED fires, as after terminate()


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_report_holds_the_first_bad_iteration_of_every_bad_rank(guard_runs, world_size):
    results = guard_runs(world_size)[("two ranks",)]
    assert [r["report"] for r in results] == [{0: 5, 1: 4}] * world_size
    assert [r["iteration"] for r in results] == [first_sync_at_or_after(4)] * world_size
    (logged,) = [m for m in results[0]["logs"] if "non-finite" in m]
    assert "rank 0 at iteration 5" in logged and "rank 1 at iteration 4" in logged


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_finite_losses_run_to_the_end(guard_runs, world_size):
    results = guard_runs(world_size)[("clean",)]
    assert [(r["iteration"], r["report"]) for r in results] == [(LENGTH * MAX_EPOCHS, {})] * world_size


# --- world size 1 ----------------------------------------------------------------------------------


def _engine_with_losses(losses: dict[int, float], sync_every: int | None, as_tensor: bool = True) -> Engine:
    def step(engine, batch):
        value = losses.get(engine.state.iteration, 1.0)
        return torch.tensor(value) if as_tensor else value

    return Engine(step, sync_every=sync_every)


def test_no_host_sync_inside_any_iteration_only_at_sync_points():
    length = 4200  # past the guard's compaction of the losses it keeps (every 4096)
    engine = _engine_with_losses({100: math.nan, 4150: math.inf}, sync_every=None)
    guard = NonFiniteGuard()
    guard.attach(engine)
    marks: list[tuple[str, int, int]] = []
    with count_host_syncs() as syncs:
        for event in (Events.ITERATION_STARTED, Events.GET_BATCH_STARTED, Events.EPOCH_COMPLETED):
            engine.add_event_handler(
                event, lambda e, name=event.name: marks.append((name, e.state.iteration, syncs.count))
            )
        engine.run(range(length), max_epochs=1)
    # From an iteration's start to the next batch: the step, ITERATION_COMPLETED and its handlers.
    inside = {
        it: marks[j + 1][2] - count
        for j, (name, it, count) in enumerate(marks)
        if name == "ITERATION_STARTED" and marks[j + 1][0] == "GET_BATCH_STARTED"
    }
    assert len(inside) == length - 1
    assert set(inside.values()) == {0}, {it: n for it, n in inside.items() if n}
    assert syncs.count >= 1, "the probe saw no read at all, yet the guard reads its flag at the epoch's end"
    assert guard.report == {0: 100}
    assert engine.state.iteration == length


def test_python_float_losses_are_guarded_too():
    engine = _engine_with_losses({7: math.nan}, sync_every=SYNC_EVERY, as_tensor=False)
    guard = NonFiniteGuard()
    guard.attach(engine)
    engine.run(range(LENGTH), max_epochs=MAX_EPOCHS)
    assert guard.report == {0: 7}
    assert engine.state.iteration == first_sync_at_or_after(7)


def test_output_transform_picks_the_loss():
    def step(engine, batch):
        loss = math.inf if engine.state.iteration == 2 else 1.0
        return {"loss": torch.tensor(loss), "accuracy": torch.tensor(math.nan)}

    engine = Engine(step, sync_every=SYNC_EVERY)
    guard = NonFiniteGuard(output_transform=lambda out: out["loss"])
    guard.attach(engine)
    engine.run(range(LENGTH), max_epochs=1)
    assert guard.report == {0: 2} and engine.state.iteration == SYNC_EVERY


def test_attaching_twice_keeps_one_guard_and_a_plain_ignite_engine_is_refused():
    from ignite.engine import Engine as IgniteEngine

    engine = _engine_with_losses({}, sync_every=SYNC_EVERY)
    guard = NonFiniteGuard()
    guard.attach(engine)
    guard.attach(engine)
    assert sum(c is guard for c in engine.sync_point.contributors()) == 1
    with pytest.raises(TypeError, match="unison Engine"):
        NonFiniteGuard().attach(IgniteEngine(lambda e, b: None))
