"""QuantumGrav's own config files, end to end: `unison run <config> --main quantumgrav_user.py
--nproc 2` on two spawned CPU ranks, changing on the command line only paths, the device and sizes
for a CPU.

tests/config/data/quantumgrav_train_ddp.yaml and quantumgrav_custom_model.yaml have the keys
and nesting of QuantumGrav's configs/train_ddp.yaml and configs/train_custom_model.yaml, and name
the user's code as they do, `__main__.<name>`; that code (quantumgrav_user.py: reader,
pre-transform, loss, graph networks with torch_geometric layers) is the user's script, named by
`--main` as a QuantumGrav user names it to torchrun.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch_geometric")
pytest.importorskip("zarr")

from _procs import run_in_session  # noqa: E402

from unison.distributed.env import find_free_port

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "config" / "data"
RUN_TIMEOUT_S = 240
EPOCHS = 2


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Two causal-set stores in QuantumGrav's layout (one group per graph), from the graphs recipe."""
    sys.path.insert(0, str(ROOT / "recipes" / "graphs"))
    try:
        import graphs
    finally:
        sys.path.pop(0)
    return graphs.make_data(tmp_path_factory.mktemp("stores"), graphs_per_file=20)


def laptop(folder: Path, stores: list[Path], *, prefetch_in_eval: bool) -> list[str]:
    """The --set overrides: where to read and write, the CPU, and sizes a 2-core CPU runs quickly."""
    items = [
        f"training.path={folder / 'runs'}",
        f"data.files=[{', '.join(str(p) for p in stores)}]",
        f"data.output={folder / 'cache'}",
        "data.n_processes=1",
        "training.device=cpu",
        f"training.num_epochs={EPOCHS}",
        "training.batch_size=8",
        "training.num_workers=0",
        "training.prefetch_factor=null",
        "validation.batch_size=8",
        "validation.num_workers=0",
        "testing.batch_size=8",
        "testing.num_workers=0",
    ]
    if prefetch_in_eval:
        items += ["validation.prefetch_factor=null", "testing.prefetch_factor=null"]
    return items


def unison_run(name: str, tmp_path: Path, overrides: list[str]) -> tuple[dict, str]:
    """Copies the config and the user's script into ``tmp_path`` and runs it with ``--main``;
    metrics.json and everything the command printed."""
    shutil.copy(DATA / name, tmp_path / "config.yaml")
    shutil.copy(DATA / "quantumgrav_user.py", tmp_path / "quantumgrav_user.py")
    cmd = [sys.executable, "-m", "unison", "run", "config.yaml", "--main", "quantumgrav_user.py", "--nproc", "2"]
    for item in overrides:
        cmd += ["--set", item]
    result = run_in_session(cmd, RUN_TIMEOUT_S, tmp_path)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-6000:]
    (run_dir,) = [p for p in (tmp_path / "runs").glob("*/*") if (p / "metrics.json").is_file()]
    return json.loads((run_dir / "metrics.json").read_text()), output


def finite(section: dict) -> bool:
    return bool(section) and all(math.isfinite(v) for v in section.values() if isinstance(v, float))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_ddp_config_trains_a_graph_network_from_zarr_stores(tmp_path: Path, stores: list[Path]) -> None:
    overrides = [*laptop(tmp_path, stores, prefetch_in_eval=False), f"parallel.master_port={find_free_port()}"]
    metrics, output = unison_run("quantumgrav_train_ddp.yaml", tmp_path, overrides)
    assert (metrics["world_size"], metrics["epochs"]) == (2, EPOCHS)
    assert finite(metrics["validation"]) and finite(metrics["test"]), metrics
    assert "loss" in metrics["validation"] and "loss" in metrics["test"]
    assert (tmp_path / "cache" / "items").is_dir(), "data.output holds the preprocessed graphs"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_the_custom_model_config_builds_its_model_around_a_sage_convolution(
    tmp_path: Path, stores: list[Path]
) -> None:
    # training.path and data.output are one anchored value in the file: both move to tmp_path.
    metrics, _ = unison_run(
        "quantumgrav_custom_model.yaml", tmp_path, laptop(tmp_path, stores, prefetch_in_eval=True)
    )
    assert (metrics["world_size"], metrics["epochs"]) == (2, EPOCHS)
    assert finite(metrics["validation"]) and finite(metrics["test"]), metrics
    assert "loss" in metrics["validation"] and "loss" in metrics["test"]
    assert (tmp_path / "cache" / "items").is_dir()
