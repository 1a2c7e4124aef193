"""The job this process belongs to: an identity that outlives a restart of its ranks.

torchrun gives every worker the rendezvous id (``TORCHELASTIC_RUN_ID``): the same on every
node and across every restart of the worker group, and different for another job given
another ``--rdzv-id``. A job id lets a restarted group find what its first attempt wrote
(``unison run`` keeps one run folder per job and resumes it without ``--resume``).

torchrun's default ``--rdzv-id`` is ``none``, which every job shares, so it identifies no job;
a single-node torchrun with the default static rendezvous (``--standalone``, or no
``--rdzv-endpoint`` nor ``--master-port``) draws a random id instead, one per invocation.
``TORCHELASTIC_RESTART_COUNT`` is kept for logs only: a restart caused by a node joining
does not increment it, and ranks of one group may see different counts.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from unison.distributed.env import detect_launcher

__all__ = ["JobIdentity", "NO_JOB_ID", "job_id", "job_identity"]

NO_JOB_ID = "none"
"""torchrun's default ``--rdzv-id``: shared by every job that does not set one."""

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_MAX_NAME = 48


@dataclass(frozen=True)
class JobIdentity:
    """Which launcher started the job, its id, and the restart count the launcher reports."""

    launcher: str
    job_id: str
    restart_count: int | None = None

    @property
    def folder_name(self) -> str:
        """``job-<id>`` with characters a file name should not hold replaced by ``_`` (the
        record in the folder keeps the exact id).

        Example:
            >>> JobIdentity("torchrun", "exp 7/a").folder_name
            'job-exp_7_a'
        """
        return "job-" + (_UNSAFE.sub("_", self.job_id).strip("._") or "_")[:_MAX_NAME]

    def record(self) -> dict[str, str]:
        """What a run folder stores about the job that owns it."""
        return {"job_id": self.job_id, "launcher": self.launcher}


def job_identity(environ: Mapping[str, str] | None = None) -> JobIdentity | None:
    """The job this process is a rank of, or None when its launcher gives no job id.

    Under torchrun: the rendezvous id (``--rdzv-id``), unless it is unset or torchrun's
    default ``none``. Elsewhere (unison's own spawn, srun without torchrun, no launcher): None.
    Reads the environment only; no collective.

    Example:
        >>> job_identity({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2",
        ...               "TORCHELASTIC_RUN_ID": "exp-7", "TORCHELASTIC_RESTART_COUNT": "1"})
        JobIdentity(launcher='torchrun', job_id='exp-7', restart_count=1)
    """
    env = os.environ if environ is None else environ
    if detect_launcher(dict(env)).kind != "torchrun":
        return None
    run_id = env.get("TORCHELASTIC_RUN_ID", "").strip()
    if not run_id or run_id == NO_JOB_ID:
        return None
    count = env.get("TORCHELASTIC_RESTART_COUNT", "")
    return JobIdentity("torchrun", run_id, int(count) if count.isdigit() else None)


def job_id(environ: Mapping[str, str] | None = None) -> str | None:
    """The id of the job this process belongs to (torchrun's ``--rdzv-id``), or None.

    A script of one's own keeps one checkpoint folder per job with it, so that a restarted
    worker group resumes its own job and a new job starts fresh::

        checkpoint = Checkpoint(folder=f"runs/{job_id() or 'local'}", ...)
        checkpoint.resume("auto")  # the job's newest checkpoint; none yet: a fresh start

    Every rank gets the same id, so every rank names the same folder.
    """
    identity = job_identity(environ)
    return None if identity is None else identity.job_id
