"""The CPU copy an asynchronous sharded save writes: buffers kept from save to save, the tensors
only an optimizer's step changes copied while training goes on.

An asynchronous save copies the states to CPU memory, so that training may change them while a
thread writes the copy. DCP's own staging (``dcp.async_save``'s) allocates that copy anew at
every save: measured here at 1 GB and 2 ranks, 757 ms of a 775 ms stall went to it (the pages of
fresh memory fault in as they are first written), longer than a whole synchronous save.
:class:`KeptStaging` keeps its buffers from save to save and copies each save's states into them
(as :class:`~unison.checkpoint.snapshot.Snapshot` does for a checkpoint file), making new ones
only when the states' layout changed: a tensor's shape, dtype, device, local shard or placements,
or a key. It makes them with DCP's own helper, which knows DTensors (its mesh and placements
kept): ``torch.distributed._state_dict_utils._create_cpu_state_dict`` (DCP's public
``BlockingAsyncStager`` caches its copy too, in pinned memory, which a CPU-only torch cannot
make); ``unison doctor`` checks that later saves still copy into them. It can
:meth:`~KeptStaging.reserve` them ahead of the first save, in a thread, every page written once.

Given the tensors only an optimizer's step changes, :meth:`KeptStaging.stage` copies the others
at once and leaves those to a :class:`~unison.checkpoint.snapshot.Pending` copy
(:meth:`KeptStaging.deferred`), which the save's writer thread takes while the next iteration's
forward and backward run, before it writes.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

import torch

from unison.checkpoint.keypaths import tensors_with_paths
from unison.checkpoint.snapshot import Pending, copy_pairs, default_threads
from unison.distributed.fsdp import stored_shard
from unison.utils.logging import get_logger

_log = get_logger(__name__)

__all__ = ["KeptStaging", "layout_of", "staging_problem"]


class KeptStaging:
    """Copies an asynchronous sharded save's states into CPU buffers kept from one save to the next;
    kept by the checkpoint's writer, which lets one save write at a time (the next save's copy
    overwrites the buffers the previous one wrote from).

    Args:
        threads: threads that copy large CPU tensors (default: this process's CPUs, at most 8).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self.buffers: dict[str, Any] | None = None
        """The kept copy, laid out as the states last staged (None before the first)."""
        self._layout: Any = None
        self._deferred: Pending | None = None
        self._reserving: threading.Thread | None = None

    def reserve(self, state_dict: dict[str, Any]) -> None:
        """Makes the buffers of a state laid out as ``state_dict`` in a thread, every page of them
        written once, so that the next :meth:`stage` (which waits for it) only copies. Its values
        are overwritten by that copy: the thread may read them while training changes them."""
        if self._reserving is not None:
            return

        def run() -> None:
            try:
                layout, buffers = layout_of(state_dict), _buffers(state_dict)
                for _, buffer in tensors_with_paths(buffers):
                    stored_shard(buffer).zero_()  # the pages fault in here, not in the save's copy
                self.buffers, self._layout = buffers, layout
            except (RuntimeError, MemoryError) as err:  # the first save makes its buffers itself
                _log.warning("Could not reserve the CPU copy of an asynchronous sharded checkpoint: %s", err)

        self._reserving = threading.Thread(target=run, name="unison-ckpt", daemon=True)
        self._reserving.start()

    def stage(
        self, state_dict: dict[str, Any], later: Callable[[torch.Tensor], bool] | None = None
    ) -> dict[str, Any]:
        """``state_dict`` with its tensors in the kept buffers (new ones when its layout changed),
        every tensor copied but those ``later`` holds for (asked of each DTensor's local shard),
        which are left to :meth:`deferred`; other values are copied."""
        if self._reserving is not None:
            self._reserving.join()
        self._deferred = None
        layout = layout_of(state_dict)
        if self.buffers is None or layout != self._layout:
            self.buffers = None  # the old buffers go before the new ones are made
            self.buffers = _buffers(state_dict)
            self._layout = layout
            later = None  # new buffers hold no values yet: every tensor is copied at once
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        sources: list[tuple[str, torch.Tensor]] = []
        staged = _into(state_dict, self.buffers, pairs, sources, "")
        now: list[tuple[torch.Tensor, torch.Tensor]] = []
        left: list[tuple[torch.Tensor, torch.Tensor]] = []
        left_sources: list[tuple[str, torch.Tensor]] = []
        for pair, source in zip(pairs, sources, strict=True):
            if later is not None and later(pair[1]):
                left.append(pair)
                left_sources.append(source)
            else:
                now.append(pair)
        copy_pairs(now, self.threads)
        if left:
            names, watched = [n for n, _ in left_sources], [t for _, t in left_sources]
            self._deferred = Pending(left, names, self.threads, watched)
        return staged

    def deferred(self) -> Pending | None:
        """The copy the last :meth:`stage` left for later (to be taken before the staged state is
        written); None when it left none."""
        deferred, self._deferred = self._deferred, None
        return deferred


def _buffers(state_dict: dict[str, Any]) -> dict[str, Any]:
    """New CPU buffers laid out as ``state_dict`` (DCP's helper: a DTensor's mesh and placements
    kept), pinned where CUDA is available; their values are not yet the state's."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    return _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())


def _into(
    source: Any,
    kept: Any,
    pairs: list[tuple[torch.Tensor, torch.Tensor]],
    sources: list[tuple[str, torch.Tensor]],
    where: str,
) -> Any:
    """``source`` with each tensor replaced by its kept buffer (``kept`` is laid out as ``source``,
    :func:`layout_of`): each (buffer, tensor) pair to copy goes to ``pairs``, and the tensor as
    the state holds it (a DTensor, whose version counter moves with its in-place changes), with
    its key path, to ``sources``; other values are copied."""
    if isinstance(source, torch.Tensor):
        pairs.append((stored_shard(kept), stored_shard(source)))
        sources.append((where, source))
        return kept
    if isinstance(source, Mapping):
        return {
            k: _into(v, kept[k], pairs, sources, f"{where}.{k}" if where else str(k))
            for k, v in source.items()
        }
    if isinstance(source, (list, tuple)):
        items = [_into(v, kept[i], pairs, sources, f"{where}.{i}") for i, v in enumerate(source)]
        return items if isinstance(source, list) else tuple(items)
    return copy.deepcopy(source)


def layout_of(obj: Any) -> Any:
    """What must match for a state to be copied into another's buffers: its keys and, for each
    tensor, its type, shape, dtype and device, and a DTensor's local shape, stride and placements.

    Example:
        >>> layout_of({"w": torch.ones(2)}) == layout_of({"w": torch.zeros(2)})
        True
        >>> layout_of({"w": torch.ones(2)}) == layout_of({"w": torch.ones(3)})
        False
    """
    if isinstance(obj, torch.Tensor):
        local = stored_shard(obj)
        placements = tuple(getattr(obj, "placements", ()))
        return (
            type(obj),
            tuple(obj.shape),
            obj.dtype,
            obj.device,
            tuple(local.shape),
            local.stride(),
            placements,
        )
    if isinstance(obj, Mapping):
        return tuple((key, layout_of(value)) for key, value in obj.items())
    if isinstance(obj, (list, tuple)):
        return (type(obj), tuple(layout_of(value) for value in obj))
    return type(obj)


def check_staging() -> str | None:
    """None when this torch's buffer-making helper behaves as :class:`KeptStaging` relies on
    (checked on a small state: a second staging copies into the first one's buffers), else what
    changed."""
    stager = KeptStaging()
    source: dict[str, Any] = {"w": torch.arange(6.0), "step": 3}
    first = stager.stage(source)
    source["w"].add_(1)
    second = stager.stage(source)
    if second["w"].data_ptr() != first["w"].data_ptr():
        return "a second staging of a state shaped alike did not copy into the first one's buffers"
    if second["w"].data_ptr() == source["w"].data_ptr() or not torch.equal(second["w"], source["w"]):
        return "a staging did not copy the state's values into its own buffers"
    return None if second["step"] == 3 else "a staging did not keep a state's plain values"


@functools.cache
def staging_problem() -> str | None:
    """:func:`check_staging`, once a process (``unison doctor`` runs the same check); an error it
    raises (a helper renamed, moved or called otherwise) is a problem too."""
    try:
        return check_staging()
    except Exception as err:
        return f"{type(err).__name__}: {err}"
