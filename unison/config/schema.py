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

from unison.config.checkpoint_config import CheckpointConfig
from unison.config.data_config import DataConfig
from unison.config.fault_tolerance_config import FaultToleranceConfig
from unison.config.handlers_config import HandlerConfig
from unison.config.loader import KeyPath, PyObjectRef
from unison.config.logging_config import LoggingConfig
from unison.config.mlflow_config import MLflowConfig  # noqa: F401 (logging.mlflow's type)
from unison.config.model_config import ModelConfig
from unison.config.origin import NO_ORIGIN, Origin
from unison.config.parallel_docs import AC_DOC
from unison.config.profiling import ProfileConfig
from unison.config.wandb_config import WandbConfig  # noqa: F401 (logging.wandb's type)


def option(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    alias: str | None = None,
    slot: str | None = None,
    any_case: bool = False,
) -> Any:
    """A schema field: its default, a line of documentation, an accepted old name, for
    ``!pyobject`` fields the slot it fills (checked when resolved), and for a ``Literal``
    field whether its values are read in any case (``info`` for ``INFO``, :func:`~unison.config.checks_base.in_case_of`)."""
    metadata = {"doc": doc, "alias": alias, "slot": slot, "any_case": any_case}
    if isinstance(default, (dict, list)):
        value = default
        return field(default_factory=lambda: type(value)(value), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type, doc: str) -> Any:
    """A schema field holding a whole section."""
    return field(default_factory=cls, metadata={"doc": doc, "alias": None, "slot": None})


@dataclass
class FSDPConfig:
    shard: str | list[str] = option(
        "auto",
        "which submodules become FSDP units: auto (every class with 2+ instances holding parameters, "
        "outermost first: the repeated blocks) or a list of class names; the root is always one",
    )
    reshard_after_forward: bool = option(
        True, "free each unit's gathered parameters after its forward (less memory, a second all-gather)"
    )
    param_dtype: Literal["bfloat16", "float16", "float32"] | None = option(
        None, "mixed precision: the dtype parameters are gathered and computed in; null keeps theirs"
    )
    reduce_dtype: Literal["bfloat16", "float16", "float32"] | None = option(
        None, "the dtype gradients are reduced in; null: param_dtype"
    )
    cpu_offload: bool = option(False, "keep shards, gradients and optimizer state in CPU memory (CUDA only)")


@dataclass
class ParallelConfig:
    strategy: Literal["ddp", "fsdp"] = option(
        "ddp",
        "ddp: a full replica per rank; fsdp: parameters, gradients and optimizer state sharded over the "
        "ranks (FSDP2), with sharded checkpoints (docs/sharded.md)",
    )
    fsdp: FSDPConfig = section(FSDPConfig, "FSDP2 sharding, with strategy: fsdp")
    backend: Literal["gloo", "nccl"] | None = option(
        None, "collective backend; default nccl with CUDA, else gloo"
    )
    nproc_per_node: int | None = option(
        None, "processes to spawn when no launcher is present (`--nproc`)", alias="world_size"
    )
    rank: int | None = option(
        None, "accepted for QuantumGrav configs: each process takes its rank from the launcher (a number "
        "is not used; a log line says so)",
    )
    master_addr: str = option("127.0.0.1", "rendezvous address when spawning")
    master_port: int | str | None = option(None, "rendezvous port when spawning; default, a free port")
    timeout: float = option(600.0, "seconds a collective waits for the other ranks before failing")
    find_unused_parameters: bool | None = option(
        None,
        "DDP option for models with parameters unused in some steps; null: the DDP_FIND_UNUSED_PARAMETERS "
        "environment variable (true/false, 1/0, yes/no) when set, else false. A value given here wins",
    )
    sync_batchnorm: bool = option(False, "convert BatchNorm layers to SyncBatchNorm")
    activation_checkpointing: bool | str | list[str] = option(False, AC_DOC)
    output_device: int | str | None = option(
        None, "DDP's output_device on GPUs (a cuda index or device); null: the rank's own device; not used "
        "on the CPU (a log line says so)",
    )
    fault_tolerance: FaultToleranceConfig | None = option(
        None,
        "run as one replica group of a torchft job: a lost group costs the others no step and no restart "
        "(docs/launching.md); null: off",
    )


@dataclass
class LRScalingConfig:
    rule: Literal["none", "linear", "sqrt"] = option(
        "linear",
        "lr x global/reference batch (linear) or its square root (sqrt); none keeps lr (warmup alone)",
    )
    reference_batch_size: int | None = option(
        None, "the global batch lr was tuned for; default one rank's batch, batch_size x accumulation_steps"
    )
    warmup_steps: int = option(
        0,
        "optimizer updates of linear warmup: update k steps with lr x min(1, k/warmup_steps), on top of "
        "the scheduler's value; 0: none",
    )


@dataclass
class EMAConfig:
    decay: float = option(0.999, "at each average: ema = decay x ema + (1 - decay) x weights; in (0, 1)")
    every: int = option(1, "average every this many optimizer updates (never per micro-batch)")
    warmup: int = option(0, "optimizer updates during which the average is a copy of the weights")
    evaluate: bool = option(
        True,
        "validate (so rank the best checkpoint and stop early), test and predict with the averaged weights; "
        "false: with the trained ones (the average is saved in checkpoints either way, as handler:EMA)",
    )


@dataclass
class CompileConfig:
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = option(
        None, "torch.compile's mode; null: its default"
    )
    fullgraph: bool = option(False, "fail on a graph break instead of falling back to Python")
    dynamic: bool | None = option(None, "compile for dynamic shapes; null: decide from the shapes seen")


@dataclass
class TrainingConfig:
    seed: int = option(0, "seed for weights, splits and shuffling (the same on every rank)")
    max_epochs: int = option(10, "epochs to train", alias="num_epochs")
    batch_size: int | None = option(
        None, "samples per rank per step, at any world size (an update: x ranks x accumulation_steps); null: 32"
    )
    global_batch_size: int | None = option(
        None, "samples per optimizer update across all ranks (per-rank batch x ranks x accumulation_steps), "
        "divided among the ranks; instead of batch_size",
    )
    epoch_length: int | None = option(None, "iterations per epoch; default, one pass over the shard")
    optimizer_type: PyObjectRef = option(
        PyObjectRef("torch.optim.AdamW"), "optimizer class", slot="optimizer"
    )
    optimizer_args: list[Any] = option([], "positional arguments of the optimizer, after the parameters")
    optimizer_kwargs: dict[str, Any] = option({}, "keyword arguments of the optimizer (lr, weight_decay ...)")
    lr: float | None = option(None, "learning rate; overrides optimizer_kwargs.lr")
    lr_scaling: Literal["none", "linear", "sqrt"] | LRScalingConfig = option(
        "none",
        "scale lr by the global batch (ranks x batch_size x accumulation_steps) over a reference batch; as a "
        "string the reference is one rank's batch, so lr x world size (linear) or its square root (sqrt); "
        "a mapping sets the rule, the reference and a warmup (keys below)",
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
    collate: PyObjectRef | None = option(
        None, "fn(items) -> batch for the training loader; null: torch_geometric's for graphs, else torch's "
        "default_collate", slot="collate",
    )
    batch: dict[str, str | int | None] | PyObjectRef | None = option(
        None, "how a batch becomes (inputs, target), in training and evaluation: {target: <field>} keeps it "
        "whole, or !pyobject fn(batch, device) -> (inputs, target); null: (x, y) pairs split, else whole with y",
        slot="batch",
    )
    amp: Literal["none", "bf16", "fp16"] = option("none", "autocast precision")
    accumulation_steps: int = option(1, "micro-batches per optimizer update")
    clip_grad_norm: float | None = option(None, "clip the total gradient norm to this value")
    compile: bool | CompileConfig = option(
        False,
        "torch.compile the model after DDP/FSDP wrapping, in place (checkpoints keep the plain keys, so a "
        "run resumes with or without it); a mapping sets the options below",
    )
    ema: EMAConfig | None = option(
        None,
        "keep an exponential moving average of the weights, updated once per optimizer update (keys "
        "below; `ema: {}` takes their defaults); null: off",
    )
    profile: ProfileConfig | None = option(None, "torch.profiler traces of a few iterations; null: off")
    num_workers: int = option(0, "DataLoader worker processes per rank")
    pin_memory: bool = option(False, "pin host memory for faster copies to the GPU")
    drop_last: bool = option(False, "drop the last incomplete training batch")
    shuffle: bool = option(True, "shuffle the training data, with a new order each epoch (the same on every rank)")
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
class ValidationConfig:
    every: int = option(1, "evaluate every this many epochs")
    batch_size: int | None = option(None, "per-rank batch size; default training's per-rank batch")
    global_batch_size: int | None = option(None, "samples per step across all ranks; instead of batch_size")
    num_workers: int = option(0, "DataLoader worker processes")
    pin_memory: bool | None = option(None, "pin host memory; default training.pin_memory")
    drop_last: bool = option(
        False, "drop each rank's last incomplete batch: metrics then skip samples (a warning says so)"
    )
    prefetch_factor: int | None = option(
        None, "batches each worker loads ahead; default training.prefetch_factor when there are workers"
    )
    collate: PyObjectRef | None = option(None, "fn(items) -> batch; default training.collate", slot="collate")
    shuffle: bool = option(False, "a new order each evaluation, the same on every rank (from training.seed)")
    validator: dict[str, Any] = option(
        {}, "QuantumGrav's validator: criterion (!pyobject fn(outputs, batch), the loss metric) and apply_model "
        "(the model call) are used; device is not needed, every rank evaluates on its own device (logged)",
    )
    metrics: dict[str, Any] = option(
        {}, "name -> !pyobject metric class, or {type: !pyobject ..., kwargs: {...}}"
    )


@dataclass
class TestingConfig:
    enabled: bool = option(True, "evaluate the test set after training, when data.build returns one")
    batch_size: int | None = option(None, "per-rank batch size; default validation's per-rank batch")
    global_batch_size: int | None = option(None, "samples per step across all ranks; instead of batch_size")
    use_best: bool = option(True, "load the best checkpoint by checkpoint.metric before testing")
    num_workers: int | None = option(None, "DataLoader worker processes; default validation.num_workers")
    pin_memory: bool | None = option(None, "pin host memory; default validation.pin_memory")
    drop_last: bool = option(
        False, "drop each rank's last incomplete batch: metrics then skip samples (a warning says so)"
    )
    prefetch_factor: int | None = option(
        None, "batches each worker loads ahead; default validation.prefetch_factor"
    )
    collate: PyObjectRef | None = option(None, "fn(items) -> batch; default validation.collate", slot="collate")
    shuffle: bool = option(False, "a new order each evaluation, as validation.shuffle")
    tester: dict[str, Any] = option(
        {}, "QuantumGrav's tester: criterion and apply_model as validation.validator's (default theirs); "
        "device is not needed (logged)",
    )


@dataclass
class PredictConfig:
    enabled: bool = option(
        False, "after training, predict the test (else validation) set into the run directory"
    )
    batch_size: int | None = option(None, "per-rank batch size; default validation's per-rank batch")
    global_batch_size: int | None = option(None, "samples per step across all ranks; instead of batch_size")


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
    type: PyObjectRef | str | None = option(
        None,
        "the handler: null, EarlyStopping or QuantumGrav's DefaultEarlyStopping is unison.handlers.EarlyStopping; "
        "or a subclass of it, by name in the modules under imports: or by !pyobject",
        slot="early_stopping",
    )
    args: list[Any] = option([], "positional arguments after the trainer (for EarlyStopping: the metric)")
    kwargs: dict[str, Any] = option(
        {}, "keyword arguments: this section's keys (patience, mode, min_delta or delta ...) set them; the "
        "others go to a handler class of your own",
    )


@dataclass
class HooksConfig:
    after_training: PyObjectRef | None = option(
        None, "fn(context) called on every rank after training and testing; context holds config (the config as "
        "plain data, URL credentials masked), run_dir, model, optimizer, trainer, evaluator, datasets and results", slot="hook"
    )


@dataclass
class TuningConfig:
    direction: Literal["maximize", "minimize"] | None = option(
        None,
        "whether the sweep maximizes or minimizes tuning.metric; default from checkpoint.mode, or the metric's name",
    )
    metric: str | None = option(
        None, "the validation metric a trial is judged by (its best value); default checkpoint.metric"
    )
    search_space: dict[str, Any] = option(
        {},
        "dotted config key -> {type: float | int, low, high, log, step} or {type: categorical, choices: [...]}; "
        "each trial sets the drawn values as --set does",
    )
    sampler: str = option("TPESampler", "a class of optuna.samplers, by name")
    sampler_kwargs: dict[str, Any] = option({}, "keyword arguments of the sampler (plain values, e.g. seed)")
    pruner: str | None = option(
        "MedianPruner", "a class of optuna.pruners, by name; asked after each validation; null: never prune"
    )
    pruner_kwargs: dict[str, Any] = option({}, "keyword arguments of the pruner (plain values)")
    storage: str | None = option(
        None, "an Optuna storage URL (sqlite:///..., postgresql://...); default <sweep folder>/study.db"
    )
    study_name: str | None = option(None, "the study's name in the storage; default the config's name")
    load_if_exists: bool = option(True, "continue a study of this name in the storage; false: refuse to")


@dataclass
class Config:
    """A whole run. Sections are optional; keys left out take their defaults."""

    name: str = option("run", "the run's name: its directory is <logging.root>/<name>/<timestamp>/")
    criterion: PyObjectRef | None = option(
        None,
        "the loss as QuantumGrav calls it: a function of yours gets (outputs, batch), and the trainer as a third "
        "argument when it takes one; a torch loss gets (y_pred, y). Fills training.loss; both different: an error",
        slot="loss",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] | None = option(
        None, "console log level, every rank (any case: info is INFO)", any_case=True
    )
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
    handlers: list[HandlerConfig] = option(
        [], "your own handlers, attached in the order written (docs/handlers.md); each item's keys below"
    )
    tuning: TuningConfig = section(TuningConfig, "hyperparameter sweeps with `unison tune`")

    @property
    def origin(self) -> Origin:
        """Where its keys were written (file, lines, ``--set``): the locator of its errors. Not a key:
        set by :func:`~unison.config.load_config`; a config built in Python has none."""
        return vars(self).get("_origin", NO_ORIGIN)

    @origin.setter
    def origin(self, value: Origin) -> None:
        vars(self)["_origin"] = value


REQUIRED: tuple[KeyPath, ...] = (("model", "type"), ("data", "build"))
"""Keys a config must set: without them there is nothing to train."""


def _is_section(tp: Any) -> bool:
    return dataclasses.is_dataclass(tp) and tp is not PyObjectRef


def _hints(cls: type) -> dict[str, Any]:
    # Each class's annotations are read in its own module: sections live in modules of their own.
    return typing.get_type_hints(cls, localns={"PyObjectRef": PyObjectRef})


def section_in(tp: Any) -> type | None:
    """The section class a key takes as a mapping: ``tp`` itself, or the section in its union
    (``EMAConfig | None``, ``Literal[...] | LRScalingConfig``); None for a plain key."""
    if _is_section(tp):
        return typing.cast(type, tp)
    if typing.get_origin(tp) in (Union, types.UnionType):
        return next((a for a in typing.get_args(tp) if _is_section(a)), None)
    return None


def item_section(tp: Any) -> type | None:
    """The section each item of a list key is (``list[HandlerConfig]``: ``handlers``); None otherwise."""
    args = typing.get_args(tp) if typing.get_origin(tp) is list else ()
    return typing.cast(type, args[0]) if len(args) == 1 and _is_section(args[0]) else None


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if _is_section(tp):
        return "a mapping {" + ", ".join(f.name for f in dataclasses.fields(tp)) + "}"
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
