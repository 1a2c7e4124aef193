"""unison/distributed/env.py: the free-port probe agrees with torch's rendezvous store.

A run that ends leaves its store's port in TIME_WAIT for about a minute. The store binds
with ``SO_REUSEADDR``, so a new run can start on that port at once: the probe that
``parallel.master_port`` and ``unison doctor`` go through must say so, and must still refuse
a port something listens on.
"""

from __future__ import annotations

import datetime
import socket

import pytest
import torch.distributed as dist

from unison.cli.launch_checks import check_rendezvous
from unison.distributed.env import port_is_free

STORE_TIMEOUT = datetime.timedelta(seconds=10)


def _plain_bind_fails(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return True
        return False


def _port_left_in_time_wait() -> int:
    """A port on which a torch store served one client, then closed first: only TIME_WAIT remains."""
    server = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    port = server.port
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=STORE_TIMEOUT)
    client.set("key", "value")
    del server  # the server's end of the connection closes first: it waits in TIME_WAIT on the port
    del client
    return port


@pytest.mark.timeout(60)
def test_a_port_in_time_wait_is_free_and_a_store_binds_it() -> None:
    port = _port_left_in_time_wait()
    assert _plain_bind_fails(port), "setup: the port should be held by a TIME_WAIT connection"
    assert port_is_free(port, "127.0.0.1") is True
    assert port_is_free(port, "0.0.0.0") is True
    store = dist.TCPStore("127.0.0.1", port, 1, True, timeout=STORE_TIMEOUT)  # the truth: a new run binds it
    del store


@pytest.mark.timeout(60)
def test_doctor_calls_a_port_in_time_wait_free() -> None:
    port = _port_left_in_time_wait()
    section = check_rendezvous({}, port)
    assert not section.problems, section.problems
    assert any("free on this host" in str(value) for _, value in section.lines)


@pytest.mark.parametrize("reuse", [False, True], ids=["plain", "reuseaddr"])
def test_a_listening_port_is_still_in_use(reuse: bool) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        if reuse:  # as a running store holds it
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("0.0.0.0", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port_is_free(port, "127.0.0.1") is False
        assert port_is_free(port, "0.0.0.0") is False
