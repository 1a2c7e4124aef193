"""What stops or watches a run, on each rank: early stopping, the non-finite guard, the time
limit and the hang watchdog; each stop is agreed by every rank at a sync point."""

from __future__ import annotations

from pathlib import Path

from unison.handlers import NonFiniteGuard, TimeLimit, Watchdog
from unison.recipe.build.parts import RunParts
from unison.recipe.planning.early_stop import make_early_stopping
from unison.recipe.planning.run_plan import RunPlan


def attach_early_stopping(plan: RunPlan, parts: RunParts, run_dir: Path) -> None:
    """Early stopping, when ``early_stopping.patience`` is set (``early_stopping.type``, default
    unison's ``EarlyStopping``), on the evaluator; its state joins the checkpoint's
    (``parts.early_stopping``)."""
    stopper = make_early_stopping(plan.early_stopping, parts.trainer)
    if stopper is not None:
        stopper.attach(parts.evaluator)
        parts.early_stopping = stopper


def attach_guards(plan: RunPlan, parts: RunParts, run_dir: Path) -> None:
    """The guards that stop or watch the run: non-finite guard, time limit, hang watchdog."""
    t = plan.control
    trainer, evaluator = parts.trainer, parts.evaluator
    if t.nonfinite_guard:
        NonFiniteGuard().attach(trainer)
    if t.time_limit is not None:
        TimeLimit(t.time_limit).attach(trainer)
    if t.hang_timeout is not None:
        watchdog = Watchdog(t.hang_timeout, run_dir=run_dir / "logs")
        watchdog.attach(trainer)
        watchdog.watch(evaluator)
