"""The collective save of a sharded checkpoint: every rank's shards, then rank 0's rest, checksums and record.

It stands above the folder's parts (:mod:`unison.checkpoint.sharded`); every rank's checksums
reach rank 0 with DCP's own gather of the write results (:class:`~unison.checkpoint.dcp_files.RankFiles`).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unison.checkpoint.disk_full import unwritten
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
from unison.distributed.primitives import get_rank

__all__ = ["background_group", "dcp_states", "save_sharded", "sharded_names"]
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


def save_sharded(
    writer: Any,
    name: str,
    rest: dict[str, Any] | None,
    states: Mapping[str, Any],
    entry: Any,
    *,
    async_group: Any = None,
) -> Path | None:
    """Collective: writes a sharded checkpoint folder ``name`` and records it (rank 0).

    Every rank writes its shards into a temporary folder; rank 0 then writes the rest,
    the checksums of every rank's files, renames the folder and records ``entry`` in the
    manifest (rotation follows, as for files).

    With ``async_group`` (a gloo group of every rank, made once for this), DCP copies the
    shards to CPU memory and returns; the writing (its collectives over that group) and rank
    0's rename and record run in each rank's writer thread, which the next
    save and the end of the run wait for (``writer.wait()``).

    Args:
        writer: the :class:`~unison.checkpoint.writer.CheckpointWriter` (rank 0's records it).
        name: the folder's name, the same on every rank.
        rest: the checkpoint's other parts (rank 0); None elsewhere.
        states: this rank's sharded states (:func:`~unison.checkpoint.sharded.dcp_states`).
        entry: the manifest entry (rank 0); None elsewhere.
        async_group: write in the background, gathering over this group.

    Returns:
        The folder on rank 0 (recorded once written); None on other ranks.
    """
    final = file_in(writer.folder, name)
    tmp = temp_folder(final)
    if get_rank() == 0:  # a folder left by a save that died here: gone before any rank writes
        remove(tmp)
    # No barrier: DCP's writer makes the folder on every rank as it plans, and no rank writes a
    # byte before the plans are scattered, which rank 0 joins only after the removal above.

    def finish(checksums: list[dict[str, tuple[int, int]]] | None, rest: Mapping[str, Any] | None) -> None:
        if checksums is None:  # not rank 0
            return
        entry.size = finish_folder(
            tmp, final, rest or {}, {n: v for mine in checksums for n, v in mine.items()}
        )
        writer.record(entry, final)

    if async_group is None:
        finish(write_shards(states, tmp), rest)
        return final if get_rank() == 0 else None
    import torch.distributed.checkpoint as dcp

    from unison.checkpoint.dcp_files import DirectWriter

    storage = DirectWriter(tmp)  # O_DIRECT, each file checksummed as it is written
    pending = dcp.async_save(dict(states), storage_writer=storage, process_group=async_group)
    rest = to_cpu_copy(rest) if rest is not None else None  # training goes on changing the originals

    def in_background() -> None:
        done: Any = getattr(pending, "upload_completion", pending)  # a Future, or a response holding one
        try:
            done.result()
        except BaseException as err:
            if (error := unwritten(err, tmp, states)) is err:
                raise
            raise error from err
        finish(storage.gathered(), rest)  # every rank's checksums, on rank 0

    writer.in_background(in_background)
    return final if get_rank() == 0 else None
