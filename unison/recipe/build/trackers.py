"""What a run reports through, on each rank: TensorBoard (with its HParams session and the
profiler's traces), MLflow, W&B and the progress bar, one attacher each (:data:`TRACKERS`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from unison.handlers import ProgressBar
from unison.recipe.build.parts import RunParts
from unison.recipe.build.tracking import attach_tracking
from unison.recipe.build.tracking_tb import attach_hparams, attach_profiler
from unison.recipe.build.tracking_wandb import attach_wandb
from unison.recipe.planning.run_plan import RunPlan
from unison.utils import get_logger
from unison.utils.run_files import real_folder

_log = get_logger("unison.recipe.run")  # the run's logger


def attach_tensorboard(plan: RunPlan, parts: RunParts, run_dir: Path) -> None:
    """TensorBoard event files in ``run_dir/tb``, as ``logging.tensorboard`` asks."""
    lg = plan.logging
    if lg.tb_every is not None:
        try:
            from unison.handlers.tensorboard import TensorBoardLogger
        except ImportError as err:  # pragma: no cover - tensorboardX is a dependency
            _log.warning("TensorBoard logging is off: %s", err)
        else:
            TensorBoardLogger(
                real_folder(run_dir / "tb"),
                trainer=parts.trainer,
                evaluators={"val": parts.evaluator},
                log_every=lg.tb_every,
            ).attach(parts.trainer)


def attach_progress(plan: RunPlan, parts: RunParts, run_dir: Path) -> None:
    """The progress bar (``logging.progress``)."""
    if plan.logging.progress:
        ProgressBar().attach(parts.trainer)


TRACKERS: tuple[Callable[[RunPlan, RunParts, Path], object], ...] = (
    attach_tensorboard,
    attach_hparams,  # logging.tensorboard: the settings for the HParams view
    attach_profiler,  # training.profile: a trace of a few iterations per rank
    attach_tracking,  # logging.mlflow (unison.recipe.build.tracking)
    attach_wandb,  # logging.wandb (unison.recipe.build.tracking_wandb)
    attach_progress,
)
"""What a run reports through, each attached by its own function, in this order."""
