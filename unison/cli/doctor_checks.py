"""The checks of ``unison doctor`` on this machine, and the report they fill.

Each check reads the environment (a mapping of variables) and returns a :class:`Section`:
the ``name: value`` lines to show and the :class:`Problem` instances found, each with its
fix. The checks here look at this machine: versions, GPUs, backends and threads; the
launcher, rendezvous and network checks are in :mod:`unison.cli.launch_checks`.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import metadata
from typing import Literal

import torch
import torch.distributed as dist
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from unison.distributed.env import usable_cores

Severity = Literal["blocks", "warning"]
"""A problem ``blocks`` a run (``unison doctor`` exits 1) or is a ``warning``."""

_PACKAGES = (
    ("torch", "torch"),
    ("pytorch-ignite", "ignite"),
    ("unison", "unison"),
    ("tensorboardX", "tensorboardX"),
)
IGNITE_RANGE = ">=0.5.5,<0.6"
"""The ignite versions unison is tested with (its Engine overrides private methods of ignite 0.5)."""


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
        """Adds the line ``name: value``."""
        self.lines.append((name, str(value)))

    def problem(self, severity: Severity, what: str, fix: str) -> None:
        """Adds a problem: what is wrong, and how to fix it."""
        self.problems.append(Problem(severity, what, fix))


def env_shown(env: Mapping[str, str], name: str) -> str:
    """The variable ``name`` of ``env`` as a report shows it: quoted, or ``<unset>``."""
    return repr(env[name]) if name in env else "<unset>"


def env_int(env: Mapping[str, str], name: str) -> int | None:
    """The variable ``name`` of ``env`` as an integer; None when unset or not a number."""
    try:
        return int(env[name])
    except (KeyError, ValueError):
        return None


# -- checks ------------------------------------------------------------------------------


def check_versions(env: Mapping[str, str]) -> Section:
    """The versions of python, torch, ignite, unison and tensorboardX; ignite within the tested range."""
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
            if not _in_range(version, IGNITE_RANGE):
                section.problem(
                    "blocks",
                    f"pytorch-ignite {version} is outside the range unison is tested with ({IGNITE_RANGE}): "
                    "unison's Engine overrides private methods of ignite 0.5",
                    f'pip install "pytorch-ignite{IGNITE_RANGE}"',
                )
    return section


def _in_range(version: str, spec: str) -> bool:
    """Whether ``version`` satisfies ``spec`` by PEP 440 (``0.6.0rc1`` is not ``<0.6``)."""
    try:
        return SpecifierSet(spec).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def check_gpus(env: Mapping[str, str]) -> Section:
    """CUDA and the visible GPUs, and whether each local rank has one of its own."""
    section = Section("GPUs")
    visible = env.get("CUDA_VISIBLE_DEVICES")
    built = torch.version.cuda
    section.add("torch CUDA build", built or "none (CPU-only torch)")
    section.add("CUDA_VISIBLE_DEVICES", env_shown(env, "CUDA_VISIBLE_DEVICES"))
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
    local_rank = env_int(env, "LOCAL_RANK")
    if local_rank is None:
        local_rank = env_int(env, "SLURM_LOCALID")
    if available and local_rank is not None:
        if count > 1 and local_rank >= count:
            section.problem(
                "blocks",
                f"LOCAL_RANK={local_rank} but only {count} GPUs visible "
                f"(CUDA_VISIBLE_DEVICES={env_shown(env, 'CUDA_VISIBLE_DEVICES')})",
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
    """The gloo, NCCL and MPI backends of this torch build, and the default one."""
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


def check_threads(env: Mapping[str, str]) -> Section:
    """The usable CPU cores and threads, and whether the ranks of this node oversubscribe them."""
    section = Section("Threads")
    cores = usable_cores()
    section.add("CPU cores usable", cores)
    section.add("OMP_NUM_THREADS", env_shown(env, "OMP_NUM_THREADS"))
    section.add("torch threads", torch.get_num_threads())
    threads = env_int(env, "OMP_NUM_THREADS")
    if "OMP_NUM_THREADS" in env and (threads is None or threads < 1):
        section.problem(
            "warning",
            f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']!r} is not a positive integer",
            "set OMP_NUM_THREADS=1 or unset it",
        )
        return section
    per_node = env_int(env, "LOCAL_WORLD_SIZE") or env_int(env, "SLURM_NTASKS_PER_NODE")
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
