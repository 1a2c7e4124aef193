"""An epoch in which no rank got a batch: an error on every rank, agreed at the epoch's sync point.

ignite refuses data with a length of 0 before a run starts ("Input data has zero size").
Data without a length (a stream) learns its epoch's length at the end of its first pass,
and a stream that yields nothing would end that epoch with a length of 0: trained on
nothing, a loss of nan, and the run reported done. :class:`EmptyEpochs` rides in the sync
point that opens every ``EPOCH_COMPLETED`` (no collective of its own): each rank adds
whether its epoch had a length of 0, and when every rank says so, every rank raises
:class:`EmptyDataError` together. One rank without a batch while another has some is not
this case (``shard_stream(equal_length=False)`` documents it).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from ignite.engine import Engine as IgniteEngine

from unison.distributed.primitives import get_world_size
from unison.distributed.sync import rank_row, split_rows

__all__ = ["EmptyDataError", "EmptyEpochs", "describe_data"]


class EmptyDataError(ValueError):
    """Every rank's data yielded no batch in an epoch; ``engine_name`` is the engine that ran it."""

    def __init__(self, message: str, engine_name: str) -> None:
        super().__init__(message)
        self.engine_name = engine_name


def describe_data(data: Any) -> str:
    """``data`` as a chain of types, down to the files a source reads when it names them:
    ``StatefulDataLoader over ShardedStream over FileStream (files: a.txt, b.txt)``."""
    chain: list[str] = []
    item = data
    for _ in range(6):  # a loader, a wrapper or two, the source
        if item is None:
            break
        chain.append(type(item).__name__)
        files = getattr(item, "files", None)
        if isinstance(files, (list, tuple)) and files:
            names = ", ".join(str(f) for f in files[:5]) + (
                f", ... ({len(files)} files)" if len(files) > 5 else ""
            )
            chain[-1] += f" (files: {names})"
            break
        item = getattr(item, "dataset", None) or getattr(item, "source", None)
    return " over ".join(chain)


class EmptyEpochs:
    """The engine's contributor (scope ``"epoch"``) that refuses an epoch no rank got a batch of."""

    def __init__(self, engine: IgniteEngine) -> None:
        self._engine = weakref.ref(engine)

    def sync_state(self) -> torch.Tensor:
        engine = self._engine()
        empty = engine is not None and engine.state.epoch_length == 0
        return rank_row(1.0 if empty else 0.0)

    def load_synced_state(self, state: torch.Tensor) -> None:
        (empty,) = split_rows(state, 1)
        engine = self._engine()
        if engine is None or not all(v > 0 for v in empty):
            return
        name = getattr(engine, "name", "engine")
        world = get_world_size()
        raise EmptyDataError(
            f"{name}: the data yielded no batch: epoch {engine.state.epoch} ended empty on every rank "
            f"({world} of {world}), so nothing ran. The data: {describe_data(engine.state.dataloader)}. "
            "Data with a length of 0 is refused the same way ('Input data has zero size'). Fix the source: "
            "its files hold samples, its reader yields them, and no filter drops them all.",
            name,
        )
