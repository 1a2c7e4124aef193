"""A failure on one rank ends the whole job promptly, naming that rank, the handler or step
or data that raised, the event and the iteration, with the original exception."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from _lockstep_workers import Boom, ExplodingDataset, boom_message, explode, failing_run
from _procs import kill_tree
from torch.utils.data import DataLoader

from unison.distributed import RankFailedError, find_free_port
from unison.engine import Engine, Events
from unison.testing import run_distributed

RUN_TIMEOUT = 60.0
JOB_TIMEOUT = 60.0
AT = 5  # between the sync points of iterations 3 and 6: the other ranks wait for the failing one at 6


def _notes(err: BaseException) -> list[str]:
    return list(getattr(err, "__notes__", []))


def _note_prefix(where: str, at: int) -> str:
    """The engine's note up to the rank (which follows it): what raised, the event and the iteration."""
    if where == "handler":
        return (
            f"raised by handler {explode.__qualname__} at engine ITERATION_COMPLETED, epoch 1, "
            f"iteration {at}, "
        )
    if where == "step":
        return f"raised by the process function (the step) at engine ITERATION, epoch 1, iteration {at}, "
    # The batch of iteration ``at`` is being fetched: the state still counts ``at - 1`` iterations.
    return (
        f"raised while fetching the batch of iteration {at} from the data, at engine GET_BATCH_STARTED, "
        f"epoch 1, iteration {at - 1}, "
    )


# --- one rank of several fails ------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["step", "handler", "data"])
@pytest.mark.parametrize(("world_size", "bad_rank"), [(2, 1), (3, 1)], ids=["2ranks-rank1", "3ranks-rank1"])
def test_a_rank_that_raises_fails_the_job_naming_that_rank_and_where(where, world_size, bad_rank):
    started = time.monotonic()
    with pytest.raises(RankFailedError) as info:
        run_distributed(failing_run, where, bad_rank, AT, nproc=world_size, timeout=RUN_TIMEOUT)
    assert time.monotonic() - started < RUN_TIMEOUT, "the job ended by its deadline, not by the failure"
    err = info.value
    message = str(err)
    # The failing rank, not one that failed after it while waiting in a collective.
    assert (err.rank, err.world_size) == (bad_rank, world_size)
    assert message.startswith(f"rank {bad_rank} of {world_size} failed:")
    # The original exception, with its type, and the engine's note saying where it was raised.
    assert f"{Boom.__name__}: {boom_message(where, bad_rank, AT)}" in message
    note = _note_prefix(where, AT) + f"rank {bad_rank} of {world_size}"
    assert note in message
    # The traceback shown is the failing rank's own, not a peer's broken connection.
    assert "Connection closed by peer" not in message.split(boom_message(where, bad_rank, AT))[0]


# --- a job run as a program -----------------------------------------------------------------------

_JOB = """
import os
import sys

import torch

from unison.distributed import get_rank, launch
from unison.engine import Engine


def fn(pid_dir):
    with open(os.path.join(pid_dir, "rank-%d.pid" % get_rank()), "w") as fh:
        fh.write(str(os.getpid()))

    def step(engine, batch):
        if get_rank() == 1 and engine.state.iteration == 4:
            # Built at run time, so that the source line shown in a traceback does not repeat it.
            raise RuntimeError("rank %d exploded at iteration %d" % (get_rank(), engine.state.iteration))
        return torch.tensor(1.0)

    Engine(step, sync_every=3).run(range(10), max_epochs=2)


if __name__ == "__main__":
    if sys.argv[2] == "spawn":
        launch(fn, sys.argv[1], nproc_per_node=2)
    else:
        launch(fn, sys.argv[1])
"""
MESSAGE = "rank 1 exploded at iteration 4"


class _Job:
    """A program started in its own session, so that a hang can be ended without touching anything else."""

    def __init__(self, args: list[str], cwd: Path) -> None:
        self.cwd = cwd
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            args, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )

    def result(self) -> subprocess.CompletedProcess:
        left = JOB_TIMEOUT - (time.monotonic() - self.started)
        try:
            out, err = self.proc.communicate(timeout=max(left, 0.1))
        except subprocess.TimeoutExpired:
            self.kill()
            out, err = self.proc.communicate()
            pytest.fail(f"the job did not end within {JOB_TIMEOUT:g} s:\n{err[-4000:]}")
        return subprocess.CompletedProcess(self.proc.args, self.proc.returncode, out, err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            kill_tree(self.proc)

    def rank_pids(self) -> list[int]:
        return [int(p.read_text()) for p in sorted(self.cwd.glob("rank-*.pid"))]


@pytest.fixture
def start_job(tmp_path):
    """Starts the program under ``launcher`` ("spawn" or "torchrun"); kills what is left of it after."""
    started: list[_Job] = []

    def start(launcher: str) -> _Job:
        (tmp_path / "job.py").write_text(textwrap.dedent(_JOB))
        args = [sys.executable, "job.py", str(tmp_path), launcher]
        if launcher == "torchrun":
            port = find_free_port()
            args[1:1] = ["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}"]
        started.append(_Job(args, tmp_path))
        return started[-1]

    yield start
    for one in started:
        one.kill()
        one.proc.communicate()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as fh:
            state = next(line for line in fh if line.startswith("State:"))
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "Z" not in state.split()[1]


NOTE = "raised by the process function (the step) at engine ITERATION, epoch 1, iteration 4, rank 1 of 2"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_spawned_job_whose_rank_raises_exits_with_its_traceback_once_and_leaves_nothing(start_job):
    job = start_job("spawn")
    result = job.result()
    assert result.returncode != 0
    assert "RankFailedError: rank 1 of 2 failed" in result.stderr
    assert NOTE in result.stderr
    assert result.stderr.count(f"RuntimeError: {MESSAGE}") == 1, result.stderr
    # Nothing else repeats the failure (a log line per rank, the peer's broken connection).
    assert result.stderr.count(MESSAGE) == 1, result.stderr
    pids = job.rank_pids()
    assert len(pids) == 2
    assert not [pid for pid in pids if _alive(pid)], "a rank outlived the job"


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_torchrun_job_whose_rank_raises_exits_naming_the_rank(start_job):
    job = start_job("torchrun")
    result = job.result()
    assert result.returncode != 0
    assert f"RuntimeError: {MESSAGE}" in result.stderr
    assert NOTE in result.stderr
    pids = job.rank_pids()
    assert len(pids) == 2
    assert not [pid for pid in pids if _alive(pid)], "a rank outlived the job"


# --- world size 1: the notes ----------------------------------------------------------------------


def _step_raising_at(at: int):
    def step(engine, batch):
        if engine.state.iteration == at:
            raise Boom(boom_message("step", 0, at))
        return torch.tensor(1.0)

    return step


def test_a_handlers_exception_keeps_its_type_and_names_the_handler_event_iteration_and_rank():
    engine = Engine(lambda e, b: torch.tensor(1.0), name="trainer")
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=AT), explode)
    with pytest.raises(Boom) as info:
        engine.run(range(10), max_epochs=2)
    assert str(info.value) == boom_message("handler", 0, AT)
    unison_notes = [n for n in _notes(info.value) if n.startswith("raised")]
    where = f"trainer ITERATION_COMPLETED, epoch 1, iteration {AT}, rank 0 of 1"
    assert unison_notes == [f"raised by handler {explode.__qualname__} at {where}"]


class _Saver:
    def save(self, engine):
        raise OSError(f"disk full at epoch {engine.state.epoch}")


def test_a_bound_method_handler_is_named_by_class_and_method():
    engine = Engine(lambda e, b: torch.tensor(1.0), name="trainer")
    engine.add_event_handler(Events.EPOCH_COMPLETED(once=2), _Saver().save)
    with pytest.raises(OSError, match="disk full at epoch 2") as info:
        engine.run(range(10), max_epochs=3)
    where = "trainer EPOCH_COMPLETED, epoch 2, iteration 20, rank 0 of 1"
    assert _notes(info.value) == [f"raised by handler {_Saver.__name__}.save at {where}"]


def test_a_process_function_exception_says_it_came_from_the_step():
    engine = Engine(_step_raising_at(AT), name="trainer")
    with pytest.raises(Boom) as info:
        engine.run(range(10), max_epochs=2)
    assert str(info.value) == boom_message("step", 0, AT)
    where = f"trainer ITERATION, epoch 1, iteration {AT}, rank 0 of 1"
    assert _notes(info.value) == [f"raised by the process function (the step) at {where}"]


def test_a_data_loader_exception_says_it_came_from_fetching_a_batch():
    engine = Engine(lambda e, b: torch.tensor(1.0), name="trainer")
    loader = DataLoader(ExplodingDataset(10, bad_rank=0, bad_index=AT - 1), batch_size=None)
    with pytest.raises(Boom) as info:
        engine.run(loader, max_epochs=2)
    assert str(info.value) == boom_message("data", 0, AT)
    (note,) = _notes(info.value)
    assert note.startswith(f"raised while fetching the batch of iteration {AT} from the data, at trainer GET_BATCH_STARTED, epoch 1,")
    assert note.endswith("rank 0 of 1")


def test_an_evaluators_failure_inside_a_trainer_handler_names_both():
    trainer = Engine(lambda e, b: torch.tensor(1.0), name="trainer")
    evaluator = Engine(_step_raising_at(2), name="evaluator", sync_every=None)

    def validate(engine):
        evaluator.run(range(4))

    trainer.add_event_handler(Events.EPOCH_COMPLETED, validate)
    with pytest.raises(Boom) as info:
        trainer.run(range(3), max_epochs=2)
    assert _notes(info.value) == [
        "raised by the process function (the step) at evaluator ITERATION, epoch 1, iteration 2, rank 0 of 1",
        f"raised by handler {validate.__qualname__} at trainer EPOCH_COMPLETED, epoch 1, iteration 3, "
        "rank 0 of 1",
    ]
