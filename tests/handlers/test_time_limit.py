"""TimeLimit: ranks of different speeds stop together at the first sync point past the budget."""

from __future__ import annotations

import time

import pytest
from _control_workers import RecordingTimeLimit, time_limit_worker
from ignite.engine import Engine as IgniteEngine

from unison.engine import Engine
from unison.handlers import TimeLimit
from unison.testing import run_distributed

SECONDS = 0.25
PACE = 0.01  # rank r sleeps PACE * (r + 1) per step
LENGTH = 60
SYNC_EVERY = 5


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_of_different_speeds_stop_together_once_the_budget_is_spent(world_size):
    # The slowest rank needs at least PACE * world_size * LENGTH seconds for the epoch, several
    # times the budget, so the budget runs out well before the data does.
    assert PACE * world_size * LENGTH > 4 * SECONDS
    results = run_distributed(
        time_limit_worker, SECONDS, PACE, LENGTH, SYNC_EVERY, nproc=world_size, timeout=60
    )
    stops = [r["iteration"] for r in results]
    assert stops == [stops[0]] * world_size, stops
    assert [r["unlimited"] for r in results] == [LENGTH] * world_size  # without the limit: every iteration
    assert stops[0] < LENGTH

    seen = results[0]["seen"]
    assert all(r["seen"] == seen for r in results), "ranks saw different sums at a sync point"
    sync_iterations = [it for it, _ in seen]
    assert sync_iterations == list(range(SYNC_EVERY, stops[0] + 1, SYNC_EVERY))
    # The stop is the first sync point at which some rank was over budget, and not earlier.
    over = [max(elapsed) >= SECONDS for _, elapsed in seen]
    assert over == [False] * (len(seen) - 1) + [True], seen


@pytest.mark.parametrize("seconds", [0, -1, True, "10", None])
def test_seconds_must_be_a_positive_number(seconds):
    with pytest.raises(ValueError) as info:
        TimeLimit(seconds)
    assert f"seconds={seconds!r}" in str(info.value)


def test_world_size_one_stops_at_the_first_sync_point_past_the_budget():
    def slow(engine, batch):
        time.sleep(0.01)

    engine = Engine(slow, sync_every=SYNC_EVERY)
    limit = RecordingTimeLimit(0.12)
    limit.attach(engine)
    limit.attach(engine)  # a second attach changes nothing
    assert sum(c is limit for c in engine.sync_point.contributors()) == 1
    state = engine.run(range(LENGTH), max_epochs=1)
    over = [max(elapsed) >= limit.seconds for _, elapsed in limit.seen]
    assert over == [False] * (len(over) - 1) + [True], limit.seen
    assert state.iteration == limit.seen[-1][0] < LENGTH


def test_a_plain_ignite_engine_is_refused():
    with pytest.raises(TypeError, match="unison Engine"):
        TimeLimit(1).attach(IgniteEngine(lambda e, b: None))
