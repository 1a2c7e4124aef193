"""unison/checkpoint/tracking_step.py: trackers' steps go on across a renumbering resume, and the
offset travels in the trainer's saved state."""

from __future__ import annotations

import torch
from torch.nn import functional as F

from unison.checkpoint.positions import place_engine
from unison.checkpoint.state import Position
from unison.checkpoint.tracking_step import renumber, step_offset, tracking_step
from unison.engine import create_trainer


def _trainer():
    model = torch.nn.Linear(2, 1)
    return create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)


def test_a_renumbered_trainer_keeps_its_step_and_saves_the_offset() -> None:
    trainer = _trainer()
    trainer.load_state_dict({"iteration": 14, "epoch_length": 7, "max_epochs": 4})  # 1 rank, 2 epochs
    assert tracking_step(trainer) == 14 and step_offset(trainer) == 0
    renumber(trainer, 8)  # resumed at 2 ranks: 2 epochs of 4 batches
    assert (trainer.state.iteration, tracking_step(trainer)) == (8, 14)
    saved = trainer.state_dict()
    assert saved["unison"]["step_offset"] == 6

    again = _trainer()  # resumed once more, at the same world size: the offset stays
    again.load_state_dict(saved)
    assert (again.state.iteration, tracking_step(again)) == (8, 14)
    renumber(again, 6)  # and at 3 ranks: 2 epochs of 3 batches
    assert tracking_step(again) == 14
    plain = _trainer()
    plain.load_state_dict({"iteration": 3, "epoch_length": 3, "max_epochs": 2})
    assert step_offset(plain) == 0 and "unison" not in plain.state_dict()


def test_placing_a_resumed_trainer_mid_epoch_keeps_its_step() -> None:
    trainer = _trainer()
    trainer.load_state_dict({"iteration": 10, "epoch_length": 7, "max_epochs": 4})  # 3 into epoch 2
    place_engine(trainer, Position(epoch=1, iteration=6, epoch_length=4, into_epoch=2))
    assert (trainer.state.iteration, tracking_step(trainer)) == (6, 10)
