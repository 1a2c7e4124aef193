"""Config-named helpers for the multi-node tests (this folder goes on PYTHONPATH).

- ``record``: a ``hooks.after_training`` hook; each rank writes
  ``<run_dir>/placement/rank<R>.json`` with what its launcher told it (torchrun's or
  SLURM's variables) and what unison and ignite made of it.
- ``SlowCNN``: the digits recipe's model, sleeping in each training step, so that a test
  can signal a job while it is still training.

Named with ``--set imports=[multinode_probe]`` and, for instance,
``--set 'hooks.after_training=!pyobject multinode_probe.record'``.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

import torch
from torch import nn

_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "GROUP_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_NODEID",
    "SLURM_RESTART_COUNT",
)

# Imported when the config is resolved, before the process group exists: what the
# launcher alone set (ignite later exports RANK & co. under SLURM too).
_AT_START = {k: os.environ.get(k) for k in _VARS}


def _launcher_at_start() -> str:
    from unison.distributed import detect_launcher

    return detect_launcher({k: v for k, v in _AT_START.items() if v is not None}).kind


def record(context: Any) -> None:
    """Writes where this rank ran; called on every rank after training."""
    import ignite.distributed as idist

    out = context.run_dir / "placement"
    out.mkdir(parents=True, exist_ok=True)
    rank = idist.get_rank()
    data = {
        "env": {k: os.environ.get(k) for k in _VARS},
        "env_at_start": _AT_START,
        "launcher": _launcher_at_start(),
        "rank": rank,
        "local_rank": idist.get_local_rank(),
        "world_size": idist.get_world_size(),
        "node_rank": idist.get_node_rank(),
        "nnodes": idist.get_nnodes(),
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "host": socket.gethostname(),
        "iterations": context.trainer.state.iteration,
    }
    tmp = out / f"rank{rank}.json.tmp"
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, out / f"rank{rank}.json")


class SlowCNN(nn.Module):
    """The digits recipe's SmallCNN, sleeping ``delay`` seconds in each training forward.

    Same initialisation and the same steps as the recipe's model (its parameters sit under
    ``inner.``); only the wall time grows.
    """

    def __init__(self, delay: float = 0.05, **kwargs: Any) -> None:
        from digits import SmallCNN  # the recipe's folder is on sys.path once its config is resolved

        super().__init__()
        self.inner = SmallCNN(**kwargs)
        self.delay = float(delay)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.delay:
            time.sleep(self.delay)
        return self.inner(x)
