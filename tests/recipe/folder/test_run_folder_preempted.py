"""unison/recipe/phases.py: a preempted run says the exact command that continues it, with the real
paths and the --set items it was given, shell-quoted; that command resumes and finishes the run."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from unison.cli import main
from unison.handlers import EXIT_PREEMPTED

MODULE = """
import os
import signal

import torch
from torch.utils.data import Dataset, TensorDataset


class Preempting(Dataset):
    \"\"\"Sends SIGTERM to this process when item 5 is read the first time (the scheduler's notice).\"\"\"

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        flag = os.path.join(os.path.dirname(__file__), "preempted")
        if i == 5 and not os.path.exists(flag):
            open(flag, "w").close()
            os.kill(os.getpid(), signal.SIGTERM)
        return self.x[i], self.y[i]


def data(seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(12, 3, generator=g)
    y = x.sum(1, keepdim=True)
    return Preempting(x, y), TensorDataset(x[:4], y[:4])
"""

CONFIG = """name: pre
model: {{type: !pyobject torch.nn.Linear, kwargs: {{in_features: 3, out_features: 1}}}}
data: {{build: !pyobject pre_user.data}}
training:
  max_epochs: 2
  batch_size: 4
  loss: !pyobject torch.nn.functional.mse_loss
  optimizer_type: !pyobject torch.optim.SGD
  optimizer_kwargs: {{lr: 0.01}}
validation: {{metrics: {{loss: !pyobject unison.metrics.Loss}}}}
logging: {{root: {root}, progress: false}}
"""


@pytest.mark.timeout(120)
def test_a_preempted_run_names_the_command_that_continues_it(tmp_path: Path, monkeypatch) -> None:
    folder = tmp_path / "my runs"  # a space: the command quotes it
    folder.mkdir()
    (folder / "pre_user.py").write_text(MODULE)
    path = folder / "config.yaml"
    path.write_text(CONFIG.format(root=folder / "out"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        main(["run", "my runs/config.yaml", "--set", "training.optimizer_kwargs.lr=0.02"])
    assert info.value.code == EXIT_PREEMPTED
    (run_dir,) = (folder / "out" / "pre").iterdir()
    log = (run_dir / "logs" / "rank0.log").read_text()
    expected = shlex.join(
        ["unison", "run", str(path), "--set", "training.optimizer_kwargs.lr=0.02", "--resume", str(run_dir)]
    )
    assert expected in log, log
    argv = shlex.split(expected)
    assert argv[:2] == ["unison", "run"]
    assert main(argv[1:]) == 0  # the command continues the run to its end
    metrics = (run_dir / "metrics.json").read_text()
    assert '"epoch": 2' in metrics or '"epochs": 2' in metrics, metrics
    assert "changed on resume" not in (run_dir / "logs" / "rank0.log").read_text()
