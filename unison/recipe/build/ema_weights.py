"""``training.ema`` in a run: the average on the trainer, and the model that is evaluated.

With ``training.ema`` set, every rank attaches an :class:`~unison.handlers.EMA` to the
trainer (updated once per optimizer update; saved in checkpoints as ``handler:EMA`` and
resumed exactly). With ``training.ema.evaluate`` (the default) the averaged model is the
one the run judges and delivers: validation runs on it, so the best checkpoint, early
stopping and a ``ReduceLROnPlateau`` scheduler follow its metrics; the test phase loads
the best checkpoint's average and tests it; predictions are made with it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from unison.checkpoint import load_checkpoint
from unison.checkpoint.attached import attached_states
from unison.checkpoint.loading import load_states
from unison.engine import Engine
from unison.handlers import EMA
from unison.recipe.planning.run_plan import RunPlan
from unison.utils import get_logger

_log = get_logger("unison.recipe.run")


def attach_ema(plan: RunPlan, model: nn.Module, trainer: Engine) -> EMA | None:
    """The average of ``training.ema``, attached to the trainer; None when it is off.

    Distributed:
        Every rank attaches it alike; it issues no collective (see :mod:`unison.handlers.ema`).
    """
    e = plan.control.ema
    if e is None:
        return None
    ema = EMA(model, e.decay, every=e.every, warmup=e.warmup)
    ema.attach(trainer)
    _log.info(
        "EMA of the weights: decay %g, every %d update(s), after %d warmup update(s); %s",
        e.decay,
        e.every,
        e.warmup,
        "validating, testing and predicting with it" if e.evaluate else "saved, not evaluated",
    )
    return ema


def evaluated_model(plan: RunPlan, model: nn.Module, ema: EMA | None) -> nn.Module:
    """The model a run validates, tests and predicts with: the average when ``training.ema.evaluate``."""
    return ema.module if ema is not None and plan.ema_evaluated else model


def load_best_weights(plan: RunPlan, model: nn.Module, ema: EMA | None, trainer: Engine, path: str) -> None:
    """Loads a checkpoint's weights for testing: the model's, and the average's when it is evaluated.

    Either kind of checkpoint: a file, or a sharded folder (read at this run's world size).

    Distributed:
        Collective: call on every rank.
    """
    state = load_checkpoint(path)
    objects: dict[str, Any] = {"model": model}
    if evaluated_model(plan, model, ema) is not model and ema is not None:
        name = next((n for n, obj in attached_states(trainer, []).items() if obj is ema), None)
        if name is None or (name not in state["objects"] and name not in state["meta"].get("sharded", [])):
            _log.warning("the best checkpoint holds no EMA state: testing the average as training left it")
        else:
            objects[name] = ema
    load_states(objects, state, Path(path), {"model": model})
