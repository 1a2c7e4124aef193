"""``training.num_workers`` with a training stream that does not split by worker, refused at its key.

:func:`~unison.distributed.prepare_loaders` refuses the same in terms of its own argument;
from a config, the value is ``training.num_workers``'s, so the error names that key, its
file and line.
"""

from __future__ import annotations

from typing import Any

from torch.utils.data import IterableDataset

from unison.config.usercode import public_module
from unison.distributed.stream_sources import splits_by_worker
from unison.recipe.planning.run_plan import RunPlan


def check_stream_workers(plan: RunPlan, train: Any) -> None:
    """Refuses ``training.num_workers > 0`` for a training stream whose workers would each yield all of it.

    Raises:
        ConfigError: at ``training.num_workers``, with the fix.
    """
    workers = plan.loaders.training.num_workers
    if workers <= 0 or not isinstance(train, IterableDataset) or splits_by_worker(train):
        return
    raise plan.refs.origin.error(
        ("training", "num_workers"),
        f"{workers}, and the training stream, {public_module(type(train).__module__)}.{type(train).__qualname__}, "
        "does not say "
        "it splits by worker: each of the workers would yield the whole stream. Fix: wrap it in "
        "unison.distributed.shard_stream (it splits by rank and by worker), set shards_itself = True on a stream "
        "that yields only its process's share, or set training.num_workers: 0",
    )
