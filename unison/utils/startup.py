"""A trace of a run's start-up: where the time goes from the command to the first iteration.

Set ``UNISON_STARTUP_TRACE=<file>`` and every process of a run (the launching one, each
rank) appends one line to ``<file>`` as it passes each phase of its start::

    <phase> <unix time, seconds> <pid> <rank or ->

``benchmarks/startup.py`` reads these lines into its table. The phases, in order: ``cli``
(Python and ``import unison`` done, the command parsed next), ``run`` (the recipe layer
imported), ``config`` (read and checked), ``plan``, ``checks`` (the checks before any rank
starts), ``process_group`` (a rank's group created), ``rank_plan`` (the rank's own plan),
``run_folder``, ``data``, ``model``, ``build`` (optimizer, trainer, handlers), ``first_batch``
(the first batch drawn) and ``first_iteration`` (its step done).

Without the variable :func:`mark` returns after one dictionary lookup, and the run attaches
no handler for the two iteration phases: nothing is added to the training loop. Each call
opens, appends and closes the file (a few tens of microseconds), once per phase.
"""

from __future__ import annotations

import os
import time

ENV = "UNISON_STARTUP_TRACE"


def tracing() -> bool:
    """Whether this process traces its start-up (``UNISON_STARTUP_TRACE`` is set)."""
    return bool(os.environ.get(ENV))


def mark(phase: str) -> None:
    """Appends ``phase``'s line (see the module's docstring) when ``UNISON_STARTUP_TRACE`` is set."""
    path = os.environ.get(ENV)
    if not path:
        return
    line = f"{phase} {time.time():.6f} {os.getpid()} {os.environ.get('RANK', '-')}\n"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, line.encode())  # one write of a short line: lines of several processes never mix
    finally:
        os.close(fd)
