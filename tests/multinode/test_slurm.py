"""unison under a real SLURM: a one-machine cluster runs ``slurm/multi-node-one-gpu.sbatch`` on CPU.

The cluster (Debian's slurm-wlm and munge, installed with apt-get when missing; see
``slurm_cluster.py`` beside this file) has one node, ``localhost``, with the machine's
CPUs. The template is submitted as it is, with command-line options for a CPU job:
``--nodes=1 --ntasks-per-node=2 --gpus-per-task=0 --cpus-per-task=1``; srun starts two
tasks and each is a rank, placed from SLURM_PROCID / SLURM_LOCALID / SLURM_NTASKS.

- an uninterrupted job trains, checkpoints and writes its metrics, with world size 2;
- a second job gets ``scancel --signal=USR1`` while training: the ranks save at an agreed
  iteration and exit with 75 (the job's exit code is 75, or 143 when srun's
  ``--kill-on-bad-exit=1`` ended a rank still tearing down); submitting the template again
  (it passes ``--resume auto``) continues from that checkpoint to the end, with the
  parameters of the uninterrupted job;
- with ``checkpoint.requeue=true`` the job requeues itself after the save, and its second
  start resumes and ends with the same parameters.

When SLURM is missing and cannot be installed (no root, no apt-get, no mirror), the tests
skip with the reason; with ``UNISON_REQUIRE_SLURM=1`` they fail instead.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
import torch
from slurm_cluster import SlurmCluster, SlurmUnavailable, ensure_slurm

from unison.checkpoint.lock import LOCK_FILE

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
TEMPLATE = ROOT / "slurm" / "multi-node-one-gpu.sbatch"
CONFIG = ROOT / "recipes" / "digits" / "config.yaml"
REQUIRE = os.environ.get("UNISON_REQUIRE_SLURM") == "1"
JOB_TIMEOUT_S = 240
EPOCHS, EVERY = 3, 5
CPU_JOB = ["--nodes=1", "--ntasks-per-node=2", "--gpus-per-task=0", "--cpus-per-task=1", "--time=15"]
RUN = [
    "--set", f"training.max_epochs={EPOCHS}",
    "--set", f"training.sync_every={EVERY}",
    "--set", f"checkpoint.every_iters={EVERY}",
    "--set", "logging.progress=false",
    "--set", "logging.tensorboard=false",
    "--set", "imports=[multinode_probe]",
    "--set", "model.type=!pyobject multinode_probe.SlowCNN",  # the recipe's CNN, 50 ms per step
    "--set", "model.kwargs={channels: 16, hidden: 64, delay: 0.05}",
    "--set", "hooks.after_training=!pyobject multinode_probe.record",
]  # fmt: skip


@pytest.fixture(scope="module")
def cluster():
    started = time.monotonic()
    try:
        installed = ensure_slurm()
    except SlurmUnavailable as err:
        if REQUIRE:
            pytest.fail(f"UNISON_REQUIRE_SLURM=1, but SLURM is not available: {err}")
        pytest.skip(f"SLURM is not available (set UNISON_REQUIRE_SLURM=1 to fail instead): {err}")
    if installed:
        print(f"\ninstalled slurm-wlm and munge in {installed:.1f} s")
    cluster = SlurmCluster()
    try:
        cluster.start()
    except BaseException:
        cluster.stop()
        raise
    print(f"SLURM cluster up in {time.monotonic() - started - installed:.1f} s: {cluster.conf}")
    yield cluster
    cluster.stop()


def submit(
    cluster: SlurmCluster, root: Path, outputs: Path, sbatch: tuple[str, ...] = (), run: tuple[str, ...] = ()
) -> int:
    """Submits the template for a CPU job; its runs go under ``root``, its output to ``outputs``."""
    venv_bin = Path(sys.executable).parent
    assert (venv_bin / "unison").exists(), f"the unison command is not next to {sys.executable}"
    env = {
        "PATH": os.pathsep.join([str(venv_bin), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    }
    args = [
        *CPU_JOB, "--job-name=unison-test", f"--output={outputs}/slurm-%j.out", f"--chdir={ROOT}", *sbatch,
        str(TEMPLATE), str(CONFIG), *RUN, "--set", f"logging.root={root}", *run,
    ]  # fmt: skip
    return cluster.sbatch(args, env=env)


def finish(cluster: SlurmCluster, job: int, outputs: Path) -> tuple[dict[str, str], str]:
    """Waits for the job; returns scontrol's fields and the job's output."""
    info = cluster.wait(job, JOB_TIMEOUT_S)
    out = outputs / f"slurm-{job}.out"
    return info, out.read_text() if out.exists() else "<no output file>"


def _refused_as_already_killed(cluster: SlurmCluster, job: int) -> bool:
    """Whether slurmd refused to start the job because it still held an earlier start as killed."""
    log = cluster.logs / "slurmd.log"
    return log.exists() and f"Job {job} already killed, do not launch batch job" in log.read_text(errors="replace")


def only_run(root: Path) -> Path:
    runs = sorted((root / "digits").glob("*/")) if (root / "digits").exists() else []
    assert len(runs) == 1, f"expected one run directory under {root}, got {runs}"
    return runs[0]


def last_checkpoint(run_dir: Path) -> tuple[dict, dict]:
    folder = run_dir / "checkpoints"
    entries = json.loads((folder / "manifest.json").read_text())["checkpoints"]
    on_disk = sorted(p.name for p in folder.iterdir() if p.name not in ("manifest.json", LOCK_FILE))
    assert on_disk == sorted(e["file"] for e in entries), f"folder {on_disk} vs manifest {entries}"
    entry = entries[-1]
    return entry, torch.load(folder / entry["file"], map_location="cpu", weights_only=True)


@pytest.fixture(scope="module")
def uninterrupted(cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("slurm-uninterrupted")
    started = time.monotonic()
    job = submit(cluster, root / "runs", root)
    info, output = finish(cluster, job, root)
    print(f"\nuninterrupted job {job}: {info.get('JobState')} in {time.monotonic() - started:.1f} s")
    return job, info, output, root / "runs"


@pytest.mark.timeout(900)  # includes installing SLURM (about a minute) and starting the cluster
def test_template_trains_two_srun_ranks(cluster, uninterrupted):
    job, info, output, root = uninterrupted
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), (
        f"job {job}: {info}\n{output}\n{cluster.diagnostics()}"
    )
    assert cluster.completed(job)["ExitCode"] == "0:0"
    run_dir = only_run(root)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["epochs"] == EPOCHS, metrics
    entry, state = last_checkpoint(run_dir)
    assert entry["iteration"] == metrics["iterations"] == state["meta"]["iteration"]
    assert state["meta"]["world_size"] == 2

    # SLURM's variables placed the ranks: srun started two tasks, each a rank of world size 2.
    log0 = (run_dir / "logs" / "rank0.log").read_text()
    assert "(world size 2)" in log0, log0
    assert (run_dir / "logs" / "rank1.log").exists()
    for r in range(2):
        placed = json.loads((run_dir / "placement" / f"rank{r}.json").read_text())
        env = placed["env"]
        assert placed["launcher"] == "slurm" and placed["env_at_start"]["RANK"] is None, placed
        assert (placed["rank"], placed["local_rank"], placed["world_size"]) == (r, r, 2), placed
        assert (env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NTASKS"]) == (str(r), str(r), "2"), env
        assert env["SLURM_JOB_ID"] == str(job) and env["SLURM_STEP_ID"] is not None, env
    # Logged once, by rank 0, though both tasks share the job's output file.
    assert len(re.findall(rf"epoch {EPOCHS}/{EPOCHS}  train loss", output)) == 1, output


def preempt_when_training(cluster: SlurmCluster, job: int, root: Path, outputs: Path) -> None:
    """Sends USR1 to the job's tasks (``scancel --signal=USR1``) once its first checkpoint is on disk."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        logs = list(root.glob("digits/*/logs/rank0.log"))
        if logs and "Saved checkpoint" in logs[0].read_text():
            break
        state = cluster.job(job).get("JobState")
        assert state in ("PENDING", "CONFIGURING", "RUNNING"), (
            f"job {job} ended ({state}) before its first checkpoint:\n{finish(cluster, job, outputs)[1]}"
        )
        if time.monotonic() > deadline:
            cluster.cancel(job)
            pytest.fail(f"job {job} saved no checkpoint in {JOB_TIMEOUT_S} s\n{cluster.diagnostics()}")
        time.sleep(0.1)
    cluster.cancel(job, "USR1")


def check_exact_resume(run_a: Path, run_b: Path, total: int) -> None:
    """The run that was preempted and resumed ends with the uninterrupted run's parameters, bit for bit."""
    end_a, state_a = last_checkpoint(run_a)
    end_b, state_b = last_checkpoint(run_b)
    assert end_a["iteration"] == end_b["iteration"] == total
    model_a, model_b = state_a["objects"]["model"], state_b["objects"]["model"]
    assert model_a.keys() == model_b.keys()
    differ = [k for k in model_a if not torch.equal(model_a[k], model_b[k])]
    assert not differ, f"preempted + resumed differs from uninterrupted in {differ}"
    metrics_a = json.loads((run_a / "metrics.json").read_text())
    metrics_b = json.loads((run_b / "metrics.json").read_text())
    assert metrics_b["iterations"] == total and metrics_b["epochs"] == EPOCHS, metrics_b
    assert metrics_b["validation"] == metrics_a["validation"]


@pytest.fixture
def reference(uninterrupted) -> tuple[Path, int]:
    job, info, _, root = uninterrupted
    if info.get("ExitCode") != "0:0":
        pytest.skip(f"the uninterrupted job {job} failed; see test_template_trains_two_srun_ranks")
    run_a = only_run(root)
    return run_a, json.loads((run_a / "metrics.json").read_text())["iterations"]


TASK_EXIT = re.compile(r"^srun: error: \S+: tasks? ([\d,-]+): (.+)$", re.M)


@pytest.mark.timeout(600)
def test_usr1_saves_exits_75_and_resubmission_resumes_exactly(cluster, reference, tmp_path):
    run_a, total = reference
    root = tmp_path / "runs"

    # -- preempted: USR1 to the tasks while training ------------------------------------
    started = time.monotonic()
    # The template asks for a requeue after a preemption save; this test resubmits by hand.
    job = submit(cluster, root, tmp_path, run=("--set", "checkpoint.requeue=false"))
    preempt_when_training(cluster, job, root, tmp_path)
    info, output = finish(cluster, job, tmp_path)
    print(
        f"\npreempted job {job}: {info.get('JobState')} {info.get('ExitCode')} in {time.monotonic() - started:.1f} s"
    )
    assert "stopping after iteration" in output and "preempted" in output, output
    # Every rank saved and exited with 75. srun (--kill-on-bad-exit=1 in the template) ends the
    # other tasks as soon as the first exits non-zero: a rank still tearing down Python then
    # dies of SIGTERM, and the job's exit code is 143 instead of 75 (see docs/launching.md).
    exits = TASK_EXIT.findall(output)
    assert exits and all(why in ("Exited with exit code 75", "Terminated") for _, why in exits), output
    assert any(why == "Exited with exit code 75" for _, why in exits), output
    expected = "75:0" if all(why != "Terminated" for _, why in exits) else "143:0"
    assert info.get("ExitCode") == expected, f"job {job}: {info}\n{output}\n{cluster.diagnostics()}"
    assert cluster.completed(job)["ExitCode"] == expected
    run_dir = only_run(root)
    assert not (run_dir / "metrics.json").exists(), "a preempted run should stop before its end"
    entry, _ = last_checkpoint(run_dir)
    saved_at = entry["iteration"]
    assert EVERY <= saved_at < total and saved_at % EVERY == 0, (saved_at, total)

    # -- resubmitted: the template's --resume auto continues from that checkpoint ---------
    started = time.monotonic()
    job = submit(cluster, root, tmp_path)
    info, output = finish(cluster, job, tmp_path)
    print(
        f"resumed job {job}: {info.get('JobState')} {info.get('ExitCode')} in {time.monotonic() - started:.1f} s"
    )
    assert (info.get("JobState"), info.get("ExitCode")) == ("COMPLETED", "0:0"), (
        f"job {job}: {info}\n{output}\n{cluster.diagnostics()}"
    )
    assert only_run(root) == run_dir, "resume=auto should continue in the preempted run's directory"
    resumed = re.findall(r"Resumed from (\S+) \(epoch \d+, iteration (\d+)\)", output)
    assert resumed == [(str(run_dir / "checkpoints" / entry["file"]), str(saved_at))], output
    check_exact_resume(run_a, run_dir, total)


@pytest.mark.timeout(600)
def test_usr1_with_requeue_resumes_in_the_same_job(cluster, reference, tmp_path):
    """``checkpoint.requeue=true``: rank 0 requeues the job after the save (the template has
    ``#SBATCH --requeue``), and the job's second start resumes it, with no resubmission."""
    run_a, total = reference
    root = tmp_path / "runs"
    started = time.monotonic()
    job = submit(cluster, root, tmp_path)
    preempt_when_training(cluster, job, root, tmp_path)
    # SLURM holds a requeued job (Reason=BeginTime) for about two minutes; release it once
    # the first start's batch step has ended (released earlier, the new start can be marked
    # FAILED by the old step's exit).
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while True:
        info = cluster.job(job)
        if info.get("Restarts") == "1" and info.get("JobState") == "PENDING" and cluster.batch_step_done(job):
            cluster.scontrol("update", f"JobId={job}", "StartTime=now")
            break
        if info.get("Restarts") == "1" and info.get("JobState") in ("RUNNING", "COMPLETED"):
            break  # a SLURM without the requeue delay
        assert info.get("JobState") in ("RUNNING", "COMPLETING", "REQUEUED", "PENDING"), (
            f"job {job} was not requeued: {info}\n{(tmp_path / f'slurm-{job}.out').read_text()}"
        )
        assert time.monotonic() < deadline, f"job {job} was not requeued in {JOB_TIMEOUT_S} s: {info}"
        time.sleep(0.2)
    info, output = finish(cluster, job, tmp_path)
    restarts = "1"
    if info.get("JobState") == "FAILED" and _refused_as_already_killed(cluster, job):
        # A one-machine cluster's race: slurmd refused the requeued start while it still held the
        # first start as killed ("Job N already killed, do not launch batch job"); nothing of
        # unison ran. Requeue it again: the checkpoint is on disk, the second try resumes.
        cluster.scontrol("requeue", str(job))
        cluster.scontrol("update", f"JobId={job}", "StartTime=now")
        info, output = finish(cluster, job, tmp_path)
        restarts = "2"
    print(
        f"\nrequeued job {job}: {info.get('JobState')} {info.get('ExitCode')} in {time.monotonic() - started:.1f} s"
    )
    assert (info.get("JobState"), info.get("ExitCode"), info.get("Restarts")) == ("COMPLETED", "0:0", restarts), (
        f"job {job}: {info}\n{output}\n{cluster.diagnostics()}"
    )
    assert "DUE TO JOB REQUEUE" in output, output
    stopped = re.findall(r"all 2 ranks stopping after iteration (\d+) .*: preempted", output)
    assert len(stopped) == 1 and EVERY <= int(stopped[0]) < total, output
    run_dir = only_run(root)
    resumed = re.findall(r"Resumed from (\S+) \(epoch \d+, iteration (\d+)\)", output)
    assert len(resumed) == 1 and resumed[0][1] == stopped[0], output
    assert Path(resumed[0][0]).parent == run_dir / "checkpoints", resumed
    for r in range(2):
        placed = json.loads((run_dir / "placement" / f"rank{r}.json").read_text())
        assert placed["env"]["SLURM_RESTART_COUNT"] == restarts, placed
    check_exact_resume(run_a, run_dir, total)
