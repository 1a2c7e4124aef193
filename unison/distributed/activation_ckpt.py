"""Activation checkpointing: chosen blocks recompute their activations in the backward pass.

A checkpointed block keeps only its inputs from the forward pass; the backward pass runs
its forward again to get the activations it needs, trading about one more forward of the
block for the memory of everything it computed inside. Which blocks: ``"auto"`` takes the
same blocks as FSDP2's units (:mod:`unison.distributed.fsdp`: with ``strategy="fsdp"`` its
``shard`` rule, otherwise the repeated blocks, every class with two or more instances
holding parameters, outermost first) that are made of layers (a lone ``Linear`` would gain
nothing), or a list of class names (any module, as named).

The mechanism is torch's non-reentrant ``torch.utils.checkpoint.checkpoint``, applied in
place: each chosen block's ``forward`` becomes a call of its class's forward through
``checkpoint``. The block keeps its class, its place in the model and its ``state_dict``
keys (``checkpoint_wrapper`` would add ``_checkpoint_wrapped_module.`` to every name
under it), so a checkpoint saved with activation checkpointing loads without it and the
other way round. Why this and not torch's other two forms:

- ``torch.distributed._composable.checkpoint`` also keeps the keys, but works through a
  generator held between a forward pre-hook and a forward hook; ``torch.compile`` does not
  trace that pair, and in torch 2.13 a compiled model with such blocks fails in backward
  (the recomputed tensors' metadata differ from the saved ones).
- ``torch.utils.checkpoint.checkpoint`` called in ``forward`` is what dynamo captures as a
  region to recompute (its ``tag_activation_checkpoint`` operator), so the compiled graph
  recomputes the block too; FSDP2's hooks stay outside the region (they run around
  ``forward``, in the module's call), as with ``checkpoint_wrapper`` applied before
  ``fully_shard``: the backward gathers a unit's parameters before the block is recomputed.

Randomness: ``checkpoint`` saves the RNG state at the forward and restores it for the
recomputation (``preserve_rng_state``), so dropout draws the same mask twice and the
gradients are those of the plain model. Under ``torch.no_grad`` (evaluation, prediction)
the block runs its plain forward: nothing is saved, so nothing is recomputed.

Buffers: the recomputation runs on copies of the block's buffers, dropped when it ends
(:class:`_ScratchBuffers`, the recompute half of ``checkpoint``'s ``context_fn``), so a
buffer the forward updates is updated once per step, as without: BatchNorm's running
statistics and ``num_batches_tracked`` (in training mode its output uses the batch's own
statistics, so the copies give the same activations). Under ``torch.compile`` the graph
applies a buffer's update once, in the forward, and recomputes only activations.

The order :func:`~unison.distributed.model.prepare_model` uses: move the model, checkpoint
the blocks, then wrap (DDP) or shard (FSDP2), then compile.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from unison.distributed.fsdp import FSDPOptions
from unison.distributed.units import auto_units, candidates, named_units, outermost

ActivationCheckpointing = bool | str | Sequence[str]
"""``False`` (none), ``"auto"`` (or True), one class name or a list of class names."""


def ac_spec(value: Any, who: str = "activation_checkpointing") -> str | tuple[str, ...] | None:
    """The blocks rule of ``value``: None for off, ``"auto"``, or a tuple of class names.

    Example:
        >>> ac_spec(False), ac_spec(True), ac_spec("Block"), ac_spec(["A", "B"])
        (None, 'auto', ('Block',), ('A', 'B'))

    Raises:
        ValueError: naming ``who`` and the value, for anything else.
    """
    if value is None or value is False:
        return None
    if value is True or value == "auto":
        return "auto"
    if isinstance(value, str) and value:
        return (value,)
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise ValueError(
        f"{who}={value!r}: expected false, 'auto' (the repeated blocks; FSDP2's units with strategy fsdp) "
        "or a non-empty list of class names such as ['TransformerEncoderLayer']."
    )


def checkpointed_blocks(
    model: nn.Module,
    rule: str | Sequence[str],
    fsdp: FSDPOptions | None = None,
    who: str = "activation_checkpointing",
) -> list[nn.Module]:
    """The submodules ``rule`` chooses in ``model``, outermost first (never the model itself).

    ``"auto"``: with ``fsdp`` given, the units of its ``shard`` rule; otherwise the repeated
    blocks (:func:`~unison.distributed.units.auto_units`); of these, the ones made of layers
    (with submodules): a lone layer such as a ``Linear`` keeps only its input and weight for
    the backward pass, which a recomputation would need as well, so it gains nothing.

    Raises:
        ValueError: a class name the model lacks, or nothing to checkpoint; the message
            lists the model's submodule classes that hold parameters.
    """
    if rule == "auto":
        if fsdp is not None and fsdp.shard != "auto":
            units = outermost(model, lambda m: type(m).__name__ in set(fsdp.shard))
        else:
            units = auto_units(model)
        blocks = [unit for unit in units if any(True for _ in unit.children())]
        if not blocks:
            raise ValueError(
                f"{who}='auto': the model ({type(model).__name__}) has no repeated blocks to recompute (no class "
                "with two or more instances holding parameters and made of layers; a lone layer such as a Linear "
                f"keeps nothing a recomputation would save). Name the classes instead, from {candidates(model)}, "
                "or leave it off."
            )
        return blocks
    blocks = named_units(model, rule, who)
    if not blocks:
        raise ValueError(
            f"{who}={sorted(set(rule))}: no instance of these classes holds parameters, so there is nothing to "
            f"recompute; choose from {candidates(model)}."
        )
    return blocks


def checkpoint_blocks(
    model: nn.Module, rule: ActivationCheckpointing, fsdp: FSDPOptions | None = None
) -> list[nn.Module]:
    """Makes the blocks ``rule`` chooses recompute their activations in backward, in place.

    Returns the blocks (none when ``rule`` is off). Apply it before wrapping in DDP,
    sharding or compiling (:func:`~unison.distributed.model.prepare_model` does). A block
    already checkpointed is left as it is.

    Example:
        >>> m = nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 1))
        >>> [type(b).__name__ for b in checkpoint_blocks(m, ["Linear"])], is_checkpointed(m[0])
        (['Linear', 'Linear'], True)

    Raises:
        ValueError: as :func:`ac_spec` and :func:`checkpointed_blocks`.
    """
    spec = ac_spec(rule)
    if spec is None:
        return []
    blocks = checkpointed_blocks(model, spec, fsdp)
    for block in blocks:
        if not is_checkpointed(block):
            # a partial, not a closure: a deep copy (an EMA's average) binds its own copy of the block
            block.forward = functools.partial(_checkpointed_forward, block)
    return blocks


def is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module`` recomputes its activations in backward (made so by :func:`checkpoint_blocks`)."""
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _checkpointed_forward


def _checkpointed_forward(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    forward = type(module).forward
    if not torch.is_grad_enabled():
        return forward(module, *args, **kwargs)
    if torch.compiler.is_compiling():  # dynamo takes only dispatch modes as contexts; see the module's note
        return checkpoint(forward, module, *args, use_reentrant=False, **kwargs)
    contexts = functools.partial(_contexts, module)
    return checkpoint(forward, module, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _contexts(module: nn.Module) -> tuple[nullcontext[None], _ScratchBuffers]:
    return nullcontext(), _ScratchBuffers(module)


class _ScratchBuffers:
    """Inside, every buffer of ``module`` (and its submodules) is a copy; on exit the originals are back.

    Reusable: a backward with ``retain_graph`` recomputes the block again, in the same context.
    The originals are never written, so their version counters (and anything autograd saved
    of them) stay as the forward left them.
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.originals: list[tuple[nn.Module, str, torch.Tensor]] = []

    def __enter__(self) -> None:
        for owner in self.module.modules():
            for name, buffer in owner._buffers.items():
                if buffer is not None:
                    self.originals.append((owner, name, buffer))
                    owner._buffers[name] = buffer.clone()

    def __exit__(self, *exc: object) -> None:
        for owner, name, buffer in self.originals:
            owner._buffers[name] = buffer
        self.originals = []
