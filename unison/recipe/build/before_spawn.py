"""The checks of a run in the launching process, after its plan and before any rank starts.

:func:`check_before_spawning` takes the plan and checks what only this machine and the run
folders can tell: the plan's :func:`~unison.recipe.build.preflight.preflight` (the device, the
output folder, the model on ``meta``), the run a ``--resume`` continues (no links where unison
writes, no change a checkpoint cannot follow, the schedule's and the data stream's shapes), a
rendezvous port that is free, and a run folder no other job holds. Each fails here, before
spawning, not in a rank.
"""

from __future__ import annotations

import os

import torch

from unison.distributed import detect_launcher
from unison.recipe.build.preflight import check_port, preflight
from unison.recipe.build.resume_shape import check_resume_shape
from unison.recipe.folder.job_run import job_previous_run, run_job
from unison.recipe.folder.run_choice import ResumeError, previous_run
from unison.recipe.folder.run_folder import refuse_if_held, refuse_unsafe
from unison.recipe.planning.changes import check_resume
from unison.recipe.planning.run_plan import RunPlan


def check_before_spawning(planned: RunPlan, resume: str | None, nproc_per_node: int | None) -> None:
    """Checks ``planned`` in the launching process (``nproc_per_node`` None: this process trains
    next, as torchrun's or srun's rank or a run of one process).

    Raises:
        ConfigError: naming the key (file and line) of the first problem.
        ResumeError: a ``resume`` that names no run to continue, or one another job holds.
    """
    launcher = detect_launcher()
    # the model on meta unless this process trains next (a tensor the user's code keeps from that
    # build would reach training)
    preflight(planned, trains_here=nproc_per_node is None)
    job = run_job(resume, explain=False)  # torchrun with an id: every rank checks the job's run
    root = planned.run_root
    found = previous_run(root, resume) if job is None else job_previous_run(root, job)
    if found is not None:
        refuse_unsafe(found[0], ResumeError)  # a run folder with links where unison writes: before any rank
        # A change no checkpoint can follow fails here, not in a rank; so does a schedule or a
        # stream of another shape than the checkpoint's.
        check_resume(planned.record, planned.refs.origin, found[0], planned.resolved.scheduler_type)
        world = launcher.world_size if launcher.kind != "none" else nproc_per_node or 1
        check_resume_shape(planned, found[0], found[1], world)
    if launcher.kind == "none":
        if nproc_per_node is not None:
            check_gpus(planned, nproc_per_node)  # each rank takes a GPU where there are any
        check_port(planned)  # a busy port fails here, not after the ranks started
        refuse_if_held(found, ResumeError)  # so does a run folder another job holds (rank 0 takes it again)


def check_gpus(planned: RunPlan, nproc: int) -> None:
    """Spawned ranks take one GPU each where the machine has GPUs (``cuda:LOCAL_RANK``; ignite
    sets it as the group forms, on gloo too): no more of them than this machine shows. Without
    the check, the rank past the last GPU fails in the process group's set-up with CUDA's
    "invalid device ordinal".

    Raises:
        ConfigError: at ``parallel.nproc_per_node``, with the GPUs this process sees and the fixes.
    """
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0 or nproc <= count:
        return
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
    raise planned.refs.error(
        "parallel.nproc_per_node",
        f"{nproc} ranks (--nproc or parallel.nproc_per_node) take a GPU each, and this machine shows "
        f"{count} (CUDA_VISIBLE_DEVICES={visible!r}): spawn at most {count} (--nproc {count}) or make more "
        "GPUs visible; for ranks on the CPU, hide the GPUs from them: CUDA_VISIBLE_DEVICES= unison run ... "
        "--set parallel.backend=gloo",
    )
