"""Replica-group processes for the tests here and benchmarks/fault_tolerance.py: start a group
(``_replica_worker.py``) in a session of its own, and read the lines it writes per step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

WORKER = Path(__file__).with_name("_replica_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def start(lighthouse: str, replica_id: int, out: Path, *extra: str) -> subprocess.Popen:
    """Group ``replica_id`` of the job on ``lighthouse``, writing to ``out``; end it by its PID."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    with open(out / f"output{replica_id}-{time.monotonic_ns()}.txt", "w") as log:
        return subprocess.Popen(
            [sys.executable, str(WORKER), lighthouse, str(replica_id), str(out), *extra],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def lines(out: Path, replica_id: int) -> list[dict]:
    """Every whole JSON line group ``replica_id`` wrote so far."""
    path = out / f"group{replica_id}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def steps(out: Path, replica_id: int, pid: int | None = None) -> list[dict]:
    """The committed steps group ``replica_id`` recorded (of process ``pid`` only, when given)."""
    return [x for x in lines(out, replica_id) if "step" in x and (pid is None or x["pid"] == pid)]
