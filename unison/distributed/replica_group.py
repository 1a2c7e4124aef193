"""One replica group of a torchft job: its Manager, its fault-tolerant gradient average, its live state.

A fault-tolerant job is split into replica groups, each a whole copy of the model on its own
ranks (one process, a spawned set or a torchrun job). A torchft lighthouse, outside the groups,
forms a quorum of the live groups at every step; the gradient is averaged across the groups of
the quorum on a process group that is rebuilt with each quorum, and an error in it (a peer
group killed mid-step) marks the step failed instead of ending the rank. A group that joins
late or comes back after a fault is healed from a live peer: the peer sends its model and
optimizer state over HTTP at the quorum's step, nothing is read from disk.

Inside a group nothing changes: its ranks keep their own process group (the default one),
unison's sync points and agreed stops run in it as before. :func:`~unison.engine.quorum_step.
create_replica_trainer` puts the trainer's step inside the quorum.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from unison.distributed.env import find_free_port

INSTALL_HINT = "install the extra: pip install 'unison[ft]' (torchft>=0.2)"


def _torchft() -> Any:
    try:
        import torchft
    except ImportError as error:  # an optional extra
        raise ImportError(
            f"fault tolerance across replica groups runs on torchft, which is missing; {INSTALL_HINT}"
        ) from error
    return torchft


@dataclass(frozen=True)
class ReplicaSettings:
    """How one replica group joins a torchft job (the ``parallel.fault_tolerance`` section).

    Attributes:
        lighthouse: the lighthouse's address, ``http://host:port``.
        replica_id: this group's number, ``0 <= replica_id < replica_groups``; a restarted group
            keeps its number (torchft adds a fresh suffix, so the old incarnation is not mistaken
            for it).
        replica_groups: how many groups the job has at most (the data is cut in that many shares).
        min_replicas: the fewest groups a step commits with; below it, steps wait for a quorum.
        timeout_s: the cross-group collectives', commit vote's and state transfer's timeout.
        quorum_timeout_s: how long a step waits for a quorum before the rank fails.
        connect_timeout_s: how long to wait for the lighthouse and the group's manager server.
        step_attempts: how many times one batch is tried (each in a new quorum) before the rank fails.
    """

    lighthouse: str
    replica_id: int
    replica_groups: int
    min_replicas: int = 1
    timeout_s: float = 30.0
    quorum_timeout_s: float = 60.0
    connect_timeout_s: float = 10.0
    step_attempts: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.replica_id < self.replica_groups:
            raise ValueError(
                f"ReplicaSettings(replica_id={self.replica_id}, replica_groups={self.replica_groups}): "
                "replica_id must be in [0, replica_groups); number the groups 0, 1, ..."
            )
        if not 1 <= self.min_replicas <= self.replica_groups:
            raise ValueError(
                f"ReplicaSettings(min_replicas={self.min_replicas}) must be in [1, replica_groups="
                f"{self.replica_groups}]: with more, no quorum can form; 1 lets one group train alone."
            )
        if self.step_attempts < 1:
            raise ValueError(f"ReplicaSettings(step_attempts={self.step_attempts}) must be >= 1.")


class Lighthouse:
    """A torchft lighthouse in this process, on a free port; ``with Lighthouse(...) as lh:``.

    The lighthouse forms the quorums. A local run starts one; on a cluster it runs on a host
    that is no training node (``torchft_lighthouse --min_replicas N --bind [::]:29510``) and
    the groups are given its address.
    """

    def __init__(
        self,
        min_replicas: int = 1,
        *,
        port: int | None = None,
        join_timeout_ms: int = 1000,
        heartbeat_timeout_ms: int = 2000,
        quorum_tick_ms: int = 50,
    ) -> None:
        _torchft()
        from torchft import coordination

        self.port = port or find_free_port()
        self._server = coordination.LighthouseServer(
            bind=f"[::]:{self.port}",
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            quorum_tick_ms=quorum_tick_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
        )
        self.address: str = self._server.address()
        """``http://host:port``, what :class:`ReplicaSettings` ``lighthouse`` takes."""

    def shutdown(self) -> None:
        self._server.shutdown()

    def __enter__(self) -> Lighthouse:
        return self

    def __exit__(self, *_: object) -> None:
        self.shutdown()


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(value)
    return future


def _group_ddp() -> type:
    from torchft.ddp import DistributedDataParallel

    class GroupDDP(DistributedDataParallel):
        """torchft's DDP, with the bucket averaged inside the group before the quorum's average,
        and a failed cross-group all-reduce (a peer group died mid-step) ending the bucket instead of
        the rank: torchft 0.2's own hook asserts on it, where the manager has the error already and
        the step will not be committed."""

        @staticmethod
        def _comm_hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP refuses annotations but GradBucket
            dist = torch.distributed
            buffer = bucket.buffer()
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(buffer)
                buffer.div_(dist.get_world_size())
            work = state.allreduce(buffer)
            if not work.wait():
                return _done(buffer)  # the manager recorded the error: this step is not committed
            inner = getattr(work.get_future(), "_fut", None)
            return inner if inner is not None else _done(buffer)

    return GroupDDP


class ReplicaGroup:
    """This process's rank in one replica group: the torchft Manager and what hangs on it.

    Build it on every rank of the group, after the group's own process group (if it has more
    than one rank). Then :meth:`wrap_model` (the cross-group gradient average) and
    :meth:`track` (what a healing peer receives: the model's and the optimizer's state).
    """

    def __init__(
        self,
        settings: ReplicaSettings,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        store_addr: str | None = None,
        store_port: int | None = None,
    ) -> None:
        torchft = _torchft()
        from torchft.process_group import ProcessGroupGloo

        self.settings = settings
        dist = torch.distributed
        joined = dist.is_available() and dist.is_initialized()
        self.rank = rank if rank is not None else (dist.get_rank() if joined else 0)
        self.world_size = world_size if world_size is not None else (dist.get_world_size() if joined else 1)
        self._store = None
        if store_port is None and joined:  # the group's own rendezvous store (spawn, torchrun)
            store_addr, store_port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        elif store_port is None:  # one rank alone: its own store for the manager's address
            if self.world_size != 1:
                raise ValueError(
                    f"ReplicaGroup(world_size={self.world_size}) without a process group: a group of several "
                    "ranks joins its own process group first (unison.distributed.launch, torchrun), or passes "
                    "store_addr and store_port."
                )
            store_addr, store_port = "127.0.0.1", find_free_port()
            self._store = dist.TCPStore("127.0.0.1", store_port, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=settings.timeout_s)
        self.process_group = ProcessGroupGloo(timeout=timeout)
        """The cross-group process group; rebuilt by the manager at each new quorum."""
        self.manager = torchft.Manager(
            pg=self.process_group,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=settings.min_replicas,
            use_async_quorum=False,  # heal before the forward pass, not during it
            timeout=timeout,
            quorum_timeout=timedelta(seconds=settings.quorum_timeout_s),
            connect_timeout=timedelta(seconds=settings.connect_timeout_s),
            rank=self.rank,
            world_size=self.world_size,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=settings.lighthouse,
            replica_id=f"unison_{settings.replica_id}",
        )
        self._tracked: set[str] = set()

    def wrap_model(self, model: nn.Module) -> nn.Module:
        """The model inside torchft's DDP: gradients averaged over the groups of each step's quorum.

        torchft's process group joins rank ``r`` of each group with rank ``r`` of the others; in a
        group of several ranks, each bucket is first averaged over the group's own ranks (its
        default process group), so every rank of every group ends with the same gradient.
        """
        return _group_ddp()(self.manager, model)

    def track(self, name: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]) -> None:
        """Registers state a healing group receives from a live one under ``name`` (once per name)."""
        if name in self._tracked:
            raise ValueError(f"ReplicaGroup.track({name!r}): already tracked; give each state its own name.")
        self._tracked.add(name)
        self.manager.register_state_dict_fn(name, load_state_dict, state_dict)

    def track_training(self, model: nn.Module, optimizer: Optimizer) -> None:
        """Tracks the model's weights and the optimizer's state (momenta, steps): what a step needs."""
        self.track("model", model.state_dict, model.load_state_dict)
        self.track("optimizer", optimizer.state_dict, optimizer.load_state_dict)

    def data_placement(self) -> tuple[int, int]:
        """``(rank, world_size)`` for a sampler: the group folded into the ranks, so that each
        group reads its own share of the data, ``replica_id * group_size + rank`` of
        ``replica_groups * group_size`` (e.g. ``TrainSampler(data, rank=..., world_size=...)``)."""
        return (
            self.settings.replica_id * self.world_size + self.rank,
            self.settings.replica_groups * self.world_size,
        )

    @property
    def step(self) -> int:
        """The number of steps the quorum has committed (a healed group takes its peer's)."""
        return int(self.manager.current_step())

    def start_step(self) -> None:
        """Joins this step's quorum; a group behind the quorum is healed from a peer here."""
        self.manager.start_quorum()

    def commit(self) -> bool:
        """Whether this step may be applied: every rank of the group saw no error and the quorum
        held at least ``min_replicas`` groups. Call it after the backward pass, on every rank."""
        return bool(self.manager.should_commit())

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)
        self.process_group.shutdown()
