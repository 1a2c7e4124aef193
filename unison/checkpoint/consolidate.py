"""The full state of a checkpoint's objects, read in one process without a process group.

A checkpoint is a file ``<name>.pt`` (``objects`` holds each saved object's state), or a
sharded folder ``<name>.dcp/``: a Distributed Checkpoint (``.metadata``, ``.distcp`` files)
of ``{name: state}`` for the objects stored sharded, beside ``rest.pt``, the file's dict
without them. :class:`CheckpointReader` reads either into plain values (contiguous CPU
tensors, no ``DTensor``), whatever world size wrote the shards; :func:`full_objects` and
:func:`model_weights` are its one-call forms. Nothing here runs code from a checkpoint:
files load with ``torch.load(weights_only=True)``, ``.metadata`` unpickles with only DCP's
metadata classes allowed, and the shards are read through the one safe reader
(:mod:`unison.checkpoint.safe_dcp`): each non-tensor value must load with ``weights_only=True``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from unison.checkpoint.io import CheckpointError, is_complete, load_checkpoint
from unison.checkpoint.safe_dcp import safe_load
from unison.checkpoint.sharded_check import read_metadata, sharded_problem
from unison.checkpoint.sharded_files import REST

__all__ = [
    "EMA_OBJECT",
    "METADATA",
    "REST",
    "CheckpointReader",
    "checkpoint_problem",
    "full_objects",
    "model_weights",
    "strip_wrappers",
]

METADATA = ".metadata"
"""The Distributed Checkpoint's index of a sharded checkpoint folder."""

EMA_OBJECT = "handler:EMA"
"""The name under which a checkpoint holds an attached :class:`~unison.handlers.EMA`'s state."""

_WRAPPERS = ("module.", "_orig_mod.")


def checkpoint_problem(path: str | Path) -> str | None:
    """What makes the checkpoint at ``path`` unusable, as a phrase; None when it is whole.

    A file must be a whole ``torch.save`` archive (:func:`~unison.checkpoint.io.is_complete`);
    a sharded folder needs its ``.metadata``, every shard file it lists at its recorded
    length, and a whole ``rest.pt``; where the folder records its files' sizes and CRC-32s
    (``checksums.json``, as unison writes it), every file must match them. Without that
    record, flipped bytes inside a shard file are not seen.
    """
    path = Path(path)
    if not path.exists():
        return "it does not exist"
    if path.is_file():
        return None if is_complete(path) else "it is truncated or corrupt (its checksums do not match)"
    return sharded_problem(path, require_checksums=False)


def _plain(value: Any) -> Any:
    """``value`` with every tensor a contiguous CPU tensor; containers rebuilt as they were."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu").contiguous()
    if isinstance(value, Mapping):
        items = ((key, _plain(item)) for key, item in value.items())
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if isinstance(value, (list, tuple)):
        listed = [_plain(item) for item in value]
        return listed if isinstance(value, list) else tuple(listed)
    return value


class CheckpointReader:
    """One checkpoint, a file or a sharded folder, read on demand and never changed.

    Args:
        path: a checkpoint file, or a sharded checkpoint folder (``<name>.dcp``).

    Raises:
        CheckpointError: when first read, naming the path and what is wrong with it
            (missing, truncated, a missing shard file, a value ``weights_only`` refuses).

    Example:
        >>> import tempfile, torch
        >>> from unison.checkpoint.io import atomic_save
        >>> folder = tempfile.mkdtemp()
        >>> model = torch.nn.Linear(2, 1)
        >>> saved = {f"module.{k}": v for k, v in model.state_dict().items()}  # a DDP model's keys
        >>> path = atomic_save({"meta": {"epoch": 1, "iteration": 4}, "objects": {"model": saved}}, f"{folder}/c.pt")
        >>> reader = CheckpointReader(path)
        >>> reader.names(), sorted(reader.weights())
        (['model'], ['bias', 'weight'])
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._rest: dict[str, Any] | None = None
        self._metadata: Any = None

    @property
    def sharded(self) -> bool:
        """Whether this is a sharded checkpoint folder."""
        return self.path.is_dir()

    def check(self) -> None:
        """Raises :class:`CheckpointError` naming the path and what is wrong; nothing when it is whole."""
        problem = checkpoint_problem(self.path)
        if problem is not None:
            raise CheckpointError(
                f"Checkpoint {self.path} cannot be read: {problem}. Export another checkpoint (--checkpoint last "
                "falls back past damaged ones), or restore this one from a copy."
            )

    @property
    def rest(self) -> dict[str, Any]:
        """The checkpoint's dict (``meta``, ``trainer``, ``objects``...): a file's, or a folder's ``rest.pt``."""
        if self._rest is None:
            if self.sharded:  # a file is checked as it loads
                self.check()
                self._metadata = read_metadata(self.path)
            self._rest = load_checkpoint(self.path / REST if self.sharded else self.path)
            if not isinstance(self._rest.get("objects", {}), Mapping):
                raise CheckpointError(f"Checkpoint {self.path}: its 'objects' is not a dict of states.")
        return self._rest

    @property
    def meta(self) -> dict[str, Any]:
        """The ``meta`` record: epoch, iteration, score, world size..."""
        return dict(self.rest.get("meta", {}))

    def sharded_names(self) -> list[str]:
        """The objects stored in the folder's shards (none for a file), in saved order."""
        rest = self.rest  # reads the metadata too
        if not self.sharded:
            return []
        planner_data = getattr(self._metadata, "planner_data", None) or {}
        names = [path[0] if path else fqn.split(".")[0] for fqn, path in planner_data.items()]
        listed = [str(name) for name in rest.get("meta", {}).get("sharded", [])]
        return list(dict.fromkeys([*listed, *(str(name) for name in names)]))

    def names(self) -> list[str]:
        """Every object the checkpoint holds: those of ``objects``, then the sharded ones."""
        return list(dict.fromkeys([*self.rest.get("objects", {}), *self.sharded_names()]))

    def objects(self, names: Iterable[str] | None = None) -> dict[str, Any]:
        """The full, plain state of each named object (all of them when ``names`` is None).

        Raises:
            CheckpointError: for a name the checkpoint does not hold (the message lists
                those it holds), or shards that do not read.
        """
        held = self.names()
        wanted = held if names is None else list(names)
        missing = [name for name in wanted if name not in held]
        if missing:
            raise CheckpointError(
                f"Checkpoint {self.path} holds no object {', '.join(map(repr, missing))}; it holds "
                f"{', '.join(map(repr, held)) or 'none'}. Ask for one of those."
            )
        stored = self.rest.get("objects", {})
        sharded = [name for name in wanted if name not in stored]
        found = {name: stored[name] for name in wanted if name in stored}
        if sharded:
            found.update(self._read_shards(sharded))
        return {name: _plain(found[name]) for name in wanted}

    def _read_shards(self, names: list[str]) -> dict[str, Any]:
        state: dict[str, Any] = {}
        safe_load(state, self.path, keys=set(names), no_dist=True)
        return {name: state[name] for name in names if name in state}

    def ema_name(self) -> str:
        """The name of the EMA average's state: ``handler:EMA``, else the one ``handler:`` object of EMA's shape.

        Raises:
            CheckpointError: when the checkpoint holds no average (or several, none named ``handler:EMA``).
        """
        held = self.names()
        if EMA_OBJECT in held:
            return EMA_OBJECT
        stored = self.rest.get("objects", {})
        shaped = [
            n
            for n in held
            if isinstance(stored.get(n), Mapping) and {"weights", "n_averaged"} <= set(stored[n])
        ]
        if len(shaped) == 1:
            return shaped[0]
        raise CheckpointError(
            f"Checkpoint {self.path} holds {'several averages: ' + ', '.join(shaped) if shaped else 'no EMA average'} "
            f"(its objects: {', '.join(held) or 'none'}). An average is saved when the run had training.ema set "
            "(or an EMA handler attached to the trainer); export the trained weights instead (leave out --ema)."
        )

    def weights(self, *, ema: bool = False, name: str = "model") -> dict[str, Any]:
        """The model's weights as a plain ``state_dict``, DDP and compile prefixes removed.

        Args:
            ema: the EMA average's weights instead of the trained ones.
            name: the object that holds the model (``to_save``'s name for it).
        """
        if ema:
            key = self.ema_name()
            state = self.objects([key])[key]
            if not isinstance(state, Mapping) or not isinstance(state.get("weights"), Mapping):
                raise CheckpointError(f"Checkpoint {self.path}: {key} holds no 'weights' state_dict.")
            state = state["weights"]
        else:
            state = self.objects([name])[name]
            if not isinstance(state, Mapping):
                raise CheckpointError(
                    f"Checkpoint {self.path}: {name!r} holds a {type(state).__name__}, not a state_dict."
                )
        return strip_wrappers(state, source=f"{self.path}")


def strip_wrappers(state: Mapping[str, Any], *, source: str = "the state_dict") -> dict[str, Any]:
    """``state`` with the keys the plain model class expects.

    A ``module.`` (DDP, DataParallel) or ``_orig_mod.`` (``torch.compile``) that starts every
    key is removed, repeatedly, in any order; a ``_orig_mod`` part anywhere else in a key (a
    compiled submodule) is removed too. A lone ``module.`` that not every key has is a
    submodule's name and stays.

    Raises:
        CheckpointError: when two keys become the same.

    Example:
        >>> strip_wrappers({"module._orig_mod.fc.weight": 1, "module._orig_mod.enc._orig_mod.w": 2})
        {'fc.weight': 1, 'enc.w': 2}
    """
    keys = [str(key) for key in state]
    stripping = bool(keys)
    while stripping:
        stripping = False
        for wrapper in _WRAPPERS:
            if all(key.startswith(wrapper) for key in keys):
                keys = [key[len(wrapper) :] for key in keys]
                stripping = True
    keys = [_without_compiled(key) for key in keys]
    out = dict(zip(keys, state.values(), strict=True))
    if len(out) != len(keys):
        clash = sorted({key for key in keys if keys.count(key) > 1})
        raise CheckpointError(
            f"{source}: removing the module./_orig_mod. wrapper prefixes makes keys clash ({', '.join(clash[:5])}); "
            "the state_dict mixes wrapped and unwrapped copies of the same weights. Export it by hand."
        )
    return out


def _without_compiled(key: str) -> str:
    """``key`` without the ``_orig_mod`` parts of compiled submodules (the last part names a tensor)."""
    *modules, last = key.split(".")
    return ".".join([*(part for part in modules if part != "_orig_mod"), last])


def full_objects(path: str | Path, names: Iterable[str] | None = None) -> dict[str, Any]:
    """The full, plain states of the named objects (all when None): :meth:`CheckpointReader.objects`."""
    return CheckpointReader(path).objects(names)


def model_weights(path: str | Path, *, ema: bool = False, name: str = "model") -> dict[str, Any]:
    """The weights, keyed as the plain model class expects: :meth:`CheckpointReader.weights`."""
    return CheckpointReader(path).weights(ema=ema, name=name)
