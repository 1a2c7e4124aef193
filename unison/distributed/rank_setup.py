"""What every rank does for itself, however it was started (spawned, torchrun, srun).

Its set-up before user code (logging with its rank, its device), the note that names it
on an error it raises, telling a peer's failure (a lost connection) from its own, SLURM's
variables hidden from ignite while its group is created, and how it leaves its group
(:func:`_leave_group`).
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import ignite.distributed as idist
import torch

from unison.distributed.env import device_for_local_rank
from unison.utils.exception_notes import add_note, has_note, print_notes_at_exit
from unison.utils.logging import get_logger, setup_logging

_log = get_logger(__name__)

# Messages of errors a rank gets because another rank died while they shared a collective:
# only a lost connection says that. A backend's own errors (a gloo size mismatch, an NCCL
# error of this rank) name "ProcessGroupGloo" or "DistBackendError" too, and are this rank's
# failure, with a traceback to print.
_PEER_FAILURE_MARKERS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "NCCL communicator was aborted",
)


@contextlib.contextmanager
def _hide_slurm_from_ignite(hide: bool) -> Iterator[None]:
    """Under torchrun inside an sbatch job, torchrun's variables describe the ranks.

    ignite reads SLURM's whenever SLURM_JOB_ID is set, and with several nodes refuses
    torchrun's RANK because it differs from SLURM_PROCID (one srun task per node starts
    several torchrun workers). The group is created, and ranks placed, from torchrun's
    variables alone; SLURM's are back once that is done.
    """
    if not hide:
        yield
        return
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SLURM_")}
    try:
        yield
    finally:
        os.environ.update(saved)


def _note_rank(err: BaseException) -> None:
    note = f"on rank {idist.get_rank()} of {idist.get_world_size()} (pid {os.getpid()})"
    if not has_note(err, note):
        add_note(err, note)


def _is_peer_failure(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}"
    return any(marker in text for marker in _PEER_FAILURE_MARKERS)


def _configure_rank() -> None:
    """Per-process set-up every rank does before user code: logging and the device."""
    # Resolving rank and world size here runs idist's one-time context sync on every rank
    # at the same moment, instead of at the first rank-conditional idist call.
    rank, world_size = idist.get_rank(), idist.get_world_size()
    setup_logging(rank=rank, world_size=world_size)
    print_notes_at_exit()  # which handler and event raised, on Python 3.10 too
    device = device_for_local_rank(idist.get_local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)


# The C++ threads of a process group, by the names torch and gloo give them: gloo's worker
# threads (2 per group) and its socket loop, and the TCPStore server of rank 0.
_GROUP_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv", "pt_tcpstore")


def _group_threads() -> list[str]:
    """The names of this process's threads that belong to a process group (Linux; else [])."""
    names = []
    for comm in Path("/proc/self/task").glob("*/comm"):
        with contextlib.suppress(OSError):
            name = comm.read_text().strip()
            if name in _GROUP_THREADS:
                names.append(name)
    return sorted(names)


_frozen_caches: list[object] = []
"""The caches of ``torch.distributed`` among the objects :func:`freeze_heap` froze: a scan of the
heap as a rank leaves no longer sees them (``gc.get_objects`` leaves frozen objects out)."""


def freeze_heap() -> None:
    """Moves every object of this process out of the garbage collector's passes (``gc.freeze``), for
    a process whose forks are ranks (``unison.testing``'s warm process): a rank's collections then
    walk only what the rank made, and leave the frozen objects' pages shared. The caches of
    ``torch.distributed`` among them are kept aside, for :func:`_clear_dtensor_cache` to empty."""
    _frozen_caches.extend(_caches_of("torch.distributed"))
    gc.freeze()


def _clear_dtensor_cache() -> None:
    """Empties DTensor's caches, whose entries hold the device mesh of a sharded (FSDP2) model and
    through it the process group, whose threads then outlived the group's destroy: the sharding
    propagation cache kept in C++ (where ``gc`` cannot see it), the redistribution planners and
    the ``functools`` caches of ``torch.distributed`` (redistribution plans, mesh topology,
    tensor metadata; some on instances, such as DTensor's sharding propagator). Only where
    DTensor was imported; it scans the heap once, as the rank leaves: the objects a fork server
    froze are not scanned, their caches were found as they were frozen."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    redistribute = sys.modules.get("torch.distributed.tensor._redistribute")
    for clear in (
        getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None),
        getattr(redistribute, "clear_redistribute_planner_cache", None),  # planners keyed by mesh
    ):
        if callable(clear):
            clear()
    for cache in (*_frozen_caches, *_caches_of("torch.distributed")):
        with contextlib.suppress(Exception):
            cache.cache_clear()  # type: ignore[attr-defined]


def _caches_of(package: str) -> list[object]:
    """The objects with a ``cache_clear`` method defined in ``package``, among those ``gc`` tracks
    and has not frozen."""
    found = []
    with warnings.catch_warnings():  # reading attributes of deprecated objects warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            try:
                owner = (
                    getattr(obj, "__module__", None) if callable(getattr(obj, "cache_clear", None)) else None
                )
                if isinstance(owner, str) and owner.startswith(package):
                    found.append(obj)
            except Exception:  # an object whose attributes cannot be read: not one of these caches
                continue
    return found


def _leave_group() -> None:
    """Destroys this rank's process group for good, while Python is still whole.

    Called by every rank whose function returned, before its process exits (spawned ranks,
    and ranks of torchrun or srun whose group :func:`~unison.distributed.launch` created).
    ``destroy_process_group`` only drops the group from torch's registry; the C++ group and
    its threads (gloo's two workers and its socket loop; on rank 0 the TCPStore server)
    live on while anything references it, and a ``DistributedDataParallel`` does (its
    Reducer), kept alive by the reference cycles of an engine and its handlers. Such a
    group was destroyed by the garbage collection of interpreter teardown
    (``Py_FinalizeEx``), with the GIL held and the interpreter finalizing, which kills any
    thread that still needs Python; a C++ thread killed that way aborts the process with
    "terminate called without an active exception", after training succeeded, now and then,
    as scheduling allows (torch issue #190489). Collecting the garbage first frees those
    models while their group is whole, so the destroy below frees the group and joins its
    threads here. (Collecting only after the destroy, to skip the pass when nothing holds the
    group, left a model's destructor waiting on a destroyed group now and then: a rank hung
    in ``gc.collect`` after its function returned.)

    No barrier before it: ranks return at different times (rank 0 writes files), and a rank
    that ran fewer collectives than its peers must leave, so that their next collective fails
    with a lost connection that names the cause, instead of waiting on it in a barrier.
    """
    _clear_dtensor_cache()  # DTensor's caches hold its mesh, and the mesh the group
    gc.collect()  # a model in reference cycles still holds the group: freed while it is whole
    idist.finalize()  # dist.destroy_process_group(), and ignite back to a single process
    left = _group_threads()
    if left:
        _log.warning(
            "The process group was destroyed but its threads (%s) still run: an object still "
            "references the group, for instance a DistributedDataParallel model kept in a global "
            "variable or a cache. They stop only as Python exits, which can abort the process "
            "('terminate called without an active exception'). Drop such references before the "
            "function returns.",
            ", ".join(left),
        )
