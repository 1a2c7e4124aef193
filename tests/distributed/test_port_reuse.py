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
from unison.distributed import RankFailedError, launch, spawn
from unison.distributed.env import find_free_port, port_is_free

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


def test_a_chosen_port_lies_below_the_kernels_ephemeral_range_and_is_free() -> None:
    """Ports the kernel hands to outgoing connections and to gloo's listeners come from the
    ephemeral range; a store's port drawn from it was taken before the store bound it."""
    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {find_free_port("127.0.0.1") for _ in range(20)}
    assert all(port < low and port_is_free(port, "127.0.0.1") for port in ports), (ports, low)
    assert len(ports) > 1  # drawn, not one fixed port every caller would share


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


@pytest.mark.timeout(120)
def test_a_port_taken_before_the_ranks_bind_it_is_replaced_and_the_ranks_run_once(monkeypatch) -> None:
    """What the machine did to one job in CI: the chosen port was free, then something else
    listened on it before rank 0's store bound it (EADDRINUSE). No rank has run anything yet,
    so launch starts them again on a fresh port instead of failing the job."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        picks = iter([taken.getsockname()[1]])
        chosen: list[int] = []

        def pick(host: str = "127.0.0.1") -> int:
            chosen.append(next(picks, None) or find_free_port(host))
            return chosen[-1]

        monkeypatch.setattr(spawn, "find_free_port", pick)
        busy = taken.getsockname()[1]
        results = launch(_rank_and_world, nproc_per_node=2, backend="gloo", start_method="forkserver")
    assert results == [(0, 2), (1, 2)]
    assert len(chosen) == 2 and chosen[0] == busy and chosen[1] != busy, chosen


@pytest.mark.timeout(120)
def test_a_port_the_caller_named_is_not_replaced_and_its_error_says_it_is_in_use() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RankFailedError, match="EADDRINUSE"):
            launch(_rank_and_world, nproc_per_node=2, backend="gloo", start_method="forkserver",
                   master_port=taken.getsockname()[1], timeout=20)  # fmt: skip
