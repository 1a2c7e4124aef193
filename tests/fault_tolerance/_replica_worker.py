"""One replica group, as its own process tree: ``python _replica_worker.py LIGHTHOUSE ID OUT [--ranks N]``.

It trains a tiny model on fixed data with :func:`create_replica_trainer` and appends one JSON
line per committed step to ``OUT/group<ID>.jsonl`` (rank ``r > 0`` of a group: ``group<ID>-rank<r>.jsonl``): the step, its pid, the time, the data it
saw, and digests of the weights and of the optimizer's state. It stops when ``OUT/stop`` exists
or after ``--steps`` commits, and SIGKILLs itself inside its next step once ``OUT/kill<ID>``
exists: after joining the step's quorum, before the gradient's all-reduce. Any ``torch.load`` of a file is recorded as a ``disk_read`` line.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn


def digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    found = []
    for state in optimizer.state.values():
        for key in sorted(state):
            value = state[key]
            found.append(value if isinstance(value, torch.Tensor) else torch.tensor(float(value)))
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("lighthouse")
    parser.add_argument("replica_id", type=int)
    parser.add_argument("out", type=Path)
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--pace", type=float, default=0.05, help="seconds each step waits (paces the run)")
    parser.add_argument("--width", type=int, default=16, help="the hidden layer's width")
    parser.add_argument("--no-digests", action="store_true", help="no weight digests (timing runs)")
    parser.add_argument(
        "--ranks", type=int, default=1, help="ranks of the group (spawned by unison's launch)"
    )
    args = parser.parse_args()
    if args.ranks > 1:
        from unison.distributed import launch

        launch(train, args, nproc_per_node=args.ranks, backend="gloo", timeout=60)
    else:
        train(args)
    sys.exit(0)


def train(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    from unison.distributed import TrainSampler, get_rank
    from unison.distributed.replica_group import ReplicaGroup, ReplicaSettings
    from unison.engine import Events
    from unison.engine.quorum_step import create_replica_trainer

    suffix = f"-rank{get_rank()}" if get_rank() else ""  # rank 0's file is the group's
    log = open(args.out / f"group{args.replica_id}{suffix}.jsonl", "a", buffering=1)  # noqa: SIM115
    real_load = torch.load

    def watched_load(f, *a, **k):  # a checkpoint file read would show here
        if isinstance(f, (str, os.PathLike)):
            log.write(json.dumps({"disk_read": str(f)}) + "\n")
        return real_load(f, *a, **k)

    torch.load = watched_load

    torch.manual_seed(args.seed)
    model = nn.Sequential(nn.Linear(4, args.width), nn.Tanh(), nn.Linear(args.width, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = {"start": os.getpid(), "time": time.time(), "weights": digest(list(model.parameters()))}
    log.write(json.dumps(start) + "\n")

    settings = ReplicaSettings(
        lighthouse=args.lighthouse, replica_id=args.replica_id, replica_groups=args.groups, timeout_s=10
    )
    group = ReplicaGroup(settings)
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(512, 4, generator=g)
    data = torch.utils.data.TensorDataset(torch.arange(512), x, x.sum(1, keepdim=True).sin())
    rank, world = group.data_placement()
    loader = torch.utils.data.DataLoader(
        data, batch_size=4, sampler=TrainSampler(data, seed=7, rank=rank, world_size=world)
    )
    seen: list[int] = []

    def prepare(batch, device, non_blocking):
        index, xb, yb = batch
        if (
            args.out / f"kill{args.replica_id}"
        ).exists():  # in the step: after its quorum, before its all-reduce
            log.write(
                json.dumps({"killed": os.getpid(), "time": time.time(), "at_step": group.step + 1}) + "\n"
            )
            os.kill(os.getpid(), signal.SIGKILL)
        seen[:] = index.tolist()
        return xb, yb

    trainer = create_replica_trainer(group, model, optimizer, nn.functional.mse_loss, prepare_batch=prepare)

    @trainer.on(Events.ITERATION_COMPLETED)
    def _record(engine) -> None:
        line = {
            "step": group.step,
            "pid": os.getpid(),
            "time": time.time(),
            "samples": seen,
        }
        if not args.no_digests:
            line["weights"] = digest(list(model.parameters()))
            line["optimizer"] = digest(optimizer_tensors(optimizer))
        log.write(json.dumps(line) + "\n")
        if (args.out / "stop").exists() or group.step >= args.steps:
            engine.terminate()
        if args.pace:
            time.sleep(args.pace)

    trainer.run(loader, max_epochs=1000)
    log.write(json.dumps({"end": os.getpid(), "failed_tries": trainer.process_function.failed_tries}) + "\n")
    log.close()
    group.shutdown()


if __name__ == "__main__":
    main()
