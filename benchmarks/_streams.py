"""The streams ``stream_loading.py`` reads: each source as a raw loop splits it, and as unison does.

Every source is built per rank (``rank`` of ``world`` ranks) and per variant:

- ``raw``: what one writes without unison, over the same source and reading the same items:
  a generator or a file stream read whole by every process, each keeping its own items with
  ``itertools.islice`` (item ``i`` to rank ``i % W``, a rank's items to its workers in turn,
  the split ``shard_stream`` makes); Hugging Face's ``split_dataset_by_node``; WebDataset's
  ``nodesplitter=split_by_node``.
- ``unison``: ``shard_stream`` of the unsplit generator; ``data.stream.files``' source
  (``shard_stream(FileStream(files, reader, seed))``); the Hugging Face and WebDataset
  objects as they are (their own split, which ``prepare_loaders`` recognises).
- ``raw_own`` (the generator only): a generator that reads only this process's items, as a
  source that can seek does; the floor of a stream read by several processes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from itertools import chain, islice
from pathlib import Path
from typing import Any

SOURCES = ("generator", "files", "hf", "webdataset")
FILES = 8
SHARDS = 4


def _process() -> tuple[int, int]:
    from torch.utils.data import get_worker_info

    info = get_worker_info()
    return (info.id, info.num_workers) if info is not None else (0, 1)


def _split_stream(read: Callable[[], Iterator[Any]], rank: int, world: int) -> Any:
    """Raw: every process reads ``read()`` whole and keeps item ``i`` where ``i % W == rank``
    and ``i // W % K == worker``, with ``itertools.islice``."""
    from torch.utils.data import IterableDataset

    class SplitStream(IterableDataset):
        def __iter__(self) -> Iterator[Any]:
            worker, workers = _process()
            return islice(read(), worker * world + rank, None, world * workers)

    return SplitStream()


def _generator(x: Any, y: list[int], rank: int, world: int, own_only: bool) -> Any:
    from torch.utils.data import IterableDataset

    class GeneratorStream(IterableDataset):
        """(x[i], y[i]) for each i; with ``own_only``, only this process's i."""

        def __iter__(self) -> Iterator[Any]:
            start, step = 0, 1
            if own_only:
                worker, workers = _process()
                start, step = worker * world + rank, world * workers
            return ((x[i], y[i]) for i in range(start, len(y), step))

    return GeneratorStream()


def read_part(path: str) -> Iterator[Any]:
    """The reader of the files source: one ``torch.save``'d (features, classes) pair per file."""
    import torch

    xs, ys = torch.load(path, weights_only=True)
    return zip(xs.unbind(0), ys.tolist(), strict=True)


def _write_files(x: Any, y: list[int], folder: Path) -> list[str]:
    import torch

    paths, per_file = [], -(-len(y) // FILES)
    for f in range(FILES):
        path = folder / f"part-{f:02d}.pt"
        sl = slice(f * per_file, min(len(y), (f + 1) * per_file))
        torch.save((x[sl].clone(), torch.tensor(y[sl])), path)
        paths.append(str(path))
    return paths


def _write_shards(x: Any, y: list[int], folder: Path) -> list[str]:
    import webdataset as wds

    urls, per_shard = [], -(-len(y) // SHARDS)
    for s in range(SHARDS):
        path = folder / f"shard-{s:02d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for i in range(s * per_shard, min(len(y), (s + 1) * per_shard)):
                sink.write({"__key__": f"{i:07d}", "npy": x[i].numpy(), "cls": y[i]})
        urls.append(str(path))
    return urls


def write_data(samples: int, folder: Path, write: bool = True) -> dict[str, Any]:
    """The samples, and the files and tar shards holding them: written by the parent process
    (``write``), the same samples drawn again and the files named in each rank."""
    import torch

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(samples, 784, generator=gen)
    y = torch.randint(0, 10, (samples,), generator=gen).tolist()
    if not write:
        files = [str(folder / f"part-{f:02d}.pt") for f in range(FILES)]
        return {
            "x": x,
            "y": y,
            "files": files,
            "urls": [str(folder / f"shard-{s:02d}.tar") for s in range(SHARDS)],
        }
    folder.mkdir(parents=True, exist_ok=True)
    return {"x": x, "y": y, "files": _write_files(x, y, folder), "urls": _write_shards(x, y, folder)}


def variants(name: str) -> tuple[str, ...]:
    return ("raw", "raw_own", "unison") if name == "generator" else ("raw", "unison")


def sources(name: str, data: dict[str, Any], rank: int, world: int) -> Callable[[str], Any]:
    """A factory of ``name``'s dataset for a variant (a new object at each call)."""
    x, y = data["x"], data["y"]
    if name == "generator":
        from unison.distributed import shard_stream

        def generator(variant: str) -> Any:
            if variant == "unison":
                return shard_stream(
                    _generator(x, y, rank, world, own_only=False), rank=rank, world_size=world
                )
            if variant == "raw_own":
                return _generator(x, y, rank, world, own_only=True)
            whole = _generator(x, y, rank, world, own_only=False)
            return _split_stream(lambda: iter(whole), rank, world)

        return generator
    if name == "files":
        from unison.distributed import shard_stream
        from unison.distributed.file_stream import FileStream

        files = data["files"]

        def file_source(variant: str) -> Any:
            if variant == "unison":
                return shard_stream(FileStream(files, read_part, seed=0), rank=rank, world_size=world)
            return _split_stream(lambda: chain.from_iterable(map(read_part, files)), rank, world)

        return file_source
    if name == "hf":
        import datasets

        datasets.disable_progress_bars()
        table = datasets.Dataset.from_dict({"x": x.numpy(), "y": y})

        def hf(variant: str) -> Any:
            stream = table.to_iterable_dataset(num_shards=SHARDS).with_format("torch")
            if world == 1:
                return stream
            from datasets.distributed import split_dataset_by_node

            return split_dataset_by_node(stream, rank=rank, world_size=world)

        return hf
    import webdataset as wds

    urls = data["urls"]
    splitter = wds.split_by_node if world > 1 else wds.single_node_only
    return lambda variant: webdataset_stream(urls, splitter)


def webdataset_stream(urls: list[str], splitter: Any = None) -> Any:
    """A WebDataset over ``urls`` that decodes only the keys it reads: WebDataset's default decoders
    unpickle .pyd/.pickle members and torch.load .pth ones with weights_only=False, whatever a shard holds."""
    import webdataset as wds

    splitter = splitter or wds.single_node_only
    return (
        wds.WebDataset(urls, shardshuffle=False, nodesplitter=splitter)
        .decode(only=["npy", "cls"])
        .to_tuple("npy", "cls")
    )
