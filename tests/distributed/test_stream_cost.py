"""shard_stream's own cost per source item, counted exactly, and its dealing pinned against a
reference: every rank, worker and resume position yields what the round-by-round rule says.

Calls are counted with ``sys.setprofile`` (Python and builtin calls) as the difference between
reading 2n and n items, so fixed costs cancel out: deterministic, unlike a timing.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable, Iterable, Iterator
from unittest import mock

import pytest
from torch.utils.data import IterableDataset

from unison.distributed import shard_stream

N = 240


class Numbers(IterableDataset):
    """0 .. size-1 from a Python generator: one Python call per item, the cheapest stream there is."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __iter__(self) -> Iterator[int]:
        yield from range(self.size)


def _calls(read: Callable[[int], None], n: int) -> int:
    count = 0

    def profile(frame, event, arg) -> None:  # type: ignore[no-untyped-def]
        nonlocal count
        if event in ("call", "c_call"):
            count += 1

    gc.disable()  # no collection (and no gc callback's calls) during the count; see test_call_budget
    sys.setprofile(profile)
    try:
        read(n)
    finally:
        sys.setprofile(None)
        gc.enable()
    return count


def _per_item(read: Callable[[int], None]) -> float:
    read(16)
    return (_calls(read, 2 * N) - _calls(read, N)) / N


def _worker(worker: int, workers: int) -> mock._patch:
    info = mock.Mock(id=worker, num_workers=workers) if workers > 1 else None
    return mock.patch("unison.distributed.iterable.get_worker_info", return_value=info)


@pytest.mark.parametrize("world_size, workers", [(1, 1), (2, 1), (3, 1), (2, 2), (1, 2)])
def test_shard_stream_adds_no_call_per_source_item_it_skips_or_yields(world_size, workers):
    def raw(n: int) -> None:
        for _ in Numbers(n):
            pass

    def sharded(n: int) -> None:
        with _worker(workers - 1, workers):
            for _ in shard_stream(Numbers(n), rank=world_size - 1, world_size=world_size):
                pass

    # not a call per item, yielded or skipped: the source's own calls only
    assert _per_item(sharded) - _per_item(raw) <= 1e-9


def _reference(size: int, rank: int, world: int, worker: int, workers: int, start: int, equal: bool) -> list:
    """Item i goes to rank i % W; the rounds of W items after ``start`` go to the workers in turn
    (round k to worker (start // W + k) % K); an incomplete last round is dropped with ``equal``."""
    out = []
    k = 0
    while True:
        begin = start + k * world
        round_ = list(range(begin, min(begin + world, size)))
        if not round_ or (equal and len(round_) < world):
            return out
        if (start // world + k) % workers == worker and rank < len(round_):
            out.append(round_[rank])
        k += 1


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize("equal_length", [True, False])
def test_every_rank_worker_and_resume_position_yields_the_rule_s_items_and_position(
    world_size, workers, equal_length
):
    for size in (0, 1, 7, 12, 13):
        for start in sorted({0, 1, 2, 3, 6, size}):
            if start > size:
                continue
            for rank in range(world_size):
                for worker in range(workers):
                    stream = shard_stream(
                        Numbers(size), rank=rank, world_size=world_size, equal_length=equal_length
                    )
                    stream.load_state_dict({"epoch": 0, "consumed": start})
                    expected = _reference(size, rank, world_size, worker, workers, start, equal_length)
                    with _worker(worker, workers):
                        got, positions = [], []
                        for item in stream:
                            got.append(item)
                            positions.append(stream.state_dict()["consumed"])
                    assert got == expected, (size, start, rank, worker)
                    # the position after an item is the end of its round: a resume there goes on after it
                    ends = [min(start + ((i - start) // world_size + 1) * world_size, size) for i in got]
                    assert positions == ends, (size, start, rank, worker)


def test_a_file_stream_adds_no_call_per_sample_over_its_reader():
    from unison.distributed.file_stream import FileStream

    def reader(path: str, size: int) -> Iterator[int]:
        yield from range(size)

    def raw(n: int) -> None:
        for path in ("a", "b"):
            for _ in reader(path, n // 2):
                pass

    def streamed(n: int) -> None:
        for _ in FileStream(["a", "b"], reader, seed=0, kwargs={"size": n // 2}):
            pass

    assert _per_item(streamed) - _per_item(raw) <= 1e-9


class Pairs(IterableDataset):
    """(features, class) pairs from a generator over precomputed tensors: a cheap stream's samples."""

    def __init__(self, size: int) -> None:
        import torch

        self.x = torch.zeros(size, 4)

    def __iter__(self) -> Iterator[tuple]:
        return ((self.x[i], i) for i in range(len(self.x)))


def _loader_calls(make: Callable[[int], Iterable], n: int) -> int:
    def read(size: int) -> None:
        for _ in make(size):
            pass

    return _calls(read, n)


def test_a_stream_s_loader_costs_the_calls_of_a_raw_dataloader_per_sample():
    """``prepare_loaders`` over ``shard_stream`` against a raw ``DataLoader`` over the same source (batch
    32): torchdata's batch sampler and unison's collate add no call per sample (+3.3 calls each before)."""
    pytest.importorskip("torchdata.stateful_dataloader")
    import warnings

    from torch.utils.data import DataLoader

    from unison.distributed import prepare_loaders

    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")

    def raw(size: int) -> Iterable:
        return DataLoader(Pairs(size), batch_size=32)

    def unison(size: int) -> Iterable:
        return prepare_loaders(train=shard_stream(Pairs(size), rank=0, world_size=1), batch_size=32)[0]

    per_sample = {}
    for name, make in (("raw", raw), ("unison", unison)):
        _loader_calls(make, 64)
        per_sample[name] = (_loader_calls(make, 64 * N) - _loader_calls(make, 32 * N)) / (32 * N)
    # 11.2 against 8.0 before; now 7.2: the raw loader's batch sampler resumes a generator per sample
    assert per_sample["unison"] <= per_sample["raw"], per_sample
