"""The order of a training epoch and where a position stands in it: pure functions of plain values.

:class:`~unison.distributed.samplers.TrainSampler` draws torch's ``DistributedSampler`` order
(:func:`epoch_order`), lays the samples still to go out over the ranks (:func:`layout_order`)
and keeps a global position in it (:func:`advance_position`), which is what lets a position
saved at one world size continue at another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def epoch_order(size: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's order of ``range(size)``, as torch's ``DistributedSampler`` draws it.

    Example:
        >>> epoch_order(4, seed=0, epoch=0, shuffle=False)
        [0, 1, 2, 3]
    """
    if not shuffle:
        return list(range(size))
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(size, generator=generator).tolist()


def layout_order(rest: Sequence[int], world_size: int, drop_last: bool) -> list[int]:
    """``rest`` made a multiple of ``world_size`` long, as ``DistributedSampler`` does: padded with
    its own first items (repeated when needed), or with its tail dropped (``drop_last``).

    Rank ``r`` takes ``layout_order(...)[r::world_size]``.

    Example:
        >>> layout_order([7, 8, 9], 2, drop_last=False), layout_order([7, 8, 9], 2, drop_last=True)
        ([7, 8, 9, 7], [7, 8])
    """
    n = len(rest)
    if drop_last:
        return list(rest[: n - n % world_size])
    if n == 0:
        return []
    pad = math.ceil(n / world_size) * world_size - n
    return list(rest) + (list(rest) * math.ceil(pad / n))[:pad]


def remaining_positions(size: int, consumed: int, extra: Sequence[int] = ()) -> list[int]:
    """The positions of an epoch's order not yet consumed, in order.

    Args:
        size: the dataset size.
        consumed: positions ``0 .. consumed - 1`` are consumed.
        extra: positions after those that are consumed as well (ranks that consumed unequal counts).
    """
    skip = set(extra)
    return [p for p in range(consumed, size) if p not in skip]


def advance_position(
    size: int,
    consumed: int,
    extra: Sequence[int],
    *,
    world_size: int,
    drop_last: bool,
    counts: Sequence[int],
) -> tuple[int, list[int]]:
    """The epoch's global position after rank ``r`` consumed ``counts[r]`` samples of its shard.

    The shards are those of the positions still to go at ``(consumed, extra)`` (see
    :func:`remaining_positions`), laid out by :func:`layout_order` over ``world_size`` ranks. A
    padding sample consumed marks the sample it repeats as seen: it is not new, and is not
    given out again.

    Returns:
        ``(consumed, extra)`` after them: positions ``0 .. consumed - 1`` and ``extra`` are done.

    Example:
        >>> advance_position(10, 0, [], world_size=2, drop_last=False, counts=[2, 2])
        (4, [])
        >>> advance_position(10, 0, [], world_size=2, drop_last=False, counts=[1, 2])
        (2, [3])
    """
    if len(counts) != world_size:
        raise ValueError(f"advance_position: {len(counts)} per-rank counts for world_size={world_size}.")
    top, low = max(counts, default=0), min(counts, default=0)
    ahead = sum(1 for c in counts if c > low)
    if not extra and top - low <= 1 and all(c == top for c in counts[:ahead]):
        # The common case: equal counts, or the first ranks one ahead: a prefix of the layout.
        return min(consumed + world_size * low + ahead, size), []
    rest = remaining_positions(size, consumed, extra)
    order = layout_order(rest, world_size, drop_last)
    done = set(extra)
    for rank, count in enumerate(counts):
        done.update(order[rank::world_size][: max(count, 0)])
    while consumed in done:
        done.discard(consumed)
        consumed += 1
    return consumed, sorted(done)
