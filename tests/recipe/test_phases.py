"""unison/recipe/phases.py: a process that planned never plans again.

Under torchrun or srun the launching process is the rank: ``run`` plans (and checks the plan
before training), then trains from that same plan. A sweep's trial that trains in the sweep
process does the same.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import pytest
from _tiny_run import write_tiny

import unison.config
import unison.recipe
from unison.distributed.env import find_free_port
from unison.recipe import phases
from unison.recipe.planning.run_plan import RunPlan


def _counted_plans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every call of the plan pass from the run's phases, as the id of the process that made it."""
    calls: list[int] = []
    real = phases.plan

    def counted(*args: Any, **kwargs: Any) -> RunPlan:
        calls.append(os.getpid())
        return real(*args, **kwargs)

    monkeypatch.setattr(phases, "plan", counted)
    return calls


@pytest.mark.timeout(240)
def test_the_one_rank_of_a_torchrun_job_plans_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = write_tiny(tmp_path, "once", "plan_once_data")
    monkeypatch.syspath_prepend(str(tmp_path))
    for key, value in {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(find_free_port()),
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    calls = _counted_plans(monkeypatch)
    logger = logging.getLogger("unison")  # a run in this process sets up unison's console logging
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        results = unison.recipe.run(config)
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])
    assert results["epochs"] == 1
    assert calls == [os.getpid()]  # planned before the checks, and trained from that plan


def test_a_rank_given_a_plan_does_not_plan_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """train_from_config takes the plan its process made; a spawned rank gets the config and plans once."""
    path = write_tiny(tmp_path, "once", "plan_once_data")
    monkeypatch.syspath_prepend(str(tmp_path))
    config = unison.config.load_config(path)
    planned = phases.plan(config)
    calls = _counted_plans(monkeypatch)
    seen: list[Any] = []
    monkeypatch.setattr(phases, "_in_run_folder", lambda p, resume, attach: seen.append(p) or {})
    phases.train_from_config(planned)
    phases.train_from_config(config)
    assert seen[0] is planned and isinstance(seen[1], RunPlan)
    assert calls == [os.getpid()]  # only the rank given a config planned


def _calls(fn: Any) -> list[str]:
    """The names ``fn`` calls, in the order its source writes them."""
    import ast
    import inspect
    import textwrap

    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return [n.func.id if isinstance(n.func, ast.Name) else getattr(n.func, "attr", "") for n in calls]


def _in_order(names: list[str], expected: list[str]) -> bool:
    found = iter(names)
    return all(name in found for name in expected)


def test_the_run_reads_as_its_phases() -> None:
    """run() and a rank's _train are short scripts that call the phases in order: read, plan, check
    before spawning, launch; build, resume, fit, collect, test."""
    run_calls, rank_calls = _calls(phases.run), _calls(phases._train)
    assert _in_order(run_calls, ["load_config", "plan", "check_before_spawning", "launch_config"]), run_calls
    assert _in_order(rank_calls, ["build_run", "apply_on_resume", "fit", "collect_results", "finish_run"]), (
        rank_calls
    )
    assert len(run_calls) <= 16 and len(rank_calls) <= 16, (len(run_calls), len(rank_calls))


_REFUSED_RUN = """\
import os, sys
import unison.recipe
from unison.config import load_config
from multiprocessing import forkserver

config = load_config(sys.argv[1], ["training.optimizer_kwargs.lr=-1"])
try:
    unison.recipe.run(config, nproc=2)
except Exception as err:
    print("refused:", type(err).__name__)
mine = str(os.getpid())
children = [p for p in os.listdir("/proc") if p.isdigit() and open(f"/proc/{p}/stat").read().split(")")[-1].split()[1] == mine]
servers = [p for p in children if b"forkserver" in open(f"/proc/{p}/cmdline", "rb").read()]
print("server:", forkserver._forkserver._forkserver_pid is not None, "server processes:", len(servers))
"""


@pytest.mark.timeout(120)
def test_a_run_refused_before_its_ranks_leaves_no_fork_server_importing(tmp_path: Path) -> None:
    # The fork server starts as the config is read, to import torch while the checks run; a run the
    # checks refuse ends it at once instead of leaving it to finish its imports, orphaned.
    import subprocess
    import sys

    config = write_tiny(tmp_path, "refused", "refused_run_data")
    script = tmp_path / "refused.py"
    script.write_text(_REFUSED_RUN)
    done = subprocess.run(
        [sys.executable, str(script), str(config)], cwd=tmp_path, capture_output=True, text=True, timeout=100
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "refused:" in done.stdout and "server: False server processes: 0" in done.stdout, done.stdout
