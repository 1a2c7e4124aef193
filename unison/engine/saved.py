"""What an Engine's ``state_dict()`` holds beyond ignite's counters, under the ``"unison"`` key.

ignite's keys (``iteration``, ``epoch_length``, ``max_epochs`` or ``max_iters``, and the
user's ``state_dict_user_keys``) resume a run at ``divmod(iteration, epoch_length)``. unison
adds, when there is any:

- ``stop``: this rank's stop requests that no sync point will have settled before the next
  iteration (a decision already taken is applied before anything saves);
- ``update``: the optimizer updates done (``state.update``, a trainer's);
- ``position``: ``[epochs completed, iterations into the next]``, which differs from ignite's
  ``divmod`` after an epoch cut short by ``terminate_epoch()``;
- ``step_offset``: what a resume at another world size took off the iteration, so that
  trackers' steps go on (:mod:`unison.checkpoint.tracking_step`); left out when 0.

The entry is left out when it says nothing ignite's keys do not: a plain Engine's state dict is
then ignite's, key for key. A checkpoint of unison's Checkpoint handler always holds it (with
every rank's requests and the epoch's partial sums, see ``handlers/checkpoint.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unison.checkpoint.tracking_step import STEP_OFFSET_ATTR, step_offset
from unison.distributed.primitives import get_rank
from unison.engine.control import StopControl
from unison.engine.events import UPDATE_ATTR
from unison.engine.lockstep import requests_settle_here
from unison.engine.protocol import EngineParts

STATE_KEY = "unison"


def extra_state(engine: EngineParts) -> dict[str, Any]:
    """The engine's own entry, whether or not ignite's keys imply it."""
    stop = StopControl(engine.name) if requests_settle_here(engine) else engine._control
    extra = {
        "stop": stop.state_dict(),
        UPDATE_ATTR: int(getattr(engine.state, UPDATE_ATTR, 0)),
        "position": list(engine.epoch_position),
    }
    if step_offset(engine):
        extra[STEP_OFFSET_ATTR] = step_offset(engine)
    return extra


def says_more(extra: Mapping[str, Any], ignite_state: Mapping[str, Any]) -> bool:
    """Whether ``extra`` holds anything a resume from ignite's keys alone would lose."""
    if any(extra["stop"].values()) or extra[UPDATE_ATTR] or extra.get(STEP_OFFSET_ATTR):
        return True
    length, iteration = ignite_state.get("epoch_length"), ignite_state.get("iteration", 0)
    if not length:
        return bool(iteration)
    return list(extra["position"]) != [iteration // length, iteration % length]


def ignite_keys(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """ignite's keys of a saved state, for ignite's ``load_state_dict``.

    A state saved before the data's length was known (inside the first epoch over data without
    a length, ``epoch_length`` None) cannot be loaded by ignite, which derives the epoch from
    the length: with unison's ``position`` it loads at iteration 0, and :func:`load_extra_state`
    puts the iteration and the position back. The loop learns the length when the data ends.
    """
    keys = {k: v for k, v in state_dict.items() if k != STATE_KEY}
    saved = state_dict.get(STATE_KEY)
    if keys.get("epoch_length") is None and keys.get("iteration") and isinstance(saved, Mapping):
        if "position" in saved:
            keys["iteration"] = 0
    return keys


def load_extra_state(
    engine: EngineParts, saved: Mapping[str, Any] | None, iteration: int | None = None
) -> None:
    """Restores the entry after ignite's keys were loaded; without one, no request is pending.

    ``iteration``: the saved iteration, put back when ignite could not load it (no epoch length).
    """
    if saved is not None and iteration and engine.state.epoch_length is None:
        engine.state.iteration = int(iteration)
    setattr(engine.state, STEP_OFFSET_ATTR, int((saved or {}).get(STEP_OFFSET_ATTR, 0)))
    if saved is None:
        engine._control.clear()
        state = engine.state  # ignite's keys alone: its position, as its loop will take it up
        engine._epoch.load({"position": divmod(state.iteration, state.epoch_length or 1)}, state)
        return
    by_rank = saved.get("stop_by_rank")  # a checkpoint holds every rank's own requests
    if by_rank is not None:
        engine._control.load_state_dict(by_rank[get_rank()] if get_rank() < len(by_rank) else {})
    else:
        engine._control.load_state_dict(saved.get("stop", {}))
    setattr(engine.state, UPDATE_ATTR, int(saved.get(UPDATE_ATTR, 0)))
    engine._epoch.load(saved, engine.state)
