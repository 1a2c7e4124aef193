"""A torchrun job owns its run: a restarted worker group resumes it, with no --resume flag.

One torchrun agent, 2 workers, ``--max-restarts=1`` and a rendezvous id of the test's own.
Rank 1 SIGKILLs itself at a fixed training step on the first attempt (a flag file marks it);
the agent restarts the group, which finds the job's run folder (``job.json``) and resumes its
newest checkpoint. The final weights equal those of a second job (another rendezvous id) that
ran uninterrupted, bitwise, and that job trained in a fresh run folder of its own.

The agent runs in a session of its own; on a timeout the test kills that process group and
every process below the agent (listed from /proc first), and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from _procs import kill_tree

from unison.distributed import find_free_port
from unison.recipe.folder.job_run import JOB_RECORD

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONFIG = ROOT / "recipes" / "digits" / "config.yaml"
EVERY_ITERS, CRASH_AT, LENGTH = 3, 5, 8  # checkpoints at 3 and 6; rank 1 dies in step 5
RUN_TIMEOUT_S = 120  # one job: ~20 s on an idle 2-core machine, ~35 s with its restart


def run_job(root: Path, rdzv_id: str, flag: Path, crash_at: int) -> str:
    """Runs one torchrun job of the digits recipe; returns the agent's output."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PET_"))}
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    env.update(
        OMP_NUM_THREADS="1",
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # with the agent's store shared, a restarted group's gloo mesh fails

        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
    )
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.5",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{find_free_port()}", f"--rdzv-id={rdzv_id}",
        "-m", "unison.cli", "run", str(CONFIG),
        "--set", "training.max_epochs=1",
        "--set", f"training.epoch_length={LENGTH}",
        "--set", f"checkpoint.every_iters={EVERY_ITERS}",
        "--set", "checkpoint.preemption=false",
        "--set", "early_stopping=null",
        "--set", "logging.progress=false",
        "--set", "logging.tensorboard=false",
        "--set", f"logging.root={root}",
        "--set", "imports=[elastic_probe]",
        "--set", "model.type=!pyobject elastic_probe.CrashOnceCNN",
        "--set", f"model.kwargs={{channels: 8, hidden: 32, flag: '{flag}', at: {crash_at}}}",
    ]  # fmt: skip
    out = root / f"agent-{rdzv_id}.out"
    with open(out, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        pytest.fail(f"torchrun job {rdzv_id} did not finish in {RUN_TIMEOUT_S} s:\n{out.read_text()[-4000:]}")
    text = out.read_text()
    assert proc.returncode == 0, f"torchrun job {rdzv_id} exited with {proc.returncode}:\n{text[-4000:]}"
    return text


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    entries = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())["checkpoints"]
    newest = max(entries, key=lambda e: e["iteration"])
    assert newest["iteration"] == LENGTH, entries
    return torch.load(run_dir / "checkpoints" / newest["file"], map_location="cpu", weights_only=True)["objects"]["model"]


@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 60)
def test_a_restarted_group_resumes_its_jobs_run_and_a_new_job_starts_fresh(tmp_path):
    tag = uuid.uuid4().hex[:8]
    flag = tmp_path / "crashed"
    first = run_job(tmp_path, f"elastic-{tag}-a", flag, CRASH_AT)
    assert flag.exists(), f"rank 1 never reached step {CRASH_AT}:\n{first[-3000:]}"
    runs = sorted((tmp_path / "digits").iterdir())
    assert len(runs) == 1, f"the restart should continue the job's run folder, got {runs}"
    crashed = runs[0]
    assert json.loads((crashed / JOB_RECORD).read_text()) == {"job_id": f"elastic-{tag}-a", "launcher": "torchrun"}
    resumed = re.findall(r"Resumed from (\S+) \(epoch \d+, iteration (\d+)\)", first)
    assert [int(i) for _, i in resumed] == [EVERY_ITERS], f"expected one resume from iteration {EVERY_ITERS}:\n{first}"

    second = run_job(tmp_path, f"elastic-{tag}-b", flag, CRASH_AT)  # the flag exists: no crash
    assert "Resumed from" not in second, f"a new job resumed another job's run:\n{second}"
    fresh = [d for d in (tmp_path / "digits").iterdir() if d != crashed]
    assert len(fresh) == 1 and fresh[0].name.endswith(f"-job-elastic-{tag}-b"), fresh

    restarted, uninterrupted = final_model(crashed), final_model(fresh[0])
    assert restarted.keys() == uninterrupted.keys()
    for name, tensor in uninterrupted.items():
        assert torch.equal(restarted[name], tensor), f"{name} differs after the restart"
