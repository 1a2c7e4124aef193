"""QuantumGrav's DDP config in a run: each key's effect, and the guide's block trained by `unison run`.

The keys one at a time run in this process (unison/recipe/build/eval_loaders.py, accepted.py,
early_stop.py and their calls in steps.py and run.py); the whole block, verbatim, with a
user's module and `--set` overrides for a CPU laptop only, runs on 2 spawned gloo ranks.
What the config layer accepts and refuses is in tests/config/test_quantumgrav.py.
"""

from __future__ import annotations

import json
import logging
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from _cli_parts import config, datasets, parts_of, planned, resolved
from _procs import run_in_session

import unison.recipe.build.guards
import unison.recipe.build.model_steps
from unison.config import load_config
from unison.distributed.env import find_free_port
from unison.handlers import EarlyStopping
from unison.recipe.build.assemble import build_loaders, build_model, build_optimizer
from unison.recipe.build.eval_loaders import eval_loader
from unison.recipe.phases import collect_results, evaluate_test_set
from unison.recipe.planning.accepted import accepted_lines, report_accepted
from unison.recipe.planning.loader_plan import loader_plans

ROOT = Path(__file__).resolve().parents[2]
BLOCK = ROOT / "tests" / "config" / "data" / "quantumgrav_ddp.yaml"


# -- training.optimizer_args ----------------------------------------------------------------------


def test_optimizer_args_reach_the_optimizer_after_the_parameters() -> None:
    c = config()
    r = resolved(optimizer_type=torch.optim.SGD, optimizer_kwargs={"momentum": 0.5}, optimizer_args=[0.05])
    optimizer, _ = build_optimizer(planned(c, r), torch.nn.Linear(4, 2), world_size=1)
    assert (optimizer.param_groups[0]["lr"], optimizer.param_groups[0]["momentum"]) == (0.05, 0.5)


# -- validation / testing loader keys -------------------------------------------------------------


def test_validation_loader_keys_reach_the_validation_loader_only() -> None:
    c = config()
    c.validation.pin_memory, c.validation.drop_last, c.validation.batch_size = True, True, 4
    c.validation.num_workers, c.validation.prefetch_factor = 1, 5
    train_loader, val_loader = build_loaders(planned(c), datasets())
    assert train_loader is not None and val_loader is not None
    assert (
        val_loader.pin_memory,
        val_loader.drop_last,
        val_loader.num_workers,
        val_loader.prefetch_factor,
    ) == (
        True,
        True,
        1,
        5,
    )
    assert (train_loader.pin_memory, train_loader.drop_last, train_loader.num_workers) == (False, False, 0)
    assert len(val_loader) == 1  # 6 samples, batches of 4: the last 2 are dropped


def test_testing_loader_keys_fall_back_to_validations() -> None:
    c = config()
    c.training.pin_memory, c.validation.num_workers, c.validation.prefetch_factor = True, 1, 3
    loader = eval_loader(loader_plans(c).testing, datasets().test)
    assert loader is not None
    assert (loader.pin_memory, loader.num_workers, loader.prefetch_factor, loader.drop_last) == (
        True,
        1,
        3,
        False,
    )
    c.testing.pin_memory, c.testing.num_workers, c.testing.drop_last, c.testing.batch_size = False, 0, True, 5
    loader = eval_loader(loader_plans(c).testing, datasets().test)
    assert loader is not None
    assert (loader.pin_memory, loader.num_workers, loader.drop_last, loader.batch_size) == (False, 0, True, 5)


def test_the_test_phase_reads_the_testing_sections_loader(tmp_path: Path) -> None:
    """testing.drop_last with batches of 4 over 6 test samples: the test loss is the first 4's."""
    c = config()
    c.testing.batch_size, c.testing.drop_last = 4, True
    r = resolved()
    parts = parts_of(c, r, tmp_path)
    values = evaluate_test_set(planned(c, r), parts)
    x, y = parts.datasets.test[:4]
    with torch.no_grad():
        expected = torch.nn.functional.cross_entropy(parts.model(x), y).item()
    assert values["loss"] == pytest.approx(expected, rel=1e-6)


# -- training.checkpoint_at -----------------------------------------------------------------------


def test_checkpoint_at_saves_every_n_epochs(tmp_path: Path) -> None:
    c = config(tmp_path)
    c.training.checkpoint_at, c.training.max_epochs, c.checkpoint.keep_last = 2, 5, None
    parts = parts_of(c, resolved(), tmp_path)
    parts.trainer.run(parts.train_loader, max_epochs=5)
    names = sorted(p.name for p in (tmp_path / "checkpoints").glob("*.pt"))
    assert [name.split("-")[1] for name in names] == ["e0002", "e0004", "e0005"]  # every 2, and the end


# -- parallel.output_device, rank; the evaluator specs: one log line each -------------------------


def test_output_device_reaches_ddp_on_a_gpu_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict = {}
    monkeypatch.setattr("unison.recipe.planning.step_plans.rank_device", lambda: torch.device("cuda", 1))
    monkeypatch.setattr(
        unison.recipe.build.model_steps, "prepare_model", lambda model, **kwargs: seen.update(kwargs) or model
    )
    c = config()
    c.parallel.output_device = 1
    build_model(planned(c))
    assert seen["output_device"] == 1
    monkeypatch.setattr("unison.recipe.planning.step_plans.rank_device", lambda: torch.device("cpu"))
    seen.clear()
    build_model(planned(c))
    assert "output_device" not in seen  # DDP takes none for a CPU module


def test_keys_that_are_not_needed_here_are_reported_once_each(caplog: pytest.LogCaptureFixture) -> None:
    c = config()
    c.parallel.rank, c.parallel.output_device = 0, 0
    c.validation.validator = {"device": "cuda", "type": "Validator"}
    c.testing.tester = {"device": "cuda"}
    c.validation.drop_last = True
    assert accepted_lines(planned(config()).accepted, torch.device("cpu")) == []
    with caplog.at_level(logging.INFO, logger="unison"):
        report_accepted(planned(c).accepted)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 5
    assert lines[0].startswith("parallel.rank 0 is not used: each process takes its rank from the launcher")
    assert lines[1].startswith("parallel.output_device 0 is not used: the ranks run on the cpu")
    assert lines[2].startswith("validation.validator (device=cuda, type=Validator) is not needed")
    assert lines[3].startswith("testing.tester (device=cuda) is not needed")
    assert lines[4].startswith("validation.drop_last is true: each rank drops its last incomplete batch")
    assert [r.levelno for r in caplog.records] == [logging.INFO] * 4 + [logging.WARNING]


def test_a_validators_criterion_is_used_and_its_monitors_are_named_as_not_run() -> None:
    """criterion and apply_model become the section's loss and model call: never called "not needed"."""
    c = config()
    c.validation.validator = {"device": "cuda", "criterion": len, "evaluator_tasks": [{"name": "f1"}], "x": 1}
    c.testing.tester = {"criterion": len, "apply_model": len}
    lines = accepted_lines(planned(c).accepted, torch.device("cpu"))
    messages = [message for _, message in lines]
    assert messages[0].startswith("validation.validator (device=cuda) is not needed")
    assert messages[1].startswith("validation.validator.evaluator_tasks are not run")
    assert messages[2] == "validation.validator.x is not used by unison: it has no effect here"
    assert len(lines) == 3 and not any("criterion" in m or "apply_model" in m for m in messages)
    assert [level for level, _ in lines] == [logging.INFO, logging.WARNING, logging.WARNING]


# -- early_stopping: {type, args, kwargs} --------------------------------------------------------


def test_default_early_stopping_with_kwargs_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list = []
    make = unison.recipe.build.guards.make_early_stopping
    monkeypatch.setattr(
        unison.recipe.build.guards, "make_early_stopping", lambda *a: made.append(make(*a)) or made[-1]
    )
    c = load_config(
        BLOCK, ["data.build=!pyobject torch.utils.data.random_split", "early_stopping.kwargs={patience: 1}"]
    )
    quiet = config()
    quiet.early_stopping = c.early_stopping  # {type: DefaultEarlyStopping, args: [], kwargs: {patience: 1}}
    r = resolved(optimizer_kwargs={"lr": 0.0})  # nothing improves after the first evaluation
    parts = parts_of(quiet, r, tmp_path)
    assert type(made[0]) is EarlyStopping and made[0].checker.patience == 1
    parts.trainer.run(parts.train_loader, max_epochs=6)
    assert collect_results(parts, tmp_path, 1)["epochs"] == 2


# -- training.device: "cuda" on a machine without one ------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: 'cuda' is a device here")
def test_cuda_on_a_cpu_machine_fails_before_spawn_naming_the_override(tmp_path: Path) -> None:
    from unison.config import ConfigError
    from unison.recipe.build.preflight import preflight
    from unison.recipe.planning.run_plan import plan

    path = _user_config(tmp_path, "!pyobject qg_user.compute_loss")
    config = load_config(path, [f"training.path={tmp_path}"])
    with pytest.raises(ConfigError) as info:
        preflight(plan(config))
    line = next(i for i, row in enumerate(path.read_text().splitlines(), 1) if 'device: "cuda"' in row)
    assert str(info.value).startswith(f"{path}:{line}: training.device: 'cuda' asks for cuda")
    assert "--set training.device=cpu" in str(info.value)
    config = load_config(path, [f"training.path={tmp_path}", "training.device=cpu"])
    preflight(plan(config))


# -- the guide's block, end to end ---------------------------------------------------------------

USER_MODULE = """\
import torch
from torch import nn
from torch.utils.data import TensorDataset

from unison.distributed import split_dataset


class GNNModel(nn.Module):  # no graph here: a stand-in with the guide's name
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))

    def forward(self, x):
        return self.net(x)


def compute_loss(outputs, data, *args):  # QuantumGrav's signature: the whole batch (here x, y)
    return nn.functional.cross_entropy(outputs, data[1])


def build(seed, n=70):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    return split_dataset(TensorDataset(x, y), [0.8, 0.1, 0.1], seed=seed)
"""

CPU_LAPTOP = [
    "training.device=cpu",
    "training.num_epochs=2",
    "training.batch_size=8",
    "validation.batch_size=8",
    "testing.batch_size=8",
    "training.num_workers=0",  # worker processes are spawned processes here: seconds each
    "training.prefetch_factor=null",
    "validation.num_workers=0",
    "testing.num_workers=0",
    "logging.progress=false",
]
"""What a user on a 2-core laptop without a GPU changes, on the command line."""


def _user_config(folder: Path, criterion: str) -> Path:
    """The guide's block, unmodified but for the criterion, with the user's imports and data."""
    block = BLOCK.read_text()
    text = block.replace("!pyobject __main__.compute_loss", criterion)
    (folder / "qg_user.py").write_text(USER_MODULE)
    path = folder / "config.yaml"
    path.write_text(text + "imports: [qg_user]\ndata:\n  build: !pyobject qg_user.build\n")
    return path


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_unison_run_trains_the_guides_block_on_two_cpu_ranks(tmp_path: Path) -> None:
    path = _user_config(tmp_path, "!pyobject qg_user.compute_loss")
    out = tmp_path / "output"
    cmd = [sys.executable, "-m", "unison", "run", str(path), "--nproc", "2"]
    for item in [*CPU_LAPTOP, f"training.path={out}", f"parallel.master_port={find_free_port()}"]:
        cmd += ["--set", item]
    result = run_in_session(cmd, 200, ROOT)
    assert result.returncode == 0, f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"

    (run_dir,) = (out / "run").iterdir()  # training.path is the root of the run folders
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["epochs"]) == (2, 2)
    assert set(metrics["test"]) == {"loss"} and metrics["test"]["loss"] > 0  # the test phase ran
    assert set(metrics["validation"]) == {"loss"}
    saved = load_config(run_dir / "config.yaml")
    assert saved.early_stopping.patience == 5 and saved.model.type == "GNNModel"
    manifest = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())
    checkpoint = torch.load(
        run_dir / "checkpoints" / manifest["checkpoints"][-1]["file"], map_location="cpu", weights_only=True
    )
    assert "early_stopping" in checkpoint["objects"]  # DefaultEarlyStopping, attached on every rank
    for line in (
        "validation.validator (device=cuda) is not needed",
        "testing.tester (device=cuda) is not needed",
        "testing the best checkpoint",
    ):
        assert line in result.stderr, result.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_unison_run_refuses_main_before_spawning_and_says_what_to_write(tmp_path: Path) -> None:
    """The guide's `criterion: !pyobject __main__.compute_loss` under the `unison` command: exit status
    2, one line naming the key and the fix, no run folder (`python -m unison`: tests/config)."""
    path = _user_config(tmp_path, "!pyobject __main__.compute_loss")
    script = shutil.which("unison", path=str(Path(sys.executable).parent)) or shutil.which("unison")
    assert script, "no `unison` console script: run `pip install -e .`"
    cmd = [script, "run", str(path), "--nproc", "2", "--set", f"training.path={tmp_path / 'out'}"]
    result = run_in_session(cmd, 100, ROOT)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(
        f"unison run: {path}:1: criterion: !pyobject __main__.compute_loss: under `unison run`, "
        "`__main__` is the unison command itself, not your code."
    ), result.stderr
    assert "`!pyobject mymodule.compute_loss` with `imports: [mymodule]`" in result.stderr
    assert not (tmp_path / "out").exists()


def test_the_block_runs_from_the_users_script_under_torchrun_keeping_its_rendezvous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`criterion: !pyobject __main__.compute_loss` and `model.type: "GNNModel"`, both in the user's
    script, which runs the config through `unison.recipe.run`; here as the one rank of a torchrun
    job, whose MASTER_ADDR and MASTER_PORT win over the config's localhost:12355."""
    from unison.recipe.phases import run

    script = types.ModuleType("__main__")
    script.__file__ = str(tmp_path / "train_qg.py")
    record = "import os\ndef record(context):\n    context.results['rendezvous'] = os.environ['MASTER_ADDR'], os.environ['MASTER_PORT']\n"
    exec(compile(USER_MODULE + record, script.__file__, "exec"), script.__dict__)
    monkeypatch.setitem(sys.modules, "__main__", script)
    port = str(find_free_port())
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
    }.items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "config.yaml"
    path.write_text(BLOCK.read_text() + "data:\n  build: !pyobject __main__.build\n")
    here = [f"training.path={tmp_path / 'out'}", "hooks.after_training=!pyobject __main__.record"]
    logger = logging.getLogger("unison")  # a run in this process sets up unison's console logging
    saved = (list(logger.handlers), logger.level, logger.propagate)
    try:
        results = run(path, overrides=[*CPU_LAPTOP, *here])
    finally:
        logger.handlers[:], logger.propagate = saved[0], saved[2]
        logger.setLevel(saved[1])
    assert (results["world_size"], results["epochs"]) == (1, 2)
    assert results["rendezvous"] == ("127.0.0.1", port)  # not the config's localhost:12355
    written = json.loads((Path(results["run_dir"]) / "metrics.json").read_text())
    assert written["test"] == pytest.approx(results["test"])
