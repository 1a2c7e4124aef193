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
- ``elastic``: whether a run saved at N ranks may continue at M.
- ``fix``: what to use instead, for the error a refused save raises.

Sources register a recognizer (:func:`register_source`); the first that answers wins, and
the built-in answers come last. No collective here: each rank asks about its own loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

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
        save: returns this rank's state (``kind == "stateful"``), plain values only.
        load: puts a saved state back (``kind == "stateful"``).
    """

    source: str
    kind: Kind
    scope: Scope | None
    elastic: bool
    fix: str = ""
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


_builtin: list[Recognizer] = []
