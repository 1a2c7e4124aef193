"""Run folders: a new one made atomically (two runs started in the same second never share one),
an early refusal of a folder another job holds, and of one whose entries are links, and the
command that continues a run.

A run folder is data: one from elsewhere (a tarball, a colleague's copy, a group-writable run
root that ``--resume auto`` searches) may hold symbolic links or special files where unison
writes. :func:`refuse_unsafe` checks every entry unison writes (:data:`RUN_FILES`,
:data:`RUN_FOLDERS`, anything inside :data:`DEEP_FOLDERS`) before any rank starts; the writers
themselves never follow a link either (:mod:`unison.utils.run_files`).
"""

from __future__ import annotations

import itertools
import os
import shlex
from pathlib import Path

from unison.checkpoint.lock import LOCK_FILE, FolderInUseError, FolderLock
from unison.config.origin import Origin
from unison.utils.run_files import unsafe_entries

RUN_MARKER = ".unison-run"
"""The file that marks a folder as a unison run folder (written when the run is created)."""

JOB_RECORD = "job.json"
"""The file in a run folder that names the job owning it."""

RUN_FILES = (
    LOCK_FILE,
    RUN_MARKER,
    JOB_RECORD,
    "config.yaml",
    "metrics.json",
    "history.jsonl",
    "changes-on-resume.jsonl",
    "predictions.pt",
    "mlflow-run.json",
    "wandb-run.json",
)
"""The files unison writes at the top of a run folder: each must be a regular file, when present."""

RUN_FOLDERS = ("checkpoints", "logs", "tb", "wandb")
"""The folders unison writes into: each must be a real directory, when present."""

DEEP_FOLDERS = ("checkpoints", "logs", "tb")
"""The folders whose every entry unison writes (``wandb/`` holds W&B's own links)."""


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
    ``found`` (what :func:`~unison.recipe.folder.run_choice.previous_run` found; None: a fresh run) now.

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


def refuse_unsafe(run_dir: Path, error: type[Exception]) -> None:
    """Raises ``error``, naming every entry, when the run folder ``run_dir`` is a link or holds a
    link or a special file where unison writes (see the module's notes); called before any rank starts.
    """
    found = unsafe_entries(run_dir, RUN_FILES, RUN_FOLDERS, DEEP_FOLDERS)
    if found:
        raise error(
            f"the run folder {run_dir} cannot be resumed: " + "; ".join(found) + ". unison writes these "
            "entries in place and never through a link, so that a run folder from elsewhere (a tarball, a "
            "colleague's copy, a shared run root) cannot make it overwrite or append to the files they point "
            "to. Remove them (or put real files and folders in their place), or start a new run (leave out "
            "--resume)."
        )


def resume_command(origin: Origin, run_dir: Path, main: Path | None = None) -> str:
    """The command that continues the run in ``run_dir``: ``unison run CONFIG [--set ...] [--main
    SCRIPT] --resume RUN_DIR``, its config file made absolute and every item shell-quoted; the
    ``--set`` items are the ones the run was given (a resume compares its config with the saved one).
    For a config built in Python (no file), the call of :func:`~unison.recipe.run` instead.

    Example:
        >>> resume_command(Origin(file="my runs/c.yaml", overrides={("a",): "a=1"}), Path("/r/x"))[:11]
        'unison run '
        >>> resume_command(Origin(), Path("/r/x"))
        "unison.recipe.run(<the same config>, resume='/r/x')"
    """
    if origin.file is None:
        return f"unison.recipe.run(<the same config>, resume={str(run_dir)!r})"
    argv = ["unison", "run", os.path.abspath(origin.file)]
    for text in origin.overrides.values():
        argv += ["--set", text]
    if main is not None:
        argv += ["--main", os.path.abspath(main)]
    return shlex.join([*argv, "--resume", os.path.abspath(run_dir)])
