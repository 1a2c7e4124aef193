"""``unison doctor``: what this machine and environment offer a distributed run, and what blocks one.

Each check reads the environment and returns the lines to show and the problems found;
:func:`run_doctor` prints them. A problem says what is wrong and how to fix it, and whether it
blocks a run (exit status 1) or is a warning.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Literal, TextIO

import torch
import torch.distributed as dist

from unison.distributed.env import detect_launcher, port_is_free

DEFAULT_MASTER_PORT = 29500
"""The port torchrun and ``torch.distributed`` use when ``MASTER_PORT`` is unset."""

Severity = Literal["blocks", "warning"]

_TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE")
_TORCHRUN_EXTRA = ("LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
_SLURM_VARS = (
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NNODES",
    "SLURM_JOB_NODELIST",
    "SLURM_NTASKS_PER_NODE",
    "SLURM_GPUS_ON_NODE",
)
_PACKAGES = (
    ("torch", "torch"),
    ("pytorch-ignite", "ignite"),
    ("unison", "unison"),
    ("tensorboardX", "tensorboardX"),
)
_IGNITE_RANGE = ((0, 5, 5), (0, 6, 0))


@dataclass(frozen=True)
class Problem:
    """Something wrong in this environment, and its fix."""

    severity: Severity
    what: str
    fix: str


@dataclass
class Section:
    """One block of the report: a title, ``name: value`` lines, and the problems it found."""

    title: str
    lines: list[tuple[str, str]] = field(default_factory=list)
    problems: list[Problem] = field(default_factory=list)

    def add(self, name: str, value: object) -> None:
        self.lines.append((name, str(value)))

    def problem(self, severity: Severity, what: str, fix: str) -> None:
        self.problems.append(Problem(severity, what, fix))


def _shown(env: Mapping[str, str], name: str) -> str:
    return repr(env[name]) if name in env else "<unset>"


def _int(env: Mapping[str, str], name: str) -> int | None:
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


# -- checks ------------------------------------------------------------------------------


def check_versions(env: Mapping[str, str]) -> Section:
    section = Section("Versions")
    section.add("python", f"{platform.python_version()} ({sys.executable})")
    for dist_name, _ in _PACKAGES:
        try:
            version = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            section.add(dist_name, "not installed")
            section.problem(
                "blocks", f"{dist_name} is not installed", f"pip install {dist_name} (or pip install unison)"
            )
            continue
        section.add(dist_name, version)
        if dist_name == "pytorch-ignite":
            numbers = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
            low, high = _IGNITE_RANGE
            if not low <= numbers < high:
                section.problem(
                    "blocks",
                    f"pytorch-ignite {version} is outside the range unison is tested with (>=0.5.5,<0.6): "
                    "unison's Engine overrides private methods of ignite 0.5",
                    'pip install "pytorch-ignite>=0.5.5,<0.6"',
                )
    return section


def check_gpus(env: Mapping[str, str]) -> Section:
    section = Section("GPUs")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    built = torch.version.cuda
    section.add("torch CUDA build", built or "none (CPU-only torch)")
    section.add("CUDA_VISIBLE_DEVICES", _shown(env, "CUDA_VISIBLE_DEVICES"))
    available = torch.cuda.is_available()
    count = torch.cuda.device_count() if available else 0
    section.add("CUDA available", "yes" if available else "no (ranks run on the CPU with gloo)")
    section.add("GPUs visible", count)
    for i in range(count):
        section.add(f"  cuda:{i}", torch.cuda.get_device_name(i))
    if visible is not None and visible.strip() in ("", "-1"):
        section.problem(
            "warning",
            f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU",
            "unset CUDA_VISIBLE_DEVICES (or list the GPUs to use, e.g. CUDA_VISIBLE_DEVICES=0,1); check the "
            "job script or the shell profile that sets it",
        )
    elif built and not available:
        section.problem(
            "warning",
            "torch is a CUDA build but sees no GPU",
            "check nvidia-smi and the driver; on a cluster, ask the scheduler for GPUs "
            "(--gpus-per-node / --gres=gpu:N)",
        )
    local_rank = _int(env, "LOCAL_RANK")
    if local_rank is None:
        local_rank = _int(env, "SLURM_LOCALID")
    if available and local_rank is not None:
        if count > 1 and local_rank >= count:
            section.problem(
                "blocks",
                f"LOCAL_RANK={local_rank} but only {count} GPUs visible "
                f"(CUDA_VISIBLE_DEVICES={_shown(env, 'CUDA_VISIBLE_DEVICES')})",
                f"start at most {count} processes per node (torchrun --nproc_per_node={count}, srun "
                f"--ntasks-per-node={count}), or make every GPU of the node visible",
            )
        elif count == 1 and local_rank > 0 and visible is None:
            section.problem(
                "warning",
                f"LOCAL_RANK={local_rank} and one GPU visible: every local rank would use cuda:0",
                "bind one GPU per task (srun --gpus-per-task=1), or run one process per node; NCCL refuses "
                "two ranks on one GPU ('Duplicate GPU detected')",
            )
    return section


def check_backends(env: Mapping[str, str]) -> Section:
    section = Section("Backends")
    if not dist.is_available():
        section.add("torch.distributed", "not available")
        section.problem(
            "blocks",
            "this torch build has no torch.distributed",
            "install a torch wheel from pytorch.org (the default builds include it)",
        )
        return section
    found = {
        "gloo": dist.is_gloo_available(),
        "nccl": dist.is_nccl_available(),
        "mpi": dist.is_mpi_available(),
    }
    for name, ok in found.items():
        section.add(name, "available" if ok else "not available")
    section.add("default", "nccl" if torch.cuda.is_available() and found["nccl"] else "gloo")
    if not found["gloo"]:
        section.problem(
            "blocks", "the gloo backend is not available", "install a torch wheel from pytorch.org"
        )
    if torch.cuda.is_available() and not found["nccl"]:
        section.problem(
            "warning",
            "GPUs are visible but this torch has no NCCL: ranks fall back to gloo (slow on GPUs)",
            "install a CUDA torch wheel from pytorch.org (NCCL is bundled on Linux)",
        )
    return section


def check_launcher(env: Mapping[str, str]) -> Section:
    section = Section("Launcher")
    info = detect_launcher(dict(env))
    section.add("detected", info.describe())
    for name in (*_TORCHRUN_VARS, *_TORCHRUN_EXTRA):
        if name in env:
            section.add(name, env[name])
    for name in _SLURM_VARS:
        if name in env:
            section.add(name, env[name])
    present = [n for n in _TORCHRUN_VARS if n in env]
    if present and len(present) < len(_TORCHRUN_VARS):
        missing = [n for n in _TORCHRUN_VARS if n not in env]
        section.problem(
            "blocks",
            f"torchrun variables incomplete: {', '.join(f'{n}={env[n]}' for n in present)} set but "
            f"{', '.join(missing)} not",
            "a leftover export or a hand-written launch script: unset "
            f"{' '.join(present)}, or launch with torchrun (which sets all of them)",
        )
    rank, world = _int(env, "RANK"), _int(env, "WORLD_SIZE")
    if rank is not None and world is not None and not 0 <= rank < world:
        section.problem(
            "blocks",
            f"RANK={rank} is not below WORLD_SIZE={world}",
            "fix the launch script, or let torchrun set RANK and WORLD_SIZE",
        )
    if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" not in env and info.kind == "none":
        section.problem(
            "warning",
            f"SLURM job {env['SLURM_JOB_ID']} without srun step: this process is the batch script, so a run "
            "started here is a single process",
            "launch with srun (srun unison run config.yaml), one task per GPU",
        )
    return section


def _is_local(host: str) -> bool | None:
    """Whether ``host`` names this machine; None when it does not resolve."""
    if host in ("localhost", "0.0.0.0", "::1", "") or host.startswith("127."):
        return True
    try:
        wanted = {str(a[4][0]) for a in socket.getaddrinfo(host, None)}
    except (socket.gaierror, UnicodeError):
        return None
    names = {socket.gethostname(), socket.getfqdn()}
    if host in names:
        return True
    mine: set[str] = set()
    for name in names:
        try:
            mine |= {str(a[4][0]) for a in socket.getaddrinfo(name, None)}
        except (socket.gaierror, UnicodeError):
            pass
    return bool(wanted & mine) or any(a.startswith("127.") for a in wanted)


def check_rendezvous(env: Mapping[str, str], master_port: int | None) -> Section:
    section = Section("Rendezvous")
    addr = env.get("MASTER_ADDR")
    if master_port is not None:
        port, source = master_port, "--master-port"
    elif "MASTER_PORT" in env:
        try:
            port, source = int(env["MASTER_PORT"]), "MASTER_PORT"
        except ValueError:
            section.add("MASTER_PORT", repr(env["MASTER_PORT"]))
            section.problem(
                "blocks",
                f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number",
                "set MASTER_PORT=29500 (or any free port)",
            )
            return section
    else:
        port, source = DEFAULT_MASTER_PORT, "default"
    section.add("MASTER_ADDR", _shown(env, "MASTER_ADDR"))
    if not 0 < port < 65536:
        section.add("master port", f"{port} ({source})")
        section.problem("blocks", f"master port {port} is not a TCP port", "pick a port in 1024-65535")
        return section
    local = True if addr is None else _is_local(addr)
    if local is None:
        section.problem(
            "blocks",
            f"MASTER_ADDR={addr!r} does not resolve from this host: ranks would hang at init",
            "use the master node's IP address or a name this node resolves (check with `getent hosts NAME`)",
        )
    if local is not True:
        why = "MASTER_ADDR does not resolve" if local is None else "the master is another host"
        section.add("master port", f"{port} ({source}); not checked here: {why}")
        return section
    launcher = detect_launcher(dict(env)).kind
    if port_is_free(port, host="0.0.0.0"):
        section.add("master port", f"{port} ({source}): free on this host")
    elif launcher in ("torchrun", "spawn"):
        section.add(
            "master port", f"{port} ({source}): in use, by the launcher's store (expected under {launcher})"
        )
    else:
        section.add("master port", f"{port} ({source}): IN USE on this host")
        section.problem(
            "blocks",
            f"master port {port} is in use: another job or a stale process holds it",
            "pick another with --master-port / MASTER_PORT (torchrun --master-port, or "
            f"--rdzv-endpoint=HOST:PORT), or find it with `ss -ltnp | grep {port}`; a port a run just "
            "released frees within a minute",
        )
    if port < 1024:
        section.problem(
            "warning", f"master port {port} is privileged (below 1024)", "pick a port in 1024-65535"
        )
    return section


def _interfaces() -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError:
        return []


def _ifname_matches(spec: str, names: list[str]) -> bool:
    """Whether NCCL's / gloo's interface selector ``spec`` picks any of ``names``."""
    spec = spec.strip()
    if not spec or spec.startswith("^"):  # exclusions leave the other interfaces
        return True
    exact = spec.startswith("=")
    wanted = [p for p in spec.lstrip("=").split(",") if p]
    return any((n == w) if exact else n.startswith(w) for n in names for w in wanted)


def check_network(env: Mapping[str, str]) -> Section:
    section = Section("NCCL and network")
    interfaces = _interfaces()
    section.add("interfaces", ", ".join(interfaces) or "unknown")
    shown = sorted(
        n for n in env if n.startswith(("NCCL_", "TORCH_NCCL_", "GLOO_")) or n == "TORCH_DISTRIBUTED_DEBUG"
    )
    for name in shown:
        section.add(name, env[name])
    if not shown:
        section.add("NCCL_* / GLOO_*", "none set")
    uses_nccl = torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()
    for name, blocking in (("NCCL_SOCKET_IFNAME", uses_nccl), ("GLOO_SOCKET_IFNAME", True)):
        if name in env and interfaces and not _ifname_matches(env[name], interfaces):
            section.problem(
                "blocks" if blocking else "warning",
                f"{name}={env[name]!r} matches no interface of this host ({', '.join(interfaces)})",
                f"set {name} to the interface that reaches the other nodes (see `ip -br addr`), or unset it",
            )
    if env.get("NCCL_IB_DISABLE") == "1":
        section.problem(
            "warning",
            "NCCL_IB_DISABLE=1: InfiniBand is off, so traffic between nodes goes over TCP sockets (slow)",
            "unset it unless InfiniBand is broken on this cluster",
        )
    if env.get("NCCL_P2P_DISABLE") == "1":
        section.problem(
            "warning",
            "NCCL_P2P_DISABLE=1: GPUs of this node exchange data through host memory (slower)",
            "keep it only where peer-to-peer hangs (some consumer GPUs, some VMs)",
        )
    if uses_nccl and "NCCL_DEBUG" not in env:
        section.add(
            "hint", "on an NCCL error, rerun with NCCL_DEBUG=INFO to see which interface and transport fail"
        )
    return section


def check_threads(env: Mapping[str, str]) -> Section:
    section = Section("Threads")
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    section.add("CPU cores usable", cores)
    section.add("OMP_NUM_THREADS", _shown(env, "OMP_NUM_THREADS"))
    section.add("torch threads", torch.get_num_threads())
    threads = _int(env, "OMP_NUM_THREADS")
    if "OMP_NUM_THREADS" in env and (threads is None or threads < 1):
        section.problem(
            "warning",
            f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']!r} is not a positive integer",
            "set OMP_NUM_THREADS=1 or unset it",
        )
        return section
    per_node = _int(env, "LOCAL_WORLD_SIZE") or _int(env, "SLURM_NTASKS_PER_NODE")
    if per_node and per_node > 1:
        used = per_node * (threads or torch.get_num_threads())
        if used > cores:
            section.problem(
                "warning",
                f"{per_node} ranks x {threads or torch.get_num_threads()} threads on {cores} cores: "
                "the CPU is oversubscribed",
                f"set OMP_NUM_THREADS={max(1, cores // per_node)}",
            )
    return section


CHECKS: tuple[Callable[[Mapping[str, str]], Section], ...] = (
    check_versions,
    check_gpus,
    check_backends,
    check_launcher,
)


def diagnose(master_port: int | None = None, environ: Mapping[str, str] | None = None) -> list[Section]:
    """Runs every check; reads the environment only, opens no process group.

    Args:
        master_port: the rendezvous port to check; default ``MASTER_PORT``, else 29500.
        environ: the variables to read; default ``os.environ``.
    """
    env = dict(os.environ if environ is None else environ)
    sections = [check(env) for check in CHECKS]
    sections.append(check_rendezvous(env, master_port))
    sections.append(check_network(env))
    sections.append(check_threads(env))
    return sections


def run_doctor(
    master_port: int | None = None, stream: TextIO | None = None, *, environ: Mapping[str, str] | None = None
) -> int:
    """Prints what this machine offers a distributed run and every problem found, with its fix.

    Checks the versions of python, torch, ignite, unison and tensorboardX; CUDA and the
    visible GPUs; the gloo / NCCL / MPI backends; the launcher (torchrun, srun) and its
    variables; the master address and whether the master port is free here; the
    ``NCCL_*`` / ``GLOO_*`` variables; and the CPU threads.

    Args:
        master_port: the rendezvous port to check; default ``MASTER_PORT``, else 29500.
        stream: where to print; default ``sys.stdout``.
        environ: the variables to read; default ``os.environ``.

    Returns:
        0 when nothing blocks a run (warnings may remain), 1 when something does.

    Example:
        .. code-block:: console

            $ unison doctor --master-port 29501
            $ srun --ntasks-per-node=1 unison doctor    # on every node of a SLURM job

    Distributed:
        Not a collective and opens no process group: run it on any host, inside or
        outside a launcher. Under torchrun, the master port is expected to be in use.
    """
    out = sys.stdout if stream is None else stream
    sections = diagnose(master_port, environ)
    print("unison doctor", file=out)
    for section in sections:
        print(f"\n{section.title}", file=out)
        width = max((len(name) for name, _ in section.lines), default=0)
        for name, value in section.lines:
            print(f"  {name.ljust(width)}  {value}", file=out)
    problems = [p for s in sections for p in s.problems]
    blocking = [p for p in problems if p.severity == "blocks"]
    print("", file=out)
    if not problems:
        print("No problems found.", file=out)
        return 0
    print(f"Problems ({len(blocking)} blocking, {len(problems) - len(blocking)} warnings):", file=out)
    for problem in sorted(problems, key=lambda p: p.severity != "blocks"):
        label = "BLOCKS " if problem.severity == "blocks" else "warning"
        print(f"  [{label}] {problem.what}", file=out)
        print(f"            fix: {problem.fix}", file=out)
    return 1 if blocking else 0
