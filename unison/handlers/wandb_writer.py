"""What :class:`~unison.handlers.wandb.WandbLogger` does with a W&B run, on rank 0 only.

:class:`RunWriter`, the thread that writes to the run (so training never waits on W&B), and
the run's record in the run folder (:func:`read_record`, :func:`write_record`), which a
resumed run reads to continue the same W&B run.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from unison.handlers.queued_writer import QueuedWriter
from unison.handlers.wandb_files import RUN_ID
from unison.utils import get_logger
from unison.utils.run_files import read_bytes, replace_file

_log = get_logger("unison.handlers.wandb")

Checkpoint = tuple[Path, Mapping[str, Any]]
"""A checkpoint's file (or sharded folder) and what its manifest entry says of it."""


def read_record(run_file: Path) -> dict[str, Any]:
    """The record :func:`write_record` left in ``run_file``: the W&B run's ``id``, ``project`` and
    ``entity``; empty when there is none. A record that is not one (not JSON, an id W&B would not
    make, a project or entity that is not a name: a file from elsewhere) is ignored with a warning
    naming it: a new W&B run is started. Nothing else in it is read."""
    try:
        record = json.loads(read_bytes(run_file, limit=2**16))  # never through a link, nor a FIFO
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        _log.warning("W&B: %s is not a W&B run's record (%s); a new W&B run is started", run_file, err)
        return {}
    names = isinstance(record, dict) and all(
        record.get(key) is None or isinstance(record.get(key), str) for key in ("project", "entity")
    )
    if not names or not isinstance(record.get("id"), str) or not RUN_ID.fullmatch(record["id"]):
        _log.warning(
            "W&B: %s does not hold a W&B run's id, project and entity (an id of letters, digits, '-' and "
            "'_'); a new W&B run is started",
            run_file,
        )
        return {}
    return {key: record.get(key) for key in ("id", "project", "entity")}


def write_record(run_file: Path, record: Mapping[str, Any]) -> None:
    """Writes ``record`` (the run's id, project and entity) to ``run_file`` atomically."""
    replace_file(run_file, (json.dumps(dict(record), sort_keys=True) + "\n").encode(), sync=False)


class RunWriter(QueuedWriter):
    """Rank 0's writes to one W&B run, made in order by a thread of their own
    (:class:`~unison.handlers.queued_writer.QueuedWriter`).

    The training thread hands over batches of points (:meth:`points`) and the run's end
    (:meth:`finish`, which waits for everything handed over). ``wandb.log`` hands each row to
    W&B's own service process and can block when that process is busy: here it blocks this
    thread, never training. A step at or below the last one the run holds (a resumed run
    replaying what the run before it logged past its checkpoint) is skipped: W&B keeps one row
    per step, in increasing order.

    Args:
        run: the open ``wandb`` run; only this writer's thread uses it from now on.
        last_step: the last step the run holds (-1 for a new run).
    """

    def __init__(self, run: Any, last_step: int) -> None:
        self.run = run
        self.last_step = last_step
        super().__init__("W&B", str(run.id), "unison.handlers.wandb")

    def points(self, points: Mapping[int, Mapping[str, float]]) -> None:
        """Queues ``{step: {name: value}}`` for the run; returns at once."""
        self._queue_write(points)

    def finish(self, status: str, checkpoint: Checkpoint | None = None, timeout: float = 600.0) -> bool:
        """Queues the checkpoint's record and the run's end with ``status``, then waits up to
        ``timeout`` seconds for all queued writes; whether everything was done in time (else a
        warning says what is left)."""
        return self._queue_end(status, checkpoint, timeout)

    def _write(self, points: Mapping[int, Mapping[str, float]]) -> None:
        for step in sorted(points):
            if step > self.last_step:
                self.run.log(dict(points[step]), step=step)
                self.last_step = step

    def _end(self, status: str, checkpoint: Checkpoint | None) -> None:
        if checkpoint is not None:
            try:
                self._log_checkpoint(*checkpoint)
            except Exception as err:  # the run still ends
                _log.warning(
                    "W&B: run %s: checkpoint not recorded: %s: %s", self.run.id, type(err).__name__, err
                )
        if status == "KILLED":
            self.run.mark_preempting()  # stopped to be resumed: W&B shows it preempted
        self.run.finish(exit_code=0 if status == "FINISHED" else 1)
        _stop_service()

    def _log_checkpoint(self, path: Path, entry: Mapping[str, Any]) -> None:
        """The checkpoint as a reference artifact (its path and entry, no copy of its bytes) and
        in the run's summary."""
        import wandb

        self.run.summary.update(
            {"checkpoint/path": str(path), **{f"checkpoint/{k}": v for k, v in entry.items()}}
        )
        artifact = wandb.Artifact(f"checkpoint-{self.run.id}", type="model", metadata=dict(entry))
        artifact.add_reference(path.resolve().as_uri(), name=path.name, checksum=False)
        self.run.log_artifact(artifact, aliases=["latest", f"iteration-{entry.get('iteration', 0)}"])


def _stop_service() -> None:
    """Stops W&B's service process once no run of this process is open. W&B stops it at exit,
    but a rank's process ends without running exit handlers (``multiprocessing`` leaves through
    ``os._exit``), and the service, which holds the launcher's output open, would linger."""
    import wandb

    teardown = getattr(wandb, "teardown", None)
    if wandb.run is None and callable(teardown):
        teardown()
