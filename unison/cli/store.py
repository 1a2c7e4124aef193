"""``unison store``: the rendezvous store of torchrun jobs, on a host that trains nothing.

torchrun's c10d rendezvous keeps its state in a TCP store that, by default, the agent on the
host named by ``--rdzv-endpoint`` serves: when that host is lost (its agent, or the node of
rank 0 with it), every other agent loses the rendezvous too and the job ends, however many
nodes ``--nnodes=MIN:MAX`` would let it go on with. Served by a process of its own, on a host
that is not a training node (a login node, a small service VM), the store outlives any node:
the agents that remain re-form the group without the lost one and resume from the newest
checkpoint. Every agent is then a client, told so with ``--rdzv-conf=is_host=0``.

    unison store --port 29400                      # on the store's host; until SIGTERM or Ctrl-C
    torchrun --nnodes=1:4 --rdzv-backend=c10d --rdzv-endpoint=STOREHOST:29400 \\
        --rdzv-conf=is_host=0 --rdzv-id=JOB ... -m unison run config.yaml

docs/launching.md, "A rendezvous that outlives its host", says when to use it.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

ENDS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""The signals that end the store."""


def serve_store(port: int, *, ready: str | None = None) -> int:
    """Serves a TCP store on ``port`` (every interface) until SIGTERM, SIGINT or SIGHUP.

    Args:
        port: the port the agents' ``--rdzv-endpoint`` names; 0 picks a free one (printed).
        ready: a file to write the port to once the store listens (for scripts and tests).

    Returns:
        The exit status: 0 once a signal ended it, 2 when the port cannot be bound.
    """
    import torch.distributed as dist

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, ENDS)  # taken by sigwait below, never lost
    try:
        try:
            store = dist.TCPStore(
                "0.0.0.0", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
            )
        except (RuntimeError, ValueError) as err:  # DistNetworkError is a RuntimeError
            print(
                f"unison store: cannot serve on port {port}: {err}. Pick a free port (--port 0 picks one).",
                file=sys.stderr,
            )
            return 2
        print(
            f"unison store: serving the rendezvous store on port {store.port}. Start every agent with "
            f"--rdzv-backend=c10d --rdzv-endpoint=<this host>:{store.port} --rdzv-conf=is_host=0",
            flush=True,
        )
        if ready is not None:
            with open(ready + ".part", "w") as fh:
                fh.write(str(store.port))
            os.replace(ready + ".part", ready)
        got = signal.sigwait(ENDS)
        print(f"unison store: {signal.Signals(got).name}: stopping.", flush=True)
        del store
        return 0
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
