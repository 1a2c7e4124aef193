"""A ``shard_stream`` without loader workers continues at another world size.

All ranks read the stream's rounds in lockstep, so a save knows one global position: the
number of source items read. A resume at M ranks reads the rest of the epoch in rounds of M:
every remaining sample once, but for the incomplete last round (at most M - 1 samples),
which ``equal_length`` drops. With loader workers the position is each rank's own and another
world size is refused, naming ``num_workers``.
"""

from __future__ import annotations

import sys
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _stream_elastic_workers import SIZE, Shuffled, resume, resume_each, save_and_resume  # noqa: E402

from unison.checkpoint import CheckpointError  # noqa: E402
from unison.checkpoint.data_entry import DataEntry  # noqa: E402
from unison.checkpoint.state import check_checkpoint  # noqa: E402
from unison.distributed import shard_stream  # noqa: E402
from unison.distributed.data_state import data_position  # noqa: E402
from unison.testing import run_distributed  # noqa: E402

StatefulDataLoader = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


def read(world: int, batches: int | None, state: dict[str, int] | None = None, size: int = 23) -> Any:
    """Every rank of ``world`` reads ``batches`` batches of 2 (None: to the end) of ``range(size)``
    through a plain DataLoader, from ``state``; the ids each read and each one's state after."""
    ids, states = [], []
    for rank in range(world):
        stream = shard_stream(list(range(size)), rank=rank, world_size=world)
        if state is not None:
            stream.load_state_dict(state)
        ids.append([i for batch in islice(DataLoader(stream, batch_size=2), batches) for i in batch.tolist()])
        states.append(stream.state_dict())
    return ids, states


@pytest.mark.parametrize(
    ("saved_at", "into", "resumed_at"), [(2, 2, 1), (2, 2, 3), (3, 1, 2), (2, 5, 3), (1, 3, 4)]
)
def test_the_global_position_continues_at_another_world_size(saved_at, into, resumed_at):
    before, states = read(saved_at, into)
    assert all(s == states[0] for s in states), f"the ranks' positions differ: {states}"
    assert states[0]["consumed"] == saved_at * 2 * into, "the position counts the source items of every rank"
    after, _ = read(resumed_at, None, states[0])
    trained = [i for ids in before + after for i in ids]
    assert len(trained) == len(set(trained)), "a sample trained twice"
    assert len({len(ids) for ids in after}) == 1, "the ranks' shares differ: a collective would hang"
    left_out = set(range(23)) - set(trained)
    assert left_out == set(range(23 - len(left_out), 23)), "samples left out before the end"
    assert len(left_out) < resumed_at, "more than the incomplete last round of the new world size dropped"


def test_a_stream_without_workers_says_its_position_is_global_and_elastic():
    for loader in (
        DataLoader(shard_stream(Shuffled(), rank=0, world_size=2), batch_size=2),
        StatefulDataLoader(shard_stream(Shuffled(), rank=0, world_size=2), batch_size=2),
    ):
        position = data_position(loader)
        assert (position.kind, position.scope, position.elastic) == ("stateful", "global", True)
    workers = data_position(StatefulDataLoader(shard_stream(Shuffled(), rank=0, world_size=2), num_workers=2))
    assert (workers.scope, workers.elastic) == ("rank", False)
    assert "num_workers=2" in workers.not_elastic and "num_workers=0" in workers.not_elastic
    unequal = data_position(DataLoader(shard_stream(Shuffled(), rank=0, world_size=2, equal_length=False)))
    assert not unequal.elastic and "equal_length=True" in unequal.not_elastic


def entry_of(loader: Any, world: int, states: list[Any] | None = None) -> dict[str, Any]:
    """The checkpoint's data entry of ``world`` ranks whose loaders say what ``loader`` says."""
    data = DataEntry()
    data.run_started(loader)
    entry = data.entry([data.local() for _ in range(world)] if states is None else states, world)
    assert entry is not None
    return entry


def mid_epoch_state(data: dict[str, Any]) -> dict[str, Any]:
    meta = {"format": 1, "world_size": data["world_size"], "mid_epoch": True, "iteration": 3}
    return {"meta": meta, "objects": {"model": {}}, "sampler": None, "data": data}


def test_another_world_size_is_refused_with_workers_naming_num_workers():
    loader = StatefulDataLoader(shard_stream(Shuffled(), rank=0, world_size=2), batch_size=2, num_workers=2)
    state = mid_epoch_state(entry_of(loader, 2, [{}, {}]))  # no state asked: it would start the workers
    with pytest.raises(CheckpointError, match=r"world size 2; this run has world size 3") as err:
        check_checkpoint(state, source="ckpt.pt", names=["model"], world_size=3)
    assert "num_workers=2" in str(err.value) and "num_workers=0" in str(err.value)
    assert check_checkpoint(state, source="ckpt.pt", names=["model"], world_size=2) is None


def test_without_workers_another_world_size_loads_the_global_position_on_every_rank():
    loader = DataLoader(shard_stream(list(range(20)), rank=0, world_size=2), batch_size=2)
    it = iter(loader)
    next(it), next(it)
    state = mid_epoch_state(entry_of(loader, 2))
    change = check_checkpoint(state, source="ckpt.pt", names=["model"], world_size=3)
    assert change is not None and "remaining samples are sharded" in change
    third = DataLoader(shard_stream(list(range(20)), rank=2, world_size=3), batch_size=2)
    data = DataEntry()
    data.run_started(third)
    data.load(state["data"], 2, mid_epoch=True, source="ckpt.pt")
    assert [i for b in third for i in b.tolist()] == [10, 13, 16, 19], "rank 2 of 3 continues after item 8"


def by_epoch(trained: list[tuple[int, list[int]]]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for epoch, ids in trained:
        out.setdefault(epoch, []).extend(ids)
    return out


def check_resumed(before: list[dict[str, Any]], after: list[dict[str, Any]], at: int, world: int) -> None:
    """The 2-rank run's first ``at`` iterations and the resume at ``world`` ranks train every
    sample of each epoch once, but for a dropped last round of fewer than ``world`` samples."""
    done = [by_epoch(r["trained"][:at]) for r in before]
    rest = [by_epoch(r["trained"]) for r in after]
    for epoch in range(1, 3):
        ids = [i for part in done + rest for i in part.get(epoch, [])]
        assert len(ids) == len(set(ids)), (
            f"resumed at iteration {at}, {world} ranks: epoch {epoch} repeats samples"
        )
        assert SIZE - world < len(ids) <= SIZE, (
            f"resumed at iteration {at}, {world} ranks: epoch {epoch} left out {SIZE - len(ids)}"
        )
        assert len({len(r.get(epoch, [])) for r in rest}) == 1, (
            "the ranks trained different numbers of samples"
        )
    # An epoch after the resumed one learns its length at the new world size; a resumed epoch
    # forgets the length it learned (it counts batches of both world sizes).
    first_epoch = sum(1 for epoch, _ in before[0]["trained"] if epoch == 1)
    length = -(-(SIZE // world) // 2) if at < first_epoch else None
    lengths = {r["epoch_length"] for r in after}
    assert lengths == {length}, f"resumed at iteration {at}, {world} ranks: epoch lengths {lengths}"


@pytest.mark.slow
def test_a_stream_saved_at_two_ranks_resumes_at_one_two_and_three(tmp_path):
    """Saves at iterations 3 (first epoch, its length not yet known), 6 and 9 (second epoch)."""
    saved = run_distributed(save_and_resume, str(tmp_path / "two"), 3, nproc=2, timeout=240)
    paths = saved[0]["paths"]
    assert len(paths) == 3
    for rank in saved:  # the same world size: as the uninterrupted run, bit for bit
        for at, resumed in zip((3, 6, 9), rank["resumed"], strict=True):
            assert rank["trained"][:at] + resumed["trained"] == rank["trained"], f"resumed at iteration {at}"
            assert torch.equal(resumed["weights"], rank["weights"]), (
                f"resumed at iteration {at}: other weights"
            )
    one = [resume(str(tmp_path / f"one{i}"), path) for i, path in enumerate(paths)]
    three = run_distributed(resume_each, str(tmp_path / "three"), paths, nproc=3, timeout=240)
    for i, at in enumerate((3, 6, 9)):
        check_resumed(saved, [one[i]], at, 1)
        check_resumed(saved, [r[i] for r in three], at, 3)
