"""Rank functions of tests/cli/test_training_extras.py: runs built by the CLI's steps on 1-3 ranks.

``run_distributed`` sends a function by name; the ranks import this module (and
``_cli_parts``), not the test module.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from _cli_parts import config, planned

from unison.config.schema import LRScalingConfig
from unison.distributed import get_world_size, prepare_model, unwrap_model
from unison.recipe.build.assemble import build_model, build_run


def effective_lrs(batch_size: int, max_epochs: int = 5) -> dict[str, Any]:
    """The learning rate every optimizer step of this rank used, for the mapping and the string form.

    The data has 12 training samples: ``batch_size x world size = 12`` gives one update per
    epoch, the whole dataset, at every world size.
    """
    out: dict[str, Any] = {}
    forms: dict[str, Any] = {
        "mapping": LRScalingConfig(rule="linear", reference_batch_size=6, warmup_steps=3),
        "string": "linear",
    }
    for name, form in forms.items():
        c = config()
        c.training.batch_size = batch_size
        c.training.max_epochs = max_epochs
        c.training.lr_scaling = form
        with tempfile.TemporaryDirectory() as run_dir:
            parts = build_run(planned(c), Path(run_dir), get_world_size())
            used: list[float] = []
            parts.optimizer.register_step_pre_hook(
                lambda opt, a, k, used=used: used.append(opt.param_groups[0]["lr"])
            )
            parts.trainer.run(parts.train_loader, max_epochs=max_epochs)
        out[name] = used
        out[name + "_weights"] = torch.cat(
            [p.detach().reshape(-1) for p in unwrap_model(parts.model).parameters()]
        )
    return out


def ddp_find_unused() -> dict[str, bool]:
    """DDP's ``find_unused_parameters`` as the CLI builds the model: the config's value, else the variable."""
    seen = {}
    for env, value in ((None, None), ("true", None), ("1", False), ("no", True)):
        if env is None:
            os.environ.pop("DDP_FIND_UNUSED_PARAMETERS", None)
        else:
            os.environ["DDP_FIND_UNUSED_PARAMETERS"] = env
        c = config()
        c.parallel.find_unused_parameters = value
        model = build_model(planned(c))
        seen[f"env={env} config={value}"] = bool(model.find_unused_parameters)  # type: ignore[union-attr]
    return seen


def sync_batchnorm_on_cpu() -> str:
    """What prepare_model says when asked for SyncBatchNorm on CPU ranks (torch refuses it)."""
    try:
        prepare_model(
            torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)), sync_batchnorm=True
        )
    except ValueError as err:
        return str(err)
    return "no error"
