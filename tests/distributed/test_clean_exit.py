"""A rank that finished its work exits cleanly: code 0, nothing from its teardown on stderr.

A rank used to abort now and then as its interpreter tore down, after training succeeded
("terminate called without an active exception", SIGABRT): its process group was still
alive then, because destroy_process_group leaves the C++ group to whoever still holds it
(a DistributedDataParallel model, kept by an engine's reference cycles), and the group was
destroyed by the interpreter's final garbage collection, with its threads still running.
Whether that aborted depended on scheduling, so the tests check what made it possible, in
every rank of every launch: when the interpreter starts its teardown, no thread of a process
group is left (each rank records it from an ``atexit`` handler; before the fix every rank
had gloo's two workers and its socket loop, rank 0 the TCPStore server too). They also
check what a user sees: every process exits with 0 and stderr holds no teardown noise.

The jobs train as a recipe does (prepare_model's DDP, an engine and an evaluator): two
spawned jobs one after the other (the second from a process that has launched before), and
one under torchrun (the path where launch creates the group). Each command runs in a session
of its own, with a timeout after which its whole process tree is ended; ports are free ones
(launch's own choice, torchrun --standalone).
A last test: a spawned job whose rank raises leaves nothing in the temp folder (torch's
spawn left a pytorch-errorfile-*.pickle there for each such rank).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from _procs import run_in_session

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.slow,
    pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are read from /proc (Linux)"),
]

ROOT = Path(__file__).resolve().parents[2]
WORKERS = Path(__file__).resolve().parent / "_exit_workers.py"
SPAWNED_JOBS = 2  # ~7 s each on an idle 2-core machine (each rank imports torch); one after the other
RUN_TIMEOUT_S = 240

# What a rank's teardown must not print: the abort, a fatal signal, Python's or torch's
# complaints at exit (c10d's own log lines start with "[W" or "[E" and a date), a lost
# connection to a peer or to the TCPStore, unison's warning of a group still referenced.
# These jobs log nothing else at WARNING or above either, so any such line counts.
TEARDOWN_NOISE = re.compile(
    r"terminate called|Aborted|core dumped|Fatal Python error|Segmentation fault|SIG[A-Z]+|"
    r"destroy_process_group|process group has NOT been destroyed|still run|Exception ignored|"
    r"Traceback|leaked semaphore|resource_tracker|Connection (closed|reset)|Broken pipe|TCPStore|"
    r"^\[[WE]\d|\b(WARNING|ERROR|CRITICAL)\b"
)


@pytest.fixture
def job_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """One compute thread per rank (2 cores); no launcher variables (conftest removes them)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")


def check_clean(proc: subprocess.CompletedProcess, out: Path, jobs: int) -> None:
    noise = [line for line in proc.stderr.splitlines() if TEARDOWN_NOISE.search(line)]
    assert proc.returncode == 0 and not noise, (
        f"exit code {proc.returncode}; teardown noise on stderr:\n"
        + "\n".join(noise)
        + f"\n{proc.stderr[-3000:]}"
    )
    records = sorted(out.glob("exit-*.json"))
    assert len(records) == 2 * jobs, f"{len(records)} exit records for {jobs} jobs of 2 ranks: {records}"
    alive = {p.name: json.loads(p.read_text())["group_threads"] for p in records}
    alive = {name: threads for name, threads in alive.items() if threads}
    assert not alive, f"process-group threads still running as the interpreter tore down: {alive}"


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_spawned_ranks_leave_no_group_thread_to_teardown(tmp_path: Path, job_env: None) -> None:
    cmd = [sys.executable, str(WORKERS), "spawn", str(SPAWNED_JOBS), str(tmp_path)]
    check_clean(run_in_session(cmd, RUN_TIMEOUT_S, ROOT), tmp_path, SPAWNED_JOBS)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_sharded_ranks_leave_no_group_thread_to_teardown(tmp_path: Path, job_env: None) -> None:
    cmd = [sys.executable, str(WORKERS), "spawn-fsdp", str(tmp_path)]
    check_clean(run_in_session(cmd, RUN_TIMEOUT_S, ROOT), tmp_path, 1)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_torchrun_ranks_leave_no_group_thread_to_teardown(tmp_path: Path, job_env: None) -> None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd += [str(WORKERS), "torchrun", str(tmp_path)]
    check_clean(run_in_session(cmd, RUN_TIMEOUT_S, ROOT), tmp_path, 1)


@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_a_failed_spawn_leaves_no_error_file_in_the_temp_folder(
    tmp_path: Path, job_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # torch's spawn writes a raising rank's traceback to a pytorch-errorfile-*.pickle in the
    # temp folder and never deletes it; a rank launch spawned records it in its own folder.
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # the launching process's and its ranks' temp folder
    proc = run_in_session([sys.executable, str(WORKERS), "fail"], RUN_TIMEOUT_S, ROOT)
    assert proc.returncode == 3, f"exit code {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    assert "RankFailedError of rank 1" in proc.stdout and "rank one fails on purpose" in proc.stdout
    assert sorted(p.name for p in temp.iterdir()) == []
