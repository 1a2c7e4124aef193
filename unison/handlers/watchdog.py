"""Reports a rank that stopped making progress, with the stacks of all its threads."""

from __future__ import annotations

import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import TextIO

from ignite.engine import Engine, Events

from unison.distributed.primitives import get_rank, get_world_size
from unison.engine.closing import on_close
from unison.utils.run_files import real_folder, write_text

EXIT_HANG = 70
"""Exit code of a process the watchdog ends (``abort=True``)."""


def format_all_stacks() -> str:
    """The Python stacks of every thread of this process, most recent call last."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        if ident == threading.get_ident():
            continue  # the watchdog itself
        parts.append(f"Thread {names.get(ident, '?')} ({ident}):\n" + "".join(traceback.format_stack(frame)))
    return "\n".join(parts)


class Watchdog:
    """Dumps where a rank is stuck when it completes no iteration for ``hang_timeout`` seconds.

    A background thread watches the time since the last ``ITERATION_COMPLETED``. Past
    ``hang_timeout`` it writes the rank, the last event, the iteration and the Python
    stacks of all threads to ``stream`` (stderr) and, with ``run_dir``, to
    ``run_dir/hang-rank<r>.txt``, once per stall. With ``abort=True`` it then ends the
    process with exit code :data:`EXIT_HANG`, so the launcher ends the job instead of
    waiting for the collective timeout. The hot path pays one ``time.monotonic()`` call
    per iteration.

    Args:
        hang_timeout: seconds without a completed iteration before reporting.
        run_dir: a folder for the report file.
        abort: end the process after reporting.
        stream: where to write the report; default stderr.

    Example:
        .. code-block:: python

            Watchdog(hang_timeout=600, run_dir="runs/x", abort=True).attach(trainer)

    Distributed:
        Attach it on every rank: each rank reports its own stall.
    """

    def __init__(
        self,
        hang_timeout: float = 600.0,
        *,
        run_dir: str | os.PathLike[str] | None = None,
        abort: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        if isinstance(hang_timeout, bool) or not isinstance(hang_timeout, (int, float)) or hang_timeout <= 0:
            raise ValueError(f"Watchdog(hang_timeout={hang_timeout!r}) must be a positive number of seconds.")
        self.hang_timeout = float(hang_timeout)
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.abort = abort
        self.stream = stream
        self.reports = 0
        self._last = time.monotonic()
        self._reported = False
        self._engine: Engine | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _tick(self, _: Engine) -> None:
        self._last = time.monotonic()
        self._reported = False

    def _start(self, engine: Engine) -> None:
        self._engine = engine
        self._tick(engine)
        self._stop.clear()
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._watch, name="unison-watchdog", daemon=True)
            self._thread.start()

    def _finish(self, _: object = None) -> None:
        self._stop.set()
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5)

    def _watch(self) -> None:
        poll = min(1.0, self.hang_timeout / 4)
        while not self._stop.wait(poll):
            stalled = time.monotonic() - self._last
            if stalled >= self.hang_timeout and not self._reported:
                self._reported = True
                self.report(stalled)
                if self.abort:
                    os._exit(EXIT_HANG)

    def report(self, stalled: float) -> str:
        """Writes (and returns) the stall report."""
        engine = self._engine
        event = getattr(getattr(engine, "last_event_name", None), "name", "none")
        state = engine.state if engine is not None else None
        text = (
            f"unison watchdog: rank {get_rank()} of {get_world_size()} completed no iteration for "
            f"{stalled:.1f} s (hang_timeout={self.hang_timeout:g} s). Last event: {event}, "
            f"iteration {getattr(state, 'iteration', '?')}, epoch {getattr(state, 'epoch', '?')}. "
            "Stacks of all threads:\n" + format_all_stacks()
        )
        out = self.stream or sys.stderr
        out.write(text + "\n")
        out.flush()
        if self.run_dir is not None:
            real_folder(self.run_dir)  # never through a link (unison.utils.run_files)
            write_text(self.run_dir / f"hang-rank{get_rank()}.txt", text + "\n")
        self.reports += 1
        return text

    def watch(self, engine: Engine) -> None:
        """Counts ``engine``'s iterations as progress too, without tying the watchdog to its runs.

        For an evaluator run from a trainer's handler: a long evaluation is progress, not
        a hang.
        """
        if not engine.has_event_handler(self._tick, Events.ITERATION_COMPLETED):
            engine.add_event_handler(Events.ITERATION_COMPLETED, self._tick)

    def attach(self, engine: Engine) -> None:
        """Registers on ``engine`` (the trainer); attaching twice has no effect."""
        if engine.has_event_handler(self._start, Events.STARTED):
            return
        engine.add_event_handler(Events.STARTED, self._start)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._tick)
        on_close(engine, self._finish)
