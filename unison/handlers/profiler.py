"""A ``torch.profiler`` trace of a few training iterations, on every rank, for TensorBoard and Perfetto."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from ignite.engine import Engine, Events

from unison.distributed.primitives import get_rank
from unison.engine.closing import on_close

TRACE_FOLDER = ("plugins", "profile")
"""Where traces go inside the log dir: ``<log_dir>/plugins/profile/<session>/``."""


def _count(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(
            f"Profiler({name}={value!r}) must be an int >= {least} (iterations); e.g. Profiler(wait=1, "
            "warmup=1, active=3) skips one iteration, warms up on the next and records three."
        )
    return value


class Profiler:
    """Records a ``torch.profiler`` trace of a few training iterations on every rank.

    From the trainer's ``STARTED``, iterations are counted with ``torch.profiler``'s
    schedule: ``wait`` iterations are skipped, ``warmup`` are traced and thrown away (the
    profiler's own start-up cost), then ``active`` iterations are recorded, ``repeat``
    times over. Each rank then writes its trace, a Chrome-trace JSON file (what TensorBoard's
    PyTorch profiler view and https://ui.perfetto.dev open), to::

        <log_dir>/plugins/profile/iterations-<first>-<last>/rank<R>.<ns>.pt.trace.json[.gz]

    where ``first``-``last`` are the trainer iterations the window spans (the same folder
    on every rank, with no collective: it comes from the trainer's iteration, which every
    rank shares) and ``<ns>`` the writing time. CPU activity is recorded, and CUDA
    activity when CUDA is available.

    When the window is over the profiler stops and its per-iteration handler is removed:
    the rest of the run costs nothing more. A run that ends (or fails) inside the window
    writes what was recorded. Profiling changes no result: the trainer's computation is
    the same, only observed.

    Args:
        log_dir: the run's TensorBoard folder; traces go below it, as shown above.
        wait: iterations skipped before the warmup (>= 0).
        warmup: iterations traced and discarded before recording (>= 0).
        active: iterations recorded (>= 1).
        repeat: windows of ``wait + warmup + active`` recorded one after the other (>= 1).
        record_shapes: record the input shapes of operators (larger traces).
        profile_memory: record tensor allocations.
        with_stack: record the Python stack of operators (much larger traces).
        use_gzip: write ``.pt.trace.json.gz`` (about 10x smaller; both viewers open it).

    Example:
        >>> import tempfile, torch
        >>> from pathlib import Path
        >>> from unison.engine import create_trainer
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> trainer = create_trainer(model, opt, torch.nn.functional.mse_loss)
        >>> folder = Path(tempfile.mkdtemp())
        >>> Profiler(folder, wait=1, warmup=1, active=2).attach(trainer)
        >>> _ = trainer.run([(torch.ones(4, 2), torch.zeros(4, 1))] * 3, max_epochs=2)
        >>> [p.parent.name + "/" + p.name.split(".")[0] for p in folder.glob("plugins/profile/*/*")]
        ['iterations-3-4/rank0']

    Distributed:
        Build and attach it on every rank, with the same arguments: every rank records its
        own trace (named by its rank) into the same folder. It issues no collective; the
        trace itself is written at the end of the window, by each rank on its own.
    """

    def __init__(
        self,
        log_dir: str | os.PathLike[str],
        *,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        repeat: int = 1,
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
        use_gzip: bool = False,
    ) -> None:
        if not isinstance(log_dir, (str, os.PathLike)) or not str(log_dir):
            raise TypeError(f"Profiler(log_dir={log_dir!r}) must be a folder path (str or Path).")
        self.log_dir = Path(log_dir)
        self.wait = _count("wait", wait, 0)
        self.warmup = _count("warmup", warmup, 0)
        self.active = _count("active", active, 1)
        self.repeat = _count("repeat", repeat, 1)
        self.record_shapes = bool(record_shapes)
        self.profile_memory = bool(profile_memory)
        self.with_stack = bool(with_stack)
        self.use_gzip = bool(use_gzip)
        self.folder: Path | None = None
        """The folder of this run's traces, once the trainer has started."""
        self._profile: torch.profiler.profile | None = None
        self._engine: Engine | None = None

    @property
    def steps(self) -> int:
        """Iterations from the start to the end of the last window."""
        return (self.wait + self.warmup + self.active) * self.repeat

    @property
    def running(self) -> bool:
        """Whether the profiler is started and its window not yet over."""
        return self._profile is not None

    # -- events -------------------------------------------------------------------------

    def _start(self, engine: Engine) -> None:
        self._finish()  # a run started again in this process starts a new window
        first = engine.state.iteration + 1  # the first iteration counted
        window = (first + self.wait + self.warmup, first + self.steps - 1)
        self.folder = self.log_dir.joinpath(*TRACE_FOLDER, f"iterations-{window[0]}-{window[1]}")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profile = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=self.wait, warmup=self.warmup, active=self.active, repeat=self.repeat
            ),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(self.folder), worker_name=f"rank{get_rank()}", use_gzip=self.use_gzip
            ),
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        profile.__enter__()
        self._profile = profile
        self._engine = engine
        engine.add_event_handler(Events.ITERATION_COMPLETED, self._step)

    def _step(self, _: Engine) -> None:
        profile = self._profile
        if profile is None:
            return
        profile.step()
        if profile.step_num >= self.steps:
            self._finish()

    def _finish(self, *_: Any) -> None:
        """Stops the profiler (a window cut short writes what it recorded) and removes the
        per-iteration handler. Idempotent."""
        profile, engine = self._profile, self._engine
        self._profile = self._engine = None
        if engine is not None and engine.has_event_handler(self._step, Events.ITERATION_COMPLETED):
            engine.remove_event_handler(self._step, Events.ITERATION_COMPLETED)
        if profile is not None:
            profile.__exit__(None, None, None)

    def attach(self, engine: Engine) -> None:
        """Registers on the trainer; attaching twice has no effect."""
        if not isinstance(engine, Engine):
            raise TypeError(f"Profiler.attach(engine) needs an Engine, got {type(engine).__name__}.")
        if engine.has_event_handler(self._start, Events.STARTED):
            return
        engine.add_event_handler(Events.STARTED, self._start)
        on_close(engine, self._finish)  # a failed run's error is never hidden by a trace not written
