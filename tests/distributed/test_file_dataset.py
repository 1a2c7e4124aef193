"""FileDataset over real zarr stores of torch_geometric graphs: the items a direct computation
gives, in its order; a cache reused, rebuilt when an input changes, refused when not ours;
one preprocessing for all ranks; confined paths; items checked with the file and sample named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("zarr")
pytest.importorskip("torch_geometric")

from _file_dataset_workers import (  # noqa: E402  # after the skips: both need zarr and torch_geometric
    GraphReader,
    Pair,
    at_least_three_nodes,
    digest,
    file_dataset_on_rank,
    to_graph,
    to_graph_doubled,
    to_pair,
    write_store,
)

from unison.distributed import split_dataset  # noqa: E402
from unison.distributed.file_dataset import FileDataset  # noqa: E402
from unison.distributed.file_items import InvalidItemError  # noqa: E402
from unison.distributed.file_sources import count_samples  # noqa: E402
from unison.testing import run_distributed  # noqa: E402

SIZES = [[4, 2, 5, 3, 1], [3, 6, 2], [5, 4, 4, 2]]  # graphs of 1 or 2 nodes are filtered out


@pytest.fixture
def stores(tmp_path: Path) -> list[Path]:
    return [write_store(tmp_path / f"part{k}.zarr", sizes, seed=k) for k, sizes in enumerate(SIZES)]


def _direct(stores: list[Path], pre_transform=to_graph, pre_filter=at_least_three_nodes) -> list[str]:
    """The truth: every sample read, filtered and transformed in one loop, in file then index order."""
    reader, items = GraphReader(), []
    for path in stores:
        for index in range(len(zarr_groups(path))):
            raw = reader(path, index)
            if pre_filter is None or pre_filter(raw):
                items.append(digest(pre_transform(raw)))
    return items


def zarr_groups(path: Path) -> list[str]:
    return [p.name for p in path.iterdir() if p.is_dir()]


def _calls(folder: Path) -> int:
    return sum(1 for _ in folder.iterdir())


def _dataset(stores: list[Path], output: Path, calls: Path, **kwargs) -> FileDataset:
    calls.mkdir(exist_ok=True)
    options = dict(output=output, pre_transform=to_graph, pre_filter=at_least_three_nodes, chunksize=2)
    return FileDataset(stores, GraphReader(str(calls)), **{**options, **kwargs})


def test_items_are_the_direct_computation_and_the_cache_is_reused(stores, tmp_path):
    data = _dataset(stores, tmp_path / "out", tmp_path / "calls")
    truth = _direct(stores)
    assert data.built and _calls(tmp_path / "calls") == sum(len(s) for s in SIZES)
    assert len(truth) == 8 < sum(len(s) for s in SIZES), "the filter must drop some graphs"
    assert [digest(data[i]) for i in range(len(data))] == truth
    assert data.source(0) == (stores[0], 0) and data.source(1) == (stores[0], 2)  # graph 1 has 2 nodes
    assert digest(data[-1]) == truth[-1]
    with pytest.raises(IndexError, match="out of range for 8 items"):
        data[8]

    (tmp_path / "calls2").mkdir()
    again = FileDataset(
        stores, GraphReader(str(tmp_path / "calls")), output=tmp_path / "out",
        pre_transform=to_graph, pre_filter=at_least_three_nodes, chunksize=2,
    )  # fmt: skip
    assert not again.built and _calls(tmp_path / "calls") == sum(len(s) for s in SIZES)  # no new read
    assert [digest(again[i]) for i in range(len(again))] == truth
    # A split of it is seeded and leaves the dataset's order alone.
    train, val = split_dataset(again, [0.75, 0.25], seed=3)
    assert sorted(list(train.indices) + list(val.indices)) == list(range(8))


def test_a_changed_input_file_rebuilds_the_cache(stores, tmp_path):
    _dataset(stores, tmp_path / "out", tmp_path / "calls")
    write_store(stores[1], [3, 3, 3, 3], seed=7)  # new content in one store
    calls = tmp_path / "calls_after"
    data = _dataset(stores, tmp_path / "out", calls)
    assert data.built and _calls(calls) == sum(len(s) for s in SIZES) - 3 + 4
    assert [digest(data[i]) for i in range(len(data))] == _direct(stores)


def test_a_changed_pre_transform_rebuilds_the_cache(stores, tmp_path):
    first = _dataset(stores, tmp_path / "out", tmp_path / "calls")
    x = first[0].x
    doubled = _dataset(stores, tmp_path / "out", tmp_path / "calls2", pre_transform=to_graph_doubled)
    assert doubled.built and _calls(tmp_path / "calls2") > 0
    assert torch.equal(doubled[0].x, x * 2)
    with pytest.raises(RuntimeError, match="was rebuilt or removed since this dataset was made"):
        first[len(first) - 1]  # a chunk the old dataset had not read yet: never the new build's
    assert [digest(doubled[i]) for i in range(len(doubled))] == _direct(stores, to_graph_doubled)


@pytest.mark.slow
def test_two_worker_processes_give_the_items_of_one(stores, tmp_path):
    data = _dataset(stores, tmp_path / "out", tmp_path / "calls", n_processes=2)
    assert data.built and _calls(tmp_path / "calls") == sum(len(s) for s in SIZES)
    assert [digest(data[i]) for i in range(len(data))] == _direct(stores)


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_every_rank_sees_the_same_items_and_one_rank_preprocessed(stores, tmp_path):
    (tmp_path / "calls").mkdir()
    results = run_distributed(
        file_dataset_on_rank,
        [str(s) for s in stores],
        str(tmp_path / "out"),
        str(tmp_path / "calls"),
        str(write_store(tmp_path / "broken.zarr", [3, 3, 3], seed=0, nan_at=1)),
        nproc=2,
    )
    assert [r["built"] for r in results] == [True, False]
    assert _calls(tmp_path / "calls") == sum(len(s) for s in SIZES)  # each sample read once, in all
    assert results[0]["digests"] == results[1]["digests"] == _direct(stores)
    # A preprocessing that fails on rank 0 fails on every rank, promptly, saying why.
    assert results[0]["error"].startswith("InvalidItemError: FileDataset: sample 1 of ")
    assert results[1]["error"].startswith("RuntimeError: FileDataset: rank 0 failed to preprocess into ")
    assert "InvalidItemError: FileDataset: sample 1 of " in results[1]["error"]


def test_paths_leaving_the_root_are_refused(stores, tmp_path):
    root = tmp_path / "data"
    root.mkdir()
    write_store(root / "in.zarr", [3, 3], seed=0)
    (root / "link.zarr").symlink_to(stores[0])
    for files, output, word in (
        (["../part0.zarr"], "out", "files"),
        ([str(stores[0])], "out", "files"),
        (["link.zarr"], "out", "files"),
        (["in.zarr"], "../out", "output"),
    ):
        with pytest.raises(ValueError, match=rf"FileDataset\({word}=\.\.\.\).* is refused"):
            FileDataset(files, GraphReader(), root=root, output=output, pre_transform=to_graph)
    data = FileDataset(["in.zarr"], GraphReader(), root=root, output="out", pre_transform=to_graph)
    assert len(data) == 2 and (root / "out" / "items" / "manifest.json").exists()


def test_an_invalid_item_is_named_by_file_and_sample(tmp_path):
    broken = write_store(tmp_path / "broken.zarr", [3, 4, 3, 5], seed=0, nan_at=2)
    with pytest.raises(
        InvalidItemError, match=r"sample 2 of .*broken\.zarr gives an invalid item: x holds 1 non-finite"
    ):
        FileDataset([broken], GraphReader(), output=tmp_path / "out", pre_transform=to_graph)
    assert not (tmp_path / "out" / "items").exists()  # nothing half-built is left to reuse
    assert not list((tmp_path / "out").iterdir())  # nor the build's hidden folder
    unchecked = FileDataset(
        [broken], GraphReader(), output=tmp_path / "out", pre_transform=to_graph, validate_data=False
    )
    assert len(unchecked) == 4 and torch.isnan(unchecked[2].x).any()


def test_a_folder_that_is_not_a_cache_is_refused_and_kept(stores, tmp_path):
    foreign = tmp_path / "out" / "items"
    foreign.mkdir(parents=True)
    (foreign / "mine.txt").write_text("keep me")
    with pytest.raises(ValueError, match="is not a FileDataset cache"):
        _dataset(stores, tmp_path / "out", tmp_path / "calls")
    assert (foreign / "mine.txt").read_text() == "keep me"


def test_items_load_with_weights_only_and_own_classes_need_an_allow_list(stores, tmp_path):
    data = FileDataset(stores[:1], GraphReader(), output=tmp_path / "out", pre_transform=to_pair)
    with pytest.raises(Exception, match="weights_only|Unsupported global"):
        data[0]
    allowed = FileDataset(
        stores[:1], GraphReader(), output=tmp_path / "out", pre_transform=to_pair, safe_globals=[Pair]
    )
    assert not allowed.built and isinstance(allowed[0], Pair) and allowed[0].x.shape == (4, 2)


def test_without_output_items_are_made_on_access(stores, tmp_path):
    data = FileDataset(stores, GraphReader(), pre_transform=to_graph)
    assert [digest(data[i]) for i in range(len(data))] == _direct(stores, pre_filter=None)
    with pytest.raises(ValueError, match="pre_filter=...\\) needs output"):
        FileDataset(stores, GraphReader(), pre_filter=at_least_three_nodes)


def test_zarr_sample_counts(tmp_path):
    import numpy as np
    import zarr

    stacked = zarr.open_group(str(tmp_path / "stacked.zarr"), mode="w")
    stacked.create_array("features", data=np.zeros((7, 3), dtype=np.float32))
    stacked.create_array("num_samples", data=np.array([7]))
    columns = zarr.open_group(str(tmp_path / "columns.zarr"), mode="w")
    columns.create_array("a", data=np.arange(5))
    columns.create_array("b", data=np.arange(5.0))
    assert count_samples(tmp_path / "stacked.zarr") == 7
    assert count_samples(tmp_path / "columns.zarr") == 5
    assert count_samples(write_store(tmp_path / "groups.zarr", [3, 3, 3], seed=0)) == 3
    (tmp_path / "plain.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a zarr store.*count="):
        count_samples(tmp_path / "plain.bin")


def test_functions_that_workers_cannot_import_are_refused_before_any_worker_starts(stores, tmp_path):
    with pytest.raises(
        ValueError, match=r"n_processes=2\): pre_transform=.*cannot be sent to worker processes"
    ):
        FileDataset(
            stores, GraphReader(), output=tmp_path / "out", pre_transform=lambda raw: raw, n_processes=2
        )


def test_the_users_script_keys_the_cache_alike_when_run_and_when_a_rank_imports_it():
    """torchrun runs the script as __main__; a spawned rank (or --main) imports it as __mp_main__."""
    from unison.distributed.file_sources import callable_identity

    def reader(path, index):
        return index

    identities = []
    for module in ("__main__", "__mp_main__"):
        reader.__module__ = module
        identities.append(callable_identity(reader))
    assert identities[0] == identities[1] and identities[0].startswith("__main__.")
