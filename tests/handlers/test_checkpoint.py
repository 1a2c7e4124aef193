"""Checkpoint: when it saves, what a file holds, rotation across restarts, asynchronous writes."""

from __future__ import annotations

import json
import math
import threading
from pathlib import Path

import ignite
import pytest
import torch
from _ckpt_workers import (
    BATCH,
    CONFIG,
    SIZE,
    build_parts,
    build_run,
    checkpoint_contents,
    epoch_length,
    require_empty_on_every_rank,
    window_end,
)
from torch import nn

import unison
import unison.handlers.checkpoint as checkpoint_module
from unison.checkpoint import Manifest, load_checkpoint
from unison.checkpoint.manifest import checkpoint_name
from unison.engine import Engine, Events
from unison.handlers import Checkpoint
from unison.testing import run_distributed


def on_disk(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.pt"))


def in_manifest(folder: Path) -> list[str]:
    return sorted(e["file"] for e in json.loads((folder / "manifest.json").read_text())["checkpoints"])


def assert_same_state(a, b, where: str = "checkpoint") -> None:
    """Nested containers equal, tensors bitwise; the save's wall-clock time aside."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            if where == "checkpoint.meta" and key == "saved_at":
                continue
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)), (
            f"{where}: {a!r} != {b!r}"
        )


# --- triggers -------------------------------------------------------------------------------------


def test_every_epochs_and_at_end_save_at_the_expected_iterations(tmp_path):
    length, epochs, every = epoch_length(SIZE, BATCH, 1), 3, 2
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=every, at_end=True))
    run.trainer.run(run.loader, max_epochs=epochs)
    expected = [
        checkpoint_name("ckpt", e, e * length) for e in range(1, epochs + 1) if e % every == 0 or e == epochs
    ]
    assert [p.name for p in run.checkpoint.saved] == expected
    assert on_disk(tmp_path) == in_manifest(tmp_path) == sorted(expected)


def test_every_iters_saves_wait_for_the_end_of_the_accumulation_window(tmp_path):
    length, epochs, every, k = epoch_length(SIZE, BATCH, 1), 2, 3, 2
    run = build_run(
        str(tmp_path), accumulation=k, checkpoint=dict(every_epochs=None, every_iters=every, at_end=False)
    )
    run.trainer.run(run.loader, max_epochs=epochs)
    due = range(every, length * epochs + 1, every)
    expected = [window_end(i, length, k) for i in due]
    assert any(e != i for e, i in zip(expected, due, strict=True)), "no save had to wait: the test is blind"
    assert [load_checkpoint(p)["meta"]["iteration"] for p in run.checkpoint.saved] == expected
    for path in run.checkpoint.saved:
        meta = load_checkpoint(path)["meta"]
        assert path.name == checkpoint_name("ckpt", -(-meta["iteration"] // length), meta["iteration"])
        assert meta["mid_epoch"] == bool(meta["iteration"] % length)


def test_saving_twice_at_one_iteration_writes_once(tmp_path):
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=1, at_end=True))
    run.trainer.run(run.loader, max_epochs=1)
    first = run.checkpoint.saved[-1]
    assert run.checkpoint.save() == first
    assert len(run.checkpoint.saved) == 1 and on_disk(tmp_path) == [first.name]


# --- what a checkpoint holds ----------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_two_rank_checkpoint_loads_with_weights_only_and_holds_an_exact_resume(tmp_path):
    results = run_distributed(checkpoint_contents, str(tmp_path), nproc=2, timeout=100)
    r0 = results[0]
    length = r0["length"]
    assert results[1]["saved"] == [], "a rank other than 0 wrote a file"
    assert r0["iteration"] == results[1]["iteration"] and r0["iteration"] % length, (
        "the last save is not mid-epoch"
    )
    for path in Path(tmp_path).glob("*.pt"):
        torch.load(path, weights_only=True)  # every file the library wrote
    state = torch.load(r0["saved"][-1], weights_only=True)
    assert sorted(state) == ["config", "meta", "objects", "rng", "sampler", "trainer"]
    objects = state["objects"]
    assert sorted(objects) == ["early_stopping", "model", "optimizer", "scaler", "scheduler"]

    # the model, without DDP's prefix, although the ranks trained a DDP model
    assert all(k.startswith("module.") for k in r0["wrapped_keys"])
    assert sorted(objects["model"]) == sorted(r0["model"])
    for key, value in objects["model"].items():
        assert torch.equal(value, r0["model"][key]) and torch.equal(value, results[1]["model"][key])

    # every rank's generators, each its own
    assert len(state["rng"]) == 2
    for rank, result in enumerate(results):
        assert torch.equal(state["rng"][rank]["torch"], result["torch_rng"]), f"rank {rank}'s torch generator"
    assert not torch.equal(state["rng"][0]["torch"], state["rng"][1]["torch"])

    # the loop's and the sampler's position
    iteration = r0["iteration"]
    assert state["trainer"]["iteration"] == iteration and state["trainer"]["epoch_length"] == length
    sampler = state["sampler"]
    assert sampler["epoch"] == iteration // length
    assert sampler["consumed"] == (iteration % length) * BATCH
    assert (sampler["world_size"], sampler["dataset_size"]) == (2, SIZE)

    # the handlers' and objects' states, as the live objects had them
    assert_same_state(objects["scheduler"], r0["scheduler"], "scheduler")
    assert objects["scheduler"]["last_epoch"] == iteration // length
    assert_same_state(objects["scaler"], r0["scaler"], "scaler")
    assert_same_state(objects["early_stopping"], r0["early_stopping"], "early_stopping")
    assert objects["early_stopping"]["checker"]["best"] is not None
    steps = [s["step"] for s in objects["optimizer"]["state"].values()]
    assert len(steps) == len(r0["optimizer_steps"]) and all(
        torch.equal(a, b) for a, b in zip(steps, r0["optimizer_steps"], strict=True)
    )
    assert state["config"] == CONFIG

    meta = state["meta"]
    assert (meta["world_size"], meta["iteration"], meta["mid_epoch"]) == (2, iteration, True)
    assert (meta["batch_size"], meta["accumulation_steps"]) == (BATCH, 1)
    assert meta["versions"] == {
        "unison": unison.__version__,
        "torch": str(torch.__version__),
        "ignite": ignite.__version__,
    }


# --- require_empty --------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_require_empty_gives_every_rank_the_same_answer(tmp_path):
    used, fresh = tmp_path / "used", tmp_path / "fresh"
    run = build_run(str(used))
    run.trainer.run(run.loader, max_epochs=1)
    assert on_disk(used)
    results = run_distributed(require_empty_on_every_rank, [str(used), str(fresh)], nproc=2, timeout=100)
    (used0, fresh0), (used1, fresh1) = results
    assert used0 is not None and used0 == used1, "the ranks did not both refuse the folder"
    assert str(used) in used0 and "1 checkpoint" in used0
    assert fresh0 is None and fresh1 is None


def test_require_empty_on_one_rank(tmp_path):
    run = build_run(str(tmp_path))
    run.trainer.run(run.loader, max_epochs=1)
    with pytest.raises(FileExistsError, match="already holds 1 checkpoint"):
        Checkpoint(tmp_path, {"model": run.model}, run.trainer, require_empty=True)
    Checkpoint(tmp_path / "other", {"model": run.model}, run.trainer, require_empty=True)


# --- rotation -------------------------------------------------------------------------------------


SCORES = [0.9, 0.5, 0.6, 0.4, 0.3, 0.2, 0.95, 0.1, 0.05]
"""The score after each epoch: the best comes first, then a new best arrives after a restart."""
FIRST_RUN = 5


def expected_kept(scores: list[float], keep_last: int, keep_best: int) -> list[str]:
    """The files rotation keeps after epochs 1..len(scores) (one iteration each), mode max."""
    names = [checkpoint_name("ckpt", e, e) for e in range(1, len(scores) + 1)]
    best = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)[:keep_best]
    return sorted(set(names[-keep_last:]) | {names[i] for i in best})


def _scored_engine(folder: Path, **options) -> tuple[Engine, Checkpoint, list]:
    """An engine of one iteration per epoch whose score follows SCORES; records the folder after each save."""
    engine = Engine(lambda e, b: None, sync_every=None)

    @engine.on(Events.EPOCH_COMPLETED)
    def _score(e: Engine) -> None:
        e.state.metrics["score"] = SCORES[e.state.epoch - 1]

    checkpoint = Checkpoint(folder, {"model": nn.Linear(2, 1)}, engine, metric="score", mode="max", **options)
    checkpoint.attach()
    after_each: list = []

    @engine.on(Events.EPOCH_COMPLETED)
    def _record(e: Engine) -> None:
        after_each.append((e.state.epoch, checkpoint.saved[-1].name, on_disk(folder), in_manifest(folder)))

    return engine, checkpoint, after_each


@pytest.mark.parametrize("manifest_lost", [False, True], ids=["manifest-kept", "manifest-lost"])
def test_rotation_keeps_the_last_two_and_the_best_across_a_restart(tmp_path, manifest_lost):
    options = dict(keep_last=2, keep_best=1)
    engine, checkpoint, first = _scored_engine(tmp_path, **options)
    engine.run(range(1), max_epochs=FIRST_RUN)
    expected = expected_kept(SCORES[:FIRST_RUN], 2, 1)
    assert checkpoint_name("ckpt", 1, 1) in expected, "the early best is not kept: the scenario is off"
    assert on_disk(tmp_path) == in_manifest(tmp_path) == expected
    assert checkpoint.best.file == checkpoint_name("ckpt", 1, 1)

    if manifest_lost:
        (tmp_path / "manifest.json").unlink()
    engine, checkpoint, second = _scored_engine(tmp_path, **options)  # a new job on the same folder
    assert checkpoint.resume("auto").name == checkpoint_name("ckpt", FIRST_RUN, FIRST_RUN)
    engine.run(range(1), max_epochs=len(SCORES))
    for epoch, newest, files, listed in first + second:
        kept = expected_kept(SCORES[:epoch], 2, 1)
        assert files == listed == kept, (
            f"after epoch {epoch}: on disk {files}, manifest {listed}, expected {kept}"
        )
        assert newest in files, f"after epoch {epoch} rotation deleted the checkpoint it had just written"
    assert [epoch for epoch, *_ in second] == list(range(FIRST_RUN + 1, len(SCORES) + 1))


def test_rotation_deletes_nothing_when_the_new_file_fails_to_write(tmp_path, monkeypatch):
    engine, checkpoint, after_each = _scored_engine(tmp_path, keep_last=1)
    engine.run(range(1), max_epochs=2)
    before_disk, before_manifest = on_disk(tmp_path), in_manifest(tmp_path)
    assert before_disk == [checkpoint_name("ckpt", 2, 2)]

    def full_disk(obj, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "atomic_save", full_disk)
    with pytest.raises(OSError, match="No space left"):
        engine.run(range(1), max_epochs=3)
    assert on_disk(tmp_path) == before_disk and in_manifest(tmp_path) == before_manifest


def test_rotation_deletes_nothing_before_the_manifest_is_durable(tmp_path, monkeypatch):
    engine, checkpoint, after_each = _scored_engine(tmp_path, keep_last=1)
    engine.run(range(1), max_epochs=2)
    old = checkpoint_name("ckpt", 2, 2)
    assert on_disk(tmp_path) == in_manifest(tmp_path) == [old]

    def write_fails(self):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(Manifest, "write", write_fails)
    with pytest.raises(OSError, match="Input/output"):
        engine.run(range(1), max_epochs=3)
    new = checkpoint_name("ckpt", 3, 3)
    assert on_disk(tmp_path) == sorted([old, new]), (
        "the old checkpoint was deleted before the manifest was written"
    )
    assert in_manifest(tmp_path) == [old]
    monkeypatch.undo()
    assert [e.file for e in Manifest(tmp_path).rebuild().entries] == [old, new]


@pytest.mark.parametrize(
    "mode, scores, best",
    [("max", [float("nan"), 0.5, 0.7, 0.6], 3), ("min", [float("nan"), 0.5, 0.2, 0.6], 3)],
)
def test_a_nan_score_is_never_the_best(tmp_path, mode, scores, best):
    engine = Engine(lambda e, b: None, sync_every=None)

    @engine.on(Events.EPOCH_COMPLETED)
    def _score(e: Engine) -> None:
        e.state.metrics["score"] = scores[e.state.epoch - 1]

    # keep every file, so the NaN-scored one is still in the manifest when ``best`` is asked
    checkpoint = Checkpoint(
        tmp_path, {"model": nn.Linear(2, 1)}, engine, metric="score", mode=mode, keep_last=None, keep_best=1
    )
    checkpoint.attach()
    engine.run(range(1), max_epochs=len(scores))
    assert len(on_disk(tmp_path)) == len(scores)
    best_name = checkpoint_name("ckpt", best, best)
    assert checkpoint.best is not None and checkpoint.best.file == best_name, f"best is {checkpoint.best}"
    # and rotation agrees: keeping only the last one and the best keeps the real best
    engine, kept = Engine(lambda e, b: None, sync_every=None), tmp_path / "rotated"
    engine.add_event_handler(Events.EPOCH_COMPLETED, _score)
    Checkpoint(
        kept, {"model": nn.Linear(2, 1)}, engine, metric="score", mode=mode, keep_last=1, keep_best=1
    ).attach()
    engine.run(range(1), max_epochs=len(scores))
    assert on_disk(kept) == sorted({best_name, checkpoint_name("ckpt", len(scores), len(scores))})


# --- asynchronous saves ---------------------------------------------------------------------------


class GatedWrite:
    """Stands in for ``atomic_save``: each write waits for ``release`` before writing for real."""

    def __init__(self, real) -> None:
        self.real = real
        self.entered = threading.Event()
        self.release = threading.Event()
        self.calls = 0
        self.active = 0
        self.most_active = 0
        self._lock = threading.Lock()

    def __call__(self, obj, path):
        with self._lock:
            self.calls += 1
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        self.entered.set()
        try:
            if not self.release.wait(timeout=60):
                raise TimeoutError("the test never released the write")
            return self.real(obj, path)
        finally:
            with self._lock:
                self.active -= 1


def _trained(folder: Path, **checkpoint_options):
    run = build_parts()
    run.trainer.run(run.loader, max_epochs=1)
    options = dict(every_epochs=None, at_end=False, keep_last=None, **checkpoint_options)
    return run, Checkpoint(folder, {"model": run.model, "optimizer": run.optimizer}, run.trainer, **options)


def test_an_async_checkpoint_enters_the_manifest_only_once_durable(tmp_path, monkeypatch):
    gate = GatedWrite(checkpoint_module.atomic_save)
    monkeypatch.setattr(checkpoint_module, "atomic_save", gate)
    run, checkpoint = _trained(tmp_path, async_save=True)
    path = checkpoint.save()
    assert gate.entered.wait(timeout=30)
    assert not path.exists()
    assert checkpoint.manifest.entries == [] and checkpoint.saved == []
    assert not (tmp_path / "manifest.json").exists() or in_manifest(tmp_path) == []
    gate.release.set()
    checkpoint.wait()
    assert path.exists() and in_manifest(tmp_path) == [path.name]
    assert [e.file for e in checkpoint.manifest.entries] == [path.name] and checkpoint.saved == [path]
    load_checkpoint(path)


def test_async_and_sync_saves_of_one_state_hold_the_same_content(tmp_path, monkeypatch):
    gate = GatedWrite(checkpoint_module.atomic_save)
    run, sync = _trained(tmp_path / "sync")
    asynchronous = Checkpoint(
        tmp_path / "async",
        {"model": run.model, "optimizer": run.optimizer},
        run.trainer,
        every_epochs=None,
        at_end=False,
        async_save=True,
    )
    sync_path = sync.save()
    monkeypatch.setattr(checkpoint_module, "atomic_save", gate)
    async_path = asynchronous.save()
    assert gate.entered.wait(timeout=30)
    # training goes on while the write is pending: it must not leak into the file
    with torch.no_grad():
        for p in run.model.parameters():
            p.add_(1.0)
    for group in run.optimizer.state.values():
        group["exp_avg"].mul_(2.0)
    gate.release.set()
    asynchronous.wait()
    assert async_path.name == sync_path.name
    assert_same_state(load_checkpoint(sync_path), load_checkpoint(async_path))
    assert asynchronous.stall_seconds and len(asynchronous.stall_seconds) == 1


def test_at_most_one_async_write_is_in_flight(tmp_path, monkeypatch):
    gate = GatedWrite(checkpoint_module.atomic_save)
    monkeypatch.setattr(checkpoint_module, "atomic_save", gate)
    run = build_run(
        str(tmp_path), checkpoint=dict(every_epochs=None, every_iters=1, at_end=False, async_save=True)
    )
    checkpoint = run.checkpoint
    second_waits = threading.Event()
    original_wait = checkpoint.wait

    def spying_wait():
        if checkpoint._writer is not None:
            second_waits.set()
        original_wait()

    checkpoint.wait = spying_wait
    iterations = 3
    failure: list[BaseException] = []

    def train():
        try:
            run.trainer.run(run.loader, max_epochs=1, epoch_length=iterations)
        except BaseException as err:  # noqa: BLE001 - reported below
            failure.append(err)

    trainer_thread = threading.Thread(target=train)
    trainer_thread.start()
    try:
        assert second_waits.wait(timeout=60), "the second save never waited for the first write"
        assert gate.calls == 1 and gate.active == 1, "a second write started while the first was in flight"
        assert run.trainer.state.iteration == 2, "training did not go on while the first write was pending"
    finally:
        gate.release.set()
        trainer_thread.join(timeout=60)
    assert not trainer_thread.is_alive() and not failure, failure
    assert gate.most_active == 1 and gate.calls == iterations
    expected = [checkpoint_name("ckpt", 1, i) for i in range(1, iterations + 1)]
    assert in_manifest(tmp_path) == on_disk(tmp_path) == expected


def test_an_async_write_error_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    def broken(obj, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint_module, "atomic_save", broken)
    run, checkpoint = _trained(tmp_path, async_save=True)
    checkpoint.save()
    with pytest.raises(RuntimeError, match="No space left") as err:
        checkpoint.wait()
    assert str(tmp_path) in str(err.value)
    assert on_disk(tmp_path) == [] and checkpoint.manifest.entries == []
    checkpoint.wait()  # reported once
