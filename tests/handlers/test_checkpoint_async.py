"""Checkpoint(async_save=True): the trainer waits for a copy into buffers reserved before the
first save, and for nothing else; the copy is checked and written in the writer's thread."""

from __future__ import annotations

import threading

import pytest
import torch
from _ckpt_workers import LogRecords, build_run

import unison.checkpoint.snapshot as snapshot_module
import unison.checkpoint.verify as verify_module
from unison.checkpoint import load_checkpoint
from unison.engine import Events


def _threads_calling(monkeypatch, module, name: str) -> list[str]:
    """The names of the threads that call ``module.name`` from now on."""
    seen: list[str] = []
    real = getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


def test_an_async_save_checks_the_weights_in_the_writers_thread(tmp_path, monkeypatch):
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=None, at_end=False, async_save=True))
    run.trainer.run(run.loader, max_epochs=1)
    checked = _threads_calling(monkeypatch, verify_module, "first_non_finite")
    path = run.checkpoint.save()
    run.checkpoint.wait()
    assert len(checked) == 1 and checked[0].startswith("unison-ckpt"), (
        f"the finite check ran in {checked}, not (only) in the writer's threads"
    )
    assert path.exists() and torch.equal(
        load_checkpoint(path)["objects"]["model"]["0.weight"], run.model.state_dict()["0.weight"]
    )


def test_an_async_copy_holding_a_nan_is_never_written(tmp_path):
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=None, at_end=False, async_save=True))
    run.trainer.run(run.loader, max_epochs=1)
    with torch.no_grad():
        run.model[0].weight[0, 0] = float("nan")
    with LogRecords() as logs:
        run.checkpoint.save()
        run.checkpoint.wait()
    assert list(tmp_path.glob("*.pt")) == [] and run.checkpoint.manifest.entries == []
    warned = [m for m in logs.messages if "Not saving a checkpoint" in m]
    assert len(warned) == 1 and "model.0.weight" in warned[0], logs.messages


def test_the_first_async_save_copies_into_buffers_reserved_before_it(tmp_path, monkeypatch):
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=None, at_end=False, async_save=True))
    allocated = _threads_calling(monkeypatch, snapshot_module, "_buffer")

    @run.trainer.on(Events.ITERATION_COMPLETED(once=3))
    def _save(engine) -> None:
        run.checkpoint.save(engine)

    run.trainer.run(run.loader, max_epochs=1, epoch_length=4)
    run.checkpoint.wait()
    assert len(run.checkpoint.saved) == 1
    assert allocated and set(allocated) == {"unison-ckpt"}, (
        f"buffers allocated in {allocated}: the first save allocated its copy while the trainer waited"
    )


def test_a_reserved_copy_follows_a_change_of_shape(tmp_path):
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=None, at_end=False, async_save=True))
    run.trainer.run(run.loader, max_epochs=1)
    writer = run.checkpoint.writer
    first = run.checkpoint.save()
    run.checkpoint.wait()
    with torch.no_grad():
        run.model[0].bias = torch.nn.Parameter(
            torch.arange(float(run.model[0].bias.numel() + 3))
        )  # another shape than the buffer's
    run.trainer.state.iteration += 1
    second = run.checkpoint.save()
    writer.wait()
    assert first != second
    assert torch.equal(load_checkpoint(second)["objects"]["model"]["0.bias"], run.model[0].bias.detach())


# --- the copy of what only the optimizer's step changes, taken while the next iteration runs ---


def _held_copy(monkeypatch, release: threading.Event) -> list[list[str]]:
    """Holds the writer thread's later copy until ``release`` is set; returns the names it copied."""
    real = snapshot_module.Pending.fill
    copied: list[list[str]] = []

    def held(self):
        assert release.wait(10), "the copy was never released"
        copied.append(list(self.names))
        return real(self)

    monkeypatch.setattr(snapshot_module.Pending, "fill", held)
    return copied


def _states(run) -> dict:
    return {
        "model": {k: v.clone() for k, v in run.model.state_dict().items()},
        "adam": {
            i: {k: v.clone() for k, v in s.items() if isinstance(v, torch.Tensor)}
            for i, s in run.optimizer.state_dict()["state"].items()
        },
    }


def test_the_next_step_waits_for_the_copy_of_its_weights_and_the_file_holds_them_as_saved(
    tmp_path, monkeypatch
):
    """The copy of the weights and Adam's state is taken only once the next iteration's step is
    reached (held until then): without the step's wait, the step would change them first."""
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=None, at_end=False, async_save=True))
    writer = run.checkpoint.writer
    at_step = threading.Event()
    copied = _held_copy(monkeypatch, at_step)
    real_fence = type(writer).fence
    waits: list[float] = []

    def fence(self):
        at_step.set()  # the trainer reached the optimizer's step: only now is the copy taken
        waits.append(real_fence(self))
        return waits[-1]

    monkeypatch.setattr(type(writer), "fence", fence)
    saved: dict = {}

    @run.trainer.on(Events.ITERATION_COMPLETED(once=2))
    def _save(engine) -> None:
        saved["path"] = run.checkpoint.save(engine)
        saved["state"], saved["stall"] = _states(run), run.checkpoint.stall_seconds[-1]

    run.trainer.run(run.loader, max_epochs=1, epoch_length=4)
    run.checkpoint.wait()
    on_disk = load_checkpoint(saved["path"])["objects"]
    for name, value in saved["state"]["model"].items():
        assert torch.equal(on_disk["model"][name], value), name
        assert not torch.equal(run.model.state_dict()[name], value) or "bias" in name  # training moved on
    for i, tensors in saved["state"]["adam"].items():
        for key, value in tensors.items():
            assert torch.equal(on_disk["optimizer"]["state"][i][key], value), (i, key)
    expected = {f"objects.model.{n}" for n in run.model.state_dict()}
    expected |= {f"objects.optimizer.state.{i}.{k}" for i, t in saved["state"]["adam"].items() for k in t}
    assert copied and set(copied[0]) == expected  # the rest (RNG states, positions) was copied at the save
    assert waits[0] > 0 and run.checkpoint.stall_seconds[-1] == saved["stall"] + waits[0]
    assert len(run.optimizer._optimizer_step_pre_hooks) == 1


def test_a_weight_changed_in_place_before_its_copy_is_caught_and_that_checkpoint_is_not_written(
    tmp_path, monkeypatch
):
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=None, at_end=False, async_save=True))
    changed = threading.Event()
    _held_copy(monkeypatch, changed)
    paths: list = []

    @run.trainer.on(Events.ITERATION_COMPLETED(once=2))
    def _save_then_change(engine) -> None:
        paths.append(run.checkpoint.save(engine))
        with torch.no_grad():
            run.model[0].weight.mul_(0.5)  # outside the optimizer's step: breaks the promise
        changed.set()

    with LogRecords() as logs:
        run.trainer.run(run.loader, max_epochs=1, epoch_length=4)
        run.checkpoint.wait()
    assert not paths[0].exists() and run.checkpoint.manifest.entries == []
    warned = [m for m in logs.messages if "Not saving checkpoint" in m]
    assert len(warned) == 1 and "objects.model.0.weight" in warned[0], logs.messages
    assert not [m for m in logs.messages if "after the save began" in m], (
        "the step warned of it a second time"
    )
    assert run.checkpoint.writer.overlap is False
    taken_later = _threads_calling(monkeypatch, snapshot_module.Snapshot, "take_later")
    run.trainer.state.iteration += 1
    path = run.checkpoint.save()  # the next save copies every tensor before it returns
    run.checkpoint.wait()
    assert taken_later == [] and path.exists()
    assert torch.equal(load_checkpoint(path)["objects"]["model"]["0.weight"], run.model[0].weight.detach())


def test_a_change_after_the_copys_own_check_is_reported_by_the_step_and_later_saves_copy_at_once(
    tmp_path, monkeypatch
):
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=None, at_end=False, async_save=True))
    writer = run.checkpoint.writer

    @run.trainer.on(Events.ITERATION_COMPLETED(once=2))
    def _save_then_change(engine) -> None:
        run.checkpoint.save(engine)
        writer._later[1].wait(10)  # the copy is taken and checked unchanged
        with torch.no_grad():
            run.model[0].bias.add_(1.0)

    with LogRecords() as logs:
        run.trainer.run(run.loader, max_epochs=1, epoch_length=4)
        run.checkpoint.wait()
    warned = [m for m in logs.messages if "changed in place after the save began" in m]
    assert len(warned) == 1 and "objects.model.0.bias" in warned[0], logs.messages
    assert writer.overlap is False and len(run.checkpoint.manifest.entries) == 1


def test_a_run_that_ends_right_after_an_async_save_writes_it(tmp_path):
    run = build_run(str(tmp_path), checkpoint=dict(every_epochs=1, at_end=False, async_save=True))
    run.trainer.run(run.loader, max_epochs=1)  # saved at the epoch's end: no step follows it
    assert len(run.checkpoint.manifest.entries) == 1
    path = run.checkpoint.saved[-1]
    assert torch.equal(load_checkpoint(path)["objects"]["model"]["0.weight"], run.model[0].weight.detach())


def _same(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a, key=str) == sorted(b, key=str), where
        for key in a:
            _same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("every", [1, 3])
def test_async_checkpoints_taken_beside_training_equal_sync_ones_at_the_same_iterations(tmp_path, every):
    """The truth is the synchronous save: every async checkpoint, its optimizer tensors copied while
    the next iterations ran, holds bitwise what the sync run saved at the same iteration."""
    for mode in ("sync", "async"):
        run = build_run(
            str(tmp_path / mode),
            checkpoint=dict(every_epochs=None, every_iters=every, at_end=False, async_save=mode == "async"),
        )
        run.trainer.run(run.loader, max_epochs=2)
        run.checkpoint.wait()
    names = sorted(p.name for p in (tmp_path / "sync").glob("*.pt"))
    assert names and names == sorted(p.name for p in (tmp_path / "async").glob("*.pt"))
    for name in names:
        sync, later = (load_checkpoint(tmp_path / mode / name) for mode in ("sync", "async"))
        _same(sync["objects"], later["objects"], f"{name}: objects")
        _same(sync["rng"], later["rng"], f"{name}: rng")
