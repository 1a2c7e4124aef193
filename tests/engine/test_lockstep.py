"""Agreed control flow: a stop asked on some ranks stops every rank after the same iteration.

The distributed tests run tiny engines (a constant loss over ``range(LENGTH)``) on 2 and 3
gloo ranks, ask to stop on one rank, and check in the parent that every rank ended at the
iteration and epoch the sync-point rule gives: with ``sync_every=s`` a request at
iteration ``i`` takes effect at the first multiple of ``s`` at or after ``i``, or at the
epoch's end when that comes first; a request in an ``EPOCH_COMPLETED`` handler takes
effect at the end of that same epoch.
"""

from __future__ import annotations

import io
import os

import pytest
import torch
from _lockstep_workers import (
    RECORDED_EVENTS,
    collective_count_worker,
    debug_env_worker,
    ones,
    rank_local_handler_worker,
    state_dict_worker,
    stop_scenarios_worker,
    world,
)
from ignite.engine import Engine as IgniteEngine

from unison.distributed import RankFailedError, get_rank, launch
from unison.engine import Engine, Events
from unison.testing import run_distributed

SYNC_EVERY = 3
LENGTH = 10  # not a multiple of SYNC_EVERY: some requests meet the epoch's end first
MAX_EPOCHS = 3
WORLD_SIZES = (2, 3)
# Iterations at which one rank asks: on a sync point (3), between two (4), on the epoch's
# last iteration (10), in a later epoch (11), and where the epoch ends before the next
# multiple of SYNC_EVERY (19: the next multiple is 21, the epoch ends at 20).
ITERATION_REQUESTS = (1, 3, 4, 10, 11, 19)
EPOCH_REQUESTS = (1, 2)
RUN_TIMEOUT = 60.0


def ceil_to(value: int, step: int) -> int:
    return -(-value // step) * step


def reference_stop(
    requests: list[tuple[str, str, int]], *, sync_every: int, length: int, max_epochs: int
) -> dict:
    """What the documented rule says: where the run stops and where each epoch ends.

    ``requests``: ``(kind, event, at)``, kind ``"stop"`` or ``"epoch"`` (terminate_epoch),
    event ``"iteration"`` (at an iteration) or ``"epoch"`` (at the end of an epoch).
    A sync point comes after every iteration that is a multiple of ``sync_every``, and at
    every epoch's end.
    """
    iteration, pending, epoch_ends = 0, set(), []
    for epoch in range(1, max_epochs + 1):
        start = iteration
        while iteration - start < length:
            iteration += 1
            pending |= {kind for kind, event, at in requests if event == "iteration" and at == iteration}
            at_end = iteration - start == length
            if pending and (iteration % sync_every == 0 or at_end):
                if "stop" in pending:
                    # Stopping at an epoch's end happens in its EPOCH_COMPLETED sync point.
                    return {
                        "iteration": iteration,
                        "epoch": epoch,
                        "epoch_ends": epoch_ends + [iteration] * at_end,
                    }
                pending.clear()  # only this epoch ends, here
                break
        epoch_ends.append(iteration)
        if any(kind == "stop" and event == "epoch" and at == epoch for kind, event, at in requests):
            return {"iteration": iteration, "epoch": epoch, "epoch_ends": epoch_ends}
    return {"iteration": iteration, "epoch": max_epochs, "epoch_ends": epoch_ends}


def _scenario(requests: list[tuple], sync_every: int = SYNC_EVERY) -> dict:
    return {"sync_every": sync_every, "length": LENGTH, "max_epochs": MAX_EPOCHS, "requests": requests}


def _expected(scenario: dict) -> dict:
    kinds = {"terminate": "stop", "request_stop": "stop", "terminate_epoch": "epoch"}
    return reference_stop(
        [(kinds[how], event, at) for _, how, event, at, _ in scenario["requests"]],
        sync_every=scenario["sync_every"],
        length=scenario["length"],
        max_epochs=scenario["max_epochs"],
    )


def _scenarios(world_size: int) -> dict:
    out = {}
    for k in range(world_size):
        for i in ITERATION_REQUESTS:
            out[("terminate", "iteration", k, i)] = _scenario([(k, "terminate", "iteration", i, "")])
        for e in EPOCH_REQUESTS:
            out[("terminate", "epoch", k, e)] = _scenario([(k, "terminate", "epoch", e, "")])
        out[("request_stop", k)] = _scenario(
            [(k, "request_stop", "iteration", 4, f"plateau seen by rank {k}")]
        )
        out[("terminate_epoch", k)] = _scenario([(k, "terminate_epoch", "iteration", 14, "")])
    # Epoch 1 ends early (at 5), so epoch 2 runs iterations 6..15: iteration 10 is a multiple
    # of both sync_every and the epoch length, but not an epoch's end.
    last = world_size - 1
    out[("misaligned",)] = _scenario(
        [(last, "terminate_epoch", "iteration", 3, ""), (last, "terminate", "iteration", 8, "")], sync_every=5
    )
    # The same, asking at 14: the stop falls on epoch 2's real end (15), so epoch 2 completes.
    out[("misaligned end",)] = _scenario(
        [(last, "terminate_epoch", "iteration", 3, ""), (last, "terminate", "iteration", 14, "")],
        sync_every=5,
    )
    # Several ranks ask, at different iterations: the earliest request decides, and rank 0's log
    # names exactly the ranks that had asked by then.
    out[("several",)] = _scenario(
        [
            (r, "request_stop", "iteration", at, f"reason of rank {r}")
            for r, at in enumerate((5, 4, 8)[:world_size])
        ]
    )
    return out


SCENARIOS = {n: _scenarios(n) for n in WORLD_SIZES}


@pytest.fixture(scope="module")
def stop_runs():
    """Per world size: {scenario key: [result of rank 0, rank 1, ...]}, run once for the module."""
    cache: dict = {}

    def get(world_size: int) -> dict:
        if world_size not in cache:
            keys = list(SCENARIOS[world_size])
            per_rank = run_distributed(
                stop_scenarios_worker,
                [SCENARIOS[world_size][k] for k in keys],
                nproc=world_size,
                timeout=RUN_TIMEOUT,
            )
            cache[world_size] = {key: [ranks[i] for ranks in per_rank] for i, key in enumerate(keys)}
        return cache[world_size]

    return get


def _assert_lockstep(results: list[dict], expected: dict) -> None:
    ends = [(r["iteration"], r["epoch"]) for r in results]
    assert ends == [(expected["iteration"], expected["epoch"])] * len(results), ends
    assert all(r["events"] == results[0]["events"] for r in results), [r["events"] for r in results]
    assert not any(r["pending"] for r in results), "a request outlived the run"


def _cases(kind: str, values: tuple) -> list:
    return [
        pytest.param(n, k, v, id=f"{n}ranks-rank{k}-{kind}{v}")
        for n in WORLD_SIZES
        for k in range(n)
        for v in values
    ]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("world_size", "rank", "at"), _cases("iteration", ITERATION_REQUESTS))
def test_terminate_on_one_rank_at_an_iteration_stops_every_rank_at_the_next_sync_point(
    stop_runs, world_size, rank, at
):
    results = stop_runs(world_size)[("terminate", "iteration", rank, at)]
    expected = _expected(SCENARIOS[world_size][("terminate", "iteration", rank, at)])
    assert expected["iteration"] == min(ceil_to(at, SYNC_EVERY), ceil_to(at, LENGTH))
    _assert_lockstep(results, expected)
    events = results[0]["events"]
    assert [e[0] for e in events].count("TERMINATE") == 1
    assert events[-1] == ("COMPLETED", expected["epoch"], expected["iteration"])
    # An epoch that ends at the stop still completes: its end is the sync point that agreed it.
    assert [it for name, _, it in events if name == "EPOCH_COMPLETED"] == expected["epoch_ends"]
    stop_logs = [m for m in results[0]["logs"] if "stopping after iteration" in m]
    assert len(stop_logs) == 1 and f"rank {rank}: terminate() was called" in stop_logs[0], results[0]["logs"]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("world_size", "rank", "epoch"), _cases("epoch", EPOCH_REQUESTS))
def test_terminate_on_one_rank_at_epoch_completed_stops_every_rank_at_that_epochs_end(
    stop_runs, world_size, rank, epoch
):
    results = stop_runs(world_size)[("terminate", "epoch", rank, epoch)]
    expected = _expected(SCENARIOS[world_size][("terminate", "epoch", rank, epoch)])
    assert (expected["iteration"], expected["epoch"]) == (epoch * LENGTH, epoch)
    _assert_lockstep(results, expected)
    names = [e[0] for e in results[0]["events"]]
    assert names.count("EPOCH_COMPLETED") == epoch and names.count("TERMINATE") == 1


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("world_size", "rank"), [(n, k) for n in WORLD_SIZES for k in range(n)])
def test_request_stop_reason_is_logged_by_rank_zero_naming_the_asking_rank(stop_runs, world_size, rank):
    scenario = SCENARIOS[world_size][("request_stop", rank)]
    results = stop_runs(world_size)[("request_stop", rank)]
    expected = _expected(scenario)
    _assert_lockstep(results, expected)
    reason = scenario["requests"][0][4]
    logged = [m for m in results[0]["logs"] if reason in m]
    assert len(logged) == 1, results[0]["logs"]
    assert f"rank {rank}: {reason}" in logged[0]
    assert f"after iteration {expected['iteration']}" in logged[0]
    assert f"all {world_size} ranks" in logged[0]
    for other in results[1:]:
        assert not any(reason in m for m in other["logs"]), "only rank 0 logs the agreed stop"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_the_earliest_of_several_requests_decides_and_the_log_names_every_asking_rank(stop_runs, world_size):
    scenario = SCENARIOS[world_size][("several",)]
    results = stop_runs(world_size)[("several",)]
    expected = _expected(scenario)
    _assert_lockstep(results, expected)
    (logged,) = [m for m in results[0]["logs"] if "stopping after iteration" in m]
    for who, _, _, at, reason in scenario["requests"]:
        asked_in_time = at <= expected["iteration"]
        assert (f"rank {who}: {reason}" in logged) == asked_in_time, (who, at, logged)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(("world_size", "rank"), [(n, k) for n in WORLD_SIZES for k in range(n)])
def test_terminate_epoch_on_one_rank_ends_that_epoch_everywhere_and_the_run_goes_on(
    stop_runs, world_size, rank
):
    scenario = SCENARIOS[world_size][("terminate_epoch", rank)]
    results = stop_runs(world_size)[("terminate_epoch", rank)]
    expected = _expected(scenario)
    # Epoch 2 ends at the sync point after iteration 14; epoch 3 then runs in full.
    short_end = ceil_to(14, SYNC_EVERY)
    assert expected["epoch_ends"] == [LENGTH, short_end, short_end + LENGTH]
    _assert_lockstep(results, expected)
    events = results[0]["events"]
    assert [(it) for name, _, it in events if name == "EPOCH_COMPLETED"] == expected["epoch_ends"]
    assert [(ep, it) for name, ep, it in events if name == "TERMINATE_SINGLE_EPOCH"] == [(2, short_end)]
    assert "TERMINATE" not in [name for name, _, _ in events]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sync_points_stay_every_sync_every_iterations_after_a_shortened_epoch(stop_runs, world_size):
    """Epoch 1 ends at 5 (terminate_epoch at 3, sync_every=5); a stop asked at iteration 8 is
    agreed at the sync point of iteration 10, which epoch 2 (iterations 6..15) passes through."""
    scenario = SCENARIOS[world_size][("misaligned",)]
    expected = _expected(scenario)
    assert (expected["iteration"], expected["epoch_ends"]) == (10, [5])
    _assert_lockstep(stop_runs(world_size)[("misaligned",)], expected)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_stop_on_a_shortened_epochs_last_iteration_still_completes_that_epoch(stop_runs, world_size):
    """As when epochs are aligned (a stop asked at iteration 10 of 10 fires EPOCH_COMPLETED at 10),
    a stop that falls on the end of epoch 2 (iterations 6..15) is agreed in its EPOCH_COMPLETED."""
    expected = _expected(SCENARIOS[world_size][("misaligned end",)])
    assert (expected["iteration"], expected["epoch_ends"]) == (15, [5, 15])
    results = stop_runs(world_size)[("misaligned end",)]
    _assert_lockstep(results, expected)
    completed = [it for name, _, it in results[0]["events"] if name == "EPOCH_COMPLETED"]
    assert completed == expected["epoch_ends"]


# --- world size 1: ignite's behaviour, event for event -----------------------------------------

ALL_EVENTS = (
    Events.STARTED,
    Events.EPOCH_STARTED,
    Events.GET_BATCH_STARTED,
    Events.GET_BATCH_COMPLETED,
    Events.DATALOADER_STOP_ITERATION,
    Events.ITERATION_STARTED,
    Events.ITERATION_COMPLETED,
    Events.EPOCH_COMPLETED,
    Events.TERMINATE_SINGLE_EPOCH,
    Events.TERMINATE,
    Events.COMPLETED,
)


def _event_trace(engine: IgniteEngine, stop: str) -> tuple:
    trace: list = []
    for event in ALL_EVENTS:
        engine.add_event_handler(
            event, lambda e, *_, name=event.name, **__: trace.append((name, e.state.epoch, e.state.iteration))
        )
    if stop == "terminate@iteration":
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=4), lambda e: e.terminate())
    elif stop == "terminate@epoch":
        engine.add_event_handler(Events.EPOCH_COMPLETED(once=2), lambda e: e.terminate())
    elif stop == "terminate(skip_completed)":
        engine.add_event_handler(
            Events.ITERATION_COMPLETED(once=4), lambda e: e.terminate(skip_completed=True)
        )
    elif stop == "terminate_epoch":
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=4), lambda e: e.terminate_epoch())
    elif stop == "request_stop":
        # unison's request_stop is terminate() with a reason: compare it with ignite's terminate().
        if isinstance(engine, Engine):
            engine.add_event_handler(Events.ITERATION_COMPLETED(once=4), lambda e: e.request_stop("enough"))
        else:
            engine.add_event_handler(Events.ITERATION_COMPLETED(once=4), lambda e: e.terminate())
    state = engine.run(range(LENGTH), max_epochs=MAX_EPOCHS)
    return state.iteration, state.epoch, trace


@pytest.mark.parametrize(
    "stop",
    [
        "terminate@iteration",
        "terminate@epoch",
        "terminate(skip_completed)",
        "terminate_epoch",
        "request_stop",
    ],
)
def test_at_world_size_one_stopping_is_ignites_event_for_event(stop):
    ours = _event_trace(Engine(ones, sync_every=SYNC_EVERY), stop)
    theirs = _event_trace(IgniteEngine(ones), stop)
    assert ours == theirs
    assert ours[0] < LENGTH * MAX_EPOCHS or stop == "terminate_epoch", "the stop took no effect"


# --- pending requests survive a checkpoint ------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_pending_requests_survive_state_dict():
    request_at, asking = 4, 1
    results = run_distributed(
        state_dict_worker, asking, request_at, SYNC_EVERY, LENGTH, MAX_EPOCHS, nproc=2, timeout=RUN_TIMEOUT
    )
    syncs_before = request_at // SYNC_EVERY  # sync points passed before the request: iteration 3
    stop = ceil_to(request_at, SYNC_EVERY)
    for rank, r in enumerate(results):
        assert r["saved_pending"] == (rank == asking)
        assert r["saved_syncs"] == syncs_before
        # Loaded through torch.load(weights_only=True): the request is back. The sync count is
        # this engine's own (not saved): a resumed engine counts its syncs from 0.
        assert r["loaded"] == {"syncs": 0, "pending": rank == asking}
        # The resumed run honours the request at the first sync point after it: every rank stops there.
        assert r["resumed"] == (stop, 1)
        assert r["resumed_syncs"] == stop // SYNC_EVERY - request_at // SYNC_EVERY
        assert r["resumed_events"][-1] == ("COMPLETED", 1, stop)
        # Without unison's part of the checkpoint the request is lost and the run goes to its end.
        assert r["control"] == (LENGTH * MAX_EPOCHS, MAX_EPOCHS)


# --- the stop flag rides in the metrics' collective ---------------------------------------------


def _windows(timeline: list) -> dict:
    """Collectives issued inside each iteration (ITERATION_STARTED to ITERATION_COMPLETED's
    handlers) and right after it (the engine's sync point, up to the next event mark)."""
    inside, after = {}, {}
    for i, (name, _, iteration, count) in enumerate(timeline):
        if name == "ITERATION_STARTED":
            completed = timeline[i + 1]
            assert completed[0] == "ITERATION_COMPLETED" and completed[2] == iteration
            inside[iteration] = completed[3] - count
            if timeline[i + 2][0] == "GET_BATCH_STARTED":  # not the epoch's last iteration
                after[iteration] = timeline[i + 2][3] - completed[3]
    return {"inside": inside, "after": after}


@pytest.fixture(scope="module")
def collective_runs():
    return {
        ("epoch ends only", 1): run_distributed(
            collective_count_worker, LENGTH, 1, None, nproc=2, timeout=RUN_TIMEOUT
        ),
        ("epoch ends only", 2): run_distributed(
            collective_count_worker, LENGTH, 2, None, nproc=2, timeout=RUN_TIMEOUT
        ),
        ("sync_every", 1): run_distributed(
            collective_count_worker, LENGTH, 1, SYNC_EVERY, nproc=2, timeout=RUN_TIMEOUT
        ),
        ("stop asked", 2): run_distributed(
            collective_count_worker, LENGTH, 2, None, 1, 4, nproc=2, timeout=RUN_TIMEOUT
        ),
    }


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_last_epoch_costs_exactly_one_all_reduce_shared_by_metrics_and_stop_flags(collective_runs):
    for r in collective_runs[("epoch ends only", 1)]:
        assert r["totals"]["all_reduce"] == 1, r["totals"]
        assert sum(r["totals"].values()) == 1, {k: v for k, v in r["totals"].items() if v}
        marks = {(name, it): count for name, _, it, count in r["timeline"]}
        assert marks[("EPOCH_COMPLETED", LENGTH)] == 1 and marks[("COMPLETED", LENGTH)] == 1
        assert r["metrics"]["loss"] == 1.0  # the EpochAverage did travel in that one collective
        assert set(_windows(r["timeline"])["inside"].values()) == {0}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_an_epoch_that_is_not_the_last_adds_one_sync_point_after_its_handlers(collective_runs):
    for r in collective_runs[("epoch ends only", 2)]:
        assert r["totals"]["all_reduce"] == 3 and sum(r["totals"].values()) == 3
        started = [count for name, _, _, count in r["timeline"] if name == "EPOCH_STARTED"]
        assert started == [0, 2]  # epoch 1's end: one before its handlers, one after
        windows = _windows(r["timeline"])
        assert set(windows["inside"].values()) == {0}


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_stop_request_rides_in_the_epochs_one_all_reduce(collective_runs):
    # Rank 1 asks at iteration 4; with sync points at epoch ends only, the ranks agree at the end
    # of epoch 1 in the all-reduce that also carries the EpochAverage. Naming who asked, for the
    # log, costs one all_gather_object, once, when the stop is decided.
    for r in collective_runs[("stop asked", 2)]:
        assert r["end"] == (LENGTH, 1)
        assert r["totals"]["all_reduce"] == 1
        assert r["totals"]["all_gather_object"] == 1
        assert sum(r["totals"].values()) == 2
        assert r["metrics"]["loss"] == 1.0


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_between_sync_points_no_collective_at_all(collective_runs):
    for r in collective_runs[("sync_every", 1)]:
        windows = _windows(r["timeline"])
        assert set(windows["inside"].values()) == {0}, windows["inside"]
        sync_iterations = {i for i in range(1, LENGTH) if i % SYNC_EVERY == 0}
        assert {i for i, n in windows["after"].items() if n} == sync_iterations, windows["after"]
        assert all(windows["after"][i] == 1 for i in sync_iterations)
        # Plus one at STARTED (ranks compare epoch lengths) and one at the epoch's end.
        assert r["totals"]["all_reduce"] == len(sync_iterations) + 2
        assert sum(r["totals"].values()) == r["totals"]["all_reduce"]


# --- the debug switch -------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("kind", "sync_every", "world_size"), [("EpochAverage", None, 2), ("NonFiniteGuard", SYNC_EVERY, 3)]
)
def test_debug_reports_a_handler_attached_on_rank_zero_only(kind, sync_every, world_size):
    with pytest.raises(RankFailedError) as info:
        run_distributed(rank_local_handler_worker, kind, sync_every, nproc=world_size, timeout=RUN_TIMEOUT)
    message = str(info.value)
    if sync_every is None:  # no collective at the run's start: debug's check at the sync point finds it
        assert "Ranks left lockstep" in message
        assert kind in message and "sync contributors" in message
        assert "rank 1 is at" in message  # the first rank that differs from rank 0
    else:  # the layout check at the run's start names it, with or without debug
        assert f"the sync contributor {kind} is registered on rank(s) [0] but not on rank(s) [1, 2]" in message


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(150)
def test_launch_debug_trains_a_ddp_model_with_the_checks_on_in_the_ranks_and_only_there():
    # A fork server is already up, as in any test session: it must not hand out its own environment.
    assert run_distributed(world, nproc=2, timeout=RUN_TIMEOUT) == [(0, 2), (1, 2)]
    saved = dict(os.environ)
    seen = launch(
        debug_env_worker, nproc_per_node=2, debug=True, start_method="forkserver", timeout=RUN_TIMEOUT
    )
    assert seen == [{"TORCH_DISTRIBUTED_DEBUG": "INFO", "UNISON_DEBUG": "1", "engine_debug": True}] * 2
    # The next job, launched without debug, runs without it.
    later = run_distributed(debug_env_worker, nproc=2, timeout=RUN_TIMEOUT)
    changed = {
        k: os.environ.get(k)
        for k in ("TORCH_DISTRIBUTED_DEBUG", "UNISON_DEBUG")
        if os.environ.get(k) != saved.get(k)
    }
    assert later == [{"TORCH_DISTRIBUTED_DEBUG": None, "UNISON_DEBUG": None, "engine_debug": False}] * 2, (
        f"launch(debug=True) left {changed} in the caller's environment"
    )


def test_recorded_events_are_all_fired_by_a_plain_run():
    # Guards the helper: an event it records that a run never fires would make lockstep checks vacuous.
    engine = Engine(ones, sync_every=SYNC_EVERY)
    seen: list = []
    for event in RECORDED_EVENTS:
        engine.add_event_handler(event, lambda e, *_, name=event.name, **__: seen.append(name))
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda e: e.terminate_epoch())
    engine.add_event_handler(Events.EPOCH_COMPLETED(once=2), lambda e: e.terminate())
    engine.run(range(LENGTH), max_epochs=MAX_EPOCHS)
    assert set(seen) == {e.name for e in RECORDED_EVENTS}
    buffer = io.BytesIO()
    torch.save(engine.state_dict(), buffer)
    assert torch.load(io.BytesIO(buffer.getvalue()), weights_only=True)["unison"]["stop"] == {
        "reasons": [],
        "epoch_reasons": [],
        "interrupt_reasons": [],
    }


class _Ragged:
    """A contributor whose state is longer on rank 1: a collective of mismatched sizes."""

    def sync_state(self) -> torch.Tensor:
        return torch.zeros(2 + get_rank(), dtype=torch.float64)

    def load_synced_state(self, state: torch.Tensor) -> None:
        pass


def _ragged_contributor() -> None:
    engine = Engine(ones, sync_every=2)
    engine.sync_point.register(_Ragged(), scope="every")
    engine.run(range(4))


def _contributor_on_rank_zero_only() -> None:
    engine = Engine(ones, sync_every=2)
    if get_rank() == 0:
        engine.sync_point.register(_Ragged(), scope="every")
    engine.run(range(4))


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("worker", "expected"),
    [
        (_ragged_contributor, "returns states of different lengths on different ranks (rank 0: 2, rank 1: 3)"),
        (_contributor_on_rank_zero_only, "is registered on rank(s) [0] but not on rank(s) [1]"),
    ],
)
def test_a_sync_layout_that_differs_between_ranks_fails_at_the_start_naming_the_contributor(worker, expected):
    """Without debug mode: not a hang until the collective timeout, nor a bare gloo abort."""
    with pytest.raises(RankFailedError) as info:
        run_distributed(worker, nproc=2, timeout=50)
    assert "_Ragged" in str(info.value) and expected in str(info.value)


def _stop_agreed_from_a_handler() -> None:
    engine = Engine(ones)
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda e: e.stop_agreed("alone"))
    engine.run(range(4))


def test_stop_agreed_outside_a_sync_point_is_refused_at_the_call() -> None:
    with pytest.raises(RuntimeError, match=r"stop_agreed\('alone'\) was called outside a sync point"):
        _stop_agreed_from_a_handler()


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_unison_debug_from_the_environment_trains_a_ddp_model(monkeypatch):
    monkeypatch.setenv("UNISON_DEBUG", "1")
    seen = run_distributed(debug_env_worker, nproc=2, timeout=RUN_TIMEOUT)
    assert [s["engine_debug"] for s in seen] == [True, True]


def _plain_handler_on_rank_zero_only() -> None:
    def write_csv(engine: Engine) -> None:
        pass

    engine = Engine(ones, sync_every=2, debug=True)
    if get_rank() == 0:
        engine.add_event_handler(Events.ITERATION_COMPLETED, write_csv)
    engine.run(range(6))


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_debug_compares_the_handlers_attached_too() -> None:
    with pytest.raises(RankFailedError) as info:
        run_distributed(_plain_handler_on_rank_zero_only, nproc=2, timeout=50)
    message = str(info.value)
    assert "attached different handlers to ITERATION_COMPLETED" in message
    assert "write_csv" in message and "rank 1 has []" in message


def _collective_on_rank_zero_only_with_debug() -> None:
    import torch.distributed as dist

    def report_total(engine: Engine) -> None:
        if get_rank() == 0:  # the mistake: a collective inside a rank-0-only branch
            dist.all_reduce(torch.ones(5, dtype=torch.float32))

    engine = Engine(ones, sync_every=2, debug=True)
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=2), report_total)
    engine.run(range(6))


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_debug_makes_a_collective_on_one_rank_fail_fast_naming_the_handler() -> None:
    import time

    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_distributed(_collective_on_rank_zero_only_with_debug, nproc=2, timeout=60)  # group timeout 60 s
    assert time.monotonic() - started < 30, "debug mode waited for the collective timeout"
    message = str(info.value)
    assert "report_total" in message and "died inside a collective" in message
