"""Handlers to attach to an engine's events."""

from unison.handlers.checkpoint import Checkpoint
from unison.handlers.early_stop_checker import EarlyStopChecker
from unison.handlers.early_stopping import EarlyStopping
from unison.handlers.ema import EMA
from unison.handlers.hparams import HParamsLogger
from unison.handlers.lr_scaling import LRWarmup, scale_lr
from unison.handlers.mlflow import MLflowLogger
from unison.handlers.non_finite import NonFiniteGuard
from unison.handlers.preemption import EXIT_PREEMPTED, Preemption
from unison.handlers.profiler import Profiler
from unison.handlers.progress import ProgressBar
from unison.handlers.pruning import AgreedPruning
from unison.handlers.synced import SyncedHandler
from unison.handlers.tensorboard import TensorBoardLogger
from unison.handlers.time_limit import TimeLimit
from unison.handlers.watchdog import EXIT_HANG, Watchdog

__all__ = [
    "AgreedPruning",
    "EXIT_HANG",
    "EMA",
    "EXIT_PREEMPTED",
    "Checkpoint",
    "EarlyStopChecker",
    "EarlyStopping",
    "HParamsLogger",
    "LRWarmup",
    "MLflowLogger",
    "NonFiniteGuard",
    "Preemption",
    "Profiler",
    "ProgressBar",
    "SyncedHandler",
    "TensorBoardLogger",
    "TimeLimit",
    "Watchdog",
    "scale_lr",
]
