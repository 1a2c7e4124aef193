"""Launching process of tests/distributed/test_fork_server.py: run as ``python this.py FD``.

It installs a SIGTERM handler of its own, imports a module nothing else imports
(``colorsys``) inside its ``__main__`` block, starts the fork server, launches 2 ranks twice and
prints one JSON line: what each rank saw (its imports, its handler, the objects its
garbage collections walk), the server's command line and open descriptors, and
whether ``FD`` (a descriptor the test passed to this process) is open in the server.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys


def what_a_rank_sees() -> dict:
    handler = signal.getsignal(signal.SIGTERM)
    return {
        "frozen": gc.get_freeze_count(),  # the server's objects, out of the rank's collections
        "collected": len(gc.get_objects()),  # what a collection in the rank walks
        "server": os.getppid(),
        "imported_by_the_launcher": "colorsys" in sys.modules,
        "launchers_sigterm_handler": getattr(handler, "__name__", "") == "launchers_handler",
    }


def launchers_handler(signum, frame):  # noqa: ARG001 - a handler the server must not keep
    raise SystemExit(99)


if __name__ == "__main__":
    import colorsys  # noqa: F401 - the marker: imported here only, never by the ranks' own code

    from unison.distributed import launch
    from unison.distributed.fork_server import server_pid, start_fork_server

    passed_fd = int(sys.argv[1])
    signal.signal(signal.SIGTERM, launchers_handler)
    start_fork_server()
    server = server_pid()
    first = launch(what_a_rank_sees, nproc_per_node=2, backend="gloo")
    second = launch(what_a_rank_sees, nproc_per_node=2, backend="gloo")
    server_fds = sorted(int(fd) for fd in os.listdir(f"/proc/{server}/fd"))  # the server is serving
    with open(f"/proc/{server}/cmdline", "rb") as f:
        cmdline = f.read().replace(b"\0", b" ").decode()
    print(json.dumps({
        "pid": os.getpid(), "server": server, "cmdline": cmdline, "server_fds": server_fds,
        "passed_fd": passed_fd, "ranks": first + second,
    }))  # fmt: skip
