"""Batches of any shape through a config: collate, batch preparation, the model call, the criterion.

:func:`batch_slots` resolves, before any rank is spawned, the keys that say how a batch
flows through a run, into the very objects the Python API takes
(:func:`~unison.distributed.prepare_loaders`'s ``collate_fn``,
:func:`~unison.engine.create_trainer`'s and :func:`~unison.engine.create_evaluator`'s
``prepare_batch``, ``model_call`` and loss):

- ``training.collate``, ``validation.collate``, ``testing.collate``: each loader's
  ``collate_fn`` (default: torch_geometric's for graphs, torch's otherwise);
- ``training.batch``: ``{target: <field>}`` (a :class:`~unison.engine.WholeBatch`) or a
  function ``fn(batch, device) -> (inputs, target)``;
- ``model.call``: fields (a :class:`~unison.engine.ModelCall`) or ``fn(model, batch)``;
  default :class:`~unison.engine.AutoCall`; ``validation.validator.apply_model`` and
  ``testing.tester.apply_model`` (QuantumGrav's) for that section;
- ``criterion``: a function of the user's gets the whole batch, as QuantumGrav calls it
  (:func:`criterion_loss`); ``validation.validator.criterion`` and
  ``testing.tester.criterion`` become that section's loss metric.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from unison.config import Config, PyObjectRef
from unison.config.usercode import describe
from unison.engine import AutoCall, ModelCall, WholeBatch
from unison.metrics import BatchLoss, Loss
from unison.recipe.planning.references import _References

SECTIONS = ("training", "validation", "testing")
EVALUATORS = {"validation": "validator", "testing": "tester"}
"""The evaluation sections and QuantumGrav's name for their evaluator spec."""

PrepareBatch = Callable[[Any, torch.device, bool], tuple[Any, Any]]


@dataclass
class BatchSlots:
    """How batches flow through a run, as the Python API takes it.

    Attributes:
        collate: section -> the loader's ``collate_fn`` (None: the automatic one).
        prepare_batch: ``fn(batch, device, non_blocking) -> (inputs, target)``, None for the default.
        calls: section -> ``model_call`` (training's is ``model.call``).
        losses: section -> the criterion of that section's loss metric (a ``BatchLoss``), or None
            for the training loss.
    """

    collate: dict[str, Callable[[list[Any]], Any] | None] = field(default_factory=dict)
    prepare_batch: PrepareBatch | None = None
    calls: dict[str, Callable[[nn.Module, Any], Any]] = field(default_factory=dict)
    losses: dict[str, Callable[..., torch.Tensor] | None] = field(default_factory=dict)


def batch_slots(config: Config, refs: _References, loss: Callable[..., torch.Tensor]) -> BatchSlots:
    """Resolves the collate, batch and model-call keys, and each evaluator's criterion.

    Raises:
        ConfigError: naming the key, with its file and line.
    """
    slots = BatchSlots(prepare_batch=_prepare_batch(config.training.batch, refs))
    collate = None
    for section in SECTIONS:
        named = getattr(config, section).collate
        if named is not None:
            collate = refs.ref(named, "collate", f"{section}.collate")
        slots.collate[section] = collate  # a section without its own takes the one before it
    call = _model_call(config.model.call, refs)
    slots.calls["training"] = call
    loss_used = (
        any(issubclass(cls, Loss) and "loss_fn" not in kw for cls, kw in _metric_classes(config, refs))
        or not config.validation.metrics
    )
    criterion: Callable[..., torch.Tensor] | None = None
    for section, key in EVALUATORS.items():
        spec = getattr(config, section).__dict__[key]
        if "apply_model" in spec:
            call = _model_call(spec["apply_model"], refs, f"{section}.{key}.apply_model")
        if "criterion" in spec:
            criterion = _section_criterion(spec["criterion"], refs, f"{section}.{key}.criterion")
        slots.calls[section], slots.losses[section] = call, criterion
        if criterion is None and loss_used and isinstance(loss, BatchLoss) and _requires(loss.loss_fn) > 2:
            raise refs.error(
                "criterion",
                f"{describe(loss.loss_fn)} needs a third argument (the trainer), but evaluation calls "
                f"criterion(outputs, batch), as QuantumGrav's evaluators do, and {section} uses it: give that "
                f"parameter a default (trainer=None) or set {section}.{key}.criterion",
            )
    return slots


def with_loss(cls: type, kwargs: dict[str, Any], loss: Callable[..., torch.Tensor] | None) -> dict[str, Any]:
    """``kwargs`` of a metric class, where a :class:`~unison.metrics.Loss` without ``loss_fn``
    gets ``loss`` (the section's criterion, else the training loss): the rule in one place."""
    if issubclass(cls, Loss) and "loss_fn" not in kwargs:
        return {"loss_fn": loss, **kwargs}
    return kwargs


def criterion_loss(loss: Callable[..., torch.Tensor], refs: _References) -> Callable[..., torch.Tensor]:
    """The top-level ``criterion``, called as QuantumGrav calls it, decided from its signature.

    A torch loss (a ``torch.nn.Module`` or a function of torch) compares outputs with the
    target: ``loss(y_pred, y)``. A function of the user's gets the whole batch on the device,
    ``criterion(outputs, batch)``, and in training the trainer too, ``criterion(outputs,
    batch, trainer)``, when its third positional parameter is required, is named ``trainer``,
    or is ``*args``. Anything else is refused, naming ``criterion``.
    """
    module = getattr(loss, "__module__", None) or ""
    if isinstance(loss, nn.Module) or module == "torch" or module.startswith("torch."):
        return loss
    try:
        params = list(inspect.signature(loss).parameters.values())
    except (TypeError, ValueError):
        return BatchLoss(loss)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind is p.VAR_POSITIONAL for p in params)
    required = _requires(loss)
    keyword_only = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if required > 3 or keyword_only or (len(positional) < 2 and not varargs):
        raise refs.error(
            "criterion",
            f"{describe(loss)} cannot be called as criterion(outputs, batch) nor criterion(outputs, batch, "
            f"trainer) (its parameters: {[p.name for p in params]}); write compute_loss(outputs, batch) or "
            "compute_loss(outputs, batch, trainer), or name a loss of (y_pred, y) as training.loss",
        )
    third = positional[2] if len(positional) > 2 else None
    with_trainer = varargs or (
        third is not None and (third.default is third.empty or third.name == "trainer")
    )
    return NamedCriterion(loss, refs, with_trainer=with_trainer)


class NamedCriterion(BatchLoss):
    """A top-level ``criterion`` of the user's, called ``criterion(outputs, batch[, trainer])``: the
    failure of its first call names the key (file and line), the convention the slot calls it by,
    and how to write the other one.

    A loss written ``loss(y_pred, y)`` fits the signature check and fails only once called, with
    the whole batch where it expects the target (torch's ``argument 'target' must be Tensor, not
    list``). Later calls go straight to the function.
    """

    def __init__(self, loss_fn: Callable[..., torch.Tensor], refs: _References, with_trainer: bool) -> None:
        super().__init__(loss_fn, with_trainer=with_trainer)
        self.refs, self.called = refs, False

    def __call__(self, y_pred: Any, batch: Any, *trainer: Any) -> torch.Tensor:
        if self.called:
            return self.loss_fn(y_pred, batch, *trainer)
        try:
            out = self.loss_fn(y_pred, batch, *trainer)
        except Exception as err:
            raise self.refs.error(
                "criterion",
                f"{describe(self.loss_fn)} raised {type(err).__name__} on its first call: {err}. The criterion "
                "key calls a function as QuantumGrav does, criterion(outputs, batch) (criterion(outputs, batch, "
                "trainer) in training when it takes a third parameter): the second argument is the whole batch "
                "on the device, not its target. A loss of (y_pred, y) is named by training.loss instead "
                "(training.loss: !pyobject <module>.<function>), or reads the target from the batch: "
                "def criterion(outputs, batch): return loss(outputs, batch[1]) (batch.y for a graph)",
            ) from err
        self.called = True
        return out


def _requires(fn: Callable[..., Any]) -> int:
    """How many positional arguments ``fn`` cannot do without."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return 0
    return sum(
        1 for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty
    )


def _section_criterion(value: Any, refs: _References, key: str) -> Callable[..., torch.Tensor]:
    """``validator.criterion`` / ``tester.criterion``: ``fn(outputs, batch)``, that section's loss metric."""
    if not isinstance(value, PyObjectRef):
        raise refs.error(key, f"expected !pyobject fn(outputs, batch), got {value!r}")
    fn = refs.ref(value, "loss", key)
    if isinstance(fn, type):
        raise refs.error(
            key, f"{describe(fn)} is a class; name a function fn(outputs, batch) (or an instance)"
        )
    required = _requires(fn)
    try:
        inspect.signature(fn).bind(None, None)
    except TypeError as err:
        raise refs.error(
            key,
            f"{describe(fn)} cannot be called as criterion(outputs, batch), as evaluation calls it ({err}; "
            f"{required} required)",
        ) from None
    except ValueError:
        pass
    return BatchLoss(fn)


def _model_call(value: Any, refs: _References, key: str = "model.call") -> Callable[[nn.Module, Any], Any]:
    """``model.call``: fields by position (a list) or keyword (a mapping), or ``fn(model, batch)``."""
    if value is None:
        return AutoCall()
    if isinstance(value, list):
        return ModelCall(args=value)
    if isinstance(value, dict):
        return ModelCall(kwargs=value)
    if not isinstance(value, PyObjectRef):
        raise refs.error(
            key, f"expected a list of fields, a mapping or !pyobject fn(model, batch), got {value!r}"
        )
    fn = refs.ref(value, "model_call", key)
    refs.bind(fn, type_key=key, kwargs_key=key, kwargs={}, args=(None, None), how="(model, batch)")
    return fn  # checked by its slot: a function of the user's


def _prepare_batch(value: Any, refs: _References) -> PrepareBatch | None:
    """``training.batch``: ``{target: <field>}``, or ``fn(batch, device[, non_blocking])``."""
    key = "training.batch"
    if value is None:
        return None
    if isinstance(value, dict):
        if set(value) != {"target"}:
            raise refs.error(
                key, f"a mapping takes one key, target (the batch's target field), got {sorted(value)}"
            )
        target = value["target"]
        if isinstance(target, bool) or not isinstance(target, (str, int, type(None))):
            raise refs.error(f"{key}.target", f"expected a field name, a position or null, got {target!r}")
        return WholeBatch(target)
    fn = refs.ref(value, "batch", key)
    if _requires(fn) <= 2:
        try:
            inspect.signature(fn).bind(None, None, True)
        except TypeError:
            refs.bind(fn, type_key=key, kwargs_key=key, kwargs={}, args=(None, None), how="(batch, device)")
            return lambda batch, device, non_blocking: fn(batch, device)
        except ValueError:
            pass
        return fn
    refs.bind(fn, type_key=key, kwargs_key=key, kwargs={}, args=(None, None), how="(batch, device)")
    return fn  # not reached: bind refused it


def _metric_classes(config: Config, refs: _References) -> list[tuple[type, dict[str, Any]]]:
    """The validation metric classes with their kwargs, as written (resolved by their own slot)."""
    found: list[tuple[type, dict[str, Any]]] = []
    for name, spec in config.validation.metrics.items():
        key = f"validation.metrics.{name}"
        if isinstance(spec, PyObjectRef):
            found.append((refs.ref(spec, "metric", key), {}))
        elif isinstance(spec, dict) and isinstance(spec.get("type"), PyObjectRef):
            found.append((refs.ref(spec["type"], "metric", key + ".type"), dict(spec.get("kwargs") or {})))
    return found


def batch_options(slots: BatchSlots, section: str) -> dict[str, Any]:
    """The ``prepare_batch`` and ``model_call`` arguments of ``create_trainer`` (``section="training"``)
    or ``create_evaluator`` for ``section``: the same objects the Python API takes."""
    options: dict[str, Any] = {"model_call": slots.calls.get(section, slots.calls.get("training"))}
    if slots.prepare_batch is not None:
        options["prepare_batch"] = slots.prepare_batch
    return options
