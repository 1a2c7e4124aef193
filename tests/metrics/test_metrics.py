"""Unit tests of unison's sum-state metrics, in a single process (no process group)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from _sync_probe import count_host_syncs
from ignite.engine import Engine as IgniteEngine
from ignite.exceptions import NotComputableError

from unison.metrics import (
    Accuracy,
    Loss,
    MeanAbsoluteError,
    MeanSquaredError,
    MetricGroup,
    Perplexity,
    SumMetric,
)


def _logits(n: int, c: int, seed: int, *extra: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, *extra, generator=gen), torch.randint(0, c, (n, *extra), generator=gen)


def _regression(n: int, seed: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *shape, generator=gen), torch.randn(n, *shape, generator=gen)


def _rank_of_target(y_pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """How many classes score strictly higher than the target: top-k hit iff this is < k."""
    target_score = y_pred.gather(1, y.unsqueeze(1))
    return (y_pred > target_score).sum(dim=1)


# --- the probe used below ------------------------------------------------------------------------


def test_sync_probe_counts_every_kind_of_host_read():
    t = torch.arange(4, dtype=torch.float32)
    with count_host_syncs() as syncs:
        t.sum().item()
    assert syncs.count == 1 and syncs.calls == ["aten._local_scalar_dense"]

    reads = {
        "bool": lambda: bool(t[1] > 0),
        "float": lambda: float(t[2]),
        "int": lambda: int(t[3]),
        "if tensor": lambda: 1 if t.max() else 0,
        "tolist": lambda: t.tolist(),
        "numpy": lambda: t.numpy(),
        "cpu": lambda: t.cpu(),
    }
    for what, read in reads.items():
        with count_host_syncs() as syncs:
            read()
        assert syncs.count >= 1, f"{what} was not counted"

    with count_host_syncs() as syncs:
        (t * 2 + 1).sum(dim=0, keepdim=True).argmax()
    assert syncs.count == 0, syncs.calls


def test_sync_probe_restores_tensor_methods_and_nests():
    before = {name: getattr(torch.Tensor, name) for name in ("tolist", "numpy", "cpu")}
    t = torch.ones(2)
    with count_host_syncs() as outer:
        with count_host_syncs() as inner:
            t.tolist()
        t[0].item()
    assert inner.calls == ["Tensor.tolist"]
    assert outer.calls == ["Tensor.tolist", "aten._local_scalar_dense"]
    assert {name: getattr(torch.Tensor, name) for name in before} == before
    with count_host_syncs() as after:
        pass
    t.tolist()
    assert after.count == 0


# --- Accuracy --------------------------------------------------------------------------------------


def test_accuracy_top1_matches_argmax_over_batches():
    y_pred, y = _logits(50, 5, seed=1)
    acc = Accuracy()
    for lo, hi in ((0, 13), (13, 14), (14, 50)):
        acc.update((y_pred[lo:hi], y[lo:hi]))
    expected = (y_pred.argmax(dim=1) == y).sum().item() / 50
    assert acc.compute() == expected


@pytest.mark.parametrize("k", [1, 2, 3, 5])
def test_accuracy_top_k_counts_target_among_k_highest(k):
    y_pred, y = _logits(64, 5, seed=k)
    acc = Accuracy(top_k=k)
    acc.update((y_pred[:20], y[:20]))
    acc.update((y_pred[20:], y[20:]))
    expected = (_rank_of_target(y_pred, y) < k).sum().item() / 64
    assert acc.compute() == expected
    if k == 5:
        assert acc.compute() == 1.0


def test_accuracy_per_position_predictions():
    y_pred, y = _logits(6, 4, 11, 3, 2)  # (N, C, d1, d2) and (N, d1, d2)
    acc = Accuracy()
    acc.update((y_pred, y))
    hits = (y_pred.argmax(dim=1) == y).sum().item()
    assert acc.compute() == hits / y.numel()


@pytest.mark.parametrize(
    "pred_shape, target_shape",
    [((4, 3), (5,)), ((4, 3), (4, 3)), ((4,), (4,)), ((4, 3, 2), (4, 5))],
)
def test_accuracy_shape_error_names_both_shapes(pred_shape, target_shape):
    acc = Accuracy()
    with pytest.raises(ValueError) as err:
        acc.update((torch.zeros(pred_shape), torch.zeros(target_shape, dtype=torch.long)))
    assert str(tuple(pred_shape)) in str(err.value)
    assert str(tuple(target_shape)) in str(err.value)


def test_accuracy_argument_errors():
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="top_k"):
            Accuracy(top_k=bad)
    acc = Accuracy(top_k=4)
    with pytest.raises(ValueError, match=r"top_k=4.*3 classes"):
        acc.update((torch.zeros(2, 3), torch.zeros(2, dtype=torch.long)))


# --- Loss --------------------------------------------------------------------------------------------


def test_loss_weights_each_batch_by_its_size():
    y_pred, y = _logits(8, 4, seed=3)
    loss = Loss(F.cross_entropy)
    loss.update((y_pred[:3], y[:3]))
    loss.update((y_pred[3:], y[3:]))
    per_sample = F.cross_entropy(y_pred.double(), y, reduction="none")
    expected = per_sample.sum().item() / 8
    assert loss.compute() == pytest.approx(expected, rel=1e-6)
    # The test can tell weighting from a plain mean of the two batch means.
    unweighted = (per_sample[:3].mean() + per_sample[3:].mean()).item() / 2
    assert abs(expected - unweighted) > 1e-3
    assert loss.compute() != pytest.approx(unweighted, rel=1e-6)


def test_loss_custom_batch_size_and_scalar_check():
    y_pred, y = _regression(6, 4, 2)
    loss = Loss(F.l1_loss, batch_size=lambda target: target.numel())
    loss.update((y_pred[:2], y[:2]))
    loss.update((y_pred[2:], y[2:]))
    expected = (y_pred.double() - y.double()).abs().sum().item() / y.numel()
    assert loss.compute() == pytest.approx(expected, rel=1e-6)

    with pytest.raises(ValueError, match="scalar"):
        Loss(lambda a, b: (a - b).abs()).update((y_pred, y))
    with pytest.raises(TypeError, match="loss_fn"):
        Loss("mse")  # type: ignore[arg-type]


# --- regression -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metric_cls, per_element",
    [(MeanSquaredError, lambda d: d.square()), (MeanAbsoluteError, lambda d: d.abs())],
)
def test_regression_metrics_match_torch(metric_cls, per_element):
    y_pred, y = _regression(30, 5, 3)
    metric = metric_cls()
    metric.update((y_pred[:7], y[:7]))
    metric.update((y_pred[7:], y[7:]))
    expected = per_element(y_pred.double() - y.double()).mean().item()
    assert metric.compute() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("metric_cls", [MeanSquaredError, MeanAbsoluteError])
def test_regression_shape_error_names_both_shapes(metric_cls):
    with pytest.raises(ValueError) as err:
        metric_cls().update((torch.zeros(4, 1), torch.zeros(4)))
    assert "(4, 1)" in str(err.value) and "(4,)" in str(err.value)
    assert metric_cls.__name__ in str(err.value)


# --- life cycle --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metric", [Accuracy(), Accuracy(top_k=2), Loss(F.mse_loss), MeanSquaredError(), MeanAbsoluteError()]
)
def test_not_computable_without_update_and_after_reset(metric):
    metric.reset()
    with pytest.raises(NotComputableError, match=type(metric).__name__):
        metric.compute()
    assert torch.equal(metric.sync_state(), torch.zeros(metric.state_size, dtype=torch.float64))


def test_reset_forgets_earlier_updates():
    first = _regression(10, 6)
    second = _regression(4, 7)
    mse = MeanSquaredError()
    mse.update(first)
    before_reset = mse.compute()
    mse.reset()
    mse.update(second)
    expected = (second[0].double() - second[1].double()).square().mean().item()
    assert mse.compute() == pytest.approx(expected, rel=1e-12)
    assert mse.compute() != pytest.approx(before_reset)


def test_compute_standalone_does_not_consume_state():
    y_pred, y = _logits(10, 3, seed=8)
    acc = Accuracy()
    acc.update((y_pred, y))
    expected = (y_pred.argmax(1) == y).sum().item() / 10
    assert acc.compute() == expected
    assert acc.compute() == expected  # computing twice gives the same value
    acc.update((y_pred, y))
    assert acc.compute() == expected  # and later updates keep adding to the same sums


def test_state_follows_float64_sums():
    y_pred, y = _regression(5, 9)
    mse = MeanSquaredError()
    mse.update((y_pred, y))
    state = mse.sync_state()
    assert state.dtype == torch.float64 and state.shape == (2,)
    assert state[1].item() == 5
    assert state[0].item() == pytest.approx((y_pred.double() - y.double()).square().sum().item(), rel=1e-12)


def test_sum_metric_checks_batch_state_shape():
    class Broken(SumMetric):
        state_size = 2

        def batch_state(self, output):
            return torch.zeros(3)

        def compute_from(self, state):
            return 0.0

    with pytest.raises(RuntimeError, match=r"Broken.*\(3,\).*\(2,\)"):
        Broken().update(None)


def test_metric_group_refuses_ignite_metrics_and_ignite_engines():
    from ignite.metrics import Accuracy as IgniteAccuracy

    with pytest.raises(TypeError, match="'ign'"):
        MetricGroup({"ours": Accuracy(), "ign": IgniteAccuracy()})
    with pytest.raises(TypeError, match="metric.attach"):
        MetricGroup({"ours": Accuracy()}).attach(IgniteEngine(lambda e, b: b))


# --- ignite compatibility ---------------------------------------------------------------------------


def test_attach_the_ignite_way_on_a_plain_ignite_engine():
    y_pred, y = _logits(23, 4, seed=10)
    reg_pred, reg_y = _regression(23, 11)
    batches = [
        {"cls": (y_pred[i : i + 5], y[i : i + 5]), "reg": (reg_pred[i : i + 5], reg_y[i : i + 5])}
        for i in range(0, 23, 5)
    ]
    engine = IgniteEngine(lambda e, batch: batch)
    Accuracy(output_transform=lambda o: o["cls"]).attach(engine, "acc")
    Accuracy(top_k=2, output_transform=lambda o: o["cls"]).attach(engine, "top2")
    Loss(F.cross_entropy, output_transform=lambda o: o["cls"]).attach(engine, "loss")
    MeanSquaredError(output_transform=lambda o: o["reg"]).attach(engine, "mse")
    MeanAbsoluteError(output_transform=lambda o: o["reg"]).attach(engine, "mae")

    metrics = engine.run(batches).metrics
    diff = reg_pred.double() - reg_y.double()
    assert metrics["acc"] == (y_pred.argmax(1) == y).sum().item() / 23
    assert metrics["top2"] == (_rank_of_target(y_pred, y) < 2).sum().item() / 23
    assert metrics["loss"] == pytest.approx(F.cross_entropy(y_pred.double(), y).item(), rel=1e-6)
    assert metrics["mse"] == pytest.approx(diff.square().mean().item(), rel=1e-12)
    assert metrics["mae"] == pytest.approx(diff.abs().mean().item(), rel=1e-12)

    # A second run resets the states at its epoch start: only its own data counts.
    metrics = engine.run(batches[:1]).metrics
    assert metrics["acc"] == (y_pred[:5].argmax(1) == y[:5]).sum().item() / 5
    assert metrics["mse"] == pytest.approx(diff[:5].square().mean().item(), rel=1e-12)


# --- the hot path -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "metric, make_output",
    [
        (Accuracy(), lambda: _logits(16, 4, 12)),
        (Accuracy(top_k=3), lambda: _logits(16, 4, 13)),
        (Accuracy(), lambda: _logits(4, 3, 14, 5)),
        (Loss(F.cross_entropy), lambda: _logits(16, 4, 15)),
        (Loss(F.mse_loss), lambda: _regression(16, 16, 2)),
        (MeanSquaredError(), lambda: _regression(16, 17, 2)),
        (MeanAbsoluteError(), lambda: _regression(16, 18)),
    ],
    ids=["acc", "top3", "acc-per-position", "loss-ce", "loss-mse", "mse", "mae"],
)
def test_update_reads_nothing_back_to_the_host(metric, make_output):
    outputs = [make_output() for _ in range(3)]
    metric.reset()
    with count_host_syncs() as syncs:
        for output in outputs:
            metric.update(output)
    assert syncs.count == 0, f"{type(metric).__name__}.update synchronised with the host: {syncs.calls}"
    # The probe was live: computing reads the state back, and the result is finite.
    with count_host_syncs() as syncs:
        value = metric.compute()
    assert syncs.count >= 1
    assert math.isfinite(value)


def _padded_batches(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Two language-model batches whose padding (-100) differs a lot: the weighting matters."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for n, t, real in ((2, 8, 3), (3, 8, 8)):
        scores = torch.randn(n, 5, t, generator=g) * 3
        targets = torch.randint(0, 5, (n, t), generator=g)
        targets[:, real:] = -100
        batches.append((scores, targets))
    return batches


@pytest.mark.parametrize("seed", range(5))
def test_perplexity_counts_only_the_tokens_the_loss_counts(seed: int) -> None:
    batches = _padded_batches(seed)
    ppl = Perplexity()
    for batch in batches:
        ppl.update(batch)
    total = sum(F.cross_entropy(s, t, reduction="sum") for s, t in batches)
    tokens = sum(int((t != -100).sum()) for _, t in batches)
    assert ppl.compute() == pytest.approx(math.exp(float(total) / tokens), rel=1e-6)  # float32 losses


def test_perplexity_of_a_batch_of_padding_only_adds_nothing() -> None:
    scores = torch.zeros(1, 4, 3)
    ppl = Perplexity()
    ppl.update((scores, torch.tensor([[0, 1, 2]])))
    ppl.update((scores, torch.full((1, 3), -100)))
    assert ppl.compute() == pytest.approx(4.0)


def test_perplexity_honours_another_ignore_index() -> None:
    ppl = Perplexity(ignore_index=0)
    ppl.update((torch.zeros(1, 4, 3), torch.tensor([[0, 1, 2]])))
    assert ppl.compute() == pytest.approx(4.0)
    assert ppl.sync_state()[1].item() == 2
