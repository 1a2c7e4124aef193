"""What a checkpoint needs from every rank: gathered states, and answers rank 0 gives them all."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch.distributed as dist

from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.lock import Claim, hold_folder
from unison.checkpoint.manifest import Manifest
from unison.checkpoint.sharded_check import Problem, checkpoint_verdict, sharded_verdict
from unison.checkpoint.verify import Verdict, vet
from unison.distributed.packed import packed, unpacked
from unison.distributed.primitives import broadcast_object, get_rank, get_world_size, is_distributed


def gather_on_first(mine: Any) -> list[Any] | None:
    """Collective: call on every rank. Every rank's ``mine`` on rank 0, by rank; None elsewhere."""
    if not is_distributed():
        return [mine]
    everyone: list[Any] | None = [None] * get_world_size() if get_rank() == 0 else None
    dist.gather_object(packed(mine), everyone, dst=0)  # small CPU tensors (RNG states) as bytes
    return [unpacked(theirs) for theirs in everyone] if everyone is not None else None


def open_folder(manifest: Manifest, *, require_empty: bool) -> Claim:
    """Collective: rank 0 holds the folder (:mod:`unison.checkpoint.lock`) and rebuilds its manifest;
    every rank gets its answer.

    Returns:
        The claim on the folder (rank 0's lock; nothing held elsewhere).

    Raises:
        FolderInUseError: on every rank, when another process holds the folder.
        FileExistsError: on every rank, with ``require_empty`` and a folder that holds
            checkpoints.
    """
    claim = hold_folder(manifest.folder)  # before the rebuild, which removes temp files
    problem = None
    if get_rank() == 0:
        manifest.rebuild()
        if require_empty and manifest.entries:
            problem = (
                f"Checkpoint(require_empty=True): {manifest.folder} already holds {len(manifest.entries)} "
                "checkpoint(s). Choose a new folder, remove them, or resume from them."
            )
    problem = broadcast_object(problem)
    if problem:
        claim.release()
        raise FileExistsError(problem)
    return claim


def choose(manifest: Manifest, which: str | os.PathLike[str]) -> str | None:
    """Collective: the file to resume from, chosen on rank 0 and shared.

    With ``"auto"`` at several ranks, rank 0 walks the checkpoints from the newest and every rank
    checks a share of each sharded candidate's files (:func:`sharded_verdict`'s ``share``): a
    rank reads 1/N of the folder, whatever the world size, where rank 0 alone read it all. A
    file checkpoint is checked by rank 0 (its check is its load).

    Args:
        manifest: the folder's manifest.
        which: ``"auto"`` for the newest complete checkpoint (None when there is none), or a path.

    Raises:
        CheckpointError: on every rank, when rank 0 finds checkpoints it cannot read.
    """
    if which == "auto" and is_distributed() and get_world_size() > 1:
        return _newest_checked_together(manifest)
    choice, problem = None, None
    if get_rank() == 0:
        try:
            newest = manifest.rebuild().newest_complete() if which == "auto" else which
            choice = None if newest is None else str(newest)
        except CheckpointError as err:
            problem = str(err)
    choice, problem = broadcast_object((choice, problem))
    if problem is not None:
        raise CheckpointError(problem)
    return choice


def _newest_checked_together(manifest: Manifest) -> str | None:
    """Collective: :meth:`Manifest.newest_complete` on rank 0, each sharded candidate checked by every
    rank, a share each. Rank 0 sends every rank each candidate (and whether it is sharded) and
    gathers their verdicts, then sends its choice; the others follow until it does."""
    rank, world = get_rank(), get_world_size()
    if rank != 0:
        while True:
            kind, path, problem = broadcast_object(None)
            if kind == "check":  # a sharded candidate: this rank's share of its files
                gather_on_first(_share(Path(path), rank, world))
                continue
            if problem is not None:
                raise CheckpointError(problem)
            return path

    def verdict(path: Path) -> Problem | None:
        if not path.is_dir():
            return checkpoint_verdict(path)  # a file: read whole here, kept for the load
        broadcast_object(("check", str(path), None))
        found = gather_on_first(_share(path, 0, world)) or []
        return next((p for p in found if p is not None), None)

    try:
        newest = manifest.rebuild().newest_complete(verdict=verdict)
        outcome: tuple[str, str | None, str | None] = ("done", None if newest is None else str(newest), None)
    except CheckpointError as err:
        outcome = ("done", None, str(err))
    except BaseException as err:  # the other ranks must not wait for a candidate that never comes
        broadcast_object(
            ("done", None, f"rank 0 failed while choosing a checkpoint: {type(err).__name__}: {err}")
        )
        raise
    broadcast_object(outcome)
    if outcome[2] is not None:
        raise CheckpointError(outcome[2])
    return outcome[1]


def _share(folder: Path, rank: int, world: int) -> Problem | None:
    """This rank's verdict on its share of a sharded folder. A check that raises (a file this rank
    may not read, a read error) is a problem that stops the choice, as the error would in one
    process, and every rank still reaches the gather."""
    try:
        return sharded_verdict(folder, share=(rank, world))
    except Exception as err:
        return Problem(f"checking it failed on rank {rank} ({type(err).__name__}: {err})", unreadable=True)


def summed_over_ranks(per_rank: list[list[list[float]] | None]) -> list[list[float]] | None:
    """Element-wise sums over ranks of each rank's partial sums (None at an epoch boundary).

    Example:
        >>> summed_over_ranks([[[1.0, 2.0]], [[3.0, 4.0]]])
        [[4.0, 6.0]]
    """
    if not per_rank or per_rank[0] is None:
        return None
    return [[sum(column) for column in zip(*rows, strict=True)] for rows in zip(*per_rank, strict=True)]


def agreed_verdict(
    state: dict[str, Any] | None, problem: Exception | None, *, finite: bool = True
) -> tuple[dict[str, Any] | None, Verdict | None]:
    """Collective: rank 0 checks what it collected (``verify.vet``); every rank gets rank 0's
    verdict. With ``finite=False`` rank 0 leaves its state's weights unchecked (its writer checks
    them as it writes).

    Returns:
        The state with plain values (rank 0; None elsewhere), and None or the reason not
        to write it, the same on every rank.
    """
    state, verdict = vet(state, problem, finite=finite)
    return state, broadcast_object(verdict)
