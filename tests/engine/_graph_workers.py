"""A small graph network over generated graphs, trained and evaluated as a graph user writes it.

torch_geometric ``Data`` items with graph-level labels, batched by ``prepare_loaders`` (which
collates them into a ``Batch``), a model called ``model(x, edge_index, batch)`` and a
criterion that reads the whole batch (``compute_loss(outputs, data)``). Rank functions live
here so spawned ranks import this module, not the test module.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

pytest.importorskip("torch_geometric")  # also when --doctest-modules imports this module
from torch_geometric.data import Batch, Data  # noqa: E402
from torch_geometric.nn import GCNConv, SAGEConv, global_mean_pool  # noqa: E402

from unison.distributed import (
    TrainSampler,
    collate,
    get_rank,
    get_world_size,
    prepare_loaders,
    prepare_model,
    unwrap_model,
)
from unison.engine import Events, ModelCall, create_evaluator, create_trainer
from unison.handlers import Checkpoint
from unison.metrics import BatchLoss, Loss, MeanAbsoluteError

FEATURES, HIDDEN = 3, 8
GRAPH_CALL = ModelCall(args=["x", "edge_index", "batch"])


def make_graphs(n: int, seed: int = 0) -> list[Data]:
    """``n`` graphs of 3 to 9 nodes with random edges; the label says whether the mean
    feature is positive (one float per graph, so a batch's ``y`` has one row per graph)."""
    gen = torch.Generator().manual_seed(seed)
    graphs = []
    for _ in range(n):
        nodes = int(torch.randint(3, 10, (1,), generator=gen))
        x = torch.randn(nodes, FEATURES, generator=gen)
        edges = torch.randint(0, nodes, (2, 2 * nodes), generator=gen)
        y = (x.mean() > 0).float().reshape(1)
        graphs.append(Data(x=x, edge_index=edges, y=y))
    return graphs


class GraphNet(nn.Module):
    """Two message-passing layers, a mean over each graph's nodes, and a linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = SAGEConv(FEATURES, HIDDEN)
        self.conv2 = GCNConv(HIDDEN, HIDDEN)
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.conv1(x, edge_index))
        h = F.relu(self.conv2(h, edge_index))
        return self.head(global_mean_pool(h, batch)).squeeze(-1)


def compute_loss(outputs: torch.Tensor, data: Any) -> torch.Tensor:
    """The criterion as a graph user writes it: the model's output and the whole batch."""
    return F.binary_cross_entropy_with_logits(outputs, data.y)


def make_model(seed: int = 0) -> nn.Module:
    state = torch.random.get_rng_state()
    torch.manual_seed(seed)
    model = GraphNet()
    torch.random.set_rng_state(state)
    return model


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def train(*, per_rank: int, size: int = 24, max_epochs: int = 2) -> dict[str, Any]:
    """Trains from the same weights on this rank's shards of the same graphs (SGD, shuffled)."""
    train_set = make_graphs(size, seed=1)
    loader, _ = prepare_loaders(train_set, batch_size=per_rank, seed=5)
    model = prepare_model(make_model())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    trainer = create_trainer(model, optimizer, BatchLoss(compute_loss), model_call=GRAPH_CALL)
    seen: list[int] = []
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda e: seen.append(e.state.batch.num_graphs))
    losses: list[float] = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: losses.append(e.state.metrics["loss"]))
    trainer.run(loader, max_epochs=max_epochs)
    return {
        "initial": flat_params(make_model()),
        "params": flat_params(unwrap_model(model)),
        "graphs_per_batch": seen,
        "losses": losses,
    }


def evaluate(*, size: int = 11, batch_size: int = 2) -> dict[str, float]:
    """Evaluates a fixed model on this rank's unpadded shard of ``size`` graphs."""
    _, loader = prepare_loaders(None, make_graphs(size, seed=2), batch_size=batch_size)
    model = make_model(seed=3)
    evaluator = create_evaluator(
        model,
        {"loss": Loss(BatchLoss(compute_loss)), "mae": MeanAbsoluteError()},
        model_call=GRAPH_CALL,
    )
    return dict(evaluator.run(loader).metrics)


def truth(*, size: int = 11) -> dict[str, float]:
    """The metrics of one process over one batch of every graph: what every world size must give."""
    graphs = make_graphs(size, seed=2)
    model = make_model(seed=3)
    batch = Batch.from_data_list(graphs)
    with torch.no_grad():
        out = model(batch.x, batch.edge_index, batch.batch)
    return {"loss": float(compute_loss(out, batch)), "mae": float((out - batch.y).abs().mean())}


class GraphBudget:
    """A batch sampler that fills each batch up to ``nodes`` nodes (at least one graph), as
    graph users batch by size: batches hold varying numbers of graphs, and the loader has no
    ``batch_size``, so a mid-epoch position is counted from the batches themselves."""

    def __init__(self, sampler: TrainSampler, graphs: list[Data], nodes: int) -> None:
        self.sampler, self.graphs, self.nodes = sampler, graphs, nodes

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        total = 0
        for index in self.sampler:
            size = int(self.graphs[index].num_nodes)
            if batch and total + size > self.nodes:
                yield batch
                batch, total = [], 0
            batch.append(index)
            total += size
        if batch:
            yield batch

    def __len__(self) -> int:
        return sum(1 for _ in self)


def resume(
    folder: str,
    *,
    stop: int,
    max_epochs: int = 2,
    size: int = 22,
    per_rank: int = 3,
    node_budget: int | None = None,
) -> dict[str, Any]:
    """An uninterrupted run, and a run stopped mid-epoch after ``stop`` iterations then resumed
    from its checkpoint by a run built afresh: both end with the same parameters. With
    ``node_budget`` the batches are filled by :class:`GraphBudget` instead of ``per_rank``."""

    def build(sub: str) -> tuple[nn.Module, Any, Any, Checkpoint]:
        graphs = make_graphs(size, seed=4)
        if node_budget is None:
            loader, _ = prepare_loaders(graphs, batch_size=per_rank, seed=7)
        else:
            sampler = GraphBudget(TrainSampler(graphs, seed=7), graphs, node_budget)
            loader = DataLoader(graphs, batch_sampler=sampler, collate_fn=collate)
        model = prepare_model(make_model(seed=6))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
        trainer = create_trainer(
            model, optimizer, BatchLoss(compute_loss), model_call=GRAPH_CALL, sync_every=1
        )
        checkpoint = Checkpoint(
            f"{folder}/{sub}", {"model": model, "optimizer": optimizer}, trainer, keep_last=None
        )
        checkpoint.attach()
        return model, trainer, loader, checkpoint

    model_a, trainer_a, loader_a, _ = build("a")
    trainer_a.run(loader_a, max_epochs=max_epochs)

    _, trainer_b, loader_b, _ = build("b")
    trainer_b.add_event_handler(Events.ITERATION_COMPLETED(once=stop), lambda e: e.terminate())
    trainer_b.run(loader_b, max_epochs=max_epochs)
    stopped = trainer_b.state.iteration

    model_c, trainer_c, loader_c, checkpoint_c = build("b")
    checkpoint_c.resume("auto")
    resumed_at = trainer_c.state.iteration
    trainer_c.run(loader_c, max_epochs=max_epochs)
    return {
        "uninterrupted": flat_params(unwrap_model(model_a)),
        "resumed": flat_params(unwrap_model(model_c)),
        "stopped": stopped,
        "resumed_at": resumed_at,
        "epoch_length": trainer_a.state.epoch_length,
        "iterations": (trainer_a.state.iteration, trainer_c.state.iteration),
    }


def two_rank_job(folder: str, per_rank: int) -> dict[str, Any]:
    """Everything the 2-rank tests check, in one job (each start imports torch_geometric)."""
    return {
        "rank": get_rank(),
        "world_size": get_world_size(),
        "train": train(per_rank=per_rank),
        "evaluate": evaluate(),
        "resume": resume(folder, stop=2),
    }
