"""A tiny run for tests of the recipe layer: a data module and a config, written to a test's folder.

The model is ``Linear(4, 2)`` on 8 random samples (``build(seed)`` returns the same set for
training and validation); one epoch of two batches of 4, accuracy measured, no progress bar, no
TensorBoard, no preemption handler.
"""

from __future__ import annotations

from pathlib import Path

DATA_MODULE = """\
import torch
from torch.utils.data import TensorDataset


def build(seed):
    g = torch.Generator().manual_seed(seed)
    ds = TensorDataset(torch.randn(8, 4, generator=g), torch.randint(0, 2, (8,), generator=g))
    return ds, ds
"""

CONFIG = """\
name: {name}
model:
  type: !pyobject torch.nn.Linear
  kwargs: {{in_features: 4, out_features: 2}}
data:
  build: !pyobject {module}.build
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


def tiny_config(name: str, module: str, root: Path) -> str:
    """The config's text: the run ``name``, its data from ``<module>.build``, its runs under ``root``."""
    return CONFIG.format(name=name, module=module, root=root)


def write_tiny(folder: Path, name: str, module: str, extra: str = "") -> Path:
    """Writes ``<module>.py`` and ``config.yaml`` (the config, then ``extra``) to ``folder``; the config's path."""
    (folder / f"{module}.py").write_text(DATA_MODULE)
    path = folder / "config.yaml"
    path.write_text(tiny_config(name, module, folder / "runs") + extra)
    return path
