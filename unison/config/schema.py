"""The typed schema of a run's config: its sections as dataclasses, and :class:`Config`.

Each key is a field made with :func:`option` (its default, a line of documentation, an old
name still read, the ``!pyobject`` slot it fills). Checking a raw config against it is
:mod:`unison.config.validation`; the reference page made from it is
:mod:`unison.config.reference`.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from unison.config.loader import KeyPath, PyObjectRef


def option(
    default: Any = dataclasses.MISSING, doc: str = "", *, alias: str | None = None, slot: str | None = None
) -> Any:
    """A schema field: its default, a line of documentation, an accepted old name, and
    for ``!pyobject`` fields the slot it fills (checked when resolved)."""
    metadata = {"doc": doc, "alias": alias, "slot": slot}
    if isinstance(default, (dict, list)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, doc: str) -> Any:
    """A schema field holding a whole section."""
    return field(default_factory=cls, metadata={"doc": doc, "alias": None, "slot": None})


@dataclass
class ParallelConfig:
    backend: Literal["gloo", "nccl"] | None = option(
        None, "collective backend; default nccl with CUDA, else gloo"
    )
    nproc_per_node: int | None = option(
        None, "processes to spawn when no launcher is present (`--nproc`)", alias="world_size"
    )
    master_addr: str = option("127.0.0.1", "rendezvous address when spawning")
    master_port: int | str | None = option(None, "rendezvous port when spawning; default, a free port")
    timeout: float = option(600.0, "seconds a collective waits for the other ranks before failing")
    find_unused_parameters: bool = option(False, "DDP option for models with parameters unused in some steps")
    sync_batchnorm: bool = option(False, "convert BatchNorm layers to SyncBatchNorm")


@dataclass
class TrainingConfig:
    seed: int = option(0, "seed for weights, splits and shuffling (the same on every rank)")
    max_epochs: int = option(10, "epochs to train", alias="num_epochs")
    batch_size: int = option(32, "samples per rank per step (total = batch_size x world size)")
    epoch_length: int | None = option(None, "iterations per epoch; default, one pass over the shard")
    optimizer_type: PyObjectRef = option(
        PyObjectRef("torch.optim.AdamW"), "optimizer class", slot="optimizer"
    )
    optimizer_kwargs: dict[str, Any] = option({}, "keyword arguments of the optimizer (lr, weight_decay ...)")
    lr: float | None = option(None, "learning rate; overrides optimizer_kwargs.lr")
    lr_scaling: Literal["none", "linear", "sqrt"] = option(
        "none", "scale lr by the world size (linear) or its square root (sqrt)"
    )
    scheduler_type: PyObjectRef | None = option(
        None, "LR scheduler class, stepped as training.scheduler_every says", slot="scheduler"
    )
    scheduler_kwargs: dict[str, Any] = option({}, "keyword arguments of the scheduler")
    scheduler_every: Literal["epoch", "update"] = option(
        "epoch",
        "step the scheduler once per epoch (after validation), or once per optimizer update "
        "(UPDATE_COMPLETED: once per accumulation window, never per micro-batch); ReduceLROnPlateau "
        "always steps per epoch, on the watched metric",
    )
    loss: PyObjectRef = option(
        PyObjectRef("torch.nn.functional.cross_entropy"),
        "loss_fn(y_pred, y) -> scalar tensor; a loss module class is built with no arguments",
        slot="loss",
    )
    amp: Literal["none", "bf16", "fp16"] = option("none", "autocast precision")
    accumulation_steps: int = option(1, "micro-batches per optimizer update")
    clip_grad_norm: float | None = option(None, "clip the total gradient norm to this value")
    num_workers: int = option(0, "DataLoader worker processes per rank")
    pin_memory: bool = option(False, "pin host memory for faster copies to the GPU")
    drop_last: bool = option(False, "drop the last incomplete training batch")
    prefetch_factor: int | None = option(None, "batches each worker loads ahead (needs num_workers > 0)")
    sync_every: int | None = option(100, "iterations between sync points inside an epoch")
    time_limit: float | None = option(None, "stop every rank together after this many seconds")
    nonfinite_guard: bool = option(True, "stop every rank when a loss is NaN or infinite on any of them")
    hang_timeout: float | None = option(None, "seconds without progress before a rank dumps its stacks")
    device: str | None = option(
        None, "kept for compatibility; each rank uses its own device (checked to exist on this machine)"
    )
    path: str | None = option(None, "output root; the same as logging.root")
    checkpoint_at: int | None = option(
        None, "save every this many epochs; the same as checkpoint.every_epochs"
    )


@dataclass
class ModelConfig:
    type: PyObjectRef | None = option(None, "the model class (or a function returning a model)", slot="model")
    kwargs: dict[str, Any] = option({}, "keyword arguments of the model")


@dataclass
class DataConfig:
    build: PyObjectRef | None = option(
        None, "fn(seed, **kwargs) -> (train, val, test) datasets; test may be None", slot="data"
    )
    kwargs: dict[str, Any] = option({}, "keyword arguments of build")


@dataclass
class ValidationConfig:
    every: int = option(1, "evaluate every this many epochs")
    batch_size: int | None = option(None, "per-rank batch size; default training.batch_size")
    num_workers: int = option(0, "DataLoader worker processes")
    metrics: dict[str, Any] = option(
        {}, "name -> !pyobject metric class, or {type: !pyobject ..., kwargs: {...}}"
    )


@dataclass
class TestingConfig:
    enabled: bool = option(True, "evaluate the test set after training, when data.build returns one")
    batch_size: int | None = option(None, "per-rank batch size; default validation.batch_size")
    use_best: bool = option(True, "load the best checkpoint by checkpoint.metric before testing")


@dataclass
class PredictConfig:
    enabled: bool = option(
        False, "after training, predict the test (else validation) set into the run directory"
    )
    batch_size: int | None = option(None, "per-rank batch size; default validation.batch_size")


@dataclass
class CheckpointConfig:
    enabled: bool = option(True, "write checkpoints to <run>/checkpoints")
    every_epochs: int | None = option(1, "save every this many epochs")
    every_iters: int | None = option(None, "save every this many iterations")
    keep_last: int | None = option(2, "newest checkpoints to keep")
    keep_best: int = option(1, "best checkpoints (by metric) to keep as well")
    metric: str | None = option(None, "validation metric ranking checkpoints; default the first metric")
    mode: Literal["max", "min"] = option(
        "max",
        "whether a higher or lower metric is better; when left out, min for a loss-like metric "
        "(loss, *_loss, mse, mae, perplexity ...), else max",
    )
    async_save: bool = option(False, "write in a background thread")
    preemption: bool = option(True, "on SIGTERM/SIGUSR1 save at an agreed iteration and exit 75")
    requeue: bool = option(False, "under SLURM, requeue the job after a preemption save")


@dataclass
class EarlyStoppingConfig:
    patience: int | None = option(None, "evaluations without improvement before stopping; None disables")
    metric: str | None = option(None, "validation metric to watch; default checkpoint.metric")
    mode: Literal["max", "min"] | None = option(
        None, "default checkpoint.mode (for another metric: min for a loss-like one, else max)"
    )
    min_delta: float = option(0.0, "smallest change that counts as improvement")
    threshold_mode: Literal["abs", "rel"] = option("abs", "min_delta absolute or relative")
    cumulative_delta: bool = option(False, "compare with the score at the last improvement")
    agreement: Literal["rank_zero", "any", "all"] = option("rank_zero", "how ranks agree on stopping")


@dataclass
class LoggingConfig:
    root: str = option("runs", "runs go to <root>/<name>/<timestamp>/")
    tensorboard: bool = option(True, "write TensorBoard event files to <run>/tb")
    progress: bool = option(True, "a progress bar on rank 0")
    log_every: int = option(50, "iterations between learning-rate points in TensorBoard")


@dataclass
class HooksConfig:
    after_training: PyObjectRef | None = option(
        None, "fn(context) called on every rank after training and testing", slot="hook"
    )


@dataclass
class Config:
    """A whole run. Sections are optional; keys left out take their defaults."""

    name: str = option("run", "the run's name: its directory is <logging.root>/<name>/<timestamp>/")
    imports: list[str] = option(
        [], "your own modules (installed or on sys.path) that !pyobject may name; not stdlib or libraries"
    )
    parallel: ParallelConfig = section(ParallelConfig, "how ranks are started")
    training: TrainingConfig = section(TrainingConfig, "the training loop")
    model: ModelConfig = section(ModelConfig, "the model")
    data: DataConfig = section(DataConfig, "the datasets")
    validation: ValidationConfig = section(ValidationConfig, "evaluation after epochs")
    testing: TestingConfig = section(TestingConfig, "evaluation of the test set after training")
    predict: PredictConfig = section(PredictConfig, "predictions written after training")
    checkpoint: CheckpointConfig = section(CheckpointConfig, "checkpoints and preemption")
    early_stopping: EarlyStoppingConfig = section(EarlyStoppingConfig, "stopping when a metric stalls")
    logging: LoggingConfig = section(LoggingConfig, "run directory, TensorBoard, progress")
    hooks: HooksConfig = section(HooksConfig, "recipe code run at fixed points")


REQUIRED: tuple[KeyPath, ...] = (("model", "type"), ("data", "build"))
"""Keys a config must set: without them there is nothing to train."""


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and tp is not PyObjectRef


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, globalns=globals(), localns={"PyObjectRef": PyObjectRef})


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(v) for v in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if tp is PyObjectRef:
        return "!pyobject dotted.path"
    if origin is dict:
        return "a mapping"
    if origin is list:
        return f"a list of {_type_name(typing.get_args(tp)[0])}"
    return getattr(tp, "__name__", str(tp))
