"""recipes/graphs/config.yaml, run as a user runs it: `unison run config.yaml --nproc 2` on two
spawned CPU ranks, the zarr stores made by the recipe's own module.

The config and graphs.py are copied into a fresh folder with the stores under data/, as the
recipe's folder holds them after `python graphs.py --make-data data`: the config runs
unchanged but for its number of epochs.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_geometric")
pytest.importorskip("zarr")

from _procs import run_in_session  # noqa: E402

from unison.distributed import split_dataset  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "recipes" / "graphs"
RUN_TIMEOUT_S = 240
GRAPHS_PER_FILE = 55  # 110 graphs: 11 validate, an odd number
EPOCHS = 6


def unison_run(folder: Path) -> tuple[dict, str]:
    """Runs the config in ``folder`` at 2 spawned ranks (a free port: the config names none);
    returns metrics.json and rank 0's log."""
    cmd = [
        sys.executable, "-m", "unison", "run", "config.yaml", "--nproc", "2",
        "--set", f"training.num_epochs={EPOCHS}", "--set", "logging.progress=false",
    ]  # fmt: skip
    before = set((folder / "runs" / "graphs").glob("*")) if (folder / "runs" / "graphs").exists() else set()
    result = run_in_session(cmd, RUN_TIMEOUT_S, folder)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    (run_dir,) = set((folder / "runs" / "graphs").glob("*")) - before
    metrics = json.loads((run_dir / "metrics.json").read_text())
    return metrics, (run_dir / "logs" / "rank0.log").read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The recipe's folder, copied with its stores made; two runs of its config one after the other."""
    folder = tmp_path_factory.mktemp("graphs")
    for name in ("config.yaml", "graphs.py"):
        shutil.copy(RECIPE / name, folder / name)
    sys.path.insert(0, str(RECIPE))
    try:
        import graphs
    finally:
        sys.path.remove(str(RECIPE))
    stores = graphs.make_data(folder / "data", graphs_per_file=GRAPHS_PER_FILE)
    assert [p.relative_to(folder).as_posix() for p in stores] == ["data/manifold.zarr", "data/random.zarr"]
    first, first_log = unison_run(folder)
    cache = folder / "runs" / "items"
    built = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    second, second_log = unison_run(folder)
    reused = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    return {
        "first": first, "first_log": first_log, "second": second, "second_log": second_log,
        "built": built, "reused": reused,
    }  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 120)
def test_the_graph_network_learns_to_tell_the_families_apart(runs: dict) -> None:
    metrics = runs["first"]
    assert metrics["world_size"] == 2
    assert metrics["validation"]["accuracy"] >= 0.8, metrics["validation"]  # chance is 0.5
    assert metrics["test"]["accuracy"] >= 0.8, metrics["test"]
    assert metrics["test"]["loss"] < 0.69, metrics["test"]  # below the cross-entropy of a coin flip


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 120)
def test_validation_counts_every_validation_graph_once(runs: dict) -> None:
    """GraphCount sums the graphs each rank evaluated: the validation split's size, no padding."""
    _, val, _ = split_dataset(list(range(2 * GRAPHS_PER_FILE)), [0.8, 0.1, 0.1], seed=0)
    assert len(val) % 2 == 1  # a padded DistributedSampler would count one graph twice on 2 ranks
    for run in ("first", "second"):
        assert runs[run]["validation"]["graphs"] == len(val), runs[run]["validation"]


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(2 * RUN_TIMEOUT_S + 120)
def test_the_second_run_reuses_the_cache_without_preprocessing(runs: dict) -> None:
    assert "preprocessing 2 file(s)" in runs["first_log"]
    assert "preprocessing" not in runs["second_log"] and "rebuilding" not in runs["second_log"]
    assert runs["reused"] == runs["built"], "the cache's files were written again"
    # The same split and the same seed: the second run is the first one again.
    assert runs["second"]["validation"] == runs["first"]["validation"]
