"""Resuming mid-epoch at another world size or per-rank batch size: the interrupted epoch goes
on from the first sample of its permutation not yet consumed, sharded over the new ranks.

The truth is a comparison (DESIGN rule 9): the pure remainder computation against a brute
force built on torch's own ``DistributedSampler``; the samples every rank loads across a
stopped run and its resume against the epoch's permutation; the epoch after the resume
against a fresh sampler at the new world size.
"""

from __future__ import annotations

import itertools
import math
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "handlers"))
from _ckpt_workers import build_run, stop_at  # noqa: E402

from unison.distributed import TrainSampler, get_rank, get_world_size  # noqa: E402
from unison.distributed.samplers import (  # noqa: E402
    advance_position,
    epoch_order,
    layout_order,
    remaining_positions,
)
from unison.testing import run_distributed  # noqa: E402

# --- the pure remainder, against a brute force ------------------------------------------------------


def brute_seen(size: int, world: int, drop_last: bool, counts: list[int], seed: int, epoch: int) -> set[int]:
    """The samples torch's DistributedSampler hands rank ``r`` in its first ``counts[r]`` draws."""
    seen: set[int] = set()
    for rank, count in enumerate(counts):
        sampler = DistributedSampler(range(size), world, rank, shuffle=True, seed=seed, drop_last=drop_last)
        sampler.set_epoch(epoch)
        seen.update(list(sampler)[:count])
    return seen


def brute_shards(rest: list[int], world: int, drop_last: bool) -> list[list[int]]:
    """``rest`` sharded over ``world`` ranks as torch's DistributedSampler shards a dataset (no shuffle)."""
    if not rest:
        return [[] for _ in range(world)]
    shards = []
    for rank in range(world):
        sampler = DistributedSampler(range(len(rest)), world, rank, shuffle=False, drop_last=drop_last)
        shards.append([rest[i] for i in sampler])
    return shards


def resumed_shards(
    size: int, saved: int, new: int, counts: list[int], drop_last: bool, new_drop: bool
) -> list:
    seed, epoch = 3, 2
    state = {}
    for rank in range(saved):
        sampler = TrainSampler(range(size), seed=seed, rank=rank, world_size=saved, drop_last=drop_last)
        sampler.set_epoch(epoch)
        state = sampler.state_dict(consumed=counts[0], consumed_by_rank=counts)
    out = []
    for rank in range(new):
        sampler = TrainSampler(range(size), seed=0, rank=rank, world_size=new, drop_last=new_drop)
        sampler.load_state_dict({**state, "consumed": counts[rank] if rank < saved else 0})
        sampler.set_epoch(epoch)
        out.append(list(sampler))
        assert len(sampler) == len(out[-1])
    return out


CASES = [
    (size, saved, new, drop, new_drop)
    for size in (1, 2, 5, 7, 12, 13)
    for saved, new in ((1, 2), (2, 1), (2, 3), (3, 2), (3, 5), (4, 3), (2, 2))
    for drop, new_drop in ((False, False), (True, True), (False, True))
    if (size // saved if drop else 1) and (size // new if new_drop else 1) and size >= 1
]


@pytest.mark.parametrize("size, saved, new, drop, new_drop", CASES)
def test_the_remainder_is_the_unconsumed_permutation_sharded_anew(size, saved, new, drop, new_drop):
    seed, epoch = 3, 2
    shard = len(DistributedSampler(range(size), saved, 0, drop_last=drop))
    order = epoch_order(size, seed=seed, epoch=epoch, shuffle=True)
    count_sets = {tuple([c] * saved) for c in range(shard + 1)}
    count_sets |= set(itertools.islice(itertools.product(range(shard + 1), repeat=saved), 60))
    for counts in map(list, count_sets):
        seen = brute_seen(size, saved, drop, counts, seed, epoch)
        rest = [i for i in order if i not in seen]
        expected = brute_shards(rest, new, new_drop)
        if saved == new and drop == new_drop:
            # the same sharding: every rank skips its own count (the uninterrupted order, bitwise)
            expected = []
            for r in range(saved):
                s = DistributedSampler(range(size), saved, r, seed=seed, drop_last=drop)
                s.set_epoch(epoch)
                expected.append(list(s)[counts[r] :])
        got = resumed_shards(size, saved, new, counts, drop, new_drop)
        assert got == expected, (counts, got, expected)
        if saved != new or drop != new_drop:
            resumed = [i for s in got for i in s]
            padding = len(resumed) - len(set(resumed))
            assert not set(resumed) & seen, "a consumed sample is given out again"
            assert padding < new, "more duplicates than the padding of one round"
            dropped = set(order) - seen - set(resumed)
            assert len(dropped) < new and (new_drop or not dropped), "a sample was skipped"


def test_advance_position_is_composable_and_marks_padding_seen():
    # 5 samples on 2 ranks: the padded order is [0 1 2 3 4 0]; rank 1 took positions 1, 3, 5 (= 0).
    assert advance_position(5, 0, [], world_size=2, drop_last=False, counts=[0, 3]) == (2, [3])
    rest = remaining_positions(5, 2, [3])
    assert rest == [2, 4]
    # then 3 ranks over [2, 4] (padded [2, 4, 2]): rank 0 and 1 each took one
    assert advance_position(5, 2, [3], world_size=3, drop_last=False, counts=[1, 1, 0]) == (5, [])
    assert layout_order([2, 4], 3, drop_last=False) == [2, 4, 2]
    assert layout_order([2, 4], 3, drop_last=True) == []


def test_state_dict_stores_the_global_position():
    sampler = TrainSampler(range(11), seed=7, rank=1, world_size=3)
    sampler.set_epoch(4)
    state = sampler.state_dict(consumed=2)
    assert (state["global_consumed"], state["global_extra"]) == (6, [])
    assert (state["layout_consumed"], state["layout_extra"]) == (0, [])
    uneven = sampler.state_dict(consumed=2, consumed_by_rank=[2, 1, 2])
    assert (uneven["global_consumed"], uneven["global_extra"]) == (4, [5])


# --- through checkpoints at 1, 2 and 3 ranks ----------------------------------------------------------

SIZE, BATCH = 20, 2


def elastic_run(folder: str, phase: str, stop: int, max_epochs: int, batch_size: int) -> dict[str, Any]:
    """``phase="stop"``: train and stop after iteration ``stop`` (a checkpoint at the end);
    ``phase="resume"``: resume from the folder and finish. Returns what this rank loaded."""
    run = build_run(folder, size=SIZE, batch_size=batch_size, checkpoint={"every_epochs": None})
    if phase == "stop":
        stop_at(run.trainer, stop)
    else:
        run.checkpoint.resume("auto")
    run.trainer.run(run.loader, max_epochs=max_epochs)
    state = run.trainer.state
    return {
        "rank": get_rank(),
        "world_size": get_world_size(),
        "loaded": run.per_epoch_loaded,
        "iteration": state.iteration,
        "epoch": state.epoch,
        "epoch_length": state.epoch_length,
    }


def run_at(nproc: int, *args: Any) -> list[dict[str, Any]]:
    if nproc == 1:
        return [elastic_run(*args)]
    return run_distributed(elastic_run, *args, nproc=nproc, timeout=150)


def check_elastic(stopped: list[dict], resumed: list[dict], epoch: int, batch_after: int) -> None:
    new_world = len(resumed)
    order = epoch_order(SIZE, seed=0, epoch=epoch - 1, shuffle=True)
    before = [i for r in stopped for i in r["loaded"][epoch]]
    after = [i for r in resumed for i in r["loaded"][epoch]]
    assert len(before) == len(set(before)), "the stopped run loaded a sample twice"
    assert not set(before) & set(after), "the resumed run loaded a consumed sample again"
    assert set(before) | set(after) == set(order), "a sample of the interrupted epoch was skipped"
    consumed = len(before)
    assert before and consumed < SIZE
    assert sorted(before) == sorted(order[:consumed]), "the stopped run did not consume a prefix"
    rest = order[consumed:]
    expected = [list(layout_order(rest, new_world, False)[r::new_world]) for r in range(new_world)]
    for r, result in enumerate(resumed):
        assert result["loaded"][epoch] == expected[r], f"rank {r} of the resumed epoch"
    padding = len(after) - len(rest)
    assert 0 <= padding < new_world, "more duplicates than the padding of the new world size"
    # the following epoch: a normal full one at the new world size
    length = math.ceil(math.ceil(SIZE / new_world) / batch_after)
    for r, result in enumerate(resumed):
        sampler = TrainSampler(range(SIZE), seed=0, rank=r, world_size=new_world)
        sampler.set_epoch(epoch)
        assert result["loaded"][epoch + 1] == list(sampler), f"rank {r}: the next epoch is not a full one"
        assert result["epoch_length"] == length
        assert result["iteration"] == (epoch + 1) * length and result["epoch"] == epoch + 1


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "saved_world, new_world, batch_after",
    [(2, 3, BATCH), (3, 2, BATCH), (2, 1, BATCH), (2, 2, 3)],
    ids=["2to3", "3to2", "2to1", "2to2-batch3"],
)
def test_a_mid_epoch_resume_at_another_world_size_sees_each_sample_once(
    tmp_path, saved_world, new_world, batch_after
):
    length = math.ceil(math.ceil(SIZE / saved_world) / BATCH)
    stop = length + 2  # two batches into the second epoch
    folder = str(tmp_path)
    stopped = run_at(saved_world, folder, "stop", stop, 3, BATCH)
    resumed = run_at(new_world, folder, "resume", 0, 3, batch_after)
    assert all(2 not in r["loaded"] or r["loaded"][2] for r in stopped)
    check_elastic(stopped, resumed, epoch=2, batch_after=batch_after)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_resume_at_another_world_size_says_whether_the_global_batch_changed(tmp_path, caplog):
    """Saved by 2 ranks of BATCH, resumed by 1 rank: with twice the per-rank batch the global
    batch stays what it was (as ``training.global_batch_size`` makes it), with the same one it
    halves; the warning says which, with both sizes."""
    length = math.ceil(math.ceil(SIZE / 2) / BATCH)
    folder = str(tmp_path)
    run_at(2, folder, "stop", length + 2, 3, BATCH)
    caplog.set_level("WARNING", logger="unison")
    run_at(1, folder, "resume", 0, 3, 2 * BATCH)
    notes = [r.getMessage() for r in caplog.records if "saved mid-epoch with world size 2" in r.getMessage()]
    assert len(notes) == 1 and notes[0].endswith(
        f"the global batch stays {2 * BATCH} ({BATCH} -> {2 * BATCH} per rank)."
    ), notes
