"""The data position in the checkpoint: each rank's data state saved and restored, mid-epoch
saves refused when the position is unknown, first-epoch checkpoints of streams resumable.

The truth is the uninterrupted run: it saves after every iteration, and a run built from
scratch resumes from each of those checkpoints; every resumed run must end with the same
weights, bit for bit, and each rank must have trained the same ids, batch for batch.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _data_state_workers import (  # noqa: E402
    SIZE,
    Ids,
    StreamShard,
    make_loader,
    refused_at_started,
    resume_error,
    resume_from_every_save,
    save_mid_epoch,
)

from unison.checkpoint import CheckpointError  # noqa: E402
from unison.checkpoint.state import check_checkpoint  # noqa: E402
from unison.distributed import TrainSampler  # noqa: E402
from unison.distributed.data_state import data_position  # noqa: E402
from unison.engine import Engine  # noqa: E402
from unison.handlers import Checkpoint  # noqa: E402
from unison.testing import run_distributed  # noqa: E402

pytest.importorskip("torchdata")  # the [test] extra installs it; absent only where it cannot install
pytest.importorskip("datasets")


def check_every_resume(result: dict[str, Any], *, epoch_length: int) -> None:
    trained = result["trained"]
    assert result["epoch_length"] == epoch_length
    iterations = 2 * epoch_length
    assert len(trained) == iterations
    assert sorted(result["resumed"]) == list(range(1, iterations + 1)), "a save is missing"
    for at, resumed in sorted(result["resumed"].items()):
        assert trained[:at] + resumed["trained"] == trained, (
            f"resumed at iteration {at}: trained {resumed['trained']}, the uninterrupted run {trained[at:]}"
        )
        assert torch.equal(resumed["weights"], result["weights"]), f"resumed at iteration {at}: other weights"
        assert resumed["epoch_length"] == epoch_length, f"resumed at iteration {at}: epoch length"


ONE_RANK = [
    ("stateful-shard", 0),
    pytest.param("stateful-shard", 2, marks=pytest.mark.slow, id="stateful-shard-w2"),
    ("train-sampler", 0),
    ("hf-stream", 0),
]


@pytest.mark.parametrize(("source", "num_workers"), ONE_RANK)
def test_every_resume_of_one_rank_equals_the_uninterrupted_run(source, num_workers, tmp_path):
    """Saves inside the first epoch of a stream (its length not yet known) resume too. With two
    workers each takes half the ids, batched apart: 10 ids, 5 batches of 2 each."""
    result = resume_from_every_save(str(tmp_path), source, num_workers)
    check_every_resume(result, epoch_length=SIZE // 2)
    ids = sorted(i for batch in result["trained"] for i in batch)
    assert ids == sorted(list(range(SIZE)) * 2), "each epoch trains every sample once"


@pytest.mark.slow
@pytest.mark.parametrize("source", ["stateful-shard", "train-sampler", "hf-stream"])
def test_every_resume_of_two_ranks_equals_the_uninterrupted_run(source, tmp_path):
    results = run_distributed(resume_from_every_save, str(tmp_path), source, nproc=2, timeout=240)
    for result in results:
        check_every_resume(result, epoch_length=SIZE // 4)
    for epoch in range(2):
        ids = [
            {i for batch in r["trained"][epoch * SIZE // 4 : (epoch + 1) * SIZE // 4] for i in batch}
            for r in results
        ]
        assert not ids[0] & ids[1], f"epoch {epoch + 1}: the ranks trained the same samples"
        assert ids[0] | ids[1] == set(range(SIZE)), f"epoch {epoch + 1}: samples left out"


@pytest.mark.slow
@pytest.mark.parametrize(("source", "epoch_length"), [("stateful-shard", 6), ("train-sampler", 5)])
def test_every_resume_of_two_ranks_with_two_workers_equals_the_uninterrupted_run(
    source, epoch_length, tmp_path
):
    """Each rank's loader keeps one position per worker: a stream's 10 ids of a rank split 5 and 5
    over the workers (3 batches each, the last of one id), the sampler's 10 indices 5 batches
    handed out round robin. Every save of both epochs resumes on both ranks."""
    results = run_distributed(resume_from_every_save, str(tmp_path), source, 2, nproc=2, timeout=300)
    for result in results:
        check_every_resume(result, epoch_length=epoch_length)
    for epoch in range(2):
        ids = [
            [i for batch in r["trained"][epoch * epoch_length : (epoch + 1) * epoch_length] for i in batch]
            for r in results
        ]
        assert sorted(ids[0] + ids[1]) == list(range(SIZE)), f"epoch {epoch + 1}: a sample missed or repeated"


@pytest.mark.slow
def test_a_per_rank_stream_position_is_refused_at_another_world_size(tmp_path):
    (path, _) = run_distributed(
        save_mid_epoch, str(tmp_path / "saved"), "stateful-shard", 3, nproc=2, timeout=120
    )
    message = resume_error(str(tmp_path / "again"), path, "stateful-shard")
    assert message is not None, "a per-rank position saved at 2 ranks resumed at 1"
    assert "world size 2" in message and "world size 1" in message
    assert "torchdata.StatefulDataLoader" in message


def test_a_per_rank_state_at_another_world_size_fails_before_anything_is_loaded():
    state = {
        "meta": {"format": 1, "world_size": 2, "mid_epoch": True, "iteration": 3},
        "objects": {"model": {}},
        "sampler": None,
        "data": {
            "kind": "stateful",
            "source": "datasets.IterableDataset",
            "scope": "rank",
            "elastic": False,
            "world_size": 2,
            "by_rank": [{}, {}],
        },
    }
    with pytest.raises(
        CheckpointError, match=r"datasets.IterableDataset saved at world size 2; .*world size 3"
    ):
        check_checkpoint(state, source="ckpt.pt", names=["model"], world_size=3)
    check_checkpoint(state, source="ckpt.pt", names=["model"], world_size=2)  # the same world size resumes


@pytest.mark.parametrize("preemption", [False, True], ids=["every_iters", "preemption"])
def test_mid_epoch_saves_of_a_plain_stream_are_refused_at_started(preemption, tmp_path):
    message = refused_at_started(str(tmp_path), "plain-stream", preemption=preemption)
    assert message is not None, "a plain IterableDataset was saved mid-epoch"
    assert "_data_state_workers.PlainStream" in message
    assert "mid-epoch checkpoints" in message
    assert "StatefulDataLoader" in message and "every_iters=None" in message
    assert ("Preemption" if preemption else "Checkpoint(every_iters=3)") in message
    assert message.endswith("[trained 0 batches]"), "refused after training began"


def test_epoch_end_saves_of_a_plain_stream_stay_allowed(tmp_path):
    from _data_state_workers import build

    model, trainer, checkpoint, loader, trained = build("plain-stream", str(tmp_path), every_iters=None)
    trainer.run(loader, max_epochs=2)
    assert len(checkpoint.saved) == 2 and len(trained) == SIZE


def test_a_loader_or_stream_in_to_save_is_refused_naming_it(tmp_path):
    for name, obj in {"loader": make_loader("stateful-shard"), "stream": StreamShard(4, 0, 1)}.items():
        with pytest.raises(
            ValueError, match=rf"to_save=\{{'{name}': ...\}}.*saves the trainer's data state itself"
        ):
            Checkpoint(tmp_path / name, {"model": nn.Linear(1, 1), name: obj}, Engine(lambda e, b: None))


@pytest.mark.parametrize("name", ["data", "loader"])
def test_a_loader_in_to_save_gets_one_message_whatever_its_name(name, tmp_path):
    """torchdata documents ``to_save={"data": loader}``: the answer says the state is saved already."""
    with pytest.raises(ValueError) as err:
        Checkpoint(
            tmp_path,
            {"model": nn.Linear(1, 1), name: make_loader("stateful-shard")},
            Engine(lambda e, b: None),
        )
    message = str(err.value)
    assert f"to_save={{{name!r}: ...}}" in message and "StatefulDataLoader" in message
    assert "every rank" in message and "leave it out of to_save" in message
    assert "reserved" not in message, "the loader's own answer, not the name's"


def test_the_data_name_says_what_the_entry_holds(tmp_path):
    with pytest.raises(ValueError) as err:
        Checkpoint(tmp_path, {"model": nn.Linear(1, 1), "data": nn.Linear(1, 1)}, Engine(lambda e, b: None))
    message = str(err.value)
    assert "to_save={'data': ...}" in message and "each rank's data state" in message
    assert "another name" in message and "Linear" in message


def test_what_each_source_says_about_its_position():
    from torch.utils.data import DataLoader

    assert data_position(make_loader("stateful-shard")).kind == "stateful"
    assert data_position(make_loader("hf-stream")).source == "datasets.IterableDataset"
    assert data_position(make_loader("hf-stream")).scope == "rank"
    sampler = data_position(DataLoader(Ids(), sampler=TrainSampler(Ids(), rank=0, world_size=1)))
    assert (sampler.kind, sampler.scope, sampler.elastic) == ("sampler", "global", True)
    workers = data_position(DataLoader(StreamShard(4, 0, 1), num_workers=2))
    assert workers.kind == "none" and "StatefulDataLoader" in workers.fix
    assert data_position(make_loader("plain-stream")).kind == "none"


def test_a_train_sampler_reports_what_its_iterator_handed_out():
    """torchdata's StatefulDataLoader calls state_dict() without arguments, then load_state_dict."""
    sampler = TrainSampler(range(10), seed=1, rank=0, world_size=1)
    sampler.set_epoch(2)
    order = list(sampler)
    it = iter(sampler)
    taken = [next(it) for _ in range(4)]
    state = sampler.state_dict()
    assert (state["epoch"], state["consumed"]) == (2, 4)
    again = TrainSampler(range(10), seed=1, rank=0, world_size=1)
    again.load_state_dict(state)
    rest = list(again)
    assert taken + rest == order
    assert again.state_dict()["consumed"] == 10, "skipped samples count as handed out"
    again.set_epoch(3)
    assert again.state_dict()["consumed"] == 0, "another epoch's iterator has handed out nothing yet"
