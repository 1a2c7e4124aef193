"""What each build step of a run reads, planned once: small frozen records of the plan.

:func:`~unison.recipe.planning.run_plan.plan` computes one of each from the config; the build steps
(:mod:`unison.recipe.build.assemble`) and the test phase (:mod:`unison.recipe.build.finish`) read them and
never the config:

- :class:`ModelPlan`: how the model is wrapped (``parallel`` and ``training.compile``);
- :class:`TrainerPlan`: how the trainer steps and how long it runs (``training``);
- :class:`ControlPlan`: the guards that stop or watch a run, and the average of the weights;
- :class:`CheckpointPlan`: the checkpoint handler and preemption (``checkpoint``);
- :class:`LoggingPlan`: TensorBoard, HParams, the profiler, the progress bar, MLflow, W&B (``logging``);
- :class:`LaunchPlan`: how the ranks start (``parallel``);
- :class:`FinishPlan`: what the run does after training (``testing``, ``predict``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch

from unison.config import Config
from unison.config.batch_sizes import BatchSizes, batch_sizes
from unison.distributed import device as rank_device
from unison.handlers.hparams import HParamValue
from unison.recipe.planning.config_record import config_record, hparams_of, params_of
from unison.recipe.planning.wandb_plan import WandbPlan, wandb_plan


@dataclass(frozen=True)
class ModelPlan:
    """How ``prepare_model`` wraps the model: ``parallel``'s strategy and options, ``training.compile``.

    ``compile`` is False when off and ``{}`` for torch's defaults; ``fsdp`` holds FSDP2's options
    with ``strategy: fsdp``, else None; ``output_device`` is DDP's, used on GPU ranks only;
    ``activation_checkpointing`` is the rule of the blocks that recompute their activations.
    """

    strategy: Literal["ddp", "fsdp"]
    fsdp: dict[str, Any] | None
    compile: bool | dict[str, Any]
    sync_batchnorm: bool
    find_unused_parameters: bool | None
    output_device: int | str | None
    activation_checkpointing: bool | str | tuple[str, ...] = False

    def ddp_options(self, device: torch.device | None = None) -> dict[str, Any]:
        """DDP's extra options on this rank's ``device``: ``output_device`` on a GPU, none on the CPU
        (where DDP returns the output on the model's device; :mod:`unison.recipe.planning.accepted` says so once).

        Example:
            >>> m = ModelPlan("ddp", None, False, False, None, 1)
            >>> m.ddp_options(torch.device("cuda", 1)), m.ddp_options(torch.device("cpu"))
            ({'output_device': 1}, {})
        """
        if self.output_device is None:
            return {}
        if (device if device is not None else rank_device()).type != "cuda":
            return {}
        return {"output_device": self.output_device}


@dataclass(frozen=True)
class TrainerPlan:
    """The ``training`` keys of the trainer's step and run: accumulation, clipping, sync points,
    when the scheduler steps, the epochs and their length."""

    accumulation_steps: int
    clip_grad_norm: float | None
    sync_every: int | None
    scheduler_every: Literal["epoch", "update"]
    max_epochs: int
    epoch_length: int | None


@dataclass(frozen=True)
class EMAPlan:
    """``training.ema``: the average's decay, its period and warmup in optimizer updates, and
    whether it is the model the run evaluates."""

    decay: float
    every: int
    warmup: int
    evaluate: bool


@dataclass(frozen=True)
class ControlPlan:
    """What stops or watches a run besides early stopping: the non-finite guard, the time limit,
    the hang watchdog (``training``), validation's period, and the average of the weights."""

    nonfinite_guard: bool
    time_limit: float | None
    hang_timeout: float | None
    validate_every: int
    ema: EMAPlan | None


@dataclass(frozen=True)
class CheckpointPlan:
    """The checkpoint handler's settings (``checkpoint``; ``every_epochs`` is ``training.checkpoint_at``
    when set) and ``record``, the config's copy each checkpoint stores (URL credentials masked)."""

    every_epochs: int | None
    every_iters: int | None
    every_seconds: float | None
    keep_last: int | None
    keep_best: int
    async_save: bool
    preemption: bool
    requeue: bool
    record: dict[str, Any]


@dataclass(frozen=True)
class MLflowPlan:
    """``logging.mlflow``'s run: its experiment (default the config's name), run name (None: the run
    folder's), parent, period and artefacts; the config as parameters, and the tags it gives."""

    experiment: str
    run_name: str | None
    parent_run_id: str | None
    every: int | None
    log_checkpoints: bool
    params: dict[str, str]
    strategy: str
    config_file: str | None


@dataclass(frozen=True)
class LoggingPlan:
    """TensorBoard (``tb_every``: the period of its learning-rate points; None when off) with its
    HParams session, the profiler window (``training.profile``), the progress bar, MLflow and W&B."""

    tb_every: int | None
    hparams: dict[str, HParamValue] | None
    profile: dict[str, Any] | None
    progress: bool
    mlflow: MLflowPlan | None
    wandb: WandbPlan | None = None


@dataclass(frozen=True)
class LaunchPlan:
    """How the ranks start (``parallel``): the backend, the process group's timeout, the rendezvous
    address and port (a local spawn's), and the ranks per node the config asks for."""

    backend: str | None
    timeout: float
    master_addr: str
    master_port: int | None
    nproc_per_node: int | None


@dataclass(frozen=True)
class FinishPlan:
    """After training: whether the test set is evaluated (and with the best checkpoint's weights),
    whether predictions are written (``predict.enabled``), and their batch size."""

    test: bool
    use_best: bool
    predict: bool
    predict_batch_size: int


def model_plan(config: Config, compile_options: dict[str, Any] | None) -> ModelPlan:
    """``config``'s :class:`ModelPlan`; ``compile_options`` as :func:`~unison.recipe.planning.accepted.compile_options`."""
    p = config.parallel
    return ModelPlan(
        strategy=p.strategy,
        fsdp=dataclasses.asdict(p.fsdp) if p.strategy == "fsdp" else None,
        compile=False if compile_options is None else compile_options,
        sync_batchnorm=p.sync_batchnorm,
        find_unused_parameters=p.find_unused_parameters,
        output_device=p.output_device,
        activation_checkpointing=(
            tuple(p.activation_checkpointing)
            if isinstance(p.activation_checkpointing, list)
            else p.activation_checkpointing
        ),
    )


def trainer_plan(config: Config) -> TrainerPlan:
    """``config``'s :class:`TrainerPlan`."""
    t = config.training
    return TrainerPlan(
        t.accumulation_steps, t.clip_grad_norm, t.sync_every, t.scheduler_every, t.max_epochs, t.epoch_length
    )


def control_plan(config: Config) -> ControlPlan:
    """``config``'s :class:`ControlPlan`."""
    t, e = config.training, config.training.ema
    ema = None if e is None else EMAPlan(e.decay, e.every, e.warmup, bool(e.evaluate))
    return ControlPlan(t.nonfinite_guard, t.time_limit, t.hang_timeout, config.validation.every, ema)


def checkpoint_plan(config: Config) -> CheckpointPlan | None:
    """``config``'s :class:`CheckpointPlan`; None when ``checkpoint.enabled`` is false."""
    ck = config.checkpoint
    if not ck.enabled:
        return None
    return CheckpointPlan(
        every_epochs=config.training.checkpoint_at or ck.every_epochs,
        every_iters=ck.every_iters,
        every_seconds=ck.every_seconds,
        keep_last=ck.keep_last,
        keep_best=ck.keep_best,
        async_save=ck.async_save,
        preemption=ck.preemption,
        requeue=ck.requeue,
        record=config_record(config),
    )


def logging_plan(config: Config) -> LoggingPlan:
    """``config``'s :class:`LoggingPlan`."""
    lg, m, window = config.logging, config.logging.mlflow, config.training.profile
    mlflow = None
    if m is not None:
        source = config.origin.file
        mlflow = MLflowPlan(
            experiment=m.experiment or config.name,
            run_name=m.run_name,
            parent_run_id=m.parent_run_id,
            every=m.every,
            log_checkpoints=m.log_checkpoints,
            params=params_of(config),
            strategy=str(config.parallel.strategy),
            config_file=str(source) if source else None,
        )
    return LoggingPlan(
        tb_every=lg.log_every if lg.tensorboard else None,
        hparams=hparams_of(config) if lg.tensorboard else None,
        profile=None if window is None else dataclasses.asdict(window),
        progress=lg.progress,
        mlflow=mlflow,
        wandb=wandb_plan(config),
    )


def launch_plan(config: Config) -> LaunchPlan:
    """``config``'s :class:`LaunchPlan`."""
    p = config.parallel
    port = None if p.master_port is None else int(p.master_port)
    return LaunchPlan(p.backend, p.timeout, p.master_addr, port, p.nproc_per_node)


def finish_plan(config: Config, sizes: BatchSizes | None = None) -> FinishPlan:
    """``config``'s :class:`FinishPlan`; ``sizes``: the batches per rank at the run's world size."""
    s, pr = config.testing, config.predict
    batch = (sizes if sizes is not None else batch_sizes(config, 1)).predict
    return FinishPlan(s.enabled, s.use_best, pr.enabled, batch)
