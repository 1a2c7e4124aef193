"""recipes/digits/config.yaml from the Python API (one process) and under torchrun (2 ranks)."""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _procs import run_in_session

import unison.recipe.phases
from unison.config import load_config, to_plain
from unison.distributed.env import find_free_port

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "recipes" / "digits" / "config.yaml"
TORCHRUN_TIMEOUT_S = 240
ITERATIONS = 3


def short_run(root: Path) -> list[str]:
    return [
        "training.max_epochs=1",
        f"training.epoch_length={ITERATIONS}",
        "logging.progress=false",
        f"logging.root={root}",
    ]


# -- one process, from Python ---------------------------------------------------------------


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One in-process run; returns (results, root, unison log handlers before and after)."""
    root = tmp_path_factory.mktemp("digits-api")
    logger = logging.getLogger("unison")
    before = list(logger.handlers)
    saved_path = list(sys.path)  # resolve() puts the recipe's folder on sys.path
    try:
        # The config asks for 2 ranks (parallel.nproc_per_node: 2); null means this process.
        overrides = [*short_run(root), "parallel.nproc_per_node=null"]
        results = unison.recipe.run(str(CONFIG), nproc=None, overrides=overrides)
        after = list(logger.handlers)
    finally:
        sys.path[:] = saved_path
        for handler in logger.handlers[len(before) :]:
            logger.removeHandler(handler)
            handler.close()
    return results, root, before, after


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_from_python_in_one_process(single):
    results, root, _, _ = single
    assert (results["world_size"], results["epochs"], results["iterations"]) == (1, 1, ITERATIONS)
    for section in ("validation", "test"):
        assert 0.0 <= results[section]["accuracy"] <= 1.0, results[section]
        assert results[section]["loss"] > 0.0
    assert results["history"][-1]["val_accuracy"] == results["validation"]["accuracy"]
    run_dir = Path(results["run_dir"])
    assert run_dir.parent == root / "digits"
    assert [p.name for p in (root / "digits").iterdir()] == [run_dir.name]
    on_disk = json.loads((run_dir / "metrics.json").read_text())
    assert on_disk["validation"] == results["validation"] and on_disk["test"] == results["test"]
    assert (run_dir / "logs" / "rank0.log").is_file()
    assert to_plain(load_config(run_dir / "config.yaml")) == to_plain(
        load_config(CONFIG, [*short_run(root), "parallel.nproc_per_node=null"])
    )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_run_from_python_leaves_no_log_handler_behind(single):
    """The run's log files are closed; only the console handler (installed once) stays."""
    _, _, before, after = single
    added = [h for h in after if h not in before and h.get_name() != "unison-console"]
    assert added == [], [getattr(h, "baseFilename", h) for h in added]
    assert sum(h.get_name() == "unison-console" for h in after) <= 1


# -- two ranks under torchrun ---------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(TORCHRUN_TIMEOUT_S + 30)
def test_torchrun_runs_the_config_in_one_run_directory(tmp_path):
    """`torchrun -m unison run CONFIG`: both ranks write into the one directory rank 0 picked."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
        "--master_addr=127.0.0.1", f"--master_port={find_free_port()}",
        "-m", "unison", "run", str(CONFIG),
    ]  # fmt: skip
    for item in short_run(tmp_path):
        cmd += ["--set", item]
    result = run_in_session(cmd, TORCHRUN_TIMEOUT_S, ROOT)
    out, err = result.stdout, result.stderr
    assert result.returncode == 0, f"{' '.join(cmd)}\n{out[-3000:]}\n{err[-5000:]}"

    runs = list((tmp_path / "digits").iterdir())
    assert len(runs) == 1, runs
    run_dir = runs[0]
    # Every rank prints the directory it used; their output may interleave on one pipe.
    reported = set(re.findall(r"run directory: (\S*?/digits/\d{8}-\d{6}(?:-\d+)?)", out))
    assert reported == {str(run_dir)}, out
    # Each rank opens its own log file in the run directory it was given.
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]
    assert f"run directory: {run_dir} (world size 2)" in (run_dir / "logs" / "rank0.log").read_text()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["iterations"]) == (2, ITERATIONS)
    assert 0.0 <= metrics["validation"]["accuracy"] <= 1.0 and "test" in metrics


def test_the_recipe_reads_scikit_learns_digits_without_importing_sklearn_datasets() -> None:
    """The same 1,797 images and labels as ``sklearn.datasets.load_digits``; the recipe's module
    imports neither it nor SciPy (a process that plans the recipe saves their 1.3 s)."""
    from sklearn.datasets import load_digits

    code = (
        "import sys; import digits; data = digits.load_all(); "
        "print(len(data), 'sklearn.datasets' in sys.modules, 'scipy' in sys.modules)"
    )
    env = {"PYTHONPATH": str(CONFIG.parent)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.stdout.split() == ["1797", "False", "False"], out.stderr

    sys.path.insert(0, str(CONFIG.parent))
    try:
        import digits
    finally:
        sys.path.remove(str(CONFIG.parent))
    images, labels = digits.load_all().tensors
    truth = load_digits()
    assert images.dtype == torch.float32 and labels.dtype == torch.long
    assert torch.equal(images, torch.tensor(truth.images, dtype=torch.float32).unsqueeze(1) / 16.0)
    assert torch.equal(labels, torch.tensor(truth.target, dtype=torch.long))
