"""launch: spawning, refusing nested spawns, failing fast, deadlines and timeouts."""

from __future__ import annotations

import importlib
import logging
import multiprocessing
import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from _dist_workers import (
    fail_on_rank_one_while_rank_zero_waits,
    nested_launch,
    parent_and_threads,
    placement,
    process_group_timeout,
    sleep_past_deadline,
    sum_of_ranks,
)

from unison.distributed import DEFAULT_TIMEOUT, RankFailedError, find_free_port, launch
from unison.testing import run_distributed

# The package re-exports the function launch under the submodule's name, so the module
# itself is reached through importlib.
launch_module = importlib.import_module("unison.distributed.launcher")

TORCHRUN_ENV = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
SLURM_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_ID": "0",
}


@pytest.fixture
def spawn_calls(monkeypatch):
    """Replaces the spawning step of launch: records its calls instead of starting processes."""
    calls = []

    def record(*args, **kwargs):
        calls.append(args)
        return ["spawned"]

    monkeypatch.setattr(launch_module, "_spawn", record)
    return calls


@pytest.fixture
def warm_ranks():
    """Starts the fork server before a test that times a run, so its start is not timed."""
    assert run_distributed(placement, 0, nproc=2)[1]["rank"] == 1


def _children() -> set[int]:
    return {p.pid for p in multiprocessing.active_children()}


# --- nested spawns are refused ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, must_mention",
    [
        (TORCHRUN_ENV, ["torchrun", "nproc_per_node=2", "duplicate ranks", "Leave nproc_per_node out"]),
        (SLURM_ENV, ["SLURM", "nproc_per_node=2", "srun", "--ntasks-per-node"]),
    ],
    ids=["torchrun", "slurm"],
)
def test_spawn_under_a_launcher_is_refused_before_spawning(monkeypatch, spawn_calls, env, must_mention):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = _children()
    with pytest.raises(RuntimeError) as err:
        launch(placement, 0, nproc_per_node=2)
    assert not isinstance(err.value, RankFailedError)
    for text in must_mention:
        assert text in str(err.value), f"{text!r} missing from: {err.value}"
    assert spawn_calls == [] and _children() == before


def test_slurm_batch_script_without_job_step_may_spawn(monkeypatch, spawn_calls):
    # sbatch runs the script once, with SLURM_JOB_ID but no SLURM_STEP_ID: not a rank of srun.
    for key, value in SLURM_ENV.items():
        if key != "SLURM_STEP_ID":
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert launch(placement, 0, nproc_per_node=2) == ["spawned"]
    assert len(spawn_calls) == 1


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_by_default_the_ranks_fork_from_one_server_and_take_the_callers_thread_count(monkeypatch):
    # The first launch starts the server (it imports torch, ignite and unison once); the next
    # forks from it again. Each rank still gets the thread count of the caller's moment.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    first = launch(parent_and_threads, nproc_per_node=2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    second = launch(parent_and_threads, nproc_per_node=2)
    servers = {parent for parent, _ in first + second}
    assert len(servers) == 1 and os.getpid() not in servers  # not children of this process: the server's
    assert [threads for _, threads in first] == [1, 1] and [threads for _, threads in second] == [2, 2]


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_launch_inside_a_spawned_rank_is_refused():
    with pytest.raises(RankFailedError) as err:
        run_distributed(nested_launch, nproc=2)
    message = str(err.value)
    assert "launch(nproc_per_node=2)" in message
    assert "already one rank" in message and "Call fn directly" in message


# --- spawning ----------------------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_results_come_back_in_rank_order_with_args_and_kwargs():
    results = run_distributed(placement, 10, nproc=3, scale=3)
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert [r["local_rank"] for r in results] == [0, 1, 2]
    assert [r["value"] for r in results] == [3 * (10 + rank) for rank in range(3)]
    assert all(r["world_size"] == 3 and r["group"] for r in results)
    pids = {r["pid"] for r in results}
    assert len(pids) == 3 and os.getpid() not in pids
    assert not dist.is_initialized()


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_concurrent_runs_do_not_collide():
    tokens = (100, 200)
    start = threading.Barrier(len(tokens))
    results: dict[int, object] = {}

    def job(token: int) -> None:
        start.wait()
        try:
            results[token] = run_distributed(sum_of_ranks, token, nproc=2, timeout=60)
        except BaseException as err:  # noqa: BLE001 - reported below
            results[token] = err

    threads = [threading.Thread(target=job, args=(token,)) for token in tokens]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=80)
    assert not any(thread.is_alive() for thread in threads)

    ports = set()
    for token in tokens:
        result = results[token]
        assert isinstance(result, list), f"job {token} failed: {result}"
        # Each job's all-reduce summed its own ranks only: token + 0 + token + 1.
        assert [r[:2] for r in result] == [(token, 2.0 * token + 1)] * 2
        assert result[0][2] == result[1][2]
        ports.add(result[0][2])
    assert len(ports) == len(tokens), "both jobs used the same rendezvous port"


def test_without_nproc_or_launcher_fn_runs_once_here():
    result = launch(placement, 5, scale=2)
    assert result == [
        {"rank": 0, "world_size": 1, "local_rank": 0, "value": 10, "pid": os.getpid(), "group": False}
    ]
    assert not dist.is_initialized()


def test_one_torchrun_rank_gets_a_process_group_with_the_timeout(monkeypatch):
    # A world of one torchrun rank: launch creates the group itself, with the timeout asked for,
    # and destroys it afterwards.
    for key, value in {**TORCHRUN_ENV, "WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(find_free_port()))
    [seconds] = launch(process_group_timeout, backend="gloo", timeout=33)
    if seconds is None:
        pytest.skip("this torch does not expose the gloo backend's timeout")
    assert seconds == 33
    assert not dist.is_initialized()


# --- failures end the job promptly ------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_failing_rank_ends_the_job_with_its_traceback(warm_ranks):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as err:
        # The group timeout (40 s) is far beyond what the test waits for.
        run_distributed(fail_on_rank_one_while_rank_zero_waits, "boom-8d1f", nproc=2, timeout=40)
    elapsed = time.monotonic() - started
    assert (err.value.rank, err.value.world_size) == (1, 2)
    message = str(err.value)
    assert "rank 1 of 2" in message
    assert "ValueError: boom-8d1f" in message
    assert "Traceback" in message and "fail_on_rank_one_while_rank_zero_waits" in message
    assert elapsed < 25, f"rank 0, blocked in a collective, was ended only after {elapsed:.1f} s"


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_collective_mismatch_without_debug_is_named_with_the_stack_and_the_debug_switch():
    from _dist_workers import mismatched_all_reduce

    with pytest.raises(RankFailedError) as err:
        run_distributed(mismatched_all_reduce, nproc=2, timeout=40)
    message = str(err.value)
    assert "died with signal SIGABRT" in message and "mismatched_all_reduce" in message
    assert "died inside a collective" in message and "UNISON_DEBUG=1" in message


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_rank_that_returned_while_another_still_calls_a_collective_is_named():
    from _dist_workers import rank_one_skips_a_collective

    with pytest.raises(RankFailedError) as err:
        run_distributed(rank_one_skips_a_collective, nproc=2, timeout=40)
    assert "rank(s) [1] had already returned from the function and left" in str(err.value)


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_a_rank_past_its_deadline_fails_the_call(warm_ranks):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as err:
        launch(sleep_past_deadline, 120, nproc_per_node=2, deadline=3, timeout=60, start_method="forkserver")
    elapsed = time.monotonic() - started
    assert "deadline=3" in str(err.value)
    assert elapsed < 30


# --- arguments -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fn, kwargs, error, argument",
    [
        (placement, {"nproc_per_node": 0}, ValueError, "nproc_per_node"),
        (placement, {"nproc_per_node": -1}, ValueError, "nproc_per_node"),
        (placement, {"nproc_per_node": 2.0}, ValueError, "nproc_per_node"),
        (placement, {"nproc_per_node": True}, ValueError, "nproc_per_node"),
        (placement, {"nproc_per_node": 2, "backend": "mpi"}, ValueError, "backend"),
        (placement, {"nproc_per_node": 2, "backend": "nccl"}, ValueError, "backend"),
        (placement, {"nproc_per_node": 2, "timeout": -1}, ValueError, "timeout"),
        (placement, {"nproc_per_node": 2, "timeout": 0}, ValueError, "timeout"),
        (placement, {"nproc_per_node": 2, "timeout": "60"}, TypeError, "timeout"),
        (placement, {"nproc_per_node": 2, "deadline": 0}, ValueError, "deadline"),
        (placement, {"nproc_per_node": 2, "start_method": "fork"}, ValueError, "start_method"),
        (42, {"nproc_per_node": 2}, TypeError, "fn"),
        ("placement", {}, TypeError, "fn"),
    ],
)
def test_bad_arguments_raise_before_spawning(spawn_calls, fn, kwargs, error, argument):
    if kwargs.get("backend") == "nccl":
        import torch

        if torch.cuda.is_available():
            pytest.skip("nccl is a valid backend where CUDA is available")
    before = _children()
    with pytest.raises(error, match=argument):
        launch(fn, 0, **kwargs)
    assert spawn_calls == [] and _children() == before


# --- the process group's timeout -----------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "timeout, seconds",
    [(timedelta(seconds=77), 77.0), (None, DEFAULT_TIMEOUT.total_seconds())],
    ids=["timedelta", "default"],
)
def test_process_group_has_the_timeout_asked_for(timeout, seconds):
    kwargs = {} if timeout is None else {"timeout": timeout}
    results = launch(process_group_timeout, nproc_per_node=2, start_method="forkserver", **kwargs)
    if results[0] is None:
        pytest.skip("this torch does not expose the gloo backend's timeout")
    assert results == [seconds, seconds]


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_run_distributed_timeout_is_the_process_group_timeout():
    results = run_distributed(process_group_timeout, nproc=2, timeout=45)
    if results[0] is None:
        pytest.skip("this torch does not expose the gloo backend's timeout")
    assert results == [45.0, 45.0]


@pytest.mark.parametrize(
    ("message", "peer"),
    [
        ("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500", True),
        ("DistBackendError: Connection reset by peer", True),
        ("NCCL communicator was aborted on rank 1", True),
        ("DistBackendError: [ProcessGroupGloo] allreduce: tensor size mismatch (4 vs 6)", False),
        ("ProcessGroupGloo::allgather: invalid tensor type", False),
    ],
)
def test_only_a_lost_connection_counts_as_a_peers_failure(message: str, peer: bool) -> None:
    from unison.distributed.rank_setup import _is_peer_failure

    assert _is_peer_failure(RuntimeError(message)) is peer


def test_when_every_rank_hits_a_backend_error_of_its_own_the_first_ones_traceback_is_reported(
    tmp_path,
) -> None:
    from unison.distributed.spawn import _root_cause

    (tmp_path / "error-rank-1.txt").write_text("2.0\nTraceback: rank 1 ProcessGroupGloo size mismatch")
    (tmp_path / "error-rank-0.txt").write_text("1.0\nTraceback: rank 0 ProcessGroupGloo size mismatch")
    rank, text = _root_cause(tmp_path, reported=1, message="")
    assert rank == 0 and text.startswith("Traceback: rank 0")
    assert "rank(s) [1] failed too, each with an error of its own" in text


# --- a rank that leaves early; SLURM's placement --------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_rank_that_calls_sys_exit_0_is_named_with_its_exit_code():
    from _signal_workers import exit_early_on_rank

    with pytest.raises(RankFailedError) as err:
        run_distributed(exit_early_on_rank, 1, nproc=2, timeout=60)
    assert (err.value.rank, err.value.world_size) == (1, 2)
    message = str(err.value)
    assert "rank 1 exited with code 0 before returning a result" in message
    assert "sys.exit(0)" in message and "SystemExit: 0" in message and "exit_early_on_rank" in message
    assert "FileNotFoundError" not in message


def _srun_task_seeing_one_gpu(monkeypatch, tmp_path) -> list[str]:
    """This process as task 1 of an srun step with ``--gpus-per-task=1``: it sees one GPU, cuda:0."""
    import random

    from unison.distributed.env import port_is_free

    # ignite's rendezvous port under SLURM: 15000 + the job id's last 4 digits
    port = next(p for p in random.sample(range(15000, 25000), 200) if port_is_free(p))
    env = {
        "SLURM_JOB_ID": str(port - 15000 + 70000),
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "1",
        "SLURM_NTASKS": "1",
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_NODELIST": "localhost",
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_STEP_GPUS": "3",
        "CUDA_VISIBLE_DEVICES": "3",
        "PATH": str(tmp_path),  # no scontrol: ignite expands SLURM_JOB_NODELIST itself
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    import torch

    chosen: list[str] = []

    def set_device(device) -> None:
        index = torch.device(device).index if not isinstance(device, int) else device
        if index is None or index >= torch.cuda.device_count():
            raise RuntimeError(f"CUDA error: invalid device ordinal (cuda:{index}, 1 device visible)")
        chosen.append(f"cuda:{index}")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return chosen


@pytest.mark.timeout(60)
def test_an_srun_task_with_one_gpu_computes_on_cuda_0_whatever_its_local_id(monkeypatch, tmp_path):
    from unison.distributed import device, get_local_rank

    chosen = _srun_task_seeing_one_gpu(monkeypatch, tmp_path)
    [(where, local_rank)] = launch(lambda: (device(), get_local_rank()), backend="gloo", timeout=30)
    assert (str(where), local_rank) == ("cuda:0", 1)
    assert chosen and set(chosen) == {"cuda:0"}
    assert not dist.is_initialized()
    assert os.environ["SLURM_LOCALID"] == "1" and "RANK" not in os.environ, "the environment was not restored"


SBATCH_SCRIPT_ENV = {
    # What an sbatch script inherits in a 2-node, 4-task allocation: no srun step of its own.
    "SLURM_JOB_ID": "4243",
    "SLURM_PROCID": "0",
    "SLURM_LOCALID": "0",
    "SLURM_NTASKS": "4",
    "SLURM_NODEID": "0",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "node[1-2]",
}


@pytest.mark.parametrize(
    "step", [None, "4294967294", "batch"], ids=["no-step", "batch-step-id", "batch-name"]
)
def test_the_sbatch_script_is_no_srun_task(monkeypatch, step):
    from unison.distributed.env import slurm_batch_placement

    env = dict(SBATCH_SCRIPT_ENV, **({} if step is None else {"SLURM_STEP_ID": step}))
    from unison.distributed import detect_launcher

    assert detect_launcher(env).kind == "none"
    assert "SLURM_NTASKS=4" in (slurm_batch_placement(env) or "")
    assert slurm_batch_placement({**env, "SLURM_STEP_ID": "0"}) is None  # an srun task
    assert slurm_batch_placement({}) is None


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_nproc_inside_an_sbatch_script_ignores_slurms_placement(monkeypatch):
    from _signal_workers import placement_and_job

    for key, value in SBATCH_SCRIPT_ENV.items():
        monkeypatch.setenv(key, value)
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record.getMessage())

    handler = Collect(level=logging.INFO)
    logger = logging.getLogger("unison.distributed.spawn")
    logger.addHandler(handler)
    try:
        # spawn: each rank starts from this process's environment as it is now
        results = launch(placement_and_job, nproc_per_node=2, start_method="spawn", timeout=60)
    finally:
        logger.removeHandler(handler)
    assert [(r["rank"], r["local_rank"], r["world_size"]) for r in results] == [(0, 0, 2), (1, 1, 2)]
    assert all(r["slurm_job"] == "4243" for r in results), "the ranks lost SLURM_JOB_ID (requeueing needs it)"
    assert any("ignoring SLURM's task placement" in m and "SLURM_NTASKS=4" in m for m in records), records
    assert os.environ["SLURM_NTASKS"] == "4"


def test_more_ranks_than_gpus_are_refused_before_spawning(monkeypatch, spawn_calls):
    """On a machine with one GPU, rank 1 failed as its group formed ('invalid device ordinal':
    ignite sets cuda:LOCAL_RANK on gloo too); now launch refuses before spawning, saying why."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    before = _children()
    with pytest.raises(ValueError) as err:
        launch(placement, 0, nproc_per_node=2, backend="gloo")
    text = str(err.value)
    assert "nproc_per_node=2" in text and "shows 1 GPU(s) (CUDA_VISIBLE_DEVICES='0')" in text, text
    assert "Spawn at most 1" in text and "CUDA_VISIBLE_DEVICES=" in text, text
    assert spawn_calls == [] and _children() == before
