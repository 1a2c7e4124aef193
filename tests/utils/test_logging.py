"""unison/utils/logging.py: console_level quiets the console only, and puts it back; the console
writes to the stderr of the moment."""

from __future__ import annotations

import contextlib
import io
import logging
from pathlib import Path

import pytest

from unison.utils.logging import console_level, get_logger, setup_logging


@pytest.fixture
def unison_logger():
    logger = logging.getLogger("unison")
    saved = (list(logger.handlers), logger.level, logger.propagate)
    yield logger
    logger.handlers[:], logger.level, logger.propagate = saved


def test_console_level_keeps_info_off_the_console_but_in_other_handlers(
    unison_logger, tmp_path: Path, capsys
) -> None:
    setup_logging()
    file = logging.FileHandler(tmp_path / "rank0.log")
    unison_logger.addHandler(file)
    log = get_logger("unison.test")
    with console_level(logging.ERROR):
        log.info("saved a checkpoint")
        log.error("a rank failed")
    log.info("trial 0 COMPLETE")  # the console is back once the block ends
    file.close()
    err = capsys.readouterr().err
    assert "saved a checkpoint" not in err and "a rank failed" in err and "trial 0 COMPLETE" in err
    assert "saved a checkpoint" in (tmp_path / "rank0.log").read_text()


def test_console_level_none_changes_nothing(unison_logger, capsys) -> None:
    setup_logging()
    with console_level(None):
        get_logger("unison.test").info("shown")
    assert "shown" in capsys.readouterr().err


def test_the_console_writes_to_the_stderr_of_the_moment_not_a_closed_one(unison_logger, capsys) -> None:
    """Set up while a capture held sys.stderr (a notebook cell, a test), it still writes once that
    capture is closed and replaced: Python's logging printed "--- Logging error ---" for every record."""
    first = io.StringIO()
    with contextlib.redirect_stderr(first):
        setup_logging()
        get_logger("unison.test").info("during the first capture")
    first.close()
    second = io.StringIO()
    with contextlib.redirect_stderr(second):
        get_logger("unison.test").info("after it closed")
    assert "after it closed" in second.getvalue()
    assert "Logging error" not in capsys.readouterr().err
