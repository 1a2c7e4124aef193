"""Per-rank state: one contract for every object whose state is its rank's own.

Most of what a checkpoint holds is the same on every rank (the weights, the optimizer, an
early-stopping counter) and is saved from rank 0. Some state is each rank's own: the position
of a stream each rank reads apart, an RNN's hidden state carried from batch to batch. An object
says so with a class attribute::

    class HiddenState:
        per_rank_state = True

        def state_dict(self): ...
        def load_state_dict(self, state): ...

        # optional: how to continue at another world size
        def load_state_dict_resharded(self, states: list, rank: int, world_size: int): ...

At a save every rank's ``state_dict()`` rides to rank 0 in the gather that a save makes
anyway (generator states, data positions): no collective of its own. The checkpoint stores
one *rank entry* per object, ``{"world_size": W, "by_rank": [state of rank 0, ...]}``, and
lists the names in ``meta["per_rank"]``. At a resume at the same world size each rank loads
its own state; at another, the object's ``load_state_dict_resharded(states, rank, world_size)``
decides (it gets every saved rank's state), and an object without one refuses the resume on
every rank, naming it, before anything is loaded.

The training data's own state (:class:`~unison.checkpoint.data_entry.DataEntry`, the
checkpoint's ``data`` entry) is one user of this contract: it rides the same gather under the
name ``data``, is stored as a rank entry (with what kind of data it is) and is put back by
:func:`load_own`, its resharding decided by whether its position is global.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from unison.checkpoint.checkpoint_error import CheckpointError

ATTRIBUTE = "per_rank_state"
"""The attribute an object sets to True when its state is its rank's own."""

RESHARD = "load_state_dict_resharded"
"""The method that decides how per-rank states continue at another world size."""

DATA = "data"
"""The name the training data's state rides the gather under (the checkpoint's ``data`` entry)."""


def is_per_rank(obj: Any) -> bool:
    """Whether ``obj`` declares its state per rank (``per_rank_state = True``)."""
    return getattr(obj, ATTRIBUTE, False) is True


def per_rank_names(objects: Mapping[str, Any]) -> list[str]:
    """The names of the objects of ``objects`` whose state is per rank, in order."""
    return [name for name, obj in objects.items() if is_per_rank(obj)]


def local_states(objects: Mapping[str, Any], data: Any = None) -> dict[str, Any]:
    """This rank's part of a save's gather: the data's state (under ``data``) and each per-rank
    object's ``state_dict()``."""
    mine = {name: objects[name].state_dict() for name in per_rank_names(objects)}
    return {DATA: data, **mine}


def rank_entry(by_rank: list[Any], world_size: int, **about: Any) -> dict[str, Any]:
    """The entry a checkpoint stores for one per-rank state: every rank's, by rank, with the world
    size it was saved at and, in ``about``, what the state is (the data's kind and source)."""
    return {**about, "world_size": world_size, "by_rank": list(by_rank)}


def rank_entries(gathered: list[Mapping[str, Any]], world_size: int) -> dict[str, dict[str, Any]]:
    """Rank 0, after the gather: one :func:`rank_entry` per object from every rank's
    :func:`local_states` (the data's left out: :class:`~unison.checkpoint.data_entry.DataEntry`
    makes its own entry)."""
    names = [name for name in gathered[0] if name != DATA] if gathered else []
    return {name: rank_entry([mine[name] for mine in gathered], world_size) for name in names}


def load_own(
    entry: Mapping[str, Any],
    rank: int,
    world_size: int,
    *,
    load: Callable[[Any], None],
    reshard: Callable[[list[Any], int, int], None] | None,
) -> None:
    """Puts rank ``rank``'s state of ``entry`` back: ``load(its own state)`` at the saved world size,
    else ``reshard(every saved rank's state, rank, world_size)``.

    Raises:
        CheckpointError: another world size and no ``reshard`` (the callers refuse earlier, naming
            the object).
    """
    by_rank = list(entry["by_rank"])
    if world_size == len(by_rank):
        load(by_rank[rank])
    elif reshard is not None:
        reshard(by_rank, rank, world_size)
    else:
        raise CheckpointError(f"per-rank state saved at world size {len(by_rank)}; this run has {world_size}")


def check_rank_objects(
    objects: Mapping[str, Any], state: Mapping[str, Any], *, source: str, world_size: int
) -> list[str]:
    """At a resume, before anything is loaded: the per-rank entries of ``state`` fit this run.

    Returns:
        The names of the objects to load per rank.

    Raises:
        CheckpointError: on every rank alike, for an entry that is not one state per saving rank,
            or saved at another world size for an object without ``load_state_dict_resharded``.
    """
    names = [n for n in state["meta"].get("per_rank", []) if n in objects]
    for name in names:
        entry = state["objects"][name]
        by_rank = entry.get("by_rank") if isinstance(entry, Mapping) else None
        saved = entry.get("world_size") if isinstance(entry, Mapping) else None
        if not isinstance(by_rank, list) or saved != len(by_rank) or saved != state["meta"]["world_size"]:
            raise CheckpointError(
                f"Checkpoint {source}: objects.{name} is listed as per-rank state but holds no state per saving "
                f"rank (expected {{'world_size': {state['meta']['world_size']}, 'by_rank': [one state per "
                "rank]}): the file is damaged or was not written by unison. Resume from another checkpoint."
            )
        obj = objects[name]
        if saved != world_size and not callable(getattr(obj, RESHARD, None)):
            raise CheckpointError(
                f"Checkpoint {source} holds each rank's own state of {name} (a {type(obj).__name__}, "
                f"{ATTRIBUTE} = True) saved at world size {saved}; this run has world size {world_size}, and "
                f"{type(obj).__name__} defines no {RESHARD}(states, rank, world_size) to decide how its "
                f"per-rank state continues at another world size. Resume with {saved} ranks, define "
                f"{RESHARD} on {type(obj).__name__}, or start the run afresh."
            )
    return names


def load_rank_objects(
    objects: Mapping[str, Any], saved: Mapping[str, Any], names: list[str], rank: int, world_size: int
) -> None:
    """Loads each named object's per-rank state (:func:`load_own`): its own rank's, or through its
    ``load_state_dict_resharded`` at another world size (checked by :func:`check_rank_objects`)."""
    for name in names:
        obj = objects[name]
        load_own(saved[name], rank, world_size, load=obj.load_state_dict, reshard=getattr(obj, RESHARD, None))
