"""run_distributed's warm process: calls reuse it, yet every call's ranks start fresh, and a crashed,
hung or abandoned call never poisons the next."""

from __future__ import annotations

import os
import signal
import sys
import threading
from pathlib import Path

import _pool_threaded_workers
import _pool_workers
import pytest
from _runner_workers import killed_by_signal, rank_and_args

from unison.distributed import RankFailedError
from unison.distributed.env import usable_cores
from unison.testing import pool, run_distributed, zygote

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the pool forks its ranks (Linux)"),
]


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie counts: it runs nothing)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_gone(pids: list[int], within_s: float = 20.0) -> list[int]:
    """The processes of ``pids`` still running after ``within_s`` seconds (polled)."""
    event = threading.Event()
    for _ in range(int(within_s * 20)):
        if all(gone(pid) for pid in pids):
            return []
        event.wait(0.05)
    return [pid for pid in pids if not gone(pid)]


def written(folder: Path, suffix: str, count: int, within_s: float = 60.0) -> list[str]:
    """What the ranks wrote to ``folder``'s ``rank-*<suffix>`` files, once all ``count`` are there
    (polled: a rank writes some of them as it leaves its group, after its call returned)."""
    event = threading.Event()
    for _ in range(int(within_s * 20)):
        if len(list(folder.glob(f"rank-*{suffix}"))) >= count:
            break
        event.wait(0.05)
    else:
        raise AssertionError(f"the ranks wrote {sorted(folder.glob(f'rank-*{suffix}'))}, not {count} files")
    return [p.read_text() for p in sorted(folder.glob(f"rank-*{suffix}"))]


def pids_in(folder: Path, count: int, within_s: float = 60.0) -> list[int]:
    """The process ids the ranks wrote to ``folder``, once all ``count`` are there."""
    return [int(text) for text in written(folder, ".pid", count, within_s)]


def threads_of(pid: int) -> int:
    """The threads of process ``pid`` that would make a fork of it unsafe."""
    comms = [p.read_text().strip() for p in Path(f"/proc/{pid}/task").glob("*/comm")]
    return sum(comm not in zygote.FORK_SAFE_THREADS for comm in comms)


def assert_pool_works() -> None:
    results = run_distributed(rank_and_args, 1, nproc=2)
    assert [r["sum_of_ranks"] for r in results] == [1.0, 1.0]


@pytest.mark.timeout(300)
def test_a_warm_call_reuses_the_warm_process_instead_of_importing_torch_again():
    run_distributed(_pool_workers.where_am_i, nproc=2)  # starts the warm process, if none runs yet
    starts = pool.started
    calls = [run_distributed(_pool_workers.where_am_i, nproc=n) for n in (2, 3, 2)]
    warm = pool.warm_pid()
    assert pool.started == starts, "a warm call started a new warm process"
    for results in calls:
        assert [r["world"] for r in results] == [float(len(results))] * len(results)
        # Each rank is a new process, forked by the warm process, which imported the rank's
        # module (and torch, ignite and unison before it) once: no rank imported it again.
        assert {r["parent"] for r in results} == {warm}
        assert {r["imported_in"] for r in results} == {warm}
    pids = [r["pid"] for results in calls for r in results]
    assert len(set(pids)) == len(pids)


@pytest.mark.timeout(300)
def test_a_module_global_set_in_one_call_is_not_there_in_the_next():
    for _ in range(3):
        assert run_distributed(_pool_workers.append_and_count, nproc=2) == [1, 1]


@pytest.mark.slow  # starts a warm process, or ranks from nothing
@pytest.mark.timeout(300)
def test_fresh_spawns_ranks_that_import_everything_themselves():
    results = run_distributed(_pool_workers.where_am_i, nproc=2, fresh=True)
    assert all(r["imported_in"] == r["pid"] for r in results)
    assert all(r["parent"] != pool.warm_pid() for r in results)


@pytest.mark.timeout(300)
def test_ranks_get_the_callers_working_folder_sys_path_and_thread_share(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "on-path"))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    results = run_distributed(_pool_workers.setting, nproc=2)
    expected = {
        "cwd": str(tmp_path),
        "path0": str(tmp_path / "on-path"),
        "threads": max(1, usable_cores() // 2),
    }
    assert results == [expected, expected]
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert [r["threads"] for r in run_distributed(_pool_workers.setting, nproc=2)] == [1, 1]


@pytest.mark.timeout(300)
def test_the_warm_process_runs_no_thread_pool_of_torch_and_ranks_start_their_own():
    assert run_distributed(_pool_workers.parallel_matmul, nproc=2) == [256.0**3] * 2
    warm = pool._warm
    assert warm is not None and warm.pid == pool.warm_pid()
    threads = threads_of(warm.pid)
    assert threads == warm.threads, (
        f"the warm process runs {threads} threads, {warm.threads} after its imports"
    )


@pytest.mark.timeout(300)
def test_a_crashed_rank_fails_its_call_and_the_next_call_runs_in_the_same_warm_process():
    assert_pool_works()
    warm = pool.warm_pid()
    with pytest.raises(RankFailedError) as err:
        run_distributed(killed_by_signal, nproc=2)
    assert err.value.rank == 0 and "SIGKILL" in str(err.value)
    assert_pool_works()
    assert pool.warm_pid() == warm


@pytest.mark.timeout(300)
def test_a_hung_rank_prints_its_stacks_at_the_timeout_and_the_next_call_runs(capfd):
    with pytest.raises(RankFailedError) as err:
        run_distributed(_pool_workers.hang_on_rank_one, nproc=2, timeout=3)
    assert err.value.rank == 1 and "did not finish within deadline=3 s" in str(err.value)
    stderr = capfd.readouterr().err
    assert "hang_on_rank_one" in stderr and "Thread" in stderr, stderr[-3000:]
    assert_pool_works()


@pytest.mark.slow  # starts a warm process, or ranks from nothing
@pytest.mark.timeout(300)
def test_a_warm_process_that_dies_is_replaced_and_its_ranks_end(tmp_path):
    assert_pool_works()
    warm, starts = pool.warm_pid(), pool.started
    with pytest.raises(pool.PoolDied, match="died during a call"):
        run_distributed(_pool_workers.record_pid_then, str(tmp_path), "kill-parent", nproc=2)
    assert wait_gone(pids_in(tmp_path, 2)) == []
    assert_pool_works()
    assert pool.warm_pid() != warm and pool.started == starts + 1


class Abandoned(Exception):
    pass


@pytest.mark.slow  # starts a warm process, or ranks from nothing
@pytest.mark.timeout(300)
def test_an_abandoned_call_ends_its_ranks_and_the_next_call_runs(tmp_path):
    """As when a test's timeout or Ctrl-C interrupts the caller while its ranks run."""
    assert_pool_works()
    warm = pool.warm_pid()

    def interrupt(signum, frame):
        raise Abandoned

    previous = signal.signal(signal.SIGUSR2, interrupt)
    pids: list[int] = []

    def once_running():
        pids.extend(pids_in(tmp_path, 2))
        os.kill(os.getpid(), signal.SIGUSR2)

    waiter = threading.Thread(target=once_running, daemon=True)
    waiter.start()
    try:
        with pytest.raises(Abandoned):
            run_distributed(_pool_workers.record_pid_then, str(tmp_path), "sleep", nproc=2)
    finally:
        signal.signal(signal.SIGUSR2, previous)
        waiter.join(30)
    assert wait_gone([*pids, warm]) == []
    assert pool.warm_pid() is None
    assert_pool_works()


@pytest.mark.slow  # starts a warm process, or ranks from nothing
@pytest.mark.timeout(300)
def test_a_module_that_starts_threads_as_it_is_imported_is_imported_by_the_ranks():
    results = run_distributed(_pool_threaded_workers.imported_in, nproc=2)
    assert pool.warm_pid() not in results  # imported in each rank, not in the warm process
    warm = pool.warm_pid()
    assert threads_of(warm) == pool._warm.threads
    assert run_distributed(_pool_threaded_workers.imported_in, nproc=2) != [warm, warm]
    assert_pool_works()


@pytest.mark.timeout(300)
def test_a_rank_leaves_its_group_without_unfreezing_the_warm_processs_objects(tmp_path):
    """Its last garbage collection then walks what the rank made, not every object of torch."""
    frozen = run_distributed(_pool_workers.frozen_at_leave, str(tmp_path), nproc=2)
    assert min(frozen) > 10_000, f"the warm process froze only {frozen} objects"
    at_leave = [int(text) for text in written(tmp_path, ".frozen", 2)]
    assert at_leave == frozen, f"frozen: {frozen} when the function ran, {at_leave} at the leave"


@pytest.mark.timeout(300)
def test_a_sharded_models_group_ends_as_its_forked_rank_leaves(tmp_path):
    """DTensor's caches created in the warm process (and frozen there) are emptied too."""
    norms = run_distributed(_pool_workers.sharded_then_group_threads, str(tmp_path), nproc=2)
    assert norms[0] == norms[1] > 0
    left = dict(enumerate(written(tmp_path, ".threads", 2)))
    assert left == {0: "[]", 1: "[]"}, f"process-group threads still running after the leave: {left}"


@pytest.mark.timeout(300)
def test_a_call_runs_in_a_new_group_formed_ahead_with_the_calls_timeout():
    """The ranks of a call form their group before the call comes; it is still a group of its own,
    on a port of its own, and it has the timeout the call gives, as if created with it."""
    run_distributed(_pool_workers.group_settings, nproc=2)  # the ranks of the next calls form ahead
    ahead = pool.formed_ahead
    first = run_distributed(_pool_workers.group_settings, nproc=2, timeout=37)
    second = run_distributed(_pool_workers.group_settings, nproc=2, timeout=53)
    assert pool.formed_ahead == ahead + 2
    for results, timeout in ((first, 37.0), (second, 53.0)):
        assert [r["world"] for r in results] == [2.0, 2.0]
        assert {(r["group_timeout"], r["store_timeout"]) for r in results} == {(timeout, timeout)}
    assert first[0]["port"] != second[0]["port"]
    assert not {r["pid"] for r in first} & {r["pid"] for r in second}
    cold = run_distributed(_pool_workers.group_settings, nproc=2, timeout=37, fresh=True)  # the truth
    keys = ("group_timeout", "store_timeout", "debug", "backend", "placement")
    assert [[r[k] for k in keys] for r in cold] == [[r[k] for k in keys] for r in first]


@pytest.mark.timeout(300)
def test_a_call_whose_environment_a_group_reads_differs_gets_a_group_made_in_it(monkeypatch):
    """TORCH_DISTRIBUTED_DEBUG is read as a group is created: a group formed ahead without it must
    not serve a call with it, nor one formed with it a call without it."""
    run_distributed(_pool_workers.group_settings, nproc=2)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")
    for _ in range(2):  # formed at the call, then ahead in the new environment
        assert {r["debug"] for r in run_distributed(_pool_workers.group_settings, nproc=2)} == {
            "DebugLevel.INFO"
        }
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")  # torch wraps the group in its checks
    detail = run_distributed(_pool_workers.group_settings, nproc=2, timeout=41)
    truth = run_distributed(_pool_workers.group_settings, nproc=2, timeout=41, fresh=True)
    assert [(r["debug"], r["backend"], r["store_timeout"]) for r in detail] == [
        (r["debug"], r["backend"], r["store_timeout"]) for r in truth
    ]
    assert {r["backend"] for r in detail} == {"_ProcessGroupWrapper"}
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG")
    assert {r["debug"] for r in run_distributed(_pool_workers.group_settings, nproc=2)} == {"DebugLevel.OFF"}


@pytest.mark.timeout(300)
def test_a_call_of_another_world_size_forms_its_own_group_and_the_next_ones_form_ahead_at_it():
    run_distributed(_pool_workers.group_settings, nproc=2)
    ahead = pool.formed_ahead
    assert [r["world"] for r in run_distributed(_pool_workers.group_settings, nproc=3)] == [3.0] * 3
    assert [r["world"] for r in run_distributed(_pool_workers.group_settings, nproc=3)] == [3.0] * 3
    assert pool.formed_ahead == ahead + 1


@pytest.mark.timeout(300)
def test_a_call_returns_before_its_ranks_leave_and_a_rank_that_fails_to_leave_is_reported(tmp_path):
    """The call does not wait for its ranks to destroy their group and exit; a rank that fails
    there is reported (a warning) by the call that sees it, and the calls go on."""
    assert_pool_works()
    warm = pool.warm_pid()
    with pytest.warns(RuntimeWarning, match=r"fail_as_it_leaves\).*exited with code 1 as it left its group"):
        assert run_distributed(_pool_workers.fail_as_it_leaves, str(tmp_path), nproc=2) == [0, 1]
        assert wait_gone(pids_in(tmp_path, 2)) == []
        assert_pool_works()
    assert pool.warm_pid() == warm
