"""`unison run CONFIG --main SCRIPT.py`: a config's `!pyobject __main__.<name>` and plain class names
(`model.type: "GNNModel"`) looked up in the user's own script, imported as `__mp_main__` on every rank.

The config is QuantumGrav's DDP block as written for `torchrun train_script.py`
(tests/config/data/quantumgrav_ddp.yaml: `criterion: !pyobject __main__.compute_loss`,
`model.type: "GNNModel"`), with the data from the same script. The script records every import
of itself (module name and process) and would write a marker file from its `__main__` block.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path

import pytest
from _procs import run_in_session

import unison.recipe
from unison.cli import build_parser, main
from unison.config import load_config
from unison.config.main_script import MainScriptError, script, use_main
from unison.distributed.env import find_free_port

ROOT = Path(__file__).resolve().parents[2]
BLOCK = ROOT / "tests" / "config" / "data" / "quantumgrav_ddp.yaml"
RUN_TIMEOUT_S = 200

SCRIPT = """\
import os
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from unison.distributed import split_dataset

with open(Path(__file__).with_name("imported.txt"), "a") as log:
    log.write(f"{__name__} {os.getpid()}\\n")


class GNNModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)


def compute_loss(y_pred, data, *trainer):  # QuantumGrav's criterion(outputs, data[, trainer])
    y = data[1] if isinstance(data, (list, tuple)) else data
    return nn.functional.cross_entropy(y_pred, y)


def build(seed, n=70):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return split_dataset(TensorDataset(x, y), [0.8, 0.1, 0.1], seed=seed)


if __name__ == "__main__":  # the user's own launch: never run by unison
    Path(__file__).with_name("main_block_ran").write_text("yes")
"""

CPU = [
    "training.device=cpu",
    "training.num_epochs=2",
    "training.batch_size=8",
    "validation.batch_size=8",
    "testing.batch_size=8",
    "training.num_workers=0",
    "training.prefetch_factor=null",
    "validation.num_workers=0",
    "testing.num_workers=0",
    "logging.progress=false",
]


@pytest.fixture(autouse=True)
def no_script() -> Iterator[None]:
    """Each test starts and ends with no `--main` script in this process."""
    use_main(None)
    yield
    use_main(None)
    sys.modules.pop("__mp_main__", None)


def user_files(folder: Path, block: str | None = None) -> Path:
    """The config (QuantumGrav's block, data from the script) and train_qg.py beside it."""
    (folder / "train_qg.py").write_text(SCRIPT)
    path = folder / "config.yaml"
    path.write_text((block or BLOCK.read_text()) + "data:\n  build: !pyobject __main__.build\n")
    return path


def imports_of(folder: Path) -> list[tuple[str, int]]:
    log = folder / "imported.txt"
    lines = log.read_text().split("\n") if log.is_file() else []
    return [(name, int(pid)) for name, pid in (line.split() for line in lines if line)]


def line_of(path: Path, text: str) -> int:
    return next(i for i, row in enumerate(path.read_text().splitlines(), 1) if text in row)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_unison_run_with_main_trains_on_two_spawned_ranks(tmp_path: Path) -> None:
    user_files(tmp_path)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "unison", "run", "config.yaml", "--main", "train_qg.py", "--nproc", "2"]
    for item in [*CPU, f"training.path={out}", f"parallel.master_port={find_free_port()}"]:
        cmd += ["--set", item]
    result = run_in_session(cmd, RUN_TIMEOUT_S, tmp_path)  # the script relative to the working directory
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    (run_dir,) = (out / "run").iterdir()
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["epochs"]) == (2, 2)
    assert metrics["test"]["loss"] > 0 and set(metrics["validation"]) == {"loss"}
    assert not (tmp_path / "main_block_ran").exists(), "the script's __main__ block ran"
    imports = imports_of(tmp_path)
    assert {name for name, _ in imports} == {"__mp_main__"}, imports
    # Once, by the launching process as it planned: the fork server is a fork of it made after
    # the plan (unison/distributed/fork_server.py), and both ranks fork with the script imported.
    assert len(imports) == 1, imports


def test_a_missing_or_wrong_script_fails_before_anything_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = user_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    for given, words in (
        ("nope.py", f"--main nope.py: the file ({tmp_path / 'nope.py'}) does not exist; expected the Python "
         f"script (a .py file) that defines what the config names as __main__.<name>, relative to {tmp_path}"),
        ("config.yaml", "--main config.yaml: expected the Python script (a .py file) that defines what the "
         "config names as __main__.<name>; 'config.yaml' does not end in .py"),
    ):  # fmt: skip
        code = main(["run", str(path), "--main", given, "--nproc", "2", "--set", f"training.path={out}"])
        err = capsys.readouterr().err
        assert code == 2 and err == f"unison run: {words}\n"
        assert not out.exists() and imports_of(tmp_path) == []
    with pytest.raises(MainScriptError, match="--main missing.py: the file"):
        unison.recipe.run(path, main="missing.py", nproc=2)


def test_a_name_the_script_lacks_names_the_key_the_script_and_the_nearest_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    block = BLOCK.read_text().replace("__main__.compute_loss", "__main__.compute_los")
    path = user_files(tmp_path, block)
    script_file = tmp_path / "train_qg.py"
    code = main(["run", str(path), "--main", str(script_file), "--nproc", "2", "--set", f"training.path={out}"])
    assert code == 2
    assert capsys.readouterr().err == (
        f"unison run: {path}:1: criterion: !pyobject __main__.compute_los: your script {script_file} has no "
        "'compute_los'; nearest: compute_loss\n"
    )
    path = user_files(tmp_path, BLOCK.read_text().replace('"GNNModel"', '"GNNModle"'))
    code = main(["run", str(path), "--main", str(script_file), "--nproc", "2", "--set", f"training.path={out}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(
        f"unison run: {path}:{line_of(path, 'GNNModle')}: model.type: 'GNNModle' is not found in __main__ "
        f"({script_file}). It could name: __main__.GNNModel. Did you mean GNNModel?"
    ), err
    assert not out.exists() and not (tmp_path / "main_block_ran").exists()


def test_without_main_the_refusal_offers_main_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    path = user_files(tmp_path)
    entry = types.ModuleType("__main__")  # `__main__` as under `python -m unison`
    entry.__spec__ = types.SimpleNamespace(name="unison.__main__")  # type: ignore[assignment]
    monkeypatch.setitem(sys.modules, "__main__", entry)
    code = main(["run", str(path), "--nproc", "2", "--set", f"training.path={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2 and "under `unison run`, `__main__` is the unison command itself" in err
    assert err.index("`unison run CONFIG --main your_script.py`") < err.index("`imports: [mymodule]`")
    assert imports_of(tmp_path) == [] and not (tmp_path / "out").exists()


def test_the_python_api_takes_main_as_one_rank_of_a_launcher(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`unison.recipe.run(config, main=...)` as the one rank of a torchrun job, which every rank of a
    torchrun or srun job is: each reads the same `--main` and imports the script itself."""
    path = user_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    port = str(find_free_port())
    for key, value in {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
    }.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    logger = logging.getLogger("unison")  # a run in this process sets up unison's console logging
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        results = unison.recipe.run(path, main="train_qg.py", overrides=[*CPU, f"training.path={tmp_path / 'o'}"])
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])
    assert (results["world_size"], results["epochs"]) == (1, 2) and results["test"]["loss"] > 0
    assert script() == tmp_path / "train_qg.py"
    assert imports_of(tmp_path) == [("__mp_main__", os.getpid())]  # once, however often it is resolved
    assert sys.modules["__mp_main__"].compute_loss.__module__ == "__mp_main__"
    assert not (tmp_path / "main_block_ran").exists()


def test_main_with_a_config_that_names_nothing_there_imports_nothing(tmp_path: Path) -> None:
    path = user_files(tmp_path, BLOCK.read_text().replace("__main__.compute_loss", "qg.compute_loss"))
    text = path.read_text().replace("__main__.build", "qg.build").replace('"GNNModel"', '"qg.GNNModel"')
    path.write_text(text + "imports: [qg]\n")
    (tmp_path / "qg.py").write_text(SCRIPT.replace("imported.txt", "qg_imported.txt"))
    use_main(tmp_path / "train_qg.py")
    config = load_config(path, [*CPU, f"training.path={tmp_path / 'out'}"])
    planned = unison.recipe.plan(config)
    assert planned.name == config.name and imports_of(tmp_path) == []  # the script is never imported


def test_tune_and_config_take_main_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = build_parser()
    assert parser.parse_args(["tune", "c.yaml", "--trials", "2", "--main", "s.py"]).main == "s.py"
    assert parser.parse_args(["run", "c.yaml"]).main is None
    path = user_files(tmp_path)
    script_file = str(tmp_path / "train_qg.py")
    assert main(["config", str(path), "--check", "--main", script_file, "--set", "training.device=cpu"]) == 0
    assert "type: GNNModel" in capsys.readouterr().out
    assert imports_of(tmp_path) == [("__mp_main__", os.getpid())]
    assert main(["config", str(path), "--main", "nope.py"]) == 2
    assert capsys.readouterr().err.startswith("unison config: --main nope.py: the file")


POOL = """\
import concurrent.futures, multiprocessing, sys
from unison.config.main_script import main_module, use_main

use_main("pool_script.py")
script = main_module()
with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context(sys.argv[1])) as pool:
    print(sorted(pool.map(script.scaled, [1, 2])))
"""


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_processes_started_from_a_rank_import_the_script_too(tmp_path: Path, method: str) -> None:
    """What a rank sends a process of its own by name (the worker pool of data.n_processes, a
    DataLoader worker started with spawn) is found there: the script, and a module beside it that
    it imports, are imported there as in the rank, the script's __main__ block never."""
    (tmp_path / "pool_helpers.py").write_text("FACTOR = 3\n")
    (tmp_path / "pool_script.py").write_text(
        "import pool_helpers\n\n\ndef scaled(x):\n    return pool_helpers.FACTOR * x\n\n\n"
        'if __name__ == "__main__":\n    open("main_block_ran", "w").close()\n'
    )
    result = run_in_session([sys.executable, "-c", POOL, method], 100, tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "[3, 6]"
    assert not (tmp_path / "main_block_ran").exists()


def test_the_best_config_of_a_sweep_is_run_with_the_sweeps_script(tmp_path: Path) -> None:
    from unison.recipe.sweep.best import run_command

    assert run_command(Path("best.yaml"), 2) == "unison run best.yaml --nproc 2"
    found = use_main(user_files(tmp_path).with_name("train_qg.py"))
    assert run_command(Path("best.yaml"), 2) == f"unison run best.yaml --nproc 2 --main {found}"
