"""The hot path is free: the training and evaluation steps never read a device value on the host.

The epoch-end sync point reads the epoch's sums on purpose, so it is left out, in two ways:

- runs with ``max_iters`` below ``epoch_length`` stop before any ``EPOCH_COMPLETED`` (and before
  the first ``sync_every`` point), so everything the run does is counted: STARTED,
  EPOCH_STARTED, every iteration and the handlers of each;
- over whole epochs, :class:`IterationProbe` counts from ``ITERATION_STARTED`` to the last
  ``ITERATION_COMPLETED`` handler, so the short accumulation window at the epoch's end is
  covered too.
"""

from __future__ import annotations

import io

import pytest
import torch
from _collective_probe import count_collectives
from _probes import IterationProbe
from _sync_probe import count_host_syncs
from _training import make_mlp, regression_rows, shard_batches
from torch.nn import functional as F

from unison.distributed import get_rank, prepare_model
from unison.engine import Engine, Events, create_evaluator, create_trainer
from unison.handlers import ProgressBar
from unison.metrics import Accuracy, Loss
from unison.testing import run_distributed

N_ITERS = 6
EPOCH_LENGTH = 5


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = regression_rows(n * 4, seed)
    return shard_batches(x, y, n_batches=n, per_rank=4, rank=0, world_size=1)


def _class_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(3)
    return [(torch.randn(4, 6, generator=gen), torch.randint(0, 3, (4,), generator=gen)) for _ in range(n)]


def _trainer(**kwargs) -> tuple[Engine, list[int]]:
    model = make_mlp()
    # SGD: Adam and AdamW read their step counter with .item(); that counter lives on the CPU
    # (not the device), which this CPU-only probe cannot tell from a device read.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    trainer = create_trainer(model, optimizer, F.mse_loss, **kwargs)
    steps: list[int] = []
    optimizer.register_step_post_hook(lambda *_: steps.append(trainer.state.iteration))
    ProgressBar(file=io.StringIO()).attach(trainer)  # claims to read no device value either
    return trainer, steps


TRAIN_CONFIGS = {
    "plain": {},
    "accumulate-2": {"accumulation_steps": 2},
    "accumulate-3": {"accumulation_steps": 3},
    "clip": {"clip_grad_norm": 0.1},
    "bf16": {"amp": "bf16"},
    "bf16-accumulate-clip": {"amp": "bf16", "accumulation_steps": 2, "clip_grad_norm": 0.1},
}


@pytest.mark.parametrize("config", TRAIN_CONFIGS.values(), ids=TRAIN_CONFIGS.keys())
def test_training_run_has_no_host_sync_before_the_sync_point(config):
    trainer, steps = _trainer(**config)
    with count_host_syncs() as syncs:
        state = trainer.run(_batches(8), max_iters=N_ITERS, epoch_length=100)
    assert state.iteration == N_ITERS
    assert trainer.sync_point.count == 0  # neither an epoch end nor a sync_every point was reached
    assert len(steps) == N_ITERS // config.get("accumulation_steps", 1)
    assert syncs.count == 0, syncs.calls


@pytest.mark.parametrize("config", TRAIN_CONFIGS.values(), ids=TRAIN_CONFIGS.keys())
def test_training_iterations_have_no_host_sync_over_whole_epochs(config):
    trainer, steps = _trainer(**config)
    probe = IterationProbe(count_host_syncs).attach(trainer)
    state = trainer.run(_batches(EPOCH_LENGTH), max_epochs=2)
    assert state.iteration == probe.iterations == 2 * EPOCH_LENGTH
    assert EPOCH_LENGTH in steps and 2 * EPOCH_LENGTH in steps  # the short last windows updated
    assert probe.count == 0, probe.calls


def test_the_sync_point_is_where_the_host_reads():
    """Why the tests above leave the sync point out: there, the epoch's sums are read."""
    trainer, _ = _trainer()
    with count_host_syncs() as syncs:
        trainer.run(_batches(EPOCH_LENGTH), max_epochs=2)
    assert syncs.count > 0


SYNC_FORMS = {
    "item": lambda t: t.item(),
    "bool": lambda t: bool(t > 0),
    "float": lambda t: float(t),
    "tolist": lambda t: t.tolist(),
    "cpu": lambda t: t.cpu(),
    "numpy": lambda t: t.detach().numpy(),
}


@pytest.mark.parametrize("form", SYNC_FORMS.values(), ids=SYNC_FORMS.keys())
def test_positive_control_probe_catches_a_sync_in_a_handler(form):
    trainer, _ = _trainer(accumulation_steps=2)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: form(e.state.output))
    with count_host_syncs() as syncs:
        trainer.run(_batches(8), max_iters=N_ITERS, epoch_length=100)
    assert syncs.count >= N_ITERS, syncs.calls

    trainer, _ = _trainer(accumulation_steps=2)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: form(e.state.output))
    probe = IterationProbe(count_host_syncs).attach(trainer)
    trainer.run(_batches(EPOCH_LENGTH), max_epochs=2)
    assert probe.count >= 2 * EPOCH_LENGTH, probe.calls


def test_positive_control_counts_each_item_once():
    trainer, _ = _trainer()
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: e.state.output.item())
    probe = IterationProbe(count_host_syncs).attach(trainer)
    trainer.run(_batches(EPOCH_LENGTH), max_epochs=2)
    assert probe.count == 2 * EPOCH_LENGTH, probe.calls


def test_positive_control_probe_catches_a_sync_in_the_loss():
    def loss_fn(y_pred, y):
        loss = F.mse_loss(y_pred, y)
        if loss > 1e6:  # a hidden bool(tensor)
            raise AssertionError("unreachable")
        return loss

    model = make_mlp()
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn)
    with count_host_syncs() as syncs:
        trainer.run(_batches(8), max_iters=N_ITERS, epoch_length=100)
    assert syncs.count >= N_ITERS


def test_fp16_reads_the_host_only_inside_grad_scaler_step():
    """With fp16 the step's reads are GradScaler.step's overflow check, as documented."""
    trainer, steps = _trainer(amp="fp16", clip_grad_norm=1.0, accumulation_steps=2)
    scaler = trainer.process_function.scaler
    inside: list[int] = []
    original = scaler.step
    probe = IterationProbe(count_host_syncs).attach(trainer)

    def measured_step(*args, **kwargs):
        before = probe.records[-1].count
        try:
            return original(*args, **kwargs)
        finally:
            inside.append(probe.records[-1].count - before)

    scaler.step = measured_step
    trainer.run(_batches(EPOCH_LENGTH), max_epochs=2)
    assert len(inside) == len(steps) == 2 * 3
    assert probe.count == sum(inside), probe.calls


def _evaluator() -> Engine:
    model = torch.nn.Sequential(torch.nn.Linear(6, 3))
    metrics = {"acc": Accuracy(), "top2": Accuracy(top_k=2), "loss": Loss(F.cross_entropy)}
    evaluator = create_evaluator(model, metrics)
    ProgressBar(file=io.StringIO()).attach(evaluator)
    return evaluator


def test_evaluation_run_has_no_host_sync_before_the_sync_point():
    evaluator = _evaluator()
    with count_host_syncs() as syncs:
        state = evaluator.run(_class_batches(8), max_iters=N_ITERS, epoch_length=100)
    assert state.iteration == N_ITERS
    assert syncs.count == 0, syncs.calls


def test_evaluation_iterations_have_no_host_sync():
    evaluator = _evaluator()
    probe = IterationProbe(count_host_syncs).attach(evaluator)
    state = evaluator.run(_class_batches(EPOCH_LENGTH))
    assert probe.iterations == EPOCH_LENGTH
    assert probe.count == 0, probe.calls
    assert set(state.metrics) >= {"acc", "top2", "loss"}


def test_positive_control_evaluator():
    evaluator = _evaluator()
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda e: e.state.output[0].sum().item())
    probe = IterationProbe(count_host_syncs).attach(evaluator)
    evaluator.run(_class_batches(EPOCH_LENGTH))
    assert probe.count == EPOCH_LENGTH


def ddp_hot_path_worker() -> dict:
    """A DDP trainer with accumulation: per iteration, no host sync and no collective of unison's."""
    rank = get_rank()
    model = prepare_model(make_mlp())
    trainer = create_trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.05), F.mse_loss, accumulation_steps=2
    )
    x, y = regression_rows(EPOCH_LENGTH * 4, seed=rank)
    batches = shard_batches(x, y, n_batches=EPOCH_LENGTH, per_rank=4, rank=0, world_size=1)
    syncs = IterationProbe(count_host_syncs).attach(trainer)
    collectives = IterationProbe(count_collectives).attach(trainer)
    with count_collectives() as whole_run:
        trainer.run(batches, max_epochs=2)
    return {
        "iterations": syncs.iterations,
        "syncs": syncs.calls,
        "collectives_in_iterations": collectives.collectives(),
        "collectives_in_run": sum(whole_run.values()),
        "sync_points": trainer.sync_point.count,
    }


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_ddp_step_has_no_host_sync_and_no_extra_collective():
    results = run_distributed(ddp_hot_path_worker, nproc=2, timeout=50)
    for rank, result in enumerate(results):
        assert result["iterations"] == 2 * EPOCH_LENGTH
        assert result["syncs"] == [], f"rank {rank}"
        # DDP's gradient all-reduce is issued by its C++ reducer, not through torch.distributed's
        # Python functions: what the probe sees in an iteration would be unison's (or a handler's).
        assert result["collectives_in_iterations"] == 0, f"rank {rank}"
        # Control: the probe does see the sync points' all-reduces, outside the iterations.
        assert result["collectives_in_run"] >= result["sync_points"] >= 2, f"rank {rank}"
