"""Rank functions of tests/checkpoint/test_consolidate.py: sharded checkpoints written by real ranks.

Each rank saves its part of the models through torch's Distributed Checkpoint, as a
sharded save does: under FSDP2 every rank holds a different piece of each tensor (an
uneven one where a dimension does not divide by the world size); under DDP, wrapped in
``torch.compile``, the keys carry ``_orig_mod.module.``. Rank 0 writes ``rest.pt``.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp

from unison.distributed import get_rank, prepare_model
from unison.distributed.fsdp import is_sharded

TRAINED_SEED, AVERAGE_SEED = 0, 1


def make_model(seed: int) -> torch.nn.Module:
    """A small MLP whose last layer (3 rows) does not divide evenly over 2 ranks."""
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    torch.random.set_rng_state(generator_state)
    return model


def write_sharded(folder: str, strategy: str) -> dict[str, object]:
    """Saves ``{"model", "handler:EMA"}`` as a DCP into ``folder``; returns what the rank held."""
    model = prepare_model(make_model(TRAINED_SEED), strategy=strategy)
    average = prepare_model(make_model(AVERAGE_SEED), strategy=strategy)
    if strategy == "ddp":
        model = torch.compile(model)  # wrapping only: nothing is compiled before a forward
    state = {
        "model": model.state_dict(),
        "handler:EMA": {"weights": average.state_dict(), "n_averaged": 4, "updates": 9},
    }
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=folder)
    if get_rank() == 0:
        meta = {"epoch": 2, "iteration": 8, "sharded": ["model", "handler:EMA"]}
        torch.save(
            {"meta": meta, "objects": {"optimizer": {"state": {}, "param_groups": []}}}, f"{folder}/rest.pt"
        )
    torch.distributed.barrier()
    return {"sharded": is_sharded(model), "keys": sorted(state["model"])}
