"""The stopping API of unison's Engine: every stop is a request the ranks agree on.

``terminate``, ``terminate_epoch``, ``interrupt`` and ``request_stop`` may be called on any
subset of ranks; ``stop_agreed`` is for decisions every rank takes alike at a sync point.
All of them go to the engine's :class:`~unison.engine.control.StopControl`, which decides
and applies them with one boundary rule at every world size.
"""

from __future__ import annotations

from ignite.engine import Engine as IgniteEngine

from unison.distributed.primitives import get_world_size
from unison.engine.control import Kind, StopControl


class AgreedStops(IgniteEngine):
    """ignite's stopping methods, made agreed; the base of :class:`~unison.engine.Engine`."""

    _control: StopControl
    _waiting_boundary: bool
    _in_sync: bool

    def terminate(self, skip_completed: bool = False) -> None:
        """Stops the run; with several ranks, all stop after the same iteration.

        At world size 1 the run stops after the current event, as ignite's does. With more
        ranks the call is a request: every rank stops at the first sync point at or after
        it (see :meth:`request_stop`), whichever ranks made it. Either way a stop never
        splits a gradient-accumulation window: it waits for the window's last micro-batch.
        """
        self._request("stop", "terminate() was called", skip_completed)

    def terminate_epoch(self, skip_epoch_completed: bool = False) -> None:
        """Ends the current epoch; with several ranks, all end it after the same iteration.

        That iteration is the first sync point at or after the call: with ``sync_every=None``
        (an evaluator's default) the epoch's end, so the epoch then runs to its end anyway.
        """
        if skip_epoch_completed and get_world_size() > 1:
            raise ValueError(
                "terminate_epoch(skip_epoch_completed=True) is not supported with several ranks: the "
                "epoch's sync point runs at EPOCH_COMPLETED and every rank must reach it."
            )
        self._request("epoch", "terminate_epoch() was called", skip_epoch_completed)

    def interrupt(self) -> None:
        """Pauses the run after the current iteration; ``run()`` continues it (see ignite).

        With several ranks every rank pauses after the same iteration, the first sync point
        at or after the call.
        """
        if not self.interrupt_resume_enabled:
            super().interrupt()  # ignite's error: interrupting is switched off
        self._request("interrupt", "interrupt() was called")

    def request_stop(self, reason: str = "requested", *, skip_completed: bool = False) -> None:
        """Asks every rank to stop at the next sync point; call it from any rank, any handler.

        Args:
            reason: why, for rank 0's log.
            skip_completed: do not fire ``COMPLETED`` after ``TERMINATE``.

        Distributed:
            Not a collective: one rank may call it alone. The stop itself is agreed at
            the next sync point, where every rank learns who asked.
        """
        self._request("stop", reason, skip_completed)

    def stop_agreed(self, reason: str) -> None:
        """Stops every rank at the end of the current sync point, for a decision all ranks share.

        For handlers that decide from state reduced at a sync point (inside
        ``load_synced_state``, or a synced handler's ``on_agreed``): every rank sees the same
        sums, takes the same decision and calls this, so no further agreement is needed.

        Raises:
            RuntimeError: when called outside a sync point, where one rank could call it
                alone and the ranks would part; use :meth:`request_stop` there.
        """
        if not self._in_sync:
            raise RuntimeError(
                f"stop_agreed({reason!r}) was called outside a sync point (at {self.last_event_name}). It is "
                "for decisions every rank takes alike from the sums a sync point hands back (inside "
                "load_synced_state, or SyncedHandler.on_agreed); called elsewhere, on one rank, the ranks "
                "would part. Use engine.request_stop(reason): it is agreed at the next sync point."
            )
        self._control.agree(reason)

    @property
    def stop_requested(self) -> bool:
        """Whether this rank has asked to stop and the ranks have not agreed yet."""
        return self._control.requested

    def _request(self, kind: Kind, reason: str, skip_completed: bool = False) -> None:
        self._control.request(kind, reason, skip_completed)
        if get_world_size() == 1:
            # Nothing to agree on: decide now, and apply at once unless a window is open.
            self._control.decide_alone()
            self._waiting_boundary = not self.at_boundary()
            if not self._waiting_boundary:
                self._control.apply(self)

    def at_boundary(self) -> bool:
        """Whether the step's state is whole here: no accumulation window is half done.

        Asks the process function (``TrainStep.at_boundary``) when it can tell; any other
        process function is always at a boundary. Sync points and checkpoints inside an
        epoch wait for one.
        """
        check = getattr(self._process_function, "at_boundary", None)
        return True if check is None else bool(check(self))

