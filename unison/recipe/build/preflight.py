"""Checking the run in the launching process, before any rank is spawned.

:func:`preflight` takes the run's plan (:func:`~unison.recipe.plan`), never the config (what
the config alone decides, the plan checked), and checks what needs this machine or the built
model: it builds what it can without memory or data (the model on the ``meta`` device, its
optimizer and scheduler, the validation metrics) and checks ``training.device`` against this
machine and that the output folder can be written.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch
from torch import nn

from unison.config import ConfigError
from unison.config.usercode import describe
from unison.distributed.env import port_is_free
from unison.distributed.model import find_unused_from_env
from unison.distributed.units import named_units
from unison.recipe.planning.ac_check import check_activation_checkpointing
from unison.recipe.planning.references import _References
from unison.recipe.planning.resolved import Resolved
from unison.recipe.planning.run_plan import RunPlan
from unison.utils import get_logger

_log = get_logger("unison.recipe.build.preflight")


def preflight(plan: RunPlan, *, trains_here: bool = False) -> None:
    """Checks, in the launching process, what would otherwise fail only once ranks run.

    Checks ``training.device`` against this machine and that the output folder
    (``training.path`` or ``logging.root``) can be written; builds the model on the
    ``meta`` device (no memory, no data), the optimizer on its parameters and the
    scheduler on that optimizer, and the validation metrics. The data builder is never
    called (it may be expensive): :func:`~unison.recipe.planning.resolved.resolve` checked its signature.

    The checks leave nothing behind in a process that trains. With ``trains_here`` (this
    process is a rank next: under torchrun or srun, or a run of one process that spawns
    none) the model is not built on the meta device: its constructor is the user's code,
    and a tensor it makes there (a corpus it reads and keeps in an ``lru_cache`` or a
    module global, for its vocabulary size) would stay a meta tensor and reach training.
    The optimizer and scheduler are then built on a stand-in parameter of the CPU, and the
    checks on the model itself (``parallel.fsdp.shard``, the blocks of
    ``parallel.activation_checkpointing``) are left to the rank's own build.

    Raises:
        ConfigError: naming the file, line and key of the first problem.
    """
    resolved, refs = plan.resolved, plan.refs
    _check_device(plan.device, refs)
    _check_output_root(plan, refs)
    _check_find_unused(plan.model.find_unused_parameters, refs)
    model = None if trains_here else _meta_model(resolved, refs)
    _meta_optimizer(plan, model, refs)  # without the meta model: on a stand-in parameter of the CPU
    if model is not None:
        _check_shard_rule(plan.model.fsdp, model, refs)
    check_activation_checkpointing(plan.model, model, refs)
    for name, (cls, kwargs) in plan.metrics["validation"].items():
        try:
            cls(**kwargs)
        except Exception as err:
            raise refs.error(
                f"validation.metrics.{name}", f"building {describe(cls)} raised {type(err).__name__}: {err}"
            ) from err


def _check_shard_rule(fsdp: dict[str, Any] | None, model: nn.Module, refs: _References) -> None:
    """``parallel.fsdp.shard`` names classes the model holds (checked on the meta model); ``fsdp``:
    the plan's FSDP2 options, None unless ``parallel.strategy`` is ``fsdp``."""
    shard = None if fsdp is None else fsdp["shard"]
    if shard is None or shard == "auto":
        return
    try:
        named_units(model, [shard] if isinstance(shard, str) else list(shard))
    except ValueError as err:
        raise refs.error(
            "parallel.fsdp.shard", str(err).replace("parallel.fsdp.shard names", "names")
        ) from None


def _check_find_unused(find_unused: bool | None, refs: _References) -> None:
    """``parallel.find_unused_parameters`` left out: ``DDP_FIND_UNUSED_PARAMETERS`` decides, and must
    read as a bool in this process (the ranks inherit it)."""
    if find_unused is not None:
        return
    try:
        find_unused_from_env()
    except ValueError as err:
        raise refs.error(
            "parallel.find_unused_parameters", f"left out, so the environment decides: {err}"
        ) from None


def _check_device(text: str | None, refs: _References) -> None:
    """``training.device``: a device this machine has (each rank still takes its own)."""
    if text is None:
        return
    key = "training.device"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError) as err:
        raise refs.error(
            key, f"{text!r} is not a device ({err}); use 'cpu' or 'cuda', or leave it out"
        ) from None
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    available = bool(getattr(backend, "is_available", lambda: False)())
    if not available:
        raise refs.error(
            key,
            f"{text!r} asks for {device.type}, which this machine does not have (torch.{device.type}."
            "is_available() is False); run on the CPU with `--set training.device=cpu` (or set "
            "`device: cpu` in the file), or leave training.device out: each rank takes its own device",
        )
    count = int(getattr(backend, "device_count", lambda: 0)())
    if device.index is not None and device.index >= count:
        raise refs.error(
            key,
            f"{text!r}: this machine has {count} {device.type} device(s) (0..{count - 1}); leave "
            "training.device out (each rank takes its own device)",
        )


def _check_output_root(plan: RunPlan, refs: _References) -> None:
    """The run folder ``<root>/<name>`` can be made: its nearest existing parent is a writable folder."""
    key, root = plan.root_key, plan.root
    probe = plan.run_root
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise refs.error(key, f"{probe} is a file, not a folder: runs cannot be written under {root}")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise refs.error(key, f"{probe} is not writable here: runs cannot be written under {root}")


_META_MESSAGES = ("meta tensor", "meta device")
"""What torch says when an operation needs data a meta tensor does not have (``.item()``,
``.cpu()``, ``.numpy()``); an operation with no meta kernel raises NotImplementedError."""


def _meta_only(err: BaseException) -> bool:
    """Whether ``err`` comes from the meta device itself (a real device would not raise it).

    Example:
        >>> _meta_only(RuntimeError("Tensor.item() cannot be called on meta tensors"))
        True
        >>> _meta_only(ValueError("metadata of the dataset is missing"))
        False
    """
    text = str(err).lower()
    return isinstance(err, NotImplementedError) or any(message in text for message in _META_MESSAGES)


def _meta_model(resolved: Resolved, refs: _References) -> nn.Module | None:
    """The model built on the ``meta`` device; None when it cannot be built there."""
    try:
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return resolved.model_type(*resolved.model_args, **resolved.model_kwargs)
    except ConfigError:
        raise
    except Exception as err:
        if _meta_only(err):
            _log.debug("the model cannot be built on the meta device (%s); not checked before spawn", err)
            return None
        raise refs.error(
            "model.kwargs" if resolved.model_kwargs else "model.type",
            f"building the model ({describe(resolved.model_type)}) raised {type(err).__name__}: {err}",
        ) from err


def _meta_optimizer(plan: RunPlan, model: nn.Module | None, refs: _References) -> None:
    """The optimizer on the meta model's parameters (without one: on a stand-in parameter, a real
    tensor of one element), and the scheduler on that optimizer."""
    resolved = plan.resolved
    if model is None:
        params = [nn.Parameter(torch.zeros(1))]
    else:
        params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise refs.error(
            "model.type", f"{describe(resolved.model_type)} built a model with no trainable parameters"
        )
    kwargs = dict(plan.optimizer_kwargs)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            optimizer = resolved.optimizer_type(params, *resolved.optimizer_args, **kwargs)
    except Exception as err:
        if _meta_only(err) or {"fused", "foreach", "capturable"} & set(kwargs):
            return
        raise refs.error(
            "training.optimizer_kwargs" if kwargs else "training.optimizer_type",
            f"building {describe(resolved.optimizer_type)} raised {type(err).__name__}: {err}",
        ) from err
    if resolved.scheduler_type is None:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            resolved.scheduler_type(optimizer, **resolved.scheduler_kwargs)
    except Exception as err:
        if _meta_only(err):
            return
        raise refs.error(
            "training.scheduler_kwargs" if resolved.scheduler_kwargs else "training.scheduler_type",
            f"building {describe(resolved.scheduler_type)} raised {type(err).__name__}: {err}",
        ) from err


def check_port(plan: RunPlan) -> None:
    """``parallel.master_port``, when given for a local spawn: free now, or an error naming it.

    Under torchrun or srun the launcher owns the rendezvous: this is not called there.
    """
    port, host = plan.launch.master_port, plan.launch.master_addr
    if port is None:
        return
    if not port_is_free(port, host):
        raise plan.refs.error(
            "parallel.master_port",
            f"{port} is in use on {host} (another job, or a leftover process): leave master_port out "
            "(a free port is picked) or choose another",
        )
