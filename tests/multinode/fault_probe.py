"""Config-named data and model for the elastic fault runs (this folder goes on PYTHONPATH).

- ``build_indexed(seed, size, val)``: a random training set whose sample ``i`` carries ``i``
  in its first pixel, so a model can tell which samples it trained on; and a validation set.
- ``TraceNet``: a tiny classifier that, in each training step, appends one JSON line to
  ``<trace>/<node>-<pid>.jsonl``: the time, the node (``PROBE_NODE`` in the agent's
  environment), rank, world size, this process's step count and the ids of the batch. On
  node ``node`` (or on rank 0's node, for ``node="rank0"``), at the ``at``-th step of the first worker group (the file ``flag`` does not
  exist yet), it creates ``flag`` (holding the time) and then, by ``fault``:

  - ``"hang"``: sleeps until it is killed (its node is lost);
  - ``"crash"``: kills itself with SIGKILL (a worker crash);
  - ``"term"``: waits until SIGTERM reaches it, hands the signal on to the handler it
    found (unison's Preemption: the ranks save at an agreed iteration) and trains on; with
    no handler installed, the signal then takes its default action.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import TensorDataset

TERM_WAIT_S = 120.0  # a "term" fault that no SIGTERM reaches fails the worker after this


def build_indexed(seed: int, size: int = 96, val: int = 16) -> tuple[TensorDataset, TensorDataset]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(size, 1, 8, 8, generator=gen)
    x[:, 0, 0, 0] = torch.arange(size, dtype=torch.float32)  # exact: integers below 2**24
    y = torch.randint(0, 10, (size,), generator=gen)
    return TensorDataset(x, y), TensorDataset(torch.randn(val, 1, 8, 8, generator=gen), y[:val].clone())


class TraceNet(nn.Module):
    def __init__(self, trace: str, flag: str, node: str = "", at: int = 0, fault: str = "none") -> None:
        super().__init__()
        if fault not in ("none", "hang", "crash", "term"):
            raise ValueError(f"TraceNet(fault=...) must be none, hang, crash or term, got {fault!r}")
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
        self.trace, self.flag = Path(trace), Path(flag)
        self.node, self.at, self.fault = node, int(at), fault
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.steps += 1
            self._record(x)
            if self.fault != "none" and self.steps == self.at and self._faults_here():
                self._fault()
        return self.net(x)

    def _faults_here(self) -> bool:
        """This worker meets the fault: its node is ``node``, or ``node`` is ``"rank0"`` and it is rank 0."""
        if self.node == "rank0":
            return os.environ.get("RANK") == "0"
        return os.environ.get("PROBE_NODE") == self.node

    def _record(self, x: torch.Tensor) -> None:
        line = {
            "t": time.time(),
            "node": os.environ.get("PROBE_NODE"),
            "pid": os.getpid(),
            "rank": int(os.environ.get("RANK", "0")),
            "world": int(os.environ.get("WORLD_SIZE", "1")),
            "step": self.steps,
            "ids": [int(v) for v in x[:, 0, 0, 0].tolist()],
        }
        self.trace.mkdir(parents=True, exist_ok=True)
        with open(self.trace / f"{line['node']}-{line['pid']}.jsonl", "a") as fh:
            fh.write(json.dumps(line) + "\n")

    def _fault(self) -> None:
        if self.fault == "term":
            self._wait_for_sigterm()
            return
        if not self._announce():
            return
        if self.fault == "crash":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # "hang"
            time.sleep(1.0)

    def _announce(self) -> bool:
        """Creates the flag, holding the time; False where it exists (a restarted group trains on)."""
        try:
            with open(self.flag, "x") as fh:
                fh.write(repr(time.time()))
        except FileExistsError:
            return False
        return True

    def _wait_for_sigterm(self) -> None:
        """Catches SIGTERM before the flag tells the driver to send it, so none is missed."""
        received: list[int] = []
        previous = signal.getsignal(signal.SIGTERM)

        def on_term(signum: int, frame: Any) -> None:
            received.append(signum)
            if callable(previous):
                previous(signum, frame)

        signal.signal(signal.SIGTERM, on_term)
        deadline = time.monotonic() + TERM_WAIT_S
        try:
            if not self._announce():
                return
            while not received:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"no SIGTERM reached rank {os.environ.get('RANK')} in {TERM_WAIT_S:g} s"
                    )
                time.sleep(0.02)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if not callable(previous) and previous != signal.SIG_IGN:
            os.kill(os.getpid(), signal.SIGTERM)  # no handler: the default action, as without the probe
