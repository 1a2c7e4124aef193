"""unison.checkpoint.dcp_small: a DCP item's archive of one plain tensor read without torch.load.

The truth is ``torch.load(weights_only=True)`` of the same bytes: whatever it gives, ``decode``
gives the same tensor (values, dtype, shape, strides, offset) or None, and None sends the item
back to torch.load. Nothing in an archive is ever run: a pickle that would create a marker file
is refused and the marker never appears.
"""

from __future__ import annotations

import collections
import io
import pickle
import sys
import warnings
from pathlib import Path

import hypothesis.strategies as st
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from torch import nn

from unison.checkpoint.dcp_small import _DTYPES, decode
from unison.checkpoint.sharded import dcp_states, load_dcp_states

MARKER = "pwned-small"


def _archive(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _loaded(archive: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(archive), map_location="cpu", weights_only=True)


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and got.stride() == want.stride()
        and got.storage_offset() == want.storage_offset()
        and torch.equal(got, want)
    )


@st.composite
def _tensors(draw: st.DrawFn) -> torch.Tensor:
    """A tensor of any dtype torch.save writes a plain storage for, often a view into a larger one."""
    dtype = draw(st.sampled_from(sorted(_DTYPES.values(), key=str)))
    shape = draw(st.lists(st.integers(0, 5), min_size=0, max_size=3))
    base = torch.arange(max(1, 2 * int(torch.tensor(shape).prod().item()) + 3)).to(dtype)
    whole = base[: int(torch.tensor(shape).prod().item())].reshape(shape)
    view = draw(st.sampled_from(["whole", "offset", "transposed", "strided"]))
    if view == "offset" and whole.numel():
        return base[3 : 3 + whole.numel()].reshape(shape)
    if view == "transposed" and whole.dim() >= 2:
        return whole.transpose(0, 1)
    if view == "strided" and whole.dim() >= 1 and whole.shape[0] > 1:
        return whole[::2]
    return whole


@settings(max_examples=150, deadline=None)
@given(_tensors())
def test_a_plain_tensor_reads_as_torch_load_reads_it(tensor):
    archive = _archive(tensor)
    got = decode(archive)
    assert got is not None
    assert _same(got, _loaded(archive))


@pytest.mark.parametrize(
    "obj",
    [
        nn.Parameter(torch.ones(2)),  # a Parameter rebuilds through another function
        {"weight": torch.ones(2)},
        [torch.ones(2), torch.zeros(2)],
        3.5,
    ],
    ids=["parameter", "dict", "list", "float"],
)
def test_anything_but_one_plain_tensor_is_left_to_torch_load(obj):
    assert decode(_archive(obj)) is None


def test_an_archive_in_another_byte_order_is_left_to_torch_load(monkeypatch):
    archive = _archive(torch.arange(4.0))
    monkeypatch.setattr(sys, "byteorder", "big")
    assert decode(archive) is None


def test_bytes_that_are_no_archive_are_left_to_torch_load():
    archive = _archive(torch.arange(4.0))
    assert decode(archive[: len(archive) // 2]) is None
    assert decode(b"") is None


class _Payload:
    """A value whose unpickling creates the marker file."""

    def __reduce__(self):
        return (Path.touch, (Path(MARKER),))


def test_a_pickle_that_would_run_code_is_refused_unrun(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert decode(_archive(_Payload())) is None
    assert decode(_archive({"t": torch.ones(1), "x": _Payload()})) is None
    assert not (tmp_path / MARKER).exists()


class _StorageRef:
    pass


class _Rebuilt:
    """Pickles as torch pickles a tensor: ``_rebuild_tensor_v2`` of a persistent storage."""

    def __init__(self, offset: int, size: tuple[int, ...], stride: tuple[int, ...]) -> None:
        self.args = (_StorageRef(), offset, size, stride, False, collections.OrderedDict())

    def __reduce__(self):
        return (torch._utils._rebuild_tensor_v2, self.args)


def _crafted(offset: int, size: tuple[int, ...], stride: tuple[int, ...], numel: int, stored: int) -> bytes:
    """An archive torch's own writer makes, whose pickle rebuilds ``size``/``stride`` at ``offset`` from a
    float storage it says holds ``numel`` elements, and whose record holds ``stored``."""

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return (
                ("storage", torch.FloatStorage, "0", "cpu", numel) if isinstance(obj, _StorageRef) else None
            )

    pickled = io.BytesIO()
    Pickler(pickled, protocol=2).dump(_Rebuilt(offset, size, stride))
    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out)
    data = torch.arange(float(stored)).numpy().tobytes()
    for name, payload in (
        ("data.pkl", pickled.getvalue()),
        ("byteorder", sys.byteorder.encode()),
        ("data/0", data),
    ):
        writer.write_record(name, payload, len(payload))
    writer.write_end_of_file()
    return out.getvalue()


def test_a_crafted_archive_within_its_storage_reads_as_torch_load_reads_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TypedStorage's deprecation, pickled by name
        archive = _crafted(2, (3, 2), (1, 3), numel=10, stored=10)
    got = decode(archive)
    assert got is not None and _same(got, _loaded(archive))


@pytest.mark.parametrize(
    ("offset", "size", "stride", "numel", "stored"),
    [
        (0, (8,), (1,), 4, 4),  # reaches past its storage
        (3, (2, 2), (2, 1), 6, 6),  # its last element past the storage's end
        (0, (4,), (1,), 4, 3),  # a record shorter than the storage it claims
        (0, (2,), (1,), 4, 8),  # a record longer than that storage
    ],
)
def test_a_crafted_archive_that_reads_outside_its_record_is_left_to_torch_load(
    offset, size, stride, numel, stored
):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert decode(_crafted(offset, size, stride, numel, stored)) is None


def _many_small(seed: int) -> dict:
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(12)])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    return {"model": model, "optimizer": optimizer}


def test_a_folder_of_small_tensors_loads_with_torch_load_for_its_values_only(tmp_path, monkeypatch):
    """A model of 12 layers and SGD's momentum: 48 tensor items, every one decoded; ``torch.load``
    runs only for the folder's values (the optimizer's settings and step counts), through the safe
    hook, and every tensor comes back as saved."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from unison.checkpoint.sharded_check import read_metadata

    saved = _many_small(0)
    folder = tmp_path / "c.dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that no process group exists
        dcp.save(dcp_states(saved, ["model", "optimizer"]), checkpoint_id=folder, no_dist=True)
    values = [
        k for k, v in read_metadata(folder).state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)
    ]
    calls = []
    real = torch.load

    def counted(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    monkeypatch.setattr(torch, "load", counted)
    fresh = _many_small(1)
    load_dcp_states(folder, fresh, ["model", "optimizer"])
    assert values and not any(isinstance(got, torch.Tensor) for got in calls)  # none for a tensor
    assert len(calls) == 2 * len(values)  # the safe hook's load of each value, then DCP's of its plain copy
    for (name, got), want in zip(
        fresh["model"].state_dict().items(), saved["model"].state_dict().values(), strict=True
    ):
        assert torch.equal(got, want), name
    for got, want in zip(fresh["optimizer"].state.values(), saved["optimizer"].state.values(), strict=True):
        assert torch.equal(got["momentum_buffer"], want["momentum_buffer"])
