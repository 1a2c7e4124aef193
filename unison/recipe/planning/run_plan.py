"""One pass from a config to the plan of its run: :func:`plan` returns a :class:`RunPlan`.

The pass resolves every ``!pyobject`` slot (:func:`~unison.recipe.planning.resolved.resolve`) and
computes each value a run derives from its config, once: the watched metric and its mode,
the amp dtype, the learning-rate plan, the MLflow store, the output root, the early-stopping
handler, and what each build step reads: every section's loader
(:mod:`unison.recipe.planning.loader_plan`), the model's wrapping, the trainer's step, the guards, the
checkpoint, logging and the test phase (:mod:`unison.recipe.planning.step_plans`). It starts nothing:
no process, no file, no model. :func:`~unison.recipe.build.preflight.preflight` checks the plan before any rank is
spawned; each rank builds its run from it (:func:`~unison.recipe.build.assemble.build_run`).

The plan is closed: it holds the values the run reads, the origin of every key for errors
(``refs``), the config's redacted record and its name, and no :class:`~unison.config.Config`;
nothing after the plan reads a config. It holds the objects a config names (classes of the
user's modules, imported by file path), which do not travel between processes: a spawned rank
receives the config and plans once, which gives the same plan (the pass reads the config and
the user's modules only); a process that planned (torchrun's rank, a run of one process) trains
from its plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from unison.config import Config, to_plain
from unison.config.batch_sizes import batch_sizes
from unison.config.watched import Watched, watched_of
from unison.distributed import detect_launcher, get_world_size
from unison.distributed.replica_group import ReplicaSettings
from unison.recipe.planning.accepted import AcceptedKeys, accepted_keys, compile_options
from unison.recipe.planning.config_record import config_record, config_yaml
from unison.recipe.planning.early_stop import EarlyStoppingPlan, early_stopping_plan
from unison.recipe.planning.handlers_plan import UserHandler, handlers_plan
from unison.recipe.planning.loader_plan import LoaderPlans, loader_plans, training_data_key
from unison.recipe.planning.lr_plan import LRPlan, lr_plan
from unison.recipe.planning.references import _References
from unison.recipe.planning.replica_plan import replica_settings
from unison.recipe.planning.resolved import MetricSpec, Resolved, metric_specs, resolve
from unison.recipe.planning.resume_base import ResumeBase, resume_base
from unison.recipe.planning.step_plans import (
    CheckpointPlan,
    ControlPlan,
    FinishPlan,
    LaunchPlan,
    LoggingPlan,
    ModelPlan,
    TrainerPlan,
    checkpoint_plan,
    control_plan,
    finish_plan,
    launch_plan,
    logging_plan,
    model_plan,
    trainer_plan,
)
from unison.recipe.planning.tracking_store import check_mlflow, root_setting, store
from unison.recipe.planning.wandb_plan import check_wandb


@dataclass(frozen=True)
class RunPlan:
    """A config, what it names, and every value a run derives from it, each computed once.

    Attributes:
        name: the config's ``name`` (its runs go to ``<root>/<name>``).
        refs: how its references resolve, and the file and line of each key for errors (its
            ``origin``): built once, here.
        record: the config as plain data, URL credentials masked: what a resume compares with the
            saved run's, and what ``hooks.after_training`` is given.
        record_yaml: the same as the YAML a run folder's ``config.yaml`` holds (None: the config holds
            an object YAML cannot write, one built in Python, which builds parts but is not run).
        log_level: ``log_level`` (every rank's console), None for the default.
        device: ``training.device``, None: each rank takes its own.
        launch: how the ranks start (``parallel``'s backend, timeout, rendezvous, ranks per node).
        data_key: the key that names the training data and the fix, where an empty epoch is reported.
        resolved: the objects it names, imported and checked.
        watched: the metric checkpoints rank by, the one early stopping follows, and their modes
            (also what ``tuning.metric`` defaults to).
        amp: the autocast dtype of training and evaluation (``training.amp``), None when off.
        seed: the seed of every generator before the data is built (``training.seed``).
        loaders: each section's loader, its defaults from the section before it applied.
        model: how the model is wrapped: strategy, FSDP2 and DDP options, compile, SyncBatchNorm.
        trainer: the trainer's step (accumulation, clipping, sync points), scheduler period, epochs.
        control: the non-finite guard, time limit, watchdog, validation's period, the EMA.
        checkpoint: the checkpoint handler's settings and the config's record; None when off.
        logging: TensorBoard and its HParams, the profiler, the progress bar, MLflow's run.
        finish: the test phase: the test set, the best weights, the predictions.
        accepted: other trainers' keys that the run reports once (:mod:`unison.recipe.planning.accepted`).
        lr: the learning-rate plan at one rank (:meth:`~unison.recipe.planning.lr_plan.LRPlan.at`
            gives it at a run's world size).
        optimizer_kwargs: the optimizer's keyword arguments, ``training.lr`` applied (before scaling).
        tracking: ``(tracking URI, artefact location)`` of ``logging.mlflow``, None when it is off.
        early_stopping: the early-stopping handler to build, None without ``early_stopping.patience``.
        root: the folder runs go to, as written; ``root_key`` is the key that names it.
        ema_evaluated: whether the average of the weights (``training.ema``) is what the run
            validates, tests and predicts with.
        world_size: the ranks of the run planned for: each section's batch per rank is planned
            for it (``global_batch_size`` divided among them), and ``data.build`` is told it when
            it asks (a parameter named ``world_size``).
        handlers: the user's own handlers (``handlers``), resolved and checked
            (:mod:`unison.recipe.build.user_handlers`).
        resume: what a resume compares with the checkpoint's: this config's base learning rate at
            ``world_size`` ranks, its optimizer and scheduler keyword arguments
            (:mod:`unison.recipe.planning.resume_base`).
        metrics: the metrics each evaluation builds (``validation``, ``testing``), the loss rule
            applied (:func:`~unison.recipe.planning.resolved.metric_specs`).
        replica: this process's replica group of a torchft job (``parallel.fault_tolerance``), None
            when off: the build joins the group's quorum (:mod:`unison.recipe.build.replica_steps`).
    """

    name: str
    refs: _References
    record: dict[str, Any]
    record_yaml: str | None
    log_level: str | None
    device: str | None
    launch: LaunchPlan
    data_key: tuple[tuple[str, ...], str]
    resolved: Resolved
    watched: Watched
    amp: Literal["bf16", "fp16"] | None
    seed: int
    loaders: LoaderPlans
    model: ModelPlan
    trainer: TrainerPlan
    control: ControlPlan
    checkpoint: CheckpointPlan | None
    logging: LoggingPlan
    finish: FinishPlan
    accepted: AcceptedKeys
    lr: LRPlan
    optimizer_kwargs: dict[str, Any]
    tracking: tuple[str, str | None] | None
    early_stopping: EarlyStoppingPlan | None
    root: Path
    root_key: str
    ema_evaluated: bool
    resume: ResumeBase
    metrics: dict[str, dict[str, MetricSpec]]
    world_size: int = 1
    handlers: tuple[UserHandler, ...] = ()
    replica: ReplicaSettings | None = None

    @property
    def run_root(self) -> Path:
        """The folder this config's runs go to: ``<root>/<name>``; one replica group's,
        ``<root>/<name>-replica<id>`` (two groups on one machine share no folder, no lock)."""
        if self.replica is not None:
            return self.root / f"{self.name}-replica{self.replica.replica_id}"
        return self.root / self.name


def amp_dtype(config: Config) -> Literal["bf16", "fp16"] | None:
    """The autocast dtype of ``training.amp``: None for ``"none"``."""
    amp = config.training.amp
    return None if amp == "none" else amp


def launch_world_size(config: Config, nproc: int | None = None) -> int:
    """The world size a launch of ``config`` has, known before any rank starts: the launcher's
    (``WORLD_SIZE`` under torchrun, ``SLURM_NTASKS`` under srun), else ``nproc`` (``--nproc``),
    else ``parallel.nproc_per_node``, else 1 (one process)."""
    launcher = detect_launcher()
    if launcher.kind != "none":
        return launcher.world_size
    return nproc if nproc is not None else config.parallel.nproc_per_node or 1


def plan(config: Config, resolved: Resolved | None = None, world_size: int | None = None) -> RunPlan:
    """The plan of ``config``'s run: every slot resolved, every derived value computed once.

    Args:
        config: a validated config.
        resolved: what :func:`~unison.recipe.planning.resolved.resolve` returned for it, when the caller
            has it already; resolved here otherwise.
        world_size: the ranks the run will have (:func:`launch_world_size` before they start);
            default this process group's size (1 outside one).

    Raises:
        ConfigError: naming the file, line and key of the first slot that is refused, a
            ``global_batch_size`` that does not divide over ``world_size`` ranks, a tracking
            store a config may not name, or an early-stopping handler that cannot be built.
    """
    world = world_size if world_size is not None else get_world_size()
    sizes = batch_sizes(config, world)  # before resolving: a size that cannot divide fails first
    refs = _References.of(config)  # the one locator of the run: every check and error takes it from the plan
    resolved = resolved if resolved is not None else resolve(config, refs)
    check_mlflow(config)  # logging.mlflow: installed, names given, every at sync points
    check_wandb(config)  # logging.wandb: the same, and its tags
    t = config.training
    loaders = loader_plans(config, resolved.batches.collate, sizes)
    watched = watched_of(config, list(resolved.metrics))
    root_key, root = root_setting(config)
    lr = {"lr": t.lr} if t.lr is not None else {}
    return RunPlan(
        name=config.name,
        refs=refs,
        record=config_record(config),
        record_yaml=config_yaml(config),
        log_level=config.log_level,
        device=t.device,
        launch=launch_plan(config),
        data_key=training_data_key(config),
        resolved=resolved,
        watched=watched,
        amp=amp_dtype(config),
        seed=t.seed,
        loaders=loaders,
        model=model_plan(config, compile_options(config)),
        trainer=trainer_plan(config),
        control=control_plan(config),
        checkpoint=checkpoint_plan(config),
        logging=logging_plan(config),
        finish=finish_plan(config, sizes),
        accepted=accepted_keys(config, loaders),
        lr=lr_plan(config, 1),
        optimizer_kwargs={**resolved.optimizer_kwargs, **lr},
        tracking=None if config.logging.mlflow is None else store(config),
        early_stopping=early_stopping_plan(config, refs, watched),
        root=root,
        root_key=root_key,
        ema_evaluated=t.ema is not None and bool(t.ema.evaluate),
        resume=resume_base(to_plain(t), resolved, world),
        metrics={section: metric_specs(resolved, section) for section in ("validation", "testing")},
        world_size=world,
        handlers=handlers_plan(config, refs),
        replica=replica_settings(config),
    )
