"""The code a QuantumGrav user keeps beside their config: a reader for causal-set zarr stores,
the pre-transform to torch_geometric graphs, the loss, and two graph networks.

quantumgrav_train_ddp.yaml and quantumgrav_custom_model.yaml name these as QuantumGrav's configs
do, `__main__.<name>`: `unison run CONFIG --main quantumgrav_user.py` makes this file their `__main__`.
"""

from __future__ import annotations

from typing import Any

import torch


def read_data(
    store: Any, idx: int, float_dtype: torch.dtype, int_dtype: torch.dtype, validate_data: bool
) -> dict[str, Any]:
    """Every array of the group ``cset_<idx + 1>`` of the store, as numpy arrays."""
    import zarr

    group = zarr.open_group(store, path=f"cset_{idx + 1}", mode="r")
    return {name: array[:] for name, array in group.arrays()}


def collect_data(data: dict[str, Any]) -> Any:
    """A graph: links as edges, in- and out-degrees as node features, manifold-likeness as target."""
    import numpy as np
    from torch_geometric.data import Data
    from torch_geometric.utils import dense_to_sparse

    edge_index, _ = dense_to_sparse(torch.tensor(data["linkmat"], dtype=torch.float32))
    x = torch.tensor(np.stack([data["in_degrees_link"], data["out_degrees_link"]]), dtype=torch.float32).t()
    y = torch.tensor(data["manifold_like"], dtype=torch.float32).reshape(1)
    graph = Data(x=x, edge_index=edge_index, y=y, atom_count=torch.tensor(x.shape[0]))
    if not graph.validate():
        raise ValueError(f"invalid graph: {graph}")
    return graph


def compute_loss(predictions: torch.Tensor, data: Any, *args: Any) -> torch.Tensor:
    """Mean squared error of one score per graph against its target."""
    return torch.nn.functional.mse_loss(predictions.reshape(-1), data.y.reshape(-1))


class GNNModel(torch.nn.Module):
    """Two SAGE convolutions, mean pooling and a linear read-out: one score per graph."""

    def __init__(self, hidden: int = 16) -> None:
        super().__init__()
        from torch_geometric.nn import SAGEConv

        self.conv1 = SAGEConv(2, hidden)
        self.conv2 = SAGEConv(hidden, hidden)
        self.out = torch.nn.Linear(hidden, 1)

    def forward(
        self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor | None = None
    ) -> torch.Tensor:
        from torch_geometric.nn import global_mean_pool

        h = self.conv2(self.conv1(x, edge_index).relu(), edge_index).relu()
        return self.out(global_mean_pool(h, batch))


class BidirectionalModel(torch.nn.Module):
    """One convolution along the edges, one against them, weighted, pooled and read out.

    Built as ``BidirectionalModel(conv_class, conv_args, conv_kwargs)``: the config passes a
    torch_geometric convolution class and its arguments positionally.
    """

    def __init__(self, conv: type[torch.nn.Module], args: list[Any], kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.forward_conv = conv(*args, **kwargs)
        self.backward_conv = conv(*args, **kwargs)
        self.forward_weight = torch.nn.Parameter(torch.tensor(1.0))
        self.backward_weight = torch.nn.Parameter(torch.tensor(1.0))
        self.out = torch.nn.Linear(args[1], 1)

    def forward(
        self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor | None = None
    ) -> torch.Tensor:
        from torch_geometric.nn import global_mean_pool

        ahead = self.forward_conv(x, edge_index)
        behind = self.backward_conv(x, edge_index.flip(0))
        h = (self.forward_weight * ahead + self.backward_weight * behind).relu()
        return self.out(global_mean_pool(h, batch))
