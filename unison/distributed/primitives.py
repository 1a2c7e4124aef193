"""Rank helpers and the few collectives unison is built on.

Vocabulary: a decorator (:func:`rank_zero_only`) means "only this rank does it"; every
function that is a collective says so in the first line of its docstring, and must be
called by every rank, in the same order, or the job hangs.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal, TypeVar, cast

import ignite.distributed as idist
import torch
import torch.distributed as dist

from unison.distributed.env import device_for_local_rank

F = TypeVar("F", bound=Callable[..., Any])
SyncMode = Literal["any", "all", "rank_zero"]


def get_rank() -> int:
    """This process's global rank (0 without a process group)."""
    return idist.get_rank()


def get_world_size() -> int:
    """The number of ranks (1 without a process group)."""
    return idist.get_world_size()


def get_local_rank() -> int:
    """This process's rank on its machine (0 without a process group)."""
    return idist.get_local_rank()


def device() -> torch.device:
    """The device this rank computes on: ``cuda:LOCAL_RANK`` on GPUs, else the CPU."""
    return device_for_local_rank(get_local_rank())


def is_distributed() -> bool:
    """Whether a process group of more than one rank exists."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_zero_only(fn: F) -> F:
    """Decorator: the function runs on rank 0 only; other ranks get ``None``.

    For side effects alone (writing a file, printing). A function that is or calls a
    collective must never be wrapped: the other ranks would wait for rank 0 forever.
    Exceptions on rank 0 propagate, they are never swallowed.

    Example:
        >>> @rank_zero_only
        ... def report(msg):
        ...     print(msg)
        >>> report("hello")
        hello
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if get_rank() == 0:
            return fn(*args, **kwargs)
        return None

    return cast(F, wrapper)


def _comm_device() -> torch.device:
    """Where tensors must live for the backend's collectives."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return device()
    return torch.device("cpu")


def sync_bool(flag: bool, mode: SyncMode = "any") -> bool:
    """Collective: call on every rank. Agrees on one boolean across all ranks.

    Args:
        flag: this rank's opinion.
        mode: ``"any"``: True if any rank says True; ``"all"``: True if every rank does;
            ``"rank_zero"``: rank 0's value, for all.

    Returns:
        The same value on every rank.
    """
    if mode not in ("any", "all", "rank_zero"):
        raise ValueError(f"sync_bool(mode=...) must be 'any', 'all' or 'rank_zero', got {mode!r}.")
    if not is_distributed():
        return bool(flag)
    if mode == "rank_zero":
        return bool(broadcast_object(bool(flag), src=0))
    votes = torch.tensor([1.0 if flag else 0.0], device=_comm_device())
    dist.all_reduce(votes, op=dist.ReduceOp.SUM)
    count = int(votes.item())
    return count > 0 if mode == "any" else count == dist.get_world_size()


def first_rank(flag: bool) -> int | None:
    """Collective: call on every rank. The lowest rank whose ``flag`` is True, the same on every
    rank; None when no rank's is. One all-reduce of one number, whatever the world size.

    Outside a process group: 0 when ``flag`` is True, else None.
    """
    if not is_distributed():
        return 0 if flag else None
    world = dist.get_world_size()
    lowest = torch.tensor([get_rank() if flag else world], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    found = int(lowest.item())
    return found if found < world else None


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Collective: call on every rank. Returns rank ``src``'s ``obj`` on every rank.

    The object is pickled: send small things (a decision, a path, a config), not tensors
    of model size.
    """
    if not is_distributed():
        return obj
    holder = [obj if get_rank() == src else None]
    dist.broadcast_object_list(holder, src=src, device=_comm_device())
    return holder[0]


def barrier() -> None:
    """Collective: call on every rank. Returns once every rank has reached it."""
    if is_distributed():
        dist.barrier()


def all_reduce_sum(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Collective: call on every rank. Sums several 1-D tensors across ranks in one all-reduce.

    The tensors are flattened into one float64 buffer, reduced once, and split back, so
    the number of collectives does not grow with the number of tensors. Each rank must
    pass tensors of the same sizes in the same order.

    Returns:
        New float64 tensors on the CPU, one per input, holding the sums over all ranks.
    """
    sizes = [int(t.numel()) for t in tensors]
    if not sizes:
        return []
    comm = _comm_device()
    parts = [t.detach().reshape(-1).to(device=comm, dtype=torch.float64) for t in tensors]
    flat = parts[0] if len(parts) == 1 else torch.cat(parts)
    if is_distributed():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    flat = flat.cpu()
    return list(torch.split(flat, sizes))


def all_gather_rows(tensor: torch.Tensor | None) -> list[torch.Tensor | None]:
    """Collective: call on every rank. Every rank's tensor (rows of any count), on the CPU.

    Unlike ``all_gather``, the tensors may differ in their first dimension, and a rank with
    nothing passes None: uneven, unpadded evaluation shards gather exactly. Tensors are
    pickled (``all_gather_object``), which suits evaluation outputs, not model weights.

    Returns:
        One entry per rank, in rank order: that rank's tensor on the CPU, or None.
    """
    local = None if tensor is None else tensor.detach().cpu()
    if not is_distributed():
        return [local]
    everyone: list[Any] = [None] * get_world_size()
    dist.all_gather_object(everyone, local)
    return everyone


def broadcast_buffers(module: torch.nn.Module, src: int = 0) -> int:
    """Collective: call on every rank. Copies rank ``src``'s buffers (BatchNorm's running
    statistics, ...) into every rank's ``module``, one broadcast per dtype.

    Under DDP each rank's buffers follow its own batches between forwards (DDP broadcasts
    them at the start of each training forward, then the local batch moves them), so
    before an evaluation ranks hold different statistics, and none equals what rank 0
    saves. unison's evaluator and ``predict`` call this first, so every rank evaluates the
    model rank 0 saves.

    Returns:
        How many buffers were broadcast (0 at world size 1, or without buffers).
    """
    return broadcast_tensors(module.buffers(), src)


def broadcast_tensors(tensors: Iterable[torch.Tensor], src: int = 0) -> int:
    """Collective: call on every rank. Copies rank ``src``'s values of ``tensors`` into every rank's,
    in place: one broadcast per dtype and device, whatever their number.

    Every rank passes tensors of the same shapes and dtypes in the same order.

    Returns:
        How many tensors were broadcast (0 at world size 1).
    """
    tensors = [t for t in tensors if t.numel()]
    if not is_distributed() or not tensors:
        return 0
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    comm = _comm_device()
    for (dtype, _), group in groups.items():
        flat = torch.cat([t.detach().reshape(-1) for t in group]).to(comm)
        dist.broadcast(flat.view(torch.uint8) if dtype == torch.bool else flat, src=src)  # gloo: no bool
        with torch.no_grad():
            for tensor, part in zip(group, torch.split(flat, [t.numel() for t in group]), strict=True):
                tensor.copy_(part.view_as(tensor))
    return len(tensors)
