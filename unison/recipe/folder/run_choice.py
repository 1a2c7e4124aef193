"""Which run folder a rank trains in: a new one, or the run a ``--resume`` continues; its log file.

- :func:`previous_run`: the run a ``resume`` names (``auto``, a checkpoint, a run folder), read
  from the filesystem before any rank is spawned;
- :func:`choose_run_dir`: on every rank, rank 0's choice (a new folder, the job's own run under
  torchrun with an id, or the one resumed), broadcast;
- :func:`file_logging`: the ``unison`` logger's records copied to ``<run>/logs/rank<N>.log``.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from unison.distributed import broadcast_object, get_rank
from unison.recipe.folder.job_run import job_previous_run, new_job_run, run_job
from unison.recipe.folder.run_folder import RUN_MARKER, new_run_folder, refuse_unsafe
from unison.utils import get_logger
from unison.utils.logging import RunLogHandler
from unison.utils.run_files import real_folder

_log = get_logger("unison.recipe.run")  # the run's logger


class ResumeError(ValueError):
    """A ``--resume`` that names no run to continue; raised before any rank is spawned."""


def is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` is a unison run folder: it has the marker, or a checkpoint manifest."""
    return (folder / RUN_MARKER).is_file() or (folder / "checkpoints" / "manifest.json").is_file()


def previous_run(run_root: Path, resume: str | None) -> tuple[Path, str] | None:
    """The run a ``resume`` continues, and what to resume it from; None for a fresh run.

    ``run_root`` is the folder of the config's runs (``plan.run_root``: ``<root>/<name>``).
    ``"auto"``: the newest run under it with a checkpoint manifest (None when
    there is none); a checkpoint file inside a run folder (``<run>/checkpoints/<file>``); or
    a run folder. Reads the filesystem only, so it runs before any rank is spawned.

    Raises:
        ResumeError: when ``resume`` names a path that does not exist, or one that is not in
            a unison run folder (a run is never resumed, and nothing is written, elsewhere).
    """
    if resume is None:
        return None
    if resume == "auto":
        previous = sorted(run_root.glob("*/checkpoints/manifest.json"), key=_run_order)
        return (previous[-1].parent.parent, "auto") if previous else None
    target = Path(resume)
    expected = "a checkpoint (<run>/checkpoints/<name>.pt, or a sharded <name>.dcp), a run folder, or 'auto'"
    if not target.exists():
        raise ResumeError(f"--resume {resume}: no such file or folder. Give {expected}.")
    if target.is_file() or target.suffix == ".dcp":  # a checkpoint file, or a sharded checkpoint's folder
        run_dir = target.parent.parent
        if target.parent.name != "checkpoints" or not is_run_dir(run_dir):
            raise ResumeError(
                f"--resume {resume}: this checkpoint is not in a unison run folder (<run>/checkpoints/<name>, the "
                f"run holding {RUN_MARKER} or checkpoints/manifest.json), so there is no run to continue and "
                f"nothing may be written beside it. Give {expected}."
            )
        return run_dir, str(target)
    for run_dir in (target, target.parent):
        if is_run_dir(run_dir) and (run_dir == target or target.name == "checkpoints"):
            return run_dir, "auto"
    raise ResumeError(
        f"--resume {resume}: this folder is not a unison run folder (it holds neither {RUN_MARKER} nor "
        f"checkpoints/manifest.json). Give {expected}."
    )


def choose_run_dir(run_root: Path, resume: str | None) -> tuple[Path, str | None]:
    """Rank 0 picks the run directory under ``run_root`` (``<root>/<name>``) and the checkpoint to
    resume; every rank gets it.

    Distributed:
        Collective (a broadcast): call on every rank.
    """
    choice: tuple[str, str | None] | str | None = None
    if get_rank() == 0:
        root = run_root
        job = run_job(resume)  # under torchrun with an id: the job's own run, restarts resume it
        found = previous_run(root, resume) if job is None else job_previous_run(root, job, explain=True)
        if found is not None:
            try:
                refuse_unsafe(found[0], ResumeError)  # checked before spawning too; again where it is used
                choice = (str(found[0]), found[1])
            except ResumeError as err:
                choice = str(err)  # every rank raises it
        else:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            run_dir = new_run_folder(root, stamp) if job is None else new_job_run(root, stamp, job)
            choice = (str(run_dir), None)  # made now: never shared
            if resume == "auto":
                _log.info("resume=auto: no earlier run of %r under %s; starting fresh.", root.name, root)
    choice = broadcast_object(choice)
    if isinstance(choice, str):
        raise ResumeError(choice)
    assert choice is not None
    return Path(choice[0]), choice[1]


def _run_order(manifest: Path) -> tuple[str, int]:
    """Run folders in the order they were made: ``<stamp>``, ``<stamp>-1``, ..., ``<stamp>-10``."""
    head, _, tail = manifest.parent.parent.name.rpartition("-")
    if head and tail.isdigit() and "-" in head:  # <date>-<time>-<n>
        return head, int(tail)
    return manifest.parent.parent.name, 0


def file_logging(run_dir: Path) -> logging.Handler:
    """Copies the ``unison`` logger's records to ``run_dir/logs/rank<N>.log``; returns the handler."""
    handler = RunLogHandler(real_folder(run_dir / "logs") / f"rank{get_rank()}.log")  # never through a link
    handler.setFormatter(
        logging.Formatter(f"[rank {get_rank()}] %(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    logging.getLogger("unison").addHandler(handler)
    return handler
