"""The checks of ``unison doctor`` on how ranks start and find each other.

The launcher (torchrun, srun) and its variables, the master address and port of the
rendezvous, and the ``NCCL_*`` / ``GLOO_*`` network settings; each check returns a
:class:`~unison.cli.doctor_checks.Section`, as those of :mod:`unison.cli.doctor_checks` do.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

import torch
import torch.distributed as dist

from unison.cli.doctor_checks import Section, env_int, env_shown
from unison.distributed.env import detect_launcher, port_is_free

DEFAULT_MASTER_PORT = 29500
"""The port torchrun and ``torch.distributed`` use when ``MASTER_PORT`` is unset."""

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


def _garbled(env: Mapping[str, str]) -> list[str]:
    """The placement variables that are set but are not integers."""
    names = (*_TORCHRUN_VARS, "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS")
    return [n for n in names if n in env and env_int(env, n) is None]


def check_launcher(env: Mapping[str, str]) -> Section:
    """The launcher detected and its variables; incomplete or inconsistent ones block."""
    section = Section("Launcher")
    garbled = _garbled(env)
    if garbled:
        shown = ", ".join(f"{n}={env[n]!r}" for n in garbled)
        section.add("detected", "unknown: placement variables are not integers")
        section.problem(
            "blocks",
            f"placement variables that are not integers: {shown}",
            f"a leftover or mistyped export: unset {' '.join(garbled)}, or let torchrun/srun set them",
        )
        return section
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
    rank, world = env_int(env, "RANK"), env_int(env, "WORLD_SIZE")
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
    """The master address and port: whether the address resolves and the port is free here.

    Args:
        env: the variables to read.
        master_port: the port to check; default ``MASTER_PORT``, else 29500.
    """
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
    section.add("MASTER_ADDR", env_shown(env, "MASTER_ADDR"))
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
    launcher = "none" if _garbled(env) else detect_launcher(dict(env)).kind
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
    """The names of this host's network interfaces; empty when they cannot be listed."""
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
    """The network interfaces and the ``NCCL_*`` / ``GLOO_*`` variables that pick or limit them."""
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
