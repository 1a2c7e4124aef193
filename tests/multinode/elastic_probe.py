"""A config-named model for the elastic torchrun test (this folder goes on PYTHONPATH).

``CrashOnceCNN``: the digits recipe's SmallCNN (its parameters under ``inner.``), whose rank
``rank`` kills itself with SIGKILL at its ``at``-th training step, once: it creates the file
``flag`` first, so the restarted worker group trains on.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn


class CrashOnceCNN(nn.Module):
    def __init__(self, flag: str, at: int, rank: int = 1, **kwargs: Any) -> None:
        from digits import SmallCNN  # the recipe's folder is on sys.path once its config is resolved

        super().__init__()
        self.inner = SmallCNN(**kwargs)
        self.flag, self.at, self.rank = Path(flag), int(at), int(rank)
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and int(os.environ.get("RANK", "0")) == self.rank:
            self.steps += 1
            if self.steps == self.at:
                try:
                    self.flag.touch(exist_ok=False)
                except FileExistsError:
                    pass
                else:
                    os.kill(os.getpid(), signal.SIGKILL)
        return self.inner(x)
