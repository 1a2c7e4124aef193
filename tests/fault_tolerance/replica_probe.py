"""Config-named parts for ``unison run`` replica-group runs (this folder goes on PYTHONPATH).

- ``build_regression(seed)``: fixed regression data (the same in every group) and a validation set.
- ``ProbeNet(kill_at, pace, pace_until)``: a tiny MLP; in training, its ``kill_at``-th forward pass
  (0: never) SIGKILLs its own process (a replica group lost mid-step), and each forward pass waits
  ``pace`` seconds (it paces a group, so that a peer has the time to restart and rejoin) until
  the file ``pace_until`` exists (the test creates it once the peer has rejoined).
- ``record_commit(engine, out)``: a handler at ITERATION_COMPLETED that appends a JSON line to
  ``out/trace<replica id>.jsonl``: the quorum's committed step, the pid, the time and a digest of the model's weights.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset


def build_regression(seed: int) -> tuple[TensorDataset, TensorDataset]:
    gen = torch.Generator().manual_seed(1234)  # the same data in every group, whatever its seed
    x = torch.randn(160, 4, generator=gen)
    y = x.sum(1, keepdim=True).sin()
    return TensorDataset(x[:128], y[:128]), TensorDataset(x[128:], y[128:])


class ProbeNet(nn.Module):
    def __init__(self, kill_at: int = 0, pace: float = 0.0, pace_until: str = "") -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.kill_at, self.pace, self.pace_until = int(kill_at), float(pace), pace_until
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
            if self.steps == self.kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            if self.pace:
                if self.pace_until and os.path.exists(self.pace_until):
                    self.pace = 0.0
                else:
                    time.sleep(self.pace)
        return self.net(x)


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def record_commit(engine, out: str) -> None:  # type: ignore[no-untyped-def]
    step = engine._process_function
    trace = os.path.join(out, f"trace{step.group.settings.replica_id}.jsonl")
    line = {
        "step": step.group.step,
        "rank": step.group.rank,
        "pid": os.getpid(),
        "time": time.time(),
        "weights": digest(step.model),
    }
    with open(trace, "a") as f:
        f.write(json.dumps(line) + "\n")
