"""The ``tuning:`` section (``unison tune``), checked as data: no optuna needed, nothing imported.

:func:`check_tuning` runs inside :func:`~unison.config.validate` when a config has a
``tuning:`` section. It checks every search-space entry (its key names a config key that
takes the values it draws; its bounds, ``log``, ``step`` and ``choices``), the watched
metric and the direction (filled in when left out, refused when they contradict), the
storage URL, the study name, and that the sampler's and pruner's names and keyword
arguments are plain data. Which Optuna class a name means is looked up by ``unison tune``
(:mod:`unison.recipe.sweep.space`), among Optuna's samplers and pruners only.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Union

from unison.config.checks_base import matches, metric_direction
from unison.config.loader import KeyPath, PyObjectRef, RawConfig
from unison.config.schema import Config, _hints, _is_section, _type_name
from unison.config.watched import watched_of
from unison.utils.confine import ConfinementError, confined_path, decoded

SPACE_FIELDS = {
    "float": ("type", "low", "high", "log", "step"),
    "int": ("type", "low", "high", "log", "step"),
    "categorical": ("type", "choices"),
}
"""What a search-space entry may hold, by its ``type``."""

NOT_TUNABLE = {
    "name": "it names the run folder; each trial gets its own (trial-<number>)",
    "imports": "it says which modules configs may name, not a hyperparameter",
    "parallel": "the ranks of every trial are the same (--nproc)",
    "logging.root": "each trial's folder is inside the sweep folder",
    "training.path": "each trial's folder is inside the sweep folder",
    "tuning": "the sweep cannot tune itself",
}
"""Keys (and sections) a search space may not draw, and why."""

_NAME = re.compile(r"^[A-Z][A-Za-z0-9]*$")
_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _section_of(tp: Any) -> type | None:
    """The section a key holds: ``tp`` itself, or the section inside a union (``X | None``)."""
    if _is_section(tp):
        return typing.cast(type, tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        return next((a for a in typing.get_args(tp) if _is_section(a)), None)
    return None


def _takes_mapping(tp: Any) -> bool:
    if typing.get_origin(tp) is dict:
        return True
    return typing.get_origin(tp) in (Union, types.UnionType) and any(
        _takes_mapping(a) for a in typing.get_args(tp)
    )


def tunable_key(dotted: str) -> tuple[Any, str | None]:
    """The schema type of the config key ``dotted`` (``Any`` inside a mapping such as
    ``model.kwargs``), and None; or None and why the key cannot be drawn by a search space."""
    parts = dotted.split(".")
    if any(not p.isidentifier() for p in parts):
        return None, f"{dotted!r} is not a dotted config key like training.lr or model.kwargs.channels"
    for i in range(1, len(parts) + 1):
        why = NOT_TUNABLE.get(".".join(parts[:i]))
        if why is not None:
            return None, f"{'.'.join(parts[:i])} cannot be tuned: {why}"
    cls: type = Config
    for i, part in enumerate(parts):
        fields = {f.name: f for f in dataclasses.fields(cls)}
        where = ".".join(parts[:i]) or "the top level"
        if part not in fields:
            aliases = {f.metadata.get("alias"): f.name for f in fields.values() if f.metadata.get("alias")}
            if part in aliases:
                return None, f"{part!r} is the old name of {aliases[part]!r}: use {aliases[part]!r}"
            near = difflib.get_close_matches(part, list(fields), n=1, cutoff=0.6)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            return None, f"no key {part!r} in {where}; its keys: {', '.join(sorted(fields))}.{hint}"
        field, tp, rest = fields[part], _hints(cls)[part], parts[i + 1 :]
        section = _section_of(tp)
        if section is not None and (rest or _is_section(tp)):
            if not rest:
                keys = ", ".join(f.name for f in dataclasses.fields(section))
                return None, f"{dotted} is a section; name one of its keys ({keys})"
            cls = section
            continue
        if field.metadata.get("slot"):
            return None, (
                f"{dotted} takes a !pyobject ({field.metadata['slot']} slot); a search space draws numbers "
                "and strings. Tune the keyword arguments instead (e.g. training.optimizer_kwargs.weight_decay)"
            )
        if rest:
            if _takes_mapping(tp):
                return Any, None  # inside kwargs: the signature it is called with checks it (unison tune)
            return None, f"{'.'.join(parts[: i + 1])} is {_type_name(tp)}: it has no keys inside"
        return tp, None
    return None, f"{dotted} names no key"  # pragma: no cover - the loop always returns


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_entry(raw: RawConfig, key: str, spec: Any) -> None:
    """One search-space entry: its fields by type, bounds, log and step, choices, and the key's type."""
    here: KeyPath = ("tuning", "search_space", key)
    tp, why = tunable_key(key)
    if why is not None:
        raise raw.origin.error(here, why)
    if not isinstance(spec, dict) or spec.get("type") not in SPACE_FIELDS:
        got = spec.get("type") if isinstance(spec, dict) else spec
        raise raw.origin.error(
            here,
            f"expected a mapping with type: float | int | categorical, got {got!r}; e.g. "
            "`{type: float, low: 1.0e-4, high: 1.0e-1, log: true}` or `{type: categorical, choices: [16, 32]}`",
        )
    kind = spec["type"]
    for name in spec:
        if name not in SPACE_FIELDS[kind]:
            near = difflib.get_close_matches(str(name), SPACE_FIELDS[kind], n=1, cutoff=0.6)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise raw.origin.error(
                here + (str(name),),
                f"a {kind} search space takes {', '.join(SPACE_FIELDS[kind])}.{hint}",
            )
    if kind == "categorical":
        drawn = _check_choices(raw, here, spec.get("choices"))
    else:
        drawn = _check_range(raw, here, kind, spec)
    if tp is Any:
        return
    for value in drawn:
        if not matches(value, tp):
            fix = (
                "use type: int"
                if kind == "float" and matches(1, tp) and not matches(0.5, tp)
                else (f"draw values the key takes ({_type_name(tp)})")
            )
            raise raw.origin.error(
                here, f"{key} takes {_type_name(tp)}; this {kind} search space draws {value!r}: {fix}"
            )


def _check_choices(raw: RawConfig, here: KeyPath, choices: Any) -> list[Any]:
    path = here + ("choices",)
    if not isinstance(choices, list) or not choices:
        raise raw.origin.error(
            path, f"expected a non-empty list of values, got {choices!r}; e.g. `choices: [16, 32, 64]`"
        )
    for value in choices:
        if value is not None and not isinstance(value, (bool, int, float, str)):
            raise raw.origin.error(
                path,
                f"a choice is a number, a string, true/false or null (what Optuna stores), got "
                f"{type(value).__name__}: {value!r}",
            )
    seen = [repr(v) for v in choices]
    twice = sorted({v for v in seen if seen.count(v) > 1})
    if twice:
        raise raw.origin.error(path, f"{', '.join(twice)} given more than once; list each choice once")
    return list(choices)


def _check_range(raw: RawConfig, here: KeyPath, kind: str, spec: dict[str, Any]) -> list[Any]:
    expect = int if kind == "int" else float
    for name in ("low", "high"):
        value = spec.get(name)
        if value is None:
            raise raw.origin.error(
                here, f"a {kind} search space needs `{name}`; e.g. `{{type: {kind}, low: 1, high: 8}}`"
            )
        if not _number(value) or (expect is int and not isinstance(value, int)):
            raise raw.origin.error(
                here + (name,), f"expected {'an int' if expect is int else 'a number'}, got {value!r}"
            )
    low, high = spec["low"], spec["high"]
    if low > high:
        raise raw.origin.error(here + ("low",), f"low {low!r} is above high {high!r}; swap them")
    log, step = spec.get("log", False), spec.get("step")
    if not isinstance(log, bool):
        raise raw.origin.error(here + ("log",), f"expected true or false, got {log!r}")
    if log and low <= 0:
        raise raw.origin.error(
            here + ("low",),
            f"a log search space needs low > 0, got {low!r}; e.g. low: 1.0e-5 for a learning rate",
        )
    if step is not None:
        if not _number(step) or step <= 0 or (expect is int and not isinstance(step, int)):
            raise raw.origin.error(
                here + ("step",),
                f"expected a {'positive int' if expect is int else 'number > 0'}, got {step!r}",
            )
        if log and not (kind == "int" and step == 1):
            raise raw.origin.error(
                here + ("step",), "Optuna draws either on a log scale or in steps, not both: drop one"
            )
    return [expect(low), expect(high)]


def _check_metric(config: Config, raw: RawConfig) -> None:
    """Fills ``tuning.metric`` and ``tuning.direction`` when left out; refuses a contradiction."""
    t = config.tuning
    names = [str(k) for k in config.validation.metrics] or ["loss"]
    watched = watched_of(config)  # the checkpoint's metric and mode
    metric = t.metric or watched.metric
    if metric not in names:
        raise raw.origin.error(
            ("tuning", "metric"), f"no validation metric named {metric!r}; the metrics: {names}"
        )
    named = metric_direction(metric)
    by_name = {"max": "maximize", "min": "minimize", None: None}[named]
    if t.direction is None:
        if metric == watched.metric:
            t.direction = "maximize" if watched.mode == "max" else "minimize"
        elif by_name is None:
            raise raw.origin.error(
                ("tuning", "metric"),
                f"whether a higher or lower {metric!r} is better is not clear from its name: set "
                "tuning.direction (maximize or minimize)",
            )
        else:
            t.direction = by_name  # type: ignore[assignment]  # one of the two
    elif by_name is not None and t.direction != by_name:
        raise raw.origin.error(
            ("tuning", "direction"),
            f"{t.direction!r} contradicts the metric {metric!r}, for which {'lower' if named == 'min' else 'higher'} "
            f"is better: the sweep would look for the worst trial. Set `direction: {by_name}` (or leave it out)",
        )
    t.metric = metric


def _plain(value: Any) -> bool:
    if isinstance(value, PyObjectRef):
        return False
    if isinstance(value, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in value.items())
    if isinstance(value, list):
        return all(_plain(v) for v in value)
    return True


def _check_optuna_names(config: Config, raw: RawConfig) -> None:
    t = config.tuning
    for key, name, kwargs, package in (
        ("sampler", t.sampler, t.sampler_kwargs, "optuna.samplers"),
        ("pruner", t.pruner, t.pruner_kwargs, "optuna.pruners"),
    ):
        if name is not None and not _NAME.match(name):
            raise raw.origin.error(
                ("tuning", key),
                f"expected the name of a class of {package} (like TPESampler or MedianPruner), got {name!r}; "
                "a config names Optuna's own classes only, never a dotted path",
            )
        for arg, value in kwargs.items():
            if not isinstance(arg, str) or not arg.isidentifier() or not _plain(value):
                raise raw.origin.error(
                    ("tuning", f"{key}_kwargs", str(arg)),
                    "keyword arguments of Optuna's classes are plain values (numbers, strings, lists, "
                    f"mappings), got {arg!r}: {value!r}",
                )


RDB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql", "oracle")
"""Database URLs (``scheme://`` or ``scheme+driver://``) Optuna opens as an ``RDBStorage``."""
REDIS_SCHEMES = ("redis", "rediss")
"""URLs of a Redis server: Optuna's journal in Redis (``JournalRedisBackend``), as its CLI maps them."""
_SQLITE_SUFFIXES = (".db", ".sqlite", ".sqlite3")


def storage_kind(storage: str) -> str:
    """What ``tuning.storage`` names, the way Optuna's own CLI reads a storage: ``"redis"`` (a
    ``redis://`` URL: a journal in Redis), ``"rdb"`` (a database URL), or ``"journal"`` (a file
    path: Optuna's journal file)."""
    scheme = storage.split("://", 1)[0].split("+", 1)[0].lower() if _URL.match(storage) else ""
    if scheme in REDIS_SCHEMES:
        return "redis"
    return "rdb" if scheme else "journal"


def storage_file(storage: str, root: Path) -> Path | None:
    """The file a ``sqlite:///`` URL or a journal path names, resolved, if it stays inside ``root``
    whichever way it is read (:func:`~unison.utils.confine.confined_path`: percent-encoding as
    SQLAlchemy decodes it, ``..``, links); None for a server.

    Raises:
        ConfinementError: the file is outside ``root``, or written so that readers differ.
    """
    if storage_kind(storage) == "journal":
        text = storage
    elif storage.lower().startswith("sqlite:///"):
        text = storage[len("sqlite:///") :]
    else:
        return None
    if not text or text == ":memory:":
        raise ConfinementError(f"{storage!r} names no file")
    if Path(decoded(text)).is_absolute():
        within = os.path.relpath(text, root)
        if within == os.curdir or within.split(os.sep)[0] == os.pardir:
            raise ConfinementError(f"{storage!r} names a file outside {root}")
        text = within
    return confined_path(text, root)


def check_storage_confined(config: Config, root: Path) -> Path | None:
    """The confinement of ``tuning.storage``: a journal or SQLite file stays inside ``root``, the
    sweep's output root (the text read as SQLAlchemy reads it: percent-decoded). The sweep checks
    it once, when it plans (:func:`~unison.recipe.sweep.space.plan_sweep`); its trials, each planned
    in a folder of its own, take the checked value and do not check it again.

    Returns:
        The file, resolved; None for a server or without ``tuning.storage``.

    Raises:
        ConfigError: at ``tuning.storage``, naming the file, the root and the fix.
    """
    storage = (config.tuning.storage or "").strip()
    if not storage:
        return None
    try:
        return storage_file(storage, root)
    except ConfinementError as err:
        raise config.origin.error(
            ("tuning", "storage"),
            f"{err}. A study's file stays inside the output root {root} (training.path or logging.root), "
            "as every file a config names: write sqlite:///<a file in it> or a journal file path like "
            "study.log; for a study shared by sweeps elsewhere use a database or Redis server",
        ) from None


def _check_storage(config: Config, raw: RawConfig) -> None:
    """``tuning.storage``'s form: a journal file, a SQLite file, a database server, or a Redis
    server (whether a file stays inside the output root: :func:`check_storage_confined`)."""
    t = config.tuning
    here: KeyPath = ("tuning", "storage")
    root = Path(config.training.path or config.logging.root).resolve()
    if t.storage is not None:
        url = t.storage.strip()
        kind = storage_kind(url)
        scheme = url.split("://", 1)[0].split("+", 1)[0].lower()
        if kind == "rdb" and scheme not in RDB_SCHEMES:
            raise raw.origin.error(
                here,
                f"{t.storage!r}: not a storage Optuna opens; give a journal file path (study.log, inside {root}), "
                f"a database URL ({', '.join(RDB_SCHEMES)}), or a Redis URL (redis://host:6379)",
            )
        if url in ("sqlite://", "sqlite:///:memory:"):
            raise raw.origin.error(
                here,
                "an in-memory SQLite database keeps nothing to resume, and only one thread can read it; "
                "give a file (sqlite:///sweep.db, in the output root) or leave storage out",
            )
        if kind == "journal" and url.lower().endswith(_SQLITE_SUFFIXES):
            raise raw.origin.error(
                here,
                f"{t.storage!r} is a path, which names an Optuna journal file; for a SQLite database write a "
                f"URL, sqlite:///{url} (in the output root), or a name like study.log for a journal file",
            )
    name = t.study_name
    if name is not None and (
        not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0") or name.startswith("~")
    ):
        raise raw.origin.error(
            ("tuning", "study_name"),
            f"{name!r} is not a folder name: the sweep folder is <logging.root>/<name>/tune-<study_name>/; "
            "use a name like 'lr-sweep'",
        )


def check_tuning(config: Config, raw: RawConfig) -> None:
    """Checks the ``tuning:`` section of a validated config, when it has one; with a search
    space, fills ``tuning.metric`` and ``tuning.direction`` (without one, as in the section
    every run's saved config.yaml holds, they stay unset: a config reads back the same).

    Raises:
        ConfigError: naming the file, the line and the ``tuning.`` key, the value, what was
            expected, and the fix.
    """
    if "tuning" not in raw.data:
        return
    space = config.tuning.search_space
    for key, spec in space.items():
        _check_entry(raw, str(key), spec)
    if space or config.tuning.metric is not None or config.tuning.direction is not None:
        _check_metric(config, raw)
    _check_optuna_names(config, raw)
    _check_storage(config, raw)
