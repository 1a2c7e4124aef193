"""Launching ranks, the collectives unison relies on, samplers and loaders."""

from unison.distributed.batches import count_items, move_to_device
from unison.distributed.collate import collate
from unison.distributed.env import default_backend, detect_launcher, find_free_port
from unison.distributed.file_dataset import FileDataset
from unison.distributed.iterable import ShardedStream, shard_stream
from unison.distributed.job import job_id
from unison.distributed.launcher import DEFAULT_TIMEOUT, RankFailedError, launch
from unison.distributed.loaders import prepare_loaders, split_dataset
from unison.distributed.model import find_unused_from_env, model_device, prepare_model, unwrap_model
from unison.distributed.primitives import (
    all_reduce_sum,
    barrier,
    broadcast_object,
    device,
    get_local_rank,
    get_rank,
    get_world_size,
    is_distributed,
    rank_zero_only,
    sync_bool,
)
from unison.distributed.samplers import EvalSampler, TrainSampler, samplers_with_set_epoch, set_sampler_epoch
from unison.distributed.sync import (
    SyncContributor,
    SyncEngine,
    SyncPoint,
    rank_row,
    require_sync_point,
    split_rows,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "EvalSampler",
    "FileDataset",
    "RankFailedError",
    "ShardedStream",
    "SyncContributor",
    "SyncEngine",
    "SyncPoint",
    "TrainSampler",
    "all_reduce_sum",
    "barrier",
    "broadcast_object",
    "collate",
    "count_items",
    "default_backend",
    "detect_launcher",
    "device",
    "find_free_port",
    "find_unused_from_env",
    "get_local_rank",
    "get_rank",
    "get_world_size",
    "is_distributed",
    "job_id",
    "launch",
    "model_device",
    "move_to_device",
    "prepare_loaders",
    "prepare_model",
    "rank_row",
    "rank_zero_only",
    "require_sync_point",
    "samplers_with_set_epoch",
    "set_sampler_epoch",
    "shard_stream",
    "split_dataset",
    "split_rows",
    "sync_bool",
    "unwrap_model",
]
