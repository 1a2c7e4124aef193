"""unison/recipe/sweep/decision_server.py: the decision socket of a trial, served to rank 0 whatever else connects.

A fake trial stands for Optuna's (report, should_prune): the socket, the handshake and the
threads are real; every wait is bounded.
"""

from __future__ import annotations

import pickle
import socket
import threading
import time
from typing import Any

import pytest

from unison.recipe.sweep.decision_server import AskSweep, DecisionServer


class _Pruner:
    pass


class _Study:
    pruner = _Pruner()


class FakeTrial:
    """Prunes once a reported value is above ``bound``."""

    number = 7
    study = _Study()

    def __init__(self, bound: float = 1.0) -> None:
        self.bound = bound
        self.values: dict[int, float] = {}

    def report(self, value: float, step: int) -> None:
        self.values[step] = value

    def should_prune(self) -> bool:
        return max(self.values.values()) > self.bound


def _ask_within(judge: AskSweep, value: float, step: int, limit: float) -> tuple[Any, float]:
    """``judge(value, step)`` in a thread; (its verdict or the exception it raised, seconds), or fails
    after ``limit`` seconds (the thread is a daemon: a stalled call does not hold the suite)."""
    out: list[Any] = []

    def ask() -> None:
        try:
            out.append(judge(value, step))
        except Exception as err:
            out.append(err)

    start = time.monotonic()
    thread = threading.Thread(target=ask, daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), f"rank 0's question was not answered within {limit} s"
    return out[0], time.monotonic() - start


@pytest.mark.timeout(60)
def test_rank_0_is_served_while_a_silent_caller_holds_a_connection() -> None:
    trial = FakeTrial()
    with DecisionServer(trial, "loss", handshake_s=30) as server:
        silent = socket.create_connection(server.address, timeout=5)  # connects first, then says nothing
        try:
            time.sleep(0.3)  # the server has accepted it and is waiting for its answer
            verdict, took = _ask_within(server.judge(timeout=20), 0.5, 1, limit=15)
            assert verdict is None and took < 5, (verdict, took)
            verdict, _ = _ask_within(server.judge(timeout=20), 2.0, 2, limit=15)
            assert isinstance(verdict, str) and "pruned trial 7" in verdict, verdict
        finally:
            silent.close()
    assert trial.values == {1: 0.5, 2: 2.0} and server.pruned_at == 2


@pytest.mark.timeout(60)
def test_a_silent_caller_is_dropped_after_the_handshake_time() -> None:
    with DecisionServer(FakeTrial(), "loss", handshake_s=1.0) as server:
        silent = socket.create_connection(server.address, timeout=10)
        start = time.monotonic()
        try:
            received = b""
            while chunk := silent.recv(4096):  # the challenge, then the end of the connection
                received += chunk
        finally:
            silent.close()
        assert received and time.monotonic() - start < 8


@pytest.mark.timeout(60)
def test_a_caller_without_the_key_is_never_unpickled() -> None:
    trial = FakeTrial()
    with DecisionServer(trial, "loss", handshake_s=5) as server:
        with socket.create_connection(server.address, timeout=10) as rogue:
            payload = pickle.dumps((1, 0.5))
            rogue.sendall(len(payload).to_bytes(4, "big") + payload)
            while rogue.recv(4096):
                pass  # dropped: the connection ends
        wrong = AskSweep(server.address, b"x" * 32, timeout=5)
        verdict, _ = _ask_within(wrong, 0.5, 1, limit=15)
        assert isinstance(verdict, ConnectionError), verdict
    assert trial.values == {}


@pytest.mark.timeout(60)
def test_rank_0_fails_in_bounded_time_when_the_sweep_process_is_silent() -> None:
    """A server that accepts and never answers (a stalled sweep process): the connect's handshake
    is bounded by parallel.timeout, as each answer is."""
    listener = socket.create_server(("127.0.0.1", 0))
    try:
        judge = AskSweep(listener.getsockname()[:2], b"k" * 32, timeout=1.0)
        verdict, took = _ask_within(judge, 0.5, 1, limit=15)
        assert isinstance(verdict, ConnectionError) and "parallel.timeout" in str(verdict), verdict
        assert took < 8
    finally:
        listener.close()


def test_the_judge_travels_to_the_ranks_without_its_connection() -> None:
    with DecisionServer(FakeTrial(), "loss") as server:
        judge = server.judge(timeout=10)
        assert judge(0.5, 1) is None
        copy = pickle.loads(pickle.dumps(judge))
        assert copy._conn is None and copy.address == server.address and copy(0.25, 2) is None


@pytest.mark.timeout(90)
def test_a_rank_ends_when_the_sweep_process_is_killed_outright() -> None:
    """A rank is no child of the sweep process (the fork server stands between them, and outlives
    it): SIGKILL the sweep, and the rank ends within seconds, not after its epoch."""
    import signal
    import subprocess
    import sys

    sweep = subprocess.Popen(["sleep", "120"])
    code = (
        "import sys, time\n"
        "from unison.recipe.sweep.decision_server import die_with_sweep\n"
        f"die_with_sweep({sweep.pid})\n"
        "print('watching', flush=True)\n"
        "time.sleep(120)\n"
    )
    rank = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert rank.stdout is not None and rank.stdout.readline().strip() == "watching"
        sweep.kill()
        sweep.wait(timeout=10)
        start = time.monotonic()
        assert rank.wait(timeout=20) == -signal.SIGKILL
        assert time.monotonic() - start < 10
    finally:
        for proc in (sweep, rank):
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)


@pytest.mark.timeout(60)
def test_close_returns_once_every_caller_s_thread_has_ended_and_logged(caplog) -> None:
    # A caller that connects and stays silent holds a thread in the handshake; closing the
    # server hangs it up, and close returns only once that thread has dropped it (and said so),
    # never leaving a thread to log after the server, and after its logging, is gone.
    with DecisionServer(FakeTrial(), "loss", handshake_s=30) as server:
        silent = socket.create_connection(server.address, timeout=10)
        deadline = time.monotonic() + 10
        while not (callers := _caller_threads()) and time.monotonic() < deadline:
            time.sleep(0.01)  # the server accepts it in its own thread
        (caller,) = callers
    try:
        assert not caller.is_alive()
        assert any("dropped a caller" in r.getMessage() for r in caplog.records), caplog.records
    finally:
        silent.close()


def _caller_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("unison-tune-caller-")]
