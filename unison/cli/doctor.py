"""``unison doctor``: what this machine and environment offer a distributed run, and what blocks one.

Each check reads the environment and returns the lines to show and the problems found
(:mod:`unison.cli.doctor_checks` for this machine, :mod:`unison.cli.launch_checks` for the
launcher, rendezvous and network); :func:`run_doctor` prints them. A problem says what is
wrong and how to fix it, and whether it blocks a run (exit status 1) or is a warning.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from typing import TextIO

from unison.cli.doctor_checks import Section, check_backends, check_gpus, check_threads, check_versions
from unison.cli.elastic_checks import check_elastic
from unison.cli.launch_checks import check_launcher, check_network, check_rendezvous
from unison.cli.private_apis import check_private_apis

CHECKS: tuple[Callable[[Mapping[str, str]], Section], ...] = (
    check_versions,
    check_gpus,
    check_backends,
    check_launcher,
    check_elastic,
    check_private_apis,
)
"""The checks that read only the environment, in report order; :func:`diagnose` adds the others."""


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
    variables; the elastic settings a torchrun job recovers with (:mod:`unison.cli.elastic_checks`);
    the master address and whether the master port is free here; the
    ``NCCL_*`` / ``GLOO_*`` variables; the CPU threads; and whether each private torch or
    ignite API unison relies on still behaves as relied on (:mod:`unison.cli.private_apis`).

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
