"""Run folders: a new one made atomically (two runs started in the same second never share one),
and an early refusal of a folder another job holds."""

from __future__ import annotations

import itertools
from pathlib import Path

from unison.checkpoint.lock import FolderInUseError, FolderLock


def new_run_folder(root: Path, stamp: str) -> Path:
    """Makes and returns ``root/<stamp>``, or ``<stamp>-1``, ``<stamp>-2``... when that is taken.

    ``mkdir`` either makes the folder or fails because it exists, so of two runs that pick
    the same name at once, one moves on to the next.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> [new_run_folder(root, "20250101-120000").name for _ in range(3)]
        ['20250101-120000', '20250101-120000-1', '20250101-120000-2']
    """
    root.mkdir(parents=True, exist_ok=True)
    for n in itertools.count():
        folder = root / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise AssertionError("unreachable")  # pragma: no cover - itertools.count() never ends


def refuse_if_held(found: tuple[Path, str] | None, error: type[Exception]) -> None:
    """Raises ``error`` (with the holder named) when another process holds the run folder of
    ``found`` (what :func:`~unison.recipe.runner.previous_run` found; None: a fresh run) now.

    Called before unison spawns the ranks (never under torchrun or srun, whose ranks would
    probe at once), so a run that cannot get its folder fails before any rank starts. The
    lock is given back at once: rank 0 of the job takes it (:func:`unison.checkpoint.lock.hold_folder`).
    """
    if found is None:
        return
    try:
        FolderLock(found[0]).release()
    except FolderInUseError as err:
        raise error(str(err)) from None
