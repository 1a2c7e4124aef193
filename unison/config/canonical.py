"""A config under unison's own names: other trainers' keys moved to the keys that mean the same.

Validation already reads old names (``num_epochs`` is ``training.max_epochs``) and settles
QuantumGrav's keys with unison's (:mod:`unison.config.compat`), but a few of those keys
keep their value beside unison's: ``training.path`` read before ``logging.root``,
``training.checkpoint_at`` before ``checkpoint.every_epochs``. :func:`canonical` moves each
onto unison's key, so the config ``unison config`` prints says each thing once and trains
the same run. ``criterion`` stays: it is not another name for ``training.loss`` but a loss
called another way (``criterion(outputs, batch[, trainer])``, as QuantumGrav calls it).
:func:`source_of` says which key as written gave a
key its value, for ``unison config --show-origin``.
"""

from __future__ import annotations

import dataclasses

from unison.config.compat import EARLY_STOPPING_ALIASES
from unison.config.origin import KeyPath, Origin
from unison.config.schema import Config
from unison.config.schema_walk import walk_keys

MOVED: dict[KeyPath, tuple[KeyPath, ...]] = {
    ("logging", "root"): (("training", "path"),),
    ("checkpoint", "every_epochs"): (("training", "checkpoint_at"),),
    ("early_stopping", "metric"): (("early_stopping", "args", "0"),),
}
"""unison's key -> the keys of other trainers that may have given its value (the first given wins)."""

SHARED: dict[KeyPath, tuple[KeyPath, ...]] = {("training", "loss"): (("criterion",),)}
"""unison's key -> another trainer's key shown beside it with the same value (``criterion``)."""


def canonical(config: Config) -> Config:
    """A copy of ``config`` with ``training.path`` and ``training.checkpoint_at`` moved onto
    ``logging.root`` and ``checkpoint.every_epochs`` (the keys they stand for), and left null.
    ``criterion`` is kept (validation gave ``training.loss`` the same value, so the two agree
    when the copy is read again). Sections are copied; ``config`` is not changed, and the run
    both describe is the same.

    Example:
        >>> from unison.config import PyObjectRef
        >>> c = Config(criterion=PyObjectRef("torch.nn.functional.mse_loss"))
        >>> c.training.path = "/scratch/out"
        >>> shown = canonical(c)
        >>> shown.criterion == c.criterion, shown.training.path, shown.logging.root
        (True, None, '/scratch/out')
    """
    training = dataclasses.replace(config.training)
    logging = dataclasses.replace(config.logging)
    checkpoint = dataclasses.replace(config.checkpoint)
    if training.path is not None:
        logging.root, training.path = training.path, None
    if training.checkpoint_at is not None:
        checkpoint.every_epochs, training.checkpoint_at = training.checkpoint_at, None
    return dataclasses.replace(config, training=training, logging=logging, checkpoint=checkpoint)


def _aliases() -> dict[KeyPath, str]:
    return {key.path: key.alias for key in walk_keys() if key.alias}


def source_of(path: KeyPath, origin: Origin) -> KeyPath | None:
    """The key as written (in the file or by ``--set``) that gave the key ``path`` of the :func:`canonical`
    config its value: ``path`` itself, its old name, or another trainer's key; None for a default or a
    value moved away (``training.path`` is shown on ``logging.root``)."""
    moved_away = {src for sources in MOVED.values() for src in sources}
    candidates = list(MOVED.get(path, ())) + list(SHARED.get(path, ()))
    if path not in moved_away:
        candidates.append(path)
    aliases = _aliases()
    for i in range(1, len(path) + 1):
        alias = aliases.get(path[:i])
        if alias is not None:
            candidates.append(path[: i - 1] + (alias,) + path[i:])
    if path[:1] == ("early_stopping",) and len(path) == 2:
        names = [old for old, new in EARLY_STOPPING_ALIASES.items() if new == path[1]]
        candidates += [("early_stopping", "kwargs", name) for name in (path[1], *names)]
    given = [c for c in candidates if c in origin.written]
    by_set = [c for c in given if origin.from_command_line(c)]  # a --set wins over the file
    found = by_set or given
    return found[0] if found else None
