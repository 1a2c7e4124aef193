"""Checkpoint.resume: a stopped and resumed run ends bitwise where an uninterrupted run ends.

Each scenario compares run A (uninterrupted) with run B, stopped by ``trainer.terminate()``
after some iteration (saving at the end), followed by run B', built from scratch and seeded
afresh as a new job would be, that resumes with ``checkpoint.resume("auto")``. The model has
dropout and is trained with Adam on data from ``prepare_loaders``, so generators, optimizer
state and the sampler's position all have to come back for the parameters to be equal.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _ckpt_workers import (
    BATCH,
    SIZE,
    LogRecords,
    build_run,
    epoch_length,
    in_place_resume,
    resume_equivalence,
    resume_scenarios,
    stop_at,
    window_end,
)

from unison.checkpoint import CheckpointError, atomic_save
from unison.checkpoint.manifest import checkpoint_name
from unison.testing import run_distributed

MAX_EPOCHS = 2


def scenarios(world_size: int) -> dict[str, dict]:
    """Where run B stops, per scenario; iterations derived from the epoch length at ``world_size``."""
    length = epoch_length(SIZE, BATCH, world_size)
    return {
        # inside epoch 2, so the sampler must skip part of an epoch other than the first
        "mid-epoch": dict(stop=length + length // 2, max_epochs=MAX_EPOCHS, control=True),
        "epoch-boundary": dict(stop=length, max_epochs=MAX_EPOCHS),
        # k=2, stop requested after the first micro-batch of epoch 2's first window
        "accumulation-mid-window": dict(stop=length + 1, max_epochs=MAX_EPOCHS, accumulation=2),
    }


def check_equivalence(result: dict, scenario: dict, world_size: int) -> None:
    length = epoch_length(SIZE, BATCH, world_size)
    k = scenario.get("accumulation", 1)
    saved_at = window_end(scenario["stop"], length, k)  # a save inside an epoch waits for the window's end
    epoch = -(-saved_at // length)
    assert result["epoch_length"] == length
    assert result["resumed"] is not None, (
        "run B' found no checkpoint to resume from: run B saved nothing when it stopped"
    )
    assert result["resumed"] == {
        "file": checkpoint_name("ckpt", epoch, saved_at),
        "epoch": epoch,
        "iteration": saved_at,
        "mid_epoch": saved_at % length != 0,
    }, "run B' did not resume from the checkpoint run B saved when it stopped"
    assert result["a_iteration"] == result["b_iteration"] == length * MAX_EPOCHS
    for e, loaded in result["a_loaded"].items():  # B then B' loaded exactly what A loaded
        b = result["b1_loaded"].get(e, []) + result["b2_loaded"].get(e, [])
        assert b == loaded, f"epoch {e}: runs B and B' loaded {b}, the uninterrupted run {loaded}"
    assert torch.equal(result["a"], result["b"]), (
        f"the resumed run differs from the uninterrupted one by {(result['a'] - result['b']).abs().max():.3g}"
    )
    if "control" in result:
        assert not torch.equal(result["a"], result["control"]), (
            "dropout masks do not change the result: the test is blind"
        )


@pytest.mark.parametrize("name", list(scenarios(1)))
def test_resume_on_one_rank_ends_bitwise_equal_to_an_uninterrupted_run(name, tmp_path):
    scenario = scenarios(1)[name]
    check_equivalence(resume_equivalence(str(tmp_path), **scenario), scenario, world_size=1)


_MODEL_WEIGHTS = [("objects", "model", key) for key in ("0.weight", "0.bias", "3.weight", "3.bias")]


def test_a_resume_that_reads_into_the_models_own_memory_ends_bitwise_equal(tmp_path):
    scenario = scenarios(1)["mid-epoch"]
    result = in_place_resume(str(tmp_path), scenario)
    check_equivalence(result, scenario, world_size=1)
    assert sorted(result["placed"]) == sorted(_MODEL_WEIGHTS), "the weights were not read into the model"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_resume_that_reads_into_the_models_own_memory_on_two_ranks_ends_bitwise_equal(tmp_path):
    scenario = scenarios(2)["mid-epoch"]
    results = run_distributed(in_place_resume, str(tmp_path), scenario, nproc=2, timeout=150)
    for rank, result in enumerate(results):  # rank 0 reads it as it checks it; rank 1 in its load
        check_equivalence(result, scenario, world_size=2)
        assert sorted(result["placed"]) == sorted(_MODEL_WEIGHTS), (
            f"rank {rank} read the weights into new memory"
        )


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    folder = tmp_path_factory.mktemp("resume2")
    results = run_distributed(resume_scenarios, str(folder), scenarios(2), nproc=2, timeout=150)
    return folder, results


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(scenarios(2)))
def test_resume_on_two_ranks_ends_bitwise_equal_to_an_uninterrupted_run(name, two_rank_results):
    _, results = two_rank_results
    for rank, result in enumerate(results):
        try:
            check_equivalence(result[name], scenarios(2)[name], world_size=2)
        except AssertionError as err:
            raise AssertionError(f"rank {rank}: {err}") from None
    # DDP keeps replicas equal: both ranks end with the same parameters
    assert torch.equal(results[0][name]["b"], results[1][name]["b"])


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_epoch_boundary_checkpoint_of_two_ranks_resumes_on_one_over_whole_epochs(
    two_rank_results, tmp_path
):
    """At an epoch's end the world size may change; each later epoch still sees every sample once."""
    folder, _ = two_rank_results
    length2 = epoch_length(SIZE, BATCH, 2)
    saved = folder / "epoch-boundary" / "b" / checkpoint_name("ckpt", 1, length2)
    run = build_run(str(tmp_path))
    with LogRecords() as logs:
        assert run.checkpoint.resume(saved) == saved
        run.trainer.run(run.loader, max_epochs=MAX_EPOCHS)
    assert any("world size 2" in m and "on 1 ranks" in m for m in logs.messages), logs.messages
    assert sorted(run.per_epoch_loaded) == list(range(2, MAX_EPOCHS + 1))
    for epoch, loaded in run.per_epoch_loaded.items():
        assert sorted(loaded) == list(range(SIZE)), (
            f"epoch {epoch} resumed on 1 rank loaded {len(loaded)} samples, not each of the {SIZE} once"
        )


# --- the layout of a run must match a mid-epoch checkpoint ----------------------------------------


def _stopped_run(folder, stop: int, **parts) -> None:
    run = build_run(str(folder), **parts)
    stop_at(run.trainer, stop)
    run.trainer.run(run.loader, max_epochs=MAX_EPOCHS)


@pytest.mark.parametrize(
    "change, expected",
    # Another per-rank batch size continues the permutation (tests/checkpoint/test_elastic.py).
    [({"accumulation": 2}, "accumulation_steps 1 -> 2")],
)
def test_a_mid_epoch_checkpoint_refuses_another_accumulation(tmp_path, change, expected):
    length = epoch_length(SIZE, BATCH, 1)
    _stopped_run(tmp_path, length + 2)  # mid-epoch, at a window boundary for k=1 and k=2
    run = build_run(str(tmp_path), **change)
    run.checkpoint.resume("auto")
    with pytest.raises(CheckpointError, match=expected) as err:
        run.trainer.run(run.loader, max_epochs=MAX_EPOCHS)
    assert "mid-epoch" in str(err.value) and "epoch's end" in str(err.value)
    assert run.dataset.loaded == [], "the run trained on data before refusing the checkpoint"


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"batch_size": BATCH // 2}, f"batch_size {BATCH} -> {BATCH // 2}"),
        ({"accumulation": 2}, "accumulation_steps 1 -> 2"),
    ],
)
def test_an_epoch_boundary_checkpoint_warns_of_another_layout_and_trains_whole_epochs(
    tmp_path, change, expected
):
    length = epoch_length(SIZE, BATCH, 1)
    _stopped_run(tmp_path, length)
    run = build_run(str(tmp_path), **change)
    with LogRecords() as logs:
        run.checkpoint.resume("auto")
        run.trainer.run(run.loader, max_epochs=MAX_EPOCHS)
    assert any(expected in m and "epoch boundary" in m for m in logs.messages), logs.messages
    assert sorted(run.per_epoch_loaded) == list(range(2, MAX_EPOCHS + 1))
    for epoch, loaded in run.per_epoch_loaded.items():
        assert sorted(loaded) == list(range(SIZE)), (
            f"epoch {epoch} resumed with {change} loaded {len(loaded)} samples, not each of the {SIZE} once"
        )


# --- damaged files --------------------------------------------------------------------------------


def _two_checkpoints(folder) -> list:
    """A run that saves at the end of epochs 1 and 2; the paths, oldest first."""
    run = build_run(str(folder))
    run.trainer.run(run.loader, max_epochs=2)
    assert len(run.checkpoint.saved) == 2
    return run.checkpoint.saved


def _truncate(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _corrupt(path) -> None:
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 64] = bytes(b ^ 0xFF for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_truncate, _corrupt], ids=["truncated", "corrupt"])
def test_resume_from_a_damaged_path_raises_naming_the_file_and_the_fix(tmp_path, damage):
    _, newest = _two_checkpoints(tmp_path)
    damage(newest)
    run = build_run(str(tmp_path))
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    with pytest.raises(CheckpointError) as err:
        run.checkpoint.resume(newest)
    message = str(err.value)
    assert str(newest) in message
    assert (
        "truncated or corrupt" in message and "previous checkpoint" in message and "resume='auto'" in message
    )
    after = run.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed resume changed the model"


def test_resume_from_a_missing_path_raises_naming_it(tmp_path):
    run = build_run(str(tmp_path))
    missing = tmp_path / checkpoint_name("ckpt", 1, 5)
    with pytest.raises(CheckpointError, match="does not exist") as err:
        run.checkpoint.resume(missing)
    assert str(missing) in str(err.value)


@pytest.mark.parametrize("damage", [_truncate, _corrupt], ids=["truncated", "corrupt"])
def test_auto_resume_falls_back_to_the_previous_complete_checkpoint_with_a_warning(tmp_path, damage):
    older, newest = _two_checkpoints(tmp_path)
    expected = torch.load(older, weights_only=True)
    damage(newest)
    run = build_run(str(tmp_path))
    with LogRecords() as logs:
        chosen = run.checkpoint.resume("auto")
    assert chosen == older
    warnings = [r for r in logs.records if r.levelno == logging.WARNING and str(newest) in r.getMessage()]
    assert warnings and "falling back" in warnings[0].getMessage(), logs.messages
    loaded = run.model.state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in expected["objects"]["model"].items())
    assert run.trainer.state.iteration == expected["meta"]["iteration"]


def test_auto_resume_in_an_empty_folder_starts_fresh(tmp_path):
    run = build_run(str(tmp_path / "new"))
    before = {k: v.clone() for k, v in run.model.state_dict().items()}
    assert run.checkpoint.resume("auto") is None
    assert all(torch.equal(before[k], v) for k, v in run.model.state_dict().items())
    run.trainer.run(run.loader, max_epochs=1)
    assert run.trainer.state.iteration == epoch_length(SIZE, BATCH, 1)


# --- checkpoints that do not fit the run ------------------------------------------------------------


def _no_meta(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "meta"}


def _other_format(state: dict) -> dict:
    return {**state, "meta": {**state["meta"], "format": 99}}


def _without_optimizer(state: dict) -> dict:
    return {**state, "objects": {"model": state["objects"]["model"]}}


def _mid_epoch_on_two_ranks(state: dict) -> dict:
    return {**state, "meta": {**state["meta"], "world_size": 2, "mid_epoch": True}}


@pytest.mark.parametrize(
    "spoil, message",
    [
        (_no_meta, r"has format None; this unison reads 1"),
        (_other_format, r"has format 99; this unison reads 1"),
        (_without_optimizer, r"holds no state for \['optimizer'\] \(it has \['model'\]\)"),
        (_mid_epoch_on_two_ranks, r"was taken mid-epoch \(iteration 2\) with world size 2; this run has 1"),
    ],
    ids=["foreign", "other-format", "missing-object", "mid-epoch-other-world-size"],
)
def test_a_checkpoint_that_does_not_fit_is_refused_before_anything_is_loaded(tmp_path, spoil, message):
    run = build_run(str(tmp_path / "a"), checkpoint=dict(every_epochs=None, every_iters=2, at_end=False))
    run.trainer.run(run.loader, max_epochs=1, epoch_length=2)
    spoilt = tmp_path / "spoilt.pt"
    atomic_save(spoil(torch.load(run.checkpoint.saved[0], weights_only=True)), spoilt)
    fresh = build_run(str(tmp_path / "b"))
    before = {k: v.clone() for k, v in fresh.model.state_dict().items()}
    with pytest.raises(CheckpointError, match=message) as err:
        fresh.checkpoint.resume(spoilt)
    assert str(spoilt) in str(err.value)
    after = fresh.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a refused checkpoint changed the model"
    assert fresh.optimizer.state_dict()["state"] == {}
