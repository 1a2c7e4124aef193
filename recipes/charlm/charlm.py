"""A character-level Transformer on the documentation topics that ship with Python.

The text is ``pydoc_data.topics`` (~460 KB of English and code, part of every CPython
installation): nothing is downloaded. The first 90 % of the text trains, the last 10 %
validates, so no validation window overlaps a training one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

from unison.distributed import rank_zero_only, shard_stream, unwrap_model
from unison.utils import get_logger

log = get_logger("charlm")


def load_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class Vocabulary:
    """Characters <-> integers; built from the whole text, so it is the same on every rank."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class Windows(Dataset):
    """Consecutive windows of ``block + 1`` characters: input the first ``block``, target the last."""

    def __init__(self, ids: torch.Tensor, block: int) -> None:
        self.ids = ids
        self.block = block

    def __len__(self) -> int:
        return (len(self.ids) - 1) // self.block

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.ids[i * self.block : i * self.block + self.block + 1]
        return chunk[:-1], chunk[1:]


def build_datasets(
    seed: int, block: int = 64, val_fraction: float = 0.1, limit: int | None = None
) -> tuple[Dataset, Dataset]:
    """Training and validation windows; ``limit`` keeps only the first characters (smoke runs)."""
    text = load_text()
    vocab = Vocabulary(text)
    ids = vocab.encode(text[:limit] if limit else text)
    cut = int(len(ids) * (1 - val_fraction))
    return Windows(ids[:cut], block), Windows(ids[cut:], block)


class WindowStream(IterableDataset):
    """The training windows as a stream: a generator over them, in a new seeded order each epoch."""

    def __init__(self, windows: Windows, seed: int) -> None:
        self.windows = windows
        self.seed = seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):  # noqa: ANN204 - a generator of (input, target) windows
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        for i in torch.randperm(len(self.windows), generator=gen).tolist():
            yield self.windows[i]


def build_stream(
    seed: int, block: int = 64, val_fraction: float = 0.1, limit: int | None = None
) -> tuple[IterableDataset, Dataset]:
    """build_datasets, with the training windows streamed: each rank reads its share
    (shard_stream); validation stays map-style."""
    train, val = build_datasets(seed, block, val_fraction, limit)
    return shard_stream(WindowStream(train, seed)), val


@functools.cache
def _vocabulary() -> Vocabulary:
    return Vocabulary(load_text())


def read_topics(
    path: Path, block: int = 64, limit: int | None = None
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """A shard of stream_files.yaml: the file names documentation topics, one a line; yields the
    consecutive windows of their text (the first ``limit`` characters only, for smoke runs)."""
    names = Path(path).read_text().split()
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[name] for name in names if name in topics)  # topics vary a little by Python
    windows = Windows(_vocabulary().encode(text[:limit] if limit else text), block)
    for i in range(len(windows)):
        yield windows[i]


class CharTransformer(nn.Module):
    """A small causal Transformer; scores come out as (batch, vocabulary, time)."""

    def __init__(
        self, block: int = 64, dim: int = 128, heads: int = 4, layers: int = 2, dropout: float = 0.1
    ) -> None:
        super().__init__()
        vocab = len(Vocabulary(load_text()))
        self.block = block
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Parameter(torch.zeros(1, block, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(block), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.embed(x) + self.position[:, :t]
        h = self.blocks(h, mask=self.mask[:t, :t], is_causal=True)
        return self.head(self.norm(h)).transpose(1, 2)


@torch.no_grad()
def sample(model: nn.Module, prompt: str, length: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
    """Continues ``prompt`` one character at a time."""
    net = unwrap_model(model)
    vocab = Vocabulary(load_text())
    device = next(net.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    ids = vocab.encode(prompt).to(device).unsqueeze(0)
    was_training = net.training
    net.eval()
    for _ in range(length):
        scores = net(ids[:, -net.block :])[:, :, -1] / temperature
        next_id = torch.multinomial(torch.softmax(scores, dim=1), 1, generator=gen)
        ids = torch.cat([ids, next_id], dim=1)
    net.train(was_training)
    return vocab.decode(ids[0].tolist())


def after_training(context) -> None:  # noqa: ANN001 - a unison.recipe.phases.RunContext
    """Logs validation perplexity and writes a few sampled lines to <run>/samples.txt (rank 0)."""
    loss = context.results["validation"].get("loss")
    if loss is not None:
        context.results["validation_perplexity"] = math.exp(loss)
    _write_samples(context)


@rank_zero_only
def _write_samples(context) -> None:  # noqa: ANN001
    prompts = ["The ", "A list ", "def "]
    texts = [sample(context.model, p, length=160, seed=i) for i, p in enumerate(prompts)]
    (context.run_dir / "samples.txt").write_text("\n\n---\n\n".join(texts) + "\n")
    log.info(
        "validation perplexity %.2f; samples:\n%s",
        context.results.get("validation_perplexity", float("nan")),
        texts[0],
    )
