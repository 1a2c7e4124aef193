"""Sharded checkpoints: every rank writes its own shards through torch's Distributed Checkpoint.

A sharded checkpoint is a folder, ``<prefix>-eEEEE-iIIIIIIIII.dcp/``, holding:

- a Distributed Checkpoint (DCP: ``.metadata`` and ``__<rank>_<n>.distcp`` files) of the
  states that are sharded: ``{name: state}`` for the models sharded with ``fully_shard``,
  their optimizers, and any object whose state holds DTensors (an EMA of a sharded model);
- ``rest.pt``: the rest of the checkpoint, the same dict as a single-file checkpoint
  (meta, trainer, sampler position, every rank's generators, the other objects, the
  config), whose ``meta["sharded"]`` names the states in the DCP. It loads with
  ``torch.load(weights_only=True)``;
- ``checksums.json``: the CRC-32 and size of every file, checked before a resume.

The folder is written under a temporary name, every file fsynced, then renamed and its
parent fsynced: a crash at any point leaves no folder that a resume could pick.

DCP stores each tensor by its key and its place in the whole tensor, so a checkpoint
written at N ranks loads at M: each rank reads the pieces of its new shards. Models and
optimizers go through torch's ``get_state_dict``/``set_state_dict``, whose keys are the
plain module's (no ``module.`` or ``_orig_mod.``): a DDP run loads a sharded checkpoint,
and a sharded run loads a single-file one (:func:`load_full_states`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.disk_full import unwritten
from unison.checkpoint.io import atomic_save, atomic_write_json, fsync_dir
from unison.checkpoint.optim_init import init_once
from unison.checkpoint.safe_dcp import safe_load
from unison.checkpoint.sharded_files import CHECKSUMS, REST, SUFFIX, file_checksum, folder_size
from unison.distributed.fsdp import is_dtensor, is_sharded
from unison.distributed.model import unwrap_model

if TYPE_CHECKING:
    from unison.checkpoint.dcp_files import Written  # imports DCP: only when saving


def is_sharded_checkpoint(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a sharded checkpoint folder (by its name; see :func:`sharded_complete`)."""
    return Path(path).suffix == SUFFIX


# --- which states are sharded -----------------------------------------------------------------


def _holds_dtensor(state: Any) -> bool:
    if isinstance(state, torch.Tensor):
        return is_dtensor(state)
    if isinstance(state, Mapping):
        return any(_holds_dtensor(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return any(_holds_dtensor(v) for v in state)
    return False


def _model_of(optimizer: torch.optim.Optimizer, to_save: Mapping[str, Any]) -> nn.Module:
    """The model of ``to_save`` whose parameters ``optimizer`` updates."""
    first = next((p for group in optimizer.param_groups for p in group["params"]), None)
    for obj in to_save.values():
        if isinstance(obj, nn.Module) and any(p is first for p in obj.parameters()):
            return unwrap_model(obj)
    raise CheckpointError(
        "A sharded checkpoint saves an optimizer through its model, and no model in to_save holds the "
        "optimizer's parameters: add the model to to_save (Checkpoint(to_save={'model': model, ...}))."
    )


def sharded_names(to_save: Mapping[str, Any]) -> list[str]:
    """The names of ``to_save`` whose states are sharded: sharded models, their optimizers, and
    objects whose ``state_dict()`` holds DTensors. Empty when nothing is sharded."""
    if not any(isinstance(o, nn.Module) and is_sharded(unwrap_model(o)) for o in to_save.values()):
        return []
    names = []
    for name, obj in to_save.items():
        if isinstance(obj, nn.Module):
            if is_sharded(unwrap_model(obj)):
                names.append(name)
        elif isinstance(obj, torch.optim.Optimizer):
            if any(is_dtensor(p) for group in obj.param_groups for p in group["params"]):
                names.append(name)
        elif _holds_dtensor(obj.state_dict()):
            names.append(name)
    return names


def dcp_states(to_save: Mapping[str, Any], names: list[str]) -> dict[str, Any]:
    """The states of ``names`` as DCP saves and loads them (models and optimizers keyed by
    parameter name, through torch's ``get_model_state_dict``/``get_optimizer_state_dict``).

    Collective for optimizers of sharded models with no state yet (torch initialises it):
    call on every rank.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    states: dict[str, Any] = {}
    for name in names:
        obj = to_save[name]
        if isinstance(obj, nn.Module):
            states[name] = get_model_state_dict(unwrap_model(obj))
        elif isinstance(obj, torch.optim.Optimizer):
            with init_once():
                states[name] = get_optimizer_state_dict(_model_of(obj, to_save), obj)
        else:
            states[name] = obj.state_dict()
    return states


def load_dcp_states(folder: Path, to_save: Mapping[str, Any], names: list[str]) -> None:
    """Collective: loads the DCP of ``folder`` into the objects ``names`` of ``to_save``, on every rank.

    Works at any world size and for sharded or plain models alike: DCP reads the pieces
    each rank's tensors need, through the safe reader (:func:`~unison.checkpoint.safe_dcp.safe_load`):
    nothing stored in the folder can run code.
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    states = dcp_states(to_save, names)
    safe_load(states, folder, no_dist=not torch.distributed.is_initialized())
    for name in names:
        obj = to_save[name]
        if isinstance(obj, nn.Module):
            set_model_state_dict(unwrap_model(obj), states[name])
        elif isinstance(obj, torch.optim.Optimizer):
            with init_once():
                set_optimizer_state_dict(_model_of(obj, to_save), obj, states[name])
        else:
            obj.load_state_dict(states[name])


def load_full_states(to_save: Mapping[str, Any], states: Mapping[str, Any], names: list[str]) -> None:
    """Loads whole (unsharded) states, as a single-file checkpoint holds them, into sharded objects.

    A model's weights are cut into this rank's shards; an optimizer's ``state_dict()``
    (keyed by parameter index) is re-keyed by parameter name in the optimizer's order.
    Collective: call on every rank.
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    full = StateDictOptions(full_state_dict=True)
    for name in names:
        obj, state = to_save[name], states[name]
        if isinstance(obj, nn.Module):
            if state and all(k.startswith("module.") for k in state):
                state = {k[len("module.") :]: v for k, v in state.items()}
            set_model_state_dict(unwrap_model(obj), dict(state), options=full)
        elif isinstance(obj, torch.optim.Optimizer):
            model = _model_of(obj, to_save)
            with init_once():
                set_optimizer_state_dict(model, obj, _by_name(obj, model, state), options=full)
        else:
            obj.load_state_dict(state)


def _by_name(optimizer: torch.optim.Optimizer, model: nn.Module, state: Mapping[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict()`` keyed by parameter index, re-keyed by parameter name."""
    names = {id(p): n for n, p in model.named_parameters()}
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved_ids = [i for group in state["param_groups"] for i in group["params"]]
    if len(saved_ids) != len(order):
        raise CheckpointError(
            f"The checkpoint's optimizer has {len(saved_ids)} parameters and this run's has {len(order)}: "
            "they are not the same model."
        )
    fqn = dict(zip(saved_ids, order, strict=True))
    groups = [{**g, "params": [fqn[i] for i in g["params"]]} for g in state["param_groups"]]
    return {"state": {fqn[i]: s for i, s in state["state"].items()}, "param_groups": groups}


# --- writing ----------------------------------------------------------------------------------


def temp_folder(final: Path) -> Path:
    """Where a sharded checkpoint is written before its rename: a hidden sibling of ``final``."""
    return final.with_name(f".{final.name}.tmp")


def write_shards(
    states: Mapping[str, Any], tmp: Path, *, process_group: Any = None, changed: str | None = None
) -> Written | None:
    """Collective: every rank writes its shards of ``states`` into ``tmp`` (fsynced), each rank
    checking beside its write that every tensor it writes is finite.

    ``process_group``: the group DCP's collectives run over (default: the default group).
    ``changed``: what this rank found changed in place while an asynchronous save copied it,
    named (rank 0 then keeps nothing: :class:`~unison.checkpoint.dcp_files.Written`).

    Returns:
        On rank 0, ``{file name: (size, crc32)}`` of the files each rank wrote, by rank (rank 0
        also writes ``.metadata``, after every rank's files are written), and the first tensor a
        rank wrote that is not finite (:class:`~unison.checkpoint.dcp_files.Written`); None
        elsewhere. They come with DCP's own gather of the ranks' write results (on a torch that
        would not hand them over, none: :func:`finish_folder` then reads every file back, and the
        save's finish loads the folder back to check it).

    Raises:
        CheckpointError: on every rank, for a full disk (naming the folder, the bytes needed
            and free); any other error as DCP gives it. ``tmp`` is removed either way.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import CheckpointException

    from unison.checkpoint.dcp_files import DirectWriter  # imports DCP: only when saving

    try:
        writer = DirectWriter(tmp)  # O_DIRECT, each file checksummed as it is written
        writer.changed = changed
        dcp.save(
            dict(states),
            storage_writer=writer,
            process_group=process_group,
            no_dist=not dist.is_initialized(),
        )
        return writer.gathered()
    except (Exception, CheckpointException) as err:  # the latter (a BaseException) wraps every rank's error
        if (error := unwritten(err, tmp, states)) is err:
            raise
        raise error from err


def finish_folder(
    tmp: Path, final: Path, rest: Mapping[str, Any], checksums: Mapping[str, tuple[int, int]]
) -> int:
    """Rank 0, after every rank's shards are durable: writes ``rest.pt`` and the checksums,
    fsyncs the folder, renames it to ``final`` and fsyncs the parent. Returns the folder's size.
    A file of the folder missing from ``checksums`` is read back for its own."""
    try:
        atomic_save(dict(rest), tmp / REST)
        sums = dict(checksums)
        sums[REST] = file_checksum(tmp / REST)
        for name in sorted(set(os.listdir(tmp)) - set(sums) - {CHECKSUMS}):
            sums[name] = file_checksum(tmp / name)
        atomic_write_json(
            {"files": {n: {"size": s, "crc32": c} for n, (s, c) in sorted(sums.items())}}, tmp / CHECKSUMS
        )
        fsync_dir(tmp)
    except Exception as err:
        if (error := unwritten(err, tmp)) is err:
            raise
        raise error from err
    if final.exists():  # the same position saved again (a resumed run): the new one replaces it
        shutil.rmtree(final)
    os.replace(tmp, final)
    fsync_dir(final.parent)
    return folder_size(final)
