"""A torchrun job owns its run folder: a restart resumes it, another job starts fresh."""

from __future__ import annotations

import json
import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from unison.distributed.job import JobIdentity
from unison.recipe.folder.job_run import JOB_RECORD, JobRunError, find_job_run
from unison.recipe.folder.run_choice import choose_run_dir

WORKER = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "TORCHELASTIC_RESTART_COUNT": "0"}


@pytest.fixture
def worker(monkeypatch: pytest.MonkeyPatch):
    """This process looks like rank 0 of a torchrun job (no process group: world size 1 here)."""
    for key in ("UNISON_SPAWNED", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in WORKER.items():
        monkeypatch.setenv(key, value)

    def as_job(run_id: str | None, restart: int = 0) -> None:
        if run_id is None:
            monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
        else:
            monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))

    return as_job


def _plan(root: Path) -> Any:
    return SimpleNamespace(run_root=root / "tiny", config=SimpleNamespace(name="tiny"))


def _checkpointed(run_dir: Path) -> None:
    (run_dir / "checkpoints").mkdir()
    (run_dir / "checkpoints" / "manifest.json").write_text('{"checkpoints": []}')


def test_a_restarted_group_resumes_its_jobs_run_without_a_flag(tmp_path, worker):
    worker("job-a")
    first, resume = choose_run_dir(_plan(tmp_path).run_root, None)
    assert resume is None and first.name.endswith("-job-job-a")
    assert json.loads((first / JOB_RECORD).read_text()) == {"job_id": "job-a", "launcher": "torchrun"}
    worker("job-a", restart=1)
    assert choose_run_dir(_plan(tmp_path).run_root, None) == (first, "auto")
    worker("job-a", restart=0)  # the count is no witness: a node joining does not raise it
    assert choose_run_dir(_plan(tmp_path).run_root, None) == (first, "auto")


def test_a_new_job_starts_fresh_even_beside_a_checkpointed_run(tmp_path, worker):
    worker("job-a")
    first, _ = choose_run_dir(_plan(tmp_path).run_root, None)
    _checkpointed(first)
    worker("job-b")
    second, resume = choose_run_dir(_plan(tmp_path).run_root, None)
    assert resume is None and second != first and second.name.endswith("-job-job-b")
    assert find_job_run(tmp_path / "tiny", _identity("job-a")) == first


def test_resume_given_keeps_its_meaning(tmp_path, worker):
    worker("job-a")
    first, _ = choose_run_dir(_plan(tmp_path).run_root, None)
    _checkpointed(first)
    worker("job-b")
    assert choose_run_dir(_plan(tmp_path).run_root, "auto") == (
        first,
        "auto",
    )  # the newest run of the name, as ever


def test_two_folders_claiming_one_job_are_an_error_naming_both(tmp_path, worker):
    worker("job-a")
    first, _ = choose_run_dir(_plan(tmp_path).run_root, None)
    copy = first.parent / "copied"
    copy.mkdir()
    (copy / JOB_RECORD).write_text((first / JOB_RECORD).read_text())
    with pytest.raises(JobRunError, match="job 'job-a'") as err:
        choose_run_dir(_plan(tmp_path).run_root, None)
    assert str(first) in str(err.value) and str(copy) in str(err.value) and "--rdzv-id" in str(err.value)


@pytest.mark.parametrize("run_id", [None, "none"])
def test_without_a_job_id_each_start_is_a_fresh_run(tmp_path, worker, caplog, run_id):
    worker(run_id)
    first, resume = choose_run_dir(_plan(tmp_path).run_root, None)
    _checkpointed(first)
    assert resume is None and not (first / JOB_RECORD).exists()
    caplog.clear()  # what the first start told, where an earlier test left the logger at INFO
    with caplog.at_level(logging.INFO, logger="unison"):
        second, resume = choose_run_dir(_plan(tmp_path).run_root, None)
    assert resume is None and second != first
    told = [r.getMessage() for r in caplog.records if "--rdzv-id" in r.getMessage()]
    assert len(told) == (1 if run_id == "none" else 0), told


def test_unreadable_records_claim_nothing(tmp_path):
    root = tmp_path / "tiny"
    for name, text in [("a", "{"), ("b", "[1]"), ("c", '{"job_id": 7}')]:
        (root / name).mkdir(parents=True)
        (root / name / JOB_RECORD).write_text(text)
    assert find_job_run(root, _identity("7")) is None


def _identity(run_id: str) -> JobIdentity:
    return JobIdentity("torchrun", run_id)


def _returns_within(call: Any, fifo: Path, seconds: float = 10.0) -> list[Any]:
    """``call()``'s result, which must come within ``seconds``; a reader left waiting on ``fifo`` is
    let go (a writer opens it) so the test ends either way."""
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(call()), daemon=True)
    thread.start()
    thread.join(seconds)
    hung = thread.is_alive()
    if hung:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # the blocked reader opens, reads nothing, goes on
        os.close(fd)
        thread.join(seconds)
    assert not hung, f"waited on the FIFO {fifo} for {seconds} s"
    return out


@pytest.mark.timeout(60)
def test_a_fifo_named_job_json_claims_nothing_and_does_not_block(tmp_path, worker):
    root = tmp_path / "tiny"
    (root / "planted").mkdir(parents=True)
    fifo = root / "planted" / JOB_RECORD
    os.mkfifo(fifo)
    assert _returns_within(lambda: find_job_run(root, _identity("job-a")), fifo) == [None]
    worker("job-a")
    [(run_dir, resume)] = _returns_within(lambda: choose_run_dir(_plan(tmp_path).run_root, None), fifo)
    assert resume is None and run_dir.name.endswith("-job-job-a")


def test_linked_or_large_job_records_claim_nothing(tmp_path):
    root = tmp_path / "tiny"
    elsewhere = tmp_path / "record.json"
    elsewhere.write_text('{"job_id": "job-a"}')
    (root / "linked").mkdir(parents=True)
    (root / "linked" / JOB_RECORD).symlink_to(elsewhere)
    (root / "large").mkdir()
    (root / "large" / JOB_RECORD).write_text('{"job_id": "job-a", "pad": "' + "x" * 8192 + '"}')
    assert find_job_run(root, _identity("job-a")) is None


def test_a_new_job_reusing_a_finished_jobs_id_is_warned_how_to_start_fresh(tmp_path, worker, caplog):
    worker("job-a")
    first, _ = choose_run_dir(_plan(tmp_path).run_root, None)
    _checkpointed(first)
    with caplog.at_level(logging.INFO, logger="unison"):
        assert choose_run_dir(_plan(tmp_path).run_root, None) == (
            first,
            "auto",
        )  # a restart of a running job: no warning
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    (first / "metrics.json").write_text("{}\n")  # the job ran to its end
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="unison"):
        assert choose_run_dir(_plan(tmp_path).run_root, None) == (first, "auto")
    [told] = [r for r in caplog.records if r.levelno >= logging.WARNING]
    text = told.getMessage()
    assert "'job-a'" in text and str(first) in text and "--rdzv-id" in text and "fresh" in text
