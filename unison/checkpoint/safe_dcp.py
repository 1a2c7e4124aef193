"""The one reader of a sharded checkpoint's shards: nothing in the folder can run code.

torch's Distributed Checkpoint (DCP) reads a folder through two hooks, both part of its
public extension interface:

- ``StorageReader.read_metadata``: ``FileSystemReader`` unpickles ``.metadata`` with
  ``pickle.load``. :class:`SafeFolderReader` reads it with only DCP's metadata classes
  allowed (:func:`~unison.checkpoint.sharded_check.read_metadata`), and refuses the
  per-rank metadata files unison never writes.
- ``LoadPlanner.load_bytes``: every non-tensor value (an optimizer's ``lr``, a step
  count) is stored as ``torch.save`` bytes, which the default planners load with
  ``torch.load(weights_only=False)``. The planners here load them with
  ``weights_only=True`` first and hand the default planner a re-serialised copy of that
  plain value, never the folder's bytes.

Tensors are read by DCP itself with ``weights_only=True``. :func:`check_hooks` makes sure,
before any load, that this torch still calls both hooks where unison overrides them; a
torch release that renames or bypasses one makes every load fail, naming what changed,
rather than read a folder unsafely. After a load, every non-tensor value the plan named
must have come through the safe hook.
"""

from __future__ import annotations

import dataclasses
import io
import types
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.dcp_reads import read_in_place
from unison.checkpoint.sharded_check import read_metadata
from unison.distributed.primitives import broadcast_object, first_rank, get_rank, is_distributed

_NO_GROUP_WARNING = r"torch\.distributed is (disabled, )?(unavailable|uninitialized)"


class UnsafeValueError(CheckpointError):
    """A value in a sharded checkpoint that only a full unpickler would load: refused."""


class HookError(CheckpointError):
    """This torch no longer reads sharded checkpoints through the hooks that keep loading safe."""


def _names_used(function: Callable[..., Any]) -> set[str]:
    """The attribute and global names ``function``'s code (and the functions inside it) refers to."""
    code = getattr(getattr(function, "__wrapped__", function), "__code__", None)
    names: set[str] = set()
    pending = [code] if code is not None else []
    while pending:
        current = pending.pop()
        names.update(current.co_names)
        pending.extend(c for c in current.co_consts if isinstance(c, types.CodeType))
    return names


def check_hooks() -> None:
    """Raises :class:`HookError` unless this torch reads a DCP folder through the hooks overridden here.

    Checked: ``LoadPlanner.load_bytes`` and ``StorageReader.read_metadata`` are still
    abstract methods of DCP's interfaces; the default planner still defines ``load_bytes``;
    ``FileSystemReader.read_data`` still hands non-tensor values to ``planner.load_bytes``;
    and the loader still asks the storage reader for the metadata (``read_metadata``).
    """
    from torch.distributed.checkpoint import FileSystemReader, planner, state_dict_loader, storage
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    changed = []
    for cls, hook in ((planner.LoadPlanner, "load_bytes"), (storage.StorageReader, "read_metadata")):
        if not getattr(getattr(cls, hook, None), "__isabstractmethod__", False):
            changed.append(f"{cls.__module__}.{cls.__qualname__}.{hook} is no longer an abstract method")
    if "load_bytes" not in vars(DefaultLoadPlanner):
        changed.append("DefaultLoadPlanner no longer defines load_bytes")
    if "load_bytes" not in _names_used(getattr(FileSystemReader, "read_data", lambda: None)):
        changed.append("FileSystemReader.read_data no longer calls planner.load_bytes")
    if "read_metadata" not in _names_used(getattr(state_dict_loader, "_load_state_dict", lambda: None)):
        changed.append(
            "torch.distributed.checkpoint.state_dict_loader._load_state_dict no longer calls read_metadata"
        )
    if changed:
        raise HookError(
            f"torch {torch.__version__} changed how Distributed Checkpoint reads a folder ({'; '.join(changed)}). "
            "unison loads sharded checkpoints only through those hooks, which keep any value in the folder from "
            "running code, so it refuses to load them with this torch. Use the torch version unison supports "
            "(see `unison doctor`)."
        )


def _plain_bytes(fqn: str, value: io.BytesIO) -> io.BytesIO:
    """The bytes of a non-tensor value, loaded with ``weights_only=True`` and saved again by us."""
    try:
        plain = torch.load(value, map_location="cpu", weights_only=True)
    except Exception as err:  # the weights-only unpickler raises UnpicklingError, RuntimeError...
        raise UnsafeValueError(
            f"its value {fqn} holds Python objects beyond tensors and plain data, which only a full unpickler "
            f"would load (and which could run code): refused ({type(err).__name__}: {err})"
        ) from err
    copy = io.BytesIO()
    torch.save(plain, copy)
    copy.seek(0)
    return copy


class _SafeBytes:
    """The ``load_bytes`` override shared by the planners; counts the values it loaded."""

    _expected: set[str]
    _loaded: set[str]

    def finish_plan(self, new_plan: Any) -> Any:
        from torch.distributed.checkpoint.planner import LoadItemType

        plan = super().finish_plan(new_plan)  # type: ignore[misc]
        self._expected = {i.dest_index.fqn for i in plan.items if i.type == LoadItemType.BYTE_IO}
        self._loaded = set()
        return plan

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        super().load_bytes(read_item, _plain_bytes(fqn, value))  # type: ignore[misc]
        self._loaded.add(fqn)

    def unread(self) -> set[str]:
        """Non-tensor values the plan named that never came through :meth:`load_bytes`."""
        return getattr(self, "_expected", set()) - getattr(self, "_loaded", set())


def _planner(keys: set[str] | None) -> Any:
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    if keys is None:
        return type("SafeLoadPlanner", (_SafeBytes, DefaultLoadPlanner), {})()
    return type("SafeEmptyStateDictLoadPlanner", (_SafeBytes, _EmptyStateDictLoadPlanner), {})(keys=keys)


def _reader(folder: Path) -> Any:
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeFolderReader(FileSystemReader):
        """A ``FileSystemReader`` whose metadata is unpickled with only DCP's metadata classes allowed."""

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if kwargs.get("rank") is not None:
                raise CheckpointError(
                    f"{folder}: unison reads only the folder's one .metadata, not a rank's own."
                )
            metadata = read_metadata(folder, checked=True)  # the copy the folder's check read, where it did
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def read_data(self, plan: Any, planner: Any) -> Any:
            """Tensor items that fill their shard are read straight into it (:mod:`unison.checkpoint.dcp_reads`);
            DCP reads the rest."""
            left = read_in_place(folder, getattr(self, "storage_data", None), plan, planner)
            return super().read_data(dataclasses.replace(plan, items=left), planner)

    return SafeFolderReader(folder)


def _first_failure(err: BaseException) -> BaseException:
    """The error a rank raised inside DCP (DCP wraps each rank's error in a CheckpointException)."""
    failures: Mapping[int, Any] = getattr(err, "failures", None) or {}
    for _, pair in sorted(failures.items()):
        inner = pair[0] if isinstance(pair, tuple) else pair
        if isinstance(inner, BaseException):
            return inner
    return err


def safe_load(
    state: dict[str, Any], folder: str | Path, *, keys: set[str] | None = None, no_dist: bool
) -> None:
    """Loads a DCP folder into ``state`` through the safe hooks; raises :class:`CheckpointError` naming it.

    At several ranks (``no_dist=False``, a collective) each rank plans and reads its own
    pieces, as DCP's load would without its two rounds of collectives: DCP gathers every
    rank's plan to rank 0 and sends it back, and its default planner's global step changes
    nothing (each rank reads what its own tensors need), then gathers every rank's result to
    learn whether one failed. Here one all-reduce of one number tells every rank whether any
    failed (:func:`~unison.distributed.primitives.first_rank`), and only then does the first rank
    that failed send what went wrong: every rank raises it, none is left waiting in a later
    collective. Nothing a rank sends grows with the world size or the model.

    Args:
        state: the states to fill in (their tensors receive the stored pieces); with ``keys``,
            an empty dict that receives the full values of those top-level keys.
        folder: the sharded checkpoint folder.
        keys: build the values from the metadata (one process, no model needed) for these keys.
        no_dist: read in this process alone; otherwise a collective on every rank.
    """
    check_hooks()
    folder = Path(folder)
    failure = _load_here(state, folder, keys)
    if not no_dist and is_distributed():
        failure = _agreed(failure)
    if failure is not None:
        raise failure


def _load_here(state: dict[str, Any], folder: Path, keys: set[str] | None) -> CheckpointError | None:
    """This process's pieces of ``folder`` loaded into ``state``; the error to raise, or None."""
    from torch.distributed.checkpoint import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict, load

    planner = _planner(keys)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_NO_GROUP_WARNING)
            if keys is None:
                load(state, storage_reader=_reader(folder), planner=planner, no_dist=True)
            else:  # what torch's own dcp_to_torch_save calls: a state built from the metadata
                _load_state_dict(state, storage_reader=_reader(folder), planner=planner, no_dist=True)
    except (Exception, CheckpointException) as err:  # the latter (a BaseException) wraps the error
        inner = _first_failure(err)
        if isinstance(inner, CheckpointError):
            error: CheckpointError = type(inner)(
                f"Sharded checkpoint {folder}: {inner}. The folder was written or altered by other code; unison "
                "never loads it. Resume or export another checkpoint, or restore this one from a trusted copy."
            )
        else:
            error = CheckpointError(
                f"Sharded checkpoint {folder}: its shards do not read ({type(inner).__name__}: {inner}). The "
                "folder is damaged or was written by other code; use another checkpoint."
            )
        error.__cause__ = err
        return error
    unread = sorted(planner.unread())
    if unread:
        named = ", ".join(unread[:4]) + (f" and {len(unread) - 4} more" if len(unread) > 4 else "")
        return HookError(
            f"Sharded checkpoint {folder}: torch {torch.__version__} loaded {named} without "
            "the safe LoadPlanner.load_bytes hook, so unison cannot vouch that loading them ran no code. Use the "
            "torch version unison supports (see `unison doctor`)."
        )
    return None


_ERRORS = {cls.__name__: cls for cls in (CheckpointError, UnsafeValueError, HookError)}


def _agreed(failure: CheckpointError | None) -> CheckpointError | None:
    """Collective: None when no rank's load failed; else the first failing rank's error, on every
    rank (that rank's own; elsewhere one of its kind and words, naming the rank)."""
    first = first_rank(failure is not None)
    if first is None:
        return None
    sent = broadcast_object(None if failure is None else (type(failure).__name__, str(failure)), src=first)
    if get_rank() == first and failure is not None:
        return failure
    kind, text = sent
    return _ERRORS.get(kind, CheckpointError)(f"{text} (rank {first}'s load failed; every rank stops)")
