"""What every rank does for itself, however it was started (spawned, torchrun, srun).

Its set-up before user code (logging with its rank, its device), the note that names it
on an error it raises, telling a peer's failure (a lost connection) from its own, and
SLURM's variables hidden from ignite while its group is created.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import ignite.distributed as idist
import torch

from unison.distributed.env import device_for_local_rank
from unison.utils.errors import add_note, has_note
from unison.utils.logging import setup_logging

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
    device = device_for_local_rank(idist.get_local_rank())
    if device.type == "cuda":
        torch.cuda.set_device(device)
