"""One rank of ``scale.py``: a tiny DDP run whose collectives are counted and whose save is weighed.

Counted by replacing the ``torch.distributed`` functions with counting wrappers for a block,
as ``tests/_collective_probe.py`` does (unison and ignite look them up at call time; DDP's
gradient all-reduce runs in its C++ reducer and is not counted: it is the model's, not
unison's). Objects each rank sends through ``gather_object`` and ``all_gather_object`` are pickled
once more to weigh them (what torch sends is their pickle).
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

NAMES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
)
_OBJECT_ARG = {"gather_object": 0, "all_gather_object": 1}


class Probe:
    """Collectives by name, and the pickled bytes of the objects this rank sent, inside ``counting()``."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self.object_bytes = 0

    @contextlib.contextmanager
    def counting(self) -> Iterator[Probe]:
        import torch.distributed as dist

        saved = {n: getattr(dist, n) for n in NAMES if hasattr(dist, n)}

        def wrap(name: str, original: Any) -> Any:
            @functools.wraps(original)
            def counted(*args: Any, **kwargs: Any) -> Any:
                self.calls[name] += 1
                if name in _OBJECT_ARG and len(args) > _OBJECT_ARG[name]:
                    self.object_bytes += len(pickle.dumps(args[_OBJECT_ARG[name]]))
                return original(*args, **kwargs)

            return counted

        for name, original in saved.items():
            setattr(dist, name, wrap(name, original))
        try:
            yield self
        finally:
            for name, original in saved.items():
                setattr(dist, name, original)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def rank_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Trains one epoch of ``cfg['iters']`` iterations with a sync point every ``cfg['sync_every']``,
    evaluates, saves once, then times ``cfg['calls']`` sync points; counts every part."""
    import _common as C
    import torch
    import torch.nn.functional as F
    from torch.utils.data import TensorDataset

    from unison import Events, create_evaluator, create_trainer, prepare_loaders, prepare_model
    from unison.distributed import get_world_size
    from unison.handlers import Checkpoint
    from unison.metrics import Accuracy, Loss

    torch.set_num_threads(1)
    world = get_world_size()
    gen = torch.Generator().manual_seed(0)
    n = cfg["iters"] * cfg["batch"] * world
    train = TensorDataset(torch.randn(n, 8, generator=gen), torch.randint(0, 2, (n,), generator=gen))
    val = TensorDataset(torch.randn(4 * world + 1, 8, generator=gen), torch.randint(0, 2, (4 * world + 1,)))
    train_loader, val_loader = prepare_loaders(train, val, batch_size=cfg["batch"], seed=0)
    torch.manual_seed(0)
    model = prepare_model(torch.nn.Linear(8, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, F.cross_entropy, sync_every=cfg["sync_every"])
    evaluator = create_evaluator(model, {"accuracy": Accuracy(), "loss": Loss(F.cross_entropy)})
    checkpoint = Checkpoint(
        Path(cfg["folder"]) / f"world{world}",
        {"model": model, "optimizer": optimizer},
        trainer,
        every_epochs=None,
        at_end=False,
        keep_last=None,
    )
    checkpoint.attach()

    iteration = Probe()
    per_iteration: list[int] = []
    stack: list[Any] = []

    def enter(_: Any) -> None:
        before = iteration.total
        stack.append((iteration.counting(), before))
        stack[-1][0].__enter__()

    def leave(_: Any) -> None:
        cm, before = stack.pop()
        cm.__exit__(None, None, None)
        per_iteration.append(iteration.total - before)

    trainer.add_event_handler(Events.ITERATION_STARTED, enter)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, leave)  # attached last: after every handler
    syncs: dict[str, list[int]] = {"in_epoch": [], "epoch_end": []}
    original = trainer._sync

    def counted_sync(epoch_end: bool) -> None:
        probe = Probe()
        with probe.counting():
            original(epoch_end)
        syncs["epoch_end" if epoch_end else "in_epoch"].append(probe.total)

    trainer._sync = counted_sync  # what the engine calls at each sync point
    trainer.run(train_loader, max_epochs=1)
    trainer._sync = original

    evaluation = Probe()
    with evaluation.counting():
        evaluator.run(val_loader)
    save = Probe()
    with save.counting():
        checkpoint.save(trainer)
    checkpoint.wait()
    sent = torch.tensor([float(save.object_bytes)])
    torch.distributed.all_reduce(sent)
    gathered = int(sent.item())

    calls = cfg["calls"]

    four = torch.ones(4, dtype=torch.float64)
    timed = {"sync_point": lambda: original(False), "all_reduce": lambda: torch.distributed.all_reduce(four)}

    def block(fn: Any, spent: list[float]) -> Any:
        def run() -> None:
            for _ in range(calls):
                start = time.perf_counter()
                fn()
                spent.append(time.perf_counter() - start)

        return run

    for fn in timed.values():  # warm-up
        C.timed_block(block(fn, []), "cpu")
    medians: dict[str, list[float]] = {name: [] for name in timed}
    for r in range(cfg["repeats"]):
        for name in C.rotated(list(timed), r):
            spent: list[float] = []
            C.timed_block(block(timed[name], spent), "cpu")
            medians[name].append(C.slowest([C.median(spent)], "cpu")[0])
    return {
        "world_size": world,
        "iterations": len(per_iteration),
        "collectives_per_iteration": max(per_iteration),
        "collectives_per_sync_point": syncs["in_epoch"],
        "collectives_per_epoch_end": syncs["epoch_end"],
        "collectives_per_evaluation": evaluation.total,
        "evaluation_calls": dict(evaluation.calls),
        "collectives_per_save": save.total,
        "save_calls": dict(save.calls),
        "save_bytes_sent_by_this_rank": save.object_bytes,
        "save_bytes_sent_by_all_ranks": gathered,
        "sync_point_s": medians["sync_point"],
        "all_reduce_s": medians["all_reduce"],
        "accuracy": evaluator.state.metrics["accuracy"],
    }
