"""unison.checkpoint.safe_dcp: every load of a sharded folder (resume, export) runs no code from it.

A folder's non-tensor values (an optimizer's ``lr``) are stored as ``torch.save`` bytes that
torch's default planners load with a full unpickler. The truth is a marker file: a value
whose unpickling would create it is refused, and the marker never appears. A torch that
stops calling the safe hooks makes every load fail, naming what changed.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from unison.checkpoint.consolidate import full_objects, model_weights
from unison.checkpoint.io import CheckpointError
from unison.checkpoint.safe_dcp import HookError, UnsafeValueError, check_hooks, safe_load
from unison.checkpoint.sharded import dcp_states, load_dcp_states

MARKER = "pwned"


class Payload:
    """A value whose unpickling creates the marker file: never a part of a checkpoint."""

    def __reduce__(self):
        return (Path.touch, (Path(MARKER),))


def _objects(seed: int = 0) -> dict:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Linear(3, 2)
    return {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)}


def _write(folder: Path, *, lr: object = 0.1) -> Path:
    """A DCP of a model and its optimizer, as a sharded save stores them, with ``lr`` as the stored lr."""
    states = dcp_states(_objects(), ["model", "optimizer"])
    states["optimizer"]["param_groups"][0]["lr"] = lr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists
        dcp.save(states, checkpoint_id=folder, no_dist=True)
    torch.save(
        {"meta": {"epoch": 1, "iteration": 4, "sharded": ["model", "optimizer"]}, "objects": {}},
        folder / "rest.pt",
    )
    return folder


def test_a_plain_folder_loads_through_the_safe_reader(tmp_path):
    folder = _write(tmp_path / "c.dcp", lr=0.25)
    objects = _objects(seed=1)
    load_dcp_states(folder, objects, ["model", "optimizer"])
    assert objects["optimizer"].param_groups[0]["lr"] == 0.25
    assert torch.equal(objects["model"].weight, _objects()["model"].weight)
    assert full_objects(folder, ["optimizer"])["optimizer"]["param_groups"][0]["lr"] == 0.25


def test_each_ranks_load_plan_is_its_own_in_this_torch(tmp_path):
    """``safe_load`` plans and reads on each rank alone, without DCP's gather of the plans to rank 0
    and their scatter back: it relies on DCP's load planner (and the file reader) leaving every
    rank's plan as that rank made it. A torch whose global step changes the plans fails here."""
    from torch.distributed.checkpoint import FileSystemReader

    from unison.checkpoint.safe_dcp import _planner
    from unison.checkpoint.sharded_check import read_metadata

    folder = _write(tmp_path / "c.dcp")
    metadata = read_metadata(folder)
    plans = []
    for names in (["model"], ["model", "optimizer"]):
        planner = _planner(None)
        planner.set_up_planner(dcp_states(_objects(), names), metadata, False)
        plans.append(planner.create_local_plan())
    assert len(plans[0].items) < len(plans[1].items)
    reader = FileSystemReader(folder)
    reader.set_up_storage_reader(metadata, True)
    for step in (_planner(None).create_global_plan, reader.prepare_global_plan):
        assert step(list(plans)) == plans


def test_a_load_after_its_check_takes_the_metadata_the_check_read_once(tmp_path, monkeypatch):
    """The check unpickles ``.metadata`` (32 ms for a 184-tensor model) and the load that follows it
    takes that copy instead of unpickling the file again, once: the next load reads the file, and a
    file changed since the check is read anew."""
    import os

    import unison.checkpoint.sharded_check as sharded_check
    from unison.checkpoint.sharded_check import sharded_verdict

    unpickled = []
    real = sharded_check._MetadataUnpickler.load

    def counted(self):
        unpickled.append(1)
        return real(self)

    monkeypatch.setattr(sharded_check._MetadataUnpickler, "load", counted)
    folder = _write(tmp_path / "c.dcp", lr=0.25)
    assert sharded_verdict(folder, require_checksums=False) is None
    assert len(unpickled) == 1
    objects = _objects(seed=1)
    load_dcp_states(folder, objects, ["model", "optimizer"])
    assert len(unpickled) == 1  # the check's copy
    assert objects["optimizer"].param_groups[0]["lr"] == 0.25
    load_dcp_states(folder, _objects(seed=1), ["model", "optimizer"])
    assert len(unpickled) == 2  # taken once
    assert sharded_verdict(folder, require_checksums=False) is None
    stat = (folder / ".metadata").stat()
    os.utime(folder / ".metadata", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))  # another file now
    load_dcp_states(folder, _objects(seed=1), ["model", "optimizer"])
    assert len(unpickled) == 4


def test_a_link_in_the_place_of_the_metadata_is_refused(tmp_path):
    folder = _write(tmp_path / "c.dcp")
    (folder / ".metadata").rename(tmp_path / "elsewhere")
    (folder / ".metadata").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError):
        load_dcp_states(folder, _objects(seed=1), ["model", "optimizer"])


def test_resume_refuses_a_stored_value_that_would_run_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = _write(tmp_path / "c.dcp", lr=Payload())
    assert not (tmp_path / MARKER).exists()
    with pytest.raises(
        UnsafeValueError, match=rf"{folder}: its value optimizer\.param_groups\.0\.lr holds Python"
    ):
        load_dcp_states(folder, _objects(), ["model", "optimizer"])
    assert not (tmp_path / MARKER).exists()


def test_export_refuses_the_same_value(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = _write(tmp_path / "c.dcp", lr=Payload())
    assert sorted(model_weights(folder)) == ["bias", "weight"]  # the model alone holds no such value
    with pytest.raises(UnsafeValueError, match=r"optimizer\.param_groups\.0\.lr .*refused"):
        full_objects(folder, ["optimizer"])
    assert not (tmp_path / MARKER).exists()


def test_the_metadata_is_read_by_the_safe_unpickler_at_load(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = _write(tmp_path / "c.dcp")
    import pickle

    (folder / ".metadata").write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError, match=r"pathlib(\._local)?\.Path\.touch, which is no part of"):
        safe_load(dcp_states(_objects(), ["model"]), folder, no_dist=True)
    assert not (tmp_path / MARKER).exists()


def test_the_hooks_of_this_torch_are_in_place():
    check_hooks()


@pytest.mark.parametrize(
    "change", ["planner hook dropped", "reader bypasses the hook", "abstract hook renamed"]
)
def test_a_torch_that_drops_a_hook_fails_loudly_before_reading(tmp_path, monkeypatch, change):
    from torch.distributed.checkpoint import FileSystemReader, planner
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    monkeypatch.chdir(tmp_path)
    folder = _write(tmp_path / "c.dcp", lr=Payload())
    if change == "planner hook dropped":
        monkeypatch.delattr(DefaultLoadPlanner, "load_bytes")
        expected = "DefaultLoadPlanner no longer defines load_bytes"
    elif change == "reader bypasses the hook":
        monkeypatch.setattr(FileSystemReader, "read_data", lambda self, plan, planner: torch.load(plan))
        expected = r"FileSystemReader\.read_data no longer calls planner\.load_bytes"
    else:
        monkeypatch.delattr(planner.LoadPlanner, "load_bytes")
        expected = r"LoadPlanner\.load_bytes is no longer an abstract method"
    with pytest.raises(
        HookError, match=rf"torch .* changed how Distributed Checkpoint reads a folder \(.*{expected}"
    ):
        load_dcp_states(folder, _objects(), ["model", "optimizer"])
    with pytest.raises(HookError, match=expected):
        full_objects(folder, ["optimizer"])
    assert not (tmp_path / MARKER).exists()


def test_a_value_that_comes_in_past_the_safe_hook_fails_the_load(tmp_path, monkeypatch):
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    from unison.checkpoint import safe_dcp

    folder = _write(tmp_path / "c.dcp")
    monkeypatch.setattr(safe_dcp._SafeBytes, "load_bytes", DefaultLoadPlanner.load_bytes)  # a path around it
    with pytest.raises(
        HookError, match=r"loaded optimizer\.param_groups\.0\.\w+, .* and \d+ more without the safe"
    ):
        load_dcp_states(folder, _objects(), ["model", "optimizer"])
