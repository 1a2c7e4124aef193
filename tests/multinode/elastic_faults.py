"""Elastic faults with real torchrun agents on one machine: the runs behind
test_elastic_faults.py and benchmarks/elastic_recovery.py.

Two agents, node A (it hosts the c10d rendezvous store: ``is_host=1``) and node B, one worker
each, ``--nnodes=1:2``. The workers train one epoch of ``fault_probe.build_indexed`` (96
samples, 4 per rank and step: 12 steps at 2 ranks, 24 at 1) with a checkpoint every
``EVERY`` iterations and a sync point every iteration, and trace every step
(``fault_probe.TraceNet``). Each fault lands at a fixed step: the worker that meets it writes
a flag file, and the driver here acts when it sees that file (kills node B, starts it, or
signals its agent). Every agent runs in a session of its own; whatever happens, each run ends
by killing what is left of the processes it started (each agent's group and everything below
it, listed from /proc), and nothing else.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from _procs import kill_tree

from unison.distributed import find_free_port

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
CONFIG = ROOT / "recipes" / "digits" / "config.yaml"
SIZE, BATCH, EVERY = 96, 4, 4
TUNED = {
    "join_timeout": 60,
    "last_call_timeout": 3,
    "close_timeout": 5,
    "keep_alive_interval": 1,
    "keep_alive_max_attempt": 3,
}
"""Rendezvous settings that re-form the group in seconds. torch's defaults: join_timeout 600,
last_call_timeout 30, close_timeout 30, and a lost node is noticed after its keep-alive missed
3 times, 5 s apart."""
TORCH_DEFAULTS: dict[str, int] = {}
MONITOR_INTERVAL = 0.5
RUN_TIMEOUT_S = 150.0
RESUMED = re.compile(r"Resumed from (\S+) \(epoch \d+, iteration (\d+)\)")
REGROUPED = re.compile(r"^I\d{4} (\d\d:\d\d:\d\d\.\d+) .*Rendezvous complete for workers", re.M)


@dataclass
class Outcome:
    """What one run left: each agent's exit code and output, the steps traced, the fault's time."""

    codes: dict[str, int | None]
    outputs: dict[str, str]
    trace: list[dict[str, Any]]
    fault_t: float
    fault: dict[str, Any]

    @property
    def resumed(self) -> list[int]:
        """The iteration of each "Resumed from" line, in order, over both agents."""
        return [int(m[2]) for text in self.outputs.values() for m in RESUMED.finditer(text)]

    def before(self) -> list[dict[str, Any]]:
        """The steps of the first worker group (its processes started before the fault)."""
        return [r for r in self.trace if r["pid"] in self._first_pids()]

    def after(self) -> list[dict[str, Any]]:
        """The steps of the worker groups that followed the fault."""
        return [r for r in self.trace if r["pid"] not in self._first_pids()]

    def recovery_s(self) -> float:
        """From the fault to the first step after it."""
        return min(r["t"] for r in self.after()) - self.fault_t

    def regrouped_s(self) -> float:
        """From the fault to node A's agent's first "Rendezvous complete" after it (its log's clock)."""
        day = datetime.fromtimestamp(self.fault_t).date()
        times = [
            datetime.combine(day, datetime.strptime(m[1], "%H:%M:%S.%f").time()).timestamp()
            for m in REGROUPED.finditer(self.outputs["A"])
        ]
        return min(t for t in times if t > self.fault_t) - self.fault_t

    def redone(self) -> int:
        """The iterations the first group completed after the checkpoint the next one resumed:
        the step of the fault completes only where the worker went on (a SIGTERM)."""
        last = self.fault["at"] if self.fault["fault"] == "term" else self.fault["at"] - 1
        return last - self.resumed[0]

    def _first_pids(self) -> set[int]:
        starts: dict[int, float] = {}
        for r in self.trace:
            starts[r["pid"]] = min(starts.get(r["pid"], r["t"]), r["t"])
        return {pid for pid, t in starts.items() if t < self.fault_t}

    def show(self) -> str:
        return "\n".join(
            f"--- node {n} (exit {self.codes[n]}) ---\n{t[-3000:]}" for n, t in self.outputs.items()
        )


@dataclass
class Agents:
    """Starts torchrun agents for one job and ends whatever of them is left."""

    root: Path
    rdzv_conf: dict[str, int]
    fault: dict[str, Any]
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    port: int = field(default_factory=find_free_port)
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    timeout: float = RUN_TIMEOUT_S
    store: int | None = None
    """The port of a rendezvous store served by ``unison store`` (every agent a client); None:
    node A's agent serves it (torchrun's default for the host the endpoint names)."""

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.timeout
        if self.store is not None:
            self.port = self.store

    @property
    def flag(self) -> Path:
        return self.root / f"fault-{self.tag}"

    @property
    def trace_dir(self) -> Path:
        return self.root / f"trace-{self.tag}"

    def start(self, node: str) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "PET_"))}
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(key, None)
        env.update(
            OMP_NUM_THREADS="1",
            LOGLEVEL="INFO",  # the agents tell when they meet, restart and stop workers
            PROBE_NODE=node,
            TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",  # a shared store breaks a re-formed group
            PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), env.get("PYTHONPATH")])),
        )
        hosts = self.store is None and node == "A"
        conf = ",".join([f"is_host={int(hosts)}", *(f"{k}={v}" for k, v in self.rdzv_conf.items())])
        kwargs = {"trace": str(self.trace_dir), "flag": str(self.flag), **self.fault}
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2", f"--monitor-interval={MONITOR_INTERVAL}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{self.port}", f"--rdzv-id=faults-{self.tag}",
            f"--rdzv-conf={conf}",
            "-m", "unison.cli", "run", str(CONFIG),
            "--set", "training.max_epochs=1",
            "--set", f"training.batch_size={BATCH}",
            "--set", "training.sync_every=1",
            "--set", f"checkpoint.every_iters={EVERY}",
            "--set", "checkpoint.preemption=true",
            "--set", "early_stopping=null",
            "--set", "logging.progress=false",
            "--set", "logging.tensorboard=false",
            "--set", f"logging.root={self.root}",
            "--set", "imports=[fault_probe]",
            "--set", "model.type=!pyobject fault_probe.TraceNet",
            "--set", f"model.kwargs={json.dumps(kwargs)}",
            "--set", "data.build=!pyobject fault_probe.build_indexed",
            "--set", f"data.kwargs={{size: {SIZE}, val: 16}}",
        ]  # fmt: skip
        with open(self.root / f"agent-{self.tag}-{node}.out", "w") as fh:
            self.procs[node] = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
            )

    def output(self, node: str) -> str:
        return (self.root / f"agent-{self.tag}-{node}.out").read_text()

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        """Polls ``ready`` until it holds; fails (with the agents' output) past the deadline or
        when every agent has exited first."""
        while not ready():
            if time.monotonic() > self.deadline or all(p.poll() is not None for p in self.procs.values()):
                raise AssertionError(f"{what}: not seen before the agents ended or timed out\n{self.show()}")
            time.sleep(0.05)

    def flag_time(self) -> float:
        self.wait_until(
            lambda: self.flag.exists() and self.flag.read_text() != "",
            f"the fault at step {self.fault['at']}",
        )
        return float(self.flag.read_text())

    def kill(self, node: str) -> None:
        kill_tree(self.procs[node])

    def finish(self, fault_t: float) -> Outcome:
        """Waits for every agent to exit and collects the run's outcome."""
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(1.0, self.deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                break
        codes = {n: p.poll() for n, p in self.procs.items()}
        return Outcome(codes, {n: self.output(n) for n in self.procs}, self._trace(), fault_t, self.fault)

    def _trace(self) -> list[dict[str, Any]]:
        lines = []
        for path in sorted(self.trace_dir.glob("*.jsonl")) if self.trace_dir.exists() else []:
            lines += [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
        return sorted(lines, key=lambda r: r["t"])

    def show(self) -> str:
        return "\n".join(f"--- node {n} ---\n{self.output(n)[-3000:]}" for n in self.procs)

    def __enter__(self) -> Agents:
        return self

    def __exit__(self, *exc: Any) -> None:
        running = [p for p in self.procs.values() if p.poll() is None]
        if running:
            kill_tree(*running)


def start_both(agents: Agents) -> None:
    """B first, A once B's agent runs: B then waits for A's store, so both arrive within the
    last call and the group forms at 2."""
    agents.start("B")
    agents.wait_until(lambda: "Starting elastic_operator" in agents.output("B"), "node B's agent starting")
    agents.start("A")


def node_lost(root: Path, rdzv_conf: dict[str, int], at: int = 7, timeout: float = RUN_TIMEOUT_S) -> Outcome:
    """Node B's worker stops at step ``at``; B's agent and its worker are then killed (SIGKILL)."""
    with Agents(root, rdzv_conf, {"node": "B", "at": at, "fault": "hang"}, timeout=timeout) as agents:
        start_both(agents)
        agents.flag_time()
        fault_t = time.time()
        agents.kill("B")
        return agents.finish(fault_t)


def host_lost(
    root: Path,
    rdzv_conf: dict[str, int],
    store: int | None,
    who: str = "rank0",
    at: int = 7,
    timeout: float = RUN_TIMEOUT_S,
) -> tuple[Outcome, str]:
    """The worker of ``who`` (a node, or ``"rank0"``: rank 0's) stops at step ``at``; its node
    (agent and worker) is then killed (SIGKILL). ``store``: the port of a ``unison store`` the
    agents use, or None for the store node A's agent serves. Returns the outcome and the node
    that was lost."""
    with Agents(
        root, rdzv_conf, {"node": who, "at": at, "fault": "hang"}, timeout=timeout, store=store
    ) as agents:
        start_both(agents)
        agents.flag_time()
        fault_t = time.time()
        lost = (
            who
            if who != "rank0"
            else next(r["node"] for r in agents._trace() if r["rank"] == 0 and r["step"] == at)
        )
        agents.kill(lost)
        return agents.finish(fault_t), lost


def worker_crash(
    root: Path, rdzv_conf: dict[str, int], at: int = 7, timeout: float = RUN_TIMEOUT_S
) -> Outcome:
    """Node B's worker kills itself (SIGKILL) at step ``at``; both agents live on."""
    with Agents(root, rdzv_conf, {"node": "B", "at": at, "fault": "crash"}, timeout=timeout) as agents:
        start_both(agents)
        fault_t = agents.flag_time()
        return agents.finish(fault_t)


def node_joins(root: Path, rdzv_conf: dict[str, int], at: int = 6, timeout: float = RUN_TIMEOUT_S) -> Outcome:
    """Node A trains alone; at its step ``at`` node B's agent starts (the fault's time) and joins."""
    with Agents(root, rdzv_conf, {"node": "A", "at": at, "fault": "term"}, timeout=timeout) as agents:
        agents.start("A")
        agents.flag_time()
        fault_t = time.time()
        agents.start("B")
        return agents.finish(fault_t)


def agent_sigterm(
    root: Path, rdzv_conf: dict[str, int], at: int = 6, timeout: float = RUN_TIMEOUT_S
) -> Outcome:
    """At step ``at`` of node B's worker, B's agent (and only it) gets SIGTERM."""
    with Agents(root, rdzv_conf, {"node": "B", "at": at, "fault": "term"}, timeout=timeout) as agents:
        start_both(agents)
        agents.flag_time()
        fault_t = time.time()
        os.kill(agents.procs["B"].pid, signal.SIGTERM)
        return agents.finish(fault_t)
