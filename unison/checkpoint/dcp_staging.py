"""The CPU copy an asynchronous sharded save writes: buffers kept from save to save.

``dcp.async_save`` copies the states it is given to CPU memory before it returns (its staging),
so that training may change them while a thread writes the copy. Its default staging allocates
that copy anew at every save: measured here at 1 GB and 2 ranks, 757 ms of a 775 ms stall went
to it (the pages of fresh memory fault in as they are first written), longer than a whole
synchronous save. :class:`KeptStaging` keeps the copy of the first save and copies each later
save's states into it (as :class:`~unison.checkpoint.snapshot.Snapshot` does for a checkpoint
file), making a new one only when the states' layout changed: a tensor's shape, dtype, device,
local shard or placements, or a key. It keeps DCP's own way of copying, which knows DTensors
(a shard copied, its mesh and placements kept): ``torch.distributed._state_dict_utils``'s
``_create_cpu_state_dict`` and ``_copy_state_dict``, behind DCP's public ``BlockingAsyncStager``
(whose own cache pins its memory, which a CPU-only torch cannot do). ``unison doctor`` checks
that they still copy into the kept buffers.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.staging import BlockingAsyncStager

from unison.distributed.fsdp import is_dtensor

__all__ = ["KeptStaging", "layout_of", "staging_problem"]


class KeptStaging(BlockingAsyncStager):
    """DCP's blocking staging (``dcp.async_save(..., async_stager=...)``) into CPU buffers kept from
    one save to the next; kept by the checkpoint's writer, which lets one save write at a time (the
    next save's copy overwrites the buffers the previous one wrote from)."""

    def __init__(self) -> None:
        super().__init__(cache_staged_state_dict=False, type_check=False)
        self._layout: Any = None

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A CPU copy of ``state_dict`` in the kept buffers (new ones when its layout changed)."""
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        layout = layout_of(state_dict)
        if self.state_dict_cache is None or layout != self._layout:
            self.state_dict_cache = None  # the old buffers go before the new ones are made
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            self._layout = layout
        return _copy_state_dict(state_dict, self.state_dict_cache, type_check=False)


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
