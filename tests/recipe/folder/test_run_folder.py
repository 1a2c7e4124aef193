"""unison/recipe/folder/run_folder.py and the writers of a run folder: no entry unison writes is reached
through a link, and a run folder holding one is refused naming it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from unison.checkpoint.lock import LOCK_FILE
from unison.handlers.mlflow_store import record_run
from unison.handlers.wandb_writer import write_record
from unison.recipe import phases as runner
from unison.recipe.build import finish
from unison.recipe.build.history import HISTORY_FILE, RunHistory
from unison.recipe.build.tracking import RUN_FILE as MLFLOW_RUN_FILE
from unison.recipe.build.tracking_wandb import RUN_FILE as WANDB_RUN_FILE
from unison.recipe.folder.job_run import JOB_RECORD
from unison.recipe.folder.run_choice import file_logging
from unison.recipe.folder.run_folder import RUN_FILES, RUN_FOLDERS, RUN_MARKER, refuse_unsafe
from unison.recipe.planning.changes import CHANGES_FILE, Change, record
from unison.utils.run_files import RunFileError

BASHRC = "export PATH=/usr/bin\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    file = tmp_path / "bashrc"
    file.write_text(BASHRC)
    return file


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "runs" / "tiny" / "x;touch PWNED;#"
    folder.mkdir(parents=True)
    return folder


def test_the_checked_names_are_the_names_the_writers_use() -> None:
    names = {LOCK_FILE, RUN_MARKER, JOB_RECORD, HISTORY_FILE, CHANGES_FILE, MLFLOW_RUN_FILE, WANDB_RUN_FILE}
    assert names | {"config.yaml", "metrics.json", "predictions.pt"} == set(RUN_FILES)
    assert {"checkpoints", "logs", "tb", "wandb"} == set(RUN_FOLDERS)
    assert runner.RUN_MARKER == RUN_MARKER


def test_refuse_unsafe_names_every_entry_and_the_fix(run_dir, victim, tmp_path) -> None:
    refuse_unsafe(run_dir, ValueError)  # nothing to refuse
    (run_dir / "config.yaml").symlink_to(victim)
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank0.log").symlink_to(victim)
    (run_dir / "tb").symlink_to(tmp_path)
    with pytest.raises(ValueError) as err:
        refuse_unsafe(run_dir, ValueError)
    text = str(err.value)
    for entry in ("config.yaml", "logs/rank0.log", "tb"):
        assert f"{run_dir / entry} is a symbolic link" in text
    assert "leave out --resume" in text


def test_the_run_log_is_never_appended_through_a_link(run_dir, victim) -> None:
    (run_dir / "logs").mkdir()
    (run_dir / "logs" / "rank0.log").symlink_to(victim)
    with pytest.raises(RunFileError, match="rank0.log is a symbolic link") as err:
        file_logging(run_dir)
    assert f"(rm '{run_dir / 'logs' / 'rank0.log'}')" in str(err.value)  # the fix, quoted: ';' is no command
    assert not any(isinstance(h, logging.FileHandler) for h in logging.getLogger("unison").handlers)
    (run_dir / "logs" / "rank0.log").unlink()
    handler = file_logging(run_dir)
    try:
        logging.getLogger("unison").warning("in %s", run_dir)
    finally:
        logging.getLogger("unison").removeHandler(handler)
        handler.close()
    assert str(run_dir) in (run_dir / "logs" / "rank0.log").read_text()
    assert victim.read_text() == BASHRC


def test_the_recipes_writers_refuse_links(run_dir, victim) -> None:
    for name in (CHANGES_FILE, HISTORY_FILE, "metrics.json"):
        (run_dir / name).symlink_to(victim)
    with pytest.raises(RunFileError, match=CHANGES_FILE):
        record(run_dir, [Change("training.lr", 0.1, 0.2)])
    with pytest.raises(RunFileError, match=HISTORY_FILE):
        RunHistory(run_dir, []).append({"epoch": 1})
    with pytest.raises(RunFileError, match="metrics.json"):
        finish._write_metrics(run_dir, {"epochs": 1})
    assert victim.read_text() == BASHRC


def test_run_files_replaced_atomically_replace_the_link_not_its_target(run_dir, victim) -> None:
    for name in (MLFLOW_RUN_FILE, WANDB_RUN_FILE, MLFLOW_RUN_FILE + ".tmp", WANDB_RUN_FILE + ".tmp"):
        (run_dir / name).symlink_to(victim)
    record_run(run_dir / MLFLOW_RUN_FILE, "abc", "sqlite:///x.db")
    write_record(run_dir / WANDB_RUN_FILE, {"id": "abc"})
    (run_dir / HISTORY_FILE).symlink_to(victim)
    with pytest.raises(RunFileError, match=HISTORY_FILE):
        RunHistory(run_dir, []).restore(0)  # rank 0 reads and rewrites the history: refused, not followed
    assert victim.read_text() == BASHRC
    assert '"abc"' in (run_dir / MLFLOW_RUN_FILE).read_text() and not (run_dir / MLFLOW_RUN_FILE).is_symlink()
