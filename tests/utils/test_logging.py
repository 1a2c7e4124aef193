"""unison/utils/logging.py: console_level quiets the console only, and puts it back."""

from __future__ import annotations

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
