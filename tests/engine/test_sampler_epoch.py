"""set_epoch: the engine tells the data's sampler which epoch it is, 0-based."""

from __future__ import annotations

import pytest
import torch
from ignite.engine import Engine as IgniteEngine
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, SequentialSampler

from unison.distributed import TrainSampler
from unison.distributed.samplers import samplers_with_set_epoch, set_sampler_epoch
from unison.engine import Engine, Events

N = 10
EPOCH_LENGTH = 5  # batches of 2 over 10 samples


class RecordingSampler(Sampler[int]):
    def __init__(self, n: int = N) -> None:
        self.n = n
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class RecordingBatchSampler(Sampler[list[int]]):
    """A custom batch sampler (bucketing, say) with a set_epoch of its own."""

    def __init__(self, sampler: Sampler[int], batch_size: int = 2) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def __iter__(self):
        batch = []
        for i in self.sampler:
            batch.append(i)
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch:
            yield batch

    def __len__(self) -> int:
        return (len(self.sampler) + self.batch_size - 1) // self.batch_size


DATASET = list(range(N))


def _loader_with_sampler():
    sampler = RecordingSampler()
    return DataLoader(DATASET, batch_size=2, sampler=sampler), [sampler]


def _loader_with_batch_sampler():
    sampler = RecordingSampler()
    return DataLoader(DATASET, batch_sampler=BatchSampler(sampler, 2, drop_last=False)), [sampler]


def _loader_with_custom_batch_sampler():
    sampler = RecordingSampler()
    batch_sampler = RecordingBatchSampler(sampler)
    return DataLoader(DATASET, batch_sampler=batch_sampler), [batch_sampler, sampler]


LOADERS = {
    "sampler": _loader_with_sampler,
    "batch_sampler": _loader_with_batch_sampler,
    "custom_batch_sampler": _loader_with_custom_batch_sampler,
}


@pytest.mark.parametrize("make", LOADERS.values(), ids=LOADERS.keys())
def test_set_epoch_called_once_per_epoch_on_each_sampler(make):
    loader, samplers = make()
    state = Engine(lambda e, b: b).run(loader, max_epochs=3)
    assert state.epoch == 3
    for sampler in samplers:
        assert sampler.epochs == [0, 1, 2], type(sampler).__name__


@pytest.mark.parametrize("make", LOADERS.values(), ids=LOADERS.keys())
def test_samplers_are_found(make):
    loader, samplers = make()
    found = samplers_with_set_epoch(loader)
    assert len(found) == len(samplers)
    assert all(any(f is s for f in found) for s in samplers)


def _first_epoch_of(iteration: int, epoch_length: int) -> int:
    """0-based epoch of a 1-based iteration."""
    return (iteration - 1) // epoch_length


@pytest.mark.parametrize(
    ("state_dict", "first_iteration"),
    [
        ({"iteration": 7, "epoch_length": EPOCH_LENGTH, "max_epochs": 3}, 8),
        ({"iteration": 5, "epoch_length": EPOCH_LENGTH, "max_epochs": 3}, 6),
        ({"epoch": 2, "epoch_length": EPOCH_LENGTH, "max_epochs": 3}, 2 * EPOCH_LENGTH + 1),
    ],
    ids=["mid-epoch", "epoch-boundary", "epoch"],
)
def test_resumed_run_sets_the_epoch_of_its_first_iteration(state_dict, first_iteration):
    loader, (sampler,) = _loader_with_sampler()
    engine = Engine(lambda e, b: b)
    engine.load_state_dict(state_dict)
    engine.run(loader)
    first = _first_epoch_of(first_iteration, EPOCH_LENGTH)
    assert sampler.epochs == list(range(first, 3))
    assert sampler.epochs  # the run did go on


def test_runs_before_user_epoch_started_handlers():
    loader, (sampler,) = _loader_with_sampler()
    engine = Engine(lambda e, b: b)
    seen = []
    engine.add_event_handler(
        Events.EPOCH_STARTED, lambda e: seen.append((e.state.epoch, list(sampler.epochs)))
    )
    engine.run(loader, max_epochs=3)
    assert seen == [(1, [0]), (2, [0, 1]), (3, [0, 1, 2])]


def test_data_without_a_sampler_is_fine():
    def gen():
        yield from range(4)

    assert samplers_with_set_epoch([1, 2, 3]) == []
    assert samplers_with_set_epoch(gen()) == []
    assert samplers_with_set_epoch(DataLoader(DATASET, batch_size=2)) == []
    assert samplers_with_set_epoch(None) == []

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(4))

    assert samplers_with_set_epoch(DataLoader(Stream(), batch_size=2)) == []
    assert Engine(lambda e, b: b).run([1, 2, 3], max_epochs=2).iteration == 6
    assert Engine(lambda e, b: b).run(gen(), max_epochs=1).iteration == 4
    assert Engine(lambda e, b: b).run(None, max_epochs=2, epoch_length=3).iteration == 6
    assert Engine(lambda e, b: b).run(DataLoader(Stream(), batch_size=2), max_epochs=2).iteration == 4


def test_train_sampler_order_changes_with_the_epoch():
    dataset = torch.arange(N)
    sampler = TrainSampler(dataset, seed=3, rank=0, world_size=1)
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    seen: dict[int, list[int]] = {}
    engine = Engine(lambda e, b: seen.setdefault(e.state.epoch, []).extend(b.tolist()))
    engine.run(loader, max_epochs=3)
    for epoch in (1, 2, 3):
        reference = TrainSampler(dataset, seed=3, rank=0, world_size=1)
        reference.set_epoch(epoch - 1)
        assert seen[epoch] == list(reference), f"epoch {epoch}"
    assert seen[1] != seen[2] or seen[2] != seen[3]


def test_set_sampler_epoch_on_ignites_engine():
    loader, (sampler,) = _loader_with_sampler()
    engine = IgniteEngine(lambda e, b: b)
    engine.add_event_handler(Events.EPOCH_STARTED, lambda e: set_sampler_epoch(e.state.dataloader, e.state.epoch - 1))
    engine.run(loader, max_epochs=2)
    assert sampler.epochs == [0, 1]


def test_unisons_engine_sets_the_epoch_without_a_handler():
    loader, (sampler,) = _loader_with_sampler()
    engine = Engine(lambda e, b: b)
    assert not engine._event_handlers[Events.EPOCH_STARTED]  # engine behaviour, not a handler
    engine.run(loader, max_epochs=2)
    assert sampler.epochs == [0, 1]


def test_set_data_switches_the_sampler():
    first, (a,) = _loader_with_sampler()
    second, (b,) = _loader_with_sampler()
    engine = Engine(lambda e, b_: b_)
    engine.add_event_handler(Events.EPOCH_COMPLETED(once=1), lambda e: e.set_data(second))
    engine.run(first, max_epochs=3)
    assert a.epochs == [0]
    assert b.epochs == [1, 2]


def test_plain_sequential_sampler_untouched():
    sampler = SequentialSampler(DATASET)
    loader = DataLoader(DATASET, batch_size=2, sampler=sampler)
    assert Engine(lambda e, b: b).run(loader, max_epochs=2).iteration == 2 * EPOCH_LENGTH
