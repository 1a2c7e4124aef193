"""The CPU copy an asynchronous sharded save writes: buffers kept from save to save, the tensors
only an optimizer's step changes copied while training goes on.

``dcp.async_save`` copies the states it is given to CPU memory (its staging), so that training
may change them while a thread writes the copy. Its default staging allocates that copy anew at
every save: measured here at 1 GB and 2 ranks, 757 ms of a 775 ms stall went to it (the pages of
fresh memory fault in as they are first written), longer than a whole synchronous save.
:class:`KeptStaging` keeps the copy of the first save and copies each later save's states into
it (as :class:`~unison.checkpoint.snapshot.Snapshot` does for a checkpoint file), making a new one
only when the states' layout changed: a tensor's shape, dtype, device, local shard or placements,
or a key. The first copy is made by DCP's own helper, which knows DTensors (a shard copied, its
mesh and placements kept): ``torch.distributed._state_dict_utils._create_cpu_state_dict``, behind
DCP's public ``BlockingAsyncStager`` (whose own cache pins its memory, which a CPU-only torch
cannot do). ``unison doctor`` checks that it still makes buffers a later save copies into.

Given the tensors only an optimizer's step changes (:attr:`KeptStaging.later`), a staging copies
the others at once and leaves those to a :class:`~unison.checkpoint.snapshot.Pending` copy
(:meth:`KeptStaging.deferred`), which the save's writer thread takes while the next iteration's
forward and backward run; DCP's ``stage`` protocol lets the staging return a future, which DCP's
writing thread waits for before it plans.
"""

from __future__ import annotations

import copy
import functools
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from typing import Any

import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from unison.checkpoint.keypaths import tensors_with_paths
from unison.checkpoint.snapshot import Pending, copy_pairs, default_threads
from unison.distributed.fsdp import is_dtensor
from unison.utils.logging import get_logger

_log = get_logger(__name__)

__all__ = ["KeptStaging", "layout_of", "staging_problem"]


class KeptStaging(BlockingAsyncStager):
    """DCP's staging (``dcp.async_save(..., async_stager=...)``) into CPU buffers kept from one save
    to the next; kept by the checkpoint's writer, which lets one save write at a time (the next
    save's copy overwrites the buffers the previous one wrote from).

    Attributes:
        later: for the next :meth:`stage` only (then reset): which tensors to leave to
            :meth:`deferred` (each DTensor asked by its local shard); None copies every tensor at once.
    """

    def __init__(self, threads: int | None = None) -> None:
        super().__init__(cache_staged_state_dict=False, type_check=False)
        self.threads = threads or default_threads()
        self.later: Callable[[torch.Tensor], bool] | None = None
        self._layout: Any = None
        self._deferred: tuple[Pending, Future[Any], dict[str, Any]] | None = None
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
                    _local(buffer).zero_()  # the pages fault in here, not in the save's copy
                self.state_dict_cache, self._layout = buffers, layout
            except (RuntimeError, MemoryError) as err:  # the first save makes its buffers itself
                _log.warning("Could not reserve the CPU copy of an asynchronous sharded checkpoint: %s", err)

        self._reserving = threading.Thread(target=run, name="unison-ckpt", daemon=True)
        self._reserving.start()

    def stage(self, state_dict: dict[str, Any]) -> Any:
        """A CPU copy of ``state_dict`` in the kept buffers (new ones when its layout changed);
        a future of it where :attr:`later` left tensors to :meth:`deferred`."""
        if self._reserving is not None:
            self._reserving.join()
        later, self.later = self.later, None
        self._deferred = None
        layout = layout_of(state_dict)
        made = self.state_dict_cache is None or layout != self._layout
        if made:
            self.state_dict_cache = None  # the old buffers go before the new ones are made
            self.state_dict_cache = _buffers(state_dict)
            self._layout = layout
        pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        sources: list[tuple[str, torch.Tensor]] = []
        staged = _into(state_dict, self.state_dict_cache, pairs, sources, "")
        if made:  # new buffers hold no values yet: every tensor is copied at once
            later = None
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
        if not left:
            return staged
        names, watched = [n for n, _ in left_sources], [t for _, t in left_sources]
        self._deferred = (Pending(left, names, self.threads, watched), Future(), staged)
        return self._deferred[1]

    def deferred(self) -> tuple[Pending, Future[Any], dict[str, Any]] | None:
        """What the last :meth:`stage` left for later: the copy to take, the future DCP waits for
        (to be given the staged state once the copy is taken) and that state; None when nothing was."""
        deferred, self._deferred = self._deferred, None
        return deferred


def _buffers(state_dict: dict[str, Any]) -> dict[str, Any]:
    """New CPU buffers laid out as ``state_dict`` (DCP's helper: a DTensor's mesh and placements
    kept), pinned where CUDA is available; their values are not yet the state's."""
    from torch.distributed._state_dict_utils import _create_cpu_state_dict

    return _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor a copy reads or writes: a DTensor's local shard, any other tensor detached."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor.detach()  # type: ignore[attr-defined]


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
        pairs.append((_local(kept), _local(source)))
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
        local = obj.to_local() if is_dtensor(obj) else obj  # type: ignore[attr-defined]
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
    """None when this torch's copying helpers behave as :class:`KeptStaging` relies on (checked on a
    small state: a second staging copies into the first one's buffers), else what changed."""
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
