"""unison/recipe/phases.py: a run built in steps, resumed, trained and tested, in one process.

Real runs of whole configs, spawned on 2 ranks, are in tests/cli/test_cli.py and
tests/recipes/; each build step on its own is in tests/recipe/build/test_assemble.py.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from _cli_parts import config, parts_of, planned, resolved

from unison.recipe.phases import collect_results, finish_run, resume_run

RUNS = Path("runs/run")
"""The folder of a config's runs (``plan.run_root``): read only by ``--resume auto``."""

# -- resume ------------------------------------------------------------------------------------


def test_no_checkpoint_means_nothing_to_resume(tmp_path: Path) -> None:
    parts = parts_of(config(), resolved(), tmp_path)
    assert parts.checkpoint is None
    assert resume_run(parts, "auto") is None
    assert not (tmp_path / "checkpoints").exists()


def test_resume_auto_in_an_empty_folder_starts_fresh(tmp_path: Path) -> None:
    parts = parts_of(config(tmp_path), resolved(), tmp_path)
    assert resume_run(parts, "auto") is None
    assert parts.trainer.state.iteration == 0


# -- every step, then the test phase -----------------------------------------------------------


def test_a_run_built_in_steps_trains_validates_tests_and_writes_results(tmp_path: Path) -> None:
    c = config(tmp_path)
    c.training.max_epochs = 2
    seen: list[Any] = []
    r = resolved(after_training=seen.append)
    parts = parts_of(c, r, tmp_path)
    resume_run(parts, None)
    parts.trainer.run(parts.train_loader, max_epochs=c.training.max_epochs)
    results = collect_results(parts, tmp_path, 1)
    finish_run(planned(c, r), parts, tmp_path, results)

    assert (results["epochs"], results["iterations"]) == (2, 6)
    assert [row["epoch"] for row in results["history"]] == [1, 2]
    assert set(results["validation"]) == {"accuracy", "loss"} == set(results["test"])
    assert seen[0].results is results and seen[0].datasets["test"] is parts.datasets.test
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["test"] == pytest.approx(results["test"])
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt"))


# -- resuming a finished run ---------------------------------------------------------------------


def _files(folder: Path) -> dict[str, int]:
    """Every file's modification time, but the locks' (each job that takes a folder writes its name there)."""
    files = (p for p in folder.rglob("*") if p.is_file() and p.name != ".unison-lock")
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in files}


def test_a_finished_run_resumed_says_so_and_touches_nothing(tmp_path: Path) -> None:
    from unison.recipe.phases import _train

    c = config(tmp_path)
    c.training.max_epochs = 2
    first = _train(planned(c), tmp_path, None)
    before = _files(tmp_path)
    again = _train(planned(c), tmp_path, "auto")
    assert again["complete"] and (again["epochs"], again["iterations"]) == (2, 6)
    assert again["history"] == first["history"] and [row["epoch"] for row in first["history"]] == [1, 2]
    assert _files(tmp_path) == before  # no checkpoint, metrics or predictions rewritten
    assert (first["epochs"], first["iterations"]) == (2, 6)


def test_a_finished_run_resumed_with_more_epochs_goes_on_from_its_end(tmp_path: Path) -> None:
    from unison.recipe.phases import _train

    c = config(tmp_path)
    c.training.max_epochs = 2
    _train(planned(c), tmp_path, None)
    c.training.max_epochs = 3
    more = _train(planned(c), tmp_path, "auto")
    assert "complete" not in more
    assert (more["epochs"], more["iterations"]) == (3, 9)
    assert [row["epoch"] for row in more["history"]] == [
        1,
        2,
        3,
    ]  # the run's whole history, the new epoch added


def test_run_folders_are_ordered_as_made_not_as_text(tmp_path: Path) -> None:
    from unison.recipe.folder.run_choice import _run_order

    names = ["20261123-101500", "20261123-101500-2", "20261123-101500-10", "20261123-101501"]
    manifests = [tmp_path / name / "checkpoints" / "manifest.json" for name in reversed(names)]
    assert [m.parent.parent.name for m in sorted(manifests, key=_run_order)] == names


# -- what --resume may name ----------------------------------------------------------------------


def test_resume_of_a_missing_path_is_an_error_not_a_fresh_run(tmp_path: Path) -> None:
    from unison.recipe.phases import ResumeError, previous_run

    with pytest.raises(ResumeError, match=r"--resume .*nope.pt: no such file or folder"):
        previous_run(RUNS, str(tmp_path / "nope.pt"))


def test_a_checkpoint_outside_a_run_folder_is_refused(tmp_path: Path) -> None:
    """A file whose grandparent is a project folder must not make that folder 'the run'."""
    from unison.recipe.phases import ResumeError, previous_run

    project = tmp_path / "project"
    (project / "weights").mkdir(parents=True)
    (project / "config.yaml").write_text("mine: true\n")
    stray = project / "weights" / "model.pt"
    stray.write_bytes(b"x")
    with pytest.raises(ResumeError, match="not in a unison run folder"):
        previous_run(RUNS, str(stray))
    with pytest.raises(ResumeError, match="not a unison run folder"):
        previous_run(RUNS, str(project))


def test_a_run_folder_and_its_checkpoints_resume(tmp_path: Path) -> None:
    from unison.recipe.phases import _train, previous_run

    c = config(tmp_path)
    _train(planned(c), tmp_path, None)
    (tmp_path / ".unison-run").touch()
    newest = sorted((tmp_path / "checkpoints").glob("*.pt"))[-1]
    assert previous_run(RUNS, str(tmp_path)) == (tmp_path, "auto")
    assert previous_run(RUNS, str(tmp_path / "checkpoints")) == (tmp_path, "auto")
    assert previous_run(RUNS, str(newest)) == (tmp_path, str(newest))


def test_a_hook_that_fails_after_training_loses_no_results(tmp_path: Path) -> None:
    from unison.recipe.phases import _train

    def broken(context: Any) -> None:
        context.results["from_hook"] = 1
        raise RuntimeError("the hook broke")

    with pytest.raises(RuntimeError, match="the hook broke"):
        _train(planned(config(tmp_path), resolved(after_training=broken)), tmp_path, None)
    written = json.loads((tmp_path / "metrics.json").read_text())
    assert written["epochs"] == 1 and "validation" in written and "from_hook" not in written
