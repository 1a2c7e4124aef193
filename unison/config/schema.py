"""The typed schema of a run's config, and its validation with file, line and key path."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from unison.config.errors import ConfigError
from unison.config.loader import KeyPath, PyObjectRef, RawConfig


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


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin is Literal:
        return any(value == a and type(value) is type(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return any(_matches(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is dict:
        return isinstance(value, dict)
    if origin is list:
        (item,) = typing.get_args(tp)
        return isinstance(value, list) and all(_matches(v, item) for v in value)
    return isinstance(value, tp)


def _takes_float(tp: Any) -> bool:
    if tp is float:
        return True
    return (
        typing.get_origin(tp) in (Union, types.UnionType)
        and float in typing.get_args(tp)
        and int not in typing.get_args(tp)
    )


def _section_error(raw: RawConfig, path: KeyPath, message: str) -> ConfigError:
    return ConfigError(message, file=raw.file_of(path), line=raw.line_of(path), key=path)


def _build(cls: type, data: Any, raw: RawConfig, path: KeyPath) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise _section_error(
            raw, path, f"expected a mapping (a section), got {type(data).__name__}: {data!r}"
        )
    fields = {f.name: f for f in dataclasses.fields(cls)}
    aliases = {f.metadata["alias"]: f.name for f in fields.values() if f.metadata.get("alias")}
    hints = _hints(cls)
    values: dict[str, Any] = {}
    given_as: dict[str, str] = {}
    for key, value in data.items():
        key = str(key)
        name = aliases.get(key, key)
        if name not in fields:
            choices = list(fields) + list(aliases)
            near = difflib.get_close_matches(key, choices, n=1, cutoff=0.6)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            where = ".".join(path) or "the top level"
            raise _section_error(
                raw,
                path + (key,),
                f"unknown key {key!r} in {where}. Valid keys: {', '.join(sorted(fields))}.{hint}",
            )
        if name in values:
            earlier = given_as[name]
            if path + (earlier,) in raw.overrides:
                continue  # the command line's --set wins over the file
            if path + (key,) not in raw.overrides:
                raise _section_error(
                    raw,
                    path + (key,),
                    f"the key is set twice, as {earlier!r} and as {key!r}; keep one of them",
                )
        given_as[name] = key
        tp = hints[name]
        if _is_section(tp):
            values[name] = _build(tp, value, raw, path + (key,))
            continue
        if not _matches(value, tp):
            raise _section_error(
                raw,
                path + (key,),
                f"expected {_type_name(tp)}, got {type(value).__name__}: {value!r}",
            )
        if isinstance(value, int) and not isinstance(value, bool) and _takes_float(tp):
            value = float(value)
        values[name] = value
    for name in fields:
        if name not in values and _is_section(hints[name]):
            values[name] = hints[name]()
    return cls(**values)


def validate(raw: RawConfig) -> Config:
    """Checks a config read by :func:`~unison.config.load_yaml` against the schema.

    Raises:
        ConfigError: naming the file, the line, the key path and the expected type; for
            an unknown key, the nearest valid one.
    """
    config = _build(Config, raw.data, raw, ())
    for path in REQUIRED:
        section = getattr(config, path[0])
        if getattr(section, path[1]) is None:
            raise ConfigError(
                f"required: set {'.'.join(path)} (e.g. `{path[1]}: !pyobject my_recipe.thing`)",
                file=raw.file_of(path),
                line=raw.line_of(path),
                key=path,
            )
    _check_values(config, raw)
    _check_name(config, raw)
    _check_modes(config, raw)
    return config


def _check_name(config: Config, raw: RawConfig) -> None:
    """``name`` is one folder name: the run directory stays inside ``logging.root``."""
    name = config.name
    bad = not name.strip() or name in (".", "..") or any(c in name for c in "/\\\0") or name.startswith("~")
    if bad:
        path = ("name",)
        raise ConfigError(
            f"{name!r} is not a folder name: the run directory is <logging.root>/<name>/, so a name with "
            "'/', '\\', '..' or '~' (or an empty one) would write outside logging.root; use a name like "
            "'digits-small'",
            file=raw.file_of(path),
            line=raw.line_of(path),
            key=path,
        )


_LOWER_IS_BETTER = frozenset(
    "loss mse mae rmse msle nll perplexity ppl error err cer wer mape smape kl kld bce xent".split()
)
_HIGHER_IS_BETTER = frozenset(
    "accuracy acc f1 precision recall auc auroc roc r2 iou miou dice bleu rouge".split()
)


def metric_direction(name: str) -> Literal["max", "min"] | None:
    """``"min"`` for a loss-like metric name (``loss``, ``val_loss``, ``mse`` ...), ``"max"`` for an
    accuracy-like one (``accuracy``, ``f1`` ...), None when the name does not say."""
    lowered = name.lower()
    words = {w for w in re.split(r"[^a-z0-9]+", lowered) if w}
    if words & _LOWER_IS_BETTER or lowered.endswith("loss"):
        return "min"
    if words & _HIGHER_IS_BETTER:
        return "max"
    return None


def _explicit(raw: RawConfig, section: str, key: str) -> bool:
    data = raw.data.get(section)
    return isinstance(data, dict) and key in data


def _check_modes(config: Config, raw: RawConfig) -> None:
    """Fills ``checkpoint.mode`` from the watched metric's name when left out, and refuses a mode
    that contradicts the name (``mode: max`` on a loss keeps the worst checkpoint)."""
    names = [str(k) for k in config.validation.metrics] or ["loss"]
    watched = config.checkpoint.metric or names[0]
    es = config.early_stopping
    es_watched = es.metric or watched
    for section, metric, explicit in (
        ("checkpoint", watched, _explicit(raw, "checkpoint", "mode")),
        ("early_stopping", es_watched, es.mode is not None),
    ):
        direction = metric_direction(metric)
        holder = config.checkpoint if section == "checkpoint" else es
        if not explicit:
            if section == "checkpoint":
                config.checkpoint.mode = direction or "max"
            elif es.metric is not None and es.metric != watched:
                es.mode = direction or "max"
            continue
        if direction is not None and holder.mode != direction:
            path = (section, "mode")
            better = "lower" if direction == "min" else "higher"
            raise ConfigError(
                f"mode {holder.mode!r} contradicts the watched metric {metric!r}, for which {better} is better: "
                f"'best' would keep the worst model. Set `mode: {direction}` (or leave mode out)",
                file=raw.file_of(path),
                line=raw.line_of(path),
                key=path,
            )


def _check_values(config: Config, raw: RawConfig) -> None:
    positive = [
        (("training", "max_epochs"), config.training.max_epochs),
        (("training", "batch_size"), config.training.batch_size),
        (("training", "accumulation_steps"), config.training.accumulation_steps),
        (("training", "epoch_length"), config.training.epoch_length),
        (("training", "sync_every"), config.training.sync_every),
        (("training", "checkpoint_at"), config.training.checkpoint_at),
        (("parallel", "nproc_per_node"), config.parallel.nproc_per_node),
        (("parallel", "timeout"), config.parallel.timeout),
        (("validation", "every"), config.validation.every),
        (("validation", "batch_size"), config.validation.batch_size),
        (("checkpoint", "every_epochs"), config.checkpoint.every_epochs),
        (("checkpoint", "every_iters"), config.checkpoint.every_iters),
        (("checkpoint", "keep_last"), config.checkpoint.keep_last),
        (("early_stopping", "patience"), config.early_stopping.patience),
        (("logging", "log_every"), config.logging.log_every),
        (("training", "time_limit"), config.training.time_limit),
        (("training", "hang_timeout"), config.training.hang_timeout),
        (("training", "clip_grad_norm"), config.training.clip_grad_norm),
        (("training", "lr"), config.training.lr),
    ]
    for path, value in positive:
        if value is not None and value <= 0:
            raise ConfigError(
                f"must be > 0, got {value!r}", file=raw.file_of(path), line=raw.line_of(path), key=path
            )
    for path, value in (
        (("training", "num_workers"), config.training.num_workers),
        (("checkpoint", "keep_best"), config.checkpoint.keep_best),
    ):
        if value < 0:
            raise ConfigError(
                f"must be >= 0, got {value!r}", file=raw.file_of(path), line=raw.line_of(path), key=path
            )
    port = config.parallel.master_port
    if isinstance(port, str):
        if not port.strip().isdigit():
            path = ("parallel", "master_port")
            raise ConfigError(
                f"expected a port number, got {port!r}",
                file=raw.file_of(path),
                line=raw.line_of(path),
                key=path,
            )
        config.parallel.master_port = port = int(port)
    if port is not None and not 0 < port < 65536:
        path = ("parallel", "master_port")
        raise ConfigError(
            f"expected a port in 1..65535, got {config.parallel.master_port}",
            file=raw.file_of(path),
            line=raw.line_of(path),
            key=path,
        )
    if config.training.prefetch_factor is not None and config.training.num_workers == 0:
        path = ("training", "prefetch_factor")
        raise ConfigError(
            "needs training.num_workers > 0 (prefetching is done by worker processes)",
            file=raw.file_of(path),
            line=raw.line_of(path),
            key=path,
        )
    if config.parallel.backend == "nccl":
        import torch

        if not torch.cuda.is_available():
            path = ("parallel", "backend")
            raise ConfigError(
                "'nccl' needs CUDA, which is not available here; use 'gloo' or leave it unset",
                file=raw.file_of(path),
                line=raw.line_of(path),
                key=path,
            )


def schema_reference() -> list[tuple[str, str, str, str]]:
    """(key path, type, default, doc) for every key: the configuration reference."""
    rows: list[tuple[str, str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            key = f"{prefix}{f.name}"
            if _is_section(tp):
                walk(tp, key + ".")
                continue
            factory: Any = f.default_factory
            default = factory() if factory is not dataclasses.MISSING else f.default
            doc = f.metadata.get("doc", "")
            if f.metadata.get("alias"):
                doc += f" (also read as `{f.metadata['alias']}`)"
            rows.append(
                (
                    key,
                    _type_name(tp),
                    repr(default) if not isinstance(default, PyObjectRef) else str(default),
                    doc,
                )
            )

    walk(Config, "")
    return rows


def reference_markdown() -> str:
    """The configuration reference page (``docs/configuration.md``), generated from the schema."""
    from unison.config.resolve import SLOTS

    lines = [
        "# Configuration reference",
        "",
        "Every key a run config may set, its type and its default. Sections and keys left out",
        "take their defaults; `model.type` and `data.build` are required. `!pyobject dotted.path`",
        "names a class or function for a key that takes one (see below). Override any key from",
        "the command line with `--set section.key=value` (the value is read as YAML).",
        "",
        "This page is generated from `unison/config/schema.py`; a test keeps them equal.",
        "",
        "| key | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for key, type_name, default, doc in schema_reference():
        cell = type_name.replace("|", "\\|")
        lines.append(f"| `{key}` | {cell} | `{default}` | {doc} |")
    lines += [
        "",
        "## What a config can and cannot do",
        "",
        "Configs travel: copied from papers, colleagues and issue threads. Reading a config and",
        "resolving it imports modules and looks objects up, but calls nothing except the objects",
        "the keys below accept, and nothing a config names can write files, run commands or",
        "import arbitrary modules.",
        "",
        "- **YAML is data.** The loader is PyYAML's safe loader plus `!pyobject`, which only makes",
        "  an inert reference; Python tags (`!!python/object/apply` ...) are refused. A document",
        "  over 1 MiB, nested deeper than 64 levels, or expanding to more than 100000 values",
        "  through its aliases (an alias bomb, a recursive alias) is refused before it is built. A",
        "  key or section given twice is refused, naming both lines.",
        "- **Which modules a `!pyobject` may come from.** torch, ignite and unison (always the",
        "  installed ones); modules beside the config file; and your own modules named under",
        "  `imports:`. Nothing else, and never private names (`_x`), `os`, `subprocess`,",
        "  `builtins`, `torch.hub`, `torch.load` and the like.",
        "- **What `imports:` trusts.** Your own code: a module beside the config, or one installed",
        "  or on `sys.path` that is not in Python's standard library, not torch, ignite or unison,",
        "  not a library unison depends on, and not a data loader (`numpy`, `joblib`, `pandas`,",
        "  `yaml` ...). An entry naming one of those is refused. Functions of these modules may",
        "  fill the keys that take your functions; nothing else of theirs can.",
        "- **Modules beside the config** are imported by file path under a private package name,",
        "  the same in every rank; the config's folder is never put on `sys.path`, so a `tqdm.py`",
        "  or `torch.py` there cannot replace the installed package. Modules there import each",
        "  other relatively (`from . import helpers`).",
        "- **Every key that takes a `!pyobject` says what it accepts**, and the object is checked",
        "  before anything is called:",
        "",
        "| key | accepts |",
        "|---|---|",
    ]
    for key, slot in _slot_keys():
        lines.append(f"| `{key}` | {SLOTS[slot].accepts} |")
    lines += [
        "| `validation.metrics.<name>` (or its `type`) | " + SLOTS["metric"].accepts + " |",
        "| any `!pyobject` inside `kwargs` | " + SLOTS["value"].accepts + " |",
        "",
        "Anything else is refused with the file, the line, the key, what was found (for example",
        "`function torch.utils.collect_env.run`) and what the key accepts.",
        "",
        "- **Checked before any rank starts:** every `kwargs` mapping against the signature it",
        "  will be called with (unknown or missing arguments, with the nearest name), the model",
        "  built on the `meta` device with its optimizer and scheduler, the metrics built,",
        "  `training.device` against this machine, and the output folder (it must be writable).",
        "  `data.build` is not called before spawn: its signature is checked.",
        "- **The run's `name`** is one folder name: `/`, `\\`, `..` and `~` are refused, so a run",
        "  stays inside `logging.root`.",
        "- **Which checkpoint is best:** when `checkpoint.mode` is left out, a loss-like watched",
        "  metric (`loss`, `*_loss`, `mse`, `mae`, `perplexity` ...; `loss` is watched when",
        "  `validation.metrics` is empty) is minimised, others maximised. A mode that contradicts",
        "  the metric's name (`mode: max` on a loss, `mode: min` on an accuracy) is refused.",
    ]
    return "\n".join(lines) + "\n"


def _slot_keys() -> list[tuple[str, str]]:
    """(key path, slot) of every schema key that takes a ``!pyobject``."""
    found: list[tuple[str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = _hints(cls)
        for f in dataclasses.fields(cls):
            if _is_section(hints[f.name]):
                walk(hints[f.name], f"{prefix}{f.name}.")
            elif f.metadata.get("slot"):
                found.append((f"{prefix}{f.name}", f.metadata["slot"]))

    walk(Config, "")
    return found
