"""The checkpoint's ``data`` entry: each rank's own data state, for sources that keep one.

A map-style loader with a TrainSampler has one global position (the ``sampler`` entry,
:mod:`unison.checkpoint.positions`). A source of kind ``"stateful"``
(:func:`unison.distributed.data_state.data_position`: torchdata's ``StatefulDataLoader``, a
Hugging Face streaming dataset) keeps its position itself: every rank's state is gathered to
rank 0 with the other per-rank states of a save, stored by rank, and each rank loads its own
before its data iterator is made: one user of the per-rank contract of
:mod:`unison.checkpoint.per_rank` (the same gather, entry and loading as a handler's per-rank state). A state of scope ``"global"`` (a ``shard_stream`` without
loader workers: every rank's counts the same source items) is the same on every rank; when it
is elastic, a run at another world size loads it on every rank. No collective here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn
from torch.utils.data import DataLoader, Dataset

from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.per_rank import load_own, rank_entry
from unison.distributed.data_state import DataPosition, data_position
from unison.distributed.primitives import get_world_size
from unison.utils.logging import get_logger

_log = get_logger(__name__)


def refuse_data_objects(to_save: Mapping[str, Any]) -> None:
    """Refuses a loader or a dataset in ``to_save``, under any name, and any object named ``data``.

    A loader in ``to_save`` (torchdata documents ``to_save={"data": loader}``) would be saved
    from rank 0 for every rank; the checkpoint saves the trainer's data state itself, each
    rank's own, in its ``data`` entry, which is why that name is taken.

    Raises:
        ValueError: naming the entry and its type, and what to do.
    """
    for name, obj in to_save.items():
        if not isinstance(obj, nn.Module) and (
            isinstance(obj, (DataLoader, Dataset)) or data_position(obj).kind == "stateful"
        ):
            raise ValueError(
                f"Checkpoint(to_save={{{name!r}: ...}}): a {type(obj).__name__} is training data, and the checkpoint "
                "already saves the trainer's data state itself for every rank, each rank's own (the position of "
                "its sampler, or the state of a StatefulDataLoader or a stream with state_dict()), and puts it "
                "back on resume. An object in to_save is saved from rank 0 for every rank, so each rank would "
                "resume at rank 0's data: leave it out of to_save."
            )
        if name == "data":
            raise ValueError(
                f"Checkpoint(to_save={{'data': ...}}): 'data' names the checkpoint's entry for each rank's data "
                "state (the trainer's data position, saved for every rank without being listed); give this "
                f"{type(obj).__name__} another name."
            )


def mid_epoch_refusal(position: DataPosition, why: str) -> str:
    """The error for mid-epoch checkpoints of data whose position cannot be told; ``why`` names the cause."""
    return (
        f"{why}: mid-epoch checkpoints need to know where the training data stands, and a {position.source} "
        f"cannot tell, so a resume would replay part of the epoch and never train the rest. Fix: {position.fix}; "
        "or save at epoch ends only (Checkpoint(every_iters=None, every_seconds=None), without Preemption)."
    )


def mid_epoch_cause(checkpoint: Any, engine: Any) -> str | None:
    """What makes ``checkpoint`` (a Checkpoint handler) save inside an epoch, for a refusal's
    message: its ``every_iters`` or ``every_seconds``, or a Preemption of it on the engine's
    sync point; None for saves at epoch ends only."""
    if checkpoint.every_iters is not None:
        return f"Checkpoint(every_iters={checkpoint.every_iters})"
    if getattr(checkpoint, "every_seconds", None) is not None:
        return f"Checkpoint(every_seconds={checkpoint.every_seconds})"
    sync_point = getattr(engine, "sync_point", None)
    contributors = sync_point.contributors() if sync_point is not None else []
    if any(getattr(c, "checkpoint", None) is checkpoint for c in contributors):
        return "Preemption (it saves at whatever iteration the signal arrives)"
    return None


class DataEntry:
    """Follows the trainer's data source through a run, for the checkpoint's ``data`` entry.

    The Checkpoint handler calls :meth:`run_started` at ``STARTED``, :meth:`local` on every
    rank of a save (the result is gathered), :meth:`entry` on rank 0 with every rank's,
    :meth:`check` at resume and :meth:`load` at ``STARTED`` of a resumed run.
    """

    def __init__(self) -> None:
        self.position: DataPosition | None = None

    def run_started(self, data: Any, *, refuse_mid_epoch: str | None = None) -> DataPosition:
        """Asks the data where it stands; with ``refuse_mid_epoch`` (the cause of mid-epoch saves,
        for the message), refuses a source that cannot tell.

        Raises:
            ValueError: a mid-epoch save is due and the source is of kind ``"none"``.
        """
        self.position = data_position(data)
        if refuse_mid_epoch and data is not None and not self.position.reports:
            raise ValueError(mid_epoch_refusal(self.position, refuse_mid_epoch))
        return self.position

    def local(self) -> Any:
        """This rank's state (kind ``"stateful"``), else None: what a save gathers."""
        if self.position is None or self.position.save is None:
            return None
        return self.position.save()

    def entry(self, by_rank: list[Any], world_size: int) -> dict[str, Any] | None:
        """The ``data`` entry of a checkpoint from every rank's :meth:`local`; None for other kinds."""
        position = self.position
        if position is None or position.kind != "stateful":
            return None
        return rank_entry(
            by_rank,
            world_size,
            kind=position.kind,
            source=position.source,
            scope=position.scope,
            elastic=position.elastic,
            not_elastic=position.not_elastic,
        )

    def load(self, entry: Mapping[str, Any] | None, rank: int, *, mid_epoch: bool, source: str) -> None:
        """Puts this rank's saved state back, before the data iterator is made.

        Raises:
            CheckpointError: the checkpoint's data state is another source's.
        """
        position = self.position
        if position is None or position.kind != "stateful":
            if entry is not None:
                raise CheckpointError(
                    f"Checkpoint {source} holds the data state of a {entry['source']}, but this run trains on "
                    f"{'no data' if position is None else position.source}. Resume with the same training data."
                )
            return
        if entry is None:
            if mid_epoch:
                _log.warning(
                    "Checkpoint %s was taken mid-epoch without the state of the training data (%s): the data "
                    "starts again from its beginning.",
                    source,
                    position.source,
                )
            return
        if entry["source"] != position.source:
            raise CheckpointError(
                f"Checkpoint {source} holds the data state of a {entry['source']}; this run's training data is "
                f"a {position.source}. Resume with the same kind of training data."
            )
        by_rank, world = entry["by_rank"], get_world_size()
        elastic = position.scope == "global" and position.elastic
        if world != len(by_rank) and not elastic:
            # The checkpoint's global position (check_data_entry let it through) meets data that
            # keeps one per rank: decided from the loader's settings, the same on every rank.
            raise CheckpointError(
                f"Checkpoint {source} holds a global position in a {entry['source']} saved at world size "
                f"{len(by_rank)}; this run has world size {world}, and its training data keeps a position per "
                f"rank ({position.not_elastic or position.source}). Resume with {len(by_rank)} ranks, or read "
                "the stream as the saving run did."
            )
        if position.load is None or not by_rank:
            return
        load = position.load  # a global position is the same for every rank: any world size continues from it
        load_own(
            entry, rank, world, load=load, reshard=(lambda states, *_: load(states[0])) if elastic else None
        )


def check_data_entry(entry: Mapping[str, Any] | None, *, source: str, world_size: int) -> None:
    """At resume, before anything is loaded: a per-rank data state continues at its world size only.

    Raises:
        CheckpointError: naming both world sizes and the data source.
    """
    if entry is None or entry.get("elastic") or entry["world_size"] == world_size:
        return
    why = f" Not elastic because {entry['not_elastic']}." if entry.get("not_elastic") else ""
    raise CheckpointError(
        f"Checkpoint {source} holds each rank's position in a {entry['source']} saved at world size "
        f"{entry['world_size']}; this run has world size {world_size}. A per-rank data position cannot be "
        f"divided among other ranks: resume with {entry['world_size']} ranks, or start the run afresh.{why}"
    )
