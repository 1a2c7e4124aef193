"""Rank functions of tests/recipes/test_wordlm.py: recipes/wordlm's model and CarriedState handler
through unison's Python API (no config)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "recipes" / "wordlm"))
import wordlm  # noqa: E402

from unison.checkpoint import CheckpointError  # noqa: E402
from unison.distributed import get_world_size, prepare_loaders, prepare_model, unwrap_model  # noqa: E402
from unison.engine import create_trainer  # noqa: E402
from unison.handlers import Checkpoint  # noqa: E402
from unison.utils import manual_seed  # noqa: E402

STREAMS = 4


def train(folder: str, resume: str | None = None, epochs: int = 2) -> dict[str, Any]:
    """Trains the small word LM on this world size, saving every 3 iterations (from ``resume`` when given);
    returns the weights and the carried hidden state it ends with, or the resume's error."""
    manual_seed(0)
    train_set, _ = wordlm.build(0, bptt=8, streams=STREAMS, vocab=100, limit=800)
    model = prepare_model(wordlm.WordLSTM(vocab=100, dim=12, layers=2, dropout=0.2))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    loader, _ = prepare_loaders(train_set, batch_size=STREAMS // get_world_size(), shuffle=False)
    trainer = create_trainer(model, optimizer, F.cross_entropy, sync_every=1)
    carried = wordlm.CarriedState(model)
    carried.attach(trainer)
    checkpoint = Checkpoint(
        folder, {"model": model, "optimizer": optimizer}, trainer, every_iters=3, keep_last=None
    )
    checkpoint.attach()
    if resume is not None:
        try:
            checkpoint.resume(resume)
        except CheckpointError as err:
            return {"error": str(err)}
    trainer.run(loader, max_epochs=epochs)
    return {
        "weights": {k: v.clone() for k, v in unwrap_model(model).state_dict().items()},
        "hidden": [t.clone() for t in carried.hidden],
        "iterations": trainer.state.iteration,
    }
