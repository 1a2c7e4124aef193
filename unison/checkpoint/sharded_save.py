"""The collective save of a sharded checkpoint: every rank's shards, then rank 0's rest, checksums and record.

It stands above the folder's parts (:mod:`unison.checkpoint.sharded`); every rank's checksums,
and its finite check of the shards it wrote, reach rank 0 with DCP's own gather of the write
results (:class:`~unison.checkpoint.dcp_files.RankFiles`). A folder a rank found a NaN or an
infinity in is removed and never takes its name: the newest checkpoint stays the last good one.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.entry import file_in
from unison.checkpoint.sharded import (
    dcp_states,
    finish_folder,
    sharded_names,
    temp_folder,
    write_shards,
)
from unison.checkpoint.sharded_files import remove
from unison.checkpoint.state import to_cpu_copy
from unison.checkpoint.verify import Verdict, skip_message
from unison.checkpoint.writer import listed, not_saved_message
from unison.distributed.primitives import get_rank
from unison.utils.logging import get_logger

_log = get_logger(__name__)

__all__ = ["background_group", "dcp_states", "reserve_staging", "save_sharded", "sharded_names"]
"""What a handler needs to save sharded states: which they are, their states, and the save."""


def background_group(writer: Any) -> Any:
    """Collective: the gloo group a background sharded save of ``writer`` gathers over (made once,
    on every rank together), or None when its saves are not asynchronous."""
    if not writer.async_save:
        return None
    if getattr(writer, "_gloo", None) is None:
        import torch.distributed as dist

        writer._gloo = dist.new_group(backend="gloo")
    return writer._gloo


def staging(writer: Any) -> Any:
    """The staging of ``writer``'s asynchronous sharded saves: CPU buffers kept from save to save
    (:class:`~unison.checkpoint.dcp_staging.KeptStaging`), made at its first use; None where this
    torch's buffer-making helper changed (``unison doctor``): each save then copies anew
    (:func:`dcp_copy`)."""
    from unison.checkpoint.dcp_staging import KeptStaging, staging_problem

    if staging_problem():
        return None
    if getattr(writer, "_staging", None) is None:
        writer._staging = KeptStaging()
    return writer._staging


def reserve_staging(writer: Any, states: Mapping[str, Any]) -> None:
    """Every rank, after the first iteration of a run whose saves are asynchronous: the buffers of
    its copy of ``states`` (:func:`~unison.checkpoint.sharded.dcp_states`) made in a thread
    (:meth:`KeptStaging.reserve <unison.checkpoint.dcp_staging.KeptStaging.reserve>`), so that
    the first save only copies, its optimizers' shards beside the next iteration as every later
    one's. Nothing where saves stage through DCP's own copy."""
    stager = staging(writer)
    if stager is not None:
        stager.reserve(dict(states))


def save_sharded(
    writer: Any,
    name: str,
    rest: dict[str, Any] | None,
    states: Mapping[str, Any],
    entry: Any,
    *,
    async_group: Any = None,
    later: Callable[[torch.Tensor], bool] | None = None,
) -> Path | None:
    """Collective: writes a sharded checkpoint folder ``name`` and records it (rank 0).

    Every rank writes its shards into a temporary folder; rank 0 then writes the rest,
    the checksums of every rank's files, renames the folder and records ``entry`` in the
    manifest (rotation follows, as for files).

    With ``async_group`` (a gloo group of every rank, made once for this), the shards are copied
    to CPU memory (:class:`~unison.checkpoint.dcp_staging.KeptStaging`; those ``later`` names
    are copied by the writer's thread) and the save returns; DCP's save of the copy (its
    collectives over that group) and rank 0's rename and record run in each rank's writer
    thread, which the next save and the end of the run wait for (``writer.wait()``).

    Args:
        writer: the :class:`~unison.checkpoint.writer.CheckpointWriter` (rank 0's records it).
        name: the folder's name, the same on every rank.
        rest: the checkpoint's other parts (rank 0); None elsewhere.
        states: this rank's sharded states (:func:`~unison.checkpoint.sharded.dcp_states`).
        entry: the manifest entry (rank 0); None elsewhere.
        async_group: write in the background, gathering over this group.
        later: with ``async_group``: the tensors only an optimizer's step changes (asked of each
            DTensor's local shard), which the writer's thread copies while training goes on; the
            step waits for that copy (:meth:`~unison.checkpoint.writer.CheckpointWriter.fence`). A
            rank that finds one of them changed in place before its copy was taken tells rank 0,
            which removes the folder and warns; later saves of that rank copy every tensor at once.

    Returns:
        The folder on rank 0 (recorded once written); None on other ranks, and on rank 0 when
        a rank found a NaN or an infinity in the shards it wrote (rank 0 warns, naming it, and
        removes the folder). An asynchronous save returns the folder before that is known.
    """
    final = file_in(writer.folder, name)
    tmp = temp_folder(final)
    if get_rank() == 0:  # a folder left by a save that died here: gone before any rank writes
        remove(tmp)
    # No barrier: DCP's writer makes the folder on every rank as it plans, and no rank writes a
    # byte before the plans are scattered, which rank 0 joins only after the removal above.

    def finish(written: Any, rest: Mapping[str, Any] | None) -> bool:
        """Rank 0: the folder finished, renamed and recorded; False where a rank's shards were not finite."""
        if written is None:  # not rank 0
            return False
        if written.changed is not None:
            remove(tmp)
            _log.warning(not_saved_message(final, written.changed))
            return False
        bad = written.not_finite if written.checked else _read_back_not_finite(tmp, states)
        if bad is not None:
            remove(tmp)
            _log.warning(skip_message(Verdict("not finite", bad), writer.manifest, entry.iteration))
            return False
        entry.size = finish_folder(
            tmp, final, rest or {}, {n: v for mine in written.files for n, v in mine.items()}
        )
        writer.record(entry, final)
        return True

    if async_group is None:
        return final if finish(write_shards(states, tmp), rest) else None
    from unison.checkpoint.dcp_files import results_problem

    stager = staging(writer)
    defer = stager is not None and later is not None and writer.overlap and not results_problem()
    handed: queue.SimpleQueue[Any] = queue.SimpleQueue()

    def in_background() -> None:
        got = handed.get()
        if got is None:  # the copy failed in the caller
            return
        staged, rest, later_copy = got
        changed: str | None = None
        error: BaseException | None = None
        if later_copy is not None:
            left, copied = later_copy
            try:
                moved = writer.take(left, copied)
                changed = listed(moved) if moved else None
            except BaseException as err:  # every rank still writes and gathers: rank 0 drops the folder
                changed, error = f"a copy that failed ({err})", err
        written = write_shards(staged, tmp, process_group=async_group, changed=changed)
        finish(written, rest)  # every rank's checksums, finite checks and copies, on rank 0
        if error is not None:
            raise error

    # The writer's thread starts before the copy's threads, which would contend for its start; it
    # waits for what this thread hands it, None where the copy failed here.
    writer.in_background(in_background)
    handoff = None
    try:
        staged = (
            stager.stage(dict(states), later if defer else None) if stager is not None else dcp_copy(states)
        )
        rest = to_cpu_copy(rest) if rest is not None else None  # training goes on changing the originals
        left = stager.deferred() if stager is not None else None
        handoff = (staged, rest, (left, writer.copy_later(left, final)) if left is not None else None)
    finally:
        handed.put(handoff)
    return final if get_rank() == 0 else None


def dcp_copy(states: Mapping[str, Any]) -> dict[str, Any]:
    """A CPU copy of ``states`` made anew by DCP's own staging (``BlockingAsyncStager``): where this
    torch's buffer-making helper changed (``unison doctor``)."""
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    return BlockingAsyncStager(cache_staged_state_dict=False, type_check=False).stage(dict(states))


def _read_back_not_finite(tmp: Path, states: Mapping[str, Any]) -> str | None:
    """Rank 0, where this torch withheld some rank's finite check from the write results: the
    first tensor of the folder written in ``tmp`` that holds a NaN or an infinity, each state
    loaded back whole."""
    from unison.checkpoint.safe_dcp import safe_load
    from unison.checkpoint.verify import first_non_finite

    whole: dict[str, Any] = {}
    safe_load(whole, tmp, keys=set(states), no_dist=True)
    return first_non_finite(whole)
