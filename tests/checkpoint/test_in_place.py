"""A resume reads big records straight into the run's own tensors (unison.checkpoint.in_place).

The truth is ``torch.load`` of the same file: whatever the state holds (views, storages two keys
share, tuples, dtypes), the loaded state must equal it, and a run's tensor may only take a
record's place when the two are the same bytes.
"""

from __future__ import annotations

import mmap
import os
import struct
import sys
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

import unison.checkpoint.archive_load as archive_load
from unison.checkpoint.archive import keep_checked, overwritten
from unison.checkpoint.archive_load import Damaged, read_archive
from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.crc import BLOCK
from unison.checkpoint.in_place import Into, mirror, plan
from unison.checkpoint.io import atomic_save
from unison.checkpoint.keypaths import tensors_with_keys
from unison.checkpoint.manifest import Manifest, checkpoint_name


@pytest.fixture
def every_record(monkeypatch):
    """Every record of a byte or more is read in place where it can be (1 MiB in a run)."""
    monkeypatch.setattr(archive_load, "IN_PLACE_FROM", 1)


def _same(a, b) -> None:
    """``a`` and ``b`` are equal states: the same containers, and tensors of one dtype, shape, stride
    and bytes."""
    assert type(a) is type(b) or (isinstance(a, dict) and isinstance(b, dict))
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == (
            b.dtype,
            b.shape,
            b.stride(),
            b.storage_offset(),
        )
        assert torch.equal(
            a.view(torch.uint8) if a.dtype == torch.bool else a,
            b.view(torch.uint8) if b.dtype == torch.bool else b,
        )
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for key in a:
            _same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _same(x, y)
    else:
        assert a == b


def _sharing(state) -> list[list[tuple]]:
    """Which key paths share a storage, as groups."""
    groups: dict[int, list[tuple]] = {}
    for keys, tensor in tensors_with_keys(state):
        groups.setdefault(tensor.untyped_storage().data_ptr(), []).append(keys)
    return sorted(sorted(g, key=str) for g in groups.values())


def _trained() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 8)).sum().backward()
        optimizer.step()
    return model, optimizer


def test_a_models_and_optimizers_records_go_into_their_own_tensors(tmp_path, every_record):
    model, optimizer = _trained()
    saved = {"objects": {"model": model.state_dict(), "optimizer": optimizer.state_dict()}, "step": 2}
    path = atomic_save(saved, tmp_path / "c.pt")
    expected = torch.load(path, weights_only=True)
    with torch.no_grad():  # the run moved on: its tensors now differ from the file's
        for p in model.parameters():
            p.add_(1.0)
    optimizer.zero_grad()
    model(torch.randn(5, 8)).sum().backward()
    optimizer.step()
    live = mirror({"model": model, "optimizer": optimizer})
    pointers = {keys: t.data_ptr() for keys, t in tensors_with_keys(live)}

    into = Into.of({"model": model, "optimizer": optimizer})
    state = read_archive(path, into=into)

    _same(state, expected)
    assert into.files == [str(path)]
    placed = {keys for keys, t in tensors_with_keys(state) if pointers.get(keys) == t.data_ptr()}
    # every weight, buffer and Adam moment (plain, whole, of matching shape) was read in place...
    assert ("objects", "model", "0.weight") in placed and (
        "objects",
        "optimizer",
        "state",
        0,
        "exp_avg",
    ) in placed
    assert ("objects", "model", "1.running_var") in placed
    # ...and the objects hold the file's values without a load_state_dict
    assert torch.equal(model[0].weight, expected["objects"]["model"]["0.weight"])
    assert torch.equal(
        optimizer.state[model[0].weight]["exp_avg_sq"],
        expected["objects"]["optimizer"]["state"][0]["exp_avg_sq"],
    )
    model.load_state_dict(state["objects"]["model"])  # a copy of each tensor onto itself
    optimizer.load_state_dict(state["objects"]["optimizer"])
    assert (
        optimizer.state[model[0].weight]["exp_avg"].data_ptr()
        == pointers[("objects", "optimizer", "state", 0, "exp_avg")]
    )


def test_outside_a_resume_nothing_of_the_run_is_written(tmp_path, every_record):
    model, optimizer = _trained()
    path = atomic_save({"objects": {"model": model.state_dict()}}, tmp_path / "c.pt")
    before = model[0].weight.detach().clone()
    with torch.no_grad():
        model[0].weight.zero_()
    state = read_archive(path)
    assert torch.equal(state["objects"]["model"]["0.weight"], before)
    assert not model[0].weight.any(), "a read without `into` wrote into the model"


_DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool]


@st.composite
def _states(draw):
    """A saved state of drawn tensors (some views, some storages shared between keys, some in
    tuples) and the run's tensors at some of its key paths (some fitting, some of another dtype,
    shape or layout, some one memory for two keys)."""
    n = draw(st.integers(1, 6))
    saved: dict = {}
    live: dict = {}
    shared_pool: list[torch.Tensor] = []
    for i in range(n):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
        base = (torch.rand(shape) * 100).to(dtype)
        kind = draw(st.sampled_from(["whole", "view", "shared", "tuple"]))
        key = f"t{i}"
        if kind == "view" and base.numel() > 1:
            saved[key] = base.reshape(-1)[1:]
        elif kind == "shared" and shared_pool:
            saved[key] = shared_pool[-1]
        elif kind == "tuple":
            saved[key] = (base, 3)
        else:
            saved[key] = base
            shared_pool.append(base)
        target = draw(
            st.sampled_from(["fits", "none", "dtype", "shape", "reshaped", "strided", "same-memory"])
        )
        fitting = [k for k, v in live.items() if isinstance(v, torch.Tensor) and v.is_contiguous()]
        if (
            target == "same-memory" and fitting
        ):  # a new record of the shape of a tensor of the run's, given that tensor
            mine = live[draw(st.sampled_from(fitting))]
            saved[key] = (torch.rand(mine.shape) * 100).to(mine.dtype)
            live[key] = mine
            continue
        value = saved[key][0] if isinstance(saved[key], tuple) else saved[key]
        if target == "fits":
            mine = torch.full_like(value, 7) if value.dtype != torch.bool else torch.zeros_like(value)
        elif target == "dtype":
            mine = torch.zeros(value.shape, dtype=torch.int32 if value.dtype != torch.int32 else torch.int64)
        elif target == "shape":
            mine = torch.zeros((value.numel() + 1,), dtype=value.dtype)
        elif target == "reshaped" and value.dim() > 1:  # the same bytes, another shape
            mine = torch.zeros((value.numel(),), dtype=value.dtype)
        elif target == "strided" and value.dim() == 2 and value.shape[0] > 1 and value.shape[1] > 1:
            mine = torch.zeros((value.shape[1], value.shape[0]), dtype=value.dtype).t()
        else:
            continue
        live[key] = mine if not isinstance(saved[key], tuple) else (mine, 3)
    return {"objects": {"m": saved}}, {"objects": {"m": live}}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(drawn=_states())
def test_whatever_the_state_it_loads_as_torch_load_does(tmp_path_factory, drawn):
    saved, live = drawn
    folder = tmp_path_factory.mktemp("in-place")
    path = atomic_save(saved, folder / "c.pt")
    expected = torch.load(path, weights_only=True)
    before = {keys: t.clone() for keys, t in tensors_with_keys(live)}
    pointers = {keys: t.data_ptr() for keys, t in tensors_with_keys(live)}
    into = Into(live)
    archive_load.IN_PLACE_FROM, old = 1, archive_load.IN_PLACE_FROM
    try:
        state = read_archive(path, into=into)
    finally:
        archive_load.IN_PLACE_FROM = old

    _same(state, expected)
    assert _sharing(state) == _sharing(expected), (
        "storages shared in the file are shared after the load, and no others"
    )
    taken = {}
    for keys, tensor in tensors_with_keys(state):
        if pointers.get(keys) == tensor.data_ptr():  # a run's tensor took the record's place
            mine = dict(tensors_with_keys(live))[keys]
            assert mine.is_contiguous() and mine.dtype == tensor.dtype and mine.shape == tensor.shape
            assert tensor.data_ptr() not in taken, (
                f"{keys} and {taken.get(tensor.data_ptr())} were read into one memory"
            )
            taken[tensor.data_ptr()] = keys
    for keys, mine in tensors_with_keys(
        live
    ):  # a run's tensor is only written where it took a record's place
        if mine.data_ptr() not in taken:
            assert torch.equal(mine, before[keys]), f"{keys} was written without taking the record's place"
    assert (into.files == [str(path)]) == bool(taken)


def test_a_damaged_file_read_in_place_is_listed_before_its_damage_shows(tmp_path, every_record):
    model, _ = _trained()
    path = atomic_save({"objects": {"model": model.state_dict()}}, tmp_path / "c.pt")
    raw = bytearray(path.read_bytes())
    at = raw.index(struct.pack("<f", model[0].weight.flatten()[3].item()))
    raw[at] ^= 0xFF  # one byte of a weight flipped: its CRC-32 no longer matches
    path.write_bytes(bytes(raw))
    into = Into.of({"model": model})
    with pytest.raises(Damaged, match="CRC-32"):
        read_archive(path, into=into)
    assert into.files == [str(path)]


def test_a_read_only_tensor_of_the_run_is_read_around(tmp_path, every_record):
    path = atomic_save({"objects": {"m": {"w": torch.arange(6.0)}}}, tmp_path / "c.pt")
    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ)  # memory no read may write: the kernel says EFAULT
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: "the given buffer is not writable"
        read_only = torch.frombuffer(page, dtype=torch.float32, count=6)
    into = Into({"objects": {"m": {"w": read_only}}})
    state = read_archive(path, into=into)
    assert torch.equal(state["objects"]["m"]["w"], torch.arange(6.0))
    assert state["objects"]["m"]["w"].data_ptr() != read_only.data_ptr() and not read_only.any()
    del read_only, state


def test_a_file_of_another_byte_order_is_read_as_torch_reads_it(tmp_path, every_record, monkeypatch):
    path = atomic_save({"objects": {"m": {"w": torch.arange(6.0)}}}, tmp_path / "c.pt")
    mine = torch.zeros(6)
    into = Into({"objects": {"m": {"w": mine}}})
    monkeypatch.setattr(sys, "byteorder", "big")  # torch now swaps every record's bytes after reading it
    expected = torch.load(path, weights_only=True)
    state = read_archive(path, into=into)
    monkeypatch.undo()
    assert torch.equal(state["objects"]["m"]["w"], expected["objects"]["m"]["w"])
    assert not torch.equal(expected["objects"]["m"]["w"], torch.arange(6.0)), (
        "nothing was swapped: the test is blind"
    )
    assert not mine.any() and into.files == [], (
        "a record was left for later, and torch swapped memory not yet read"
    )


def test_a_record_the_state_does_not_reach_is_read_as_torch_reads_it(tmp_path, every_record, monkeypatch):
    path = atomic_save({"objects": {"m": {"w": torch.arange(6.0)}}}, tmp_path / "c.pt")
    monkeypatch.setattr(archive_load, "plan", lambda state, into, deferred: ({}, []))  # places nothing
    into = Into({"objects": {"m": {"w": torch.zeros(6)}}})
    state = read_archive(path, into=into)
    assert torch.equal(state["objects"]["m"]["w"], torch.arange(6.0)) and into.files == []


def test_plan_gives_one_memory_to_one_record_only():
    a, b = torch.ones(4), torch.ones(4)
    state = {"x": a, "y": b}
    mine = torch.zeros(4)
    targets, swaps = plan(state, {"x": mine, "y": mine}, {a.data_ptr(), b.data_ptr()})
    assert [keys for keys, _ in swaps] == [("x",)] and targets[b.data_ptr()] is b


def test_when_no_checkpoint_is_whole_after_reading_into_the_run_the_resume_raises(tmp_path, every_record):
    model, _ = _trained()
    paths = [
        atomic_save(
            {"meta": {}, "objects": {"model": model.state_dict()}}, tmp_path / checkpoint_name("ckpt", i, i)
        )
        for i in (1, 2)
    ]
    manifest = Manifest(tmp_path).rebuild()
    assert [e.file for e in manifest.entries] == [p.name for p in paths]
    for path in paths:  # both damaged on disk after they were recorded: a weight's byte flipped
        raw = bytearray(path.read_bytes())
        raw[raw.index(struct.pack("<f", model[0].weight.flatten()[0].item()))] ^= 0xFF
        path.write_bytes(bytes(raw))
    with keep_checked(into=Into.of({"model": model})):
        with pytest.raises(CheckpointError, match="cannot start afresh") as raised:
            manifest.newest_complete()
        assert overwritten() == [str(p) for p in reversed(paths)]
    assert all(str(p) in str(raised.value) for p in paths)
    with keep_checked():  # nothing read into the run: no checkpoint, and a fresh start as before
        assert manifest.newest_complete() is None
    assert all(os.path.exists(p) for p in paths), "a damaged checkpoint was deleted"


def test_a_big_record_is_read_into_the_run_in_file_order_and_checksummed_by_other_threads(
    tmp_path, monkeypatch
):
    import threading

    import unison.checkpoint.crc as crc_module
    import unison.checkpoint.prefault as prefault

    weight = torch.randn(2 * BLOCK // 4 + 1000)  # two whole 8 MiB blocks and a bit: three blocks
    path = atomic_save({"objects": {"m": {"w": weight}}}, tmp_path / "c.pt")
    reads, summed, faulted = [], [], []
    real_read, real_crc, real_populate = os.preadv, crc_module.crc32, prefault.populate

    def reading(fd, buffers, offset):
        n = real_read(fd, buffers, offset)
        if n >= (1 << 20):
            reads.append((offset, n, threading.current_thread() is threading.main_thread()))
        return n

    def summing(data, *rest):
        if len(data) in (weight.nbytes % BLOCK, BLOCK):  # a block of the record
            summed.append(threading.current_thread() is threading.main_thread())
        return real_crc(data, *rest)

    monkeypatch.setattr(os, "preadv", reading)
    monkeypatch.setattr(crc_module, "crc32", summing)
    monkeypatch.setattr(prefault, "populate", lambda *a: faulted.append(a) or real_populate(*a))
    mine = torch.zeros_like(weight)
    into = Into({"objects": {"m": {"w": mine}}})
    state = read_archive(path, into=into)
    assert state["objects"]["m"]["w"] is mine and torch.equal(mine, weight)
    assert [n for _, n, _ in reads] == [BLOCK, BLOCK], "the record's whole blocks, each read once"
    assert reads[0][0] < reads[1][0] and all(main for *_, main in reads), (
        "in file order, by the calling thread"
    )
    assert summed == [False, False, False], "every block checksummed by a pool thread"
    assert faulted == [], "the run's memory has its pages: none faulted in ahead"
    monkeypatch.undo()

    raw = bytearray(path.read_bytes())
    raw[raw.index(struct.pack("<f", weight[-10].item()))] ^= 0xFF  # a byte of the last block
    path.write_bytes(bytes(raw))
    with pytest.raises(Damaged, match="CRC-32"):
        read_archive(path, into=into)
