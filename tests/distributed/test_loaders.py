"""split_dataset and prepare_loaders: identical splits on every rank, per-rank batches."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from _dist_workers import loader_shapes, split_on_rank
from torch.utils.data import Sampler, TensorDataset

from unison.distributed import EvalSampler, TrainSampler, prepare_loaders, split_dataset
from unison.testing import run_distributed

# --- split_dataset -----------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_split_is_identical_on_every_rank_whatever_the_global_rng():
    size, seeds = 50, [0, 1, 123]
    results = run_distributed(split_on_rank, size, [0.8, 0.2], seeds, nproc=2)

    for seed in seeds:
        on_rank = [result[seed] for result in results]
        assert on_rank[0] == on_rank[1], f"seed {seed}: the ranks split differently"
        train, val = on_rank[0]
        assert (len(train), len(val)) == (40, 10)
        assert not set(train) & set(val)
        assert sorted(train + val) == list(range(size))
        # Here, in a process whose global RNG is in yet another state, the split is the same.
        torch.manual_seed(999)
        here = split_dataset(list(range(size)), [0.8, 0.2], seed=seed)
        assert [list(here[0]), list(here[1])] == [train, val]
    # The seed matters: different seeds give different splits.
    assert len({tuple(results[0][seed][1]) for seed in seeds}) == len(seeds)


@pytest.mark.parametrize(
    "size, fractions",
    [
        (10, [0.5, 0.5]),
        (7, [0.5, 0.5]),
        (10, [1 / 3] * 3),
        (101, [0.7, 0.2, 0.1]),
        (5, [1.0]),
        (3, [0.1, 0.9]),
        # 0.29 * 100 is 28.999999999999996 in floating point, but 29 of 100 samples is exact.
        (100, [0.71, 0.29]),
        (100, [0.43, 0.57]),
    ],
)
def test_split_sizes_are_the_rounded_down_fractions_and_cover(size, fractions):
    subsets = split_dataset(list(range(size)), fractions, seed=0)
    lengths = [len(s) for s in subsets]
    assert sum(lengths) == size
    # Each fraction as the decimal it was written as, times the size, rounded down; the
    # rounding leftovers go to the first subset.
    exact = [math.floor(Fraction(f).limit_denominator(10**6) * size) for f in fractions]
    assert lengths[1:] == exact[1:], f"{fractions} of {size} gave {lengths}"
    flat = [s[i] for s in subsets for i in range(len(s))]
    assert sorted(flat) == list(range(size))


@pytest.mark.parametrize("fractions", [[0.5, 0.6], [0.5, 0.4], [1.2, -0.2], [], [0.5, float("nan")]])
def test_split_bad_fractions_raise_naming_them(fractions):
    with pytest.raises(ValueError, match="fractions"):
        split_dataset(list(range(10)), fractions, seed=0)


@pytest.mark.parametrize("seed", [None, 1.5, "0", True])
def test_split_seed_must_be_an_int(seed):
    with pytest.raises(TypeError, match="seed"):
        split_dataset(list(range(10)), [0.5, 0.5], seed=seed)


# --- prepare_loaders ---------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_batch_size_is_per_rank_and_samplers_shard(nproc):
    train_size, val_size, batch, val_batch = 20, 7, 3, 2
    results = run_distributed(loader_shapes, train_size, val_size, batch, val_batch, nproc=nproc)

    per_rank_train = math.ceil(train_size / nproc)
    expected_train = [min(batch, per_rank_train - i) for i in range(0, per_rank_train, batch)]
    val_indices = []
    for rank, result in enumerate(results):
        assert result["train_sampler"] == ("TrainSampler", rank, nproc)
        assert result["val_sampler"] == ("EvalSampler", rank, nproc)
        assert result["train_batches"] == expected_train
        per_rank_val = len(range(rank, val_size, nproc))
        assert result["val_batches"] == [
            min(val_batch, per_rank_val - i) for i in range(0, per_rank_val, val_batch)
        ]
        val_indices += result["val_indices"]
    assert sorted(val_indices) == list(range(val_size))


def test_val_batch_size_defaults_to_batch_size_and_none_datasets_give_none():
    train_loader, val_loader = prepare_loaders(None, TensorDataset(torch.arange(10)), batch_size=4)
    assert train_loader is None
    assert [len(b) for (b,) in val_loader] == [4, 4, 2]
    assert isinstance(val_loader.sampler, EvalSampler)
    train_loader, val_loader = prepare_loaders(TensorDataset(torch.arange(10)), batch_size=4)
    assert val_loader is None and isinstance(train_loader.sampler, TrainSampler)


def test_drop_last_drops_the_incomplete_batch():
    train_loader, _ = prepare_loaders(TensorDataset(torch.arange(10)), batch_size=4, drop_last=True)
    assert [len(b) for (b,) in train_loader] == [4, 4]
    assert train_loader.sampler.drop_last


def test_shuffle_false_keeps_the_order_and_seed_sets_the_shuffle():
    data = TensorDataset(torch.arange(12))
    ordered, _ = prepare_loaders(data, batch_size=12, shuffle=False)
    assert next(iter(ordered))[0].tolist() == list(range(12))
    first, _ = prepare_loaders(data, batch_size=12, seed=1)
    again, _ = prepare_loaders(data, batch_size=12, seed=1)
    other, _ = prepare_loaders(data, batch_size=12, seed=2)
    order = next(iter(first))[0].tolist()
    assert order == next(iter(again))[0].tolist()
    assert order != next(iter(other))[0].tolist()
    assert sorted(order) == list(range(12)) and order != list(range(12))


class _FixedOrder(Sampler[int]):
    """A sampler of the user's own, with no set_epoch."""

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class _WithEpoch(_FixedOrder):
    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch


def test_custom_sampler_without_set_epoch_is_refused_when_shuffling():
    data = TensorDataset(torch.arange(6))
    with pytest.raises(TypeError, match="train_sampler") as err:
        prepare_loaders(data, batch_size=2, train_sampler=_FixedOrder([5, 4, 3]))
    assert "set_epoch" in str(err.value) and "_FixedOrder" in str(err.value)

    loader, _ = prepare_loaders(data, batch_size=2, train_sampler=_FixedOrder([5, 4, 3]), shuffle=False)
    assert [b.tolist() for (b,) in loader] == [[5, 4], [3]]

    sampler = _WithEpoch([1, 0])
    loader, _ = prepare_loaders(data, batch_size=2, train_sampler=sampler)
    assert loader.sampler is sampler


def test_custom_sampler_is_used_even_when_it_is_empty_on_this_rank():
    # A user's sampler may hold nothing for some rank (len 0): it is still the one to use,
    # never silently swapped for a TrainSampler over the whole dataset.
    sampler = _WithEpoch([])
    loader, _ = prepare_loaders(TensorDataset(torch.arange(6)), batch_size=2, train_sampler=sampler)
    assert loader.sampler is sampler
    assert [b.tolist() for (b,) in loader] == []


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"batch_size": 0}, "batch_size"),
        ({"batch_size": -2}, "batch_size"),
        ({"batch_size": 2.0}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"batch_size": 2, "val_batch_size": 0}, "val_batch_size"),
    ],
)
def test_bad_batch_sizes_raise_naming_the_argument(kwargs, argument):
    data = TensorDataset(torch.arange(6))
    with pytest.raises(ValueError, match=rf"prepare_loaders\({argument}=") as err:
        prepare_loaders(data, data, **kwargs)
    assert repr(kwargs[argument]) in str(err.value)
