"""The data-position contract: what a training loader can say about where its data stands.

A resumed run equals the uninterrupted one only when the checkpoint knows where each rank's
data stood. Every training loader answers, through :func:`data_position`:

- ``kind``: how its position is kept. ``"sampler"``: a sampler with ``state_dict`` behind a
  map-style loader (:class:`~unison.distributed.TrainSampler`; the checkpoint's ``sampler``
  entry); ``"stateful"``: the loader or its dataset keeps the state itself (torchdata's
  ``StatefulDataLoader``, a Hugging Face streaming dataset); ``"none"``: nothing can tell
  (a plain ``IterableDataset``, WebDataset): a mid-epoch save is refused, epoch-boundary
  saves stay allowed.
- ``scope``: ``"global"`` when one position serves the whole job (it counts samples of the
  global order), ``"rank"`` when each rank keeps its own.
- ``elastic``: whether a run saved at N ranks may continue at M (``not_elastic`` says why not,
  where a setting decides it). A stream of your own declares its ``state_dict()`` a global
  position (the same on every rank, any world size continues from it: each rank reads every
  W-th record and counts the records read by all) with ``global_position = True``; read
  without loader workers, it is then ``scope="global"`` and elastic, as a ``shard_stream`` is.
- ``fix``: what to use instead, for the error a refused save raises.

Sources register a recognizer (:func:`register_source`); the first that answers wins, and
the built-in answers come last. No collective here: each rank asks about its own loader.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from torch.utils.data import DataLoader, IterableDataset

from unison.distributed.iterable import ShardedStream
from unison.distributed.samplers import TrainSampler, samplers_with_set_epoch

Kind = Literal["sampler", "stateful", "none"]
Scope = Literal["global", "rank"]


@dataclass(frozen=True)
class DataPosition:
    """What one loader can say about its position, and how to save and load it.

    Attributes:
        source: the type that decides (``"datasets.IterableDataset"``), named in messages.
        kind: ``"sampler"``, ``"stateful"`` or ``"none"`` (see the module's docstring).
        scope: ``"global"`` or ``"rank"``; None when the kind is ``"none"``.
        elastic: whether the position can continue at another world size.
        fix: for ``kind == "none"``: what to use instead, a sentence.
        not_elastic: where a setting keeps it from another world size: which, and the fix.
        save: returns this rank's state (``kind == "stateful"``), plain values only.
        load: puts a saved state back (``kind == "stateful"``).
    """

    source: str
    kind: Kind
    scope: Scope | None
    elastic: bool
    fix: str = ""
    not_elastic: str = ""
    save: Callable[[], Any] | None = None
    load: Callable[[Any], None] | None = None

    @property
    def reports(self) -> bool:
        """Whether a mid-epoch checkpoint can record where the data stands."""
        return self.kind != "none"


Recognizer = Callable[[Any], "DataPosition | None"]
_recognizers: list[Recognizer] = []


def register_source(recognizer: Recognizer) -> Recognizer:
    """Adds a recognizer: ``recognizer(loader)`` returns a :class:`DataPosition` or None.

    Registered recognizers are asked in the order registered, before the built-in ones.
    Usable as a decorator; registering the same function twice keeps one.
    """
    if recognizer not in _recognizers:
        _recognizers.append(recognizer)
    return recognizer


def type_name(obj: Any) -> str:
    """``module.Class`` of ``obj``'s type, the top-level package only (``datasets.IterableDataset``)."""
    cls = type(obj)
    return f"{cls.__module__.split('.')[0]}.{cls.__qualname__}"


def data_position(loader: Any) -> DataPosition:
    """What ``loader`` (the trainer's data) can say about its position: the first answer of the
    registered recognizers, then of the built-in ones."""
    for recognizer in (*_recognizers, *_builtin):
        answer = recognizer(loader)
        if answer is not None:
            return answer
    return DataPosition(
        source=type_name(getattr(loader, "dataset", loader)),
        kind="none",
        scope=None,
        elastic=False,
        fix="use unison.distributed.prepare_loaders on a map-style dataset, or torchdata's StatefulDataLoader "
        "over a dataset with state_dict()/load_state_dict()",
    )


STATEFUL_LOADER = "torchdata.stateful_dataloader.StatefulDataLoader"
"""The loader that saves its workers' and its sampler's state (``pip install torchdata``)."""


def _stateful_loader(loader: Any) -> DataPosition | None:
    """torchdata's ``StatefulDataLoader``: its ``state_dict()`` holds the sampler's (or the dataset's)
    state and each worker's, counted in batches the loader *yielded*, prefetched ones excluded.

    Its module is looked up, not imported: a loader of that type can exist only once it is.
    """
    module = sys.modules.get("torchdata.stateful_dataloader")
    cls = getattr(module, "StatefulDataLoader", None)
    if cls is None or not isinstance(loader, cls):
        return None
    return DataPosition(
        source=type_name(loader),
        kind="stateful",
        scope="rank",
        elastic=False,
        save=loader.state_dict,
        load=loader.load_state_dict,
    )


def _resumable_sampler(loader: Any) -> DataPosition | None:
    """A map-style loader whose sampler saves and loads its position (unison's TrainSampler): one
    global position, kept by the checkpoint's ``sampler`` entry; elastic for a TrainSampler."""
    for sampler in samplers_with_set_epoch(loader):
        if callable(getattr(sampler, "load_state_dict", None)):
            return DataPosition(
                source=type_name(sampler),
                kind="sampler",
                scope="global",
                elastic=isinstance(sampler, TrainSampler),
            )
    return None


def _has_state(obj: Any) -> bool:
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))


def _stateful_dataset(loader: Any) -> DataPosition | None:
    """A dataset with ``state_dict``/``load_state_dict`` (a Hugging Face ``datasets.IterableDataset``),
    iterated directly or by a DataLoader in the main process.

    Its state counts the examples it gave out: with ``num_workers=0`` the loader prefetches
    nothing, so at a save that is what was trained on. With workers, each holds its own copy
    of the dataset, which a plain DataLoader cannot reach: the position is unknown.
    """
    dataset: Any
    if isinstance(loader, DataLoader):
        dataset = loader.dataset
        if not isinstance(dataset, IterableDataset) or not _has_state(
            dataset
        ):  # map-style: its sampler decides
            return None
        if loader.num_workers > 0:
            return DataPosition(
                source=type_name(dataset),
                kind="none",
                scope=None,
                elastic=False,
                fix=f"load it with {STATEFUL_LOADER}, which saves each worker's dataset state, or use "
                "num_workers=0 (a DataLoader with workers cannot read its workers' copies of the dataset)",
            )
    elif _has_state(loader) and callable(getattr(loader, "__iter__", None)):
        dataset = loader
    else:
        return None
    return DataPosition(
        source=type_name(dataset),
        kind="stateful",
        scope="rank",
        elastic=False,
        save=dataset.state_dict,
        load=dataset.load_state_dict,
    )


def declares_global_position(dataset: Any) -> bool:
    """Whether ``dataset``'s ``state_dict()`` is a position in the stream's global order, the same
    on every rank, from which any world size can continue: a :func:`~unison.distributed.shard_stream`
    with ``equal_length``, or a stream of your own with ``global_position = True``.
    """
    if isinstance(dataset, ShardedStream):
        return dataset.equal_length
    return getattr(dataset, "global_position", False) is True


def _global_stream(loader: Any) -> DataPosition | None:
    """A stream whose position is global (:func:`declares_global_position`, or a
    :func:`~unison.distributed.shard_stream`), iterated directly or by a loader (plain or
    torchdata's) that saves its state.

    With no loader workers every rank reads the same rounds of ``world_size`` items, one each,
    in lockstep: at a save all ranks have read the same number of source items, a position in
    the stream's global order that any world size can continue from. With workers the rounds
    are dealt to the workers in turn and the loader interleaves their batches, so the items
    read are no prefix of the stream: each rank's position is its own.
    """
    dataset = loader.dataset if isinstance(loader, DataLoader) else loader
    if not isinstance(dataset, ShardedStream) and getattr(dataset, "global_position", False) is not True:
        return None
    answer = _stateful_loader(loader) or _stateful_dataset(loader)
    if answer is None or answer.kind != "stateful":
        return answer
    workers = loader.num_workers if isinstance(loader, DataLoader) else 0
    if workers == 0 and declares_global_position(dataset):
        return replace(answer, scope="global", elastic=True)
    why = (
        f"its loader has num_workers={workers}, which gives each worker its own copy of the stream and of "
        "its position, so each rank's position is its own; with num_workers=0 the stream's position is "
        "global and elastic"
        if workers
        else "shard_stream(equal_length=False) lets the ranks' positions differ at the stream's end; "
        "equal_length=True (the default) with num_workers=0 makes the stream's position global and elastic"
    )
    return replace(answer, not_elastic=why)


_builtin: list[Recognizer] = [_global_stream, _stateful_loader, _resumable_sampler, _stateful_dataset]
