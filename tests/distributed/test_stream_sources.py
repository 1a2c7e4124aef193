"""Streams through prepare_loaders: the engine's epochs, exact resume, Hugging Face and WebDataset sources."""

from __future__ import annotations

from collections.abc import Iterator

import datasets
import pytest
import webdataset as wds
from _stream_workers import IdStream, hf_stream_ids, webdataset_ids
from datasets.distributed import split_dataset_by_node
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from unison.distributed import prepare_loaders, shard_stream
from unison.distributed.data_state import data_position
from unison.engine import Engine, Events
from unison.testing import run_distributed


class EpochStream(IterableDataset):
    """Yields ``100 * epoch + i``: a batch tells which epoch its source was set to."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        return iter(range(100 * self.epoch, 100 * self.epoch + self.size))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_engine_sets_each_epoch_on_the_stream_before_its_workers_start(num_workers):
    loader, _ = prepare_loaders(shard_stream(EpochStream(6)), batch_size=2, num_workers=num_workers)
    seen: dict[int, list[int]] = {}
    engine = Engine(lambda engine, batch: batch.tolist())

    @engine.on(Events.ITERATION_COMPLETED)
    def record(engine):
        seen.setdefault(engine.state.epoch, []).extend(engine.state.output)

    engine.run(loader, max_epochs=3)
    assert {epoch: sorted(ids) for epoch, ids in seen.items()} == {
        epoch: [100 * (epoch - 1) + i for i in range(6)] for epoch in (1, 2, 3)
    }


def test_persistent_workers_are_refused_for_a_stream_with_epochs():
    # They would keep the stream they started with: every epoch would read epoch 0's order.
    with pytest.raises(
        ValueError,
        match=r"persistent_workers=True\) with a stream whose order follows set_epoch \(EpochStream\)",
    ):
        prepare_loaders(shard_stream(EpochStream(4)), batch_size=2, num_workers=2, persistent_workers=True)
    loader, _ = prepare_loaders(
        shard_stream(IdStream(4)), batch_size=2, num_workers=2, persistent_workers=True
    )
    assert loader is not None


def test_a_stream_for_training_and_a_map_style_set_for_evaluation():
    train, val = prepare_loaders(IdStream(4), list(range(5)), batch_size=2)
    assert train is not None and val is not None
    assert [int(i) for batch in val for i in batch] == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("world_size, num_workers, stop_after", [(1, 0, 1), (2, 2, 1), (3, 0, 4), (3, 2, 4)])
def test_a_stateful_loader_resumes_the_stream_exactly(world_size, num_workers, stop_after):
    size = 37
    for rank in range(world_size):

        def loader(rank: int = rank) -> StatefulDataLoader:
            built, _ = prepare_loaders(
                shard_stream(IdStream(size), rank=rank, world_size=world_size),
                batch_size=2,
                num_workers=num_workers,
            )
            assert isinstance(built, StatefulDataLoader)
            return built

        whole = [batch.tolist() for batch in loader()]
        first = loader()
        it = iter(first)
        head = [next(it).tolist() for _ in range(stop_after)]
        position = data_position(first)
        # Without workers every rank has read the same items: one global, elastic position.
        expected = ("stateful", "global", True) if num_workers == 0 else ("stateful", "rank", False)
        assert (position.kind, position.scope, position.elastic) == expected
        assert position.save is not None
        state = position.save()
        del it
        second = loader()
        assert data_position(second).load is not None
        data_position(second).load(state)  # type: ignore[misc]
        assert head + [batch.tolist() for batch in second] == whole, f"rank {rank}"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_hugging_face_stream_split_by_node_resumes_exactly(num_workers):
    def loader() -> StatefulDataLoader:
        full = datasets.Dataset.from_dict({"id": list(range(24))}).to_iterable_dataset(num_shards=4)
        built, _ = prepare_loaders(
            split_dataset_by_node(full, rank=1, world_size=2), batch_size=2, num_workers=num_workers
        )
        return built

    whole = [batch["id"].tolist() for batch in loader()]
    first = loader()
    it = iter(first)
    head = [next(it)["id"].tolist() for _ in range(2)]
    state = data_position(first).save()  # type: ignore[misc]
    del it
    second = loader()
    data_position(second).load(state)  # type: ignore[misc]
    assert head + [batch["id"].tolist() for batch in second] == whole


def _write_shards(folder, shards: int, per_shard: int) -> list[str]:
    paths = []
    for shard in range(shards):
        path = str(folder / f"shard-{shard:02d}.tar")
        with wds.TarWriter(path) as sink:
            for i in range(per_shard):
                sample = shard * per_shard + i
                sink.write({"__key__": f"{sample:05d}", "txt": str(sample)})
        paths.append(path)
    return paths


def test_a_webdataset_position_cannot_be_saved_and_says_what_to_do(tmp_path):
    shards = _write_shards(tmp_path, 2, 2)
    stream = wds.WebDataset(shards, shardshuffle=False, empty_check=False).decode().to_tuple("txt")
    loader, _ = prepare_loaders(stream, batch_size=2)
    position = data_position(loader)
    assert (position.kind, position.source) == ("none", "webdataset.WebDataset")
    assert "save at epoch ends only" in position.fix
    assert sorted(int(i) for (batch,) in loader for i in batch) == [0, 1, 2, 3]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc, num_workers", [(2, 0), (3, 2)])
def test_hugging_face_streams_split_by_node_read_each_sample_once(nproc, num_workers):
    size = 12
    results = run_distributed(hf_stream_ids, size, 4, num_workers, nproc=nproc, timeout=100)
    seen = [i for result in results for i in result["ids"]]
    assert sorted(seen) == list(range(size))
    for result in results:
        assert "datasets.iterable_dataset.IterableDataset" in result["refused"]
        assert "split_dataset_by_node(dataset, rank=rank, world_size=" in result["refused"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("nproc, num_workers", [(2, 2), (3, 0)])
def test_webdataset_with_split_by_node_reads_each_sample_once(tmp_path, nproc, num_workers):
    shards = _write_shards(tmp_path, 6, 3)
    results = run_distributed(webdataset_ids, shards, num_workers, nproc=nproc, timeout=100)
    seen = [i for result in results for i in result["ids"]]
    assert sorted(seen) == list(range(18))
    for result in results:
        assert "webdataset.compat.WebDataset" in result["refused"]
        assert "nodesplitter=webdataset.split_by_node" in result["refused"]
