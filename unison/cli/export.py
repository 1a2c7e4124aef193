"""``unison export``: a run's weights as one plain ``state_dict`` file, for inference.

The checkpoint is picked from the run's ``checkpoints/`` (the best by its recorded score,
the newest whole one, or a path), read in this process whatever its kind
(:class:`~unison.checkpoint.consolidate.CheckpointReader`: a file, or a sharded folder
put together), and written with ``torch.save`` as a dict of tensors whose keys are the
plain model class's: ``model.load_state_dict(torch.load(path, weights_only=True))``; or,
with ``format="safetensors"``, as a safetensors file carrying the run's config and final
metrics (:mod:`unison.cli.export_formats`).

The run folder is only read: its manifest is not rebuilt and nothing in it is removed, so
a run that is still training can be exported.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.consolidate import CheckpointReader, checkpoint_problem
from unison.checkpoint.entry import Entry, file_in
from unison.checkpoint.io import CheckpointError, atomic_save, load_checkpoint
from unison.checkpoint.manifest import MANIFEST, read_entries
from unison.checkpoint.retention import best_entry, has_score, oldest_first
from unison.cli.export_formats import FORMATS, SUFFIXES, FormatError, run_metadata, save_safetensors
from unison.utils.logging import get_logger

_log = get_logger(__name__)

_NAME = re.compile(r"^.+-e(?P<epoch>\d+)-i(?P<iteration>\d+)\.(pt|dcp)$")
_RUN = "a run folder (runs/<name>/<timestamp>) holding checkpoints/"


class ExportError(ValueError):
    """An argument of ``unison export`` that names nothing to export: exit status 2."""


@dataclass
class Exported:
    """What :func:`export_weights` wrote, and from where."""

    out: Path
    source: Path
    which: str
    meta: dict[str, Any]
    tensors: int
    values: int
    size: int
    ema: bool = False


def run_folder(run_dir: str | Path) -> Path:
    """The run folder ``run_dir`` names (its ``checkpoints/`` folder is taken for the run).

    Raises:
        ExportError: for a path that does not exist, or a folder without ``checkpoints/``.
    """
    path = Path(run_dir)
    if not path.exists():
        raise ExportError(f"RUN_DIR {run_dir}: no such folder. Expected {_RUN}; check the path.")
    if not path.is_dir():
        raise ExportError(
            f"RUN_DIR {run_dir}: this is a file, not a folder. Expected {_RUN}. To export a checkpoint "
            f"file, give its run folder and the file: unison export <run folder> --checkpoint {run_dir}"
        )
    if path.name == "checkpoints" and not (path / "checkpoints").is_dir():
        path = path.parent
    if not (path / "checkpoints").is_dir():
        raise ExportError(
            f"RUN_DIR {run_dir}: not a unison run folder (it holds no checkpoints/ folder). Expected {_RUN}; "
            "`unison run` prints the run directory when it ends."
        )
    return path


def listed_checkpoints(folder: Path) -> list[Entry]:
    """The checkpoints in ``folder``, oldest first, read without changing anything there.

    The manifest's entries whose file or folder exists, and checkpoints on disk that it
    does not record (a crash before the manifest was written) when they are whole. A
    manifest entry naming a path outside ``folder`` raises :class:`CheckpointError`.
    """
    entries: dict[str, Entry] = {}
    manifest = folder / MANIFEST
    if manifest.is_file():
        try:
            recorded = read_entries(manifest)
        except (OSError, ValueError) as err:
            _log.warning(
                "%s is unreadable (%s); looking at the checkpoints in the folder instead.", manifest, err
            )
            recorded = []
        for entry in recorded:
            if file_in(folder, entry.file, source=str(manifest)).exists():
                entries[entry.file] = entry
    for path in sorted(folder.iterdir()):
        match = _NAME.match(path.name)
        if match is None or path.name in entries or checkpoint_problem(path) is not None:
            continue
        try:
            meta = load_checkpoint(path / "rest.pt" if path.is_dir() else path).get("meta", {})
        except CheckpointError:
            continue
        sequence = meta.get("sequence")
        entries[path.name] = Entry(
            file=path.name,
            epoch=int(match.group("epoch")),
            iteration=int(match.group("iteration")),
            score=meta.get("score"),
            saved_at=path.stat().st_mtime,
            sequence=sequence if isinstance(sequence, int) else None,
        )
    return oldest_first(list(entries.values()))


def ranking_mode(run: Path, mode: str | None) -> str:
    """Whether higher (``"max"``) or lower scores are better: ``mode``, else the run's ``checkpoint.mode``."""
    if mode is not None:
        return mode
    config = run / "config.yaml"
    if config.is_file():
        from unison.config import ConfigError, load_config
        from unison.config.watched import watched_of

        try:
            return watched_of(load_config(config)).mode
        except (ConfigError, OSError) as err:
            _log.warning(
                "Could not read checkpoint.mode from %s (%s); taking higher scores as better.", config, err
            )
    else:
        _log.warning("%s has no config.yaml: taking higher scores as better (--mode min for a loss).", run)
    return "max"


def choose_checkpoint(run: Path, which: str, *, mode: str | None = None) -> tuple[Path, str]:
    """The checkpoint ``which`` names in ``run``, and how it was chosen (``best``, ``last`` or ``path``).

    ``best``: the best recorded score (``mode``, else the run's ``checkpoint.mode``); the
    newest when no checkpoint has a score. ``last``: the newest whole checkpoint, passing
    damaged newer ones with a warning. Anything else is a path: a checkpoint file or a
    sharded folder, or the name of one in ``run/checkpoints``.

    Raises:
        ExportError: for a path that does not exist, or a run without checkpoints.
        CheckpointError: when the best checkpoint, or every one, is damaged.
    """
    folder = run / "checkpoints"
    if which not in ("best", "last"):
        return _given(which, folder), "path"
    entries = listed_checkpoints(folder)
    if not entries:
        raise ExportError(
            f"RUN_DIR {run}: its checkpoints/ holds no checkpoint (the run saved none yet: checkpoint.enabled "
            "false, or stopped before its first save). Export a run that saved one, or give --checkpoint PATH."
        )
    if which == "best":
        scored = [entry for entry in entries if has_score(entry)]
        best = best_entry(scored, "min" if ranking_mode(run, mode) == "min" else "max") if scored else None
        if best is not None:
            path = file_in(folder, best.file, source=str(folder / MANIFEST))
            problem = checkpoint_problem(path)
            if problem is not None:
                raise CheckpointError(
                    f"The best checkpoint {path} cannot be read: {problem}. Export another one: --checkpoint last "
                    "(the newest whole one), or --checkpoint PATH."
                )
            return path, "best"
        _log.info("No checkpoint in %s has a score (no validation metric): exporting the last one.", folder)
    for entry in reversed(entries):
        path = file_in(folder, entry.file, source=str(folder / MANIFEST))
        problem = checkpoint_problem(path)
        if problem is None:
            return path, "last"
        _log.warning("Checkpoint %s is damaged (%s); falling back to an older one.", path, problem)
    raise CheckpointError(
        f"Every checkpoint in {folder} is damaged ({len(entries)} tried; the warnings above say how). "
        "Restore one from a copy, or train again."
    )


def _given(value: str, folder: Path) -> Path:
    expected = (
        "'best', 'last', a checkpoint file (<name>.pt) or a sharded checkpoint folder (<name>.dcp), "
        f"a path or a name in {folder}"
    )
    if not value:
        raise ExportError(f"--checkpoint '': expected {expected}.")
    path = Path(value)
    if not path.exists() and Path(value).name == value and "\\" not in value and value not in (".", ".."):
        path = file_in(folder, value, source="--checkpoint")
    if not path.exists():
        raise ExportError(f"--checkpoint {value}: no such file or folder. Expected {expected}.")
    return path


def output_path(run: Path, out: str | None, *, ema: bool, force: bool, format: str = "pt") -> Path:
    """Where to write: ``out``, else ``<run>/model.pt`` (``model-ema.pt`` with ``ema``; ``.safetensors``
    for that ``format``).

    Raises:
        ExportError: for an existing file without ``force``, a folder, or a path inside the
            run's ``checkpoints/`` (which holds checkpoints only).
    """
    target = Path(out) if out else run / (("model-ema" if ema else "model") + SUFFIXES[format])
    shown = f"--out {out}" if out else f"the output {target} (the default)"
    if target.is_dir():
        raise ExportError(f"{shown}: this is a folder. Expected a file path, e.g. {target / 'model.pt'}.")
    if _in_checkpoints(target, run):
        raise ExportError(
            f"{shown}: this is inside the run's checkpoints/ folder, which holds checkpoints only (a weights file "
            f"there would be taken for one). Write it elsewhere, e.g. --out {run / target.name}."
        )
    if target.exists() and not force:
        raise ExportError(f"{shown}: the file exists. Give --force to replace it, or another --out.")
    return target


def _in_checkpoints(target: Path, run: Path) -> bool:
    """Whether ``target`` (symbolic links resolved) lies anywhere inside ``run``'s ``checkpoints/``, or inside
    the ``checkpoints/`` of any run folder (one holding a checkpoint manifest): inside a checkpoint's own folder
    included."""
    resolved = target.resolve()
    if resolved.is_relative_to((run / "checkpoints").resolve()):
        return True
    return any(folder.name == "checkpoints" and (folder / MANIFEST).is_file() for folder in resolved.parents)


def export_weights(
    run_dir: str | Path,
    *,
    checkpoint: str = "best",
    out: str | None = None,
    ema: bool = False,
    force: bool = False,
    mode: str | None = None,
    format: str = "pt",
) -> Exported:
    """Writes the weights of one checkpoint of a run as a plain ``state_dict`` file.

    Args:
        run_dir: the run folder (``runs/<name>/<timestamp>``).
        checkpoint: ``"best"``, ``"last"``, or a checkpoint file or sharded folder (see
            :func:`choose_checkpoint`).
        out: the file to write; default ``<run_dir>/model.pt`` (``model-ema.pt`` with ``ema``).
        ema: write the EMA average of the weights instead of the trained ones.
        force: replace ``out`` when it exists.
        mode: ``"max"`` or ``"min"``: how ``best`` ranks scores; default the run's ``checkpoint.mode``.
        format: ``"pt"`` (``torch.save``) or ``"safetensors"`` (with the run's config and final
            metrics as metadata; tied weights stored once: see :mod:`unison.cli.export_formats`).

    Returns:
        What was written, and from which checkpoint.

    Raises:
        ExportError: for an argument that names nothing to export (exit status 2).
        CheckpointError: for a checkpoint that cannot be read, naming it and what is wrong.

    Example:
        .. code-block:: console

            $ unison export runs/mnist/20250101-120000 --checkpoint last --out mnist.pt
    """
    if format not in FORMATS:
        raise ExportError(f"--format {format}: expected one of {', '.join(FORMATS)}.")
    run = run_folder(run_dir)
    target = output_path(run, out, ema=ema, force=force, format=format)
    source, which = choose_checkpoint(run, checkpoint, mode=mode)
    if target.resolve() == source.resolve():
        raise ExportError(f"--out {out}: this is the checkpoint being exported. Write the weights elsewhere.")
    reader = CheckpointReader(source)
    meta = reader.meta  # a damaged checkpoint raises here, naming what is wrong
    if ema:
        try:
            reader.ema_name()
        except CheckpointError as err:
            raise ExportError(f"--ema: {err}") from err
    weights = reader.weights(ema=ema)
    written: dict[str, Any] = weights
    if format == "safetensors":
        try:
            written = save_safetensors(weights, target, run_metadata(run, meta))  # tied weights once
        except FormatError as err:
            raise ExportError(str(err)) from err
    else:
        atomic_save(weights, target)
    tensors = [value for value in written.values() if isinstance(value, torch.Tensor)]
    return Exported(
        out=target,
        source=source,
        which=which,
        meta=meta,
        tensors=len(tensors),
        values=sum(t.numel() for t in tensors),
        size=target.stat().st_size,
        ema=ema,
    )


def _size(n: int) -> str:
    """``n`` bytes for people: ``512 B``, ``3.2 KiB``, ``41.0 MiB``."""
    if n < 1024:
        return f"{n} B"
    scaled, unit = n / 1024, "KiB"
    for bigger in ("MiB", "GiB", "TiB"):
        if scaled < 1024:
            break
        scaled, unit = scaled / 1024, bigger
    return f"{scaled:.1f} {unit}"


def summary_line(done: Exported) -> str:
    """One line: what was written (tensors, values, size) and which checkpoint it came from."""
    meta = done.meta
    where = f"epoch {meta.get('epoch', '?')}, iteration {meta.get('iteration', '?')}"
    if meta.get("score") is not None:
        where += f", {meta.get('metric') or 'score'} {meta['score']:.6g}"
    what = "the EMA average of the weights" if done.ema else "the weights"
    kind = {"best": "the best checkpoint", "last": "the last checkpoint", "path": "checkpoint"}[done.which]
    return (
        f"exported {done.out}: {done.tensors} tensors, {done.values:,} values, {_size(done.size)}; "
        f"{what} of {kind} {done.source} ({where})"
    )


def run_export(
    run_dir: str,
    *,
    checkpoint: str = "best",
    out: str | None = None,
    ema: bool = False,
    force: bool = False,
    mode: str | None = None,
    debug: bool = False,
    format: str = "pt",
) -> int:
    """``unison export``: :func:`export_weights`, then its summary line; returns the exit status.

    0 when written; 2 for an argument that names nothing to export; 1 for a checkpoint that
    cannot be read. The message names the argument or path, what was expected and the fix.
    """
    from unison.utils.logging import setup_logging

    setup_logging()  # the fallbacks' warnings, on stderr
    try:
        done = export_weights(
            run_dir, checkpoint=checkpoint, out=out, ema=ema, force=force, mode=mode, format=format
        )
    except (ExportError, CheckpointError) as err:
        if debug:
            raise
        print(f"unison export: {err}", file=sys.stderr)
        return 2 if isinstance(err, ExportError) else 1
    print(summary_line(done))
    return 0
