"""Watchdog: a rank that stops making progress says where it is stuck.

The stalls here are sleeps many times ``hang_timeout`` long, and the assertions are on
what the dump says, not on when it came.
"""

from __future__ import annotations

import io
import threading

import pytest
import torch
from _control_workers import sleep_in_handler, watchdog_abort_worker, watchdog_worker

from unison.distributed import RankFailedError
from unison.engine import Engine, Events
from unison.handlers import EXIT_HANG, Watchdog
from unison.testing import run_distributed

HANG_TIMEOUT = 0.4
STALL = 2.0  # five times HANG_TIMEOUT: the watchdog polls every HANG_TIMEOUT / 4


def _watchdog_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "unison-watchdog" and t.is_alive()}


def _ones(engine, batch):
    return torch.tensor(1.0)


def test_a_stalled_handler_is_reported_with_rank_event_iteration_and_stack(tmp_path):
    before = _watchdog_threads()
    engine = Engine(_ones, sync_every=3, name="trainer")
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=4), lambda e: sleep_in_handler(STALL))
    stream = io.StringIO()
    watchdog = Watchdog(HANG_TIMEOUT, run_dir=tmp_path / "run", stream=stream)
    watchdog.attach(engine)
    watchdog.attach(engine)  # twice: still one watchdog thread, one report
    engine.run(range(10), max_epochs=1)

    text = stream.getvalue()
    assert watchdog.reports == 1, text  # once per stall, however long it lasts
    assert "rank 0 of 1" in text
    assert "Last event: ITERATION_COMPLETED, iteration 4, epoch 1" in text
    assert f"hang_timeout={HANG_TIMEOUT:g} s" in text
    assert f"in {sleep_in_handler.__name__}" in text  # the stuck frame, in the main thread's stack
    assert "time.sleep(seconds)" in text
    assert (tmp_path / "run" / "hang-rank0.txt").read_text() == text
    assert _watchdog_threads() == before, "the watchdog thread outlived the run"


def test_a_run_that_keeps_moving_is_never_reported(tmp_path):
    engine = Engine(_ones, sync_every=3)
    stream = io.StringIO()
    watchdog = Watchdog(HANG_TIMEOUT, run_dir=tmp_path, stream=stream)
    watchdog.attach(engine)
    engine.run(range(50), max_epochs=2)
    assert (watchdog.reports, stream.getvalue(), list(tmp_path.iterdir())) == (0, "", [])


def test_the_watchdog_thread_stops_after_a_failed_run():
    before = _watchdog_threads()
    engine = Engine(_ones, sync_every=3)
    seen_alive = []
    engine.add_event_handler(
        Events.ITERATION_COMPLETED(once=2), lambda e: seen_alive.append(bool(_watchdog_threads() - before))
    )

    def explode(e):
        raise ValueError("stop here")

    engine.add_event_handler(Events.ITERATION_COMPLETED(once=3), explode)
    Watchdog(HANG_TIMEOUT, stream=io.StringIO()).attach(engine)
    with pytest.raises(ValueError, match="stop here"):
        engine.run(range(10), max_epochs=1)
    assert seen_alive == [True]  # it did run during the run
    assert _watchdog_threads() == before


def test_the_watchdog_thread_stops_after_a_terminated_run():
    before = _watchdog_threads()
    engine = Engine(_ones, sync_every=3)
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda e: e.terminate(skip_completed=True))
    Watchdog(HANG_TIMEOUT, stream=io.StringIO()).attach(engine)
    engine.run(range(10), max_epochs=1)
    assert _watchdog_threads() == before


@pytest.mark.parametrize("value", [0, -1.0, True, "60"])
def test_hang_timeout_must_be_a_positive_number(value):
    with pytest.raises(ValueError) as info:
        Watchdog(value)
    assert f"hang_timeout={value!r}" in str(info.value)


# --- distributed ------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_only_the_stalled_rank_reports_in_its_stream_and_file(tmp_path):
    sleeper, length, hang_timeout, stall = 1, 10, 1.5, 4.0
    # The other rank spends the same time in steps of stall / length seconds, far under hang_timeout.
    assert stall / length < hang_timeout / 3 and stall > 2 * hang_timeout
    results = run_distributed(
        watchdog_worker, sleeper, str(tmp_path), hang_timeout, stall, length, nproc=2, timeout=60
    )
    assert [r["iteration"] for r in results] == [length, length]
    reports = {rank: r["reports"] for rank, r in enumerate(results)}
    assert reports == {0: 0, 1: 1}, [r["stream"] for r in results]
    assert results[0]["stream"] == ""
    text = results[sleeper]["stream"]
    assert f"rank {sleeper} of 2" in text
    assert "Last event: ITERATION_COMPLETED, iteration 2, epoch 1" in text
    assert f"in {sleep_in_handler.__name__}" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"hang-rank{sleeper}.txt"]
    assert (tmp_path / f"hang-rank{sleeper}.txt").read_text() == text
    assert [r["threads_after"] for r in results] == [[], []]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_abort_ends_the_stalled_rank_with_exit_hang():
    sleeper = 1
    with pytest.raises(RankFailedError) as info:
        run_distributed(watchdog_abort_worker, sleeper, 0.5, nproc=2, timeout=60)
    # The other rank, waiting for the sleeper in a collective, completes no iteration
    # either: its watchdog may end it first. Either way the job ends by the watchdog.
    assert info.value.rank in (0, 1)
    assert f"exit code {EXIT_HANG}" in str(info.value)
    assert "deadline" not in str(info.value)  # ended by the watchdog, long before the test's deadline
