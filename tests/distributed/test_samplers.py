"""TrainSampler and EvalSampler: shards that are disjoint, complete, seeded and exact."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _dist_workers import default_placement, indices_seen_by_engine

from unison.distributed import EvalSampler, TrainSampler
from unison.testing import run_distributed


def _shards(size: int, world_size: int, epoch: int = 0, **kwargs) -> list[list[int]]:
    shards = []
    for rank in range(world_size):
        sampler = TrainSampler(range(size), rank=rank, world_size=world_size, **kwargs)
        sampler.set_epoch(epoch)
        shard = list(sampler)
        assert len(shard) == len(sampler)
        shards.append(shard)
    return shards


# --- TrainSampler ------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_train_order_changes_with_the_epoch_and_comes_back(world_size):
    by_epoch = [_shards(30, world_size, epoch=e, seed=5) for e in range(4)]
    for rank in range(world_size):
        orders = [tuple(shards[rank]) for shards in by_epoch]
        assert len(set(orders)) == len(orders), f"rank {rank} repeated an order across epochs"
    # The order is a function of the epoch: epoch 1 again gives epoch 1's order.
    assert _shards(30, world_size, epoch=1, seed=5) == by_epoch[1]


@pytest.mark.parametrize("size, world_size", [(12, 2), (12, 3), (12, 4), (30, 3), (7, 7)])
def test_train_shards_are_disjoint_and_cover_when_size_divides(size, world_size):
    for epoch in range(3):
        shards = _shards(size, world_size, epoch=epoch, seed=1)
        assert [len(s) for s in shards] == [size // world_size] * world_size
        flat = [i for s in shards for i in s]
        assert sorted(flat) == list(range(size)), f"epoch {epoch}: not a partition"


@pytest.mark.parametrize("size, world_size", [(10, 3), (11, 4), (2, 3), (1, 2), (5, 2)])
def test_train_pads_to_equal_shards_that_still_cover(size, world_size):
    expected_len = -(-size // world_size)  # ceil
    for epoch in range(2):
        shards = _shards(size, world_size, epoch=epoch, seed=2)
        assert [len(s) for s in shards] == [expected_len] * world_size
        counts = Counter(i for s in shards for i in s)
        assert set(counts) == set(range(size)), "some sample is never drawn"
        # Only the padding repeats samples: expected_len * world_size - size extra draws.
        assert sum(counts.values()) - size == expected_len * world_size - size
        assert all(len(set(s)) == len(s) for s in shards)


@pytest.mark.parametrize("size, world_size", [(10, 3), (11, 4), (12, 5), (12, 3)])
def test_train_drop_last_drops_the_tail_and_keeps_shards_disjoint(size, world_size):
    for epoch in range(2):
        shards = _shards(size, world_size, epoch=epoch, seed=4, drop_last=True)
        assert [len(s) for s in shards] == [size // world_size] * world_size
        flat = [i for s in shards for i in s]
        assert len(set(flat)) == len(flat) == (size // world_size) * world_size
        assert set(flat) <= set(range(size))
    # Over epochs, the dropped samples change: every sample is drawn sooner or later.
    seen = {
        i
        for epoch in range(20)
        for s in _shards(size, world_size, epoch=epoch, seed=4, drop_last=True)
        for i in s
    }
    assert seen == set(range(size))


def test_train_drop_last_with_fewer_samples_than_ranks_raises():
    with pytest.raises(ValueError, match="drop_last"):
        TrainSampler(range(2), rank=0, world_size=3, drop_last=True)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_train_shards_are_slices_of_one_permutation_of_seed_and_epoch(world_size):
    size = 24
    for epoch in (0, 3):
        single = TrainSampler(range(size), seed=9, rank=0, world_size=1)
        single.set_epoch(epoch)
        permutation = list(single)
        assert sorted(permutation) == list(range(size)) and permutation != list(range(size))
        for rank in range(world_size):
            # Whatever the global RNG state on this rank, the shard is the same slice.
            torch.manual_seed(1000 * rank + epoch)
            sampler = TrainSampler(range(size), seed=9, rank=rank, world_size=world_size)
            sampler.set_epoch(epoch)
            torch.rand(rank + 1)
            assert list(sampler) == permutation[rank::world_size]
    other_seed = TrainSampler(range(size), seed=10, rank=0, world_size=1)
    assert list(other_seed) != list(TrainSampler(range(size), seed=9, rank=0, world_size=1))


def test_train_without_shuffle_keeps_the_dataset_order():
    for epoch in range(3):
        shards = _shards(10, 2, epoch=epoch, shuffle=False)
        assert shards == [list(range(0, 10, 2)), list(range(1, 10, 2))]
    # Padding without shuffle wraps around to the first samples.
    assert _shards(5, 2, shuffle=False) == [[0, 2, 4], [1, 3, 0]]


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        ({"rank": 3, "world_size": 3}, "rank"),
        ({"rank": -1, "world_size": 2}, "rank"),
        ({"rank": 1}, "rank"),  # no process group: world size 1
        ({"rank": 0, "world_size": 0}, "world_size"),
    ],
)
@pytest.mark.parametrize("sampler_cls", [TrainSampler, EvalSampler])
def test_sampler_placement_errors_name_the_argument(sampler_cls, kwargs, argument):
    with pytest.raises(ValueError, match=argument) as err:
        sampler_cls(range(10), **kwargs)
    if "rank" in kwargs and argument == "rank":
        assert str(kwargs["rank"]) in str(err.value)


@pytest.mark.parametrize("drop_last", [False, True])
def test_train_empty_dataset_raises_naming_the_dataset(drop_last):
    with pytest.raises(ValueError, match="dataset") as err:
        TrainSampler([], rank=0, world_size=1, drop_last=drop_last)
    assert "0 samples" in str(err.value)


@pytest.mark.parametrize("sampler_cls", [TrainSampler, EvalSampler])
def test_sampler_needs_a_sized_dataset(sampler_cls):
    with pytest.raises(TypeError, match="__len__"):
        sampler_cls(iter(range(3)), rank=0, world_size=1)


def test_samplers_default_to_a_single_rank_without_process_group():
    assert (TrainSampler(range(4)).rank, TrainSampler(range(4)).world_size) == (0, 1)
    assert list(EvalSampler(range(4))) == [0, 1, 2, 3]


# --- EvalSampler -------------------------------------------------------------------------------------


@pytest.mark.parametrize("size", [101, 7, 2, 0])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_eval_every_index_exactly_once_without_padding(size, world_size):
    shards = [list(EvalSampler(range(size), rank=r, world_size=world_size)) for r in range(world_size)]
    lengths = [len(EvalSampler(range(size), rank=r, world_size=world_size)) for r in range(world_size)]
    assert lengths == [len(s) for s in shards]
    flat = [i for s in shards for i in s]
    assert sorted(flat) == list(range(size))
    assert len(flat) == size  # no padding
    assert max(lengths) - min(lengths) <= 1
    if size < world_size:
        assert lengths.count(0) == world_size - size
    # Sample i is item i // world_size of rank i % world_size.
    for i in range(size):
        assert shards[i % world_size][i // world_size] == i


# --- with ranks ------------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize("nproc", [2, 3])
def test_engine_calls_set_epoch_on_the_training_sampler(nproc):
    size, epochs, seed = 12, 3, 17
    seen = run_distributed(indices_seen_by_engine, size, 2, epochs, seed, nproc=nproc)

    for epoch in range(1, epochs + 1):
        shards = [rank_seen[epoch] for rank_seen in seen]
        assert sorted(i for s in shards for i in s) == list(range(size)), f"epoch {epoch}: not a partition"
        for rank, shard in enumerate(shards):
            # The engine's epoch e uses the sampler's epoch e - 1.
            expected = TrainSampler(range(size), seed=seed, rank=rank, world_size=nproc)
            expected.set_epoch(epoch - 1)
            assert shard == list(expected), f"rank {rank}, epoch {epoch}"
    for rank_seen in seen:
        orders = [tuple(rank_seen[e]) for e in range(1, epochs + 1)]
        assert len(set(orders)) == epochs, "an epoch repeated the order of another: set_epoch was not called"


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_samplers_take_rank_and_world_size_from_the_process_group():
    results = run_distributed(default_placement, nproc=3)
    for rank, result in enumerate(results):
        assert result == {"train": (rank, 3), "eval": (rank, 3), "rank": rank, "world_size": 3}


@pytest.mark.parametrize("size", [1, 5, 10, 17])
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_train_sampler_is_torchs_distributed_sampler(size: int, world: int, drop_last: bool) -> None:
    from torch.utils.data import DistributedSampler

    if drop_last and size < world:
        pytest.skip("no sample for some rank: refused, tested elsewhere")
    for rank in range(world):
        ours = TrainSampler(range(size), seed=7, drop_last=drop_last, rank=rank, world_size=world)
        theirs = DistributedSampler(range(size), num_replicas=world, rank=rank, seed=7, drop_last=drop_last)
        assert isinstance(ours, DistributedSampler)
        for epoch in (0, 3):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
