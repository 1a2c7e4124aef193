"""Validation of a raw config into a :class:`~unison.config.schema.Config`.

Every key is checked against the schema's types (an unknown key gets the nearest valid
one), values against their ranges, the run's name as one folder name, and the best
checkpoint's mode against the watched metric's name; every error names the file, the
line and the key path.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from typing import Any

from unison.config.batch_sizes import check_batch_keys
from unison.config.checks_base import in_case_of, matches, metric_direction, takes_float
from unison.config.compat import apply_compat
from unison.config.data_config import check_data
from unison.config.fault_tolerance_config import check_fault_tolerance
from unison.config.handlers_config import check_handlers
from unison.config.loader import KeyPath, RawConfig
from unison.config.model_config import check_model
from unison.config.schema import REQUIRED, Config, _hints, _is_section, _type_name, item_section, section_in
from unison.config.tuning import check_tuning
from unison.config.unknown_keys import check_unknown_keys
from unison.config.watched import watched_of


def _build(cls: type, data: Any, raw: RawConfig, path: KeyPath) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise raw.origin.error(path, f"expected a mapping (a section), got {type(data).__name__}: {data!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    aliases = {f.metadata["alias"]: f.name for f in fields.values() if f.metadata.get("alias")}
    hints = _hints(cls)
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    extra_field = getattr(cls, "EXTRA_KEYS", None)  # a section that keeps the keys it does not define
    extras: dict[str, Any] = {}
    for key, value in data.items():
        key = str(key)
        name = aliases.get(key, key)
        if name not in fields and extra_field is not None:
            extras[key] = value
            continue
        if name not in fields:
            choices = list(fields) + list(aliases)
            near = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            where = ".".join(path) or "the top level"
            raise raw.origin.error(
                path + (key,),
                f"unknown key {key!r} in {where}. Valid keys: {', '.join(sorted(fields))}.{hint}",
            )
        if name in values:
            earlier = given_as[name]
            if path + (earlier,) in raw.origin.overrides:
                continue  # the command line's --set wins over the file
            if path + (key,) not in raw.origin.overrides:
                raise raw.origin.error(
                    path + (key,),
                    f"the key is set twice, as {earlier!r} and as {key!r}; keep one of them",
                )
        given_as[name] = key
        tp = hints[name]
        if fields[name].metadata.get("any_case"):
            value = in_case_of(value, tp)
        if _is_section(tp) or (isinstance(value, dict) and section_in(tp) is not None):
            values[name] = _build(section_in(tp), value, raw, path + (key,))  # type: ignore[arg-type]  # a section
            continue
        items = item_section(tp)  # a list of sections (handlers): each item checked as one
        if items is not None and isinstance(value, list):
            values[name] = [_build(items, v, raw, path + (key, str(i))) for i, v in enumerate(value)]
            continue
        if not matches(value, tp):
            raise raw.origin.error(
                path + (key,),
                f"expected {_type_name(tp)}, got {type(value).__name__}: {value!r}",
            )
        if isinstance(value, int) and not isinstance(value, bool) and takes_float(tp):
            value = float(value)
        values[name] = value
    for name in fields:
        if name not in values and _is_section(hints[name]):
            values[name] = hints[name]()
    if extras and isinstance(extra_field, str):
        values[extra_field] = {**values.get(extra_field, {}), **extras}
    return cls(**values)


def validate(raw: RawConfig) -> Config:
    """Checks a config read by :func:`~unison.config.load_yaml` against the schema.

    Raises:
        ConfigError: naming the file, the line, the key path and the expected type; for
            an unknown key, the nearest valid one.
    """
    check_unknown_keys(Config, raw)  # every unknown key at once, before any value is checked
    config = _build(Config, raw.data, raw, ())
    for path in REQUIRED:
        if path == ("data", "build"):
            check_data(config.data, raw)  # data.build, or data.files and data.reader
            continue
        section = getattr(config, path[0])
        if getattr(section, path[1]) is None:
            raise raw.origin.error(
                path, f"required: set {'.'.join(path)} (e.g. `{path[1]}: !pyobject my_recipe.thing`)"
            )
    check_model(config.model, raw)  # model: from_config's own keys, call
    check_handlers(config.handlers, raw)  # handlers: one of type or function each, events that read
    apply_compat(config, raw)  # criterion, early_stopping's type/args/kwargs, evaluator specs
    _check_values(config, raw)
    check_fault_tolerance(raw, config.parallel.fault_tolerance, config.training, config.parallel)
    check_batch_keys(config, raw.origin)  # batch_size or global_batch_size, per section
    _check_training_extras(config, raw)
    _check_name(config, raw)
    _check_modes(config, raw)
    check_tuning(config, raw)  # after _check_modes: its default direction is checkpoint.mode
    return config


def _check_name(config: Config, raw: RawConfig) -> None:
    """``name`` is one folder name: the run directory stays inside ``logging.root``."""
    name = config.name
    bad = not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0") or name.startswith("~")
    if bad:
        path = ("name",)
        raise raw.origin.error(
            path,
            f"{name!r} is not a folder name: the run directory is <logging.root>/<name>/, so a name with "
            "'/', '\\', '..' or '~' (or an empty one) would write outside logging.root; use a name like "
            "'digits-small'",
        )


def _check_modes(config: Config, raw: RawConfig) -> None:
    """Refuses a mode that contradicts its metric's name (``mode: max`` on a loss keeps the worst
    checkpoint). A mode left out stays out: the plan derives it (:func:`watched_of`)."""
    metrics = watched_of(config)
    for section, metric in (("checkpoint", metrics.metric), ("early_stopping", metrics.stop_metric)):
        mode = getattr(config, section).mode
        direction = metric_direction(metric)
        if mode is not None and direction is not None and mode != direction:
            better = "lower" if direction == "min" else "higher"
            raise raw.origin.error(
                (section, "mode"),
                f"mode {mode!r} contradicts the watched metric {metric!r}, for which {better} is better: "
                f"'best' would keep the worst model. Set `mode: {direction}` (or leave mode out)",
            )


def _check_training_extras(config: Config, raw: RawConfig) -> None:
    """``training.ema`` and the mapping form of ``training.lr_scaling``: their ranges."""
    t = config.training
    checks: list[tuple[KeyPath, bool, str]] = []
    if t.ema is not None:
        e = t.ema
        checks += [
            (
                ("training", "ema", "decay"),
                not 0.0 < e.decay < 1.0,
                f"expected a number in (0, 1), got {e.decay!r}: each average keeps `decay` of the previous one "
                "(0.999 averages over about the last 1000 updates); set e.g. `decay: 0.999`",
            ),
            (
                ("training", "ema", "every"),
                e.every < 1,
                f"must be >= 1 (optimizer updates between averages), got {e.every!r}; `every: 1` averages at "
                "every update",
            ),
            (
                ("training", "ema", "warmup"),
                e.warmup < 0,
                f"must be >= 0 (updates that copy the weights before averaging), got {e.warmup!r}",
            ),
        ]
    if t.profile is not None:
        for key, least in (("wait", 0), ("warmup", 0), ("active", 1), ("repeat", 1)):
            value = getattr(t.profile, key)
            what = (
                "iterations recorded" if key == "active" else "windows" if key == "repeat" else "iterations"
            )
            message = f"must be >= {least} ({what}), got {value!r}; leave it out for the default"
            checks.append((("training", "profile", key), value < least, message))
    if not isinstance(t.lr_scaling, str):
        ls = t.lr_scaling
        ref = ls.reference_batch_size
        checks += [
            (
                ("training", "lr_scaling", "reference_batch_size"),
                ref is not None and ref < 1,
                f"must be >= 1 (the global batch the learning rate was tuned for), got {ref!r}; leave it out "
                "for one rank's batch (batch_size x accumulation_steps)",
            ),
            (
                ("training", "lr_scaling", "warmup_steps"),
                ls.warmup_steps < 0,
                f"must be >= 0 (optimizer updates of warmup; 0 for none), got {ls.warmup_steps!r}",
            ),
        ]
    for path, bad, message in checks:
        if bad:
            raise raw.origin.error(path, message)


def _check_values(config: Config, raw: RawConfig) -> None:
    positive = [
        (("training", "max_epochs"), config.training.max_epochs),
        (("training", "batch_size"), config.training.batch_size),
        (("training", "accumulation_steps"), config.training.accumulation_steps),
        (("training", "epoch_length"), config.training.epoch_length),
        (("training", "sync_every"), config.training.sync_every),
        (("training", "checkpoint_at"), config.training.checkpoint_at),
        (("parallel", "nproc_per_node"), config.parallel.nproc_per_node),
        (("parallel", "timeout"), config.parallel.timeout),
        (("validation", "every"), config.validation.every),
        (("validation", "batch_size"), config.validation.batch_size),
        (("checkpoint", "every_epochs"), config.checkpoint.every_epochs),
        (("checkpoint", "every_iters"), config.checkpoint.every_iters),
        (("checkpoint", "every_seconds"), config.checkpoint.every_seconds),
        (("checkpoint", "keep_last"), config.checkpoint.keep_last),
        (("early_stopping", "patience"), config.early_stopping.patience),
        (("logging", "log_every"), config.logging.log_every),
        (("training", "time_limit"), config.training.time_limit),
        (("training", "hang_timeout"), config.training.hang_timeout),
        (("training", "clip_grad_norm"), config.training.clip_grad_norm),
        (("training", "lr"), config.training.lr),
    ]
    for path, value in positive:
        if value is not None and not 0 < value < math.inf:  # NaN compares false both ways
            raise raw.origin.error(
                path,
                f"must be > 0 and finite, got {value!r}"
                + ("; leave the key out (or null) for none" if value == math.inf else ""),
            )
    for path, value in (
        (("training", "num_workers"), config.training.num_workers),
        (("validation", "num_workers"), config.validation.num_workers),
        (("checkpoint", "keep_best"), config.checkpoint.keep_best),
    ):
        if value < 0:
            raise raw.origin.error(path, f"must be >= 0, got {value!r}")
    port = config.parallel.master_port
    if isinstance(port, str):
        if not port.strip().isdigit():
            path = ("parallel", "master_port")
            raise raw.origin.error(path, f"expected a port number, got {port!r}")
        config.parallel.master_port = port = int(port)
    if port is not None and not 0 < port < 65536:
        path = ("parallel", "master_port")
        raise raw.origin.error(path, f"expected a port in 1..65535, got {config.parallel.master_port}")
    if config.training.prefetch_factor is not None and config.training.num_workers == 0:
        path = ("training", "prefetch_factor")
        raise raw.origin.error(
            path, "needs training.num_workers > 0 (prefetching is done by worker processes)"
        )
    if config.parallel.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            path = ("parallel", "backend")
            raise raw.origin.error(
                path, "'nccl' needs CUDA, which is not available here; use 'gloo' or leave it unset"
            )
