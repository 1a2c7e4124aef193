"""The start-up trace (UNISON_STARTUP_TRACE): a line per phase of a run, and nothing without it;
and what a recipe run imports before its first iteration."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from unison.utils import startup

ROOT = Path(__file__).resolve().parents[2]


def test_without_the_variable_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.delenv(startup.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    startup.mark("cli")
    assert not startup.tracing() and list(tmp_path.iterdir()) == []


def test_each_mark_appends_its_phase_time_pid_and_rank(tmp_path, monkeypatch):
    trace = tmp_path / "trace.txt"
    monkeypatch.setenv(startup.ENV, str(trace))
    monkeypatch.setenv("RANK", "3")
    startup.mark("cli")
    startup.mark("plan")
    lines = [line.split() for line in trace.read_text().splitlines()]
    assert [line[0] for line in lines] == ["cli", "plan"]
    assert float(lines[0][1]) <= float(lines[1][1])
    assert {line[2] for line in lines} == {str(os.getpid())} and {line[3] for line in lines} == {"3"}


def test_a_trace_path_that_is_a_link_is_not_followed(tmp_path, monkeypatch):
    target = tmp_path / "elsewhere.txt"
    target.write_text("")
    (tmp_path / "trace.txt").symlink_to(target)
    monkeypatch.setenv(startup.ENV, str(tmp_path / "trace.txt"))
    with pytest.raises(OSError):
        startup.mark("cli")
    assert target.read_text() == ""


def test_the_recipe_layer_imports_no_tensorboard_protobufs_before_they_are_used():
    code = "import sys, unison.cli, unison.recipe.phases; print(sorted(m for m in sys.modules if m.startswith('tensorboardX')))"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_spawned_recipe_run_traces_every_phase_in_order(tmp_path):
    trace = tmp_path / "trace.txt"
    recipe = ROOT / "recipes" / "digits"
    env = {**os.environ, startup.ENV: str(trace), "PYTHONPATH": os.pathsep.join([str(recipe), str(ROOT)])}
    cmd = [sys.executable, "-m", "unison", "run", str(recipe / "config.yaml"), "--nproc", "2"]
    cmd += [
        "--set",
        "training.max_epochs=1",
        "--set",
        "training.epoch_length=2",
        "--set",
        f"logging.root={tmp_path}",
    ]
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in trace.read_text().splitlines()]
    launcher = [phase for phase, _, _, rank in lines if rank == "-"]
    assert launcher == ["cli", "run", "config", "plan", "checks"]
    for rank in ("0", "1"):
        phases = [phase for phase, _, _, r in lines if r == rank]
        assert phases == [
            "process_group",
            "rank_plan",
            "run_folder",
            "data",
            "model",
            "build",
            "first_batch",
            "first_iteration",
        ], phases
    stamps = [float(when) for _, when, _, _ in lines]
    assert stamps[:5] == sorted(stamps[:5])
