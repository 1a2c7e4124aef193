"""Loading a checkpoint's states into a run's objects, whichever way each side is sharded.

A single-file checkpoint holds whole states; a sharded one (:mod:`unison.checkpoint.sharded`)
holds some states as shards in a Distributed Checkpoint. A run may load either into plain,
DDP or sharded objects: whole states go into sharded objects by cutting them into this
rank's shards, and shards are read into whatever the run holds, at any world size.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unison.checkpoint.attached import PREFIX, load_attached
from unison.checkpoint.per_rank import check_rank_objects, load_rank_objects
from unison.checkpoint.sharded import load_dcp_states, load_full_states, sharded_names
from unison.checkpoint.state import load_object_states
from unison.distributed.primitives import get_rank, get_world_size


def load_states(
    objects: Mapping[str, Any], state: Mapping[str, Any], source: Path, to_save: Mapping[str, Any]
) -> None:
    """Collective: call on every rank. Loads a checkpoint's states into ``objects``.

    Args:
        objects: name -> object: the handlers attached to the trainer and ``to_save``.
        state: the checkpoint's dict (a sharded checkpoint's ``rest.pt``).
        source: the checkpoint file or sharded folder, where the shards are read.
        to_save: the objects the user listed (already checked to be in the checkpoint).

    Raises:
        CheckpointError: before anything is loaded, on every rank alike, for a per-rank state
            (:mod:`unison.checkpoint.per_rank`) that cannot continue at this world size.
    """
    ranked = check_rank_objects(objects, state, source=str(source), world_size=get_world_size())
    in_shards = [n for n in state["meta"].get("sharded", []) if n in objects]
    saved = state["objects"]
    load_rank_objects(objects, saved, ranked, get_rank(), get_world_size())  # each rank its own
    saved = {n: v for n, v in saved.items() if n not in ranked}
    objects = {n: o for n, o in objects.items() if n not in ranked}
    to_save = {n: o for n, o in to_save.items() if n not in ranked}
    sharded_now = set(sharded_names(objects))
    whole_into_shards = [n for n in objects if n in saved and n in sharded_now]
    listed = {n: o for n, o in to_save.items() if n not in in_shards and n not in sharded_now}
    load_object_states(listed, saved)
    attached = {
        n: o
        for n, o in objects.items()
        if n.startswith(PREFIX) and n not in to_save and n not in in_shards and n not in sharded_now
    }
    load_attached(attached, {n: v for n, v in saved.items() if n not in whole_into_shards})
    if whole_into_shards:
        load_full_states(objects, saved, whole_into_shards)
    if in_shards:
        load_dcp_states(source, objects, in_shards)
