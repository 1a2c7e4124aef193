"""Launcher detection from environment variables, and free ports."""

from __future__ import annotations

import socket

import pytest
import torch

from unison.distributed import default_backend, detect_launcher, find_free_port
from unison.distributed.env import LauncherInfo, device_for_local_rank, port_is_free

TORCHRUN = {"RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
SRUN = {
    "SLURM_JOB_ID": "123",
    "SLURM_PROCID": "6",
    "SLURM_LOCALID": "2",
    "SLURM_NTASKS": "16",
    "SLURM_STEP_ID": "0",
}


@pytest.mark.parametrize(
    "environ, expected",
    [
        (TORCHRUN, LauncherInfo("torchrun", 5, 1, 8)),
        (SRUN, LauncherInfo("slurm", 6, 2, 16)),
        # torchrun inside an sbatch allocation: torchrun's variables describe the process.
        ({**SRUN, **TORCHRUN}, LauncherInfo("torchrun", 5, 1, 8)),
        # The batch script itself has a job but no step: it is no rank.
        ({k: v for k, v in SRUN.items() if k != "SLURM_STEP_ID"}, LauncherInfo("none")),
        # Partial sets are no launcher.
        ({"RANK": "1", "WORLD_SIZE": "2"}, LauncherInfo("none")),
        ({"SLURM_JOB_ID": "1", "SLURM_STEP_ID": "0"}, LauncherInfo("none")),
        ({}, LauncherInfo("none")),
        # A process that unison's own launch() spawned.
        ({**TORCHRUN, "UNISON_SPAWNED": "1"}, LauncherInfo("spawn", 5, 1, 8)),
        ({**TORCHRUN, "UNISON_SPAWNED": "0"}, LauncherInfo("torchrun", 5, 1, 8)),
    ],
    ids=[
        "torchrun",
        "srun",
        "torchrun-in-slurm",
        "sbatch-script",
        "partial-torchrun",
        "partial-slurm",
        "empty",
        "spawned",
        "spawn-flag-off",
    ],
)
def test_detect_launcher_from_environ(environ, expected):
    assert detect_launcher(dict(environ)) == expected


def test_detect_launcher_reads_os_environ_by_default(monkeypatch):
    for key in list(TORCHRUN) + list(SRUN) + ["UNISON_SPAWNED"]:
        monkeypatch.delenv(key, raising=False)
    assert detect_launcher().kind == "none"
    for key, value in TORCHRUN.items():
        monkeypatch.setenv(key, value)
    assert detect_launcher() == LauncherInfo("torchrun", 5, 1, 8)


def test_launcher_description():
    assert LauncherInfo("none").describe() == "no launcher"
    text = LauncherInfo("slurm", 6, 2, 16).describe()
    assert all(part in text for part in ("SLURM", "RANK=6", "LOCAL_RANK=2", "WORLD_SIZE=16"))


def test_find_free_port_gives_a_port_a_server_can_listen_on():
    port = find_free_port()
    assert isinstance(port, int) and 1024 <= port <= 65535
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        # as torch's rendezvous store binds: a port only an earlier test's closed connection still
        # names (TIME_WAIT) is free to it, and find_free_port may give one
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", port))
        server.listen()
        assert server.getsockname()[1] == port


def test_port_is_free_is_false_for_a_port_held_listening():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert port_is_free(port) is False
        assert find_free_port() != port
    # Closed without a connection, the port can be bound again.
    assert port_is_free(port) is True


def test_cpu_placement():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-only defaults")
    assert default_backend() == "gloo"
    assert device_for_local_rank(0) == torch.device("cpu")
    assert device_for_local_rank(3) == torch.device("cpu")


def test_usable_cores_follow_the_affinity_mask() -> None:
    import os

    from unison.distributed.env import usable_cores

    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this OS")
    before = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {min(before)})
        assert usable_cores() == 1
    finally:
        os.sched_setaffinity(0, before)
    assert usable_cores() == len(before)
