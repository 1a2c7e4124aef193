"""The run folder a job owns: made by its first attempt, found again by every restart.

Under torchrun with a rendezvous id (:func:`unison.distributed.job.job_identity`), the run
folder is ``<root>/<name>/<stamp>-job-<id>`` and holds ``job.json`` (the exact id and the
launcher). A restarted worker group (the same id) finds that folder and resumes its newest
complete checkpoint, with no ``--resume``; a job with another id never sees it and starts
fresh. A new job given a finished job's id resumes that run too, which is said at WARNING with
how to start fresh. Nothing here is a collective: rank 0 reads and writes, and broadcasts its choice.

``job.json`` is read only as a regular file of at most 4 KiB, without following a link and
without waiting on a FIFO (:mod:`unison.utils.run_files`); any other entry of that name claims
nothing, so a FIFO dropped in the run root cannot hang a job.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

from unison.distributed.job import NO_JOB_ID, JobIdentity, job_identity
from unison.recipe.folder.run_folder import JOB_RECORD, new_run_folder
from unison.utils import get_logger
from unison.utils.run_files import read_bytes, write_text

_log = get_logger("unison.recipe.run")

__all__ = ["JOB_RECORD", "JobRunError", "find_job_run", "job_previous_run", "new_job_run", "run_job"]

_MAX_RECORD = 4096
"""The most bytes of a ``job.json`` read: what unison writes there is a few dozen."""

FINISHED = "metrics.json"
"""The file a run writes once it ends: a job run holding it is a finished job's."""


class JobRunError(RuntimeError):
    """Two run folders claim the same job: which one a restart resumes would be a guess."""


def run_job(
    resume: str | None, environ: Mapping[str, str] | None = None, *, explain: bool = True
) -> JobIdentity | None:
    """The job whose run folder this run uses, or None: a ``resume`` given keeps its meaning.

    ``explain``: log, at INFO, when torchrun runs with its default rendezvous id (shared by
    every job), how to get a restarted group to resume its own run (rank 0 does, once).
    """
    if resume is not None:
        return None
    job = job_identity(environ)
    if explain and job is None and _default_torchrun_id(environ):
        _log.info(
            "torchrun's rendezvous id is %r, which every job shares: a restarted worker group starts "
            "a fresh run. Give torchrun --rdzv-id=<an id unique to this job> (under SLURM: "
            "--rdzv-id=$SLURM_JOB_ID) and a restart resumes the job's own run, or pass --resume auto.",
            NO_JOB_ID,
        )
    return job


def _default_torchrun_id(environ: Mapping[str, str] | None) -> bool:
    env = os.environ if environ is None else environ
    return "TORCHELASTIC_RUN_ID" in env and env["TORCHELASTIC_RUN_ID"].strip() in ("", NO_JOB_ID)


def find_job_run(run_root: Path, job: JobIdentity) -> Path | None:
    """The run folder under ``run_root`` that ``job`` made, or None when it made none yet.

    Raises:
        JobRunError: when two folders claim the job, naming both and the fix.
    """
    owned = sorted(d.parent for d in run_root.glob(f"*/{JOB_RECORD}") if _claimed_id(d) == job.job_id)
    if len(owned) > 1:
        shown = " and ".join(str(d) for d in owned)
        raise JobRunError(
            f"run folders {shown} both claim {job.launcher} job {job.job_id!r} ({JOB_RECORD}), so a restart "
            "cannot tell which one to resume. Move the one that is not this job's out of "
            f"{run_root}, or start this job with another --rdzv-id."
        )
    return owned[0] if owned else None


def job_previous_run(run_root: Path, job: JobIdentity, *, explain: bool = False) -> tuple[Path, str] | None:
    """What :func:`~unison.recipe.folder.run_choice.previous_run` gives for a job: its run folder and
    ``"auto"`` (its newest complete checkpoint), or None when the job has no run yet.

    ``explain``: when that run has finished (it holds ``metrics.json``), say at WARNING that this
    job resumes it, and how to start fresh (rank 0 does, once): a restarted worker group never
    finds its own run finished, a new job that reuses an old id does.
    """
    owned = find_job_run(run_root, job)
    if owned is not None and explain and os.path.lexists(owned / FINISHED):
        _log.warning(
            "%s job %r already ran to its end in %s (it holds %s): this job resumes that run from its "
            "newest checkpoint. If this is a new job, give it an id of its own (torchrun "
            '--rdzv-id="$SLURM_JOB_ID", or --rdzv-id="exp-$(date +%%s)") to start a fresh run, or move %s '
            "out of %s.",
            job.launcher,
            job.job_id,
            owned,
            FINISHED,
            owned,
            run_root,
        )
    return None if owned is None else (owned, "auto")


def new_job_run(run_root: Path, stamp: str, job: JobIdentity) -> Path:
    """Makes ``run_root/<stamp>-job-<id>`` and records ``job`` in it; returns the folder."""
    folder = new_run_folder(run_root, f"{stamp}-{job.folder_name}")
    write_text(folder / JOB_RECORD, json.dumps(job.record(), indent=2) + "\n")
    return folder


def _claimed_id(record: Path) -> str | None:
    """The id ``record`` claims; None unless it is a small regular file holding a JSON object with one."""
    try:
        claimed = json.loads(read_bytes(record, limit=_MAX_RECORD)).get("job_id")
    except (OSError, ValueError, AttributeError):  # a link, a FIFO, a large or unreadable file: no claim
        return None
    return claimed if isinstance(claimed, str) else None
