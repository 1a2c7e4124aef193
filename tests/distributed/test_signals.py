"""Signals from outside a spawned job: a scheduler's SIGTERM/SIGUSR1 to the whole process group or to
the launcher alone, a terminal's Ctrl-C; and the warnings multiprocessing must not print at exit.

Each job runs ``launch`` in a script of its own, in a session of its own (``start_new_session``), so
that the test can signal its process group as SLURM, Kubernetes or a terminal would, and check that
nothing of it is left afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from _procs import kill_tree

from unison.checkpoint.manifest import MANIFEST, Manifest
from unison.distributed.launcher import EXIT_INTERRUPTED, EXIT_PREEMPTED

HERE = Path(__file__).resolve().parent
HANDLERS = HERE.parent / "handlers"
START_S = 150.0  # two ranks start in about 25 s on 2 busy shared cores; generous

# 40 samples, 4 a batch on each of 2 ranks: 5 iterations an epoch, a sync point every 3.
JOB = dict(size=40, sync_every=3, max_epochs=400, pace_s=0.05)

SCRIPT = """\
import sys
sys.path[:0] = [{handlers!r}, {here!r}]
from {module} import {function}
from unison.distributed import launch

if __name__ == "__main__":
    launch(
        {function}, *{args!r}, nproc_per_node=2, start_method={start_method!r}, timeout=60, deadline=400,
        **{kwargs!r},
    )
    print("launch returned")
"""


def _start(tmp_path: Path, module: str, function: str, args: tuple, kwargs: dict, start_method: str):
    script = tmp_path / "job.py"
    script.write_text(
        SCRIPT.format(
            handlers=str(HANDLERS),
            here=str(HERE),
            module=module,
            function=function,
            args=args,
            kwargs=kwargs,
            start_method=start_method,
        )
    )
    log = open(tmp_path / "job.log", "w")  # noqa: SIM115 - closed by the caller's _output
    proc = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        cwd=tmp_path,
    )
    log.close()
    return proc


def _output(tmp_path: Path) -> str:
    return (tmp_path / "job.log").read_text()


def _wait_for(paths: list[Path], proc: subprocess.Popen, tmp_path: Path, seconds: float = START_S) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if proc.poll() is not None:
            pytest.fail(
                f"the job ended (code {proc.returncode}) before training was under way:\n{_output(tmp_path)[-3000:]}"
            )
        if time.monotonic() > deadline:
            pytest.fail(f"training was not under way after {seconds:g} s:\n{_output(tmp_path)[-3000:]}")
        time.sleep(0.05)


def _group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _assert_nothing_left(pgid: int, seconds: float = 10.0) -> None:
    """The job's helpers (fork server, resource tracker) leave once the launcher has gone."""
    deadline = time.monotonic() + seconds
    while (left := _group_members(pgid)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes of the job still running after it exited: {left}"


def _signal(how: str, sig: signal.Signals, proc: subprocess.Popen, marks: Path) -> None:
    if how == "group":  # SLURM, Kubernetes, a terminal: every process of the job
        os.killpg(proc.pid, sig)
    elif how == "launcher":  # kill <pid>, or a container's PID 1
        os.kill(proc.pid, sig)
    else:  # one rank alone
        os.kill(int((marks / "rank1.pid").read_text()), sig)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sig, how, start_method",
    [
        (signal.SIGTERM, "group", "spawn"),
        (signal.SIGUSR1, "group", "forkserver"),
        (signal.SIGTERM, "launcher", "forkserver"),
    ],
    ids=["SIGTERM-group-spawn", "SIGUSR1-group-forkserver", "SIGTERM-launcher-forkserver"],
)
def test_a_signal_from_outside_ends_in_one_agreed_checkpoint_and_exit_75(tmp_path, sig, how, start_method):
    folder, marks = tmp_path / "ckpt", tmp_path / "marks"
    marks.mkdir()
    kwargs = dict(JOB, checkpoint=dict(every_epochs=None, at_end=False, keep_last=None))
    proc = _start(
        tmp_path, "_ckpt_workers", "train_until_signalled", (str(folder), str(marks)), kwargs, start_method
    )
    try:
        _wait_for([marks / "rank0.pid", marks / "rank1.pid"], proc, tmp_path)
        _signal(how, sig, proc, marks)
        code = proc.wait(timeout=120)
        output = _output(tmp_path)
        assert code == EXIT_PREEMPTED == 75, output[-3000:]
        _assert_nothing_left(proc.pid)
    finally:
        kill_tree(proc)
    reports = [torch.load(marks / f"report-rank{r}.pt", weights_only=True) for r in range(2)]
    iterations = {r["iteration"] for r in reports}
    assert len(iterations) == 1, f"the ranks stopped at different iterations: {reports}"
    (agreed,) = iterations
    assert agreed % JOB["sync_every"] == 0 or agreed % 5 == 0, f"iteration {agreed} is no sync point"
    assert all(r["triggered"] for r in reports)
    assert reports[0]["signalled"] == sig or reports[1]["signalled"] == sig
    files = sorted(p.name for p in folder.glob("*.pt"))
    assert files == reports[0]["saved"] and len(files) == 1 and reports[1]["saved"] == [], (
        f"expected exactly one checkpoint, the preemption's: {files}, rank 0 saved {reports[0]['saved']}"
    )
    entries = json.loads((folder / MANIFEST).read_text())["checkpoints"]
    assert [(e["file"], e["iteration"]) for e in entries] == [(files[0], agreed)]
    meta = torch.load(folder / files[0], weights_only=True)["meta"]
    assert (meta["iteration"], meta["world_size"]) == (agreed, 2)
    assert "leaked semaphore" not in output, output[-3000:]
    assert "launch returned" not in output


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ctrl_c_to_the_launcher_stops_the_ranks_promptly_with_130_and_an_intact_last_checkpoint(tmp_path):
    folder, marks = tmp_path / "ckpt", tmp_path / "marks"
    marks.mkdir()
    kwargs = dict(JOB, checkpoint=dict(every_epochs=None, every_iters=3, at_end=False, keep_last=None))
    proc = _start(
        tmp_path, "_ckpt_workers", "train_until_signalled", (str(folder), str(marks)), kwargs, "spawn"
    )
    try:
        _wait_for([marks / "rank0.pid", marks / "rank1.pid", folder / MANIFEST], proc, tmp_path)
        ranks = [int((marks / f"rank{r}.pid").read_text()) for r in range(2)]
        os.kill(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        code = proc.wait(timeout=60)
        took = time.monotonic() - sent
        output = _output(tmp_path)
        assert code == EXIT_INTERRUPTED == 130, output[-3000:]
        assert took < 15, f"the job took {took:.1f} s to stop after Ctrl-C"
        assert not [pid for pid in ranks if Path(f"/proc/{pid}").exists() and _state(pid) != "Z"], (
            "ranks outlived their launcher"
        )
        _assert_nothing_left(proc.pid)
    finally:
        kill_tree(proc)
    entries = json.loads((folder / MANIFEST).read_text())["checkpoints"]
    assert entries, "no checkpoint recorded before the interrupt"
    newest = Manifest(folder).rebuild().newest_complete()
    assert newest is not None and Path(newest).name == entries[-1]["file"]
    meta = torch.load(newest, weights_only=True)["meta"]
    assert meta["iteration"] == entries[-1]["iteration"]
    assert "launch returned" not in output


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_preempted_spawn_run_leaves_no_leaked_semaphore_warning(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    proc = _start(tmp_path, "_signal_workers", "preempted_with_slow_teardown", (str(marks),), {}, "spawn")
    try:
        code = proc.wait(timeout=180)
        _assert_nothing_left(proc.pid)
    finally:
        kill_tree(proc)
    output = _output(tmp_path)
    assert code == EXIT_PREEMPTED, output[-3000:]
    assert (marks / "rank0-tearing-down").exists(), output[-3000:]
    assert "leaked semaphore" not in output, output[-3000:]


BLOCKED_CALLER = """
import json, signal, sys
from unison.distributed import launch

def blocked() -> list[int]:
    return sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))

if __name__ == "__main__":
    # The caller blocks the signals before its first launch, which starts the fork server.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGUSR1})
    print(json.dumps(launch(blocked, nproc_per_node=2, backend="gloo", start_method="forkserver")))
"""


@pytest.mark.timeout(120)
def test_ranks_take_sigterm_and_sigusr1_even_from_a_caller_that_blocks_them(tmp_path):
    """A rank must take the launcher's SIGTERM and SIGUSR1 (the first failure ends the others
    with SIGTERM; a preemption is relayed with them) whatever the mask of the thread that started
    its fork server. Before, such a rank kept SIGUSR1 blocked."""
    script = tmp_path / "caller.py"
    script.write_text(BLOCKED_CALLER)
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=100
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    masks = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(masks) == 2
    for mask in masks:
        assert int(signal.SIGTERM) not in mask and int(signal.SIGUSR1) not in mask, masks


SERVER_MASKS = """
import gc, json, multiprocessing, signal, sys, threading
from multiprocessing import forkserver, resource_tracker
from unison.distributed.fork_server import start_fork_server

def blocked(queue) -> None:  # a rank's first instruction, before any group
    queue.put((sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])), gc.get_freeze_count()))

def mask_of(pid: int) -> list[int]:
    line = next(l for l in open(f"/proc/{pid}/status") if l.startswith("SigBlk:"))
    bits = int(line.split()[1], 16)
    return [n for n in range(1, 65) if bits >> (n - 1) & 1]

if __name__ == "__main__":
    tracker_first, new_interpreter = sys.argv[1] == "1", sys.argv[2] == "1"
    if tracker_first:  # a DataLoader or a launch earlier in this process started it
        resource_tracker.ensure_running()
    if new_interpreter:  # another thread: the server starts as a new interpreter, not a fork of this one
        stop = threading.Event()
        threading.Thread(target=stop.wait, daemon=True).start()
    start_fork_server()
    context = multiprocessing.get_context("forkserver")
    queue = context.SimpleQueue()
    child = context.Process(target=blocked, args=(queue,))
    child.start()
    rank, frozen = queue.get()
    print(json.dumps({"server": mask_of(forkserver._forkserver._forkserver_pid), "rank": rank, "frozen": frozen}))
    child.join()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("tracker_first", "new_interpreter"),
    [(True, False), (False, False), (False, True)],
    ids=[
        "tracker-running-forked-server",
        "tracker-started-with-forked-server",
        "tracker-started-with-new-server",
    ],
)
def test_the_fork_server_blocks_the_preemption_signals_and_its_ranks_take_them_from_their_start(
    tmp_path, tracker_first, new_interpreter
):
    """The server must hold SIGTERM and SIGUSR1 blocked (a job-wide signal must not end it), and a
    rank must take them from its first instruction: a rank still forming its group, for a peer
    that had failed, kept the launcher's SIGTERM pending until its SIGKILL 30 s later. Before, the
    tracker's start lifted SIGTERM in the starting thread (a server started with it deliverable),
    and a server started after the tracker handed its ranks SIGTERM blocked until their group existed."""
    script = tmp_path / "masks.py"
    script.write_text(SERVER_MASKS)
    proc = subprocess.run(
        [sys.executable, str(script), str(int(tracker_first)), str(int(new_interpreter))],
        cwd=tmp_path, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    masks = json.loads(proc.stdout.strip().splitlines()[-1])
    preemption = {int(signal.SIGTERM), int(signal.SIGUSR1)}
    assert preemption <= set(masks["server"]), masks
    assert not preemption & set(masks["rank"]), masks
    # The same at-fork hook froze the server's objects (torch's among them) out of the rank's
    # garbage collections, for either kind of server.
    assert masks["frozen"] > 100_000, masks


def test_importing_the_servers_own_module_elsewhere_changes_nothing_in_how_this_process_forks() -> None:
    """``unison.distributed.fork_server_ranks`` installs its at-fork hooks only in a fork server.
    Imported by another process (pytest's ``--doctest-modules`` imports every module), it froze
    that process's objects at each of its forks, so its later garbage was never collected."""
    import gc

    import unison.distributed.fork_server_ranks as server_only

    assert not server_only._installed
    frozen_before = gc.get_freeze_count()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports the freeze count it started with, and nothing else
        os.write(write, str(gc.get_freeze_count()).encode())
        os._exit(0)
    os.close(write)
    try:
        reported = os.read(read, 64).decode()
    finally:
        os.close(read)
        os.waitpid(pid, 0)
    assert int(reported) == frozen_before == gc.get_freeze_count()
