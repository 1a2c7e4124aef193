"""A one-machine SLURM cluster for tests: Debian's slurm-wlm and munge, private to a folder.

Everything lives under one folder: a munge key and socket, ``slurm.conf``, the state and
spool directories, the logs and the daemons' PID files. The daemons listen on free ports
and use their own munge socket, so the cluster touches nothing system-wide and leaves any
real SLURM configuration of the machine alone; clients reach it through ``SLURM_CONF``
(see :meth:`SlurmCluster.env`).

From Python (what ``tests/multinode/test_slurm.py`` does)::

    ensure_slurm()                      # apt-get install slurm-wlm munge, when missing
    with SlurmCluster() as cluster:     # munged, slurmctld, slurmd; waits for the node
        job = cluster.sbatch(["--wrap", "srun hostname"])
        print(cluster.wait(job))        # {'JobState': 'COMPLETED', 'ExitCode': '0:0', ...}

From a shell (the cluster stays up between the two commands)::

    python tests/multinode/slurm_cluster.py start /tmp/unison-slurm   # prints the SLURM_CONF to export
    python tests/multinode/slurm_cluster.py stop /tmp/unison-slurm

Only the processes started here are ever signalled: the daemons by their recorded PIDs
(each in a session of its own, whose process group is ended with it), and jobs of this
cluster through ``scancel``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CLIENTS = ("sbatch", "srun", "scontrol", "scancel", "squeue", "sinfo")
DAEMONS = ("slurmctld", "slurmd", "munged", "mungekey")
INSTALL = ("apt-get", "install", "-y", "--no-install-recommends", "slurm-wlm", "munge")
_SBIN_PATH = os.pathsep.join(["/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin"])


class SlurmUnavailable(RuntimeError):
    """SLURM is not installed and could not be installed here; the message says why."""


def which(name: str) -> str | None:
    """Finds a program on PATH or in the sbin folders, where Debian puts the daemons."""
    return shutil.which(name) or shutil.which(name, path=_SBIN_PATH)


def missing_programs() -> list[str]:
    return [name for name in (*CLIENTS, *DAEMONS) if which(name) is None]


def ensure_slurm(install: bool = True, timeout: float = 420.0) -> float:
    """Makes sure SLURM's daemons and clients and munge are installed.

    When any is missing and ``install`` is true, installs Debian's packages:
    ``apt-get update && apt-get install -y --no-install-recommends slurm-wlm munge``
    (needs root, Debian or Ubuntu, and access to the package mirror).

    Returns:
        The seconds spent installing (0.0 when everything was there).

    Raises:
        SlurmUnavailable: naming what is missing and why it could not be installed.
    """
    missing = missing_programs()
    if not missing:
        return 0.0
    why = f"SLURM programs missing: {', '.join(missing)}"
    if not install:
        raise SlurmUnavailable(why)
    if not sys.platform.startswith("linux") or which("apt-get") is None:
        raise SlurmUnavailable(f"{why}; no apt-get here to install slurm-wlm and munge")
    if os.geteuid() != 0:
        raise SlurmUnavailable(f"{why}; installing slurm-wlm and munge with apt-get needs root")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    started = time.monotonic()
    lock = ("-o", "DPkg::Lock::Timeout=120")  # another apt-get may be running; wait for it
    for cmd in (("apt-get", *lock, "update"), (INSTALL[0], *lock, *INSTALL[1:])):
        left = timeout - (time.monotonic() - started)
        try:
            done = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=max(1.0, left), stdin=subprocess.DEVNULL
            )
        except subprocess.TimeoutExpired:
            raise SlurmUnavailable(f"{why}; `{' '.join(cmd)}` did not finish in {timeout:.0f} s") from None
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            raise SlurmUnavailable(
                f"{why}; `{' '.join(cmd)}` exited with {done.returncode}:\n" + "\n".join(tail)
            )
    still = missing_programs()
    if still:
        raise SlurmUnavailable(f"apt-get installed slurm-wlm and munge, but these are still missing: {still}")
    return time.monotonic() - started


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def node_line(name: str) -> tuple[str, int]:
    """The NodeName line for this machine, from ``slurmd -C``, and its CPU count."""
    out = subprocess.run(
        [which("slurmd") or "slurmd", "-C"], capture_output=True, text=True, timeout=30
    ).stdout.split()
    fields = dict(item.split("=", 1) for item in out if "=" in item)
    cpus = int(fields.get("CPUs", os.cpu_count() or 1))
    topology = [
        f"{k}={fields[k]}"
        for k in ("Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore")
        if k in fields
    ]
    if cpus < 2:
        # Two one-CPU tasks need two CPUs; slurmd accepts more than it sees with config_overrides.
        cpus, topology = 2, []
    return f"NodeName={name} NodeAddr=127.0.0.1 CPUs={cpus} {' '.join(topology)} State=UNKNOWN", cpus


class SlurmCluster:
    """munged, slurmctld and slurmd for one node, ``localhost``, all under ``base``.

    Args:
        base: the folder for everything; default a new temporary one, removed by
            :meth:`stop`. Its path must be short enough for a UNIX socket (~100 chars).
    """

    NODE = "localhost"
    PARTITION = "debug"

    def __init__(self, base: str | os.PathLike[str] | None = None) -> None:
        self._own_base = base is None
        self.base = Path(base or tempfile.mkdtemp(prefix="unison-slurm-"))
        self.conf = self.base / "slurm.conf"
        self.socket = self.base / "munge" / "munge.socket"
        self.logs = self.base / "log"
        self.procs: dict[str, subprocess.Popen] = {}
        self.pids: dict[str, int] = {}
        self.cpus = 0

    # -- set-up ---------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """The variables a SLURM client needs to talk to this cluster (merge into os.environ)."""
        return {"SLURM_CONF": str(self.conf)}

    def client_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env.update(self.env)
        env.update(extra or {})
        return env

    def write_config(self) -> None:
        b = self.base
        self.base.chmod(0o755)  # munged wants every folder above its socket searchable
        for sub, mode in (
            ("key", 0o700),
            ("munge", 0o755),
            ("state", 0o755),
            ("spool", 0o755),
            ("log", 0o755),
        ):
            (b / sub).mkdir(mode=mode, exist_ok=True)
            (b / sub).chmod(mode)
        key = b / "key" / "munge.key"
        if not key.exists():
            subprocess.run(
                [which("mungekey") or "mungekey", "--create", f"--keyfile={key}"], check=True, timeout=30
            )
        key.chmod(0o600)
        node, self.cpus = node_line(self.NODE)
        lines = [
            "# Written by tests/multinode/slurm_cluster.py: one node on this machine.",
            "ClusterName=unisontest",
            f"SlurmctldHost={self.NODE}",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.socket}",
            f"StateSaveLocation={b / 'state'}",
            f"SlurmdSpoolDir={b / 'spool'}",
            f"SlurmctldPidFile={b / 'slurmctld.pid'}",
            f"SlurmdPidFile={b / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.logs / 'slurmctld.log'}",
            f"SlurmdLogFile={self.logs / 'slurmd.log'}",
            "MailProg=/bin/true",
            "ProctrackType=proctrack/linuxproc",  # no cgroups needed
            "TaskPlugin=task/none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/filetxt",  # one line per finished job, with its exit code
            f"JobCompLoc={b / 'jobcomp.txt'}",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/backfill",
            "MpiDefault=none",
            "ReturnToService=2",
            "SlurmdParameters=config_overrides",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "MinJobAge=3600",  # finished jobs stay visible to scontrol show job
            "KillWait=10",
            node,
            f"PartitionName={self.PARTITION} Nodes={self.NODE} Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _start(self, name: str, cmd: list[str]) -> None:
        log = open(self.logs / f"{name}.out", "ab")
        try:
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.client_env(),
                start_new_session=True,  # its own process group, ended with it
            )
        finally:
            log.close()
        self.procs[name] = proc
        self.pids[name] = proc.pid
        (self.base / "pids.json").write_text(json.dumps(self.pids))

    def start(self, timeout: float = 60.0) -> SlurmCluster:
        """Starts munged, slurmctld and slurmd, and waits until the node is idle."""
        self.write_config()
        munge_dir = self.base / "munge"
        self._start(
            "munged",
            [
                which("munged") or "munged", "--foreground",
                f"--socket={self.socket}",
                f"--key-file={self.base / 'key' / 'munge.key'}",
                f"--pid-file={munge_dir / 'munged.pid'}",
                f"--log-file={self.logs / 'munged.log'}",
                f"--seed-file={munge_dir / 'munged.seed'}",
            ],
        )  # fmt: skip
        self._wait_for(lambda: self.socket.exists(), timeout, "munged to create its socket")
        self._start("slurmctld", [which("slurmctld") or "slurmctld", "-D", "-f", str(self.conf)])
        self._wait_for(
            lambda: self._run(["scontrol", "ping"], check=False).returncode == 0, timeout, "slurmctld"
        )
        self._start("slurmd", [which("slurmd") or "slurmd", "-D", "-N", self.NODE, "-f", str(self.conf)])
        self._wait_for(lambda: self.node_state().startswith("IDLE"), timeout, f"node {self.NODE} to be idle")
        return self

    def _wait_for(self, ready: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = {name: p.returncode for name, p in self.procs.items() if p.poll() is not None}
            if dead:
                raise RuntimeError(f"waiting for {what}: {dead} exited\n{self.diagnostics()}")
            if ready():
                return
            time.sleep(0.25)
        raise RuntimeError(f"waited {timeout:.0f} s for {what}\n{self.diagnostics()}")

    # -- using it -------------------------------------------------------------------------

    def _run(
        self, cmd: list[str], check: bool = True, timeout: float = 30.0, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [which(cmd[0]) or cmd[0], *cmd[1:]],
            env=env or self.client_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
        if check and done.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd)}` exited with {done.returncode}: {done.stderr.strip()}")
        return done

    def scontrol(self, *args: str) -> str:
        """Runs ``scontrol ARGS`` against this cluster; returns its output."""
        return self._run(["scontrol", *args]).stdout

    def node_state(self) -> str:
        done = self._run(["sinfo", "-h", "-N", "-n", self.NODE, "-o", "%T"], check=False)
        return done.stdout.strip().upper() if done.returncode == 0 else ""

    def sbatch(self, args: list[str], env: dict[str, str] | None = None) -> int:
        """Submits a job (``sbatch --parsable ARGS``); returns its id."""
        done = self._run(["sbatch", "--parsable", *args], env=self.client_env(env))
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """``scontrol show job``'s fields for a job (JobState, ExitCode, RunTime, ...)."""
        done = self._run(["scontrol", "-o", "show", "job", str(job_id)], check=False)
        fields: dict[str, str] = {}
        for item in done.stdout.split():
            key, sep, value = item.partition("=")
            if sep and key not in fields:
                fields[key] = value
        return fields

    def completed(self, job_id: int) -> dict[str, str] | None:
        """The job's line in the job completion log (written when it ends), as fields."""
        path = self.base / "jobcomp.txt"
        if not path.exists():
            return None
        for line in path.read_text().splitlines():
            fields = dict(item.partition("=")[::2] for item in line.split())
            if fields.get("JobId") == str(job_id):
                return fields
        return None

    def wait(self, job_id: int, timeout: float, poll: float = 0.5) -> dict[str, str]:
        """Waits for a job to end; on timeout cancels it and raises TimeoutError."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            info = self.job(job_id)
            if info.get("JobState") not in (
                None,
                "PENDING",
                "CONFIGURING",
                "RUNNING",
                "COMPLETING",
                "SUSPENDED",
            ):
                return info
            time.sleep(poll)
        self.cancel(job_id)
        raise TimeoutError(
            f"job {job_id} did not end in {timeout:.0f} s: {self.job(job_id)}\n{self.diagnostics()}"
        )

    def cancel(self, job_id: int, sig: str | None = None) -> None:
        """``scancel [--signal=SIG] JOB``: with a signal, to the job's steps (its srun tasks)."""
        cmd = ["scancel", str(job_id)] if sig is None else ["scancel", f"--signal={sig}", str(job_id)]
        self._run(cmd, check=sig is not None)

    def batch_step_done(self, job_id: int) -> int:
        """How many times the job's batch step has finished, from slurmd's log."""
        path = self.logs / "slurmd.log"
        return (
            path.read_text(errors="replace").count(f"[{job_id}.batch] done with job") if path.exists() else 0
        )

    def diagnostics(self, lines: int = 25) -> str:
        out = []
        for path in sorted(self.logs.glob("*")):
            with contextlib.suppress(OSError):
                tail = path.read_text(errors="replace").splitlines()[-lines:]
                out.append(f"--- {path.name} ---\n" + "\n".join(tail))
        return "\n".join(out)

    # -- tear-down ------------------------------------------------------------------------

    def stop(self, timeout: float = 30.0) -> None:
        """Cancels this cluster's jobs, then ends the daemons started here, and only them."""
        if "slurmctld" in self.pids and _alive(self.pids["slurmctld"], "slurmctld"):
            with contextlib.suppress(Exception):
                jobs = self._run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
                for job_id in jobs:
                    self._run(["scancel", job_id], check=False)
                deadline = time.monotonic() + timeout
                while jobs and time.monotonic() < deadline:
                    time.sleep(0.5)
                    jobs = self._run(["squeue", "-h", "-o", "%i"], check=False).stdout.split()
        for name in ("slurmd", "slurmctld", "munged"):  # the reverse of the start order
            pid = self.pids.get(name)
            if pid is None or not _alive(pid, name):
                continue
            proc = self.procs.get(name)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
            if not _reap(pid, proc, 10.0):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
                _reap(pid, proc, 5.0)
        self.procs.clear()
        self.pids.clear()
        with contextlib.suppress(FileNotFoundError):
            (self.base / "pids.json").unlink()
        if self._own_base:
            shutil.rmtree(self.base, ignore_errors=True)

    @classmethod
    def attach(cls, base: str | os.PathLike[str]) -> SlurmCluster:
        """The cluster a ``start`` from the shell left running under ``base``."""
        cluster = cls(base)
        cluster.pids = json.loads((cluster.base / "pids.json").read_text())
        return cluster

    def __enter__(self) -> SlurmCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _alive(pid: int, name: str) -> bool:
    """Whether ``pid`` is still the daemon ``name`` (not a PID reused by something else)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return Path(cmdline.decode(errors="replace")).name == name


def _reap(pid: int, proc: subprocess.Popen | None, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return True
        elif not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.1)
    return False


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description="A one-machine SLURM cluster for unison's tests.")
    parser.add_argument("command", choices=["install", "start", "stop"])
    parser.add_argument("base", nargs="?", default="/tmp/unison-slurm", help="the cluster's folder")
    args = parser.parse_args(argv)
    if args.command == "install":
        print(f"installed in {ensure_slurm():.1f} s" if missing_programs() else "already installed")
        return 0
    if args.command == "start":
        ensure_slurm()
        Path(args.base).mkdir(parents=True, exist_ok=True)
        cluster = SlurmCluster(args.base).start()
        print(f"cluster up: export SLURM_CONF={cluster.conf}")
        return 0
    SlurmCluster.attach(args.base).stop()
    print("cluster stopped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
