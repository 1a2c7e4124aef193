"""``unison plot --compare``: several runs' curves on one figure, labelled by how their configs differ.

Each run's scalars come from its event files, as ``unison plot`` reads them
(:func:`unison.cli.plot.plot_run`); each run's settings from the ``config.yaml`` its run
folder holds (every default filled in, as the run wrote it). A run's label is the
settings in which the runs differ, ``training.lr=0.01, training.batch_size=32``; with no
difference, or without a config, it is the run's folder.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unison.cli.plot import find_log_dir, group_tags
from unison.config import ConfigError
from unison.config.loader import PyObjectRef, load_yaml
from unison.utils.event_files import Scalars, read_scalars

if TYPE_CHECKING:
    from matplotlib.figure import Figure

NOT_SETTINGS = frozenset({"logging.root", "training.path"})
"""Keys that say where a run was written, not how it trained: never a label."""

_UNSET = object()


def _flatten(value: Any, name: str, out: dict[str, Any]) -> None:
    """Mappings become dotted keys (an empty one none: its keys show as unset where others set them)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(item, f"{name}.{key}" if name else str(key), out)
    elif name:
        out[name] = value


def run_settings(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """A run's settings, from its ``config.yaml``, as dotted keys; None without a readable one."""
    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        return None
    try:
        data = load_yaml(path).data
    except ConfigError:
        return None
    flat: dict[str, Any] = {}
    _flatten(data, "", flat)
    return flat


def _shown(value: Any) -> str:
    if value is _UNSET:
        return "unset"
    if isinstance(value, PyObjectRef):
        return value.path
    if value is None:
        return "null"
    if isinstance(value, (bool, int, float, str)):
        return str(value) if not isinstance(value, float) else repr(value)
    return json.dumps(value, default=str, separators=(",", ":"))


def _value_in(flat: dict[str, Any], key: str) -> str:
    """``key``'s value in a run's settings; a section's keys as one ``{key: value, ...}``."""
    if key not in flat:
        inner = {k[len(key) + 1 :]: v for k, v in flat.items() if k.startswith(key + ".")}
        if inner:
            return "{" + ", ".join(f"{k}: {_shown(v)}" for k, v in inner.items()) + "}"
    return _shown(flat.get(key, _UNSET))


def _folder_name(run_dir: Path) -> str:
    return "/".join(run_dir.resolve().parts[-2:])


def run_labels(run_dirs: Sequence[str | os.PathLike[str]]) -> list[str]:
    """One legend label per run: ``key=value`` for every setting whose value differs between
    the runs (in the config's key order), joined by ``", "``.

    A run without a ``config.yaml`` is labelled by its folder (``<name>/<timestamp>``), as
    every run is when their settings do not differ. Runs with the same label get their
    folder added, so no two labels are the same.
    """
    folders = [Path(d) for d in run_dirs]
    settings = [run_settings(d) for d in folders]
    known = [s for s in settings if s is not None]
    keys: list[str] = []
    for flat in known:
        keys += [k for k in flat if k not in keys and k not in NOT_SETTINGS]
    differing = [
        key for key in keys if any(s.get(key, _UNSET) != known[0].get(key, _UNSET) for s in known[1:])
    ]
    # A key that is a section in some runs and a plain value in others (`ema: null` against
    # `ema: {decay: ...}`) is shown once, the section as one mapping.
    sections = sorted((k for k in differing if any(o.startswith(k + ".") for o in differing)), key=len)
    shown: list[str] = []
    for key in differing:
        name = next((p for p in sections if key == p or key.startswith(p + ".")), key)
        if name not in shown:
            shown.append(name)
    labels = [
        ", ".join(f"{k}={_value_in(s, k)}" for k in shown) if s is not None and shown else ""
        for s in settings
    ]
    labels = [label or _folder_name(d) for label, d in zip(labels, folders, strict=True)]
    repeated = {label for label in labels if labels.count(label) > 1}
    return [
        f"{label} ({_folder_name(d)})" if label in repeated and label != _folder_name(d) else label
        for label, d in zip(labels, folders, strict=True)
    ]


def _check_runs(run_dirs: Sequence[str | os.PathLike[str]]) -> list[Path]:
    folders = [Path(d) for d in run_dirs]
    if not folders:
        raise ValueError("plot --compare needs at least one run folder (runs/<name>/<timestamp>).")
    for folder in folders:
        if not folder.is_dir():
            raise FileNotFoundError(
                f"plot --compare: {folder}: no such run folder. Give run folders (runs/<name>/<timestamp>), "
                "each holding tb/ (or the event files themselves)."
            )
    seen = [f.resolve() for f in folders]
    twice = sorted({str(f) for f in folders if seen.count(f.resolve()) > 1})
    if twice:
        raise ValueError(f"plot --compare: {', '.join(twice)} given twice; give each run once.")
    return folders


def compare_figure(run_dirs: Sequence[str | os.PathLike[str]]) -> Figure:
    """The comparison: one panel per scalar tag (the tags of every run, in ``unison plot``'s
    panel order), one line per run in the same colour on every panel, and one legend.

    Raises:
        FileNotFoundError: a run folder does not exist, or holds no event files.
        ValueError: no run folder, one given twice, or no scalars at all.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    folders = _check_runs(run_dirs)
    scalars: list[Scalars] = [read_scalars(find_log_dir(folder)) for folder in folders]
    tags = [tag for panel in group_tags(sorted({t for s in scalars for t in s})).values() for tag in panel]
    if not tags:
        raise ValueError(
            f"plot --compare: the event files of {', '.join(map(str, folders))} hold no scalars."
        )
    labels = run_labels(folders)
    columns = min(3, len(tags))
    rows = math.ceil(len(tags) / columns)
    figure = Figure(figsize=(5.0 * columns, 3.4 * rows + 0.3 * len(folders)), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False)
    handles: dict[int, Any] = {}
    for ax, tag in zip(axes.flat, tags, strict=False):
        for i, runs_scalars in enumerate(scalars):
            points = sorted(runs_scalars.get(tag, []), key=lambda p: p[0])
            if not points:
                continue
            (line,) = ax.plot(
                [s for s, _ in points],
                [v for _, v in points],
                color=f"C{i % 10}",
                marker="o" if len(points) <= 30 else None,
                markersize=3,
                linewidth=1.2,
            )
            handles.setdefault(i, line)
        ax.set_title(tag)
        ax.set_xlabel("iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
        values = [v for s in scalars for _, v in s.get(tag, []) if math.isfinite(v)]
        if tag.split("/")[-1] == "lr" and values and min(values) > 0 and max(values) / min(values) > 50:
            ax.set_yscale("log")
    for ax in list(axes.flat)[len(tags) :]:
        ax.set_visible(False)
    order = sorted(handles)
    figure.legend([handles[i] for i in order], [labels[i] for i in order], loc="outside lower center")
    return figure


def plot_compare(
    run_dirs: Sequence[str | os.PathLike[str]], out: str | os.PathLike[str] | None = None
) -> Path:
    """Draws several runs' curves on one figure, into a PNG (``unison plot --compare``).

    Args:
        run_dirs: the runs' folders (each holding ``tb/`` and ``config.yaml``).
        out: the PNG to write; default ``compare.png`` in the runs' nearest common folder.

    Returns:
        The path of the PNG.

    Raises:
        ImportError: matplotlib is not installed (``pip install "unison[plot]"``).
        FileNotFoundError: a run folder does not exist, or holds no event files.

    Example:
        .. code-block:: python

            from unison.cli.plot_compare import plot_compare

            print(plot_compare(["runs/digits/20250101-120000", "runs/digits/20250101-130000"]))
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError as err:
        raise ImportError(
            'unison plot --compare needs matplotlib: pip install "unison[plot]" (or pip install matplotlib).'
        ) from err
    figure = compare_figure(run_dirs)
    if out is None:
        common = Path(os.path.commonpath([str(Path(d).resolve()) for d in run_dirs]))
        target = common / "compare.png"
    else:
        target = Path(out)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=100)
    return target
