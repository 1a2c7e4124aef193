"""Smoke tests of recipes/digits/train.py, run as a user runs it: spawned, under torchrun, alone.

Each run is a short one (1 epoch of a few iterations) in a subprocess of its own session, so
that on a timeout everything it started can be ended: its process group, and the ranks that
torchrun starts in sessions of their own.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from _procs import run_in_session

from unison.distributed import find_free_port

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "recipes" / "digits" / "train.py"
TIMEOUT_S = 180
ITERATIONS = 4
SHORT_RUN = ("--epochs", "1", "--epoch-length", str(ITERATIONS), "--no-progress")
EPOCH_LINE = re.compile(
    r"^(?P<prefix>.*)epoch 1/1  train loss \S+  val loss \S+  val accuracy \S+ \(\d+ samples\)$"
)


def launcher(mode: str) -> list[str]:
    """The command line before the script's path."""
    if mode == "torchrun":
        return [
            sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--master_addr=127.0.0.1", f"--master_port={find_free_port()}",
        ]  # fmt: skip
    return [sys.executable]



def run_recipe(mode: str, out: Path) -> tuple[dict, list[str]]:
    """Runs the recipe; returns the JSON rank 0 wrote and the lines printed to stdout and stderr."""
    cmd = [*launcher(mode), str(SCRIPT), *SHORT_RUN, "--out", str(out)]
    if mode == "spawn":
        cmd += ["--ranks", "2"]
    result = run_in_session(cmd, TIMEOUT_S, ROOT, merge_output=True)
    output = result.stdout
    assert result.returncode == 0, f"{mode} run exited with {result.returncode}: {' '.join(cmd)}\n{output[-4000:]}"
    return json.loads(out.read_text()), output.splitlines()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """Runs each mode at most once per module: the cross-mode test reuses the others' runs."""
    tmp_dir = tmp_path_factory.mktemp("digits")
    done: dict[str, tuple[dict, list[str]]] = {}

    def run_once(mode: str) -> tuple[dict, list[str]]:
        if mode not in done:
            done[mode] = run_recipe(mode, tmp_dir / f"{mode}.json")
        return done[mode]

    return run_once


@pytest.mark.parametrize(("mode", "world_size"), [("spawn", 2), ("torchrun", 2), ("single", 1)])
def test_recipe_runs_and_reports(run, mode, world_size):
    summary, lines = run(mode)

    assert summary["world_size"] == world_size
    assert summary["epochs"] == 1
    assert summary["iterations"] == ITERATIONS
    assert 0.0 <= summary["val_accuracy"] <= 1.0
    assert summary["val_loss"] > 0.0
    epoch_lines = [m for m in map(EPOCH_LINE.match, lines) if m]
    shown = "\n".join(lines)
    assert len(epoch_lines) == 1, (
        f"expected the epoch line once (rank 0 only), got {len(epoch_lines)}:\n{shown}"
    )
    if world_size > 1:
        assert epoch_lines[0]["prefix"].startswith(f"[rank 0/{world_size}] ")


def test_spawn_and_torchrun_train_the_same_model(run):
    spawned, _ = run("spawn")
    torchrun, _ = run("torchrun")
    for key in ("val_accuracy", "val_loss", "train_loss"):
        assert spawned[key] == torchrun[key], key
