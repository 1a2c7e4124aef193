"""A word-level LSTM language model whose hidden state carries from one batch to the next.

As pytorch/examples' ``word_language_model`` trains it (truncated backpropagation through
time): the text is cut into ``streams`` long columns, and the batch at step ``k`` holds window
``k`` of every column, so each sample continues the one before it at the same place of the
previous batch, and the LSTM starts from the hidden state the previous batch ended with.

The text is ``pydoc_data.topics`` (Python's own documentation topics, part of every CPython
installation): nothing is downloaded. The hidden state lives in a handler,
:class:`CarriedState`: reset at the start of each epoch, detached after every batch (the
gradient stops at the window's start), and saved in checkpoints per rank
(``per_rank_state = True``): each rank's own streams, so a run stopped mid-epoch and resumed
continues bitwise as the uninterrupted one.
"""

from __future__ import annotations

import collections
import functools
from typing import Any

import torch
from torch import nn
from torch.utils.data import Dataset

from unison.distributed import get_world_size, unwrap_model
from unison.engine import Engine, Events


@functools.cache
def load_words() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    return tuple(" ".join(topics[key] for key in sorted(topics)).lower().split())


def encode(words: tuple[str, ...], vocab: int) -> torch.Tensor:
    """Word ids: the ``vocab - 1`` most frequent words of the whole text, the others 0 (``<unk>``)."""
    common = [w for w, _ in collections.Counter(load_words()).most_common(vocab - 1)]
    index = {w: i + 1 for i, w in enumerate(common)}
    return torch.tensor([index.get(w, 0) for w in words], dtype=torch.long)


class Streams(Dataset):
    """``streams`` columns of the text in windows of ``bptt`` words: item ``i`` is window ``i // streams``
    of column ``i % streams``, as ``(words, next words)``.

    Read in order by ``streams`` ranks' batches together (``training.batch_size`` x ranks =
    ``streams``, ``training.shuffle: false``), sample ``j`` of every batch continues sample ``j`` of
    the batch before on the same rank.
    """

    def __init__(self, ids: torch.Tensor, bptt: int, streams: int) -> None:
        length = (len(ids) - 1) // streams
        self.columns = ids[: length * streams + 1]
        self.length, self.bptt, self.streams = length, bptt, streams
        self.steps = (length - 1) // bptt

    def __len__(self) -> int:
        return self.steps * self.streams

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        step, column = divmod(i, self.streams)
        start = column * self.length + step * self.bptt
        chunk = self.columns[start : start + self.bptt + 1]
        return chunk[:-1], chunk[1:]


def build(
    seed: int,
    bptt: int = 20,
    streams: int = 16,
    vocab: int = 2000,
    val_fraction: float = 0.1,
    limit: int | None = None,
) -> tuple[Dataset, Dataset]:
    """Training and validation streams; ``limit`` keeps only the first words (smoke runs)."""
    words = load_words()[:limit] if limit else load_words()
    ids = encode(words, vocab)
    cut = int(len(ids) * (1 - val_fraction))
    return Streams(ids[:cut], bptt, streams), Streams(ids[cut:], bptt, streams)


class WordLSTM(nn.Module):
    """Embedding, LSTM, linear head; scores come out as (batch, vocabulary, time).

    In training it starts from ``self.carry`` (the hidden state a :class:`CarriedState` hands it;
    zeros when None) and leaves the state it ends with there; in evaluation every window starts
    from zeros and ``carry`` is left alone.
    """

    def __init__(self, vocab: int = 2000, dim: int = 64, layers: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(dim, dim, layers, dropout=dropout if layers > 1 else 0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)
        self.carry: tuple[torch.Tensor, torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        start = self.carry if self.training else None
        out, state = self.lstm(self.drop(self.embed(x)), start)
        if self.training:
            self.carry = state
        return self.head(self.drop(out)).transpose(1, 2)


class CarriedState:
    """Holds the model's hidden state between batches, per rank: reset when an epoch starts at its
    beginning, detached after every batch, saved and resumed with each rank's own.

    In a config (the model is unison's, handed over by its parameter's name)::

        handlers:
          - type: !pyobject wordlm.CarriedState

    From Python: ``CarriedState(model).attach(trainer)``.
    """

    per_rank_state = True
    """Each rank carries its own streams' state: a checkpoint keeps every rank's
    (:mod:`unison.checkpoint.per_rank`). It defines no ``load_state_dict_resharded``: at another
    world size the streams are dealt out anew, so a resume there is refused, naming this handler."""

    def __init__(self, model: nn.Module) -> None:
        self.lm: Any = unwrap_model(model)
        self.hidden: tuple[torch.Tensor, torch.Tensor] | None = None

    def attach(self, engine: Engine) -> None:
        engine.add_event_handler(Events.STARTED, self.check_streams)
        engine.add_event_handler(Events.EPOCH_STARTED, self.epoch_started)
        engine.add_event_handler(Events.ITERATION_STARTED, self.hand_over)
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.take_back)

    def check_streams(self, engine: Engine) -> None:
        """The streams are the global batch: else a sample would not continue the one before it."""
        loader = engine.state.dataloader
        streams = getattr(getattr(loader, "dataset", None), "streams", None)
        batch = getattr(loader, "batch_size", None)
        if streams is not None and batch is not None and streams != batch * get_world_size():
            raise ValueError(
                f"CarriedState: data.kwargs.streams is {streams} but training.batch_size x ranks is "
                f"{batch} x {get_world_size()}: each batch must hold one window of every stream. Set "
                f"data.kwargs.streams: {batch * get_world_size()} (or training.batch_size: "
                f"{streams // get_world_size()}), with training.shuffle: false."
            )

    def epoch_started(self, engine: Engine) -> None:
        into = getattr(engine, "epoch_position", (0, 0))[1]  # mid-epoch after a resume: keep the state
        if into == 0:
            self.hidden = None

    def hand_over(self, engine: Engine) -> None:
        self.lm.carry = self.hidden

    def take_back(self, engine: Engine) -> None:
        carry = self.lm.carry
        self.hidden = None if carry is None else (carry[0].detach(), carry[1].detach())
        self.lm.carry = None

    def state_dict(self) -> dict[str, Any]:
        return {"hidden": None if self.hidden is None else [t.detach().cpu().clone() for t in self.hidden]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["hidden"]
        device = next(self.lm.parameters()).device
        self.hidden = None if saved is None else (saved[0].to(device), saved[1].to(device))
