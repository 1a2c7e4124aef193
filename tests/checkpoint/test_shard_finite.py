"""Each rank of a sharded save checks that the tensors it writes are finite beside its write, and
its answer reaches rank 0 with the write results (``unison.checkpoint.dcp_files``)."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed.checkpoint as dcp
from _sharded_folders import results_only

import unison.checkpoint.dcp_files as dcp_files
from unison.checkpoint.dcp_files import DirectFileSystem, DirectWriter
from unison.checkpoint.sharded import temp_folder, write_shards
from unison.checkpoint.sharded_save import _read_back_not_finite

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def _state(bad: bool) -> dict:
    moment = torch.ones(300)
    if bad:
        moment[7] = float("inf")
    return {
        "model": {"w": torch.randn(2000), "b": torch.zeros(3)},
        "optimizer": {"state": {"w": {"m": moment}}},
    }


def test_the_finite_check_runs_beside_the_write_and_names_the_tensor(tmp_path, monkeypatch):
    writing = threading.Event()  # set once DCP has opened its data file
    seen: list[tuple[str, bool]] = []
    real_stream, real_check = DirectFileSystem.create_stream, dcp_files.first_non_finite

    def stream(self, path, mode):
        writing.set()
        return real_stream(self, path, mode)

    def check(objects):
        seen.append((threading.current_thread().name, writing.wait(timeout=30)))
        return real_check(objects)

    monkeypatch.setattr(DirectFileSystem, "create_stream", stream)
    monkeypatch.setattr(dcp_files, "first_non_finite", check)
    writer = DirectWriter(tmp_path / "bad")
    dcp.save(_state(bad=True), storage_writer=writer, no_dist=True)
    written = writer.gathered()
    assert written.not_finite == "optimizer.state.w.m" and written.checked
    assert [(name.startswith("unison-ckpt-check"), during) for name, during in seen] == [(True, True)]
    good = DirectWriter(tmp_path / "good")
    dcp.save(_state(bad=False), storage_writer=good, no_dist=True)
    assert good.gathered().not_finite is None and len(seen) == 2


@pytest.mark.parametrize("bad", [True, False])
def test_where_no_check_came_rank_0_loads_the_folder_back_to_check_it(tmp_path, monkeypatch, bad):
    monkeypatch.setattr(DirectWriter, "write_data", results_only)
    tmp = temp_folder(tmp_path / "ckpt-e0001-i000000001.dcp")
    state = _state(bad)
    written = write_shards(state, tmp)
    assert (written.checked, written.not_finite) == (False, None)
    assert _read_back_not_finite(tmp, state) == ("optimizer.state.w.m" if bad else None)
