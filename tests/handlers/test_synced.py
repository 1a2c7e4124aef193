"""SyncedHandler: the base of handlers that contribute to the sync point and act on the result."""

from __future__ import annotations

import pytest
from ignite.engine import Engine as IgniteEngine

from unison.distributed import get_rank
from unison.engine import Engine
from unison.handlers import EarlyStopping, NonFiniteGuard, Preemption, TimeLimit
from unison.handlers.synced import SyncedHandler
from unison.testing import run_distributed


class Vote(SyncedHandler):
    """Rank ``voter`` votes to stop from iteration ``at`` on; every rank sees every vote."""

    rows = 2

    def __init__(self, at: int, voter: int = 0) -> None:
        super().__init__()
        self.at, self.voter = at, voter
        self.seen: list[list[list[float]]] = []

    def local_values(self) -> tuple[float, float]:
        assert self.engine is not None
        vote = get_rank() == self.voter and self.engine.state.iteration >= self.at  # type: ignore[attr-defined]  # SyncEngine declares only what the base uses
        return (float(vote), float(get_rank()))

    def on_agreed(self, values: list[list[float]]) -> str | None:
        self.seen.append(values)
        return "voted" if any(values[0]) else None


def test_the_built_in_synced_handlers_share_the_base() -> None:
    assert all(issubclass(cls, SyncedHandler) for cls in (EarlyStopping, NonFiniteGuard, TimeLimit, Preemption))


def test_a_vote_stops_the_run_at_the_next_sync_point() -> None:
    engine = Engine(lambda e, b: None, sync_every=3)
    vote = Vote(at=4)
    vote.attach(engine)
    assert engine.run(range(20)).iteration == 6
    assert vote.seen[-1] == [[1.0], [0.0]]


def _vote_on_rank_1() -> tuple[int, list]:
    engine = Engine(lambda e, b: None, sync_every=2)
    vote = Vote(at=3, voter=1)
    vote.attach(engine)
    return engine.run(range(20)).iteration, vote.seen[-1]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_every_rank_sees_every_ranks_values_and_stops_together() -> None:
    results = run_distributed(_vote_on_rank_1, nproc=2, timeout=100)
    assert results == [(4, [[0.0, 1.0], [0.0, 1.0]])] * 2


def test_attaching_twice_joins_once() -> None:
    engine = Engine(lambda e, b: None)
    vote = Vote(at=1)
    vote.attach(engine)
    vote.attach(engine)
    assert engine.sync_point.contributors().count(vote) == 1


def test_an_ignite_engine_is_refused_with_the_one_message() -> None:
    with pytest.raises(TypeError, match=r"Vote needs a unison Engine .*Got Engine"):
        Vote(at=1).attach(IgniteEngine(lambda e, b: None))


def test_a_count_that_differs_from_rows_is_named() -> None:
    class Wrong(Vote):
        def local_values(self) -> tuple[float, float]:
            return (1.0,)  # type: ignore[return-value]  # the mistake under test

    engine = Engine(lambda e, b: None, sync_every=1)
    Wrong(at=1).attach(engine)
    with pytest.raises(ValueError, match=r"Wrong.local_values\(\) returned 1 numbers; its rows is 2"):
        engine.run(range(3))
