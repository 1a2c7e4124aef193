"""``parallel.fault_tolerance``: the run as one replica group of a torchft job, and its checks.

A section of the schema (:mod:`unison.config.schema`, hung on ``parallel``), in a module of
its own with the checks of its values, which :func:`~unison.config.validation.validate` runs
before anything spawns. What the keys do is :mod:`unison.distributed.replica_group`'s (and
docs/launching.md's, "Fault tolerance without a restart").
"""

from __future__ import annotations

import importlib.util
import math
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from unison.config.loader import RawConfig

SECTION = ("parallel", "fault_tolerance")
_ADDRESS = re.compile(r"^https?://[^\s/:]+:\d{1,5}/?$")


def _key(default: Any, doc: str) -> Any:
    return field(default=default, metadata={"doc": doc, "alias": None, "slot": None})


@dataclass
class FaultToleranceConfig:
    """Replica groups coordinated by a torchft lighthouse; ``fault_tolerance: {...}`` turns it on."""

    lighthouse: str = _key(
        "",
        "the torchft lighthouse's address, http://host:port (on a cluster: a host that is no training node)",
    )
    replica_id: int = _key(
        0,
        "this group's number, 0 .. replica_groups-1; a restarted group keeps it; its runs go to "
        "<root>/<name>-replica<id>",
    )
    replica_groups: int = _key(
        2, "how many replica groups the job has at most; the data is cut in as many shares"
    )
    min_replicas: int = _key(1, "the fewest groups a step commits with; below it, steps wait for a quorum")
    timeout: float = _key(
        30.0, "seconds the cross-group all-reduce, the commit vote and a state transfer may take"
    )
    quorum_timeout: float = _key(60.0, "seconds a step waits for a quorum before the rank fails")
    connect_timeout: float = _key(10.0, "seconds to reach the lighthouse and the group's manager")
    step_attempts: int = _key(3, "tries of one batch, each in a new quorum, before the rank fails")


def check_fault_tolerance(
    raw: RawConfig, ft: FaultToleranceConfig | None, training: Any, parallel: Any
) -> None:
    """Refuses, at the key's file:line, values no quorum can run with and settings it cannot agree on."""
    if ft is None:
        return
    checks: list[tuple[str, bool, str]] = [
        (
            "lighthouse",
            not _ADDRESS.match(ft.lighthouse),
            f"expected the lighthouse's address as http://host:port, got {ft.lighthouse!r}; start one with "
            "`torchft_lighthouse --min_replicas 1 --bind [::]:29510` and give http://<its host>:29510",
        ),
        (
            "replica_groups",
            ft.replica_groups < 1,
            f"must be >= 1 (the most groups the job has), got {ft.replica_groups!r}",
        ),
        (
            "replica_id",
            not 0 <= ft.replica_id < max(ft.replica_groups, 1),
            f"must be in 0 .. replica_groups-1 = {ft.replica_groups - 1}, got {ft.replica_id!r}; number the groups "
            "0, 1, ... (--set parallel.fault_tolerance.replica_id=$GROUP in each group's launch)",
        ),
        (
            "min_replicas",
            not 1 <= ft.min_replicas <= ft.replica_groups,
            f"must be in 1 .. replica_groups = {ft.replica_groups}, got {ft.min_replicas!r}: with more no quorum "
            "forms; 1 lets a lone group train on",
        ),
        ("step_attempts", ft.step_attempts < 1, f"must be >= 1, got {ft.step_attempts!r}"),
    ]
    for key in ("timeout", "quorum_timeout", "connect_timeout"):
        value = getattr(ft, key)
        checks.append((key, not 0 < value < math.inf, f"must be > 0 and finite (seconds), got {value!r}"))
    for key, bad, message in checks:
        if bad:
            raise raw.origin.error((*SECTION, key), message)
    refused = [
        (
            ("training", "accumulation_steps"),
            training.accumulation_steps != 1,
            "one batch per committed step",
        ),
        (("training", "amp"), training.amp == "fp16", "the fp16 loss scaler skips steps on its own"),
        (("parallel", "strategy"), parallel.strategy != "ddp", "replica groups replicate whole models (ddp)"),
    ]
    for path, bad, why in refused:
        if bad:
            raise raw.origin.error(
                path,
                f"cannot be used with parallel.fault_tolerance ({why}, which every group of a quorum must "
                "agree on); leave it at its default or drop parallel.fault_tolerance",
            )
    if importlib.util.find_spec("torchft") is None:
        raise raw.origin.error(
            SECTION,
            "parallel.fault_tolerance runs on torchft, which is not installed: pip install 'unison[ft]'",
        )
