"""Rules the config checks share: whether a value fits a typed key, and which way a metric is better.

:mod:`~unison.config.validation` checks the schema's keys with them,
:mod:`~unison.config.compat` the keys other trainers write, and
:mod:`~unison.config.tuning` the search space and the sweep's direction: one rule each,
read from here, so that validation alone calls the other two.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Literal, Union


def matches(value: Any, tp: Any) -> bool:
    """Whether ``value`` (as YAML gives it) fits the key type ``tp``: an int fits a float, a bool
    fits neither, a list fits ``list[X]`` when every item fits ``X``."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(matches(v, item) for v in value)
    return isinstance(value, tp)


def takes_float(tp: Any) -> bool:
    """Whether an int written for a key of type ``tp`` becomes a float (``lr: 1`` is ``1.0``)."""
    if tp is float:
        return True
    return (
        typing.get_origin(tp) in (Union, types.UnionType)
        and float in typing.get_args(tp)
        and int not in typing.get_args(tp)
    )


_LOWER_IS_BETTER = frozenset(
    "loss mse mae rmse msle nll perplexity ppl error err cer wer mape smape kl kld bce xent".split()
)
_HIGHER_IS_BETTER = frozenset(
    "accuracy acc f1 precision recall auc auroc roc r2 iou miou dice bleu rouge".split()
)


def metric_direction(name: str) -> Literal["max", "min"] | None:
    """``"min"`` for a loss-like metric name (``loss``, ``val_loss``, ``mse`` ...), ``"max"`` for an
    accuracy-like one (``accuracy``, ``f1`` ...), None when the name does not say."""
    lowered = name.lower()
    words = {w for w in re.split(r"[^a-z0-9]+", lowered) if w}
    if words & _LOWER_IS_BETTER or lowered.endswith("loss"):
        return "min"
    if words & _HIGHER_IS_BETTER:
        return "max"
    return None


def literal_strings(tp: Any) -> list[str]:
    """The string values of the ``Literal`` in ``tp`` (itself, or one in a union)."""
    if typing.get_origin(tp) is Literal:
        return [v for v in typing.get_args(tp) if isinstance(v, str)]
    if typing.get_origin(tp) in (Union, types.UnionType):
        return [v for a in typing.get_args(tp) for v in literal_strings(a)]
    return []


def in_case_of(value: Any, tp: Any) -> Any:
    """``value`` written as the ``Literal`` value of ``tp`` it equals in any case (``"info"`` -> ``"INFO"``);
    anything else as is."""
    if isinstance(value, str):
        for allowed in literal_strings(tp):
            if allowed.casefold() == value.casefold():
                return allowed
    return value
