"""Checkpoint(async_save=True): the trainer waits for a copy into buffers reserved before the
first save, and for nothing else; the copy is checked and written in the writer's thread."""

from __future__ import annotations

import threading

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
    assert checked == ["unison-ckpt"], f"the finite check ran in {checked}, not (only) in the writer's thread"
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
