"""SyncPoint: every contributor's sums reduced across ranks in a single all-reduce."""

from __future__ import annotations

import pytest
import torch
from _collective_probe import count_collectives

from unison.distributed import get_rank, get_world_size
from unison.engine import Engine, Events, SyncContributor, SyncPoint
from unison.testing import run_distributed


class Contributor:
    """Holds ``size`` sums that depend on the rank and on a seed, and keeps what it receives."""

    def __init__(self, seed: int, size: int, rank: int = 0) -> None:
        self.values = contribution(seed, size, rank)
        self.received: list[torch.Tensor] = []
        self.asked = 0

    def sync_state(self) -> torch.Tensor:
        self.asked += 1
        return self.values.clone()

    def load_synced_state(self, state: torch.Tensor) -> None:
        self.received.append(state.clone())


def contribution(seed: int, size: int, rank: int) -> torch.Tensor:
    return torch.arange(size, dtype=torch.float32) * (rank + 1) + 10.0 * seed + 0.5


# --- one process ---------------------------------------------------------------------------------


def test_world_size_one_hands_back_the_own_state_without_a_collective():
    point = SyncPoint()
    a, b = Contributor(1, 3), Contributor(2, 1)
    point.register(a)
    point.register(b)
    with count_collectives() as calls:
        point()
    assert sum(calls.values()) == 0
    for c in (a, b):
        (state,) = c.received
        assert state.dtype == torch.float64 and state.device.type == "cpu"
        assert torch.equal(state, c.values.to(torch.float64))
    assert point.count == 1


def test_registering_twice_has_no_effect():
    point = SyncPoint()
    a = Contributor(1, 2)
    point.register(a)
    point.register(a)
    point.register(a, scope="every")  # the first registration stands
    assert point.contributors() == [a]
    assert point.contributors(epoch_end=False) == []
    point()
    assert a.asked == 1 and len(a.received) == 1


def test_a_non_contributor_is_refused():
    class NoSync:
        def sync_state(self):
            return torch.zeros(1)

    point = SyncPoint()
    with pytest.raises(TypeError, match="NoSync cannot join a sync point") as info:
        point.register(NoSync())
    assert "load_synced_state" in str(info.value)
    with pytest.raises(TypeError):
        point.register(lambda: None)
    assert point.contributors() == []


def test_unknown_scope_is_refused():
    with pytest.raises(ValueError, match="scope='sometimes'"):
        SyncPoint().register(Contributor(0, 1), scope="sometimes")


def test_protocol_matches_duck_typed_contributors():
    assert isinstance(Contributor(0, 1), SyncContributor)
    assert not isinstance(object(), SyncContributor)


def test_unregister():
    point = SyncPoint()
    a, b = Contributor(1, 1), Contributor(2, 1)
    point.register(a)
    point.register(b)
    point.unregister(a)
    point.unregister(a)  # no error the second time
    assert point.contributors() == [b]


def test_scopes_choose_what_a_sync_point_reduces():
    point = SyncPoint()
    epoch, every = Contributor(1, 2), Contributor(2, 2)
    point.register(epoch)
    point.register(every, scope="every")
    point(epoch_end=False)
    assert (epoch.asked, every.asked) == (0, 1)
    point(epoch_end=True)
    assert (epoch.asked, every.asked) == (1, 2)
    assert point.count == 2


def test_no_contributor_no_sync():
    point = SyncPoint()
    point()
    assert point.count == 0


@pytest.mark.parametrize("epochs", [1, 3])
@pytest.mark.parametrize("with_control", [False, True])
def test_engine_reduces_epoch_contributors_once_per_epoch(epochs, with_control):
    engine = Engine(lambda e, b: b, sync_every=None)
    epoch_scope = Contributor(1, 2)
    engine.sync_point.register(epoch_scope)
    if with_control:
        engine.sync_point.register(Contributor(2, 1), scope="every")
    events = []
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: events.append(engine.sync_point.count))
    engine.run([1, 2, 3], max_epochs=epochs)
    assert len(epoch_scope.received) == epochs
    if with_control:
        # A sync point opens each EPOCH_COMPLETED; another follows its handlers (for what
        # they asked) unless the run ends there.
        assert engine.sync_point.count == 2 * epochs - 1
        assert events == [2 * e - 1 for e in range(1, epochs + 1)]
    else:
        # With one rank and nothing but stop requests to agree on (they act at once), the
        # sync point after the handlers has nothing to do and is skipped.
        assert engine.sync_point.count == epochs
        assert events == list(range(1, epochs + 1))


# --- several ranks ---------------------------------------------------------------------------------

SIZES = (3, 1, 4)


def sync_point_worker(calls_per_run: int) -> dict:
    rank = get_rank()
    point = SyncPoint()
    contributors = [Contributor(seed, size, rank) for seed, size in enumerate(SIZES)]
    for c in contributors:
        point.register(c)
    point.register(contributors[0])  # twice: no effect
    with count_collectives() as calls:
        for _ in range(calls_per_run):
            point()
    engine = Engine(lambda e, b: b, sync_every=None)
    for c in contributors:
        engine.sync_point.register(c)
    for c in contributors:
        c.received.clear()
    with count_collectives() as engine_calls:
        engine.run([1, 2], max_epochs=2)
    return {
        "world_size": get_world_size(),
        "received": [c.received for c in contributors],
        "collectives": dict(calls),
        "count": point.count,
        "engine_collectives": dict(engine_calls),
        "engine_count": engine.sync_point.count,
    }


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_contributors_receive_the_sum_over_ranks_in_one_all_reduce(nproc):
    results = run_distributed(sync_point_worker, 2, nproc=nproc, timeout=45)
    for rank, result in enumerate(results):
        assert result["world_size"] == nproc
        for seed, size in enumerate(SIZES):
            expected = sum(contribution(seed, size, r).to(torch.float64) for r in range(nproc))
            received = result["received"][seed]
            # The engine ran 2 epochs: each contributor reduced once per epoch.
            assert len(received) == 2, f"rank {rank}, contributor {seed}"
            for state in received:
                assert torch.equal(state, expected), f"rank {rank}, contributor {seed}"
        # 3 contributors, 2 calls: 2 collectives, both all-reduces.
        assert result["count"] == 2
        assert result["collectives"]["all_reduce"] == 2
        assert sum(result["collectives"].values()) == 2
        # In an engine too: one all-reduce per sync point, nothing else.
        assert result["engine_collectives"]["all_reduce"] == result["engine_count"] == 3
        assert sum(result["engine_collectives"].values()) == 3


def world_of_one_worker() -> dict:
    point = SyncPoint()
    c = Contributor(4, 2)
    point.register(c)
    with count_collectives() as calls:
        point()
        Engine(lambda e, b: b).run([1, 2, 3], max_epochs=2)
    return {"collectives": sum(calls.values()), "received": c.received, "world_size": get_world_size()}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_process_group_of_one_issues_no_collective():
    (result,) = run_distributed(world_of_one_worker, nproc=1, timeout=45)
    assert result["world_size"] == 1
    assert result["collectives"] == 0
    assert [r.tolist() for r in result["received"]] == [contribution(4, 2, 0).tolist()]
