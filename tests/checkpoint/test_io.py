"""Checkpoint files: durable atomic writes, completeness checks, safe loading, and a writer
killed in the middle of a save."""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys

import pytest
import torch
from torch import nn

import unison.checkpoint.io as io_module
from unison.checkpoint import (
    CheckpointError,
    Manifest,
    atomic_save,
    atomic_write_json,
    is_complete,
    load_checkpoint,
)
from unison.checkpoint.manifest import checkpoint_name
from unison.engine import Engine
from unison.handlers import Checkpoint


def _state(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    return {
        "weights": torch.randn(64, 32, generator=gen),
        "step": 3,
        "nested": {"ids": torch.arange(10), "name": "x"},
    }


def _assert_same(a: dict, b: dict) -> None:
    assert torch.equal(a["weights"], b["weights"]) and torch.equal(a["nested"]["ids"], b["nested"]["ids"])
    assert (a["step"], a["nested"]["name"]) == (b["step"], b["nested"]["name"])


def _truncated(path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _flipped(path) -> None:
    """Flips bytes inside the tensor payload: the archive's structure is intact, a CRC is not."""
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 32] = bytes(b ^ 0xFF for b in data[middle : middle + 32])
    path.write_bytes(bytes(data))


# --- atomic writes --------------------------------------------------------------------------------


def test_atomic_save_writes_a_file_that_loads_with_weights_only(tmp_path):
    path = atomic_save(_state(), tmp_path / "sub" / "a.pt")
    assert path == tmp_path / "sub" / "a.pt"
    _assert_same(torch.load(path, weights_only=True), _state())
    assert os.listdir(path.parent) == ["a.pt"], "a temp file was left behind"


def test_a_failed_write_leaves_the_previous_file_and_no_temp_file(tmp_path):
    path = atomic_save(_state(0), tmp_path / "a.pt")
    with pytest.raises(Exception):  # noqa: B017 - whatever pickle raises for a lambda
        atomic_save({"weights": torch.zeros(3), "oops": lambda: None}, path)
    _assert_same(torch.load(path, weights_only=True), _state(0))
    assert os.listdir(tmp_path) == ["a.pt"]


def test_the_data_is_fsynced_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    events: list[str] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("rename")
        real_replace(src, dst)

    monkeypatch.setattr(io_module.os, "fsync", fsync)
    monkeypatch.setattr(io_module.os, "replace", replace)
    atomic_save(_state(), tmp_path / "a.pt")
    atomic_write_json({"k": 1}, tmp_path / "m.json")
    assert events == ["fsync file", "rename", "fsync folder"] * 2


def test_a_file_keep_refuses_is_removed_durable_but_unnamed_and_the_old_one_stays(tmp_path, monkeypatch):
    path = atomic_save(_state(0), tmp_path / "a.pt")
    asked: list[list[str]] = []

    def keep() -> bool:
        asked.append(sorted(os.listdir(tmp_path)))  # the temp file is there, whole, before the rename
        return False

    assert atomic_save(_state(1), path, keep=keep) is None
    assert (
        len(asked) == 1 and len(asked[0]) == 2 and asked[0][0].startswith(".a.pt.") and asked[0][1] == "a.pt"
    )
    assert os.listdir(tmp_path) == ["a.pt"]
    _assert_same(torch.load(path, weights_only=True), _state(0))
    assert atomic_save(_state(1), path, keep=lambda: True) == path
    _assert_same(torch.load(path, weights_only=True), _state(1))


def test_atomic_write_json_replaces_the_file_whole(tmp_path):
    path = tmp_path / "m.json"
    atomic_write_json({"b": [1, 2], "a": "x"}, path)
    atomic_write_json({"c": 3}, path)
    assert json.loads(path.read_text()) == {"c": 3}
    assert os.listdir(tmp_path) == ["m.json"]


# --- completeness and loading ---------------------------------------------------------------------


def test_is_complete_tells_whole_archives_from_damaged_ones(tmp_path):
    whole = atomic_save(_state(), tmp_path / "whole.pt")
    assert is_complete(whole)
    for name, damage in (("truncated", _truncated), ("flipped", _flipped)):
        path = atomic_save(_state(), tmp_path / f"{name}.pt")
        damage(path)
        assert not is_complete(path), name
    (tmp_path / "garbage.pt").write_bytes(b"not a zip archive at all")
    (tmp_path / "empty.pt").write_bytes(b"")
    for name in ("garbage.pt", "empty.pt", "missing.pt"):
        assert not is_complete(tmp_path / name), name


def test_load_checkpoint_loads_a_whole_file(tmp_path):
    _assert_same(load_checkpoint(atomic_save(_state(), tmp_path / "a.pt")), _state())


def test_load_checkpoint_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist") as err:
        load_checkpoint(tmp_path / "nope.pt")
    assert str(tmp_path / "nope.pt") in str(err.value) and "resume='auto'" in str(err.value)


@pytest.mark.parametrize("damage", [_truncated, _flipped], ids=["truncated", "flipped-bytes"])
def test_load_checkpoint_of_a_damaged_file_names_it_and_says_what_to_do(tmp_path, damage):
    path = atomic_save(_state(), tmp_path / "a.pt")
    damage(path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    message = str(err.value)
    assert str(path) in message
    assert "truncated or corrupt" in message and "Delete it" in message and "resume='auto'" in message


class _NotAllowed:
    def __init__(self) -> None:
        self.x = 1


def test_load_checkpoint_refuses_objects_beyond_weights_only(tmp_path):
    path = tmp_path / "pickled.pt"
    torch.save({"obj": _NotAllowed()}, path)
    with pytest.raises(CheckpointError, match="weights_only=True") as err:
        load_checkpoint(path)
    assert str(path) in str(err.value) and "other code" in str(err.value)


def test_load_checkpoint_wants_a_dict(tmp_path):
    path = atomic_save(torch.zeros(3), tmp_path / "tensor.pt")
    with pytest.raises(CheckpointError, match="holds a Tensor, not a dict"):
        load_checkpoint(path)


# --- a writer killed during a save ----------------------------------------------------------------


KILLED_WRITER = """\
import os
import sys
import threading

import torch
from torch import nn

import unison.checkpoint.direct as direct
from unison.engine import Engine, Events
from unison.handlers import Checkpoint

folder, big_numel = sys.argv[1], int(sys.argv[2])
armed = False


real_pwrite_all = direct._pwrite_all


def pausing_pwrite_all(fd, view, offset):
    # The big checkpoint's temp file: once its first bytes are on disk, says so and waits to be
    # killed (exits by itself after two minutes, should the test not kill it).
    if not armed:
        return real_pwrite_all(fd, view, offset)
    real_pwrite_all(fd, view, offset)
    os.fsync(fd)
    print("PAUSED", offset + len(view), flush=True)
    threading.Event().wait(120)
    os._exit(3)


direct._pwrite_all = pausing_pwrite_all
direct.DIRECT_FROM = 0  # every file through DirectFile, whose writes the pause above holds


class Blob:
    def __init__(self):
        self.tensor = torch.zeros(1)

    def state_dict(self):
        return {"blob": self.tensor}

    def load_state_dict(self, state):
        self.tensor = state["blob"]


torch.manual_seed(0)
model = nn.Linear(4, 2)
blob = Blob()
engine = Engine(lambda engine, batch: None, sync_every=None)


@engine.on(Events.EPOCH_STARTED(once=2))
def grow(engine):
    global armed
    blob.tensor = torch.ones(big_numel)
    armed = True


checkpoint = Checkpoint(folder, {"model": model, "blob": blob}, engine, every_epochs=1, keep_last=1)
checkpoint.attach()
engine.run(range(1), max_epochs=2)
print("the second save finished", flush=True)
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_writer_killed_mid_save_leaves_the_previous_checkpoint_and_a_consistent_manifest(tmp_path):
    folder = tmp_path / "ckpt"
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    big_numel = 50_000_000  # 200 MB of float32
    proc = subprocess.Popen(
        [sys.executable, str(script), str(folder), str(big_numel)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # blocks until the writer is paused mid-write (or dies)
        assert line.startswith("PAUSED"), f"{line!r}\n{proc.stderr.read() if proc.poll() is not None else ''}"
        partial = list(folder.glob(".ckpt-*.tmp"))
        assert len(partial) == 1 and 0 < partial[0].stat().st_size < big_numel * 4
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()

    first, second = checkpoint_name("ckpt", 1, 1), checkpoint_name("ckpt", 2, 2)
    torch.manual_seed(0)
    expected = nn.Linear(4, 2).state_dict()

    # the previous checkpoint survived rotation (keep_last=1) and loads with weights_only
    state = torch.load(folder / first, weights_only=True)
    assert all(torch.equal(state["objects"]["model"][k], v) for k, v in expected.items())
    assert not (folder / second).exists(), "a partial file took the checkpoint's final name"
    assert sorted(p.name for p in folder.glob("*.pt")) == [first]
    assert [e["file"] for e in json.loads((folder / "manifest.json").read_text())["checkpoints"]] == [first]

    manifest = Manifest(folder).rebuild()
    assert [e.file for e in manifest.entries] == [first]
    assert not list(folder.glob(".ckpt-*.tmp")), "rebuild left the dead writer's temp file"

    model = nn.Linear(4, 2)
    checkpoint = Checkpoint(folder, {"model": model}, Engine(lambda e, b: None, sync_every=None))
    assert checkpoint.resume("auto") == folder / first
    assert all(torch.equal(model.state_dict()[k], v) for k, v in expected.items())
