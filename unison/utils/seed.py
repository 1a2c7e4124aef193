"""Seeding every random number generator a training run draws from."""

from __future__ import annotations

import hashlib
import random

import torch


def manual_seed(seed: int) -> None:
    """Seeds Python's, NumPy's (when installed) and torch's generators, on CPU and CUDA.

    Use the same seed on every rank: data splits and initial weights then agree, and the
    training sampler still gives each rank its own shard. A trainer built by
    :func:`~unison.engine.create_trainer` then gives each rank a stream of its own when
    training starts (:func:`fork_rank_streams`), so dropout masks and noise differ across
    ranks, as they would across the samples of one large batch. Shuffles do not depend on
    these generators: every rank draws the same permutation from the sampler's seed.

    Example:
        >>> manual_seed(7)
        >>> a = torch.rand(2)
        >>> manual_seed(7)
        >>> torch.equal(a, torch.rand(2))
        True
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed(seed=...) needs an int, got {type(seed).__name__}: {seed!r}")
    _seed_all(seed)


def rank_seed(seed: int, rank: int) -> int:
    """A seed for ``rank`` derived from ``seed``: distinct per (seed, rank), rank 0's is ``seed``.

    Example:
        >>> rank_seed(42, 0), rank_seed(42, 1) != rank_seed(43, 0)
        (42, True)
    """
    if rank == 0:
        return seed
    digest = hashlib.blake2b(f"unison:{seed}:{rank}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def fork_rank_streams(rank: int) -> None:
    """Gives this rank generators of its own, derived from torch's initial seed and ``rank``.

    Rank 0 keeps its stream untouched (a one-process run is unchanged); every other rank
    reseeds Python's, NumPy's and torch's generators with :func:`rank_seed`. Called once
    at the start of a fresh training run, after the model is built (so initial weights,
    made from the common seed, agree); a checkpoint then saves and restores each rank's
    own stream.
    """
    if rank != 0:
        _seed_all(rank_seed(torch.initial_seed(), rank))


def _seed_all(seed: int) -> None:
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is optional
        pass
    else:
        np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
