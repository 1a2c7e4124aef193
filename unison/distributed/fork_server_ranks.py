"""Imported by the fork server as it starts (its preload), never by a launcher: the ranks it forks
take SIGTERM and SIGUSR1 from their first instruction, and their garbage collections walk only
the objects they made.

The fork server runs with both signals blocked, so that a signal sent to the whole job does not
end it (``unison.distributed.signals._start_helpers``), and a process forked from it inherits that
mask. A rank lifted the block only once its process group existed; one waiting to form it, for a
peer that had already failed, left the launcher's SIGTERM pending until the SIGKILL that follows
30 seconds later. Registered here, the lift runs in each forked child before anything else.

The server's objects (torch, ignite, unison and, for a server forked from the launching process,
everything that process held) are frozen before each fork (``gc.freeze``, as Python's docs advise
for a process that forks without exec): a rank's collections skip them and leave their pages
shared. Each rank collects its garbage as it leaves its group (``rank_setup._leave_group``);
over a heap left unfrozen, that pass took 0.16 s of every rank's exit (a new server's heap), and
more where the server is a fork of a launcher that holds more.
"""

from __future__ import annotations

import os
import signal
import sys

from unison.distributed.fork_server import _SERVER_CODE
from unison.distributed.rank_setup import freeze_heap
from unison.distributed.signals import _PREEMPTION_SIGNALS

_installed = False


def install() -> None:
    """In the fork server: every process it forks from now on unblocks SIGTERM and SIGUSR1, and
    starts with the server's objects frozen."""
    global _installed
    if not _installed:
        os.register_at_fork(before=freeze_heap, after_in_child=_unblock)
        _installed = True


def _unblock() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _PREEMPTION_SIGNALS)


def _started_as_fork_server() -> bool:
    """Whether this process is a fork server Python started: ``python -c "from
    multiprocessing.forkserver import main; main(...)"``. Another process that imports this
    module (a test collecting doctests, a tool listing modules) must not change how it forks."""
    argv = getattr(sys, "orig_argv", ())
    return "-c" in argv and any(arg.startswith(_SERVER_CODE) for arg in argv)


if _started_as_fork_server():  # it imports this module with its preload; a forked server calls install()
    install()
