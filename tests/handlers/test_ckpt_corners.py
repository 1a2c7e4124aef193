"""Checkpoint corners: which checkpoint is newest after a change of layout, non-finite weights,
values a weights-only load refuses, a full disk, and archives written without CRC-32s."""

from __future__ import annotations

import errno
import itertools
import json
import logging
import math
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from _ckpt_workers import (
    BATCH,
    SIZE,
    Chunks,
    LogRecords,
    build_run,
    flat_params,
    meta_of,
    resume_equivalence,
    train_saving,
)

from unison.checkpoint import CheckpointError, Manifest, load_checkpoint
from unison.checkpoint.lock import LOCK_FILE
from unison.checkpoint.manifest import checkpoint_name
from unison.checkpoint.verify import NotPlainError
from unison.checkpoint.writer import CheckpointDiskFull
from unison.distributed import TrainSampler, get_world_size
from unison.engine import Events
from unison.handlers import Checkpoint, NonFiniteGuard
from unison.testing import run_distributed


def on_disk(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.pt"))


def in_manifest(folder: Path) -> list[str]:
    return sorted(e["file"] for e in json.loads((folder / "manifest.json").read_text())["checkpoints"])


# --- 1. newest is the last saved, whatever its iteration --------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("manifest_lost", [False, True], ids=["manifest-kept", "manifest-lost"])
def test_after_a_resume_with_another_layout_rotation_keeps_the_new_checkpoints(tmp_path, manifest_lost):
    """World size 2 (3 batches an epoch) saves e1-i3 and e2-i6; the resume at world size 1 with
    the whole data in one batch counts 1 iteration an epoch and saves e3-i3, e4-i4: smaller
    iterations, newer checkpoints."""
    keep = dict(keep_last=2)
    first = run_distributed(train_saving, str(tmp_path), max_epochs=2, checkpoint=keep, nproc=2, timeout=100)
    old = [checkpoint_name("ckpt", 1, 3), checkpoint_name("ckpt", 2, 6)]
    assert first[0]["saved"] == old and on_disk(tmp_path) == old
    if manifest_lost:
        (tmp_path / "manifest.json").unlink()

    second = train_saving(str(tmp_path), max_epochs=4, resume=True, checkpoint=keep, batch_size=20)
    new = [checkpoint_name("ckpt", 3, 3), checkpoint_name("ckpt", 4, 4)]
    assert second["resumed"] == old[-1] and second["saved"] == new
    assert on_disk(tmp_path) == in_manifest(tmp_path) == sorted(new), "rotation deleted the newest files"
    assert [e.file for e in Manifest(tmp_path).rebuild().newest()] == new[::-1]

    third = build_run(str(tmp_path), checkpoint=keep, batch_size=20)
    assert meta_of(third.checkpoint.resume("auto"))["file"] == new[-1]
    sequences = [torch.load(tmp_path / name, weights_only=True)["meta"]["sequence"] for name in new]
    assert sequences == [3, 4]


# --- 2. non-finite weights are never the newest checkpoint ------------------------------------------


POISON_AT = 7
"""Inside epoch 2 (5 batches an epoch at one rank), after epoch 1's good checkpoint."""


def test_non_finite_weights_are_never_saved_and_the_last_good_checkpoint_survives(tmp_path):
    run = build_run(str(tmp_path), checkpoint=dict(keep_last=1, every_epochs=1, at_end=True))
    NonFiniteGuard().attach(run.trainer)

    @run.trainer.on(Events.ITERATION_STARTED(once=POISON_AT))
    def _poison(engine) -> None:
        with torch.no_grad():
            run.model[0].weight[0, 0] = float("nan")

    with LogRecords() as logs:
        run.trainer.run(run.loader, max_epochs=3)
    good = checkpoint_name("ckpt", 1, 5)
    assert run.trainer.state.iteration == POISON_AT, "the guard did not stop the run where expected"
    assert on_disk(tmp_path) == in_manifest(tmp_path) == [good], "a NaN checkpoint replaced the last good one"
    assert [p.name for p in run.checkpoint.saved] == [good]
    weights = load_checkpoint(tmp_path / good)["objects"]["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())
    warned = [m for m in logs.messages if "Not saving a checkpoint" in m]
    assert len(warned) == 1 and "model.0.weight" in warned[0] and good in warned[0], logs.messages
    assert Manifest(tmp_path).rebuild().newest_complete() == tmp_path / good


def test_non_finite_optimizer_state_is_named_too(tmp_path):
    run = build_run(str(tmp_path), checkpoint=dict(keep_last=1, every_epochs=None, at_end=False))
    run.trainer.run(run.loader, max_epochs=1)
    state = next(iter(run.optimizer.state.values()))
    state["exp_avg_sq"].view(-1)[0] = float("inf")
    with LogRecords() as logs:
        assert run.checkpoint.save() is None
    assert on_disk(tmp_path) == []
    assert any("optimizer.state.0.exp_avg_sq" in m for m in logs.messages), logs.messages


def test_a_sync_saves_finite_check_runs_while_its_file_is_written(tmp_path, monkeypatch):
    """The check waits until the file has begun to be written: run one after the other, the save
    would never finish. A NaN found that way keeps the file from taking its name."""
    import threading

    import unison.checkpoint.io as io_module
    import unison.checkpoint.verify as verify_module

    run = build_run(str(tmp_path), checkpoint=dict(keep_last=1, every_epochs=None, at_end=False))
    run.trainer.run(run.loader, max_epochs=1)
    writing = threading.Event()
    real_archive, real_check = io_module.save_archive, verify_module.first_non_finite
    threads: list[str] = []

    def archive(obj, sink, **kwargs):
        writing.set()
        return real_archive(obj, sink, **kwargs)

    def check(objects):
        threads.append(threading.current_thread().name)
        assert writing.wait(10), "the finite check ran before the file was written"
        return real_check(objects)

    monkeypatch.setattr(io_module, "save_archive", archive)
    monkeypatch.setattr(verify_module, "first_non_finite", check)
    first = run.checkpoint.save()
    assert first is not None and first.exists() and threads[0].startswith("unison-ckpt-check")
    with torch.no_grad():
        run.model[0].weight[0, 0] = float("nan")
    run.trainer.state.iteration += 1
    writing.clear()
    with LogRecords() as logs:
        assert run.checkpoint.save() is None
    assert on_disk(tmp_path) == in_manifest(tmp_path) == [first.name]
    assert [m for m in logs.messages if "Not saving a checkpoint" in m and first.name in m]


# --- 3. values a weights-only load refuses ---------------------------------------------------------


class Counter:
    """A handler-like object whose state holds whatever the test puts in it."""

    def __init__(self, state: dict) -> None:
        self.state = state
        self.loaded: dict | None = None

    def state_dict(self) -> dict:
        return self.state

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


def test_numpy_scalars_and_paths_are_saved_as_plain_values_and_resume(tmp_path):
    config = {
        "data": {"kwargs": {"root": Path("/data/x"), "mean": np.float32(0.25)}},
        "shape": (2, np.int64(3)),
    }
    counter = Counter({"best": np.float64(0.125), "steps": np.int64(7), "flag": np.bool_(True)})
    run = build_run(str(tmp_path / "unused"))
    checkpoint = Checkpoint(
        tmp_path, {"model": run.model, "counter": counter}, run.trainer, config=config, every_epochs=1
    )
    checkpoint.attach()
    run.trainer.run(run.loader, max_epochs=1)
    state = torch.load(checkpoint.saved[-1], weights_only=True)  # what every resume does
    assert state["config"] == {"data": {"kwargs": {"root": "/data/x", "mean": 0.25}}, "shape": (2, 3)}
    assert (
        type(state["config"]["data"]["kwargs"]["mean"]) is float and type(state["config"]["shape"][1]) is int
    )
    assert state["objects"]["counter"] == {"best": 0.125, "steps": 7, "flag": True}
    again = build_run(str(tmp_path / "unused2"))
    fresh = Counter({})
    Checkpoint(tmp_path, {"model": again.model, "counter": fresh}, again.trainer).resume("auto")
    assert fresh.loaded == {"best": 0.125, "steps": 7, "flag": True}


@pytest.mark.parametrize(
    "value, kind",
    [(np.zeros(3), "numpy.ndarray"), ({1, 2}, "builtins.set"), (object(), "builtins.object")],
    ids=["array", "set", "object"],
)
def test_a_value_a_weights_only_load_refuses_is_refused_at_save_naming_its_key(tmp_path, value, kind):
    run = build_run(str(tmp_path / "unused"))
    counter = Counter({"history": {"seen": value}})
    checkpoint = Checkpoint(tmp_path, {"model": run.model, "counter": counter}, run.trainer, every_epochs=1)
    checkpoint.attach()
    with pytest.raises(
        NotPlainError, match=rf"counter\.history\.seen = .* \(a {kind}\).*weights_only=True"
    ) as err:
        run.trainer.run(run.loader, max_epochs=1)
    assert "where counter.history.seen is set" in str(err.value)
    assert on_disk(tmp_path) == []


def test_a_config_value_a_weights_only_load_refuses_is_refused_naming_its_key(tmp_path):
    run = build_run(str(tmp_path / "unused"))
    config = {"data": {"kwargs": {"root": "/x", "mean": np.array([0.5, 0.5])}}}
    with pytest.raises(
        NotPlainError, match=r"config\.data\.kwargs\.mean = array.*numpy\.ndarray.*torch\.from_numpy"
    ):
        Checkpoint(tmp_path, {"model": run.model}, run.trainer, config=config)


# --- 4. a full disk ---------------------------------------------------------------------------------


def _no_space(fh) -> None:
    fh.write(b"PK\x03\x04 partial archive")
    raise OSError(errno.ENOSPC, "No space left on device")


def _torch_wrapped(fh) -> None:
    try:
        _no_space(fh)
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0") from None


@pytest.mark.parametrize("failure", [_no_space, _torch_wrapped], ids=["oserror", "torch-runtimeerror"])
def test_a_full_disk_says_which_file_how_much_space_and_that_the_previous_checkpoint_is_intact(
    tmp_path, monkeypatch, failure
):
    run = build_run(str(tmp_path), checkpoint=dict(keep_last=1, every_epochs=1, at_end=False))
    run.trainer.run(run.loader, max_epochs=1)
    previous = checkpoint_name("ckpt", 1, 5)
    before = (tmp_path / previous).read_bytes(), (tmp_path / "manifest.json").read_bytes()
    monkeypatch.setattr(torch, "save", lambda obj, fh, *a, **k: failure(fh))
    with pytest.raises(CheckpointDiskFull) as err:
        run.trainer.run(run.loader, max_epochs=2)
    message = str(err.value)
    free = shutil.disk_usage(tmp_path).free
    assert checkpoint_name("ckpt", 2, 10) in message and str(tmp_path) in message
    weights = sum(
        t.untyped_storage().nbytes() for t in run.model.state_dict().values()
    )  # and Adam's 2 moments
    estimate = re.search(r"needs about (\d+(?:\.\d)?) KiB", message)
    assert estimate and 3 * weights <= float(estimate[1]) * 1024 <= 3 * weights + 64 * 1024, message
    assert f"{free / 2**30:.1f} GiB free" in message or f"{free / 2**20:.1f} MiB free" in message
    assert f"previous checkpoint {previous} is intact" in message and "resume('auto')" in message
    assert err.value.errno == errno.ENOSPC
    left = sorted(p.name for p in tmp_path.iterdir() if p.name != LOCK_FILE)  # the folder's lock stays
    assert left == [previous, "manifest.json"], "a temp file was left"
    assert ((tmp_path / previous).read_bytes(), (tmp_path / "manifest.json").read_bytes()) == before


# --- 5. archives written without CRC-32s -------------------------------------------------------------


@pytest.fixture
def no_crc32():
    torch.serialization.set_crc32_options(False)
    try:
        yield
    finally:
        torch.serialization.set_crc32_options(True)


class InfoRecords(LogRecords):
    """LogRecords at INFO."""

    def __init__(self) -> None:
        super().__init__()
        self.setLevel(logging.INFO)

    def __enter__(self) -> InfoRecords:
        super().__enter__()
        self._info_level = logging.getLogger("unison").level
        logging.getLogger("unison").setLevel(logging.INFO)
        return self


def test_checkpoints_written_without_crc32s_resume_and_survive_a_rebuild(tmp_path, no_crc32):
    run = build_run(str(tmp_path), checkpoint=dict(keep_last=None, every_epochs=1))
    run.trainer.run(run.loader, max_epochs=2)
    names = [checkpoint_name("ckpt", 1, 5), checkpoint_name("ckpt", 2, 10)]
    assert [p.name for p in run.checkpoint.saved] == names
    assert all(i.CRC == 0 for i in zipfile.ZipFile(tmp_path / names[-1]).infolist()), "CRCs were recorded"
    (tmp_path / "manifest.json").unlink()
    with InfoRecords() as logs:
        assert [e.file for e in Manifest(tmp_path).rebuild().entries] == names
        again = build_run(str(tmp_path), checkpoint=dict(keep_last=None, every_epochs=1))
        assert meta_of(again.checkpoint.resume("auto"))["file"] == names[-1]
    assert any(
        names[-1] in m and "no CRC-32s" in m and "checked from the archive's structure" in m
        for m in logs.messages
    ), logs.messages
    # the structure check still sees a file cut short
    damaged = tmp_path / names[-1]
    damaged.write_bytes(damaged.read_bytes()[:-200])
    assert Manifest(tmp_path).rebuild().newest_complete() == tmp_path / names[0]
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(damaged)


# --- 6. the sampler position with a custom batch sampler ---------------------------------------------


def assert_resumed_as_uninterrupted(result: dict) -> None:
    """The same samples, in the same order, epoch by epoch; and the same parameters, bitwise."""
    assert result["resumed"] is not None and result["a_iteration"] == result["b_iteration"]
    for epoch, loaded in result["a_loaded"].items():
        resumed = result["b1_loaded"].get(epoch, []) + result["b2_loaded"].get(epoch, [])
        assert resumed == loaded, (
            f"epoch {epoch}: stopped + resumed runs loaded {resumed}, uninterrupted {loaded}"
        )
    assert sorted(result["a_loaded"]) == sorted(set(result["b1_loaded"]) | set(result["b2_loaded"]))
    assert torch.equal(result["a"], result["b"]), "the resumed run ends with other parameters"


@pytest.mark.parametrize("sizes", [(3,), (2, 5, 3)], ids=["fixed-3", "varying-2-5-3"])
def test_a_custom_batch_sampler_resumes_mid_epoch_exactly(tmp_path, sizes):
    length = len(Chunks(TrainSampler(range(SIZE), seed=0, rank=0, world_size=1), sizes))
    stop = length + 3  # 3 batches into epoch 2
    result = resume_equivalence(str(tmp_path), stop=stop, max_epochs=2, batch_sizes=sizes)
    assert result["resumed"]["iteration"] == stop and result["resumed"]["mid_epoch"]
    saved = torch.load(tmp_path / "b" / result["resumed"]["file"], weights_only=True)["sampler"]
    assert (saved["epoch"], saved["consumed"]) == (1, sum(itertools.islice(itertools.cycle(sizes), 3)))
    assert_resumed_as_uninterrupted(result)


# --- 7. epoch_length other than the loader's length ---------------------------------------------------


@pytest.mark.parametrize(
    "length, stop, max_epochs",
    [(3, 3, 4), (3, 4, 4), (3, 8, 4), (7, 7, 3), (7, 9, 3), (7, 12, 3)],
    ids=["3-epoch-end", "3-mid", "3-mid-second-pass", "7-epoch-end", "7-mid-second-pass", "7-mid"],
)
def test_an_epoch_length_other_than_the_loaders_resumes_exactly(tmp_path, length, stop, max_epochs):
    """The loader has 5 batches. With epoch_length=3 ignite keeps the data iterator across epochs;
    with 7 it starts a new one inside an epoch: the position saved is the iterator's."""
    result = resume_equivalence(str(tmp_path), stop=stop, max_epochs=max_epochs, epoch_length=length)
    assert result["resumed"]["iteration"] == stop
    assert result["a_iteration"] == length * max_epochs
    assert_resumed_as_uninterrupted(result)


# --- 8. terminate_epoch() ------------------------------------------------------------------------------


def _cut_epoch_1_at(run, k: int) -> None:
    @run.trainer.on(Events.ITERATION_COMPLETED(once=k))
    def _cut(engine) -> None:
        engine.terminate_epoch()


def _terminate_epoch_runs(folder: str, k: int = 2, num_workers: int = 0) -> dict:
    a = build_run(f"{folder}/a", num_workers=num_workers)
    _cut_epoch_1_at(a, k)
    a.trainer.run(a.loader, max_epochs=3)
    b1 = build_run(f"{folder}/b", num_workers=num_workers)
    _cut_epoch_1_at(b1, k)
    b1.trainer.add_event_handler(Events.EPOCH_COMPLETED(once=1), lambda engine: engine.terminate())
    b1.trainer.run(b1.loader, max_epochs=3)
    b2 = build_run(f"{folder}/b", num_workers=num_workers)
    resumed = b2.checkpoint.resume("auto")
    b2.trainer.run(b2.loader, max_epochs=3)
    return {
        "a": flat_params(a.model),
        "b": flat_params(b2.model),
        "a_iteration": a.trainer.state.iteration,
        "b_iteration": b2.trainer.state.iteration,
        "resumed": meta_of(resumed),
        "sampler": torch.load(resumed, weights_only=True)["sampler"],
        "a_loaded": a.per_epoch_loaded,
        "b1_loaded": b1.per_epoch_loaded,
        "b2_loaded": b2.per_epoch_loaded,
    }


def test_a_save_after_terminate_epoch_holds_the_next_iterator_as_fresh(tmp_path):
    """terminate_epoch() ends the data iterator: the save at the epoch's end must not hold the cut
    epoch's sampler position (the next epoch draws a new permutation)."""
    result = _terminate_epoch_runs(str(tmp_path))
    assert result["sampler"]["fresh"] is True and result["sampler"]["consumed"] == 0


def test_a_resume_after_terminate_epoch_consumes_what_the_uninterrupted_run_does(tmp_path):
    result = _terminate_epoch_runs(str(tmp_path))
    assert result["resumed"]["mid_epoch"] is False
    assert_resumed_as_uninterrupted(result)


def test_with_loader_workers_the_epoch_after_terminate_epoch_draws_its_own_permutation(tmp_path):
    """ignite remakes the data iterator when terminate_epoch() cuts an epoch, before the next
    set_epoch: workers prefetched the old order. Indices are loaded in the workers, so the
    parameters and the epochs' counts are what is compared."""
    result = _terminate_epoch_runs(str(tmp_path), num_workers=1)
    assert result["resumed"]["mid_epoch"] is False
    assert result["a_iteration"] == result["b_iteration"]
    assert torch.equal(result["a"], result["b"])
    plain = _terminate_epoch_runs(str(tmp_path / "plain"))
    assert torch.equal(result["a"], plain["a"])  # workers or not, the same samples in the same order


# --- the epoch's mean training loss across a mid-epoch resume -------------------------------------------


def _loss_after_resume(folder: str) -> tuple[float, float]:
    """The last epoch's mean loss, uninterrupted and resumed from inside that epoch."""
    length = math.ceil(SIZE / (BATCH * get_world_size()))  # batches per epoch and rank
    result = resume_equivalence(folder, stop=2 * length + 2, max_epochs=3)  # 2 batches into epoch 3
    return result["a_loss"], result["b_loss"]


def test_the_epochs_mean_loss_after_a_mid_epoch_resume_covers_the_whole_epoch(tmp_path):
    uninterrupted, resumed = _loss_after_resume(str(tmp_path))
    assert resumed == pytest.approx(uninterrupted, rel=1e-12, abs=0)


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_epochs_mean_loss_after_a_mid_epoch_resume_at_two_ranks(tmp_path):
    for uninterrupted, resumed in run_distributed(_loss_after_resume, str(tmp_path), nproc=2, timeout=100):
        assert resumed == pytest.approx(uninterrupted, rel=1e-12, abs=0)
