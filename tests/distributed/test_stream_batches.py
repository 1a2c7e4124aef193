"""A stream's loader cut its batches whole and saves the state torchdata's own batch sampler saves:
the same dict at every point of an epoch, with and without workers, and either's state resumes the
other at the same batch."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from itertools import islice
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from unison.distributed import prepare_loaders, shard_stream
from unison.distributed.stream_batches import StreamBatches, cut_batches_whole
from unison.distributed.stream_loader import SNAPSHOT_EVERY

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

SIZE, BATCH = 50, 4


class Numbers(IterableDataset):
    def __iter__(self) -> Iterator[int]:
        yield from range(SIZE)


def _context(workers: int) -> dict[str, Any]:
    """Workers forked, and their base seed drawn from a seeded generator: saved in the state too."""
    return (
        {"multiprocessing_context": "fork", "generator": torch.Generator().manual_seed(0)} if workers else {}
    )


def _torchdata(workers: int, **settings: Any) -> Any:
    context = {**_context(workers), **settings}
    return StatefulDataLoader(
        shard_stream(Numbers(), rank=0, world_size=1), batch_size=BATCH, num_workers=workers, **context
    )


def _unison(workers: int, **settings: Any) -> Any:
    context = {**_context(workers), **settings}
    stream = shard_stream(Numbers(), rank=0, world_size=1)
    return prepare_loaders(train=stream, batch_size=BATCH, num_workers=workers, **context)[0]


def _states(loader: Any, stops: list[int]) -> list[Any]:
    states, it = [], iter(loader)
    for done in range(max(stops) + 1):
        if done in stops:
            states.append(loader.state_dict())
        next(it, None)
    return states


@pytest.mark.parametrize("workers", [0, 2])
def test_the_state_is_torchdata_s_own_at_every_point_of_an_epoch(workers):
    loader = _unison(workers)
    assert isinstance(loader.batch_sampler, StreamBatches) and isinstance(loader, StatefulDataLoader)
    stops = [0, 1, 5, 12, 13, 14]  # before the first batch, within, the last batch (13), past the end
    same = (
        {"snapshot_every_n_steps": SNAPSHOT_EVERY} if workers else {}
    )  # unison's setting, given to torchdata's
    assert _states(loader, stops) == _states(_torchdata(workers, **same), stops)


def test_workers_send_their_position_every_snapshot_every_batches_unless_told_otherwise():
    assert _unison(2).snapshot_every_n_steps == SNAPSHOT_EVERY
    assert _unison(2, snapshot_every_n_steps=1).snapshot_every_n_steps == 1
    assert _unison(0).snapshot_every_n_steps == 1  # no workers: the position is the loader's own


@pytest.mark.parametrize("every", [SNAPSHOT_EVERY, 4])
def test_a_state_saved_between_two_worker_snapshots_resumes_at_the_next_batch_exactly(every):
    """Saved after each number of batches of an epoch (14 of them, 2 workers): the resume reads the
    batches since the last snapshot again, drops them, and hands out exactly the rest."""
    whole = [b.tolist() for b in _unison(2, snapshot_every_n_steps=every)]
    for done in range(len(whole) + 1):
        saver = _unison(2, snapshot_every_n_steps=every)
        it = iter(saver)
        for _ in range(done):
            next(it)
        state = saver.state_dict()
        resumed = _unison(2, snapshot_every_n_steps=every)
        resumed.load_state_dict(state)
        assert [b.tolist() for b in resumed] == whole[done:], f"saved after {done} batches"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("saved_by, loaded_by", [(_torchdata, _unison), (_unison, _torchdata)])
def test_either_s_state_resumes_the_other_at_the_next_batch(workers, saved_by, loaded_by):
    saver = saved_by(workers)
    it = iter(saver)
    read = [next(it) for _ in range(5)]
    state = saver.state_dict()
    rest = list(it)
    resumed = loaded_by(workers)
    resumed.load_state_dict(state)
    got = list(resumed)
    assert [b.tolist() for b in got] == [b.tolist() for b in rest]
    assert sorted(torch.cat(read + got).tolist()) == list(range(SIZE)), "each sample once"
    assert [b.tolist() for b in resumed] == [b.tolist() for b in _torchdata(workers)], "the next epoch whole"


def test_drop_last_and_a_short_last_batch_read_as_torch_reads_them():
    for drop_last in (False, True):
        raw = DataLoader(Numbers(), batch_size=BATCH, drop_last=drop_last)
        cut = cut_batches_whole(DataLoader(Numbers(), batch_size=BATCH, drop_last=drop_last))
        assert isinstance(cut.batch_sampler, StreamBatches)
        assert [b.tolist() for b in cut] == [b.tolist() for b in raw]


def test_a_loader_of_a_map_style_dataset_or_without_batches_is_left_as_it_is():
    mapped = DataLoader(list(range(8)), batch_size=2)
    assert cut_batches_whole(mapped).batch_sampler is mapped.batch_sampler
    unbatched = DataLoader(Numbers(), batch_size=None)
    assert cut_batches_whole(unbatched).batch_sampler is None
    assert list(islice(unbatched, 3)) == [0, 1, 2]
