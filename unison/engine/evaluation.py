"""The evaluation step and the evaluator built around it."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch
from ignite.engine import Engine as IgniteEngine
from ignite.engine import Events
from ignite.metrics import EpochMetric, Metric
from torch import nn
from torch.utils.data import DistributedSampler

from unison.distributed.batches import move_to_device
from unison.distributed.fsdp import gathered_parameters, swapped_in
from unison.distributed.model import unwrap_model
from unison.distributed.primitives import broadcast_buffers
from unison.engine.calls import resolve_model_call
from unison.engine.engine import Engine
from unison.engine.steps import AmpMode, check_amp, check_device, prepare_batch
from unison.metrics.base import SumMetric
from unison.metrics.batch_loss import BatchOutput
from unison.metrics.gathered import exact_epoch_metric
from unison.metrics.group import MetricGroup
from unison.utils.logging import get_logger

_log = get_logger(__name__)


class EvalStep:
    """One evaluation iteration: a forward pass without gradients, returning ``(y_pred, y)``.

    It runs the module inside any DDP wrapper: DDP's forward may issue collectives, and
    ranks of an unpadded evaluation run different numbers of batches. With ``keep_batch``
    the output is a :class:`~unison.metrics.BatchOutput`: the same pair, holding the whole
    batch on the device for the metrics that read it.
    """

    evaluates = True
    """Not refused a stream every rank reads whole (``check_sharded``): its means come out the same."""

    def __init__(
        self,
        model: nn.Module,
        *,
        device: torch.device,
        amp_dtype: torch.dtype | None,
        prepare_batch: Callable[[Any, torch.device, bool], tuple[Any, Any]],
        non_blocking: bool,
        model_call: Callable[[nn.Module, Any], Any] | None = None,
        keep_batch: bool = False,
    ) -> None:
        self.model = unwrap_model(model)
        self.device = device
        self.amp_dtype = amp_dtype
        self.prepare_batch = prepare_batch
        self.non_blocking = non_blocking
        self.model_call = resolve_model_call(model_call, "EvalStep")
        self.keep_batch = keep_batch

    def __call__(self, engine: IgniteEngine, batch: Any) -> tuple[Any, Any]:
        if self.keep_batch:
            batch = move_to_device(batch, self.device, self.non_blocking)
        x, y = self.prepare_batch(batch, self.device, self.non_blocking)
        call = self.model_call
        with torch.no_grad():
            if self.amp_dtype is not None:
                with torch.autocast(self.device.type, dtype=self.amp_dtype):
                    y_pred = self.model(x) if call is None else call(self.model, x)
            else:
                y_pred = self.model(x) if call is None else call(self.model, x)
        if self.keep_batch:
            return BatchOutput(y_pred, y, batch)
        return y_pred, y


def create_evaluator(
    model: nn.Module,
    metrics: Mapping[str, Metric] | None = None,
    *,
    device: torch.device | str | None = None,
    amp: AmpMode | None = None,
    prepare_batch: Callable[[Any, torch.device, bool], tuple[Any, Any]] = prepare_batch,
    non_blocking: bool = True,
    model_call: Callable[[nn.Module, Any], Any] | None = None,
) -> Engine:
    """Builds an evaluation :class:`~unison.engine.Engine` that computes ``metrics``.

    unison's metrics (:mod:`unison.metrics`) are reduced across ranks together, in one
    all-reduce at the end of the run, and are exact at any world size when the data is
    sharded without padding (:class:`~unison.distributed.EvalSampler`). Any ignite metric
    may be passed too; it syncs itself, as in ignite, except ignite's epoch metrics
    (``ROC_AUC``, ``AveragePrecision``, ...), whose fixed-size gather would crash on uneven
    shards: they gather exactly (:func:`~unison.metrics.exact_epoch_metric`). Results are in
    ``evaluator.state.metrics``. The model is switched to eval mode for the run and back
    to its previous mode afterwards. Every rank evaluates with rank 0's buffers (BatchNorm's
    running statistics, broadcast at the start of the run: under DDP they drift apart per
    rank), so the result is that of the model rank 0 saves.

    Every metric gets ``(y_pred, y)``: the model's output and the target ``prepare_batch``
    took from the batch (``batch.y`` of a torch_geometric batch). A metric that reads the
    whole batch (a :class:`~unison.metrics.Loss` of a :class:`~unison.metrics.BatchLoss`,
    or any metric whose ``takes_batch`` is True) gets the same pair as a
    :class:`~unison.metrics.BatchOutput`, whose ``batch`` is the batch on the device.

    Args:
        model: the model (plain or DDP; the forward pass runs on the module inside).
        metrics: name -> metric.
        device: where batches go; default, the model's device. Given, it must match it.
        amp: ``"bf16"`` or ``"fp16"`` autocast, or None.
        prepare_batch: ``fn(batch, device, non_blocking) -> (x, y)``.
        non_blocking: copy batches to the device asynchronously.
        model_call: ``fn(model, x) -> y_pred`` (a :class:`~unison.engine.ModelCall`);
            default ``model(x)``. Use the trainer's.

    Example:
        >>> import torch
        >>> from unison.engine import create_evaluator
        >>> from unison.metrics import MeanSquaredError
        >>> model = torch.nn.Linear(2, 1)
        >>> evaluator = create_evaluator(model, {"mse": MeanSquaredError()})
        >>> data = [(torch.ones(4, 2), torch.zeros(4, 1))]
        >>> "mse" in evaluator.run(data).metrics
        True

    Distributed:
        Build it and run it on every rank; each rank evaluates its own shard.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"create_evaluator(model=...) needs an nn.Module, got {type(model).__name__}.")
    metrics = dict(metrics or {})
    for name, metric in metrics.items():
        if not isinstance(metric, Metric):
            raise TypeError(
                f"create_evaluator(metrics={{{name!r}: ...}}) needs an ignite or unison Metric, "
                f"got {type(metric).__name__}."
            )
    resolved = check_device(model, device, "create_evaluator")
    amp_dtype = check_amp(amp, "create_evaluator")
    step = EvalStep(
        model,
        device=resolved,
        amp_dtype=amp_dtype,
        prepare_batch=prepare_batch,
        non_blocking=non_blocking,
        model_call=resolve_model_call(model_call, "create_evaluator"),
        # "is True": ignite's Metric answers any unknown attribute with a metric arithmetic wrapper.
        keep_batch=any(getattr(metric, "takes_batch", False) is True for metric in metrics.values()),
    )
    # Evaluation shards differ in length by design: sync at the run's end only.
    evaluator = Engine(step, sync_every=None, name="evaluator")

    modes: list[bool] = []
    gathered = contextlib.ExitStack()

    def _eval_mode(_: Engine) -> None:
        # Ranks' running statistics drift apart under DDP: evaluate the model rank 0 saves.
        broadcast_buffers(unwrap_model(step.model))
        modes.append(step.model.training)
        step.model.eval()
        # Shards differ in batches: a sharded model is gathered once, so forwards are local.
        gathered.enter_context(swapped_in(step.model))  # an EMA's average, into the shards first
        gathered.enter_context(gathered_parameters(step.model))

    def _restore_mode(_: Engine) -> None:
        gathered.close()
        if modes:
            step.model.train(modes.pop())

    evaluator.add_event_handler(Events.STARTED, _eval_mode)
    evaluator.add_event_handler(Events.STARTED, _warn_if_padded)
    evaluator.add_event_handler(Events.COMPLETED, _restore_mode)
    evaluator.add_event_handler(Events.TERMINATE, _restore_mode)
    evaluator.add_failure_callback(lambda: _restore_mode(evaluator))

    ours = {name: m for name, m in metrics.items() if isinstance(m, SumMetric)}
    if ours:
        MetricGroup(ours).attach(evaluator)
    for name, metric in metrics.items():
        if name not in ours:
            if isinstance(metric, EpochMetric):
                exact_epoch_metric(metric)  # ignite's gather crashes on uneven shards
            metric.attach(evaluator, name)
    return evaluator


def _warn_if_padded(engine: Engine) -> None:
    """Warns (once per evaluator) when the evaluation data's sampler pads the shards."""
    loader = engine.state.dataloader
    sampler = getattr(loader, "sampler", None)
    if not isinstance(sampler, DistributedSampler) or sampler.drop_last or getattr(engine, "_warned_padding", False):
        return
    size = len(sampler.dataset)  # type: ignore[arg-type]  # a map-style dataset: sized
    padded = sampler.total_size - size
    if padded > 0:
        engine._warned_padding = True  # type: ignore[attr-defined]  # a flag on this evaluator
        _log.warning(
            "%s: the evaluation data is sharded by a %s that pads %d of %d samples to give %d ranks equal shards: "
            "those samples are evaluated twice and the metrics are not the dataset's. Shard evaluation data "
            "with unison.distributed.EvalSampler (prepare_loaders does), which pads nothing.",
            engine.name,
            type(sampler).__name__,
            padded,
            size,
            sampler.num_replicas,
        )
