"""``unison plot``: a PNG of a run's training and validation curves, from its event files.

Several runs on one figure (``unison plot --compare``) are :mod:`unison.cli.plot_compare`'s.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from unison.utils.event_files import Scalars, event_files, read_scalars

if TYPE_CHECKING:
    from matplotlib.axes import Axes

_ACCURACY_LIKE = re.compile(
    r"(^|_)(acc|accuracy|top\d+|f1|precision|recall|auc|auroc|iou|dice|map)(_|$)", re.I
)
_PANEL_TITLES = {"loss": "loss", "accuracy": "accuracy-like metrics", "lr": "learning rate"}


def _metric(tag: str) -> str:
    """The metric a tag names: ``val/loss`` -> ``loss``, ``train/lr/0`` -> ``lr``."""
    parts = tag.split("/")
    if len(parts) >= 3 and parts[-1].isdigit():  # one series per parameter group
        return parts[-2]
    return parts[-1]


def group_tags(tags: list[str]) -> dict[str, list[str]]:
    """Sorts tags into panels: every loss together, accuracy-like metrics together, the
    learning rate, then one panel per remaining metric name (``grad_norm``, ``mse``, ...)
    with its series from every prefix (``train/mse`` beside ``val/mse``).

    Example:
        >>> tags = ["val/loss", "train/loss", "val/acc", "train/lr", "val/mse"]
        >>> for panel, tags in group_tags(tags).items():
        ...     print(panel, tags)
        loss ['train/loss', 'val/loss']
        accuracy ['val/acc']
        lr ['train/lr']
        mse ['val/mse']
    """
    panels: dict[str, list[str]] = {"loss": [], "accuracy": [], "lr": []}
    for tag in sorted(tags, key=lambda t: (not t.startswith("train/"), t)):
        metric = _metric(tag)
        if "loss" in metric.lower():
            panels["loss"].append(tag)
        elif _ACCURACY_LIKE.search(metric):
            panels["accuracy"].append(tag)
        elif metric == "lr":
            panels["lr"].append(tag)
        else:
            panels.setdefault(metric, []).append(tag)
    named = {k: v for k, v in panels.items() if k in _PANEL_TITLES and v}
    others = {k: panels[k] for k in sorted(panels) if k not in _PANEL_TITLES}
    return {**named, **others}


def _draw(ax: Axes, title: str, tags: list[str], scalars: Scalars) -> None:
    from matplotlib.ticker import MaxNLocator

    for tag in tags:
        points = sorted(scalars[tag], key=lambda p: p[0])
        steps = [s for s, _ in points]
        values = [v for _, v in points]
        ax.plot(
            steps, values, label=tag, marker="o" if len(points) <= 30 else None, markersize=3, linewidth=1.2
        )
    ax.set_title(title)
    ax.set_xlabel("iteration")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    if title == _PANEL_TITLES["lr"]:
        positive = [v for tag in tags for _, v in scalars[tag] if math.isfinite(v)]
        if positive and min(positive) > 0 and max(positive) / min(positive) > 50:
            ax.set_yscale("log")
    ax.legend(fontsize="small")


def find_log_dir(run_dir: Path) -> Path:
    """The folder of a run's event files: ``run_dir/tb``, else ``run_dir`` itself.

    Raises:
        FileNotFoundError: neither holds event files.
    """
    for folder in (run_dir / "tb", run_dir):
        if event_files(folder):
            return folder
    raise FileNotFoundError(
        f"unison plot: no TensorBoard event files in {run_dir / 'tb'} (nor in {run_dir}). Pass the run's "
        "folder (the one holding tb/), and log with unison.handlers.tensorboard.TensorBoardLogger "
        "(logging.tensorboard: true in a recipe's config)."
    )


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None) -> Path:
    """Draws a run's training and validation curves into a PNG.

    Reads the scalars of ``run_dir/tb`` (or of ``run_dir`` itself when it holds the event
    files) and draws one panel per family, against the trainer's iteration: every loss
    (``train/loss``, ``val/loss``, ...), the accuracy-like metrics, the learning rate, then
    one panel for each other metric.

    Args:
        run_dir: the run's folder.
        out: the PNG to write; default ``run_dir/curves.png``.

    Returns:
        The path of the PNG.

    Raises:
        ImportError: matplotlib is not installed (``pip install "unison[plot]"``).
        FileNotFoundError: no event files in ``run_dir/tb`` or ``run_dir``.
        ValueError: the event files hold no scalars.

    Example:
        .. code-block:: python

            from unison.cli.plot import plot_run

            print(plot_run("runs/digits"))  # runs/digits/curves.png
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            'unison plot needs matplotlib: pip install "unison[plot]" (or pip install matplotlib).'
        ) from err

    run_dir = Path(run_dir)
    log_dir = find_log_dir(run_dir)
    scalars = read_scalars(log_dir)
    if not scalars:
        raise ValueError(f"plot_run: the event files in {log_dir} hold no scalars; nothing to draw.")
    panels = group_tags(list(scalars))
    columns = min(3, len(panels))
    rows = math.ceil(len(panels) / columns)
    figure = Figure(figsize=(5.0 * columns, 3.6 * rows), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(rows, columns, squeeze=False)
    for ax, (name, tags) in zip(axes.flat, panels.items(), strict=False):
        _draw(ax, _PANEL_TITLES.get(name, name), tags, scalars)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    run_folder = (log_dir.parent if log_dir.name == "tb" else log_dir).resolve()
    figure.suptitle("/".join(run_folder.parts[-2:]))
    target = Path(out) if out is not None else run_dir / "curves.png"
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=100)
    return target
