"""Checkpoint: its arguments, when it saves, what a file holds, rotation across restarts, asynchronous
writes, and a complete round trip from the live objects to a file and back into fresh ones."""

from __future__ import annotations

import copy
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
from ignite.engine import Engine as IgniteEngine
from torch import nn

import unison
import unison.checkpoint.loading as loading_module
import unison.checkpoint.writer as writer_module
import unison.handlers.checkpoint as checkpoint_module
from unison.checkpoint import Manifest, capture_rng, load_checkpoint
from unison.checkpoint.manifest import checkpoint_name
from unison.checkpoint.state import load_object_states
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
    assert sorted(state) == ["config", "data", "meta", "objects", "rng", "sampler", "trainer"]
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
        assert_same_state(state["rng"][rank], result["rng"], f"rank {rank}'s generators")
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
    assert_same_state(objects["optimizer"], r0["optimizer"], "optimizer")
    assert {k: state["trainer"][k] for k in r0["trainer"]} == r0["trainer"]
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


# --- arguments ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(every_epochs=0), ValueError, r"Checkpoint\(every_epochs=0\) must be a positive int or None"),
        (
            dict(every_iters=True),
            ValueError,
            r"Checkpoint\(every_iters=True\) must be a positive int or None",
        ),
        (dict(keep_last=0), ValueError, r"Checkpoint\(keep_last=0\) must be a positive int or None"),
        (dict(keep_best=-1), ValueError, r"Checkpoint\(keep_best=-1\) must be an int >= 0"),
        (dict(keep_best=1), ValueError, r"Checkpoint\(keep_best=1\) needs metric=<name of a score>"),
        (dict(mode="best"), ValueError, r"Checkpoint\(mode='best'\) must be 'max' or 'min'"),
        (dict(to_save={}), ValueError, r"Checkpoint\(to_save=...\) needs a non-empty mapping"),
        (dict(to_save={"meta": nn.Linear(1, 1)}), ValueError, r"'meta' is reserved; use another name"),
        (
            dict(to_save={"n": 3}),
            TypeError,
            r"Checkpoint\(to_save=\{'n': ...\}\): a int has no state_dict\(\)",
        ),
        (
            dict(trainer="ignite"),
            TypeError,
            r"Checkpoint\(trainer=...\) needs a unison Engine .* Got Engine\.",
        ),
    ],
)
def test_bad_arguments_are_refused_naming_the_argument(tmp_path, options, error, message):
    engine = Engine(lambda e, b: None, sync_every=None)
    if options.pop("trainer", None) == "ignite":
        engine = IgniteEngine(lambda e, b: None)
    to_save = options.pop("to_save", {"model": nn.Linear(2, 1)})
    with pytest.raises(error, match=message):
        Checkpoint(tmp_path, to_save, engine, **options)
    assert not any(tmp_path.iterdir()), "a refused Checkpoint touched the folder"


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

    def _record(e: Engine) -> None:
        checkpoint.wait()  # rotation deletes in a thread of its own; wait() waits for it
        after_each.append((e.state.epoch, checkpoint.saved[-1].name, on_disk(folder), in_manifest(folder)))

    engine.after_epoch(_record)  # the epoch's save runs after every handler: record after it

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


def test_a_synchronous_save_returns_before_rotation_has_deleted_and_the_next_save_waits_for_it(
    tmp_path, monkeypatch
):
    release, deleting = threading.Event(), threading.Event()
    threads: list[str] = []
    real_remove = writer_module.remove

    def slow_remove(path):
        threads.append(threading.current_thread().name)
        deleting.set()
        assert release.wait(30), "the test never released the deletion"
        real_remove(path)

    monkeypatch.setattr(writer_module, "remove", slow_remove)
    engine, checkpoint, _ = _scored_engine(tmp_path, keep_last=1)
    engine.state.epoch, engine.state.iteration = 1, 1
    checkpoint.save(engine)
    engine.state.epoch, engine.state.iteration = 2, 2
    checkpoint.save(engine)  # returns while the first file's deletion is held
    assert deleting.wait(30) and threads == ["unison-ckpt-rotate"]
    first, second = checkpoint_name("ckpt", 1, 1), checkpoint_name("ckpt", 2, 2)
    assert in_manifest(tmp_path) == [second] and on_disk(tmp_path) == sorted([first, second])

    saved = threading.Event()

    def third() -> None:
        engine.state.epoch, engine.state.iteration = 3, 3
        checkpoint.save(engine)
        saved.set()

    saving = threading.Thread(target=third)
    saving.start()
    assert not saved.wait(0.2), "the next save began before the last rotation's deletion ended"
    release.set()
    saving.join(30)
    checkpoint.wait()
    assert saved.is_set() and on_disk(tmp_path) == in_manifest(tmp_path) == [checkpoint_name("ckpt", 3, 3)]


def test_rotation_deletes_nothing_when_the_new_file_fails_to_write(tmp_path, monkeypatch):
    engine, checkpoint, after_each = _scored_engine(tmp_path, keep_last=1)
    engine.run(range(1), max_epochs=2)
    before_disk, before_manifest = on_disk(tmp_path), in_manifest(tmp_path)
    assert before_disk == [checkpoint_name("ckpt", 2, 2)]

    def full_disk(obj, path, **options):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module, "atomic_save", full_disk)
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

    def __call__(self, obj, path, **options):
        with self._lock:
            self.calls += 1
            self.active += 1
            self.most_active = max(self.most_active, self.active)
        self.entered.set()
        try:
            if not self.release.wait(timeout=60):
                raise TimeoutError("the test never released the write")
            return self.real(obj, path, **options)
        finally:
            with self._lock:
                self.active -= 1


def _trained(folder: Path, **checkpoint_options):
    run = build_parts()
    run.trainer.run(run.loader, max_epochs=1)
    options = dict(every_epochs=None, at_end=False, keep_last=None, **checkpoint_options)
    return run, Checkpoint(folder, {"model": run.model, "optimizer": run.optimizer}, run.trainer, **options)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_small_checkpoint_goes_through_the_page_cache_unless_written_in_the_background(
    tmp_path, monkeypatch, async_save
):
    import unison.checkpoint.direct as direct_module
    import unison.checkpoint.io as io_module

    sinks: list[str] = []
    real_open_sink = io_module.open_sink

    def open_sink(raw, path, size=0, direct=None):
        sink = real_open_sink(raw, path, size, direct)
        if ".pt." in Path(path).name:  # the checkpoint's temp file (not the manifest's)
            sinks.append(type(sink).__name__)
        return sink

    monkeypatch.setattr(io_module, "open_sink", open_sink)
    run, checkpoint = _trained(tmp_path, async_save=async_save)
    checkpoint.save()
    checkpoint.wait()
    direct = direct_module.direct_available()
    assert sinks == (["DirectFile"] if async_save and direct else ["WritebackFile"])
    assert load_checkpoint(checkpoint.saved[-1])["meta"]["iteration"] == run.trainer.state.iteration


def test_an_async_checkpoint_enters_the_manifest_only_once_durable(tmp_path, monkeypatch):
    gate = GatedWrite(writer_module.atomic_save)
    monkeypatch.setattr(writer_module, "atomic_save", gate)
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
    gate = GatedWrite(writer_module.atomic_save)
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
    monkeypatch.setattr(writer_module, "atomic_save", gate)
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
    gate = GatedWrite(writer_module.atomic_save)
    monkeypatch.setattr(writer_module, "atomic_save", gate)
    run = build_run(
        str(tmp_path), checkpoint=dict(every_epochs=None, every_iters=1, at_end=False, async_save=True)
    )
    checkpoint = run.checkpoint
    second_waits = threading.Event()
    original_wait = checkpoint.writer.wait

    def spying_wait():
        if checkpoint.writer.in_flight:
            second_waits.set()
        original_wait()

    checkpoint.writer.wait = spying_wait
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
        # The first write checks its copy in the writer's thread before it writes: under load the
        # second save can come to wait before that write reaches the file; it is held there.
        assert gate.entered.wait(timeout=60), "the first write never started"
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
    def broken(obj, path, **options):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_module, "atomic_save", broken)
    run, checkpoint = _trained(tmp_path, async_save=True)
    checkpoint.save()
    with pytest.raises(RuntimeError, match="No space left") as err:
        checkpoint.wait()
    assert str(tmp_path) in str(err.value)
    assert on_disk(tmp_path) == [] and checkpoint.manifest.entries == []
    checkpoint.wait()  # reported once


# --- a complete round trip: the file holds the live state, and a resume puts it back -------------


SAVE_AT = 7
"""The iteration of the save: inside epoch 2 at one rank (5 batches an epoch), 2 batches in."""
ROUND_TRIP_EPOCHS = 2


def _scheduled_run(rng_seed: int | None = None):
    """Model with dropout, Adam, a StepLR stepped every iteration, TrainSampler data."""
    run = build_parts(rng_seed=rng_seed)
    scheduler = torch.optim.lr_scheduler.StepLR(run.optimizer, step_size=1, gamma=0.8)
    run.trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda _: scheduler.step())
    return run, scheduler


def _round_trip_checkpoint(folder: Path, run, scheduler, **options) -> Checkpoint:
    to_save = {"model": run.model, "optimizer": run.optimizer, "scheduler": scheduler}
    options = dict(every_epochs=None, at_end=False, keep_last=None, **options)
    checkpoint = Checkpoint(folder, to_save, run.trainer, **options)
    checkpoint.attach()
    return checkpoint


def _live_state(run, scheduler) -> dict:
    """What the live objects hold now, copied: the truth a checkpoint taken now must equal."""
    state = run.trainer.state
    return {
        "model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
        "optimizer": copy.deepcopy(run.optimizer.state_dict()),
        "scheduler": copy.deepcopy(scheduler.state_dict()),
        "last_lr": list(scheduler.get_last_lr()),
        "trainer": {
            "epoch": state.epoch,
            "iteration": state.iteration,
            "epoch_length": state.epoch_length,
            "max_epochs": state.max_epochs,
        },
        # the samples this epoch actually trained on, as the dataset counted them
        "sampler": {"epoch": run.loader.sampler.epoch, "consumed": len(run.dataset.loaded)},
        "rng": capture_rng(),
    }


def _save_mid_epoch(folder: Path, *, fault=None, async_save: bool = False) -> dict:
    """Trains with a save after iteration SAVE_AT; the file, and the live state before and after that
    iteration's step. ``fault(payload, before)`` may spoil the payload, to show the comparison fails."""
    run, scheduler = _scheduled_run()
    before: dict = {}
    live: dict = {}
    # attached before the Checkpoint: they run just before its handlers
    run.trainer.add_event_handler(
        Events.ITERATION_STARTED(once=SAVE_AT), lambda _: before.update(_live_state(run, scheduler))
    )
    run.trainer.add_event_handler(
        Events.ITERATION_COMPLETED(once=SAVE_AT), lambda _: live.update(_live_state(run, scheduler))
    )
    checkpoint = _round_trip_checkpoint(folder, run, scheduler, every_iters=SAVE_AT, async_save=async_save)
    if fault is not None:
        collect = checkpoint._collect  # what save() gathers the payload with

        def faulty_collect(engine, *args):
            payload = collect(engine, *args)
            fault(payload, before)
            return payload

        checkpoint._collect = faulty_collect
    run.trainer.run(run.loader, max_epochs=ROUND_TRIP_EPOCHS)
    assert [p.name for p in checkpoint.saved] == [checkpoint_name("ckpt", 2, SAVE_AT)]
    saved = torch.load(checkpoint.saved[0], map_location="cpu", weights_only=True)
    return {"path": checkpoint.saved[0], "saved": saved, "live": live, "before": before, "run": run}


def _assert_saved_as_live(saved: dict, live: dict) -> None:
    objects = saved["objects"]
    assert sorted(objects) == ["model", "optimizer", "scheduler"], f"the file holds {sorted(objects)}"
    assert_same_state(objects["model"], live["model"], "model")
    assert_same_state(objects["optimizer"], live["optimizer"], "optimizer")  # every tensor, torch.equal
    assert_same_state(objects["scheduler"], live["scheduler"], "scheduler")
    assert objects["scheduler"]["last_epoch"] == live["scheduler"]["last_epoch"] == SAVE_AT
    assert objects["scheduler"]["_last_lr"] == live["last_lr"]
    trainer = live["trainer"]
    assert (saved["meta"]["epoch"], saved["meta"]["iteration"]) == (trainer["epoch"], trainer["iteration"])
    for key in ("iteration", "epoch_length", "max_epochs"):
        assert saved["trainer"][key] == trainer[key], (
            f"trainer.{key}: {saved['trainer'][key]} != {trainer[key]}"
        )
    assert saved["meta"]["mid_epoch"] is True
    for key in ("epoch", "consumed"):
        assert saved["sampler"][key] == live["sampler"][key], f"sampler.{key}"
    assert len(saved["rng"]) == 1
    assert_same_state(saved["rng"][0], live["rng"], "rng")


def _assert_the_step_changed_everything(before: dict, live: dict) -> None:
    """The iteration of the save changes every part: a part saved before its step would differ."""
    assert any(not torch.equal(before["model"][k], v) for k, v in live["model"].items())
    for key, value in live["optimizer"]["state"][0].items():
        assert not torch.equal(before["optimizer"]["state"][0][key], value), f"optimizer {key}"
    assert before["scheduler"]["last_epoch"] != live["scheduler"]["last_epoch"]
    assert before["last_lr"] != live["last_lr"], "the learning rate did not change at the save"
    assert not torch.equal(before["rng"]["torch"], live["rng"]["torch"]), "no dropout draw in the step"
    assert live["sampler"] == {"epoch": 1, "consumed": 2 * BATCH}


def _resume_fresh(folder: Path, path: Path, *, faults: dict | None = None, monkeypatch=None) -> dict:
    """A new job, seeded otherwise, resumes from ``path`` into fresh objects and trains on."""
    run, scheduler = _scheduled_run(rng_seed=4242)
    checkpoint = _round_trip_checkpoint(folder, run, scheduler)
    first_batch: dict = {}

    @run.trainer.on(Events.GET_BATCH_STARTED)  # after the Checkpoint's own: sees what it put back
    def _first_batch(engine: Engine) -> None:
        if not first_batch:
            state = engine.state
            first_batch.update(
                rng=capture_rng(),
                trainer={
                    "epoch": state.epoch,
                    "iteration": state.iteration,
                    "epoch_length": state.epoch_length,
                    "max_epochs": state.max_epochs,
                },
                sampler={"epoch": run.loader.sampler.epoch, "consumed": run.loader.sampler.start},
            )

    fresh = _live_state(run, scheduler)
    for name, replacement in (faults or {}).items():
        owner = loading_module if name == "load_object_states" else checkpoint_module
        monkeypatch.setattr(owner, name, replacement)
    assert checkpoint.resume(path) == path
    loaded = _live_state(run, scheduler)
    run.trainer.run(run.loader, max_epochs=ROUND_TRIP_EPOCHS)
    return {"fresh": fresh, "loaded": loaded, "first_batch": first_batch, "run": run}


def _assert_resumed_as_saved(resumed: dict, saved: dict, trained) -> None:
    objects = saved["objects"]
    fresh, loaded, first = resumed["fresh"], resumed["loaded"], resumed["first_batch"]
    assert any(not torch.equal(fresh["model"][k], v) for k, v in objects["model"].items()), (
        "blind: same model"
    )
    assert fresh["optimizer"]["state"] == {} and fresh["scheduler"]["last_epoch"] == 0
    assert_same_state(loaded["model"], objects["model"], "resumed model")
    assert_same_state(loaded["optimizer"], objects["optimizer"], "resumed optimizer")
    assert_same_state(loaded["scheduler"], objects["scheduler"], "resumed scheduler")
    assert loaded["last_lr"] == objects["scheduler"]["_last_lr"]
    # as the resumed run draws its first batch: the loop's counters, the sampler, the generators
    counters = {
        "epoch": saved["meta"]["epoch"],
        **{k: saved["trainer"][k] for k in first["trainer"] if k != "epoch"},
    }
    assert first["trainer"] == counters, f"resumed trainer at {first['trainer']}, saved {counters}"
    saved_position = {"epoch": saved["sampler"]["epoch"], "consumed": saved["sampler"]["consumed"]}
    assert first["sampler"] == saved_position, (
        f"resumed sampler at {first['sampler']}, saved {saved_position}"
    )
    assert_same_state(first["rng"], saved["rng"][0], "resumed rng")
    consumed = saved["sampler"]["consumed"]
    assert resumed["run"].per_epoch_loaded[2] == trained.per_epoch_loaded[2][consumed:], (
        "the resumed epoch did not load exactly the samples the first run had left"
    )


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_checkpoint_holds_the_live_state_and_a_resume_puts_it_back_bitwise(tmp_path, async_save):
    first = _save_mid_epoch(tmp_path / "run", async_save=async_save)
    _assert_the_step_changed_everything(first["before"], first["live"])
    _assert_saved_as_live(first["saved"], first["live"])
    resumed = _resume_fresh(tmp_path / "run", first["path"])
    _assert_resumed_as_saved(resumed, first["saved"], first["run"])


def _replace(key: str, part: str):
    def spoil(payload: dict, before: dict) -> None:
        payload[part][key] = before[key]

    return spoil


SAVE_FAULTS = {
    # name: (how the payload is spoilt, what the comparison names)
    "no-scheduler": (lambda payload, before: payload["objects"].pop("scheduler"), "the file holds"),
    "optimizer-before-the-step": (_replace("optimizer", "objects"), "optimizer"),
    "model-before-the-step": (_replace("model", "objects"), "model"),
    "scheduler-before-the-step": (_replace("scheduler", "objects"), "scheduler"),
    "rng-before-the-step": (lambda payload, before: payload["rng"].__setitem__(0, before["rng"]), "rng"),
    "sampler-at-the-epoch-start": (
        lambda payload, before: payload["sampler"].__setitem__("consumed", 0),
        "sampler.consumed",
    ),
    "sampler-a-batch-behind": (
        lambda payload, before: payload["sampler"].__setitem__("consumed", BATCH),
        "sampler.consumed",
    ),
    "iteration-a-step-behind": (
        lambda payload, before: payload["trainer"].__setitem__("iteration", SAVE_AT - 1),
        "trainer.iteration",
    ),
    "max-epochs-lost": (
        lambda payload, before: payload["trainer"].__setitem__("max_epochs", None),
        "trainer.max_epochs",
    ),
}


@pytest.mark.parametrize("fault", list(SAVE_FAULTS))
def test_the_round_trip_comparison_catches_a_faulty_payload(tmp_path, fault):
    spoil, named = SAVE_FAULTS[fault]
    first = _save_mid_epoch(tmp_path, fault=spoil)
    with pytest.raises(AssertionError, match=named):
        _assert_saved_as_live(first["saved"], first["live"])


def _skip_scheduler(to_save, states) -> None:
    load_object_states({k: v for k, v in to_save.items() if k != "scheduler"}, states)


RESUME_FAULTS = {
    # name: (what the handler's module (or, for loading, unison.checkpoint.loading) gets instead,
    # what the comparison names)
    "generators-not-restored": ({"restore_rng": lambda state: None}, "resumed rng"),
    "scheduler-not-loaded": ({"load_object_states": _skip_scheduler}, "resumed scheduler"),
    "sampler-not-loaded": ({"load_sampler": lambda data, saved: None}, "resumed sampler"),
}


@pytest.mark.parametrize("fault", list(RESUME_FAULTS))
def test_the_round_trip_comparison_catches_a_faulty_resume(tmp_path, monkeypatch, fault):
    replacements, named = RESUME_FAULTS[fault]
    first = _save_mid_epoch(tmp_path)
    resumed = _resume_fresh(tmp_path, first["path"], faults=replacements, monkeypatch=monkeypatch)
    with pytest.raises(AssertionError, match=named):
        _assert_resumed_as_saved(resumed, first["saved"], first["run"])


def test_a_checkpoint_attached_before_the_evaluation_records_this_epochs_score(tmp_path):
    """The epoch's save runs after every EPOCH_COMPLETED handler, whatever the attach order."""
    engine = Engine(lambda e, b: None, sync_every=None)
    checkpoint = Checkpoint(
        tmp_path, {"model": nn.Linear(2, 1)}, engine, metric="score", mode="max", keep_last=1, keep_best=1
    )
    checkpoint.attach()  # before the handler that computes the score

    @engine.on(Events.EPOCH_COMPLETED)
    def _score(e: Engine) -> None:
        e.state.metrics["score"] = SCORES[e.state.epoch - 1]

    engine.run(range(1), max_epochs=len(SCORES))
    recorded = {entry.epoch: entry.score for entry in checkpoint.manifest.entries}
    assert all(recorded[epoch] == SCORES[epoch - 1] for epoch in recorded)
    best = max(range(len(SCORES)), key=lambda i: SCORES[i]) + 1
    assert checkpoint.best is not None and checkpoint.best.epoch == best


class _Counter:
    """A per-iteration stateful handler."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, engine: Engine) -> None:
        self.count += 1

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        self.count = state["count"]


def test_a_stateful_handler_attached_after_the_checkpoint_is_saved_after_it_ran(tmp_path):
    """A mid-epoch save is taken after every handler of the iteration, whatever the attach order."""
    engine = Engine(lambda e, b: None, sync_every=None)
    counter = _Counter()
    checkpoint = Checkpoint(
        tmp_path, {"counter": counter}, engine, every_epochs=None, every_iters=3, at_end=False, keep_last=None
    )
    checkpoint.attach()
    engine.add_event_handler(Events.ITERATION_COMPLETED, counter)  # attached after the Checkpoint
    sampler = unison.distributed.TrainSampler(range(10), shuffle=False, rank=0, world_size=1)
    engine.run(torch.utils.data.DataLoader(range(10), sampler=sampler))  # data whose position a save can tell
    for path in checkpoint.saved:
        saved = torch.load(path, weights_only=True)
        assert saved["objects"]["counter"]["count"] == saved["meta"]["iteration"], path.name


def test_stateful_handlers_attached_to_the_trainer_are_saved_and_restored_unasked(tmp_path):
    from unison.handlers import EarlyStopping

    def build() -> tuple[Engine, Checkpoint, EarlyStopping, _Counter]:
        engine = Engine(lambda e, b: None, sync_every=None)
        stopper = EarlyStopping(
            engine, lambda e: 1.0, patience=10, mode="max"
        )  # never improves after the first
        stopper.attach(engine)
        counter = _Counter()
        engine.add_event_handler(Events.ITERATION_COMPLETED, counter)
        checkpoint = Checkpoint(tmp_path, {"model": nn.Linear(2, 1)}, engine, keep_last=None)
        checkpoint.attach()
        return engine, checkpoint, stopper, counter

    engine, checkpoint, stopper, counter = build()
    engine.run(range(3), max_epochs=3)
    saved = torch.load(checkpoint.saved[-1], weights_only=True)["objects"]
    assert {"handler:EarlyStopping", "handler:_Counter"} <= set(saved)
    _, again, restored_stopper, restored_counter = build()
    again.resume("auto")
    assert restored_counter.count == counter.count == 9
    assert restored_stopper.checker.state_dict() == stopper.checker.state_dict()
