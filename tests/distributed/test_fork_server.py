"""The fork server is a fork of the launching process where that forks safely: it holds what the
launching process imported and none of its files or signal handlers; elsewhere it starts as
Python starts it."""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from _procs import run_in_session

from unison.distributed import fork_server

SCRIPT = Path(__file__).resolve().parent / "_fork_server_script.py"


@pytest.mark.distributed
@pytest.mark.timeout(180)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the forked server is Linux's")
@pytest.mark.cold_process  # the server's command line tells a fork of the script from a new interpreter
def test_a_clean_launcher_forks_its_server_which_keeps_its_imports_and_drops_its_files_and_handlers(tmp_path):
    read_end, write_end = os.pipe()  # inherited by the launcher: not close-on-exec
    os.set_inheritable(read_end, True)
    try:
        proc = run_in_session(
            [sys.executable, str(SCRIPT), str(read_end)], 150, tmp_path, pass_fds=(read_end,)
        )
    finally:
        os.close(read_end)
        os.close(write_end)
    assert proc.returncode == 0, proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    # the server is this script's own process image, not a fresh `python -c ...forkserver...`
    assert "multiprocessing.forkserver" not in seen["cmdline"] and str(SCRIPT) in seen["cmdline"]
    ranks = seen["ranks"]
    assert len(ranks) == 4 and {rank["server"] for rank in ranks} == {seen["server"]}
    assert all(rank["imported_by_the_launcher"] for rank in ranks), ranks
    assert not any(rank["launchers_sigterm_handler"] for rank in ranks), ranks
    # the server froze its objects (torch's among them) before forking: a rank's collection,
    # as the one it runs as it leaves its group, walks only what the rank made
    assert all(rank["frozen"] > 100_000 and rank["collected"] < rank["frozen"] // 10 for rank in ranks), [
        (rank["frozen"], rank["collected"]) for rank in ranks
    ]
    assert seen["passed_fd"] not in seen["server_fds"], seen["server_fds"]


def test_a_running_python_thread_keeps_the_server_from_forking():
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="a-thread-of-the-test")
    thread.start()
    try:
        hazard = fork_server.fork_hazard() or ""
        assert hazard.startswith("other Python threads run") and "a-thread-of-the-test" in hazard, hazard
    finally:
        stop.set()
        thread.join()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/fd")
def test_a_file_this_process_opened_counts_and_one_it_inherited_does_not():
    with tempfile.TemporaryFile() as opened:
        assert opened.fileno() in fork_server._opened_here(())
        assert opened.fileno() not in fork_server._opened_here((opened.fileno(),))
    inherited = os.dup(0)
    os.set_inheritable(inherited, True)  # as a descriptor the parent process left open
    try:
        assert inherited not in fork_server._opened_here(())
    finally:
        os.close(inherited)


def test_initialized_cuda_keeps_the_server_from_forking(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # a pytest-xdist worker runs threads
    assert fork_server.fork_hazard() == "CUDA is initialized"


def test_the_cuda_driver_counts_and_the_runtime_that_torch_maps_at_import_does_not():
    driver = "7f00-7f01 r-xp 0 fe:00 1   /usr/lib/x86_64-linux-gnu/libcuda.so.1\n"
    runtime = "7f00-7f01 r-xp 0 fe:00 1   /venv/lib/nvidia/cuda_runtime/lib/libcudart.so.13\n"
    assert fork_server._CUDA_DRIVER.search(driver) and not fork_server._CUDA_DRIVER.search(runtime)


TORCH_VARIABLE_CHANGES = """
import json, multiprocessing, os
import torch
import torch.distributed as dist
from unison.distributed import launch

def setting() -> list[str]:
    from torch.distributed import distributed_c10d
    backend = distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    return [str(dist.get_debug_level()), type(backend).__name__]

def ranks() -> list[list[str]]:
    return launch(setting, nproc_per_node=2, backend="gloo", start_method="forkserver")

if __name__ == "__main__":
    os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    context = multiprocessing.get_context("forkserver")  # started by multiprocessing, as a DataLoader would
    child = context.Process(target=print, args=("a process of multiprocessing's own server",))
    child.start()
    child.join()
    seen = {}
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
    seen["set, the server multiprocessing started"] = ranks()
    del os.environ["TORCH_DISTRIBUTED_DEBUG"]
    seen["unset, the server launch started"] = ranks()
    print(json.dumps(seen))
"""


@pytest.mark.distributed
@pytest.mark.slow  # multiprocessing starts its server as a new interpreter
@pytest.mark.timeout(240)
@pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="a server's starting environment is read from /proc"
)
def test_a_launch_after_a_torch_variable_changed_gets_ranks_made_in_the_new_environment(tmp_path):
    """torch reads TORCH_DISTRIBUTED_DEBUG as torch.distributed is imported and as a group is
    created; ranks forked from a server started before the caller set it had the old setting (as a
    new process started now would not). A server this process did not start (multiprocessing
    started it for a DataLoader) is judged by the environment it started in, as Linux keeps it;
    one that launch started, by what launch remembers of it."""
    script = tmp_path / "changes.py"
    script.write_text(TORCH_VARIABLE_CHANGES)
    proc = run_in_session([sys.executable, str(script)], 200, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "set, the server multiprocessing started": [["DebugLevel.DETAIL", "_ProcessGroupWrapper"]] * 2,
        "unset, the server launch started": [["DebugLevel.OFF", "ProcessGroupGloo"]] * 2,
    }
