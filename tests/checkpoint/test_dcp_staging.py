"""An asynchronous sharded save stages its CPU copy into buffers kept from save to save
(``unison.checkpoint.dcp_staging``)."""

from __future__ import annotations

import copy

import pytest
import torch

import unison.checkpoint.dcp_staging as dcp_staging
from unison.checkpoint.dcp_staging import KeptStaging, check_staging
from unison.checkpoint.keypaths import tensors_with_paths


def _state(width: int = 4) -> dict:
    return {
        "model": {"w": torch.randn(width, 3), "b": torch.zeros(3)},
        "optimizer": {"state": {"w": {"step": torch.tensor(2.0), "m": torch.ones(width, 3)}}, "lr": 0.1},
    }


def _pointers(state: dict) -> dict[str, int]:
    return {name: t.data_ptr() for name, t in tensors_with_paths(state)}


def _assert_equal(staged: dict, source: dict) -> None:
    pairs = list(zip(tensors_with_paths(staged), tensors_with_paths(source), strict=True))
    assert all(a == b and torch.equal(x, y) for (a, x), (b, y) in pairs)


def test_a_later_save_copies_into_the_first_ones_buffers():
    stager, source = KeptStaging(), _state()
    first = stager.stage(source)
    held = copy.deepcopy(first)
    kept = _pointers(first)
    assert all(kept[n] != t.data_ptr() for n, t in tensors_with_paths(source))  # a copy, not the source
    with torch.no_grad():
        for _, tensor in tensors_with_paths(source):
            tensor.add_(1)
    _assert_equal(first, held)  # training changing the source leaves the copy as it was
    second = stager.stage(source)
    assert _pointers(second) == kept
    _assert_equal(second, source)
    assert second["optimizer"]["lr"] == 0.1


@pytest.mark.parametrize(
    "change",
    [
        lambda s: s["model"].update(w=torch.randn(5, 3)),  # a shape
        lambda s: s["model"].update(b=torch.zeros(3, dtype=torch.float64)),  # a dtype
        lambda s: s["optimizer"]["state"].update(b={"m": torch.ones(3)}),  # a new key
    ],
    ids=["shape", "dtype", "key"],
)
def test_a_state_laid_out_otherwise_is_staged_into_new_buffers(change):
    stager, source = KeptStaging(), _state()
    first = _pointers(stager.stage(source))
    change(source)
    second = stager.stage(source)
    _assert_equal(second, source)
    assert set(_pointers(second).values()).isdisjoint(first.values())


def test_where_the_buffer_making_helper_changed_saves_stage_through_dcp_itself(monkeypatch):
    import torch.distributed._state_dict_utils as utils

    from unison.checkpoint.sharded_save import staging

    monkeypatch.setattr(utils, "_create_cpu_state_dict", lambda source, **_: source)  # no buffers of its own
    assert "did not copy the state's values into its own buffers" in check_staging()
    dcp_staging.staging_problem.cache_clear()
    try:
        assert staging(type("Writer", (), {})()) is None  # dcp.async_save's own staging, a copy a save
    finally:
        dcp_staging.staging_problem.cache_clear()


def test_a_reserved_staging_copies_into_the_buffers_reserved_before_it():
    stager, source = KeptStaging(), _state()
    stager.reserve(source)
    stager._reserving.join()
    reserved = _pointers(stager.buffers)
    assert all(torch.count_nonzero(t) == 0 for _, t in tensors_with_paths(stager.buffers))  # pages written
    staged = stager.stage(source)
    assert _pointers(staged) == reserved
    _assert_equal(staged, source)


def test_a_staging_reserved_for_another_layout_makes_new_buffers():
    stager = KeptStaging()
    stager.reserve(_state(width=4))
    reserved = set(_pointers(stager.stage(_state(width=4))).values())
    other = _state(width=5)
    staged = stager.stage(other)
    _assert_equal(staged, other)
    assert set(_pointers(staged).values()).isdisjoint(reserved)


def test_where_the_buffers_cannot_be_kept_a_save_copies_through_dcps_own_staging():
    from unison.checkpoint.sharded_save import dcp_copy

    source = _state()
    copied = dcp_copy(source)
    _assert_equal(copied, source)
    assert set(_pointers(copied).values()).isdisjoint(_pointers(source).values())


def test_a_staging_leaves_what_later_names_to_its_deferred_copy():
    stager, source = KeptStaging(), _state()
    stager.stage(source)  # makes the buffers: every tensor copied at once
    assert stager.deferred() is None
    weight = source["model"]["w"]
    with torch.no_grad():
        weight.add_(1)
    staged = stager.stage(source, later=lambda t: t.data_ptr() == weight.data_ptr())
    pending = stager.deferred()
    assert pending is not None and pending.names == ["model.w"]
    assert not torch.equal(staged["model"]["w"], weight)  # not yet copied
    _assert_equal(staged["optimizer"], source["optimizer"])
    assert pending.fill() == [] and torch.equal(staged["model"]["w"], weight)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("failing", ["stage", "to_cpu_copy"])
def test_a_copy_that_fails_in_the_caller_leaves_no_writer_thread_waiting(tmp_path, monkeypatch, failing):
    """The save's writer thread starts before the copy and waits for its hand-off: a copy (of the
    shards, or of the rest) that raises hands it nothing, the error reaches the caller, and the
    writer's wait returns."""
    import threading

    import unison.checkpoint.sharded_save as sharded_save
    from unison.checkpoint.manifest import Manifest
    from unison.checkpoint.writer import CheckpointWriter

    def broken(*args, **kwargs):
        raise RuntimeError(f"{failing} failed")

    target = KeptStaging if failing == "stage" else sharded_save
    monkeypatch.setattr(target, failing, broken)
    monkeypatch.setattr(dcp_staging, "staging_problem", lambda: None)  # its probe would stage too
    writer = CheckpointWriter(Manifest(tmp_path), keep_last=None, async_save=True)
    with pytest.raises(RuntimeError, match=f"{failing} failed"):
        sharded_save.save_sharded(writer, "ckpt-x.dcp", {"meta": {}}, _state(), None, async_group=object())
    waiting = threading.Thread(target=writer.wait, daemon=True)
    waiting.start()
    waiting.join(20)
    assert not waiting.is_alive(), "the writer's thread still waits for its hand-off"
    assert not (tmp_path / "ckpt-x.dcp").exists()
