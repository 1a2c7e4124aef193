"""A sharded checkpoint's small tensor items read without a ``torch.load`` each.

DCP writes every tensor of a rank's file as an archive of its own (``torch.save``), and its
reader loads each with ``torch.load(weights_only=True)``: on the 2-CPU machine of
docs/benchmarks.md, 354 us for an archive of 512 KB, most of it the weights-only unpickler,
a loop in Python over the archive's pickle. The items of 1 MiB or more that fill a shard are
read straight into it (:mod:`unison.checkpoint.dcp_reads`); every other item (a bias, a norm,
each shard of a modest model) paid that at every resume: a 184-tensor transformer with AdamW
has 748 items a rank.

:func:`decode` reads such an archive with torch's own zip reader and takes its pickle apart
opcode by opcode (``pickletools.genops``: parsed, never run), accepting the one form torch
writes for a plain tensor and nothing else: ``torch._utils._rebuild_tensor_v2`` of a storage
that is the archive's ``data/<key>`` record of a known storage class, an offset, a size, a
stride, ``requires_grad`` and an empty ``OrderedDict`` of hooks. The tensor is then a view of
a copy of that record, its extent checked against the record's length. Anything else (another
form, a tensor with metadata, another byte order, a record of the wrong length, a pickle that
names anything more) returns None, and the item is left to DCP's own ``torch.load``, which then
reads it as it always did or says why it cannot.

:func:`read_small` reads the small plain tensor items of a load's plan that way, in file order,
and commits each into its target as DCP's reader does (narrowed to the request, the same size,
copied).
"""

from __future__ import annotations

import functools
import io
import os
import pickletools
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from unison.utils.run_files import open_fd

__all__ = ["decode", "read_small"]

_DTYPES: dict[str, torch.dtype] = {
    "DoubleStorage": torch.float64,
    "FloatStorage": torch.float32,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
    "LongStorage": torch.int64,
    "IntStorage": torch.int32,
    "ShortStorage": torch.int16,
    "CharStorage": torch.int8,
    "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
    "ComplexDoubleStorage": torch.complex128,
    "ComplexFloatStorage": torch.complex64,
}
"""The legacy storage classes ``torch.save`` names, by name, and their dtypes."""

_TEXT = ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8")
_INTS = ("BININT", "BININT1", "BININT2", "LONG1")
_TUPLES = {"TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


class _Global(NamedTuple):
    module: str
    name: str


class _Storage(NamedTuple):
    kind: str
    key: str
    numel: int


class _Spec(NamedTuple):
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]


class _Refused(Exception):
    """The pickle is not the one form accepted here."""


_HOOKS = object()
"""An empty ``OrderedDict()``, as a plain tensor's pickle builds for its backward hooks."""
_ODICT = _Global("collections", "OrderedDict")
_REBUILD = _Global("torch._utils", "_rebuild_tensor_v2")


def _counts(value: Any) -> tuple[int, ...]:
    if not isinstance(value, tuple) or not all(type(v) is int and v >= 0 for v in value):
        raise _Refused
    return value


def _reduce(function: Any, args: Any) -> Any:
    if function == _ODICT and args == ():
        return _HOOKS
    if function != _REBUILD or not isinstance(args, tuple) or len(args) != 6:
        raise _Refused
    storage, offset, size, stride, requires_grad, hooks = args
    if not isinstance(storage, _Storage) or type(offset) is not int or offset < 0:
        raise _Refused
    if type(requires_grad) is not bool or hooks is not _HOOKS:
        raise _Refused
    size, stride = _counts(size), _counts(stride)
    if len(size) != len(stride):
        raise _Refused
    return _Spec(storage, offset, size, stride)


def _persistent(pid: Any) -> _Storage:
    if not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage":
        raise _Refused
    _, kind, key, location, numel = pid
    if not isinstance(kind, _Global) or kind.module != "torch" or kind.name not in _DTYPES:
        raise _Refused
    if not isinstance(key, str) or not key.isdigit() or not isinstance(location, str):
        raise _Refused
    if type(numel) is not int or numel < 0:
        raise _Refused
    return _Storage(kind.name, key, numel)


def _step(name: str, arg: Any, stack: list[Any], marks: list[int], memo: dict[int, Any]) -> None:
    """One opcode of the accepted form applied to ``stack``; raises :class:`_Refused` for any other."""
    if name in ("PROTO", "FRAME"):
        return
    if name in ("BINPUT", "LONG_BINPUT"):
        memo[arg] = stack[-1]
    elif name == "MEMOIZE":
        memo[len(memo)] = stack[-1]
    elif name in ("BINGET", "LONG_BINGET"):
        stack.append(memo[arg])
    elif name == "GLOBAL":
        module, _, attr = arg.partition(" ")
        stack.append(_Global(module, attr))
    elif name == "MARK":
        marks.append(len(stack))
    elif name in _TEXT or name in _INTS:
        stack.append(arg)
    elif name in ("NEWTRUE", "NEWFALSE"):
        stack.append(name == "NEWTRUE")
    elif name == "EMPTY_TUPLE":
        stack.append(())
    elif name == "TUPLE":
        start = marks.pop()
        items = tuple(stack[start:])
        del stack[start:]
        stack.append(items)
    elif name in _TUPLES:
        count = _TUPLES[name]
        items = tuple(stack[len(stack) - count :])
        del stack[len(stack) - count :]
        stack.append(items)
    elif name == "BINPERSID":
        stack.append(_persistent(stack.pop()))
    elif name == "REDUCE":
        args = stack.pop()
        stack.append(_reduce(stack.pop(), args))
    else:
        raise _Refused


@functools.lru_cache(maxsize=1024)
def _spec(pickled: bytes) -> _Spec | None:
    """What a plain tensor's pickle rebuilds, read without running it; None for any other pickle.
    Kept by its bytes: the layers of a model mostly share a few shapes, and so a few pickles."""
    stack: list[Any] = []
    marks: list[int] = []
    memo: dict[int, Any] = {}
    try:
        for op, arg, _ in pickletools.genops(pickled):
            if op.name == "STOP":
                return stack[0] if len(stack) == 1 and isinstance(stack[0], _Spec) and not marks else None
            _step(op.name, arg, stack, marks, memo)
    except (_Refused, ValueError, IndexError, KeyError, TypeError):
        return None
    return None


def decode(archive: bytes) -> torch.Tensor | None:
    """The tensor a ``torch.save`` archive of one plain tensor holds, as ``torch.load(weights_only=True,
    map_location="cpu")`` would give it, read without unpickling; None for any other archive."""
    try:
        reader = torch._C.PyTorchFileReader(io.BytesIO(archive))
        if bytes(reader.get_record("byteorder")) != sys.byteorder.encode():
            return None
        spec = _spec(bytes(reader.get_record("data.pkl")))
        if spec is None or (record := f"data/{spec.storage.key}") not in reader.get_all_records():
            return None
        # the record's bytes where they lie in the archive: get_record would copy them once more
        start = reader.get_record_offset(record)  # type: ignore[attr-defined]  # torch's stubs leave it out
        length = reader.get_record_size(record)
    except Exception:  # noqa: BLE001 - torch's reader refused it: torch.load says why, later
        return None
    dtype = _DTYPES[spec.storage.kind]
    if length != spec.storage.numel * dtype.itemsize or not 0 <= start <= len(archive) - length:
        return None
    data = memoryview(archive)[start : start + length]
    if any(n == 0 for n in spec.size):
        last = spec.offset - 1  # an empty tensor reads nothing
    else:
        last = spec.offset + sum((n - 1) * s for n, s in zip(spec.size, spec.stride, strict=True))
    if last >= spec.storage.numel:
        return None
    flat = torch.frombuffer(bytearray(data), dtype=dtype) if len(data) else torch.empty(0, dtype=dtype)
    return flat.as_strided(spec.size, spec.stride, spec.offset)


def read_small(folder: Path, storage_data: Mapping[Any, Any], items: list[Any], planner: Any) -> list[Any]:
    """Reads ``items`` (tensor items of one load's plan, each ``storage_data`` entry a plain one: a
    file of the folder, an offset, a length, no transform) with :func:`decode`, in file order, and
    commits each into its target as DCP's reader does; returns those it left to DCP, in their order."""
    by_file: dict[str, list[Any]] = {}
    for item in items:
        by_file.setdefault(storage_data[item.storage_index].relative_path, []).append(item)
    done: set[int] = set()
    for relative, found in by_file.items():
        fd = open_fd(folder / relative)  # a link or a FIFO put there is refused, not followed
        try:
            for item in sorted(found, key=lambda entry: storage_data[entry.storage_index].offset):
                where = storage_data[item.storage_index]
                tensor = decode(os.pread(fd, where.length, where.offset))
                if tensor is None:
                    continue
                tensor = _requested(tensor, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise ValueError(
                        f"the item {item.storage_index.fqn} read from {relative} has shape {tuple(tensor.shape)}, "
                        f"where its place holds {tuple(target.shape)}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(item, target)
                done.add(id(item))
        finally:
            os.close(fd)
    return [item for item in items if id(item) not in done]


def _requested(tensor: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    """The part of an item a request reads: from ``offsets``, ``lengths`` long, in each dimension."""
    for dim, (offset, length) in enumerate(zip(offsets, lengths, strict=True)):
        if offset or length != tensor.shape[dim]:
            tensor = tensor.narrow(dim, offset, length)
    return tensor
