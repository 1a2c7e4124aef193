"""shard_stream and prepare_loaders over streams: each sample read once across ranks and workers."""

from __future__ import annotations

import pytest
from _stream_workers import IdStream, ddp_epochs_over_stream, unsharded_stream_refused, wrapped_stream_ids
from torch.utils.data import DataLoader, SequentialSampler

from unison.distributed import ShardedStream, prepare_loaders, shard_stream
from unison.testing import run_distributed


def _read(stream: ShardedStream, num_workers: int, batch_size: int = 2) -> list[int]:
    if num_workers == 0:
        return [int(i) for i in stream]
    loader = DataLoader(stream, batch_size=batch_size, num_workers=num_workers)
    return [int(i) for batch in loader for i in batch]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("size", [0, 1, 12, 13])
def test_every_rank_and_worker_reads_its_own_share_and_ranks_agree_on_length(world_size, num_workers, size):
    per_rank = [
        _read(shard_stream(IdStream(size), rank=rank, world_size=world_size), num_workers)
        for rank in range(world_size)
    ]
    seen = [i for ids in per_rank for i in ids]
    assert len(seen) == len(set(seen)), f"a sample was read twice: {per_rank}"
    # Only the last incomplete round (fewer than world_size samples) is left out ...
    assert sorted(seen) == list(range(size - size % world_size))
    # ... so every rank yields as many samples, and no rank waits in a collective the others skipped.
    assert len({len(ids) for ids in per_rank}) == 1


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_unequal_length_reads_every_sample_once(world_size, num_workers):
    size = 3 * world_size + 1
    per_rank = [
        _read(shard_stream(IdStream(size), rank=rank, world_size=world_size, equal_length=False), num_workers)
        for rank in range(world_size)
    ]
    assert sorted(i for ids in per_rank for i in ids) == list(range(size))
    assert [len(ids) for ids in per_rank] == [4] + [3] * (world_size - 1)


def test_set_epoch_reaches_the_source_and_the_state():
    class EpochStream(IdStream):
        epoch = -1

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

    source = EpochStream(4)
    stream = shard_stream(source, rank=0, world_size=1)
    stream.set_epoch(3)
    assert source.epoch == 3
    assert stream.state_dict() == {"epoch": 3, "consumed": 0}
    restored = shard_stream(EpochStream(4), rank=0, world_size=1)
    restored.load_state_dict({"epoch": 5, "consumed": 2})
    assert restored.source.epoch == 5
    assert list(restored) == [2, 3]
    assert list(restored) == [0, 1, 2, 3], "the next epoch starts from the beginning"


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("stop_after", [0, 1, 3])
def test_state_resumes_exactly_where_the_stream_stood(world_size, stop_after):
    size = 20
    for rank in range(world_size):
        first = shard_stream(IdStream(size), rank=rank, world_size=world_size)
        it = iter(first)
        head = [next(it) for _ in range(stop_after)]
        second = shard_stream(IdStream(size), rank=rank, world_size=world_size)
        second.load_state_dict(first.state_dict())
        whole = list(shard_stream(IdStream(size), rank=rank, world_size=world_size))
        assert head + list(second) == whole


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rank": 2, "world_size": 2}, r"rank=\.\.\.\) must be in \[0, 1\] for world_size=2, got 2"),
        ({"rank": 0, "world_size": 0}, r"world_size=\.\.\.\) must be a positive int, got 0"),
        ({"rank": True, "world_size": 2}, r"rank=\.\.\.\)"),
    ],
)
def test_bad_rank_or_world_size_is_refused_naming_it(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shard_stream(IdStream(4), **kwargs)


def test_a_non_iterable_source_is_refused():
    with pytest.raises(TypeError, match=r"shard_stream\(source=\.\.\.\) needs an iterable.*int"):
        shard_stream(3)  # type: ignore[arg-type]


def test_a_one_shot_iterator_is_refused():
    with pytest.raises(TypeError, match=r"got an iterator \(generator\), which can be read only once"):
        shard_stream(i for i in range(4))


def test_load_state_dict_refuses_another_shape():
    with pytest.raises(ValueError, match="'epoch' and 'consumed'"):
        shard_stream(IdStream(4)).load_state_dict({"position": 3})


# --- prepare_loaders over a stream (one process) -------------------------------------------------------


def test_a_plain_stream_at_one_rank_without_workers_is_read_as_is():
    loader, _ = prepare_loaders(IdStream(5), batch_size=2)
    assert [int(i) for batch in loader for i in batch] == [0, 1, 2, 3, 4]


def test_shuffle_true_is_refused_for_a_stream():
    with pytest.raises(ValueError, match=r"shuffle=True\) with a stream \(IdStream\).*Shuffle in the source"):
        prepare_loaders(IdStream(5), batch_size=2, shuffle=True)


def test_a_sampler_is_refused_for_a_stream():
    with pytest.raises(ValueError, match=r"train_sampler=SequentialSampler\) with a stream \(IdStream\)"):
        prepare_loaders(IdStream(5), batch_size=2, train_sampler=SequentialSampler(range(5)))


def test_workers_over_a_stream_that_does_not_split_by_worker_are_refused():
    with pytest.raises(
        ValueError, match=r"num_workers=2\).*IdStream.*each worker would yield the whole stream"
    ):
        prepare_loaders(IdStream(5), batch_size=2, num_workers=2)
    loader, _ = prepare_loaders(shard_stream(IdStream(5)), batch_size=2, num_workers=2)
    assert sorted(int(i) for batch in loader for i in batch) == [0, 1, 2, 3, 4]


def test_a_stream_that_says_it_shards_itself_is_trusted():
    stream = IdStream(4)
    stream.shards_itself = True  # type: ignore[attr-defined]
    loader, _ = prepare_loaders(stream, batch_size=2, num_workers=0)
    assert loader is not None and loader.dataset is stream


def test_the_map_style_path_still_shuffles_by_default():
    loader, _ = prepare_loaders(list(range(50)), batch_size=50, seed=0)
    assert loader is not None
    assert [int(i) for i in next(iter(loader))] != list(range(50))


# --- several ranks ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc, num_workers", [(2, 0), (2, 2), (3, 2)])
def test_ranks_and_workers_read_each_sample_once_per_epoch(nproc, num_workers):
    size = 6 * nproc + 1  # one sample over whole rounds: it is the one left out
    results = run_distributed(wrapped_stream_ids, size, 2, num_workers, 2, nproc=nproc, timeout=90)
    for epoch in range(2):
        seen = [i for result in results for i in result["epochs"][epoch]]
        assert sorted(seen) == list(range(size - 1)), f"epoch {epoch}: {seen}"
    assert len({len(result["epochs"][0]) for result in results}) == 1
    assert {result["loader"] for result in results} == {"StatefulDataLoader"}, "torchdata keeps the position"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_stream_that_does_not_split_by_rank_is_refused_before_training():
    messages = run_distributed(unsharded_stream_refused, 8, nproc=2, timeout=60)
    for message in messages:
        assert "_stream_workers.IdStream" in message
        assert "while 2 ranks run" in message
        assert "unison.distributed.shard_stream(dataset)" in message


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_ddp_training_over_a_stream_of_uneven_size_ends_every_epoch_on_every_rank():
    size = 3 * 5 + 2  # 17 samples on 3 ranks: the last 2 are an incomplete round
    results = run_distributed(ddp_epochs_over_stream, size, 2, 2, nproc=3, timeout=100)
    for epoch in (1, 2):
        seen = [i for result in results for i in result["seen"][epoch]]
        assert sorted(seen) == list(range(15)), f"epoch {epoch}: {seen}"
    assert len({result["weight"] for result in results}) == 1, "the ranks' models drifted apart"
