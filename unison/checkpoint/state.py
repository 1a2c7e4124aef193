"""What goes into a checkpoint, in forms that ``torch.load(weights_only=True)`` accepts.

The parts (generator states, weights, the sampler's position, the meta record) and the
checks a resume makes, as functions of plain values: no engine, no files, no ranks.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from unison.checkpoint.checkpoint_error import CheckpointError
from unison.checkpoint.data_checks import check_data_positions
from unison.checkpoint.data_entry import check_data_entry, refuse_data_objects
from unison.checkpoint.retention import check_options as check_retention
from unison.distributed.model import unwrap_model
from unison.utils.logging import get_logger
from unison.utils.version import __version__

_log = get_logger(__name__)


def capture_rng() -> dict[str, Any]:
    """This process's random number generator states: Python, NumPy, torch CPU and CUDA."""
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    else:
        numpy_state: Any = np.random.get_state()
        name, keys, pos, has_gauss, cached = numpy_state
        state["numpy"] = {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: Mapping[str, Any]) -> None:
    """Puts back the generator states taken by :func:`capture_rng`."""
    py = state["python"]
    random.setstate((py["version"], tuple(int(v) for v in py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        st = state["numpy"]
        np.random.set_state(
            (st["name"], st["keys"].numpy().astype(np.uint32), st["pos"], st["has_gauss"], st["cached"])
        )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda_states)


def model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The weights of a model without any DDP wrapper: keys have no ``module.`` prefix."""
    return unwrap_model(model).state_dict()


def load_model_state(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Loads weights saved with or without DDP's ``module.`` prefix into a plain or DDP model."""
    if state and all(key.startswith("module.") for key in state):
        state = {key[len("module.") :]: value for key, value in state.items()}
    unwrap_model(model).load_state_dict(state)


def to_cpu_copy(obj: Any, reuse: Any = None) -> Any:
    """A deep copy of nested containers with every tensor copied to CPU memory.

    What an asynchronous save writes, while training goes on changing the originals.
    With ``reuse``, an earlier copy of the same structure that nothing reads any more,
    tensors of matching shape and dtype are copied into its buffers instead of freshly
    allocated ones: allocating is most of the cost of a copy.
    """
    if isinstance(obj, torch.Tensor):
        if (
            isinstance(reuse, torch.Tensor)
            and reuse.shape == obj.shape
            and reuse.dtype == obj.dtype
            and reuse.device.type == "cpu"
            and reuse.is_contiguous()
        ):
            return reuse.copy_(obj.detach())
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, Mapping):
        previous = reuse if isinstance(reuse, Mapping) else {}
        return {k: to_cpu_copy(v, previous.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        earlier = reuse if isinstance(reuse, (list, tuple)) and len(reuse) == len(obj) else [None] * len(obj)
        copied = [to_cpu_copy(v, p) for v, p in zip(obj, earlier, strict=True)]
        return copied if isinstance(obj, list) else tuple(copied)
    return obj


# --- the payload ------------------------------------------------------------------------------

FORMAT = 1
"""The layout version of a checkpoint's dict; a resume refuses any other."""

RESERVED = frozenset({"meta", "trainer", "sampler", "data", "rng", "config"})
"""Names a ``to_save`` mapping may not use."""


class Position(NamedTuple):
    """Where a training loop stands: completed epochs, iterations, and iterations per epoch.

    Example:
        >>> Position(epoch=2, iteration=7, epoch_length=5).mid_epoch
        True
    """

    epoch: int
    iteration: int
    epoch_length: int | None
    """None (or 0) when the data has no length."""
    into_epoch: int | None = None
    """Iterations done of an epoch not yet completed, when the loop knows it (unison's Engine:
    ``epoch_position``); None to derive it from ``iteration % epoch_length``."""

    @property
    def mid_epoch(self) -> bool:
        """Whether the position is inside an epoch rather than at its end."""
        if self.into_epoch is not None:
            return self.into_epoch > 0
        return bool(self.epoch_length and self.iteration % self.epoch_length)


def check_options(
    every_epochs: int | None,
    every_iters: int | None,
    keep_last: int | None,
    keep_best: int,
    metric: str | None,
    mode: str,
) -> None:
    """Checks a Checkpoint's options.

    Raises:
        ValueError: naming the option, for a bad interval, retention or mode.
    """
    for name, value in (("every_epochs", every_epochs), ("every_iters", every_iters)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"Checkpoint({name}={value!r}) must be a positive int or None.")
    check_retention(keep_last=keep_last, keep_best=keep_best, mode=mode, who="Checkpoint")
    if keep_best and metric is None:
        raise ValueError(
            f"Checkpoint(keep_best={keep_best}) needs metric=<name of a score> to rank checkpoints by."
        )


def check_to_save(to_save: Mapping[str, Any]) -> None:
    """Checks the objects given to a Checkpoint: a name each, none reserved, each with a state,
    no training data (:func:`~unison.checkpoint.data_entry.refuse_data_objects`).

    Raises:
        ValueError: for an empty mapping, a reserved name, or a loader or dataset.
        TypeError: for an object that is neither a model nor has ``state_dict()``.
    """
    if not isinstance(to_save, Mapping) or not to_save:
        raise ValueError("Checkpoint(to_save=...) needs a non-empty mapping of name -> object to save.")
    refuse_data_objects(to_save)  # the data state is saved per rank, under the reserved "data"
    for name, obj in to_save.items():
        if name in RESERVED:
            raise ValueError(
                f"Checkpoint(to_save={{{name!r}: ...}}): {name!r} is reserved; use another name."
            )
        if not isinstance(obj, nn.Module) and not callable(getattr(obj, "state_dict", None)):
            raise TypeError(
                f"Checkpoint(to_save={{{name!r}: ...}}): a {type(obj).__name__} has no state_dict(); pass "
                "models, optimizers, schedulers, scalers or handlers with state_dict()/load_state_dict()."
            )


def object_states(to_save: Mapping[str, Any]) -> dict[str, Any]:
    """Each object's state: a model's weights without DDP's prefix, anything else's ``state_dict()``."""
    return {
        name: model_state(obj) if isinstance(obj, nn.Module) else obj.state_dict()
        for name, obj in to_save.items()
    }


def load_object_states(to_save: Mapping[str, Any], states: Mapping[str, Any]) -> None:
    """Loads what :func:`object_states` saved back into the objects of ``to_save``."""
    for name, obj in to_save.items():
        if isinstance(obj, nn.Module):
            load_model_state(obj, states[name])
        else:
            obj.load_state_dict(states[name])


def library_versions() -> dict[str, str]:
    """The versions of unison, torch and ignite, for the record."""
    import ignite

    return {"unison": __version__, "torch": str(torch.__version__), "ignite": str(ignite.__version__)}


def checkpoint_meta(
    at: Position,
    *,
    world_size: int,
    batch_size: int | None,
    accumulation_steps: int,
    score: float | None,
    metric: str | None,
    saved_at: float,
) -> dict[str, Any]:
    """The ``meta`` entry of a checkpoint: where the run was, and the layout it ran with.

    Args:
        at: the trainer's position at the save.
        world_size: the number of ranks.
        batch_size: the per-rank batch size of the training data, if known.
        accumulation_steps: micro-batches per optimizer update.
        score: the value of ``metric`` at the save, if any.
        metric: the name of the score.
        saved_at: the wall-clock time of the save (``time.time()``).
    """
    return {
        "format": FORMAT,
        "epoch": at.epoch,
        "iteration": at.iteration,
        "mid_epoch": at.mid_epoch,
        "world_size": world_size,
        "batch_size": batch_size,
        "accumulation_steps": accumulation_steps,
        "score": score,
        "metric": metric,
        "saved_at": saved_at,
        "versions": library_versions(),
    }


def build_checkpoint(
    *,
    meta: Mapping[str, Any],
    trainer: Mapping[str, Any],
    sampler: Mapping[str, Any] | None,
    rng: Sequence[Mapping[str, Any]],
    data: Mapping[str, Any] | None = None,
    objects: Mapping[str, Any],
    config: Mapping[str, Any] | None,
    per_rank: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The checkpoint's dict, from its parts; every part loads with ``weights_only=True``.

    Args:
        meta: from :func:`checkpoint_meta`.
        trainer: the trainer's ``state_dict()``.
        sampler: from ``position.sampler_state``; None when the data's sampler cannot resume.
        data: each rank's own data state (``data_entry.DataEntry.entry``); None for data without one.
        rng: every rank's :func:`capture_rng`, indexed by rank.
        objects: from :func:`object_states`.
        config: the run's configuration as plain data, or None.
        per_rank: name -> each rank's state of an object whose state is per rank
            (:func:`~unison.checkpoint.per_rank.rank_entries`): stored among the objects, the names
            listed in ``meta["per_rank"]``.
    """
    ranked = dict(per_rank or {})
    return {
        "meta": {**meta, "per_rank": list(ranked)} if ranked else dict(meta),
        "trainer": dict(trainer),
        "sampler": None if sampler is None else dict(sampler),
        "data": None if data is None else dict(data),
        "rng": list(rng),
        "objects": {**objects, **ranked},
        "config": None if config is None else dict(config),
    }


# --- resuming ---------------------------------------------------------------------------------


def rng_of_rank(rng: Sequence[Mapping[str, Any]], rank: int) -> Mapping[str, Any] | None:
    """The generator states saved by ``rank``; None when the checkpoint had fewer ranks."""
    return rng[rank] if rank < len(rng) else None


def check_checkpoint(
    state: Mapping[str, Any],
    *,
    source: str,
    names: Iterable[str],
    world_size: int,
    layout: tuple[int | None, int] | None = None,
) -> str | None:
    """Checks that a loaded checkpoint fits this run, before anything is loaded from it.

    Args:
        state: the checkpoint's dict.
        source: the file it came from, for messages.
        names: the names of the objects to load (the keys of ``to_save``).
        world_size: this run's number of ranks.
        layout: this run's per-rank batch size and accumulation steps, when known
            (:func:`world_size_note`).

    Returns:
        None, or a warning when it was saved with another world size.

    Raises:
        CheckpointError: for another format, a data position out of its range
            (:func:`~unison.checkpoint.data_checks.check_data_positions`), a missing object, or another world size
            mid-epoch without the position of a TrainSampler over the saved world size or of an
            elastic stream (the epoch's remaining samples cannot be resharded then), or with each rank's own
            data position (:func:`~unison.checkpoint.data_entry.check_data_entry`).
    """
    meta = state.get("meta", {})
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"Checkpoint {source} has format {meta.get('format')!r}; this unison reads {FORMAT}."
        )
    check_data_positions(state, source=source)  # before any position is put back
    sharded = meta.get("sharded", [])
    missing = [name for name in names if name not in state["objects"] and name not in sharded]
    if missing:
        raise CheckpointError(
            f"Checkpoint {source} holds no state for {missing} (it has {sorted([*state['objects'], *sharded])}). "
            "Use the same to_save names as the run that wrote it."
        )
    if meta["mid_epoch"]:  # each rank's own data position, when the data keeps one
        check_data_entry(state.get("data"), source=source, world_size=world_size)
    if meta["world_size"] == world_size:
        return None
    sampler = state.get("sampler")
    if meta["mid_epoch"]:
        stream = bool((state.get("data") or {}).get("elastic"))  # a stream's global position: it reshards
        if not stream and (not sampler or sampler.get("world_size") != meta["world_size"]):
            raise CheckpointError(
                f"Checkpoint {source} was taken mid-epoch (iteration {meta['iteration']}) with world size "
                f"{meta['world_size']}; this run has {world_size}. Resume with {meta['world_size']} ranks, "
                "or from a checkpoint taken at an epoch's end. It holds no TrainSampler position over "
                f"{meta['world_size']} ranks to reshard the epoch's remaining samples from."
            )
    return world_size_note(meta, source=source, world_size=world_size, layout=layout)


def world_size_note(
    meta: Mapping[str, Any], *, source: str, world_size: int, layout: tuple[int | None, int] | None = None
) -> str:
    """What a resume at another world size changes, for the log.

    Args:
        meta: the checkpoint's ``meta`` entry.
        source: the file, for the message.
        world_size: this run's number of ranks.
        layout: this run's per-rank batch size (None when the data has no fixed one) and
            accumulation steps; None when not known yet.

    Example:
        >>> meta = {"world_size": 2, "batch_size": 8, "accumulation_steps": 1, "mid_epoch": False}
        >>> world_size_note(meta, source="f.pt", world_size=4, layout=(4, 1))
        'Resuming f.pt, saved with world size 2, on 4 ranks: the global batch stays 16 (8 -> 4 per rank).'
    """
    where = "mid-epoch " if meta["mid_epoch"] else ""
    head = f"Resuming {source}, saved {where}with world size {meta['world_size']}, on {world_size} ranks: "
    if meta["mid_epoch"]:
        head += "the epoch's remaining samples are sharded over them, and "
    before_size, before_steps = meta.get("batch_size"), meta.get("accumulation_steps") or 1
    size, steps = layout if layout is not None else (None, 1)
    if before_size is None or size is None:
        return (
            head
            + "the global batch changes from here on, unless the per-rank batch size was changed to match."
        )
    before, now = meta["world_size"] * before_size * before_steps, world_size * size * steps
    if before == now:
        return head + f"the global batch stays {now} ({before_size} -> {size} per rank)."
    return head + f"the global batch changes from {before} to {now} from here on."


def check_layout(meta: Mapping[str, Any], *, batch_size: int | None, accumulation_steps: int) -> str | None:
    """Compares the run's per-rank layout with the checkpoint's: what changed, or None.

    Raises:
        CheckpointError: when ``accumulation_steps`` changed and the checkpoint is mid-epoch:
            the saved position sits at the end of a window of the saved size. (A per-rank
            batch size may change: the epoch's remaining samples are batched anew.)
    """
    now = {"batch_size": batch_size, "accumulation_steps": accumulation_steps}
    changed = [
        f"{k} {meta.get(k)} -> {v}" for k, v in now.items() if meta.get(k) is not None and meta.get(k) != v
    ]
    if not changed:
        return None
    message = f"The run differs from its checkpoint: {', '.join(changed)} (per rank)."
    if meta["mid_epoch"] and meta.get("accumulation_steps") not in (None, accumulation_steps):
        raise CheckpointError(
            message
            + " A mid-epoch position is only exact with the same layout; resume with the saved values, "
            "or from a checkpoint taken at an epoch's end."
        )
    return message


def data_length(data: Any) -> int | None:
    """``len(data)``, or None when it has none."""
    try:
        return len(data)
    except TypeError:
        return None


def refit_epoch_length(at: Position, length: int | None, *, warn: bool = False) -> Position | None:
    """At an epoch's end the data decides the epoch length, not the checkpoint.

    Args:
        at: the resumed position, at an epoch's end.
        length: the data's length now; None when unknown.
        warn: log a warning when the length changes.

    Returns:
        The same epoch counted in epochs of ``length``; None when nothing changes.

    Example:
        >>> refit_epoch_length(Position(epoch=2, iteration=6, epoch_length=3), 5)
        Position(epoch=2, iteration=10, epoch_length=5, into_epoch=None)
    """
    if not length or length == at.epoch_length:
        return None
    if warn:
        _log.warning(
            "The epoch length changed from %s to %d batches since the checkpoint (another world size or "
            "batch size); epochs from here on cover the whole data again.",
            at.epoch_length,
            length,
        )
    return Position(at.epoch, at.epoch * length, length)
