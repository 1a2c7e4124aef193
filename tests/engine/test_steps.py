"""The training and evaluation steps: argument checks, accumulation, AMP, clipping, modes."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from _training import (
    flat_grads,
    flat_params,
    make_mlp,
    manual_window_grad,
    regression_rows,
    shard_batches,
    window_of,
)
from ignite.engine import Engine as IgniteEngine
from torch import nn
from torch.nn import functional as F

from unison.engine import Engine, Events, TrainStep, create_evaluator, create_trainer
from unison.metrics import MeanSquaredError

BATCH = 4


def _batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    x, y = regression_rows(n * BATCH, seed)
    return shard_batches(x, y, n_batches=n, per_rank=BATCH, rank=0, world_size=1)


def _sgd(model: nn.Module, lr: float = 0.1) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=lr)


# --- bad input: each error names the argument, the value and the fix -----------------------------


@pytest.mark.parametrize("value", [0, -1, 1.5, True])
def test_accumulation_steps_must_be_a_positive_int(value):
    model = make_mlp()
    with pytest.raises(ValueError) as info:
        create_trainer(model, _sgd(model), F.mse_loss, accumulation_steps=value)
    message = str(info.value)
    assert f"accumulation_steps={value!r}" in message
    assert "int >= 1" in message


def test_unknown_amp_mode_is_refused():
    model = make_mlp()
    with pytest.raises(ValueError) as info:
        create_trainer(model, _sgd(model), F.mse_loss, amp="fp8")
    message = str(info.value)
    assert "amp='fp8'" in message
    assert "'bf16'" in message and "'fp16'" in message
    with pytest.raises(ValueError, match="amp='fp8'"):
        create_evaluator(model, amp="fp8")


@pytest.mark.parametrize(("model_device", "asked"), [("meta", "cpu"), ("cpu", "meta")])
@pytest.mark.parametrize("factory", ["trainer", "evaluator"])
def test_model_on_another_device_is_refused(model_device, asked, factory):
    model = nn.Linear(3, 2, device=model_device)
    with pytest.raises(ValueError) as info:
        if factory == "trainer":
            create_trainer(model, _sgd(model), F.mse_loss, device=asked)
        else:
            create_evaluator(model, device=asked)
    message = str(info.value)
    assert f"device={asked!r}" in message
    assert f"parameters are on {model_device}" in message
    assert "prepare_model" in message


def test_device_left_unset_follows_the_model():
    model = nn.Linear(3, 2, device="meta")
    trainer = create_trainer(model, _sgd(model), F.mse_loss)
    assert trainer.process_function.device == torch.device("meta")


def test_scaler_with_bf16_is_refused():
    model = make_mlp()
    with pytest.raises(ValueError) as info:
        create_trainer(model, _sgd(model), F.mse_loss, amp="bf16", scaler=torch.amp.GradScaler("cpu"))
    message = str(info.value)
    assert "scaler" in message and "amp='bf16'" in message and "amp='fp16'" in message


@pytest.mark.parametrize("value", [0, -1.0, float("nan")])
def test_clip_grad_norm_must_be_positive(value):
    model = make_mlp()
    with pytest.raises(ValueError) as info:
        create_trainer(model, _sgd(model), F.mse_loss, clip_grad_norm=value)
    assert f"clip_grad_norm={value!r}" in str(info.value)
    assert "positive" in str(info.value)


def test_optimizer_must_be_an_optimizer():
    model = make_mlp()
    with pytest.raises(TypeError) as info:
        create_trainer(model, list(model.parameters()), F.mse_loss)
    assert "optimizer" in str(info.value) and "list" in str(info.value)
    assert "torch.optim.Optimizer" in str(info.value)


def test_metric_must_be_a_metric():
    with pytest.raises(TypeError) as info:
        create_evaluator(make_mlp(), {"mse": F.mse_loss})
    message = str(info.value)
    assert "'mse'" in message and "function" in message and "Metric" in message


def test_accumulation_needs_data_of_known_length():
    model = make_mlp()
    before = flat_params(model)
    trainer = create_trainer(model, _sgd(model), F.mse_loss, accumulation_steps=2)
    processed = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: processed.append(e.state.iteration))
    with pytest.raises(ValueError) as info:
        trainer.run(iter(_batches(4)))
    message = str(info.value)
    assert "accumulation_steps=2" in message and "epoch_length" in message
    assert processed == []
    assert torch.equal(flat_params(model), before)
    # Given the length, the same data trains (on a fresh trainer: ignite 0.5.5's Engine.run returns
    # None without running after a run that raised).
    trainer = create_trainer(model, _sgd(model), F.mse_loss, accumulation_steps=2)
    state = trainer.run(iter(_batches(4)), epoch_length=4)
    assert state.iteration == 4
    assert not torch.equal(flat_params(model), before)


# --- gradient accumulation -------------------------------------------------------------------------


@pytest.mark.parametrize(("epoch_length", "k"), [(5, 2), (5, 3), (4, 2), (3, 1), (2, 4)])
def test_accumulation_windows_and_short_last_window(epoch_length, k):
    """One update per window of k, the epoch's last shorter window included, its loss averaged over
    its own length: the gradient at each update is the mean over the window's batches."""
    batches = _batches(epoch_length)
    model = make_mlp()
    optimizer = _sgd(model)
    trainer = create_trainer(model, optimizer, F.mse_loss, accumulation_steps=k)
    seen = []

    def before_step(opt, args, kwargs):
        it = trainer.state.iteration
        window = [batches[p] for p in window_of(it, epoch_length, k)]
        seen.append(
            (trainer.state.epoch, it, flat_grads(model), manual_window_grad(model, window, F.mse_loss))
        )

    optimizer.register_step_pre_hook(before_step)
    trainer.run(batches, max_epochs=2)

    per_epoch = math.ceil(epoch_length / k)
    assert [sum(1 for s in seen if s[0] == e) for e in (1, 2)] == [per_epoch, per_epoch]
    # The update closes each window: at iterations k, 2k, ... and at the epoch's last one.
    ends = sorted({min(j * k, epoch_length) for j in range(1, per_epoch + 1)})
    assert [s[1] for s in seen] == ends + [epoch_length + e for e in ends]
    for _, it, got, expected in seen:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7, msg=f"gradient at iteration {it}")


def test_short_window_gradient_would_differ_if_divided_by_k():
    """Control for the test above: dividing the short window's loss by k (not by its length) gives a
    gradient the comparison would reject."""
    batches = _batches(5)
    model = make_mlp()
    right = manual_window_grad(model, batches[4:5], F.mse_loss)
    wrong = right / 2
    assert not torch.allclose(right, wrong, rtol=1e-5, atol=1e-7)


def test_stale_gradients_are_dropped_at_start():
    batches = _batches(2)
    model = make_mlp()
    for p in model.parameters():
        p.grad = torch.full_like(p, 100.0)
    optimizer = _sgd(model)
    expected = manual_window_grad(model, batches, F.mse_loss)
    got = []
    optimizer.register_step_pre_hook(lambda opt, a, kw: got.append(flat_grads(model)))
    create_trainer(model, optimizer, F.mse_loss, accumulation_steps=2).run(batches)
    assert len(got) == 1
    torch.testing.assert_close(got[0], expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("k", [1, 2])
def test_grads_are_none_after_each_update(k):
    epoch_length = 5
    model = make_mlp()
    optimizer = _sgd(model)
    trainer = create_trainer(model, optimizer, F.mse_loss, accumulation_steps=k)
    steps = []
    optimizer.register_step_post_hook(lambda opt, a, kw: steps.append(trainer.state.iteration))
    after = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED,
        lambda e: after.append((e.state.iteration, [p.grad is None for p in model.parameters()])),
    )
    trainer.run(_batches(epoch_length), max_epochs=2)
    assert len(steps) == 2 * math.ceil(epoch_length / k)
    for iteration, none_flags in after:
        if iteration in steps:
            assert all(none_flags), f"gradients left after the update at iteration {iteration}"
        else:
            assert not any(none_flags), f"gradients dropped inside a window at iteration {iteration}"


# --- AMP ----------------------------------------------------------------------------------------


def _record_linear_dtype(model: nn.Module) -> list[torch.dtype]:
    dtypes: list[torch.dtype] = []
    model[0].register_forward_hook(lambda mod, inp, out: dtypes.append(out.dtype))
    return dtypes


def test_bf16_autocast_trains_on_cpu():
    model = make_mlp()
    before = flat_params(model)
    dtypes = _record_linear_dtype(model)
    trainer = create_trainer(model, _sgd(model), F.mse_loss, amp="bf16")
    assert trainer.process_function.scaler is None
    losses = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
    trainer.run(_batches(4), max_epochs=2)
    assert dtypes == [torch.bfloat16] * 8
    assert all(torch.isfinite(loss) for loss in losses) and len(losses) == 8
    assert math.isfinite(trainer.state.metrics["loss"])
    after = flat_params(model)
    assert after.dtype == torch.float32  # master weights stay in full precision
    assert not torch.equal(after, before)


def _fp16_autocast_or_skip() -> None:
    try:
        with torch.autocast("cpu", dtype=torch.float16):
            out = nn.Linear(2, 2)(torch.ones(1, 2))
    except Exception as err:  # pragma: no cover - depends on the torch build
        pytest.skip(f"fp16 autocast on CPU is unsupported in torch {torch.__version__}: {err}")
    if out.dtype != torch.float16:  # pragma: no cover
        pytest.skip(f"torch {torch.__version__} ignores fp16 autocast on CPU (got {out.dtype})")


def test_fp16_creates_a_grad_scaler_and_trains():
    _fp16_autocast_or_skip()
    model = make_mlp()
    before = flat_params(model)
    dtypes = _record_linear_dtype(model)
    trainer = create_trainer(model, _sgd(model), F.mse_loss, amp="fp16")
    scaler = trainer.process_function.scaler
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.is_enabled()
    losses = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: losses.append(e.state.output))
    trainer.run(_batches(5), max_epochs=2)
    assert dtypes == [torch.float16] * 10
    assert len(losses) == 10 and all(torch.isfinite(loss) for loss in losses)
    assert not torch.equal(flat_params(model), before)


def test_fp16_uses_the_given_scaler():
    _fp16_autocast_or_skip()
    model = make_mlp()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = create_trainer(model, _sgd(model), F.mse_loss, amp="fp16", scaler=scaler)
    assert trainer.process_function.scaler is scaler
    calls = []
    original = scaler.step
    scaler.step = lambda opt, *a, **kw: calls.append(1) or original(opt, *a, **kw)
    trainer.run(_batches(3))
    assert len(calls) == 3


# --- clipping -----------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_clip_grad_norm(max_norm):
    batches = _batches(4)
    model = make_mlp()
    optimizer = _sgd(model)
    trainer = create_trainer(model, optimizer, F.mse_loss, clip_grad_norm=max_norm)
    step: TrainStep = trainer.process_function
    assert step.grad_norm is None
    seen = []

    def before_step(opt, args, kwargs):
        # Parameters have not moved since the forward pass: recompute the raw gradient.
        raw = manual_window_grad(model, [trainer.state.batch], F.mse_loss)
        seen.append((flat_grads(model), raw))

    optimizer.register_step_pre_hook(before_step)
    norms = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: norms.append(step.grad_norm.clone()))
    trainer.run(batches)

    assert len(seen) == len(norms) == 4
    for (clipped, raw), reported in zip(seen, norms, strict=True):
        raw_norm = raw.norm()
        torch.testing.assert_close(reported, raw_norm, rtol=1e-5, atol=1e-7)  # the pre-clip norm
        assert clipped.norm() <= max_norm * (1 + 1e-5)
        if raw_norm > max_norm:
            torch.testing.assert_close(clipped, raw * (max_norm / (raw_norm + 1e-6)), rtol=1e-4, atol=1e-7)
        else:
            torch.testing.assert_close(clipped, raw, rtol=1e-5, atol=1e-7)
    if max_norm < 1:
        assert all(n > max_norm for n in norms), "the test needs gradients larger than the clip"


# --- train / eval modes -------------------------------------------------------------------------


def test_model_train_called_once_per_epoch():
    model = make_mlp()
    model.eval()
    calls = []
    original = model.train

    def counting_train(mode=True):
        calls.append(mode)
        return original(mode)

    model.train = counting_train
    trainer = create_trainer(model, _sgd(model), F.mse_loss)
    modes = []
    trainer.add_event_handler(Events.ITERATION_STARTED, lambda e: modes.append(model.training))
    trainer.run(_batches(5), max_epochs=3)
    assert trainer.state.iteration == 15
    assert calls == [True, True, True]
    assert modes == [True] * 15


@pytest.mark.parametrize("initially_training", [True, False])
def test_evaluator_switches_to_eval_and_restores(initially_training):
    model = make_mlp()
    model.train(initially_training)
    during = []
    model.register_forward_pre_hook(lambda mod, inp: during.append(mod.training))
    evaluator = create_evaluator(model, {"mse": MeanSquaredError()})
    evaluator.run(_batches(3))
    assert during == [False, False, False]
    assert model.training is initially_training
    assert all(m.training is initially_training for m in model.modules())


def test_evaluator_mid_epoch_restores_train_mode_for_the_trainer():
    model = make_mlp()
    calls = []  # (grad enabled, training) at each forward: the trainer's need grad, the evaluator's not
    model.register_forward_pre_hook(lambda mod, inp: calls.append((torch.is_grad_enabled(), mod.training)))
    trainer = create_trainer(model, _sgd(model), F.mse_loss)
    evaluator = create_evaluator(model, {"mse": MeanSquaredError()})
    val = _batches(2, seed=1)
    trainer.add_event_handler(Events.ITERATION_COMPLETED(every=2), lambda e: evaluator.run(val))
    trainer.run(_batches(5), max_epochs=2)
    train_calls = [training for grad, training in calls if grad]
    eval_calls = [training for grad, training in calls if not grad]
    assert train_calls == [True] * 10
    assert eval_calls == [False] * (2 * 5)  # iterations 2, 4, 6, 8, 10: 5 evaluations of 2 batches
    assert model.training


def test_evaluator_restores_mode_when_the_run_fails():
    """A failing evaluation (here a metric refusing the shapes) must not leave the model in eval
    mode: a trainer that catches the error would go on training with dropout and BatchNorm off."""
    model = make_mlp()
    model.train()
    evaluator = create_evaluator(
        model, {"mse": MeanSquaredError(output_transform=lambda out: (out[0], out[1][:, :1]))}
    )
    with pytest.raises(ValueError, match="MeanSquaredError"):
        evaluator.run(_batches(2))
    assert model.training


def test_evaluator_restores_mode_after_terminate():
    model = make_mlp()
    model.train()
    evaluator = create_evaluator(model)
    during = []
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda e: during.append(model.training))
    evaluator.add_event_handler(Events.ITERATION_COMPLETED(once=2), lambda e: e.terminate())
    evaluator.run(_batches(4))
    assert during == [False, False]
    assert model.training


def test_evaluator_step_returns_predictions_and_targets_without_grad():
    model = make_mlp()
    batches = _batches(2)
    evaluator = create_evaluator(model)
    outputs = []
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda e: outputs.append(e.state.output))
    evaluator.run(batches)
    reference = copy.deepcopy(model).eval()
    for (y_pred, y), (x, target) in zip(outputs, batches, strict=True):
        assert not y_pred.requires_grad
        torch.testing.assert_close(y_pred, reference(x).detach())
        assert torch.equal(y, target)


def test_trainer_is_a_unison_engine():
    model = make_mlp()
    trainer = create_trainer(model, _sgd(model), F.mse_loss)
    assert isinstance(trainer, Engine) and isinstance(trainer, IgniteEngine)
    assert isinstance(trainer.process_function, TrainStep)
