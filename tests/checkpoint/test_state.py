"""What a checkpoint holds (generator states, weights without DDP's prefix, CPU copies, the payload
and the sampler's position) and the checks a resume makes, all from plain values."""

from __future__ import annotations

import io
import random

import ignite
import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import unison
from unison.checkpoint import CheckpointError, capture_rng, load_model_state, model_state, restore_rng
from unison.checkpoint.positions import DataPass, PositionUnknown, resumable_sampler, sampler_state
from unison.checkpoint.state import (
    FORMAT,
    Position,
    build_checkpoint,
    check_checkpoint,
    check_layout,
    check_to_save,
    checkpoint_meta,
    data_length,
    load_object_states,
    object_states,
    refit_epoch_length,
    rng_of_rank,
    to_cpu_copy,
    world_size_note,
)
from unison.distributed import TrainSampler


def _draws() -> tuple:
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), torch.rand(3))


def _through_weights_only(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_restored_generators_repeat_the_same_draws_after_a_weights_only_round_trip():
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    _draws()
    random.gauss(0, 1)  # leaves a cached gauss value in Python's state
    state = _through_weights_only(capture_rng())
    expected = _draws()
    _draws()  # move every generator on
    restore_rng(state)
    again = _draws()
    assert expected[:3] == again[:3] and torch.equal(expected[3], again[3])


def _seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def test_capturing_draws_nothing_from_any_generator():
    _seed_all(7)
    undisturbed = _draws()
    _seed_all(7)
    capture_rng()
    after_capture = _draws()
    assert undisturbed[:3] == after_capture[:3] and torch.equal(undisturbed[3], after_capture[3])


# --- weights and DDP ------------------------------------------------------------------------------


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.fixture
def one_rank_group(tmp_path):
    """A process group of one gloo rank in this process, for a real DistributedDataParallel."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _same(state: dict, expected: dict) -> bool:
    return sorted(state) == sorted(expected) and all(torch.equal(state[k], expected[k]) for k in expected)


def test_model_state_has_no_ddp_prefix(one_rank_group):
    ddp = DistributedDataParallel(_model(0))
    assert all(k.startswith("module.") for k in ddp.state_dict())
    state = model_state(ddp)
    assert _same(state, _model(0).state_dict())


@pytest.mark.parametrize("prefixed", [True, False], ids=["saved-with-module-prefix", "saved-without"])
@pytest.mark.parametrize("into_ddp", [False, True], ids=["into-plain", "into-ddp"])
def test_weights_load_with_or_without_the_prefix_into_plain_or_ddp_models(one_rank_group, prefixed, into_ddp):
    source = _model(1).state_dict()
    saved = {("module." + k if prefixed else k): v for k, v in source.items()}
    saved = _through_weights_only(saved)
    target = _model(2)
    assert not _same(target.state_dict(), source), "source and target start equal: the test is blind"
    if into_ddp:
        target = DistributedDataParallel(target)
    load_model_state(target, saved)
    assert _same(model_state(target), source)


def test_loading_weights_of_another_model_fails_loudly():
    with pytest.raises(RuntimeError, match="Missing key|Unexpected key"):
        load_model_state(_model(0), nn.Linear(3, 4).state_dict())


# --- CPU copies for asynchronous writes -----------------------------------------------------------


def test_to_cpu_copy_is_deep_and_keeps_the_structure():
    original = {
        "w": torch.ones(3),
        "list": [torch.zeros(2), 5],
        "tuple": (torch.arange(2), "s"),
        "none": None,
    }
    copy = to_cpu_copy(original)
    original["w"].add_(1)
    original["list"][0].add_(1)
    original["tuple"][0].add_(1)
    assert torch.equal(copy["w"], torch.ones(3)) and torch.equal(copy["list"][0], torch.zeros(2))
    assert torch.equal(copy["tuple"][0], torch.arange(2))
    assert copy["list"][1] == 5 and copy["tuple"][1] == "s" and copy["none"] is None
    assert isinstance(copy["tuple"], tuple) and isinstance(copy["list"], list)
    assert copy["w"].device.type == "cpu" and not copy["w"].requires_grad


# --- the payload, from plain values -------------------------------------------------------------


@pytest.mark.parametrize(
    "epoch, iteration, length, mid",
    [
        (1, 3, 5, True),
        (1, 5, 5, False),
        (2, 10, 5, False),
        (0, 0, 5, False),
        (3, 7, None, False),
        (3, 7, 0, False),
    ],
)
def test_a_position_is_mid_epoch_only_inside_a_known_epoch(epoch, iteration, length, mid):
    assert Position(epoch, iteration, length).mid_epoch is mid


def test_the_meta_record_holds_the_position_and_the_layout():
    meta = checkpoint_meta(
        Position(2, 7, 5),
        world_size=3,
        batch_size=4,
        accumulation_steps=2,
        score=0.25,
        metric="acc",
        saved_at=123.0,
    )
    assert meta == {
        "format": FORMAT,
        "epoch": 2,
        "iteration": 7,
        "mid_epoch": True,
        "world_size": 3,
        "batch_size": 4,
        "accumulation_steps": 2,
        "score": 0.25,
        "metric": "acc",
        "saved_at": 123.0,
        "versions": {
            "unison": unison.__version__,
            "torch": str(torch.__version__),
            "ignite": ignite.__version__,
        },
    }


def test_a_built_checkpoint_holds_its_parts_and_loads_with_weights_only():
    torch.manual_seed(0)
    model = _model(0)
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(5, 3)).sum().backward()
    optimizer.step()
    objects = object_states({"model": model, "optimizer": optimizer})
    meta = checkpoint_meta(
        Position(1, 3, 5),
        world_size=1,
        batch_size=2,
        accumulation_steps=1,
        score=None,
        metric=None,
        saved_at=1.0,
    )
    sampler = {"seed": 0, "epoch": 0, "consumed": 6}
    state = build_checkpoint(
        meta=meta,
        trainer={"iteration": 3, "epoch_length": 5, "max_epochs": 2},
        sampler=sampler,
        rng=[capture_rng()],
        objects=objects,
        config={"a": [1, 2]},
    )
    assert list(state) == ["meta", "trainer", "sampler", "data", "rng", "objects", "config"]
    loaded = _through_weights_only(state)
    assert loaded["meta"] == meta and loaded["sampler"] == sampler and loaded["config"] == {"a": [1, 2]}
    assert _same(loaded["objects"]["model"], model.state_dict())
    fresh = _model(1)
    fresh_optimizer = torch.optim.Adam(fresh.parameters(), lr=0.1)
    load_object_states({"model": fresh, "optimizer": fresh_optimizer}, loaded["objects"])
    assert _same(fresh.state_dict(), model.state_dict())
    for key, value in optimizer.state_dict()["state"][0].items():
        assert torch.equal(fresh_optimizer.state_dict()["state"][0][key], value), key


def test_objects_without_a_state_or_with_reserved_names_are_refused():
    with pytest.raises(ValueError, match="non-empty mapping"):
        check_to_save({})
    with pytest.raises(ValueError, match="'rng' is reserved"):
        check_to_save({"rng": nn.Linear(1, 1)})
    with pytest.raises(TypeError, match="a int has no state_dict"):
        check_to_save({"count": 3})
    check_to_save(
        {"model": nn.Linear(1, 1), "optimizer": torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1)}
    )


# --- the sampler's position ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "current, iteration, expected",
    [
        (DataPass(5, 1), 7, (1, 8, False)),  # 2 batches into the iterator drawn at sampler epoch 1
        (DataPass(5, 0, skipped=4), 6, (0, 8, False)),  # a resumed iterator: skipped, then one batch
        (DataPass(5, 1), 5, (1, 0, True)),  # nothing taken from it yet: the resume draws it afresh
        (DataPass(0, 0), 3, (0, 0, True)),  # all 10 samples (3 batches, the last short) taken
        (DataPass(0, 0, samples=7), 2, (0, 7, False)),  # counted samples, not batches x batch size
    ],
)
def test_the_sampler_position_is_the_data_iterators(current, iteration, expected):
    data = list(range(10))
    sampler = TrainSampler(data, seed=3, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
    state = sampler_state(loader, current, iteration)
    assert (state["epoch"], state["consumed"], state["fresh"]) == expected


def test_the_sampler_state_comes_from_a_resumable_sampler_only():
    data = list(range(10))
    sampler = TrainSampler(data, seed=3, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(data, batch_size=2, sampler=sampler)
    assert resumable_sampler(loader) is sampler
    state = sampler_state(loader, DataPass(0, 0), 2)
    assert state == {**sampler.state_dict(consumed=4), "epoch": 0, "fresh": False}
    plain = torch.utils.data.DataLoader(data, batch_size=2)
    assert resumable_sampler(plain) is None and sampler_state(plain, DataPass(0, 0), 2) is None


def test_a_mid_epoch_position_that_cannot_be_told_is_refused():
    data = list(range(10))
    sampler = TrainSampler(data, seed=3, rank=0, world_size=1)
    loader = torch.utils.data.DataLoader(data, batch_sampler=_Unsized(sampler))
    with pytest.raises(PositionUnknown, match="cannot save mid-epoch.*no fixed batch_size"):
        sampler_state(loader, DataPass(0, 0), 2)
    assert sampler_state(loader, DataPass(2, 0), 2)["fresh"] is True  # at an iterator's start: fine


class _Unsized:
    def __init__(self, sampler) -> None:
        self.sampler = sampler

    def __iter__(self):
        indices = list(self.sampler)
        yield indices[:3]
        yield indices[3:]


# --- resume checks ------------------------------------------------------------------------------


def _saved(**meta) -> dict:
    base = {"format": FORMAT, "world_size": 2, "mid_epoch": False, "iteration": 6, "epoch": 2}
    return {"meta": {**base, **meta}, "objects": {"model": {}, "optimizer": {}}}


def test_a_checkpoint_of_this_run_passes():
    assert check_checkpoint(_saved(), source="f.pt", names=["model", "optimizer"], world_size=2) is None
    assert check_checkpoint(_saved(), source="f.pt", names=["model"], world_size=2) is None


@pytest.mark.parametrize(
    "state, names, world_size, message",
    [
        (_saved(format=0), ["model"], 2, r"Checkpoint f.pt has format 0; this unison reads 1\."),
        ({"objects": {}}, ["model"], 2, r"has format None"),
        (
            _saved(),
            ["model", "scheduler"],
            2,
            r"Checkpoint f.pt holds no state for \['scheduler'\] \(it has \['model', 'optimizer'\]\)\. "
            r"Use the same to_save names",
        ),
        (
            _saved(mid_epoch=True, iteration=7),
            ["model"],
            3,
            r"Checkpoint f.pt was taken mid-epoch \(iteration 7\) with world size 2; this run has 3\. "
            r"Resume with 2 ranks, or from a checkpoint taken at an epoch's end\.",
        ),
    ],
    ids=["format", "no-format", "missing-object", "world-size-mid-epoch"],
)
def test_a_checkpoint_that_does_not_fit_is_refused(state, names, world_size, message):
    with pytest.raises(CheckpointError, match=message):
        check_checkpoint(state, source="f.pt", names=names, world_size=world_size)


def test_another_world_size_at_an_epoch_boundary_is_a_warning():
    warning = check_checkpoint(_saved(), source="f.pt", names=["model"], world_size=1)
    assert warning == (
        "Resuming f.pt, saved with world size 2, on 1 ranks: the global batch changes from here on, "
        "unless the per-rank batch size was changed to match."
    )


@pytest.mark.parametrize(
    "saved, now, layout, expected",
    [
        ((2, 8, 1), 4, (4, 1), "the global batch stays 16 (8 -> 4 per rank)."),
        ((2, 8, 2), 1, (16, 2), "the global batch stays 32 (8 -> 16 per rank)."),
        ((2, 8, 1), 1, (8, 1), "the global batch changes from 16 to 8 from here on."),
        ((2, None, 1), 1, (8, 1), "the global batch changes from here on, unless the per-rank batch size"),
        ((2, 8, 1), 1, (None, 1), "the global batch changes from here on, unless the per-rank batch size"),
    ],
    ids=["stays", "stays-accumulating", "halves", "saved-size-unknown", "size-unknown"],
)
def test_the_world_size_note_says_whether_the_global_batch_changed(saved, now, layout, expected):
    """A run with ``training.global_batch_size`` keeps its global batch at any world size: the
    note must not say it changes when it does not."""
    world, size, steps = saved
    meta = {"world_size": world, "batch_size": size, "accumulation_steps": steps, "mid_epoch": False}
    note = world_size_note(meta, source="f.pt", world_size=now, layout=layout)
    assert note.startswith(f"Resuming f.pt, saved with world size {world}, on {now} ranks: ")
    assert expected in note


@pytest.mark.parametrize(
    "meta, batch_size, accumulation_steps, expected",
    [
        ({"batch_size": 4, "accumulation_steps": 1}, 4, 1, None),
        (
            {"batch_size": None, "accumulation_steps": None},
            8,
            3,
            None,
        ),  # nothing recorded: nothing to compare
        ({}, 8, 3, None),
        (
            {"batch_size": 4, "accumulation_steps": 1},
            2,
            1,
            "The run differs from its checkpoint: batch_size 4 -> 2 (per rank).",
        ),
        (
            {"batch_size": 4, "accumulation_steps": 1},
            2,
            2,
            "The run differs from its checkpoint: batch_size 4 -> 2, accumulation_steps 1 -> 2 (per rank).",
        ),
    ],
)
def test_a_changed_layout_is_described_at_an_epoch_boundary(meta, batch_size, accumulation_steps, expected):
    meta = {**meta, "mid_epoch": False}
    assert check_layout(meta, batch_size=batch_size, accumulation_steps=accumulation_steps) == expected


def test_a_changed_layout_is_refused_mid_epoch():
    meta = {"batch_size": 4, "accumulation_steps": 1, "mid_epoch": True}
    assert check_layout(meta, batch_size=4, accumulation_steps=1) is None
    with pytest.raises(
        CheckpointError, match=r"accumulation_steps 1 -> 2 \(per rank\)\. A mid-epoch position"
    ):
        check_layout(meta, batch_size=4, accumulation_steps=2)


@pytest.mark.parametrize(
    "position, length, expected",
    [
        (Position(2, 10, 5), 5, None),  # the same length
        (Position(2, 10, 5), None, None),  # data without a length
        (Position(2, 10, 5), 0, None),
        (Position(2, 10, 5), 3, Position(2, 6, 3)),  # more ranks: shorter epochs
        (Position(2, 6, 3), 5, Position(2, 10, 5)),
        (Position(0, 0, 3), 5, Position(0, 0, 5)),
    ],
)
def test_the_epoch_length_is_refit_to_the_data(position, length, expected):
    assert refit_epoch_length(position, length) == expected


def test_data_length_and_each_ranks_generators():
    assert data_length([1, 2, 3]) == 3 and data_length(iter([1])) is None
    assert rng_of_rank([{"r": 0}, {"r": 1}], 1) == {"r": 1}
    assert rng_of_rank([{"r": 0}], 2) is None
