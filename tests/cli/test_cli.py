"""unison/cli/__init__.py: `unison run | doctor | plot`, as a user types them.

The training run is a real one (2 spawned gloo ranks, one short epoch of the digits recipe)
in a subprocess of its own session, so that a timeout can end every process it started.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _procs import run_in_session

from unison.cli import main
from unison.config import load_config, to_plain
from unison.distributed.env import find_free_port

ROOT = Path(__file__).resolve().parents[2]
DIGITS = ROOT / "recipes" / "digits" / "config.yaml"
RUN_TIMEOUT_S = 240
QUICK_TIMEOUT_S = 120
ITERATIONS = 5


def run_command(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    """Runs cmd in a new session; on a timeout ends its whole process tree and fails."""
    return run_in_session(cmd, timeout, ROOT)


def short_run(root: Path) -> list[str]:
    return [
        "training.max_epochs=1",
        f"training.epoch_length={ITERATIONS}",
        "logging.progress=false",
        f"logging.root={root}",
    ]


# -- help and entry points ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(QUICK_TIMEOUT_S + 30)
def test_python_dash_m_unison_help():
    result = run_command([sys.executable, "-m", "unison", "--help"], QUICK_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("usage: unison")
    for command in ("run", "doctor", "plot"):
        assert command in result.stdout


def test_run_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as info:
        main(["run", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--nproc", "--set", "--resume", "KEY=VALUE", "auto|PATH"):
        assert option in out


def test_no_command_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2
    assert "usage: unison" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.timeout(QUICK_TIMEOUT_S + 30)
def test_console_script_reports_a_bad_config_with_exit_2(tmp_path):
    """The installed `unison` command: a config error is one line on stderr and exit status 2."""
    script = shutil.which("unison", path=str(Path(sys.executable).parent)) or shutil.which("unison")
    assert script, "no `unison` console script: run `pip install -e .`"
    path = tmp_path / "bad.yaml"
    text = DIGITS.read_text()
    assert text.count("batch_size: 32") == 1
    path.write_text(text.replace("batch_size: 32", "batch_size: many"))
    line = next(i for i, row in enumerate(path.read_text().splitlines(), 1) if "batch_size: many" in row)
    result = run_command([script, "run", str(path), "--nproc", "2"], QUICK_TIMEOUT_S)
    assert result.returncode == 2, result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith(f"unison run: {path}:{line}: training.batch_size: expected int"), (
        result.stderr
    )
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_run_bad_override_exits_2_in_process(capsys, tmp_path):
    rc = main(["run", str(DIGITS), "--set", "training.batch_size=0", "--set", f"logging.root={tmp_path}"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("unison run: --set training.batch_size=0: training.batch_size: must be > 0")
    assert list(tmp_path.iterdir()) == []


def test_debug_shows_the_traceback_of_an_expected_error(capsys, tmp_path):
    from unison.config import ConfigError

    with pytest.raises(ConfigError, match="training.batch_size: must be > 0"):
        main(["run", str(DIGITS), "--debug", "--set", "training.batch_size=0", "--set", f"logging.root={tmp_path}"])


def test_a_missing_resume_path_exits_2_naming_it(capsys, tmp_path):
    rc = main(["run", str(DIGITS), "--resume", str(tmp_path / "gone.pt"), "--set", f"logging.root={tmp_path}"])
    assert rc == 2
    assert "--resume " + str(tmp_path / "gone.pt") + ": no such file or folder" in capsys.readouterr().err


# -- doctor ---------------------------------------------------------------------------------


def test_doctor_passes_on_this_machine(capsys):
    """With a port known to be free (the default 29500 may be held by another job's torchrun)."""
    pytest.importorskip("unison.cli.doctor")
    port = find_free_port()
    rc = main(["doctor", "--master-port", str(port)])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"{port} (--master-port): free" in out


def test_doctor_fails_when_the_master_port_is_taken(capsys):
    pytest.importorskip("unison.cli.doctor")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("0.0.0.0", 0))
        holder.listen()
        port = holder.getsockname()[1]
        rc = main(["doctor", "--master-port", str(port)])
    out = capsys.readouterr().out
    assert rc != 0, out
    assert f"master port {port} is in use" in out


# -- a real run -----------------------------------------------------------------------------


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 30)
def test_unison_run_digits_writes_a_complete_run_directory(tmp_path):
    overrides = short_run(tmp_path)
    cmd = [sys.executable, "-m", "unison", "run", "recipes/digits/config.yaml", "--nproc", "2"]
    for item in overrides:
        cmd += ["--set", item]
    result = run_command(cmd, RUN_TIMEOUT_S)
    assert result.returncode == 0, f"{' '.join(cmd)}\n{result.stdout[-3000:]}\n{result.stderr[-5000:]}"

    runs = sorted((tmp_path / "digits").iterdir())
    assert len(runs) == 1, runs
    run_dir = runs[0]
    assert re.fullmatch(r"\d{8}-\d{6}(-\d+)?", run_dir.name), run_dir.name
    assert f"run directory: {run_dir}\n" in result.stdout

    # config.yaml: the whole config, overrides applied, loading back to the same data
    expected = load_config(DIGITS, overrides)
    written = load_config(run_dir / "config.yaml")
    assert to_plain(written) == to_plain(expected)
    assert (written.training.max_epochs, written.training.epoch_length) == (1, ITERATIONS)

    # checkpoints: a manifest naming a file that loads with weights_only=True
    manifest = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())
    files = [entry["file"] for entry in manifest["checkpoints"]]
    assert files and sorted(p.name for p in (run_dir / "checkpoints").glob("*.pt")) == sorted(files)
    checkpoint = torch.load(run_dir / "checkpoints" / files[-1], map_location="cpu", weights_only=True)
    assert checkpoint["config"] == to_plain(expected)

    # logs: one file per rank
    assert sorted(p.name for p in (run_dir / "logs").iterdir()) == ["rank0.log", "rank1.log"]

    # metrics.json: rank 0's results
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert (metrics["world_size"], metrics["epochs"], metrics["iterations"]) == (2, 1, ITERATIONS)
    assert metrics["run_dir"] == str(run_dir)
    accuracy = metrics["validation"]["accuracy"]
    assert 0.0 <= accuracy <= 1.0 and 0.0 <= metrics["test"]["accuracy"] <= 1.0

    # tb: the epoch's training loss and validation metrics at the epoch's last iteration
    from unison.utils.event_files import read_scalars

    scalars = read_scalars(run_dir / "tb")
    assert [step for step, _ in scalars["train/loss"]] == [ITERATIONS]
    assert scalars["train/loss"][0][1] == pytest.approx(metrics["train_loss"], rel=1e-6)
    assert scalars["val/accuracy"] == [(ITERATIONS, pytest.approx(accuracy, rel=1e-6))]
