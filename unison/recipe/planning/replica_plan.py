"""``parallel.fault_tolerance`` planned: the replica group's settings a config gives.

:func:`replica_settings` turns the checked section into the
:class:`~unison.distributed.replica_group.ReplicaSettings` that
:class:`~unison.distributed.replica_group.ReplicaGroup` takes, for a script of one's own that
runs a config's replica group with :func:`~unison.engine.quorum_step.create_replica_trainer`.
"""

from __future__ import annotations

from unison.config import Config
from unison.distributed.replica_group import ReplicaSettings


def replica_settings(config: Config) -> ReplicaSettings | None:
    """The replica group's settings from ``config``'s ``parallel.fault_tolerance``; None when off."""
    ft = config.parallel.fault_tolerance
    if ft is None:
        return None
    return ReplicaSettings(
        lighthouse=ft.lighthouse,
        replica_id=ft.replica_id,
        replica_groups=ft.replica_groups,
        min_replicas=ft.min_replicas,
        timeout_s=ft.timeout,
        quorum_timeout_s=ft.quorum_timeout,
        connect_timeout_s=ft.connect_timeout,
        step_attempts=ft.step_attempts,
    )
