"""``--resume <run>/checkpoints/<name>.dcp``: a sharded run resumes from any of its checkpoints, as a file run does."""

from __future__ import annotations

from pathlib import Path

import pytest

from unison.recipe.phases import ResumeError, previous_run


def _run(tmp_path: Path) -> Path:
    run = tmp_path / "runs" / "tiny" / "20250101-000000"
    (run / "checkpoints" / "ckpt-e0001-i000000010.dcp").mkdir(parents=True)
    (run / ".unison-run").touch()
    return run


def test_a_sharded_checkpoint_folder_names_its_run_and_itself(tmp_path: Path) -> None:
    run = _run(tmp_path)
    folder = run / "checkpoints" / "ckpt-e0001-i000000010.dcp"
    assert previous_run(Path("runs/run"), str(folder)) == (run, str(folder))


def test_a_sharded_checkpoint_folder_outside_a_run_is_refused(tmp_path: Path) -> None:
    stray = tmp_path / "weights" / "ckpt-e0001-i000000010.dcp"
    stray.mkdir(parents=True)
    with pytest.raises(
        ResumeError, match=r"this checkpoint is not in a unison run folder .*\.pt, or a sharded <name>\.dcp"
    ):
        previous_run(Path("runs/run"), str(stray))
