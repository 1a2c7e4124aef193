"""EpochAverage: the mean of a per-iteration value over the epoch and over all ranks."""

from __future__ import annotations

import statistics
import weakref

import pytest
import torch
from ignite.engine import Engine as IgniteEngine
from torch import nn
from torch.nn import functional as F

from unison.distributed import get_rank, prepare_model
from unison.engine import Engine, Events, create_trainer
from unison.metrics import EpochAverage
from unison.testing import run_distributed


def _per_epoch_metric(engine: Engine, name: str) -> list[float]:
    values: list[float] = []
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: values.append(e.state.metrics[name]))
    return values


def _scaled_by_epoch(engine, batch):
    return torch.tensor(float(batch) * engine.state.epoch)


def test_mean_of_each_epoch():
    data = [1.0, 2.0, 4.0, 7.0]
    engine = Engine(_scaled_by_epoch)
    EpochAverage("value").attach(engine)
    seen = _per_epoch_metric(engine, "value")
    engine.run(data, max_epochs=3)
    assert seen == [statistics.fmean(data) * e for e in (1, 2, 3)]
    assert engine.state.metrics["value"] == seen[-1]


def test_plain_numbers_and_output_transform():
    engine = Engine(lambda e, b: {"loss": b, "other": -100.0})
    EpochAverage("loss", output_transform=lambda out: out["loss"]).attach(engine)
    state = engine.run([0.5, 1.5, 4.0])
    assert state.metrics["loss"] == pytest.approx(2.0)


def test_many_iterations():
    """More iterations than are kept before folding into the device sum."""
    n = 2500
    engine = Engine(lambda e, b: torch.tensor(float(b)))
    EpochAverage("value").attach(engine)
    state = engine.run(range(n))
    assert state.metrics["value"] == (n - 1) / 2


def test_keeps_no_autograd_graph_alive():
    """A process function may return a loss that still requires grad (ignite's own examples do); the
    average must not keep each iteration's graph, and with it its activations, until the epoch ends."""
    weight = torch.ones(64, requires_grad=True)
    activations: list[weakref.ref] = []

    def step(engine, batch):
        x = torch.full((64,), float(batch))
        activations.append(weakref.ref(x))
        return (x * weight).sum()  # mul saves x for backward

    engine = Engine(step)
    EpochAverage("loss").attach(engine)
    alive = []

    def count_alive(_):  # no reference cycles here: refcounting frees a dropped graph at once
        alive.append(sum(ref() is not None for ref in activations))

    engine.add_event_handler(Events.ITERATION_COMPLETED, count_alive)
    state = engine.run([1.0, 2.0, 3.0, 4.0, 5.0])
    assert state.metrics["loss"] == 64 * 3.0
    # Only the current iteration's (engine.state.output holds it) may still be alive.
    assert alive == [1] * 5


def test_a_reused_output_buffer_is_averaged_correctly():
    """A step that returns the same tensor each iteration, updated in place (a CUDA-graph replay's
    static output, a preallocated buffer): each iteration's value counts, not the last one five times."""
    buffer = torch.zeros(())

    def step(engine, batch):
        buffer.fill_(batch)
        return buffer

    engine = Engine(step)
    EpochAverage("value").attach(engine)
    data = [1.0, 2.0, 6.0, 3.0, 8.0]
    assert engine.run(data).metrics["value"] == statistics.fmean(data)


def test_attach_twice_is_harmless():
    engine = Engine(_scaled_by_epoch)
    average = EpochAverage("value")
    average.attach(engine)
    average.attach(engine)
    seen = _per_epoch_metric(engine, "value")
    engine.run([1.0, 2.0, 6.0], max_epochs=2)
    assert seen == [3.0, 6.0]
    assert engine.sync_point.contributors().count(average) == 1
    updates = [h for h, _, _ in engine._event_handlers[Events.ITERATION_COMPLETED] if h == average.update]
    assert len(updates) == 1


def test_needs_a_unison_engine():
    engine = IgniteEngine(lambda e, b: b)
    with pytest.raises(TypeError, match="EpochAverage needs a unison Engine .* Got Engine"):
        EpochAverage().attach(engine)
    assert all(len(handlers) == 0 for handlers in engine._event_handlers.values())


@pytest.mark.parametrize("name", ["", None, 3])
def test_name_must_be_a_string(name):
    with pytest.raises(ValueError, match="EpochAverage"):
        EpochAverage(name)


def test_trainer_loss_is_the_mean_of_the_iteration_losses():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    outputs: list[list[float]] = []
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: outputs.append([]))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs[-1].append(e.state.output.item()))
    seen = _per_epoch_metric(trainer, "loss")
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(3)]
    trainer.run(data, max_epochs=2)
    assert seen == pytest.approx([statistics.fmean(epoch) for epoch in outputs], rel=1e-12)
    assert seen[0] != seen[1]  # the loss went down: each epoch is averaged on its own


# --- several ranks ---------------------------------------------------------------------------------

RANK_DATA = [[1.0, 2.0, 3.0, 4.0], [10.0], []]  # rank 2 has no data at all


def uneven_worker() -> list[float]:
    engine = Engine(_scaled_by_epoch)
    EpochAverage("value").attach(engine)
    seen = _per_epoch_metric(engine, "value")
    engine.run(RANK_DATA[get_rank()], max_epochs=2)
    return seen


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_mean_over_every_iteration_of_every_rank():
    results = run_distributed(uneven_worker, nproc=3, timeout=45)
    values = [v for rank in RANK_DATA for v in rank]
    expected = [statistics.fmean(values) * epoch for epoch in (1, 2)]
    # Not the mean of the ranks' means, which would weigh rank 1's single value as much as 4.
    assert expected[0] != statistics.fmean(statistics.fmean(r) for r in RANK_DATA if r)
    assert results == [expected] * 3


def trainer_loss_worker() -> dict:
    rank = get_rank()
    torch.manual_seed(0)
    model = prepare_model(nn.Linear(3, 1))
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    gen = torch.Generator().manual_seed(rank)
    data = [
        (torch.randn(4, 3, generator=gen), torch.randn(4, 1, generator=gen) * (rank + 1)) for _ in range(3)
    ]
    outputs: list[list[float]] = []
    trainer.add_event_handler(Events.EPOCH_STARTED, lambda e: outputs.append([]))
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs[-1].append(e.state.output.item()))
    seen = _per_epoch_metric(trainer, "loss")
    trainer.run(data, max_epochs=2)
    return {"outputs": outputs, "metric": seen}


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_trainer_loss_is_the_mean_over_ranks_and_iterations():
    results = run_distributed(trainer_loss_worker, nproc=2, timeout=45)
    for epoch in range(2):
        losses = [loss for result in results for loss in result["outputs"][epoch]]
        assert len(losses) == 6
        expected = statistics.fmean(losses)
        own = [statistics.fmean(result["outputs"][epoch]) for result in results]
        assert own[0] != pytest.approx(own[1])  # the ranks' losses differ: the reduction shows
        for result in results:
            assert result["metric"][epoch] == pytest.approx(expected, rel=1e-12)
