"""Snapshot: a deep CPU copy into buffers kept from copy to copy, filled by several threads."""

from __future__ import annotations

import torch

import unison.checkpoint.snapshot as snapshot_module
from unison.checkpoint.snapshot import Snapshot


def _state() -> dict:
    big = torch.randn(3 * snapshot_module.SLICE // 4 + 5)  # sliced: 3 slices and a tail
    return {
        "model": {"big": big, "w": torch.randn(4, 3), "t": torch.randn(6, 5).t()},  # t: not contiguous
        "list": [torch.arange(3), 7],
        "tuple": (torch.zeros(2, dtype=torch.bfloat16), "s"),
        "none": None,
    }


def test_a_copy_is_deep_exact_and_keeps_the_structure():
    state = _state()
    copy = Snapshot(threads=3).take(state)
    assert torch.equal(copy["model"]["big"], state["model"]["big"])
    assert torch.equal(copy["model"]["t"], state["model"]["t"]) and copy["model"]["t"].is_contiguous()
    assert isinstance(copy["list"], list) and isinstance(copy["tuple"], tuple)
    assert copy["list"][1] == 7 and copy["tuple"][1] == "s" and copy["none"] is None
    assert copy["tuple"][0].dtype == torch.bfloat16
    before = copy["model"]["big"].clone()
    state["model"]["big"].add_(1)
    state["list"][0].add_(1)
    assert torch.equal(copy["model"]["big"], before) and torch.equal(copy["list"][0], torch.arange(3))


def test_buffers_are_kept_and_only_a_changed_shape_is_reallocated():
    snapshot = Snapshot(threads=2)
    state = _state()
    first = snapshot.take(state)
    pointers = {k: v.data_ptr() for k, v in first["model"].items()}
    state["model"]["w"] = torch.randn(5, 3)
    state["model"]["big"].mul_(2)
    second = snapshot.take(state)
    assert second["model"]["big"].data_ptr() == pointers["big"]
    assert second["model"]["t"].data_ptr() == pointers["t"]
    assert second["model"]["w"].data_ptr() != pointers["w"] and second["model"]["w"].shape == (5, 3)
    assert torch.equal(second["model"]["big"], state["model"]["big"])


def test_reserved_buffers_are_the_ones_the_next_copy_fills():
    snapshot = Snapshot()
    state = _state()
    shapes = {
        "model": {
            k: torch.empty((), dtype=v.dtype, device="meta").expand(v.shape)
            for k, v in state["model"].items()
        }
    }
    snapshot.reserve(shapes)
    reserved = {k: v.data_ptr() for k, v in snapshot._copy["model"].items()}
    copy = snapshot.take(state)
    assert {k: v.data_ptr() for k, v in copy["model"].items()} == reserved
    assert all(torch.equal(copy["model"][k], state["model"][k]) for k in reserved)


def test_a_copying_thread_that_fails_raises_in_the_caller():
    buffer = torch.empty(4)
    jobs = [(torch.empty(2), torch.ones(2)), (buffer, torch.ones(3))]  # the second cannot be copied
    try:
        snapshot_module._run(jobs, threads=2)
    except RuntimeError:
        return
    raise AssertionError("a failed copy in a helper thread was not raised")
