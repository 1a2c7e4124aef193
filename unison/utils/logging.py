"""Console logging with the rank in every record: INFO on rank 0, WARNING elsewhere."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any

from unison.utils.run_files import open_file
from unison.utils.secrets import RedactingFilter

_ROOT = "unison"
_HANDLER_NAME = "unison-console"


def get_logger(name: str) -> logging.Logger:
    """A logger under ``unison`` (``name`` is usually ``__name__``), so its records get the rank prefix.

    A script's ``__name__`` is ``__main__`` when run directly and ``__mp_main__`` in ranks
    that ``launch`` spawned; both become the script's file name, so the logger is the same
    however the script was started.
    """
    if name in ("__main__", "__mp_main__"):
        file = getattr(sys.modules.get(name), "__file__", None)
        name = os.path.splitext(os.path.basename(file))[0] if file else "main"
    return logging.getLogger(name if name.startswith(_ROOT) else f"{_ROOT}.{name}")


class _ConsoleHandler(logging.StreamHandler):
    """A stderr handler that writes around progress bars: a record printed while a tqdm bar
    is on screen clears the bar, prints its line, and the bar is drawn again below it,
    instead of the two overwriting each other on one line.

    It writes to ``sys.stderr`` as it is when each record comes, as Python's own last-resort
    handler does, not to the stream that was ``sys.stderr`` when :func:`setup_logging` ran: a
    notebook's or a test runner's capture replaces ``sys.stderr`` and closes its stream later,
    and a handler holding that stream would then fail every record ("I/O operation on closed
    file") instead of writing it to the stderr of the moment.
    """

    def __init__(self) -> None:
        logging.Handler.__init__(self)  # no stream kept: see ``stream``

    @property  # read-only: the stderr of the moment
    def stream(self) -> Any:
        return sys.stderr

    def emit(self, record: logging.LogRecord) -> None:
        std = sys.modules.get("tqdm.std")  # only when some bar may exist: no import otherwise
        bars = getattr(getattr(std, "tqdm", None), "_instances", None)
        if not bars:
            super().emit(record)
            return
        try:
            std.tqdm.write(self.format(record), file=self.stream)  # type: ignore[union-attr]  # std is set when bars exist
        except Exception:  # a logging handler never raises into the code that logged
            self.handleError(record)


def ignite_logger(name: str) -> logging.Logger:
    """The logger an Engine named ``name`` gives ignite's loop: ``unison.ignite.<name>``.

    ignite's loop logs each run's start and end at INFO and repeats every exception at ERROR
    before it propagates; unison's exceptions carry their context in notes, so the parent
    ``unison.ignite`` is quiet unless set: ``logging.getLogger("unison.ignite").setLevel(logging.INFO)``
    shows them again.
    """
    parent = logging.getLogger("unison.ignite")
    if parent.level == logging.NOTSET:
        parent.setLevel(logging.CRITICAL)
    return logging.getLogger(f"unison.ignite.{name}")


def setup_logging(rank: int = 0, world_size: int = 1, level: int | None = None) -> logging.Logger:
    """Sends unison's log records to stderr, each prefixed with the rank that wrote it, a URL's
    credentials masked (:class:`~unison.utils.secrets.RedactingFilter`).

    Rank 0 logs at INFO; the other ranks at WARNING, so a job of 64 ranks prints each
    progress line once while a warning or error on any rank still shows. Calling it again
    replaces the handler instead of adding a second one.

    Args:
        rank: this process's global rank.
        world_size: the number of ranks (shown as ``[rank 1/4]``).
        level: overrides the level on every rank.

    Returns:
        The ``unison`` logger.
    """
    logger = logging.getLogger(_ROOT)
    for handler in list(logger.handlers):
        if handler.get_name() == _HANDLER_NAME:
            logger.removeHandler(handler)
    handler = _ConsoleHandler()
    handler.set_name(_HANDLER_NAME)
    handler.addFilter(RedactingFilter())  # no URL credentials on screen
    prefix = f"[rank {rank}/{world_size}] " if world_size > 1 else ""
    handler.setFormatter(
        logging.Formatter(f"{prefix}%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S")
    )
    logger.addHandler(handler)
    if level is None:
        level = logging.INFO if rank == 0 else logging.WARNING
    logger.setLevel(level)
    logger.propagate = False
    return logger


class RunLogHandler(logging.FileHandler):
    """A log file in a run folder (``logs/rank<N>.log``), appended to in place: opened without
    following a link, only when it is a regular file (:func:`unison.utils.run_files.open_fd`),
    URL credentials masked. The file is opened when the handler is made, so a refusal is raised there.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path, mode="a", encoding="utf-8")
        self.addFilter(RedactingFilter())

    def _open(self) -> Any:
        return open_file(self.baseFilename, "a")


@contextlib.contextmanager
def console_level(level: int | None) -> Iterator[None]:
    """Inside, the console (:func:`setup_logging`'s handler) shows only records of ``level`` and above;
    the logger's level, and so what its other handlers (a run's log files) get, is unchanged unless
    ``level`` is below it (``DEBUG``, or ``INFO`` on a rank above 0): then the logger passes it too.
    ``None`` changes nothing. Both levels are put back on the way out."""
    logger = logging.getLogger(_ROOT)
    handlers = [h for h in logger.handlers if h.get_name() == _HANDLER_NAME]
    before, logger_before = [h.level for h in handlers], logger.level
    if level is not None:
        for handler in handlers:
            handler.setLevel(level)
        if level < logger.getEffectiveLevel():
            logger.setLevel(level)
    try:
        yield
    finally:
        for handler, previous in zip(handlers, before, strict=True):
            handler.setLevel(previous)
        logger.setLevel(logger_before)
