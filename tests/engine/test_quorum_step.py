"""The trainer's step inside a quorum: applied only when committed, a failed try redone on the same batch.

A stand-in for :class:`~unison.distributed.replica_group.ReplicaGroup` decides which tries
commit; the real group, with torchft and a lighthouse, is tests/fault_tolerance's.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch
from torch import nn

from unison.distributed.replica_group import ReplicaSettings
from unison.engine import Events
from unison.engine.quorum_step import QuorumStep, create_replica_trainer


@dataclass
class FakeGroup:
    """Commits the tries whose number (from 1) is not in ``refuse``."""

    refuse: set[int]
    settings: ReplicaSettings = field(
        default_factory=lambda: ReplicaSettings(lighthouse="http://x:1", replica_id=0, replica_groups=2)
    )
    tries: int = 0
    step: int = 0
    starts: int = 0
    tracked: list[str] = field(default_factory=list)

    def start_step(self) -> None:
        self.starts += 1

    def commit(self) -> bool:
        self.tries += 1
        if self.tries in self.refuse:
            return False
        self.step += 1
        return True

    def track_training(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.tracked += ["model", "optimizer"]

    def wrap_model(self, model: nn.Module) -> nn.Module:
        return model


def _run(group: FakeGroup, batches: list) -> tuple[nn.Module, list[torch.Tensor], object]:
    torch.manual_seed(0)
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = create_replica_trainer(group, model, optimizer, nn.functional.mse_loss)  # type: ignore[arg-type]
    seen: list[torch.Tensor] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.batch[0]))
    trainer.run(batches, max_epochs=1)
    return model, seen, trainer


def _batches() -> list:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 2, generator=g), torch.randn(4, 1, generator=g)) for _ in range(5)]


def test_a_refused_try_is_redone_on_the_same_batch_and_applied_once() -> None:
    batches = _batches()
    truth, _, _ = _run(FakeGroup(refuse=set()), batches)
    model, seen, trainer = _run(FakeGroup(refuse={2, 3, 6}), batches)
    # Every batch applied once, in order: the same weights as a run where every try commits.
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), truth.parameters(), strict=True))
    assert trainer.state.iteration == 5 and len(seen) == 5
    assert isinstance(trainer.process_function, QuorumStep)
    assert trainer.process_function.failed_tries == 3
    assert trainer.process_function.group.starts == 8  # each try joins a quorum


def test_a_step_never_committed_fails_the_rank_with_what_to_check() -> None:
    with pytest.raises(RuntimeError, match=r"not committed in 3 tries.*step_attempts"):
        _run(FakeGroup(refuse={2, 3, 4}), _batches())


def test_the_state_a_healing_group_needs_is_tracked() -> None:
    group = FakeGroup(refuse=set())
    _run(group, _batches()[:1])
    assert group.tracked == ["model", "optimizer"]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"accumulation_steps": 2}, "accumulation_steps=2"),
        ({"amp": "fp16"}, "amp='fp16'"),
    ],
)
def test_what_a_quorum_cannot_agree_on_is_refused(kwargs: dict, match: str) -> None:
    model = nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=match):
        create_replica_trainer(FakeGroup(refuse=set()), model, optimizer, nn.functional.mse_loss, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"replica_id": 2, "replica_groups": 2}, r"replica_id must be in \[0, replica_groups\)"),
        ({"replica_id": 0, "replica_groups": 2, "min_replicas": 3}, "min_replicas=3"),
        ({"replica_id": 0, "replica_groups": 2, "step_attempts": 0}, "step_attempts=0"),
    ],
)
def test_settings_out_of_range_say_which_and_why(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ReplicaSettings(lighthouse="http://x:1", **kwargs)
