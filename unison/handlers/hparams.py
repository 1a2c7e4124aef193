"""A run's settings in TensorBoard's HParams dashboard, written by rank 0 when the run ends."""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping
from pathlib import Path

from ignite.engine import Engine, Events

from unison.distributed.primitives import get_rank
from unison.engine.closing import How, on_close
from unison.handlers.trainer_guard import own_trainer
from unison.utils.secrets import redact_url

HParamValue = bool | int | float | str
"""What an hparam can hold: TensorBoard's HParams dashboard shows numbers, booleans and strings."""

PLUGIN_NAME = "hparams"
START_TAG = "_hparams_/session_start_info"
END_TAG = "_hparams_/session_end_info"
STATUS_SUCCESS = "STATUS_SUCCESS"
STATUS_FAILURE = "STATUS_FAILURE"


class HParamsLogger:
    """Writes a run's settings into its TensorBoard folder for the HParams dashboard (rank 0).

    TensorBoard lists each folder holding a *session* as one row of its HParams table: the
    hparams as columns, and as metrics the last value of every scalar in that folder. With
    a :class:`~unison.handlers.TensorBoardLogger` writing to the same ``log_dir``, the
    metrics are the run's final ``train/loss`` and its last ``val/<metric>`` values.

    When the trainer's run ends (:mod:`unison.engine.closing`: completed, stopped by early
    stopping, a time limit, pruning or preemption, or failed), rank 0 writes one small event
    file to ``log_dir`` with the session's start (the hparams, and when the run started) and its
    end (status and time: ``STATUS_SUCCESS``, or ``STATUS_FAILURE`` when the run raised), once
    per run.

    No experiment summary is written, on purpose: TensorBoard then builds the table from
    every session it finds under its log dir, so the trials of a sweep (each writing its
    own) line up in one table when TensorBoard is pointed at the sweep's folder. A resumed
    run writes a new session into the same folder; TensorBoard shows the latest.

    Args:
        log_dir: the run's TensorBoard folder (where its scalars are).
        hparams: name -> number, bool or str. ``None`` values are left out; NaN and
            infinities are written as strings (TensorBoard's numbers are finite); a URL's
            credentials in a string are masked (:func:`~unison.utils.secrets.redact_url`).
        trainer: the training engine.

    Example:
        >>> import tempfile, torch
        >>> from unison.engine import create_trainer
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> trainer = create_trainer(model, opt, torch.nn.functional.mse_loss)
        >>> folder = tempfile.mkdtemp()
        >>> HParamsLogger(folder, {"training.lr": 0.1, "model": "Linear"}, trainer=trainer).attach()
        >>> _ = trainer.run([(torch.ones(4, 2), torch.zeros(4, 1))] * 3, max_epochs=2)
        >>> from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        >>> sorted(EventAccumulator(folder).Reload().PluginTagToContent("hparams"))
        ['_hparams_/session_end_info', '_hparams_/session_start_info']

    Distributed:
        Build and attach it on every rank, with the same arguments. Only rank 0 creates
        ``log_dir`` and writes to it. It issues no collective and does nothing per iteration.
    """

    def __init__(
        self, log_dir: str | os.PathLike[str], hparams: Mapping[str, HParamValue | None], *, trainer: Engine
    ) -> None:
        if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
            raise TypeError(f"HParamsLogger(log_dir={log_dir!r}) must be a folder path (str or Path).")
        if not isinstance(trainer, Engine):
            raise TypeError(
                f"HParamsLogger(trainer=...) needs an Engine (from unison.engine.create_trainer), "
                f"got {type(trainer).__name__}."
            )
        if not isinstance(hparams, Mapping):
            raise TypeError(
                f"HParamsLogger(hparams=...) takes a mapping name -> value, got {type(hparams).__name__}."
            )
        kept: dict[str, HParamValue] = {}
        for name, value in hparams.items():
            if not isinstance(name, str) or not name:
                raise ValueError(
                    f"HParamsLogger(hparams=...): each name must be a non-empty str, got {name!r}."
                )
            if value is None:
                continue
            if not isinstance(value, (bool, int, float, str)):
                raise TypeError(
                    f"HParamsLogger(hparams={{{name!r}: {value!r}}}): a value must be a number, bool or str "
                    f"(TensorBoard's hparam types), got {type(value).__name__}; pass str(value) to show it."
                )
            kept[name] = redact_url(value) if isinstance(value, str) else value  # no URL credentials
        self.log_dir = Path(log_dir)
        self.hparams = kept
        self.trainer = trainer
        self._started = time.time()
        self._written = False

    # -- events -------------------------------------------------------------------------

    def _on_started(self, _: Engine) -> None:
        self._started = time.time()
        self._written = False

    def _closed(self, how: How) -> None:
        self.write(STATUS_FAILURE if how == "failed" else STATUS_SUCCESS)

    def attach(self, engine: Engine | None = None) -> None:
        """Registers on the trainer (``engine``, default the constructor's); twice has no effect.

        Raises:
            ValueError: ``engine`` is not the logger's trainer.
        """
        trainer = own_trainer("HParamsLogger", self.trainer, engine)
        if trainer.has_event_handler(self._on_started, Events.STARTED):
            return
        trainer.add_event_handler(Events.STARTED, self._on_started)
        on_close(trainer, self._closed)

    # -- the file (rank 0 only) ---------------------------------------------------------

    def write(self, status: str = STATUS_SUCCESS) -> Path | None:
        """Writes the session (hparams, start, end with ``status``) once per run, on rank 0.

        Returns:
            The event file written; None on other ranks, or when this run wrote already.
        """
        if self._written or get_rank() != 0:
            return None
        self._written = True
        from tensorboardX import SummaryWriter

        from unison.utils.event_files import event_files  # tensorboardX's protobufs: on first use only

        start, end = session_summaries(self.hparams, status, self._started, time.time())
        before = set(event_files(self.log_dir))
        # A name of its own: tensorboardX names files by the second and truncates an existing
        # one, such as the scalars' file when its writer closed in the same second.
        writer = SummaryWriter(str(self.log_dir), filename_suffix=f".hparams.{time.time_ns()}")
        try:
            writer.file_writer.add_summary(start)
            writer.file_writer.add_summary(end)
        finally:
            writer.close()
        made = [p for p in event_files(self.log_dir) if p not in before]
        return made[-1] if made else None


def session_summaries(hparams: Mapping[str, HParamValue], status: str, started: float, ended: float) -> tuple:
    """The two ``Summary`` protos of an HParams session: its start (hparams) and its end (status).

    They follow the hparams plugin's data format (``tensorboard.plugins.hparams``: plugin
    name ``hparams``, a ``HParamsPluginData`` of version 0 as the metadata's content), built
    with tensorboardX's copies of its protos, so writing needs no TensorBoard installed.
    """
    from tensorboardX.proto.api_pb2 import Status
    from tensorboardX.proto.plugin_hparams_pb2 import HParamsPluginData, SessionEndInfo, SessionStartInfo
    from tensorboardX.proto.summary_pb2 import Summary, SummaryMetadata

    start_info = SessionStartInfo(start_time_secs=started)
    for name, value in hparams.items():
        slot = start_info.hparams[name]
        if isinstance(value, bool):
            slot.bool_value = value
        elif isinstance(value, (int, float)) and math.isfinite(value):
            slot.number_value = float(value)
        else:
            slot.string_value = str(value)
    end_info = SessionEndInfo(status=Status.Value(status), end_time_secs=ended)

    def summary(tag: str, data: HParamsPluginData) -> Summary:
        plugin = SummaryMetadata.PluginData(plugin_name=PLUGIN_NAME, content=data.SerializeToString())
        return Summary(value=[Summary.Value(tag=tag, metadata=SummaryMetadata(plugin_data=plugin))])

    return (
        summary(START_TAG, HParamsPluginData(version=0, session_start_info=start_info)),
        summary(END_TAG, HParamsPluginData(version=0, session_end_info=end_info)),
    )
