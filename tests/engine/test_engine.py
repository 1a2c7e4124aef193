"""unison's Engine at world size 1 is ignite's Engine, event for event; plus what it adds."""

from __future__ import annotations

import math

import pytest
import torch
from ignite.engine import Engine as IgniteEngine
from ignite.handlers import TerminateOnNan, Timer
from ignite.metrics import Accuracy as IgniteAccuracy
from ignite.metrics import Average
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

from unison.distributed import TrainSampler, get_rank, get_world_size
from unison.engine import Engine, Events
from unison.testing import run_distributed

EVENTS = list(Events)  # every event ignite defines, EXCEPTION_RAISED included


def _recorded(engine_cls, setup=None):
    """An engine whose process function returns the batch, recording every event and batch."""
    log: list[tuple[str, int, int]] = []
    batches: list = []

    def step(engine, batch):
        batches.append(batch)
        return batch

    def record(engine, *args, _event, **kwargs):
        log.append((_event.name, engine.state.epoch, engine.state.iteration))
        if _event is Events.EXCEPTION_RAISED:
            raise args[0]  # recorded, and raised as if no handler were there

    engine = engine_cls(step)
    for event in EVENTS:
        engine.add_event_handler(event, record, _event=event)
    if setup is not None:
        setup(engine)
    return engine, log, batches


def _terminate_at(iteration):
    return lambda engine: engine.add_event_handler(
        Events.ITERATION_COMPLETED(once=iteration), lambda e: e.terminate()
    )


def _terminate_epoch_at(iteration):
    return lambda engine: engine.add_event_handler(
        Events.ITERATION_COMPLETED(once=iteration), lambda e: e.terminate_epoch()
    )


def _terminate_at_epoch_start(epoch):
    return lambda engine: engine.add_event_handler(
        Events.EPOCH_STARTED(once=epoch), lambda e: e.terminate(skip_completed=True)
    )


def _raise_at(iteration):
    def setup(engine):
        def boom(e):
            raise RuntimeError("boom")

        engine.add_event_handler(Events.ITERATION_COMPLETED(once=iteration), boom)

    return setup


def _interrupt_at(iteration):
    return lambda engine: engine.add_event_handler(
        Events.ITERATION_COMPLETED(once=iteration), lambda e: e.interrupt()
    )


_RAISES = _raise_at(3)

SCENARIOS = {  # setup, runs, an event the scenario must produce (so that it tests what it says)
    "epochs": (None, [dict(data=list(range(4)), max_epochs=3)], "EPOCH_COMPLETED"),
    "terminate": (_terminate_at(7), [dict(data=list(range(4)), max_epochs=3)], "TERMINATE"),
    "terminate-at-epoch-start": (
        _terminate_at_epoch_start(2),
        [dict(data=list(range(4)), max_epochs=3)],
        "TERMINATE",
    ),
    "terminate-epoch": (
        _terminate_epoch_at(2),
        [dict(data=list(range(4)), max_epochs=2)],
        "TERMINATE_SINGLE_EPOCH",
    ),
    "epoch-length-below-data": (
        None,
        [dict(data=list(range(10)), max_epochs=3, epoch_length=4)],
        "EPOCH_COMPLETED",
    ),
    "epoch-length-above-data": (
        None,
        [dict(data=list(range(3)), max_epochs=2, epoch_length=5)],
        "DATALOADER_STOP_ITERATION",
    ),
    "max-iters": (None, [dict(data=list(range(4)), max_iters=10)], "TERMINATE"),
    "no-data": (None, [dict(data=None, max_epochs=2, epoch_length=3)], "ITERATION_COMPLETED"),
    "iterator-without-len": ("iterator", [dict(max_epochs=1)], "EPOCH_COMPLETED"),
    "exception-raised": (_RAISES, [dict(data=list(range(4)), max_epochs=2)], "EXCEPTION_RAISED"),
    "interrupt-and-resume": (
        _interrupt_at(5),
        [dict(data=list(range(4)), max_epochs=2), dict(data=list(range(4)))],
        "INTERRUPT",
    ),
    "run-again-shorter": (
        None,
        [dict(data=list(range(3)), max_epochs=2), dict(data=list(range(3)), max_epochs=1)],
        "COMPLETED",
    ),
    "run-again-longer": (
        None,
        [dict(data=list(range(3)), max_epochs=2), dict(data=list(range(3)), max_epochs=4)],
        "COMPLETED",
    ),
    "run-again-after-terminate": (
        _terminate_at(4),
        [dict(data=list(range(3)), max_epochs=3), dict(data=list(range(3)))],
        "TERMINATE",
    ),
}


@pytest.mark.parametrize("scenario", SCENARIOS.values(), ids=SCENARIOS.keys())
def test_fires_the_same_events_as_ignite(scenario):
    setup, runs, must_see = scenario
    outcomes = []
    for engine_cls in (IgniteEngine, Engine):
        engine, log, batches = _recorded(engine_cls, None if setup == "iterator" else setup)
        states = []
        for kwargs in runs:
            kwargs = dict(kwargs)
            if setup == "iterator":
                kwargs["data"] = iter(range(5))
            try:
                state = engine.run(**kwargs)
            except Exception as err:  # both engines must fail alike
                states.append((type(err).__name__, str(err)))
            else:
                states.append(
                    (state.epoch, state.iteration, state.epoch_length, state.max_epochs, state.max_iters)
                )
        outcomes.append((log, batches, states))
    ignite, unison = outcomes
    assert must_see in {name for name, _, _ in ignite[0]}
    if setup is not _RAISES:
        assert "EXCEPTION_RAISED" not in {name for name, _, _ in ignite[0]}, ignite[2]
    assert unison[0] == ignite[0]
    assert unison[1] == ignite[1]
    assert unison[2] == ignite[2]


def test_event_sequence_is_sensitive():
    """Control: a different run gives a different sequence, so equality above means something."""
    engine_a, log_a, _ = _recorded(IgniteEngine)
    engine_a.run(list(range(4)), max_epochs=3)
    engine_b, log_b, _ = _recorded(Engine, _terminate_at(6))
    engine_b.run(list(range(4)), max_epochs=3)
    assert log_a != log_b


def test_ignite_accuracy_metric_gives_the_same_value():
    gen = torch.Generator().manual_seed(0)
    batches = [(torch.randn(7, 4, generator=gen), torch.randint(0, 4, (7,), generator=gen)) for _ in range(5)]
    correct = sum(int((y_pred.argmax(1) == y).sum()) for y_pred, y in batches)
    expected = correct / sum(len(y) for _, y in batches)
    values = []
    for engine_cls in (IgniteEngine, Engine):
        engine = engine_cls(lambda e, b: b)
        IgniteAccuracy().attach(engine, "acc")
        Average(output_transform=lambda out: out[0].max(dim=1).values.mean()).attach(engine, "avg")
        state = engine.run(batches)
        values.append((state.metrics["acc"], state.metrics["avg"]))
    assert values[0][0] == pytest.approx(expected)
    assert values[1] == values[0]


def test_ignite_terminate_on_nan_stops_at_the_same_iteration():
    data = [1.0, 2.0, float("nan"), 4.0, 5.0]
    results = []
    for engine_cls in (IgniteEngine, Engine):
        engine = engine_cls(lambda e, b: torch.tensor(b))
        engine.add_event_handler(Events.ITERATION_COMPLETED, TerminateOnNan())
        completed = []
        engine.add_event_handler(Events.COMPLETED, lambda e, out=completed: out.append(True))
        state = engine.run(data, max_epochs=3)
        results.append((state.iteration, state.epoch, completed))
    assert results[0] == (3, 1, [True])
    assert results[1] == results[0]


def test_ignite_timer_counts_the_same_steps():
    counts = []
    for engine_cls in (IgniteEngine, Engine):
        engine = engine_cls(lambda e, b: b)
        timer = Timer(average=True)
        timer.attach(
            engine,
            start=Events.STARTED,
            resume=Events.ITERATION_STARTED,
            pause=Events.ITERATION_COMPLETED,
            step=Events.ITERATION_COMPLETED,
        )
        engine.run(list(range(4)), max_epochs=2)
        counts.append(timer.step_count)
        assert timer.value() >= 0.0
    assert counts == [8, 8]


def test_state_dict_has_ignites_keys_and_values():
    states = []
    for engine_cls in (IgniteEngine, Engine):
        engine = engine_cls(lambda e, b: b)
        engine.add_event_handler(Events.ITERATION_COMPLETED(once=7), lambda e: e.terminate())
        engine.run(list(range(5)), max_epochs=3)
        states.append(engine.state_dict())
    ignite, unison = states
    assert ignite == {"epoch_length": 5, "iteration": 7, "max_epochs": 3}
    assert {k: unison[k] for k in ignite} == ignite


@pytest.mark.parametrize(
    "state_dict",
    [
        {"iteration": 7, "epoch_length": 5, "max_epochs": 3},
        {"epoch": 1, "epoch_length": 5, "max_epochs": 3},
        {"iteration": 4, "epoch_length": 5, "max_iters": 12},
    ],
    ids=["iteration", "epoch", "max-iters"],
)
def test_load_state_dict_resumes_like_ignite(state_dict):
    outcomes = []
    for engine_cls in (IgniteEngine, Engine):
        engine, log, batches = _recorded(engine_cls)
        engine.load_state_dict(state_dict)
        state = engine.run(list(range(5)))
        outcomes.append((log, batches, state.iteration, state.epoch))
    assert outcomes[1] == outcomes[0]


def test_state_dict_round_trip_through_torch_save(tmp_path):
    engine = Engine(lambda e, b: b)
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=7), lambda e: e.terminate())
    engine.run(list(range(5)), max_epochs=3)
    path = tmp_path / "engine.pt"
    torch.save(engine.state_dict(), path)
    loaded = torch.load(path, weights_only=True)
    assert loaded == engine.state_dict()

    resumed, log, batches = _recorded(Engine)
    resumed.load_state_dict(loaded)
    assert resumed.state_dict() == engine.state_dict()
    reference, ref_log, ref_batches = _recorded(IgniteEngine)
    reference.load_state_dict(
        {k: v for k, v in loaded.items() if k in ("iteration", "epoch_length", "max_epochs")}
    )
    resumed.run(list(range(5)))
    reference.run(list(range(5)))
    assert (log, batches) == (ref_log, ref_batches)
    assert resumed.state.iteration == 15


class _Contributor:
    def __init__(self, value: float) -> None:
        self.value = value
        self.received: list[list[float]] = []

    def sync_state(self) -> torch.Tensor:
        return torch.tensor([self.value, 1.0], dtype=torch.float64)

    def load_synced_state(self, state: torch.Tensor) -> None:
        self.received.append(state.tolist())


@pytest.mark.parametrize(
    "make_data", [list, lambda: DataLoader(TensorDataset(torch.zeros(0, 2)), batch_size=4)]
)
def test_empty_data_at_world_size_one_is_refused_as_ignite_refuses_it(make_data):
    data = make_data()
    assert len(data) == 0
    for engine_cls in (IgniteEngine, Engine):
        with pytest.raises(ValueError, match="zero size"):
            engine_cls(lambda e, b: b).run(data, max_epochs=2)


def empty_shard_worker(max_epochs):
    """Rank 1 holds no samples: it still fires each epoch's events and joins every sync point."""
    rank = get_rank()
    data = [] if rank == 1 else [1, 2]
    engine, log, batches = _recorded(Engine)
    contributor = _Contributor(float(rank + 1))
    engine.sync_point.register(contributor)
    state = engine.run(data, max_epochs=max_epochs)
    first = (state.iteration, state.epoch)
    then = engine.run([3, 4])  # and runs again afterwards as any engine
    return {
        "log": log,
        "batches": batches,
        "state": first,
        "received": contributor.received,
        "then": (then.iteration, then.epoch),
    }


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_epochs", [None, 2])
def test_a_rank_with_an_empty_shard_fires_an_epoch_of_events_and_syncs(max_epochs):
    results = run_distributed(empty_shard_worker, max_epochs, nproc=2, timeout=50)
    epochs = max_epochs or 1
    empty = results[1]
    expected = [("STARTED", 0, 0)]
    for epoch in range(1, epochs + 1):
        expected += [("EPOCH_STARTED", epoch, 0), ("EPOCH_COMPLETED", epoch, 0)]
    expected += [("COMPLETED", epochs, 0)]
    assert empty["log"][: len(expected)] == expected
    assert empty["state"] == (0, epochs) and results[0]["state"] == (2 * epochs, epochs)
    assert empty["batches"] == [3, 4] and results[0]["batches"] == [1, 2] * epochs + [3, 4]
    # Both ranks' rows reached every epoch's sync point, on both ranks.
    assert results[0]["received"][:epochs] == empty["received"][:epochs] == [[3.0, 2.0]] * epochs
    assert empty["then"] == results[0]["then"] == (2, 1)


def test_random_sampler_is_fine_at_world_size_one():
    loader = DataLoader(TensorDataset(torch.arange(6.0)), batch_size=2, shuffle=True)
    state = Engine(lambda e, b: b).run(loader)
    assert state.iteration == 3


class _Counting:
    def __init__(self) -> None:
        self.calls = 0

    def sync_state(self) -> torch.Tensor:
        self.calls += 1
        return torch.zeros(1, dtype=torch.float64)

    def load_synced_state(self, state: torch.Tensor) -> None:
        pass


def test_epoch_end_sync_point_runs_before_user_epoch_completed_handlers():
    engine = Engine(lambda e, b: b)
    contributor = _Contributor(0.0)
    engine.sync_point.register(contributor)
    seen = []
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: seen.append(len(contributor.received)))
    engine.run([1, 2], max_epochs=3)
    assert seen == [1, 2, 3]


def test_sync_every_adds_sync_points_inside_the_epoch():
    every = _Counting()
    engine = Engine(lambda e, b: b, sync_every=2)
    engine.sync_point.register(every, scope="every")
    at = []
    original = every.sync_state

    def recording():
        at.append((engine.last_event_name.name, engine.state.iteration))
        return original()

    every.sync_state = recording
    engine.run(list(range(5)), max_epochs=2)
    inside = [it for name, it in at if name == "ITERATION_COMPLETED"]
    # every 2 iterations, except where the epoch ends anyway (iteration 10)
    assert inside == [i for i in range(2, 11, 2) if i % 5 != 0]
    assert [it for name, it in at if name == "EPOCH_COMPLETED"] == [5, 5, 10]


# --- distributed: the DataLoader check ---------------------------------------------------------


def random_sampler_worker() -> dict:
    from torch import nn
    from torch.nn import functional as F

    from unison.engine import create_trainer

    assert get_world_size() == 2
    ds = TensorDataset(torch.randn(8, 3), torch.randn(8, 1))
    loaders = {
        "shuffle": DataLoader(ds, batch_size=2, shuffle=True),
        "sampler": DataLoader(ds, batch_size=2, sampler=RandomSampler(ds)),
        "batch_sampler": DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), 2, drop_last=False)),
        "no_batching": DataLoader(ds, batch_size=None, shuffle=True),
        "train_sampler": DataLoader(ds, batch_size=2, sampler=TrainSampler(ds, seed=0)),
    }
    out = {}
    for name, loader in loaders.items():
        model = nn.Linear(3, 1)
        before = model.weight.detach().clone()
        trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
        iterations = []
        trainer.add_event_handler(
            Events.ITERATION_COMPLETED, lambda e, out=iterations: out.append(e.state.iteration)
        )
        try:
            trainer.run(loader)
            error = None
        except ValueError as err:
            error = str(err)
        out[name] = {
            "error": error,
            "iterations": len(iterations),
            "moved": not torch.equal(before, model.weight.detach()),
            "rank": get_rank(),
        }
    return out


@pytest.fixture(scope="module")
def random_sampler_results():
    return run_distributed(random_sampler_worker, nproc=2, timeout=50)


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["shuffle", "sampler", "batch_sampler", "no_batching"])
def test_random_sampler_refused_with_two_ranks(random_sampler_results, kind):
    for result in random_sampler_results:
        outcome = result[kind]
        assert outcome["error"] is not None, f"rank {outcome['rank']}: a {kind} DataLoader was accepted"
        assert "RandomSampler" in outcome["error"]
        assert "TrainSampler" in outcome["error"] and "prepare_loaders" in outcome["error"]
        assert outcome["iterations"] == 0 and not outcome["moved"]


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_train_sampler_accepted_with_two_ranks(random_sampler_results):
    for result in random_sampler_results:
        outcome = result["train_sampler"]
        assert outcome["error"] is None
        assert outcome["iterations"] == math.ceil(math.ceil(8 / 2) / 2)
        assert outcome["moved"]


def _finished_state(max_epochs: int = 2) -> dict:
    engine = Engine(lambda e, b: None)
    engine.run(range(4), max_epochs=max_epochs)
    return dict(engine.state_dict())


def test_a_finished_run_loaded_from_its_state_does_not_run_again() -> None:
    """ignite restarts a finished state from epoch 0: a resumed run would retrain and overwrite."""
    engine = Engine(lambda e, b: None)
    events: list[str] = []
    for event in (Events.STARTED, Events.ITERATION_COMPLETED, Events.COMPLETED):
        engine.add_event_handler(event, lambda e, name=event.name: events.append(name))
    engine.load_state_dict(_finished_state())
    state = engine.run(range(4), max_epochs=2)
    assert (state.epoch, state.iteration, events) == (2, 8, [])


def test_a_finished_run_continues_to_a_larger_max_epochs() -> None:
    engine = Engine(lambda e, b: None)
    iterations: list[int] = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: iterations.append(e.state.iteration))
    engine.load_state_dict(_finished_state())
    state = engine.run(range(4), max_epochs=3)
    assert (state.epoch, state.iteration, iterations) == (3, 12, [9, 10, 11, 12])


def test_only_a_loaded_state_is_kept_a_finished_engine_runs_again_as_in_ignite() -> None:
    engine = Engine(lambda e, b: None)
    engine.run(range(4), max_epochs=2)
    iterations: list[int] = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: iterations.append(e.state.iteration))
    assert engine.run(range(4), max_epochs=2).iteration == 8
    assert iterations == list(range(1, 9))  # a fresh run from epoch 0, as ignite does
