"""What a sharded checkpoint's ``.metadata`` declares, checked before a byte of the shards is read.

DCP builds each tensor it loads from the pieces (chunks) that ``.metadata`` lists, and a
tensor that export builds from the metadata alone starts as uninitialised memory: a piece
that is missing leaves process memory in the weights. So every declared tensor must be
covered exactly by its pieces (each inside the tensor, no two overlapping, their values
adding up to the tensor's), every piece and every non-tensor value must have its stored
bytes, long enough for the piece; and every field must have the type DCP writes. A phrase
says what is wrong, naming the field or the tensor; None when the layout is sound.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from math import prod
from typing import Any

import torch

_INDEX = "storage_data"


def _integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(_integer(v) for v in value)


def _field(where: str, value: Any, expected: str) -> str:
    return f"its .metadata field {where} is {value!r} ({type(value).__name__}), expected {expected}"


def storage_problem(storage: Any) -> str | None:
    """What is wrong with the types of ``storage_data`` (where each value is stored); None when sound."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import MetadataIndex

    if not isinstance(storage, Mapping):
        return _field(
            _INDEX, storage, "a dict of where each value is stored (not a checkpoint written to a folder)"
        )
    for index, info in storage.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return _field(f"{_INDEX} key", index, "a MetadataIndex naming a value")
        if index.offset is not None and not _size(index.offset):
            return _field(f"{_INDEX}[{index.fqn}].offset", index.offset, "a torch.Size of integers >= 0")
        where = f"{_INDEX}[{index.fqn}]"
        if not isinstance(info, _StorageInfo):
            return _field(where, info, "a _StorageInfo")
        if not isinstance(info.relative_path, str):
            return _field(f"{where}.relative_path", info.relative_path, "a file name")
        for name in ("offset", "length"):
            if not _integer(getattr(info, name)):
                return _field(f"{where}.{name}", getattr(info, name), "an integer >= 0")
        if info.transform_descriptors:
            return (
                f"its value {index.fqn} is stored through transforms {list(info.transform_descriptors)!r} "
                "(compression or encryption), which unison does not read"
            )
    return None


def layout_problem(metadata: Any) -> str | None:
    """What is wrong with the tensors and values ``metadata`` declares, as a phrase; None when sound.

    Expects :func:`storage_problem` to have found nothing.
    """
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    declared = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(declared, Mapping):
        return _field("state_dict_metadata", declared, "a dict of the values stored")
    planner_data = getattr(metadata, "planner_data", None)
    if planner_data is not None and not (
        isinstance(planner_data, Mapping)
        and all(isinstance(k, str) and isinstance(v, (list, tuple)) for k, v in planner_data.items())
    ):
        return _field("planner_data", planner_data, "a dict of each value's path in the saved state")
    storage = metadata.storage_data
    for fqn, value in declared.items():
        if not isinstance(fqn, str):
            return _field("state_dict_metadata key", fqn, "a value's name")
        if isinstance(value, BytesStorageMetadata):
            if MetadataIndex(fqn) not in storage:
                return f"its value {fqn}, declared in .metadata, has no stored bytes"
        elif isinstance(value, TensorStorageMetadata):
            problem = _tensor_problem(fqn, value, storage)
            if problem is not None:
                return problem
        else:
            return _field(
                f"state_dict_metadata[{fqn}]", value, "a TensorStorageMetadata or BytesStorageMetadata"
            )
    return None


def _tensor_problem(fqn: str, value: Any, storage: Mapping[Any, Any]) -> str | None:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

    dtype = getattr(getattr(value, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        return _field(f"state_dict_metadata[{fqn}].properties.dtype", dtype, "a torch.dtype")
    if not _size(value.size):
        return _field(f"state_dict_metadata[{fqn}].size", value.size, "a torch.Size of integers >= 0")
    chunks = value.chunks
    if not isinstance(chunks, Sequence) or not all(isinstance(c, ChunkStorageMetadata) for c in chunks):
        return _field(f"state_dict_metadata[{fqn}].chunks", chunks, "a list of ChunkStorageMetadata")
    shape = list(value.size)
    boxes = []
    for chunk in chunks:
        if not (
            _size(chunk.offsets)
            and _size(chunk.sizes)
            and len(chunk.offsets) == len(chunk.sizes) == len(shape)
        ):
            return _field(
                f"state_dict_metadata[{fqn}].chunks",
                chunk,
                f"offsets and sizes of {len(shape)} integers >= 0",
            )
        if any(o + s > d for o, s, d in zip(chunk.offsets, chunk.sizes, shape, strict=True)):
            return f"its tensor {fqn} of shape {shape} declares a piece at {list(chunk.offsets)} of shape {list(chunk.sizes)}, outside it"
        info = storage.get(MetadataIndex(fqn, chunk.offsets))
        if info is None:
            return f"its tensor {fqn} declares a piece at {list(chunk.offsets)} with no stored bytes"
        needed = prod(chunk.sizes) * dtype.itemsize
        if info.length < needed:
            return (
                f"its tensor {fqn} stores its piece at {list(chunk.offsets)} in {info.length} bytes, where its "
                f"{prod(chunk.sizes)} values of {dtype} need at least {needed}"
            )
        boxes.append((tuple(chunk.offsets), tuple(chunk.sizes)))
    overlap = _overlap(boxes)
    if overlap is not None:
        return f"its tensor {fqn} declares pieces at {overlap[0]} and {overlap[1]} that overlap"
    covered, whole = sum(prod(s) for _, s in boxes), prod(shape)
    if covered != whole:
        return (
            f"its tensor {fqn} of shape {shape} ({whole} values) has stored pieces covering {covered} of them: "
            "the rest would be uninitialised memory"
        )
    return None


def _overlap(boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]) -> tuple[list[int], list[int]] | None:
    """Two boxes (offsets, sizes) that share a value, by their offsets; None when none do."""
    solid = sorted(b for b in boxes if all(b[1]))  # an empty piece holds no value
    for i, (first, first_sizes) in enumerate(solid):
        for second, second_sizes in solid[i + 1 :]:
            if first and second[0] >= first[0] + first_sizes[0]:
                break  # sorted by the first offset: no later box reaches back into this one
            if all(
                a < b + bs and b < a + as_
                for a, as_, b, bs in zip(first, first_sizes, second, second_sizes, strict=True)
            ):
                return list(first), list(second)
    return None
