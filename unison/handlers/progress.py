"""A tqdm progress bar on rank 0."""

from __future__ import annotations

import sys
from typing import Any, TextIO

from ignite.engine import Engine, Events

from unison.distributed.primitives import get_rank
from unison.engine.closing import on_close


class ProgressBar:
    """Shows the iterations of each epoch in a tqdm bar, on rank 0 only.

    Other ranks attach it too (every rank attaches every handler) but draw nothing. The
    bar reads only counters: it never reads the loss from the device, so it adds no host
    synchronisation. At the epoch's end it shows the values in ``engine.state.metrics``
    (agreed by all ranks at the sync point).

    Args:
        desc: the label before the bar; ``{epoch}`` is replaced by the epoch.
        file: where to draw; default stderr.
        disable: draw nothing on any rank.
        leave: keep each epoch's finished bar on screen.

    Distributed:
        Attach it on every rank; only rank 0 writes.
    """

    def __init__(
        self,
        desc: str = "epoch {epoch}",
        file: TextIO | None = None,
        disable: bool = False,
        leave: bool = True,
    ) -> None:
        self.desc = desc
        self.file = file
        self.disable = disable
        self.leave = leave
        self._bar: Any = None

    def _active(self) -> bool:
        return not self.disable and get_rank() == 0

    def _open(self, engine: Engine) -> None:
        if not self._active():
            return
        from tqdm.auto import tqdm

        self._close(engine)
        self._bar = tqdm(
            total=engine.state.epoch_length,
            desc=self.desc.format(epoch=engine.state.epoch),
            file=self.file or sys.stderr,
            leave=self.leave,
            dynamic_ncols=True,
        )

    def _advance(self, engine: Engine) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def _finish(self, engine: Engine) -> None:
        if self._bar is not None:
            shown = {k: v for k, v in engine.state.metrics.items() if isinstance(v, float)}
            if shown:
                self._bar.set_postfix({k: f"{v:.4g}" for k, v in shown.items()}, refresh=False)
        self._close(engine)

    def _close(self, *_: object) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def attach(self, engine: Engine) -> None:
        """Registers on ``engine``; attaching twice has no effect."""
        if engine.has_event_handler(self._open, Events.EPOCH_STARTED):
            return
        engine.add_event_handler(Events.EPOCH_STARTED, self._open)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._advance)
        engine.add_event_handler(Events.EPOCH_COMPLETED, self._finish)
        on_close(engine, self._close)
