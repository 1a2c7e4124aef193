"""The Engine, its events, and the training and evaluation step factories."""

from ignite.engine import Events, State

from unison.distributed.sync import SyncContributor, SyncPoint
from unison.engine.calls import AutoCall, ModelCall, WholeBatch, batch_field
from unison.engine.engine import Engine
from unison.engine.evaluation import EvalStep, create_evaluator
from unison.engine.events import UpdateEvents
from unison.engine.steps import TrainStep, create_trainer, prepare_batch

__all__ = [
    "AutoCall",
    "Engine",
    "EvalStep",
    "Events",
    "ModelCall",
    "State",
    "SyncContributor",
    "SyncPoint",
    "TrainStep",
    "UpdateEvents",
    "WholeBatch",
    "batch_field",
    "create_evaluator",
    "create_trainer",
    "prepare_batch",
]
