"""``unison store``: a rendezvous store of its own, served until a signal ends it.

What the store is for (a torchrun job that outlives the node of rank 0) is tested with real
agents in tests/multinode/test_elastic_faults.py; here, the command itself.
"""

from __future__ import annotations

import datetime
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist
from _procs import kill_tree


def start(tmp_path: Path, port: int = 0) -> tuple[subprocess.Popen, Path]:
    ready = tmp_path / "store.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "unison", "store", "--port", str(port), "--ready", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    return proc, ready


@pytest.mark.timeout(120)
def test_the_store_serves_clients_and_ends_on_sigterm(tmp_path: Path) -> None:
    proc, ready = start(tmp_path)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        port = int(ready.read_text())
        timeout = datetime.timedelta(seconds=10)
        writer = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        writer.set("round", "1")
        del writer  # a client that leaves does not end the store
        reader = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timeout)
        assert reader.get("round") == b"1"
        del reader
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert f"serving the rendezvous store on port {port}" in out and "--rdzv-conf=is_host=0" in out
        assert "SIGTERM: stopping" in out
    finally:
        kill_tree(proc)


@pytest.mark.timeout(120)
def test_a_port_in_use_exits_2_naming_it(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc, ready = start(tmp_path, port)
        try:
            out, _ = proc.communicate(timeout=60)
        finally:
            kill_tree(proc)
    assert proc.returncode == 2, out
    assert f"cannot serve on port {port}" in out and "--port 0" in out
    assert not ready.exists()
