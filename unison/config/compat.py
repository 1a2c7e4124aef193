"""Keys other trainers' configs use, read with their meaning (QuantumGrav's ``TrainerDDP`` first).

:func:`apply_compat` runs inside :func:`~unison.config.validate`, after the schema's types
are checked and before the values are: it settles the keys that say one thing two ways,
and checks the values of keys that are accepted but not needed.

- ``criterion`` (top level) is ``training.loss`` under QuantumGrav's name: the one given
  fills the other; both given with different values is an error (a ``--set`` wins over the
  file).
- ``early_stopping: {type, args, kwargs}``: a keyword named like a key of the section
  (``patience``, ``metric``, ``mode``, ``min_delta``; QuantumGrav's ``delta``) sets that
  key, and so does ``args`` for unison's own handler (its one positional argument after
  the trainer is the metric). What is left goes to a handler class of the user's own.
- ``validation.validator`` and ``testing.tester`` (QuantumGrav's evaluator specs),
  ``parallel.rank`` and ``parallel.output_device``: their values are checked here; what
  becomes of them is logged before the ranks start (:mod:`unison.recipe.planning.accepted`).

The loader keys of ``validation`` and ``testing`` are checked here too.
"""

from __future__ import annotations

from typing import Any

from unison.config.checks_base import matches, takes_float
from unison.config.loader import KeyPath, PyObjectRef, RawConfig
from unison.config.schema import Config, EarlyStoppingConfig, _hints, _type_name

UNISON_EARLY_STOPPING = "unison.handlers.EarlyStopping"
"""The handler an ``early_stopping`` section builds unless its ``type`` names another."""

EARLY_STOPPING_NAMES = {
    "EarlyStopping": UNISON_EARLY_STOPPING,
    "DefaultEarlyStopping": UNISON_EARLY_STOPPING,  # QuantumGrav's
    "unison.handlers.EarlyStopping": UNISON_EARLY_STOPPING,
    "unison.handlers.early_stopping.EarlyStopping": UNISON_EARLY_STOPPING,
}
"""Names of unison's early stopping in ``early_stopping.type``, other trainers' names included."""

EARLY_STOPPING_ALIASES = {"delta": "min_delta"}
"""Other trainers' keyword names for keys of the ``early_stopping`` section."""

_HANDLER_KEYS = ("type", "args", "kwargs")


def is_unison_early_stopping(value: PyObjectRef | str | None) -> bool:
    """Whether ``early_stopping.type`` names unison's own handler (None does)."""
    if value is None:
        return True
    path = value.path if isinstance(value, PyObjectRef) else value
    return path in EARLY_STOPPING_NAMES


def apply_compat(config: Config, raw: RawConfig) -> None:
    """Settles ``criterion`` and ``training.loss``, moves ``early_stopping``'s args and kwargs onto its
    keys, and checks the values of the evaluator specs, the DDP keys and the loader keys.

    Raises:
        ConfigError: naming the file, the line and the key.
    """
    _criterion(config, raw)
    _early_stopping(config, raw)
    _devices(config, raw)
    _loaders(config, raw)


def _criterion(config: Config, raw: RawConfig) -> None:
    criterion, loss = config.criterion, config.training.loss
    if criterion is None:
        return
    if raw.origin.given("training", "loss") and loss.path != criterion.path:
        by_set_loss = raw.origin.from_command_line(("training", "loss"))
        by_set_criterion = raw.origin.from_command_line(("criterion",))
        if by_set_loss and not by_set_criterion:
            config.criterion = None  # the command line's training.loss wins
            return
        if not by_set_criterion:
            raise raw.origin.error(
                ("criterion",),
                f"criterion ({criterion}) and training.loss ({loss}) name different losses; they are one "
                "setting (criterion is QuantumGrav's name for training.loss): keep one of them",
            )
    config.training.loss = criterion


def _early_stopping(config: Config, raw: RawConfig) -> None:
    es = config.early_stopping
    section = ("early_stopping",)
    hints = _hints(EarlyStoppingConfig)
    keys = [name for name in hints if name not in _HANDLER_KEYS]
    moved: dict[str, tuple[KeyPath, Any]] = {}
    for given, value in es.kwargs.items():
        name = EARLY_STOPPING_ALIASES.get(str(given), str(given))
        if name == "tasks":
            raise raw.origin.error(
                section + ("kwargs", str(given)),
                "QuantumGrav's per-task early stopping watches several metrics; unison's watches one "
                "validation metric, agreed by every rank: set kwargs {metric: <a validation.metrics name>, "
                "mode: min|max, min_delta: ..., patience: ...} instead",
            )
        if name in keys:
            moved[name] = (section + ("kwargs", str(given)), value)
    if es.args and is_unison_early_stopping(es.type):
        if len(es.args) > 1:
            raise raw.origin.error(
                section + ("args",),
                f"EarlyStopping takes one positional argument after the trainer, the metric; got {len(es.args)}: "
                f"{es.args!r}. Name the others under kwargs (patience, mode, min_delta ...)",
            )
        if "metric" in moved:
            raise raw.origin.error(
                section + ("args",), "the metric is given twice, in args and in kwargs: keep one"
            )
        moved["metric"] = (section + ("args", "0"), es.args[0])
    for name, (path, value) in moved.items():
        if not matches(value, hints[name]):
            hint = ""
            if name == "mode" and value in ("any", "all"):
                hint = (
                    " (QuantumGrav's mode any/all joins several tasks; unison watches one metric, and "
                    "early_stopping.agreement says how ranks agree)"
                )
            raise raw.origin.error(path, f"expected {_type_name(hints[name])}, got {value!r}{hint}")
        if isinstance(value, int) and not isinstance(value, bool) and takes_float(hints[name]):
            value = float(value)
        current = getattr(es, name)
        if raw.origin.given("early_stopping", name) and current != value:
            if raw.origin.from_command_line(section + (name,)) and not raw.origin.from_command_line(path):
                continue  # the command line wins over the file
            if not raw.origin.from_command_line(path):
                raise raw.origin.error(
                    path,
                    f"sets early_stopping.{name} to {value!r}, which the section also sets, to {current!r}: "
                    "keep one of them",
                )
        setattr(es, name, value)
    es.kwargs = {
        k: v for k, v in es.kwargs.items() if EARLY_STOPPING_ALIASES.get(str(k), str(k)) not in moved
    }
    if "metric" in moved and is_unison_early_stopping(es.type):
        es.args = []
    if es.type is not None and es.patience is None:
        raise raw.origin.error(
            section + ("type",),
            f"early stopping {str(es.type)!r} is named but has no patience: add `kwargs: {{patience: 5}}` "
            "(or `patience: 5` in the section)",
        )


def _devices(config: Config, raw: RawConfig) -> None:
    import torch

    checks: list[tuple[KeyPath, Any]] = [(("parallel", "output_device"), config.parallel.output_device)]
    for section, key in (("validation", "validator"), ("testing", "tester")):
        spec = getattr(getattr(config, section), key)
        if "device" in spec:
            checks.append(((section, key, "device"), spec["device"]))
    for path, value in checks:
        if value is None:
            continue
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, str))
            or (isinstance(value, int) and value < 0)
        ):
            raise raw.origin.error(
                path, f"expected a device ('cuda', 'cuda:0', 'cpu') or a cuda index, got {value!r}"
            )
        try:
            if isinstance(value, str):  # an int is a cuda index: torch.device(1) needs a GPU here
                torch.device(value)
        except (RuntimeError, ValueError) as err:
            raise raw.origin.error(
                path, f"{value!r} is not a device ({err}); use 'cuda', 'cuda:0' or 'cpu'"
            ) from None
    rank = config.parallel.rank
    if rank is not None and rank < 0:
        raise raw.origin.error(("parallel", "rank"), f"must be >= 0 or null, got {rank}")


def _loaders(config: Config, raw: RawConfig) -> None:
    v, t = config.validation, config.testing
    test_workers = v.num_workers if t.num_workers is None else t.num_workers
    for path, value in ((("testing", "num_workers"), t.num_workers),):
        if value is not None and value < 0:
            raise raw.origin.error(path, f"must be >= 0, got {value!r}")
    for path, value in (
        (("testing", "batch_size"), t.batch_size),
        (("validation", "prefetch_factor"), v.prefetch_factor),
        (("testing", "prefetch_factor"), t.prefetch_factor),
    ):
        if value is not None and value <= 0:
            raise raw.origin.error(path, f"must be > 0, got {value!r}")
    for path, prefetch, workers in (
        (("validation", "prefetch_factor"), v.prefetch_factor, v.num_workers),
        (("testing", "prefetch_factor"), t.prefetch_factor, test_workers),
    ):
        if prefetch is not None and workers == 0:
            raise raw.origin.error(
                path,
                f"needs {path[0]}.num_workers > 0 (prefetching is done by worker processes)",
            )
