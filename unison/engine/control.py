"""The one stop path: every stop of a unison Engine is requested, agreed and applied here.

A stop comes from one of two places. A *request* (``terminate()``, ``terminate_epoch()``,
``interrupt()``, ``request_stop()``) may be made on any subset of ranks, so the ranks
must agree on it: each rank puts what it asked for in the engine's sync point, and after
the sum every rank knows who asked for what. An *agreed* stop (``stop_agreed()``: early
stopping, the non-finite guard, the time limit, a preemption) is decided by a handler
from sums every rank received at a sync point, so it needs no further agreement.

Either way the stop is applied by :meth:`StopControl.apply`, with one boundary rule at
every world size: never inside a gradient-accumulation window. At world size 1 nothing
needs agreeing, so a request is applied at the end of the current event, ignite's own
semantics, once the window is whole; with more ranks, at the first sync point at or
after it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.distributed as dist
from ignite.engine import Engine as IgniteEngine

from unison.distributed.primitives import get_rank, get_world_size, is_distributed
from unison.distributed.sync import rank_row, split_rows
from unison.utils.logging import get_logger

_log = get_logger("unison.engine.engine")

Kind = Literal["stop", "interrupt", "epoch"]
KINDS: tuple[Kind, ...] = ("stop", "interrupt", "epoch")
"""In order of precedence: when ranks ask for different kinds, the first one asked wins."""

_WHAT = {"stop": "stopping", "interrupt": "interrupting the run", "epoch": "ending the epoch"}


@dataclass
class StopDecision:
    """What the ranks agreed at a sync point."""

    kind: Kind
    """``"stop"`` (terminate), ``"interrupt"`` (resumable by ``run()``), ``"epoch"`` (end the epoch)."""
    ranks: list[int]
    """The ranks that asked (empty for a stop decided from synced state)."""
    skip_completed: bool = False
    """Whether some asking rank wanted ``COMPLETED`` (or ``EPOCH_COMPLETED``) skipped."""


class StopControl:
    """Records this rank's stop requests, joins the sync point, and applies the decision.

    It is the engine's own contributor to its sync points (scope ``"every"``): one
    one-hot row per kind of request and one for ``skip_completed``; after the sum, every
    rank takes the same decision.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.requests: dict[Kind, list[str]] = {kind: [] for kind in KINDS}
        self.skip_completed = False
        self.agreed: list[str] = []
        self.decision: StopDecision | None = None

    # -- recording --------------------------------------------------------------------

    def request(self, kind: Kind, reason: str, skip_completed: bool = False) -> None:
        """Records that this rank asks for a stop of ``kind``."""
        self.requests[kind].append(str(reason))
        self.skip_completed = self.skip_completed or skip_completed

    def agree(self, reason: str) -> None:
        """Records a stop every rank decided alike from synced state."""
        self.agreed.append(str(reason))

    @property
    def pending(self) -> bool:
        """Whether anything waits to be decided or applied."""
        return bool(self.agreed or self.decision or any(self.requests.values()))

    @property
    def requested(self) -> bool:
        """Whether this rank has asked and the ranks have not decided yet."""
        return any(self.requests.values())

    def clear(self) -> None:
        for reasons in self.requests.values():
            reasons.clear()
        self.skip_completed = False
        self.agreed.clear()
        self.decision = None

    # -- the sync point ---------------------------------------------------------------

    def sync_state(self) -> torch.Tensor:
        flags = [1.0 if self.requests[kind] else 0.0 for kind in KINDS]
        return rank_row(*flags, 1.0 if self.skip_completed else 0.0)

    def load_synced_state(self, state: torch.Tensor) -> None:
        *rows, skips = split_rows(state, len(KINDS) + 1)
        for kind, row in zip(KINDS, rows, strict=True):
            ranks = [r for r, v in enumerate(row) if v > 0]
            if ranks:
                self.decision = StopDecision(kind, ranks, skip_completed=any(v > 0 for v in skips))
                return

    def decide_alone(self) -> None:
        """With one rank, the sync point's answer is this rank's own requests."""
        for kind in KINDS:
            if self.requests[kind]:
                self.decision = StopDecision(kind, [get_rank()], skip_completed=self.skip_completed)
                return

    # -- applying ---------------------------------------------------------------------

    def apply(self, engine: IgniteEngine) -> bool:
        """Applies the decision (or the agreed stop) to ``engine``; True if it stops.

        Collective only when a decision names asking ranks and more than one rank runs
        (their reasons are gathered for rank 0's log); every rank reaches it alike.
        """
        decision, agreed = self.decision, list(self.agreed)
        if decision is None and not agreed:
            return False
        reasons = self._gather_reasons(decision) if decision is not None else {}
        kind: Kind = "stop" if agreed or decision is None else decision.kind
        ranks = decision.ranks if decision is not None else []
        skip = decision.skip_completed if decision is not None else False
        self._log(engine, kind, ranks, reasons, agreed)
        self.clear()
        if kind == "stop":
            IgniteEngine.terminate(engine, skip_completed=skip)
        elif kind == "interrupt":
            IgniteEngine.interrupt(engine)
        else:
            IgniteEngine.terminate_epoch(engine, skip_epoch_completed=skip)
        return True

    def _gather_reasons(self, decision: StopDecision) -> dict[int, list[str]]:
        local = list(self.requests[decision.kind])
        if not is_distributed():
            return {get_rank(): local}
        everyone: list[Any] = [None] * get_world_size()
        dist.all_gather_object(everyone, local)
        return {r: everyone[r] for r in decision.ranks}

    def _log(
        self, engine: IgniteEngine, kind: Kind, ranks: list[int], reasons: dict[int, list[str]], agreed: list[str]
    ) -> None:
        if get_rank() != 0:
            return
        asked = [f"rank {r}: {', '.join(reasons.get(r, [])) or 'no reason given'}" for r in ranks]
        where = f"after iteration {engine.state.iteration} (epoch {engine.state.epoch})"
        if not is_distributed():
            _log.info("%s: %s %s: %s", self.name, _WHAT[kind], where, "; ".join(asked + agreed))
            return
        lead = f"{self.name}: all {get_world_size()} ranks {_WHAT[kind]} {where}"
        if ranks:
            _log.warning("%s. Asked by %s", lead, "; ".join(asked + [f"and {a}" for a in agreed]))
        else:
            _log.warning("%s: %s", lead, "; ".join(agreed))

    # -- state ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The requests not yet decided (a decision is applied before anything saves)."""
        return {
            "reasons": list(self.requests["stop"]),
            "epoch_reasons": list(self.requests["epoch"]),
            "interrupt_reasons": list(self.requests["interrupt"]),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.requests["stop"] = list(state.get("reasons", []))
        self.requests["epoch"] = list(state.get("epoch_reasons", []))
        self.requests["interrupt"] = list(state.get("interrupt_reasons", []))
