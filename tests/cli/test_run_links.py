"""A run folder is data: `unison run --resume` refuses one whose entries unison writes are links
(or FIFOs), before any rank starts, naming the entry, and leaves what they point to untouched."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from _tiny_run import tiny_config, write_tiny

from unison.config import load_config
from unison.recipe import phases as runner
from unison.recipe.phases import ResumeError, run, train_from_config

TIMEOUT_S = 240



BASHRC = "export PATH=/usr/bin:/bin\n"

FILES = [
    ".unison-lock",
    ".unison-run",
    "config.yaml",
    "metrics.json",
    "history.jsonl",
    "changes-on-resume.jsonl",
    "job.json",
    "logs/rank0.log",
    "checkpoints/manifest.json",
    "checkpoints/.unison-lock",
    "checkpoints/.manifest.json.x1y2.tmp",
]
FOLDERS = ["checkpoints", "logs", "tb", "wandb"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A config and a finished run of it (one epoch, one process), made once."""
    folder = tmp_path_factory.mktemp("links")
    config = write_tiny(folder, "tiny", "run_links_data")
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(folder))
        mp.chdir(folder)
        run_dir = Path(train_from_config(load_config(config))["run_dir"])
    sys.modules.pop("run_links_data", None)
    return config, run_dir


@pytest.fixture
def copy(trained: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A copy of the trained run's config and run folder in ``tmp_path``, where nothing may be spawned."""
    import shutil

    config, run_dir = trained
    shutil.copy(config.parent / "run_links_data.py", tmp_path)
    (tmp_path / "config.yaml").write_text(tiny_config("tiny", "run_links_data", tmp_path / "runs"))
    target = tmp_path / "runs" / "tiny" / run_dir.name
    shutil.copytree(run_dir, target)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)

    def spawned(*args: object, **kwargs: object) -> None:
        raise AssertionError("ranks were spawned for a run folder holding a link")

    monkeypatch.setattr(runner, "launch_config", spawned)
    return tmp_path / "config.yaml", target


def _plant_file(run_dir: Path, name: str, victim: Path) -> None:
    entry = run_dir / name
    entry.parent.mkdir(parents=True, exist_ok=True)
    if entry.exists():
        entry.unlink()
    entry.symlink_to(victim)


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("resume", ["folder", "auto"])
@pytest.mark.parametrize("name", FILES)
def test_a_linked_file_is_refused_before_spawning_and_its_target_untouched(copy, tmp_path, name, resume):
    config, run_dir = copy
    victim = tmp_path / "bashrc"
    victim.write_text(BASHRC)
    _plant_file(run_dir, name, victim)
    with pytest.raises(ResumeError) as err:
        run(config, nproc=1, resume=str(run_dir) if resume == "folder" else "auto")
    assert f"{run_dir / name} is a symbolic link (to {victim})" in str(err.value)
    assert "leave out --resume" in str(err.value)
    assert victim.read_text() == BASHRC


@pytest.mark.timeout(TIMEOUT_S)
@pytest.mark.parametrize("name", FOLDERS)
def test_a_linked_folder_is_refused_before_spawning_and_nothing_is_written_in_its_target(
    copy, tmp_path, name
):

    config, run_dir = copy
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "rank0.log").write_text(BASHRC)
    if (run_dir / name).exists():
        import shutil

        shutil.copytree(run_dir / name, elsewhere, dirs_exist_ok=True)
        shutil.rmtree(run_dir / name)
    (run_dir / name).symlink_to(elsewhere)
    before = {p.name: p.read_bytes() for p in elsewhere.iterdir()}
    with pytest.raises(ResumeError, match=f"{run_dir / name} is a symbolic link"):
        run(config, nproc=1, resume=str(run_dir))
    assert {p.name: p.read_bytes() for p in elsewhere.iterdir()} == before


@pytest.mark.timeout(TIMEOUT_S)
def test_a_fifo_where_unison_reads_is_refused_before_spawning(copy):
    config, run_dir = copy
    (run_dir / "config.yaml").unlink()
    os.mkfifo(run_dir / "config.yaml")
    with pytest.raises(ResumeError, match=f"{run_dir / 'config.yaml'} is a FIFO"):
        run(config, nproc=1, resume=str(run_dir))


@pytest.mark.timeout(TIMEOUT_S)
def test_a_linked_run_folder_is_refused_by_auto(copy, tmp_path):
    config, run_dir = copy
    real = tmp_path / "real-run"
    run_dir.rename(real)
    (run_dir.parent / "99991231-235959").symlink_to(real)  # the newest run, as --resume auto sees it
    with pytest.raises(ResumeError, match="99991231-235959 is a symbolic link"):
        run(config, nproc=1, resume="auto")


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_a_folder_named_like_a_command_whose_log_links_to_a_startup_file(trained, tmp_path):
    """The CLI, end to end: the folder's name would be quoted into the appended log lines."""
    import shutil

    config, run_dir = trained
    shutil.copy(config.parent / "run_links_data.py", tmp_path)
    (tmp_path / "config.yaml").write_text(tiny_config("tiny", "run_links_data", tmp_path / "runs"))
    planted = tmp_path / "runs" / "tiny" / "x;touch PWNED;#"
    shutil.copytree(run_dir, planted)
    bashrc = tmp_path / ".bashrc"
    bashrc.write_text(BASHRC)
    (planted / "logs" / "rank0.log").unlink()
    (planted / "logs" / "rank0.log").symlink_to(bashrc)
    for resume in (str(planted), "auto"):
        done = subprocess.run(
            [sys.executable, "-m", "unison", "run", "config.yaml", "--nproc", "1", "--resume", resume],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
        assert done.returncode == 2, done.stderr[-3000:]
        assert f"{planted / 'logs' / 'rank0.log'} is a symbolic link (to {bashrc})" in done.stderr
        assert "rank 0" not in done.stderr  # refused before any rank started
    assert bashrc.read_text() == BASHRC
    assert not (tmp_path / "PWNED").exists()
