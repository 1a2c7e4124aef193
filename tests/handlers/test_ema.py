"""unison/handlers/ema.py: an average of the weights per optimizer update, with buffers, resumed exactly.

The truths: the average computed by hand from the weights after each update; and the
uninterrupted run for a resumed one (bit for bit, at 1 and 2 ranks, with the LR warmup
of unison/handlers/lr_scaling.py in the same runs).
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from _ema_workers import resume_matches
from ignite.engine import Engine as IgniteEngine
from torch import nn
from torch.nn import functional as F

from unison.engine import UpdateEvents, create_trainer
from unison.handlers import EMA
from unison.testing import run_distributed


def _trainer(model: nn.Module, accumulation: int = 1):
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    return create_trainer(model, optimizer, F.mse_loss, accumulation_steps=accumulation)


def _data(n: int, features: int = 3) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(4, features, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(n)]


def _weights_at_updates(trainer, model: nn.Module) -> list[dict[str, torch.Tensor]]:
    seen: list[dict[str, torch.Tensor]] = []
    trainer.add_event_handler(
        UpdateEvents.UPDATE_COMPLETED,
        lambda e: seen.append({k: v.detach().clone() for k, v in model.state_dict().items()}),
    )
    return seen


def _by_hand(start: dict, seen: list[dict], decay: float, every: int = 1, warmup: int = 0) -> dict:
    """AveragedModel's EMA: its first average (and each in the warmup) is a copy of the weights."""
    avg, averaged = {k: v.clone() for k, v in start.items()}, 0
    for u, weights in enumerate(seen, start=1):
        if u % every:
            continue
        for k, w in weights.items():
            if u <= warmup or not averaged or not w.is_floating_point():
                avg[k] = w.clone()
            else:
                avg[k] = torch.lerp(avg[k], w, 1 - decay)
        averaged += 1
    return avg


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_average_moves_once_per_update_not_per_micro_batch() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model, accumulation=3)
    seen = _weights_at_updates(trainer, model)
    ema = EMA(model, decay=0.6)
    ema.attach(trainer)
    trainer.run(_data(9))
    assert (trainer.state.iteration, trainer.state.update, ema.updates, len(seen)) == (9, 3, 3, 3)
    assert _equal(ema.module.state_dict(), _by_hand(start, seen, 0.6))
    assert not _equal(ema.module.state_dict(), model.state_dict())


def test_warmup_copies_and_every_skips() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model)
    seen = _weights_at_updates(trainer, model)
    ema = EMA(model, decay=0.5, every=2, warmup=2)
    ema.attach(trainer)
    trainer.run(_data(2))
    assert _equal(ema.module.state_dict(), model.state_dict())  # update 2: a copy, in the warmup
    trainer.run(_data(2), max_epochs=3)  # updates 3 (skipped), 4 (averaged), 5, 6
    assert ema.updates == 6 and int(ema.averaged.n_averaged) == 3
    assert _equal(ema.module.state_dict(), _by_hand(start, seen, 0.5, every=2, warmup=2))


def test_buffers_are_averaged_and_counters_copied() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
    start = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(model)
    seen = _weights_at_updates(trainer, model)
    ema = EMA(model, decay=0.9)
    ema.attach(trainer)
    trainer.run(_data(5))
    state = ema.module.state_dict()
    assert _equal(state, _by_hand(start, seen, 0.9))
    assert int(state["1.num_batches_tracked"]) == 5  # a counter follows the model, never 0.9 x 4 + 0.1 x 5
    assert not torch.equal(state["1.running_mean"], model[1].running_mean)  # an average, not a copy
    assert state["1.running_mean"].data_ptr() != model[1].running_mean.data_ptr()  # never shared storage
    assert not ema.module.training


def test_state_round_trips_through_weights_only_and_loads_into_the_models_class() -> None:
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    trainer = _trainer(model)
    ema = EMA(model, decay=0.8)
    ema.attach(trainer)
    trainer.run(_data(3))
    buffer = io.BytesIO()
    torch.save(ema.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    fresh = EMA(nn.Linear(3, 1), decay=0.8)
    fresh.load_state_dict(state)
    assert fresh.updates == 3 and int(fresh.averaged.n_averaged) == 3
    assert _equal(fresh.module.state_dict(), ema.module.state_dict())
    plain = nn.Linear(3, 1)
    plain.load_state_dict(state["weights"])  # the model's own keys: deployable as it is
    with pytest.raises(KeyError, match="updates"):
        fresh.load_state_dict({"weights": state["weights"]})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"decay": 1.0}, r"EMA\(decay=1.0\): expected a number in \(0, 1\)"),
        ({"decay": 0}, r"decay=0"),
        ({"every": 0}, r"EMA\(every=0\): expected an int >= 1"),
        ({"warmup": -1}, r"EMA\(warmup=-1\): expected an int >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EMA(nn.Linear(2, 1), **kwargs)


def test_an_engine_without_updates_is_refused() -> None:
    with pytest.raises(ValueError, match="never fires UpdateEvents.UPDATE_COMPLETED"):
        EMA(nn.Linear(2, 1)).attach(IgniteEngine(lambda e, b: None))


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_resumed_run_has_the_uninterrupted_runs_ema_and_learning_rates(nproc: int, tmp_path: Path) -> None:
    """Resumed from a mid-epoch save inside the LR warmup, with accumulation and BatchNorm."""
    if nproc == 1:
        results = [resume_matches(str(tmp_path))]
    else:
        results = run_distributed(resume_matches, str(tmp_path), nproc=nproc, timeout=120)
    for r in results:
        full, resumed = r["full"], r["resumed"]
        assert r["iteration"] % r["epoch_length"] and 0 < r["update_at"] < 5  # mid-epoch, inside the warmup
        assert _equal(full["weights"], resumed["weights"])
        assert full["ema_updates"] == resumed["ema_updates"]
        params = [k for k in full["ema"] if "running" not in k and "num_batches" not in k]
        assert all(torch.equal(full["ema"][k], resumed["ema"][k]) for k in params)  # every rank: bitwise
        assert resumed["lrs"] == full["lrs"][r["update_at"] :]
        assert full["lrs"][:3] == pytest.approx([0.2 / 5, 0.2 * 2 / 5, 0.1 * 3 / 5])  # warmup x StepLR
    rank0 = results[0]
    assert _equal(rank0["full"]["ema"], rank0["resumed"]["ema"])  # rank 0's buffers too: what is saved
