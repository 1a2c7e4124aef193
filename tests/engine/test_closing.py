"""The end of a run is said once to every close callback, with how it ended, however it ends."""

from __future__ import annotations

import logging

import pytest
from ignite.engine import Engine as IgniteEngine

from unison.engine import Engine, Events
from unison.engine.closing import on_close


class Boom(Exception):
    pass


def _engine(record: list[str], *, fail_at: int | None = None, stop_at: int | None = None, skip: bool = False):
    def step(engine, batch):
        if engine.state.iteration == fail_at:
            raise Boom("the step failed")
        return batch

    engine = Engine(step, sync_every=None)
    if stop_at is not None:
        engine.add_event_handler(
            Events.ITERATION_COMPLETED(once=stop_at), lambda e: e.terminate(skip_completed=skip)
        )
    engine.add_event_handler(Events.COMPLETED, lambda _: record.append("COMPLETED handler"))
    engine.add_event_handler(Events.TERMINATE, lambda _: record.append("TERMINATE handler"))
    engine.add_close_callback(record.append)
    engine.add_close_callback(record.append)  # twice: no effect
    return engine


@pytest.mark.parametrize(
    ("options", "said"),
    [
        ({}, ["COMPLETED handler", "finished"]),
        ({"stop_at": 3}, ["TERMINATE handler", "COMPLETED handler", "finished"]),
        ({"stop_at": 3, "skip": True}, ["TERMINATE handler", "terminated"]),
    ],
    ids=["to-the-end", "terminate", "terminate-skip-completed"],
)
def test_a_run_that_ends_says_how_once_after_its_last_handler(options, said) -> None:
    record: list[str] = []
    _engine(record, **options).run(range(4), max_epochs=2)
    assert record == said


def test_a_failed_run_is_closed_once_before_its_error_propagates() -> None:
    record: list[str] = []
    failures: list[str] = []
    engine = _engine(record, fail_at=3)
    engine.add_failure_callback(lambda: failures.append("failed"))
    with pytest.raises(Boom):
        engine.run(range(4), max_epochs=2)
    assert record == ["failed"] and failures == ["failed"]  # the epoch loop and the run loop both saw it


def test_each_run_is_closed_once() -> None:
    record: list[str] = []
    engine = _engine(record)
    engine.run(range(2), max_epochs=1)
    engine.run(range(2), max_epochs=1)
    assert record.count("finished") == 2


def test_every_callback_is_called_when_one_raises_and_the_first_error_follows() -> None:
    called: list[str] = []
    engine = Engine(lambda e, b: b, sync_every=None)

    def broken(how: str) -> None:
        raise RuntimeError("cannot close")

    engine.add_close_callback(broken)
    engine.add_close_callback(called.append)
    with pytest.raises(RuntimeError, match="cannot close") as info:
        engine.run(range(2), max_epochs=1)
    assert called == ["finished"]  # not closed again as failed when the error passes the run loop
    assert any("closing the run (finished)" in note for note in info.value.__notes__)


def test_a_callback_that_raises_while_closing_a_failed_run_never_hides_its_error(caplog) -> None:
    called: list[str] = []
    engine = _engine([], fail_at=1)

    def broken(how: str) -> None:
        raise RuntimeError("cannot close")

    engine.add_close_callback(broken)
    engine.add_close_callback(called.append)
    with caplog.at_level(logging.WARNING, logger="unison"), pytest.raises(Boom):
        engine.run(range(2), max_epochs=1)
    assert called == ["failed"]
    assert "cannot close" in caplog.text


@pytest.mark.parametrize(("skip", "said"), [(False, ["finished"]), (True, ["terminated"])])
def test_on_close_takes_a_plain_ignite_engine(skip, said) -> None:
    record: list[str] = []
    engine = IgniteEngine(lambda e, b: b)
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda e: e.terminate(skip_completed=skip))
    on_close(engine, record.append)
    engine.run(range(4), max_epochs=1)
    assert record == said
