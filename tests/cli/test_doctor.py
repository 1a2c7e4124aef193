"""unison doctor: what blocks a distributed run on this machine, each with its fix."""

from __future__ import annotations

import io
import os
import socket
from collections.abc import Iterator

import pytest
import torch

from unison.cli.doctor import run_doctor
from unison.distributed.env import find_free_port


def _doctor(master_port: int | None = None, **env: str) -> tuple[int, str]:
    out = io.StringIO()
    environ = {**os.environ, **env} if env else None
    code = run_doctor(master_port, stream=out, environ=environ)
    return code, out.getvalue()


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def test_this_machine_with_a_free_port_passes():
    port = find_free_port()
    code, text = _doctor(port)
    assert code == 0, text
    assert f"{port} (--master-port): free on this host" in text
    for name in ("python", "torch", "pytorch-ignite", "unison", "tensorboardX", "OMP_NUM_THREADS"):
        assert name in text


def test_reports_cuda_and_backends():
    _, text = _doctor(find_free_port())
    assert "gloo     available" in text
    assert "nccl" in text and "mpi" in text
    if not torch.cuda.is_available():
        assert "CUDA available        no" in text
        assert "GPUs visible          0" in text


def test_a_busy_master_port_blocks(busy_port):
    code, text = _doctor(busy_port)
    assert code == 1
    assert f"master port {busy_port} is in use" in text
    assert f"ss -ltnp | grep {busy_port}" in text and "--master-port / MASTER_PORT" in text


def test_master_port_comes_from_the_environment(busy_port):
    code, text = _doctor(MASTER_PORT=str(busy_port))
    assert code == 1
    assert f"{busy_port} (MASTER_PORT): IN USE" in text


def test_under_torchrun_the_store_holds_the_port(busy_port):
    env = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(busy_port),
    }
    code, text = _doctor(**env)
    assert code == 0, text
    assert "torchrun (RANK=0, LOCAL_RANK=0, WORLD_SIZE=2)" in text
    assert "by the launcher's store" in text


def test_incomplete_torchrun_variables_block():
    code, text = _doctor(find_free_port(), RANK="1")
    assert code == 1
    assert "torchrun variables incomplete: RANK=1 set but LOCAL_RANK, WORLD_SIZE not" in text


def test_warnings_do_not_block():
    code, text = _doctor(find_free_port(), CUDA_VISIBLE_DEVICES="", SLURM_JOB_ID="42", NCCL_IB_DISABLE="1")
    assert code == 0, text
    assert "CUDA_VISIBLE_DEVICES='' hides every GPU" in text
    assert "SLURM job 42 without srun step" in text and "launch with srun" in text
    assert "NCCL_IB_DISABLE=1" in text


def test_local_rank_beyond_the_visible_gpus_blocks(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i: f"Fake GPU {i}")
    code, text = _doctor(find_free_port(), RANK="3", LOCAL_RANK="3", WORLD_SIZE="4", MASTER_ADDR="127.0.0.1")
    assert code == 1
    assert "LOCAL_RANK=3 but only 2 GPUs visible" in text
    assert "cuda:1" in text and "Fake GPU 1" in text


def test_an_unknown_gloo_interface_blocks():
    code, text = _doctor(find_free_port(), GLOO_SOCKET_IFNAME="nosuchif9")
    assert code == 1
    assert "GLOO_SOCKET_IFNAME='nosuchif9' matches no interface" in text


def test_an_unresolvable_master_address_blocks():
    code, text = _doctor(find_free_port(), MASTER_ADDR="no-such-host.invalid")
    assert code == 1
    assert "MASTER_ADDR='no-such-host.invalid' does not resolve" in text


@pytest.mark.parametrize(
    ("version", "ok"),
    [("0.5.5", True), ("0.5.7", True), ("0.5.5.post1", True), ("0.6.0rc1", False), ("0.6.0", False),
     ("0.5.4", False), ("0.5.6+cu121", True), ("not-a-version", False)],
)  # fmt: skip
def test_the_ignite_range_is_read_by_pep_440(version: str, ok: bool) -> None:
    from unison.cli.doctor_checks import IGNITE_RANGE, _in_range

    assert _in_range(version, IGNITE_RANGE) is ok


@pytest.mark.parametrize("env", [{"RANK": "abc"}, {"RANK": "abc", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}])
def test_placement_variables_that_are_not_numbers_block_instead_of_crashing(env: dict[str, str]) -> None:
    code, text = _doctor(find_free_port(), **env)
    assert code == 1
    assert "placement variables that are not integers: RANK='abc'" in text


def test_lists_every_private_api_as_in_use_on_the_tested_versions():
    from unison.cli.private_apis import PRIVATE_APIS

    code, text = _doctor(find_free_port())
    assert code == 0, text
    assert "Private APIs (torch, ignite)" in text
    lines = [line.strip() for line in text.splitlines()]
    for api in PRIVATE_APIS:
        assert any(
            line.startswith(api.name) and line.endswith(f"in use: {api.used_when}") for line in lines
        ), api.name
    assert "CHANGED" not in text


@pytest.mark.parametrize("severity, blocks", [("blocks", 1), ("warning", 0)])
def test_a_changed_private_api_is_reported_with_what_it_breaks(monkeypatch, severity, blocks):
    import dataclasses

    from unison.cli import private_apis

    changed = dataclasses.replace(
        private_apis.PRIVATE_APIS[0], severity=severity, probe=lambda: "load_bytes is never called"
    )
    monkeypatch.setattr(private_apis, "PRIVATE_APIS", (changed,))
    code, text = _doctor(find_free_port())
    assert code == blocks, text
    assert "CHANGED: load_bytes is never called" in text
    label = "[BLOCKS ]" if severity == "blocks" else "[warning]"
    assert f"{label} {changed.name} changed" in text and changed.if_changed in text
