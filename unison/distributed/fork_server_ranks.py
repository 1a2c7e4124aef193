"""Imported by the fork server as it starts (its preload), never by a launcher: the ranks it forks
take SIGTERM and SIGUSR1 from their first instruction.

The fork server runs with both signals blocked, so that a signal sent to the whole job does not
end it (``unison.distributed.signals._start_helpers``), and a process forked from it inherits that
mask. A rank lifted the block only once its process group existed; one waiting to form it, for a
peer that had already failed, left the launcher's SIGTERM pending until the SIGKILL that follows
30 seconds later. Registered here, the lift runs in each forked child before anything else.
"""

from __future__ import annotations

import os
import signal

from unison.distributed.signals import _PREEMPTION_SIGNALS

_installed = False


def install() -> None:
    """In the fork server: every process it forks from now on unblocks SIGTERM and SIGUSR1."""
    global _installed
    if not _installed:
        os.register_at_fork(after_in_child=_unblock)
        _installed = True


def _unblock() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _PREEMPTION_SIGNALS)


install()  # on import: the fork server started as a new interpreter imports this module with its preload
