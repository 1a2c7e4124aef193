"""The end of a sweep: the best trial's config as ``best.yaml``, and the summary ``unison tune`` prints."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from unison.config import dump_config, load_config
from unison.config.main_script import script
from unison.recipe.sweep.space import SweepPlan, as_overrides
from unison.utils import get_logger

_log = get_logger("unison.recipe.sweep.study")


def run_command(config: Path, nproc: int | None) -> str:
    """The ``unison run`` command that trains ``config`` as the sweep trained its trials (with the
    sweep's ``--main`` script, when it had one)."""
    main = script()
    return (
        f"unison run {config}"
        + (f" --nproc {nproc}" if nproc is not None else "")
        + (f" --main {main}" if main is not None else "")
    )


def _drawable(value: Any, spec: dict[str, Any]) -> bool:
    """Whether the search-space entry ``spec`` can draw ``value``."""
    if spec["type"] == "categorical":
        return any(type(value) is type(c) and value == c for c in spec["choices"])
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if spec["type"] == "int" and not isinstance(value, int):
        return False
    return bool(spec["low"] <= value <= spec["high"])


def best_values(params: dict[str, Any], plan: SweepPlan) -> dict[str, Any]:
    """The best trial's values to apply: the keys of the search space only, each a value its entry
    can draw. A study is data from a storage (shared, or written by an older config): a name
    outside the search space (``training.path``, a key with ``=`` or a newline) is left out with a
    warning, and a value the entry cannot draw is refused.

    Raises:
        ConfigError: naming ``tuning.search_space.<key>``, the value, and the trial.
    """
    out = {}
    for key, value in params.items():
        spec = plan.space.get(key)
        if spec is None:
            _log.warning(
                "best.yaml: the best trial holds a value of %r, which is not a key of the search space; left out",
                key,
            )
            continue
        if not _drawable(value, spec):
            raise plan.refs.origin.error(
                ("tuning", "search_space", key),
                f"the study's best trial holds {key} = {value!r}, which this search space cannot draw ({spec}); "
                "was the study made with another config? Give another tuning.study_name for this search space",
            )
        out[key] = value
    return out


def write_best(study: Any, plan: SweepPlan, nproc: int | None = None) -> Path | None:
    """Writes the best trial's config to ``<sweep folder>/best.yaml``; None without a complete trial.

    The file is the tuned config (with the sweep's ``--set`` overrides) plus the best values.
    Modules beside the tuned config are linked into the sweep folder, so that the references
    to them resolve from there as they did from the config's own folder.
    """
    try:
        best = study.best_trial
    except ValueError:
        return None
    sets = as_overrides(best_values(best.params, plan))
    config = load_config(plan.path, [*plan.overrides, *sets])
    header = [
        f"# The best trial of study {plan.study_name!r} (trial {best.number}: {plan.metric} {best.value:.6g}, "
        f"{plan.direction}), written by unison tune from {plan.path}",
        *(f"#   --set {item}" for item in sets),
        f"# Run it: {run_command(plan.folder / 'best.yaml', nproc)}",
    ]
    path = plan.folder / "best.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    tmp.write_text("\n".join(header) + "\n" + dump_config(config))
    os.replace(tmp, path)
    _link_modules(Path(plan.path).resolve().parent, plan.folder)
    return path


def _link_modules(config_dir: Path, folder: Path) -> None:
    """Links the modules (``*.py``, packages) beside the tuned config into ``folder``."""
    if config_dir == folder.resolve():
        return
    for entry in sorted(config_dir.iterdir()):
        module = (entry.suffix == ".py" and entry.is_file()) or (entry / "__init__.py").is_file()
        target = folder / entry.name
        if not module or target.exists() or target.is_symlink():
            continue
        try:
            target.symlink_to(entry)
        except OSError as err:
            _log.warning(
                "could not link %s into %s (%s): run best.yaml from a copy beside %s instead",
                entry,
                folder,
                err,
                config_dir,
            )
            return


def summary_lines(summary: dict[str, Any]) -> list[str]:
    """What ``unison tune`` prints at the end: the study, its trials, the best trial and its config."""
    states = ", ".join(f"{v} {k}" for k, v in sorted(summary["counts"].items()))
    lines = [f"study {summary['study']!r} ({summary['storage']}): {states}"]
    best = summary["best"]
    if best is None:
        return [*lines, "no trial has completed yet: no best config"]
    lines.append(
        f"best trial: {best['number']} ({summary['metric']} {best['value']:.6g}, {summary['direction']})"
    )
    lines += [f"  {key}: {value!r}" for key, value in best["params"].items()]
    lines.append(f"best config: {best['config']}  ({best['command']})")
    return lines
