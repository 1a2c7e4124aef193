"""One job per run folder: of two `unison run --resume <run>` started together, exactly one trains.

The data of the run waits for a file the test writes: whichever job gets the run folder
holds it while it waits, so the other meets a held folder whatever the timing.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from _procs import kill_tree

from unison.checkpoint.lock import LOCK_FILE
from unison.config import load_config
from unison.recipe.phases import train_from_config

TIMEOUT_S = 240

DATA_MODULE = """\
import time
from pathlib import Path

import torch
from torch.utils.data import TensorDataset


def build(seed, go=None):
    deadline = time.monotonic() + 200
    while go is not None and not Path(go).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))
    return ds, ds
"""

CONFIG = """\
name: locked
model:
  type: !pyobject torch.nn.Linear
  kwargs: {{in_features: 4, out_features: 2}}
data:
  build: !pyobject run_lock_data.build
  kwargs: {{go: {go}}}
training:
  max_epochs: 1
  batch_size: 4
  optimizer_kwargs: {{lr: 0.01}}
  path: {root}
validation:
  metrics:
    accuracy: !pyobject unison.metrics.Accuracy
logging: {{progress: false, tensorboard: false}}
checkpoint: {{preemption: false}}
"""


@pytest.mark.slow
@pytest.mark.timeout(TIMEOUT_S + 60)
def test_two_resumes_of_one_run_folder_one_proceeds(tmp_path: Path, monkeypatch) -> None:
    go = tmp_path / "go"
    go.touch()
    (tmp_path / "run_lock_data.py").write_text(DATA_MODULE)
    config = tmp_path / "config.yaml"
    config.write_text(CONFIG.format(go=go, root=tmp_path / "runs"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    run_dir = Path(train_from_config(load_config(config))["run_dir"])
    sys.modules.pop("run_lock_data", None)
    go.unlink()
    cmd = [sys.executable, "-m", "unison", "run", str(config), "--nproc", "1", "--resume", str(run_dir),
           "--set", "training.max_epochs=2"]  # fmt: skip
    procs = [
        subprocess.Popen(
            cmd,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for _ in range(2)
    ]
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while all(p.poll() is None for p in procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        (refused,) = [p for p in procs if p.poll() is not None]
        (holder,) = [p for p in procs if p is not refused]
        _, err = refused.communicate(timeout=30)
        # The holder is named by its PID once it has written it; in the moment between taking the
        # lock and writing its PID (two jobs that start at once can meet there), as starting.
        named = (
            f"{run_dir} is in use by PID ",
            f"{run_dir} is in use by a process that is starting",
        )
        assert refused.returncode != 0 and any(form in err for form in named), err
        go.touch()  # the job that holds the folder trains on
        out, err = holder.communicate(timeout=TIMEOUT_S)
        assert holder.returncode == 0, err
    finally:
        kill_tree(*procs)
    assert f"run directory: {run_dir}" in out
    assert (run_dir / LOCK_FILE).read_text() == ""  # released by the job that ended
