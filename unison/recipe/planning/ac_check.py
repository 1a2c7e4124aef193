"""``parallel.activation_checkpointing`` checked in the launching process, on the meta model.

The rule must choose at least one block of the model: a class name it lacks, a class whose
instances hold no parameters, or ``auto`` on a model without repeated blocks is refused here,
at the key's file and line, before any rank is spawned.
"""

from __future__ import annotations

from torch import nn

from unison.distributed.activation_ckpt import ac_spec, checkpointed_blocks
from unison.distributed.fsdp import FSDPOptions
from unison.recipe.planning.references import _References
from unison.recipe.planning.step_plans import ModelPlan

KEY = "parallel.activation_checkpointing"


def check_activation_checkpointing(plan: ModelPlan, model: nn.Module | None, refs: _References) -> None:
    """The rule's value (``plan``: the model's plan), and (when the model could be built on the meta
    device) that it chooses blocks.

    Raises:
        ConfigError: at ``parallel.activation_checkpointing``, naming the value and the model's classes.
    """
    value = plan.activation_checkpointing
    try:
        rule = ac_spec(list(value) if isinstance(value, tuple) else value, KEY)  # as written, in messages
        if rule is None or model is None:
            return
        fsdp = None
        if plan.fsdp is not None:
            shard = plan.fsdp["shard"]
            fsdp = FSDPOptions(shard=shard if shard == "auto" or not isinstance(shard, str) else (shard,))
        checkpointed_blocks(model, rule, fsdp, KEY)
    except ValueError as err:
        raise refs.error(KEY, str(err).replace(f"{KEY}=", "", 1).replace(f"{KEY} ", "", 1)) from None
