"""unison: distributed PyTorch training in which every rank moves in unison."""

from unison.distributed import launch, prepare_loaders, prepare_model
from unison.engine import Engine, Events, ModelCall, WholeBatch, create_evaluator, create_trainer
from unison.metrics import BatchLoss
from unison.utils.version import __version__

__all__ = [
    "BatchLoss",
    "Engine",
    "Events",
    "ModelCall",
    "WholeBatch",
    "__version__",
    "create_evaluator",
    "create_trainer",
    "launch",
    "prepare_loaders",
    "prepare_model",
]
