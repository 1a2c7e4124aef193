"""pytest plugin for every run of ignite's tests, with unison's Engine or ignite's own.

Both of its parts work in ``$UNISON_IGNITE_RUN_DIR``, a fresh folder the harness makes for
each run (without that variable the plugin does nothing):

- **Ports.** ignite's ``tests/ignite/conftest.py`` has rank 0 write a free port to the fixed
  path ``/tmp/free_port`` for the other ranks (xdist workers) to read, and delete it at each
  test's end. Two runs at once on one machine (two checkouts; the suite and a manual run)
  would read and delete each other's port. This plugin points the two functions of that
  conftest that use the path at ``$UNISON_IGNITE_RUN_DIR/free_port`` instead.
- **Deselected tests.** Each process writes the node ids that ``-m``/``--deselect`` left out
  to ``deselected-<pid>.txt``, so the harness can tell an entry of ``NOT_APPLICABLE`` that
  this run left out from one that names no test any more.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

CONFTEST = "tests.ignite.conftest"
PORT_WAIT_S = 60.0
RUN_DIR_VAR = "UNISON_IGNITE_RUN_DIR"


def _run_dir() -> Path:
    return Path(os.environ[RUN_DIR_VAR])


def _setup_free_port(local_rank: int) -> int:
    """Rank 0 picks a free port and publishes it (written aside, then renamed: no rank reads
    half a number); the others wait for it. Rank 0 deletes it before the test's last barrier."""
    path = _run_dir() / "free_port"
    if local_rank == 0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        aside = path.with_suffix(".tmp")
        aside.write_text(str(port))
        os.replace(aside, path)
        return port
    deadline = time.monotonic() + PORT_WAIT_S
    while time.monotonic() < deadline:
        if path.exists():
            return int(path.read_text())
        time.sleep(0.05)
    raise RuntimeError(f"rank {local_rank}: rank 0 published no port in {path} within {PORT_WAIT_S:g} s")


def _destroy_dist_context() -> None:
    """ignite's teardown of a test's process group, with this run's port file."""
    import torch.distributed as dist
    from ignite.distributed.utils import _SerialModel, _set_model

    if dist.get_rank() == 0:
        (_run_dir() / "free_port").unlink(missing_ok=True)
    dist.barrier()  # after the unlink: the next test never reads this test's port
    dist.destroy_process_group()
    _set_model(_SerialModel())


def pytest_plugin_registered(plugin: Any) -> None:
    if getattr(plugin, "__name__", None) != CONFTEST or RUN_DIR_VAR not in os.environ:
        return
    for name in ("_setup_free_port", "_destroy_dist_context"):
        if not callable(getattr(plugin, name, None)):
            raise RuntimeError(
                f"{CONFTEST} has no {name}() any more: ignite's fixtures changed; review this plugin"
            )
    plugin._setup_free_port = _setup_free_port
    plugin._destroy_dist_context = _destroy_dist_context


def pytest_deselected(items: list[Any]) -> None:
    if RUN_DIR_VAR not in os.environ or not items:
        return
    with open(_run_dir() / f"deselected-{os.getpid()}.txt", "a", encoding="utf-8") as out:
        out.write("".join(f"{item.nodeid}\n" for item in items))
