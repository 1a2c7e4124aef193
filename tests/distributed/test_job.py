"""The job identity: torchrun's rendezvous id names the job, the same across restarts."""

from __future__ import annotations

import pytest

from unison.distributed import job_id
from unison.distributed.job import JobIdentity, job_identity

RANK0 = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}


def test_torchrun_rendezvous_id_is_the_job():
    env = {**RANK0, "TORCHELASTIC_RUN_ID": "exp-7", "TORCHELASTIC_RESTART_COUNT": "2"}
    assert job_identity(env) == JobIdentity("torchrun", "exp-7", 2)
    assert job_id(env) == "exp-7"


@pytest.mark.parametrize("run_id", ["none", "", "  "])
def test_torchruns_default_id_names_no_job(run_id):
    assert job_identity({**RANK0, "TORCHELASTIC_RUN_ID": run_id}) is None


def test_no_launcher_spawn_or_srun_name_no_job():
    assert job_identity({}) is None
    assert job_identity({"TORCHELASTIC_RUN_ID": "exp-7"}) is None  # no rank variables: not a worker
    spawned = {**RANK0, "UNISON_SPAWNED": "1", "TORCHELASTIC_RUN_ID": "exp-7"}
    assert job_identity(spawned) is None
    srun = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}
    assert job_identity(srun) is None


def test_a_restart_count_torchrun_leaves_out_is_unknown_not_zero():
    assert job_identity({**RANK0, "TORCHELASTIC_RUN_ID": "a"}) == JobIdentity("torchrun", "a", None)


@pytest.mark.parametrize(
    ("run_id", "name"),
    [("12345", "job-12345"), ("exp 7/../a", "job-exp_7_.._a"), ("../", "job-_"), ("x" * 80, "job-" + "x" * 48)],
)
def test_folder_names_hold_no_path_separator(run_id, name):
    assert JobIdentity("torchrun", run_id).folder_name == name
    assert "/" not in name and not name.endswith(".")
