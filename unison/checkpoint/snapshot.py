"""The CPU copy an asynchronous save writes: buffers kept from save to save, filled in parallel.

Training goes on while a background thread writes the checkpoint, so what it writes must be
a copy taken at the save. Allocating that copy anew at each save costs more than the copy
itself (the pages of a fresh buffer fault in as they are first written): :class:`Snapshot`
keeps its buffers and copies into them, reallocating only a tensor whose shape, dtype or
layout changed. It can :meth:`~Snapshot.reserve` them ahead of the first save, its pages
touched, so that even the first save only copies. Large CPU tensors are copied in slices
by several threads (``Tensor.copy_`` releases the GIL) when torch's own intra-op threads are
fewer; a GPU tensor is copied into pinned memory, all copies queued before one wait.
:meth:`~Snapshot.take_later` leaves the tensors its caller names to a :class:`Pending` copy,
taken in another thread while training goes on, which tells by each tensor's version
counter whether it changed in place before its copy was taken.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from unison.checkpoint.keypaths import tensors_with_paths

SLICE = 4 << 20
"""Bytes below which a CPU tensor is copied whole, by one thread (4 MiB)."""


def default_threads() -> int:
    """Threads that fill a snapshot: this process's CPUs, at most 8 (memory bandwidth is the limit)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - macOS, Windows
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus))


class Snapshot:
    """Copies states into CPU buffers that it keeps for the next copy.

    Args:
        threads: threads that copy large CPU tensors (default :func:`default_threads`).

    Example:
        >>> snapshot = Snapshot()
        >>> weights = {"w": torch.ones(3)}
        >>> copy = snapshot.take(weights)
        >>> _ = weights["w"].add_(1)
        >>> copy["w"].tolist(), snapshot.take(weights)["w"] is copy["w"]
        ([1.0, 1.0, 1.0], True)
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._copy: Any = None

    def take(self, state: Any) -> Any:
        """A deep copy of ``state`` (nested dicts, lists, tuples) with every tensor in CPU memory.

        The copy's tensors are this snapshot's buffers: the previous copy must no longer be read.
        """
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        copy = _mirror(state, self._copy, pairs)
        copy_pairs(pairs, self.threads)
        self._copy = copy
        return copy

    def take_later(self, state: Any, later: Callable[[torch.Tensor], bool]) -> tuple[Any, Pending]:
        """As :meth:`take`, but the tensors for which ``later(tensor)`` holds are copied only by
        the returned :class:`Pending`'s :meth:`~Pending.fill` (in another thread, while training
        goes on, up to the moment those tensors may change)."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        copy = _mirror(state, self._copy, pairs)
        now: list[tuple[torch.Tensor, torch.Tensor]] = []
        deferred: list[tuple[torch.Tensor, torch.Tensor]] = []
        names: list[str] = []
        for pair, (name, _) in zip(pairs, tensors_with_paths(state), strict=True):
            if later(pair[1]):
                deferred.append(pair)
                names.append(name)
            else:
                now.append(pair)
        copy_pairs(now, self.threads)
        self._copy = copy
        return copy, Pending(deferred, names, self.threads)

    def reserve(self, state: Any) -> None:
        """Allocates the buffers a copy of ``state`` needs and writes every page of them once,
        without reading ``state``'s values (only shapes, dtypes and devices): the next
        :meth:`take` of a state shaped alike only copies."""
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._copy = _mirror(state, self._copy, pairs)
        for buffer, _ in pairs:
            buffer.zero_()

    def release(self) -> None:
        """Drops the buffers."""
        self._copy = None


class Pending:
    """The copies a snapshot left for later (:meth:`Snapshot.take_later`): each buffer, its source,
    and the source's version counter when the snapshot was taken. Every in-place change of a
    tensor moves its counter, so a copy taken later can tell whether its source changed since.

    Attributes:
        names: each source's key path in the state (``objects.model.0.weight``).
    """

    def __init__(
        self,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
        names: list[str],
        threads: int,
        watched: list[torch.Tensor] | None = None,
    ) -> None:
        self.pairs = pairs
        self.names = names
        self.threads = threads
        self.watched = watched if watched is not None else [tensor for _, tensor in pairs]
        """Whose version counter tells of a change: each source, or what holds it (a DTensor, whose
        in-place changes move its own counter and not its local shard's)."""
        self.versions = [tensor._version for tensor in self.watched]

    def __len__(self) -> int:
        return len(self.pairs)

    def fill(self) -> list[str]:
        """Copies every source into its buffer; returns the key paths of the sources changed in place
        since the snapshot was taken (their copies may hold some of the change)."""
        copy_pairs(self.pairs, self.threads)
        return self.changed()

    def changed(self) -> list[str]:
        """The key paths of the sources changed in place since the snapshot was taken."""
        return [
            name
            for name, tensor, version in zip(self.names, self.watched, self.versions, strict=True)
            if tensor._version != version
        ]


def _fits(buffer: Any, tensor: torch.Tensor) -> bool:
    return (
        isinstance(buffer, torch.Tensor)
        and buffer.shape == tensor.shape
        and buffer.dtype == tensor.dtype
        and buffer.device.type == "cpu"
        and buffer.is_contiguous()
        and (tensor.device.type == "cpu" or buffer.is_pinned())
    )


def _buffer(tensor: torch.Tensor) -> torch.Tensor:
    pin = tensor.device.type == "cuda" and torch.cuda.is_available()
    return torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)


def _mirror(obj: Any, previous: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The structure of ``obj`` with a buffer for each tensor (``previous``'s where it fits);
    each (buffer, tensor) goes to ``pairs``."""
    if isinstance(obj, torch.Tensor):
        buffer = previous if _fits(previous, obj) else _buffer(obj)
        pairs.append((buffer, obj.detach()))
        return buffer
    if isinstance(obj, Mapping):
        earlier = previous if isinstance(previous, Mapping) else {}
        return {k: _mirror(v, earlier.get(k), pairs) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        same = isinstance(previous, (list, tuple)) and len(previous) == len(obj)
        items = [_mirror(v, previous[i] if same else None, pairs) for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return obj


def copy_pairs(pairs: list[tuple[torch.Tensor, torch.Tensor]], threads: int) -> None:
    """Copies each tensor into its buffer: GPU ones queued, then waited for; large CPU ones in
    slices over ``threads`` threads (one, where torch's own intra-op threads are as many)."""
    devices = set()
    jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for buffer, tensor in pairs:
        if tensor.device.type == "cpu":
            jobs.extend(_slices(buffer, tensor))
        else:
            buffer.copy_(tensor, non_blocking=buffer.is_pinned())
            devices.add(tensor.device)
    if threads <= torch.get_num_threads() or len(jobs) < 2:
        threads = 1
    _run(jobs, threads)
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()


def _slices(buffer: torch.Tensor, tensor: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes < 2 * SLICE or not tensor.is_contiguous():
        return [(buffer, tensor)]
    flat, source = buffer.view(-1), tensor.view(-1)
    step = max(1, SLICE // tensor.element_size())
    return [(flat[i : i + step], source[i : i + step]) for i in range(0, flat.numel(), step)]


def _run(jobs: list[tuple[torch.Tensor, torch.Tensor]], threads: int) -> None:
    """Runs the copies, the caller's thread one share and ``threads - 1`` new threads the others
    (new at each call: nothing of them survives a fork)."""
    shares: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(threads)]
    for i, job in enumerate(jobs):
        shares[i % threads].append(job)
    errors: list[BaseException] = []

    def copy(share: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            for buffer, tensor in share:
                buffer.copy_(tensor)
        except BaseException as err:  # re-raised in the caller's thread
            errors.append(err)

    helpers = [threading.Thread(target=copy, args=(share,), daemon=True) for share in shares[1:] if share]
    for helper in helpers:
        helper.start()
    copy(shares[0])
    for helper in helpers:
        helper.join()
    if errors:
        raise errors[0]
