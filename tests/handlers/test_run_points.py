"""RunPoints: what a tracker logs and when, with a tracker that keeps what it is handed."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from unison.engine import create_trainer
from unison.handlers.run_points import Points, RunPoints


class Kept(RunPoints):
    """A tracker whose run is a list of the batches it was handed."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__("Kept", *args, **kwargs)  # type: ignore[arg-type]
        self.batches: list[Points] = []
        self.status: str | None = None

    def _open(self) -> None:
        pass

    def _send(self, points: Points) -> None:
        self.batches.append(points)

    def _end(self, status: str) -> None:
        self.status = status


@pytest.mark.parametrize(("hand_over_s", "batches"), [(0.0, 6), (3600.0, 2)])
def test_points_inside_an_epoch_wait_for_the_hand_over_period_and_an_epoch_end_hands_all(
    hand_over_s: float, batches: int
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, sync_every=2)
    kept = Kept(trainer, None, 2)
    kept.hand_over_s = hand_over_s
    kept.attach()
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)]
    trainer.run(data, max_epochs=2)
    assert (
        len(kept.batches) == batches
    )  # at once: 2 points and the epoch's end, per epoch; else one per epoch
    merged = {step: row for batch in kept.batches for step, row in batch.items()}
    assert sorted(merged) == [2, 4, 6, 8, 10, 12]  # the same points either way
    assert all("train/recent_loss" in merged[s] for s in (2, 4, 8, 10)) and "train/loss" in merged[12]
    assert kept.status == "FINISHED"


@pytest.mark.parametrize(
    ("evaluators", "every", "error", "says"),
    [
        ({"train": "trainer"}, None, ValueError, "other than 'train'"),
        ({"val": "trainer"}, None, TypeError, "an evaluation Engine other than the trainer"),
        ({}, 0, ValueError, "must be a positive int"),
        ({}, 2, ValueError, "sync_every=None"),
    ],
)
def test_every_tracker_checks_its_trainer_evaluators_and_every_alike(evaluators, every, error, says) -> None:
    from unison.handlers.mlflow import MLflowLogger

    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, sync_every=None)
    given = {name: trainer for name in evaluators}
    for who, build in (
        ("Kept", lambda: Kept(trainer, given, every)),
        (
            "MLflowLogger",
            lambda: MLflowLogger(
                "sqlite:///unused.db", trainer=trainer, experiment="e", evaluators=given, every=every
            ),
        ),
    ):
        with pytest.raises(error) as err:
            build()
        assert str(err.value).startswith(f"{who}(") and says in str(err.value), str(err.value)
