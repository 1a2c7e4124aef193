"""What launched this process, and which device and backend each rank should use."""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

Launcher = Literal["torchrun", "slurm", "spawn", "none"]

# torchrun (torch.distributed.run) always exports these three to every worker.
_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
# srun exports these to every task of a job step.
_SLURM_VARS = ("SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
# Set on processes that unison's own launch() spawned.
SPAWNED_VAR = "UNISON_SPAWNED"
# SLURM_STEP_ID of the steps that are no srun task: the batch script, the external step
# (processes adopted by pam_slurm_adopt) and salloc's interactive step, by name or by number.
_NOT_SRUN_STEPS = frozenset(
    {"batch", "extern", "interactive", "4294967294", "4294967295", "4294967290", "4294967293"}
)


@dataclass(frozen=True)
class LauncherInfo:
    """The launcher that started this process and the placement it gave it."""

    kind: Launcher
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    def describe(self) -> str:
        if self.kind == "none":
            return "no launcher"
        who = {"torchrun": "torchrun", "slurm": "srun (SLURM)", "spawn": "unison.distributed.launch"}[
            self.kind
        ]
        return f"{who} (RANK={self.rank}, LOCAL_RANK={self.local_rank}, WORLD_SIZE={self.world_size})"


def detect_launcher(environ: os._Environ[str] | dict[str, str] | None = None) -> LauncherInfo:
    """Reports which launcher, if any, started this process, from its environment variables.

    torchrun wins over SLURM when both are present (torchrun started inside an sbatch job):
    torchrun's variables then describe the process, SLURM's the allocation.
    """
    env = os.environ if environ is None else environ
    if env.get(SPAWNED_VAR) == "1" and all(k in env for k in _TORCHRUN_VARS):
        return LauncherInfo("spawn", int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]))
    if all(k in env for k in _TORCHRUN_VARS):
        return LauncherInfo("torchrun", int(env["RANK"]), int(env["LOCAL_RANK"]), int(env["WORLD_SIZE"]))
    # srun sets SLURM_STEP_ID; the batch script itself (SLURM_JOB_ID only) is one process
    # that has not been placed by srun, and treating it as a rank would hang the job.
    if all(k in env for k in _SLURM_VARS) and env.get("SLURM_STEP_ID", "batch") not in _NOT_SRUN_STEPS:
        return LauncherInfo(
            "slurm",
            int(env["SLURM_PROCID"]),
            int(env["SLURM_LOCALID"]),
            int(env["SLURM_NTASKS"]),
        )
    return LauncherInfo("none")


def slurm_batch_placement(environ: os._Environ[str] | dict[str, str] | None = None) -> str | None:
    """SLURM's task placement inherited by a process that is no srun task, if any.

    The batch script of an sbatch job (and salloc's shell) carries ``SLURM_*`` variables
    describing the allocation's tasks, which are not the ranks a local spawn starts.
    Returns them as ``"SLURM_PROCID=0, SLURM_NTASKS=4, ..."`` for a log line, or None
    outside SLURM, under srun (each task is a rank), and under torchrun.
    """
    env = os.environ if environ is None else environ
    if "SLURM_JOB_ID" not in env or detect_launcher(env).kind != "none":
        return None
    shown = [f"{k}={env[k]}" for k in (*_SLURM_VARS[1:], "SLURM_JOB_NUM_NODES", "SLURM_STEP_ID") if k in env]
    return ", ".join(shown) or f"SLURM_JOB_ID={env['SLURM_JOB_ID']}"


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``."""
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return "nccl"
    return "gloo"


def device_for_local_rank(local_rank: int) -> torch.device:
    """The device a rank should compute on: ``cuda:LOCAL_RANK`` on GPUs, else the CPU.

    The device is chosen among those this process can see, not by the node's numbering:
    when the launcher binds one GPU per task (SLURM's ``--gpus-per-task=1``, whose
    ``CUDA_VISIBLE_DEVICES`` and ``SLURM_STEP_GPUS`` name one device, or a per-rank
    ``CUDA_VISIBLE_DEVICES``), the process sees a single device, which is ``cuda:0``
    whatever its local rank (``SLURM_LOCALID``).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if count == 1:
        return torch.device("cuda", 0)
    if local_rank >= count:
        raise RuntimeError(
            f"LOCAL_RANK={local_rank} but this process sees only {count} GPUs "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')!r}, "
            f"SLURM_STEP_GPUS={os.environ.get('SLURM_STEP_GPUS', '<unset>')!r}). "
            "Start at most one process per visible GPU, or make every GPU of the node visible "
            "(under SLURM, ask for --gpus-per-task=1 or for the node's GPUs with --gpus-per-node)."
        )
    return torch.device("cuda", local_rank)


GROUP_ENV = ("TORCH_", "GLOO_", "NCCL_", "PYTORCH_")
"""Prefixes of the environment variables torch reads as ``torch.distributed`` is imported or as a
process group is created (the debug level and its checking wrapper, gloo's interface and transport,
NCCL's settings, torch's logging). A process that hands out ranks forked from an earlier state (a
fork server, run_distributed's warm process) must have had the same ones."""


def group_env(environ: os._Environ[str] | dict[str, str] | None = None) -> dict[str, str]:
    """The variables of ``environ`` (default: this process's) with a :data:`GROUP_ENV` prefix."""
    environ = os.environ if environ is None else environ
    return {key: value for key, value in environ.items() if key.startswith(GROUP_ENV)}


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing listens on right now, for a rendezvous store.

    The port is drawn at random below the kernel's ephemeral range
    (``/proc/sys/net/ipv4/ip_local_port_range``), where the kernel never puts a socket by
    itself. A port from inside the range, the kernel's own pick, stays free only until the
    next outgoing connection or ``bind(port=0)``, and gloo binds one per peer while its
    ranks connect: between the pick and the store's bind, seconds later once the ranks have
    imported torch, another job on the machine took it now and then (``EADDRINUSE``). The
    kernel's pick remains the fallback when nothing below the range is free.
    """
    low = _ephemeral_low()
    if low > _PORT_FLOOR + 1024:
        draw = random.Random()  # seeded from os.urandom: forked callers draw apart
        for _ in range(64):
            port = draw.randrange(_PORT_FLOOR, low)
            if port_is_free(port, host):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_PORT_FLOOR = 20000  # below it lie more registered services' ports (databases, X11, VNC)


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range; 32768 (Linux's default) where unknown."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a server could bind ``host:port`` now.

    The probe binds as torch's rendezvous store does, with ``SO_REUSEADDR``: a port that only
    a closed connection's ``TIME_WAIT`` still names (for a minute after a run ends) is free,
    since the store binds it; a port something listens on is not.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def usable_cores() -> int:
    """The CPU cores this process may run on: its affinity mask (taskset, SLURM's binding,
    a container's cpuset) where the OS has one, else every core of the machine."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1
