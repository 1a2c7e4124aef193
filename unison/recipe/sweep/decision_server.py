"""How rank 0 of a trial reaches the study: the sweep process answers, the ranks agree.

The process that runs ``unison tune`` owns the study and the running trial: only it ever
opens the storage (see :mod:`unison.recipe.sweep.study`). During a trial it serves a
:class:`DecisionServer` on a local socket, with a random key for this trial only (a caller
proves it holds the key before anything else is read; each caller is served by a thread of
its own, and one that stays silent is dropped, so no local process can stall the trial). After
each evaluation rank 0's :class:`AgreedPruning <unison.handlers.pruning.AgreedPruning>`
asks :class:`AskSweep`, which sends ``(epoch, value)``; the server calls
``trial.report(value, step=epoch)`` and ``trial.should_prune()`` once, and answers. Rank 0
then votes in the trainer's sync point, and every rank stops, or goes on, together.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import hmac
import math
import os
import secrets
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from unison.handlers.pruning import AgreedPruning
from unison.recipe.build.assemble import RunParts
from unison.utils import get_logger

_log = get_logger("unison.recipe.sweep.study")

HANDSHAKE_S = 10.0
"""How long a caller has to prove it holds the trial's key, on either side; a silent caller is dropped."""
_NONCE = 32


def _mac(key: bytes, role: bytes, nonce: bytes) -> bytes:
    return hmac.new(key, role + nonce, hashlib.sha256).digest()


def _recv_within(conn: Connection, timeout: float, what: str) -> bytes:
    """One message of at most 64 bytes, or ``TimeoutError`` after ``timeout`` seconds."""
    if not conn.poll(timeout):
        raise TimeoutError(f"no {what} in {timeout:g} s")
    return conn.recv_bytes(maxlength=64)


def _prove(conn: Connection, key: bytes, timeout: float) -> None:
    """The caller's side of the handshake: answers the server's challenge and checks its answer."""
    challenge = _recv_within(conn, timeout, "challenge from the sweep process")
    mine = secrets.token_bytes(_NONCE)
    conn.send_bytes(_mac(key, b"rank", challenge) + mine)
    if not hmac.compare_digest(
        _recv_within(conn, timeout, "answer from the sweep process"), _mac(key, b"sweep", mine)
    ):
        raise ConnectionRefusedError("the process at the decision address does not hold the trial's key")


def _check(conn: Connection, key: bytes, timeout: float) -> bool:
    """The server's side: the caller proves it holds ``key`` within ``timeout`` seconds, then the server does."""
    challenge = secrets.token_bytes(_NONCE)
    conn.send_bytes(challenge)
    reply = _recv_within(conn, timeout, "answer to the challenge")
    if len(reply) != 2 * _NONCE or not hmac.compare_digest(reply[:_NONCE], _mac(key, b"rank", challenge)):
        return False
    conn.send_bytes(_mac(key, b"sweep", reply[_NONCE:]))
    return True


class DecisionServer:
    """Serves the pruner's decisions for one trial to its rank 0, from threads of the sweep process.

    Every connection gets a thread of its own: a caller must prove within ``handshake_s``
    seconds that it holds the trial's key (an HMAC challenge, both ways), or it is dropped. A
    local process that connects and stays silent, or sends garbage, never delays the trial's
    own rank 0, which is served beside it. Only a caller that proved the key is ever read
    with ``pickle``.

    Args:
        trial: the running ``optuna.Trial``.
        metric: the metric's name, for messages.
        handshake_s: how long a caller has for the handshake.

    Attributes:
        reported: ``{epoch: value}`` as reported to the trial.
        pruned_at: the epoch after which the pruner said to prune, or None.
    """

    def __init__(self, trial: Any, metric: str, handshake_s: float = HANDSHAKE_S) -> None:
        self.trial = trial
        self.metric = metric
        self.handshake_s = handshake_s
        self.reported: dict[int, float] = {}
        self.pruned_at: int | None = None
        self.authkey = secrets.token_bytes(32)
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.2)  # accept() wakes to look at _closing
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._closing = False
        self._decide = threading.Lock()  # one question at a time reaches the trial
        self._open: set[socket.socket] = set()
        self._callers: set[threading.Thread] = set()
        self._guard = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="unison-tune-decisions", daemon=True)

    def __enter__(self) -> DecisionServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def judge(self, timeout: float) -> AskSweep:
        """What rank 0 calls to reach this server (picklable: it travels to the spawned ranks)."""
        return AskSweep(self.address, self.authkey, timeout)

    def decide(self, step: int, value: float) -> tuple[str, str]:
        """Reports ``value`` at ``step`` to the trial and asks its pruner, once: ``("prune", why)``
        or ``("continue", "")``."""
        with self._decide:
            self.trial.report(value, step=step)
            self.reported[step] = value
            if not self.trial.should_prune():
                return "continue", ""
            self.pruned_at = step
        pruner = type(self.trial.study.pruner).__name__
        shown = f"{value:.6g}" if math.isfinite(value) else str(value)
        return "prune", f"{pruner} pruned trial {self.trial.number} ({self.metric} {shown} at epoch {step})"

    def _serve(self) -> None:
        while not self._closing:
            try:
                sock, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return  # closed
            name = f"unison-tune-caller-{sock.fileno()}"
            caller = threading.Thread(target=self._caller, args=(sock,), name=name, daemon=True)
            with self._guard:
                self._open.add(sock)
                self._callers.add(caller)
            caller.start()

    def _caller(self, sock: socket.socket) -> None:
        sock.setblocking(True)
        conn = Connection(os.dup(sock.fileno()))
        # A caller that sends part of a message and stops would hold recv_bytes: the timer ends it.
        timer = threading.Timer(self.handshake_s, _hang_up, args=(sock,))
        timer.daemon = True
        timer.start()
        try:
            proved = _check(conn, self.authkey, self.handshake_s)
        except (OSError, EOFError, TimeoutError):
            proved = False
        finally:
            timer.cancel()
        try:
            if proved:
                self._answer(conn)
            else:
                _log.warning(
                    "the decision server of trial %s dropped a caller without the trial's key",
                    self.trial.number,
                )
        finally:
            conn.close()
            _hang_up(sock)
            sock.close()
            with self._guard:
                self._open.discard(sock)
                self._callers.discard(threading.current_thread())

    def _answer(self, conn: Connection) -> None:
        while not self._closing:
            try:
                if not conn.poll(0.2):
                    continue  # a question may take an epoch to come: look at _closing meanwhile
                step, value = conn.recv()
            except (EOFError, OSError):
                return  # rank 0 finished (or died): its connection closed
            try:
                reply = self.decide(int(step), float(value))
            except Exception as err:  # the storage failed: rank 0 raises it, and the trial fails
                reply = ("error", f"{type(err).__name__}: {err}")
            conn.send(reply)

    def close(self) -> None:
        """Stops serving; a rank still connected gets an error on its next question. Returns once
        every caller's thread has ended (a few seconds at most): none logs after the server."""
        if self._closing:
            return
        self._closing = True
        self._thread.join(timeout=5)
        self._sock.close()
        with self._guard:
            for sock in list(self._open):
                _hang_up(sock)
            callers = list(self._callers)
        deadline = time.monotonic() + 5
        for caller in callers:  # hung up: each leaves its read at once
            caller.join(timeout=max(0.0, deadline - time.monotonic()))


def _hang_up(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


class AskSweep:
    """Rank 0's judge: asks the sweep process for the pruner's verdict (see :class:`DecisionServer`).

    Picklable; the connection opens at the first question and stays open for the trial. Every
    step is bounded by ``timeout`` (``parallel.timeout``): the connect, the handshake, each answer.
    """

    def __init__(self, address: tuple[str, int], authkey: bytes, timeout: float) -> None:
        self.address = address
        self.authkey = authkey
        self.timeout = timeout
        self._conn: Connection | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"address": self.address, "authkey": self.authkey, "timeout": self.timeout}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._conn = None

    def _connect(self) -> Connection:
        try:
            sock = socket.create_connection(self.address, timeout=self.timeout)
            sock.setblocking(True)
            conn = Connection(sock.detach())
            try:
                _prove(conn, self.authkey, self.timeout)
            except BaseException:
                conn.close()
                raise
        except (OSError, EOFError) as err:
            raise ConnectionError(
                f"rank 0 could not reach the sweep process at {self.address[0]}:{self.address[1]} to ask "
                f"whether to prune ({type(err).__name__}: {err}); parallel.timeout ({self.timeout:g} s) bounds "
                "each step. Did the sweep process end?"
            ) from None
        return conn

    def __call__(self, value: float, step: int) -> str | None:
        if self._conn is None:
            self._conn = self._connect()
        self._conn.send((step, value))
        if not self._conn.poll(self.timeout):
            raise TimeoutError(
                f"the sweep process did not answer in {self.timeout:g} s whether to prune after epoch {step} "
                "(is its storage reachable?); parallel.timeout sets how long to wait"
            )
        verdict, detail = self._conn.recv()
        if verdict == "error":
            raise RuntimeError(f"the study could not take the value of epoch {step}: {detail}")
        return detail if verdict == "prune" else None


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def _end_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _watch(pid: int) -> None:
    """Waits for process ``pid`` to end (a pidfd where Linux has one, else a look every second), then
    ends this process."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        while True:
            time.sleep(1.0)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                _end_self()
            except PermissionError:
                pass
    select.select([fd], [], [])
    _end_self()


def die_with_sweep(sweep_pid: int) -> None:
    """Ends this rank (SIGKILL) when the sweep process ``sweep_pid`` ends, however it ends.

    A sweep killed outright (SIGKILL, the OOM killer) cannot stop its ranks, and a rank started by
    the fork server outlives it: the fork server lives as long as a process it started, and so no
    parent-death signal reaches the ranks through it. Each rank therefore asks for Linux's
    parent-death signal (``prctl(PR_SET_PDEATHSIG)``, for a rank the sweep started itself) and
    watches the sweep process from a daemon thread. The trial it leaves RUNNING is marked FAIL by
    the next ``unison tune`` (a database storage's heartbeat).
    """
    if sys.platform.startswith("linux") and os.getppid() == sweep_pid:
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    try:
        os.kill(sweep_pid, 0)
    except ProcessLookupError:
        _end_self()
    except PermissionError:
        pass
    threading.Thread(target=_watch, args=(sweep_pid,), name="unison-tune-sweep-watch", daemon=True).start()


@dataclass(frozen=True)
class AttachPruning:
    """``attach`` of :func:`~unison.recipe.phases.train_from_config`: every rank attaches
    :class:`~unison.handlers.pruning.AgreedPruning` to its evaluator; rank 0's judge asks the sweep.
    Every rank also ends with the sweep process (:func:`die_with_sweep`). A pruned trial takes no
    test phase: the ``ended_early`` it returns says so, alike on every rank (the verdict is agreed)."""

    metric: str
    judge: AskSweep
    sweep_pid: int = field(default_factory=os.getpid)

    def __call__(self, parts: RunParts) -> Callable[[], str | None]:
        die_with_sweep(self.sweep_pid)
        pruning = AgreedPruning(parts.trainer, self.metric, self.judge)
        pruning.attach(parts.evaluator)

        def ended_early() -> str | None:
            return (
                f"the sweep pruned the trial after epoch {parts.trainer.state.epoch}"
                if pruning.pruned
                else None
            )

        return ended_early
