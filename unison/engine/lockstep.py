"""Checks that the ranks move in lockstep: the same epoch lengths and the same sync contributors
at the start of a run, the same place at every sync point in debug mode."""

from __future__ import annotations

import zlib
from typing import Any

import torch
import torch.distributed as dist
from ignite.engine import Events

from unison.distributed.primitives import all_reduce_sum, get_rank, get_world_size, is_distributed
from unison.distributed.sync import split_rows
from unison.engine.checks import handler_name
from unison.engine.protocol import EngineParts
from unison.utils.logging import get_logger

_log = get_logger("unison.engine.engine")


def _layout(engine: EngineParts) -> tuple[list[str], list[int]]:
    """This rank's sync contributors (type names, in order) and the length each contributes."""
    contributors = engine.sync_point.contributors()
    return [type(c).__qualname__ for c in contributors], [int(c.sync_state().numel()) for c in contributors]


def agree_on_layout(engine: EngineParts) -> bool:
    """Collective when distributed: one all-reduce at the start of a run (a trainer's, where
    ``sync_every`` is set). Returns whether all ranks run epochs of the same length.

    The same all-reduce carries each rank's sync-point layout (how many contributors, which,
    and how many numbers they add): a contributor registered on some ranks only, or one whose
    state differs in length between ranks, would otherwise hang at the first sync point until
    the collective timeout or end in a backend abort. Here it fails at once on every rank,
    naming the contributor and the ranks.

    Raises:
        RuntimeError: naming the contributor that differs and the ranks concerned.
    """
    if not is_distributed():
        return True
    names, sizes = _layout(engine)
    fingerprint = float(zlib.crc32("|".join(names).encode()))
    world, rank = get_world_size(), get_rank()
    rows = torch.zeros(4 * world, dtype=torch.float64)
    length = engine.state.epoch_length
    for i, value in enumerate((length if length is not None else -1, len(names), fingerprint, sum(sizes))):
        rows[i * world + rank] = float(value)
    (gathered,) = all_reduce_sum([rows])
    lengths, counts, prints, totals = split_rows(gathered, 4)
    if len(set(counts)) > 1 or len(set(prints)) > 1 or len(set(totals)) > 1:
        _explain_layouts(engine, names, sizes)  # every rank sees the same sums: all get here
    if len(set(lengths)) > 1:
        _log.debug(
            "%s: ranks run epochs of different lengths %s; sync points at epoch ends only.",
            engine.name,
            [int(v) for v in lengths],
        )
        return False
    return True


def _explain_layouts(engine: EngineParts, names: list[str], sizes: list[int]) -> None:
    """Collective: gathers every rank's layout and raises naming what differs."""
    everyone: list[Any] = [None] * get_world_size()
    dist.all_gather_object(everyone, (names, sizes))
    layouts = {rank: dict(zip(n, s, strict=True)) for rank, (n, s) in enumerate(everyone)}
    every_name = sorted({name for layout in layouts.values() for name in layout})
    for name in every_name:
        missing = [r for r, layout in layouts.items() if name not in layout]
        if missing:
            having = [r for r in layouts if r not in missing]
            raise RuntimeError(
                f"{engine.name}: the sync contributor {name} is registered on rank(s) {having} but not on "
                f"rank(s) {missing}. Every rank must attach every handler (and join every sync point): "
                "attach it on every rank, and filter by rank only inside a side effect."
            )
        lengths = {r: layout[name] for r, layout in layouts.items()}
        if len(set(lengths.values())) > 1:
            raise RuntimeError(
                f"{engine.name}: the sync contributor {name} returns states of different lengths on different "
                f"ranks ({', '.join(f'rank {r}: {n}' for r, n in lengths.items())}). sync_state() must return the "
                "same length on every rank (zeros where a rank has nothing to add)."
            )
    raise RuntimeError(
        f"{engine.name}: the ranks' sync contributors are registered in different orders: "
        + "; ".join(f"rank {r}: {list(layout)}" for r, layout in layouts.items())
    )


def _handlers(engine: EngineParts) -> dict[str, list[str]]:
    """The handlers attached to each event, by name, in order; and the close callbacks."""
    attached = {
        getattr(event, "name", str(event)): [handler_name(h) for h, _, _ in handlers]
        for event, handlers in engine._event_handlers.items()
        if handlers
    }
    closing = getattr(engine, "_closing", None)
    if closing is not None and closing.names():
        attached["CLOSE (add_close_callback)"] = closing.names()
    return attached


def check_lockstep(engine: EngineParts, epoch_end: bool) -> None:
    """Collective (debug mode): all ranks are at the same event and iteration, with the same
    sync contributors and the same handlers; raises naming the rank that went its own way."""
    here = (
        engine.name,
        str(engine.last_event_name),
        engine.state.iteration,
        [type(c).__name__ for c in engine.sync_point.contributors(epoch_end)],
    )
    mine = (here, _handlers(engine))
    # First one small all-reduce of a fingerprint, the shape of every sync point: a collective a
    # rank calls alone (a rank-0-only branch) then meets a mismatched all-reduce and the backend
    # aborts in seconds, where a gather of objects would pair with it and wait for the timeout.
    world, rank, fingerprint = get_world_size(), get_rank(), float(zlib.crc32(repr(mine).encode()))
    rows = torch.zeros(2 * world, dtype=torch.float64)
    rows[rank], rows[world + rank] = fingerprint, 1.0
    (summed,) = all_reduce_sum([rows])
    prints, marks = split_rows(summed, 2)
    if prints[rank] != fingerprint or any(m != 1.0 for m in marks):
        # What came back is not the ranks' fingerprints: another rank's collective, called
        # where this rank called none, was paired with this sync point.
        raise RuntimeError(
            f"Ranks left lockstep: at the sync point of {describe(here)} on rank {rank}, the all-reduce was "
            "paired with a collective another rank called and this one did not (a collective inside a "
            "rank-conditional branch, in a handler at or before this event). Call collectives on every "
            "rank, or move the work inside a rank filter that calls none (rank_zero_only)."
        )
    if len(set(prints)) == 1:
        return
    everyone: list[Any] = [None] * get_world_size()
    dist.all_gather_object(everyone, mine)
    reference, attached = everyone[0]
    for rank, (other, theirs) in enumerate(everyone):
        if other != reference:
            raise RuntimeError(
                "Ranks left lockstep: at a sync point rank 0 is at "
                f"{describe(reference)} but rank {rank} is at {describe(other)}. A decision was taken "
                "on one rank alone (a handler attached on some ranks only, a terminate outside "
                "unison's Engine, a branch on the rank around a collective). Attach every handler "
                "on every rank and stop through engine.terminate() / request_stop()."
            )
        for event in sorted(set(attached) | set(theirs)):
            if attached.get(event, []) != theirs.get(event, []):
                raise RuntimeError(
                    f"{engine.name}: the ranks attached different handlers to {event}: rank 0 has "
                    f"{attached.get(event, [])}, rank {rank} has {theirs.get(event, [])}. Every rank attaches "
                    "every handler; filter by rank only inside a handler's side effect (rank_zero_only)."
                )


def describe(where: Any) -> str:
    name, event, iteration, contributors = where
    return f"{name} {event} iteration {iteration} with sync contributors {contributors}"


def requests_settle_here(engine: EngineParts) -> bool:
    """Whether this rank's pending stop requests will be decided before the next iteration.

    A checkpoint taken now must not hold them: the run it resumes would stop again for a
    request the saved run already acted on. That is so everywhere but inside an epoch
    between sync points, where a request waits for a sync point the saved run has not
    reached.
    """
    if engine.last_event_name is not Events.ITERATION_COMPLETED:
        return True  # an epoch's end or the run's end: a sync point or the end comes first
    if not engine.at_boundary():
        return False
    if get_world_size() == 1:
        return True  # applied at this boundary, right after this event's handlers
    if engine._epoch_ends_here():
        return True
    every = engine.sync_every
    due = engine._sync_due or (every is not None and engine.state.iteration % every == 0)
    return engine._iteration_syncs and due
