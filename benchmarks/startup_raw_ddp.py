"""The raw baseline of ``startup.py``: a plain DDP script on the digits recipe's data and model.

Run by torchrun (``python -m torch.distributed.run --nproc_per_node=2 benchmarks/startup_raw_ddp.py``):
gloo, the 8x8 digits from scikit-learn split 70/15/15 with a seeded permutation, a
``DistributedSampler``, the recipe's small CNN (written out here, so nothing of unison is
imported) in ``DistributedDataParallel``, Adam, and ``--iterations`` steps. With
``UNISON_STARTUP_TRACE=<file>`` it appends the same lines as unison's start-up trace
(``unison.utils.startup``): ``imports``, ``process_group``, ``data``, ``model``,
``first_batch`` and ``first_iteration``.
"""

from __future__ import annotations

import os
import time


def mark(phase: str) -> None:
    path = os.environ.get("UNISON_STARTUP_TRACE")
    if path:
        with open(path, "a") as fh:
            fh.write(f"{phase} {time.time():.6f} {os.getpid()} {os.environ.get('RANK', '-')}\n")


import argparse  # noqa: E402
import gc  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset  # noqa: E402

mark("imports")


def small_cnn(channels: int = 16, hidden: int = 64) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, 2 * channels, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(2 * channels * 4 * 4, hidden),
        nn.ReLU(),
        nn.Linear(hidden, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iterations", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    mark("process_group")
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    data = TensorDataset(images, torch.tensor(digits.target, dtype=torch.long))
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    train = Subset(data, order[: int(0.7 * len(data))])
    sampler = DistributedSampler(train, seed=0)
    loader = DataLoader(train, batch_size=32, sampler=sampler)
    mark("data")
    torch.manual_seed(0)
    model = DistributedDataParallel(small_cnn())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    mark("model")
    sampler.set_epoch(0)
    for i, (x, y) in enumerate(loader):
        if i == 0:
            mark("first_batch")
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()
        if i == 0:
            mark("first_iteration")
        if i + 1 == args.iterations:
            break
    # DDP's reducer holds the group: freed first, else the destroy can abort the process
    # ("terminate called without an active exception"), as it did one round in a benchmark run
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
