"""TrainSampler's position: saved with a checkpoint, it makes a resumed epoch skip, without
loading them, exactly the samples the stopped run had trained on."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The training set-ups are shared with the checkpoint tests in tests/handlers/.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "handlers"))
from _ckpt_workers import BATCH, SIZE, epoch_length, loaded_around_a_resume  # noqa: E402

from unison.distributed import TrainSampler  # noqa: E402
from unison.testing import run_distributed  # noqa: E402


def shard(size: int, epoch: int, rank: int, world_size: int, seed: int = 0) -> list[int]:
    """Rank ``rank``'s indices of ``epoch`` (0-based), from a fresh sampler."""
    sampler = TrainSampler(range(size), seed=seed, rank=rank, world_size=world_size)
    sampler.set_epoch(epoch)
    return list(sampler)


def saved_state(
    size: int, epoch: int, consumed: int, *, rank: int = 0, world_size: int = 1, seed: int = 0
) -> dict:
    sampler = TrainSampler(range(size), seed=seed, rank=rank, world_size=world_size)
    sampler.set_epoch(epoch)
    return sampler.state_dict(consumed=consumed)


# --- state_dict / load_state_dict -----------------------------------------------------------------


def test_state_dict_holds_the_position_and_the_sharding():
    sampler = TrainSampler(range(11), seed=7, rank=1, world_size=3, drop_last=True, shuffle=True)
    sampler.set_epoch(4)
    assert sampler.state_dict(consumed=2) == {
        "seed": 7,
        "epoch": 4,
        "consumed": 2,
        "dataset_size": 11,
        "world_size": 3,
        "shuffle": True,
        "drop_last": True,
        "layout_consumed": 0,  # the shards start at the epoch's start (see test_elastic.py)
        "layout_extra": [],
        "global_consumed": 6,  # 3 ranks x 2 samples: the first 6 of the epoch's order
        "global_extra": [],
    }
    assert sampler.state_dict()["consumed"] == 0


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("consumed", [1, 4])
def test_the_saved_epoch_resumes_after_the_consumed_samples_and_the_next_is_whole(world_size, consumed):
    size, epoch = 14, 2
    for rank in range(world_size):
        resumed = TrainSampler(range(size), seed=0, rank=rank, world_size=world_size)
        resumed.load_state_dict(saved_state(size, epoch, consumed, rank=rank, world_size=world_size))
        resumed.set_epoch(epoch)  # what the engine does as the epoch starts
        full = shard(size, epoch, rank, world_size)
        assert list(resumed) == full[consumed:]
        assert len(resumed) == len(full) - consumed and resumed.start == consumed
        resumed.set_epoch(epoch + 1)
        assert list(resumed) == shard(size, epoch + 1, rank, world_size), (
            "the skip leaked into the next epoch"
        )
        assert len(resumed) == len(full)


def test_the_skip_belongs_to_the_saved_epoch_only():
    size, epoch, consumed = 12, 3, 5
    sampler = TrainSampler(range(size), seed=0)
    sampler.load_state_dict(saved_state(size, epoch, consumed))
    sampler.set_epoch(epoch + 2)  # another epoch first: nothing to skip
    assert list(sampler) == shard(size, epoch + 2, 0, 1)
    sampler.set_epoch(epoch)  # and the skip is gone for good once another epoch was selected
    assert list(sampler) == shard(size, epoch, 0, 1)


def test_the_saved_seed_and_order_come_back():
    size, epoch, consumed = 12, 1, 3
    sampler = TrainSampler(range(size), seed=99)
    sampler.load_state_dict(saved_state(size, epoch, consumed, seed=5))
    sampler.set_epoch(epoch)
    assert list(sampler) == shard(size, epoch, 0, 1, seed=5)[consumed:]


def test_another_dataset_size_is_refused_naming_both_sizes():
    sampler = TrainSampler(range(13))
    with pytest.raises(ValueError, match="dataset of 12 samples, this one has 13"):
        sampler.load_state_dict(saved_state(12, 1, 0))
    assert sampler.start == 0 and sampler.epoch == 0, "a refused state changed the sampler"


def test_a_mid_epoch_position_at_another_world_size_continues_the_permutation():
    size, epoch, consumed = 12, 1, 2
    order = TrainSampler(range(size), rank=0, world_size=1)
    order.set_epoch(epoch)
    rest = list(order)[2 * consumed :]  # 2 ranks took 2 samples each: the first 4 of the order
    shards = []
    for rank in range(3):
        sampler = TrainSampler(range(size), rank=rank, world_size=3)
        sampler.load_state_dict(saved_state(size, epoch, consumed, rank=0, world_size=2))
        sampler.set_epoch(epoch)
        shards.append(list(sampler))
        assert sampler.start == 0 and len(sampler) == len(shards[-1])
    padded = rest + rest[:1]  # 8 samples to go over 3 ranks: padded with their first, as torch pads
    assert shards == [padded[r::3] for r in range(3)]


@pytest.mark.parametrize("saved_world, new_world", [(2, 3), (3, 1), (1, 2)])
def test_at_an_epoch_boundary_the_world_size_may_change(saved_world, new_world):
    size, epoch = 12, 2
    for rank in range(new_world):
        sampler = TrainSampler(range(size), rank=rank, world_size=new_world)
        sampler.load_state_dict(saved_state(size, epoch, 0, world_size=saved_world))
        sampler.set_epoch(epoch)
        assert list(sampler) == shard(size, epoch, rank, new_world)


# --- through a checkpoint: skipped samples are never loaded ---------------------------------------


def check_loaded(result: dict, stop: int) -> None:
    rank, world_size = result["rank"], result["world_size"]
    length = epoch_length(SIZE, BATCH, world_size)
    epoch = stop // length + 1  # 1-based epoch the run stopped in
    consumed = (stop - (epoch - 1) * length) * BATCH
    assert result["stopped"] == stop
    order = shard(SIZE, epoch - 1, rank, world_size)
    assert result["before"][epoch] == order[:consumed], "the stopped run did not load the start of its shard"
    assert result["after"][epoch] == order[consumed:], (
        f"rank {rank}: the resumed epoch loaded {result['after'][epoch]}, expected the unconsumed part "
        f"{order[consumed:]} of the shard"
    )
    assert not set(result["after"][epoch]) & set(order[:consumed]), "a consumed sample was loaded again"
    for later in range(epoch + 1, max(result["after"]) + 1):
        assert result["after"][later] == shard(SIZE, later - 1, rank, world_size)
    assert min(result["after"]) == epoch, "the resumed run loaded samples of an epoch already done"


def test_a_mid_epoch_resume_loads_only_the_unconsumed_samples_on_one_rank(tmp_path):
    stop = epoch_length(SIZE, BATCH, 1) + 2
    check_loaded(loaded_around_a_resume(str(tmp_path), stop=stop, max_epochs=3), stop)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_mid_epoch_resume_loads_only_the_unconsumed_samples_on_two_ranks(tmp_path):
    stop = epoch_length(SIZE, BATCH, 2) + 1
    results = run_distributed(
        loaded_around_a_resume, str(tmp_path), stop=stop, max_epochs=3, nproc=2, timeout=100
    )
    for result in results:
        check_loaded(result, stop)
    # together, the two ranks' shards of the resumed epoch cover the dataset
    epoch = stop // epoch_length(SIZE, BATCH, 2) + 1
    seen = [i for r in results for i in r["before"][epoch] + r["after"][epoch]]
    assert sorted(seen) == list(range(SIZE))
