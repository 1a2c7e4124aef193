"""Processes a test started: finding all of them, torchrun's workers included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Every process below ``pid``, read from /proc (empty where there is none)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_tree(*procs: subprocess.Popen) -> None:
    """SIGKILLs what a test started: each process's group (started with ``start_new_session``)
    and every process below it, listed first so that ranks that lose their parent (torchrun puts
    them in sessions of their own) are still found. Waits for the direct children."""
    trees = {proc.pid: descendants(proc.pid) for proc in procs}
    for proc in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # start_new_session: pgid == pid
        for pid in trees[proc.pid]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


def run_in_session(
    cmd: list[str], timeout: float, cwd: Path, *, merge_output: bool = False, pass_fds: tuple[int, ...] = ()
) -> subprocess.CompletedProcess:
    """Runs ``cmd`` in a session of its own; on a timeout ends its whole process tree and fails
    the test with the end of its output (stderr folded into stdout with ``merge_output``;
    ``pass_fds`` left open in it, as its parent's descriptors)."""
    import pytest

    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_output else subprocess.PIPE,
        text=True,
        start_new_session=True,
        pass_fds=pass_fds,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"did not finish in {timeout:g} s: {' '.join(cmd)}\n{out[-4000:]}\n{(err or '')[-3000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err or "")
