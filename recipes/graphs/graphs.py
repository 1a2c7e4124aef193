"""Data and model of the graphs recipe: is a directed graph a sprinkled 2-d spacetime, or random?

Each graph is a small causal set. A *manifold-like* one is ``N`` points sprinkled uniformly
into a 2-d causal diamond (light-cone coordinates ``u, v`` in ``[0, 1]``): point ``i``
precedes ``j`` when ``u_i < u_j`` and ``v_i < v_j``, and an edge joins ``i`` to ``j`` when
nothing lies between them (a link). A *random* one has as many edges as a sprinkled graph
of the same size, placed between uniformly drawn earlier-later pairs. Each node carries its
in- and out-degree; the task is to tell the two families apart (label 1: manifold-like).

The data is written as zarr stores, the way causal-set generators write theirs: one store
per family, one group per graph (``cset_1``, ``cset_2``, ...) holding ``linkmat``,
``in_degrees_link``, ``out_degrees_link`` and ``manifold_like``, and a root
array ``num_causal_sets``. Nothing is downloaded: the stores are made from a seed.

    python recipes/graphs/graphs.py --make-data data/graphs     # writes the two stores
    unison run recipes/graphs/config.yaml --nproc 2              # makes them on first use

``read_data``, ``collect_data`` and ``compute_loss`` have the signatures a QuantumGrav
config expects of them; ``GraphClassifier`` takes its convolution class positionally.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from unison.metrics import SumMetric

FAMILIES = {"manifold": 1, "random": 0}
"""Store name (``<name>.zarr``) -> label: 1 for manifold-like graphs, 0 for random ones."""


# -- data -------------------------------------------------------------------------------------


def sprinkle(rng: np.random.Generator, n: int) -> np.ndarray:
    """The link matrix of ``n`` points sprinkled into a 2-d causal diamond, in time order."""
    u, v = rng.random(n), rng.random(n)
    order = np.argsort(u + v)
    u, v = u[order], v[order]
    before = (u[:, None] < u[None, :]) & (v[:, None] < v[None, :])
    between = (before.astype(np.int64) @ before.astype(np.int64)) > 0
    return (before & ~between).astype(np.int8)


def random_links(rng: np.random.Generator, n: int, edges: int) -> np.ndarray:
    """A link matrix with ``edges`` edges drawn uniformly among the pairs ``i < j``."""
    rows, cols = np.triu_indices(n, k=1)
    chosen = rng.choice(rows.size, size=edges, replace=False)
    links = np.zeros((n, n), dtype=np.int8)
    links[rows[chosen], cols[chosen]] = 1
    return links


def make_graph(rng: np.random.Generator, family: str, min_nodes: int, max_nodes: int) -> np.ndarray:
    """One link matrix of ``family`` with between ``min_nodes`` and ``max_nodes`` nodes."""
    n = int(rng.integers(min_nodes, max_nodes + 1))
    links = sprinkle(rng, n)
    if family == "random":
        links = random_links(rng, n, int(links.sum()))
    return links


def make_data(
    folder: str | Path,
    *,
    graphs_per_file: int = 100,
    min_nodes: int = 24,
    max_nodes: int = 40,
    seed: int = 0,
) -> list[Path]:
    """Writes one zarr store per family into ``folder`` and returns their paths.

    The same arguments write the same graphs. Stores that exist with the same arguments
    are kept as they are (their files are untouched, so a cache built from them stays valid).
    """
    import zarr

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    recipe = {
        "graphs_per_file": graphs_per_file,
        "min_nodes": min_nodes,
        "max_nodes": max_nodes,
        "seed": seed,
    }
    stamp = folder / "made.json"
    paths = [folder / f"{family}.zarr" for family in FAMILIES]
    if stamp.exists() and json.loads(stamp.read_text()) == recipe and all(p.is_dir() for p in paths):
        return paths
    for k, (family, label) in enumerate(FAMILIES.items()):
        rng = np.random.default_rng([seed, k])
        root = zarr.open_group(str(paths[k]), mode="w")
        root.create_array("num_causal_sets", data=np.array([graphs_per_file], dtype=np.int64))
        for i in range(graphs_per_file):
            links = make_graph(rng, family, min_nodes, max_nodes)
            group = root.create_group(f"cset_{i + 1}")
            group.create_array("linkmat", data=links)
            group.create_array("in_degrees_link", data=links.sum(axis=0).astype(np.int32))
            group.create_array("out_degrees_link", data=links.sum(axis=1).astype(np.int32))
            group.create_array("manifold_like", data=np.array([label], dtype=np.int8))
    stamp.write_text(json.dumps(recipe))
    return paths


def read_data(
    store: Any, idx: int, float_dtype: torch.dtype, int_dtype: torch.dtype, validate_data: bool
) -> dict[str, Any]:
    """Graph ``idx`` (from 0) of a store: its arrays as tensors of the given dtypes.

    ``store`` is a zarr store or the path of one; the graph is the group ``cset_<idx + 1>``.
    With ``validate_data``, a link matrix that is not square, or whose degrees disagree
    with the stored ones, is refused, naming the group.
    """
    import zarr

    group = zarr.open_group(store, path=f"cset_{idx + 1}", mode="r")
    links = np.asarray(group["linkmat"][:])
    data = {
        "linkmat": torch.as_tensor(links, dtype=int_dtype),
        "in_degrees_link": torch.as_tensor(group["in_degrees_link"][:], dtype=float_dtype),
        "out_degrees_link": torch.as_tensor(group["out_degrees_link"][:], dtype=float_dtype),
        "manifold_like": torch.as_tensor(group["manifold_like"][:], dtype=int_dtype),
    }
    if validate_data:
        n = links.shape[0]
        if links.shape != (n, n):
            raise ValueError(f"cset_{idx + 1}: linkmat has shape {links.shape}, expected a square matrix")
        if not torch.equal(data["in_degrees_link"], data["linkmat"].sum(0).to(float_dtype)):
            raise ValueError(f"cset_{idx + 1}: in_degrees_link disagrees with the columns of linkmat")
    return data


def collect_data(data: dict[str, Any]) -> Any:
    """One graph as a torch_geometric ``Data``: edges from the link matrix, degrees as features,
    ``y`` the label (1: manifold-like)."""
    from torch_geometric.data import Data

    edge_index = data["linkmat"].nonzero().t().contiguous().long()
    x = torch.stack([data["in_degrees_link"], data["out_degrees_link"]], dim=1).float()
    return Data(x=x, edge_index=edge_index, y=data["manifold_like"].reshape(1).long())


def compute_loss(outputs: torch.Tensor, data: Any, *args: Any) -> torch.Tensor:
    """Cross-entropy of the class scores against the graphs' labels (a trainer, if passed, is unused)."""
    return nn.functional.cross_entropy(outputs, data.y)


class GraphCount(SumMetric):
    """How many graphs (samples) were evaluated, summed over every rank."""

    state_size = 1

    def batch_state(self, output: Any) -> torch.Tensor:
        _, y = output
        return torch.full((1,), float(y.shape[0]), dtype=torch.float64, device=y.device)

    def compute_from(self, state: torch.Tensor) -> int:
        return int(state.item())


# -- model ------------------------------------------------------------------------------------


class GraphClassifier(nn.Module):
    """Convolutions along and against the edges, a mixing convolution, mean pooling, a linear head.

    ``conv_type(*conv_args, **conv_kwargs)`` builds each directed convolution, e.g.
    ``SAGEConv`` with ``[2, 32]``: ``conv_args[0]`` node features in, ``conv_args[1]`` out.
    The two directions see a node's past and its future; a third convolution of the same
    type mixes them over both directions before the graphs are pooled into class scores.
    """

    def __init__(
        self,
        conv_type: type[nn.Module],
        conv_args: list[Any],
        conv_kwargs: dict[str, Any] | None = None,
        classes: int = 2,
    ) -> None:
        super().__init__()
        kwargs = dict(conv_kwargs or {})
        hidden = int(conv_args[1])
        self.future = conv_type(*conv_args, **kwargs)
        self.past = conv_type(*conv_args, **kwargs)
        self.mix = conv_type(2 * hidden, hidden, *conv_args[2:], **kwargs)
        self.head = nn.Linear(hidden, classes)

    def forward(
        self, x: torch.Tensor, edge_index: torch.Tensor, batch: torch.Tensor | None = None
    ) -> torch.Tensor:
        from torch_geometric.nn import global_mean_pool

        h = torch.cat([self.future(x, edge_index), self.past(x, edge_index.flip(0))], dim=1).relu()
        both = torch.cat([edge_index, edge_index.flip(0)], dim=1)
        h = self.mix(h, both).relu()
        return self.head(global_mean_pool(h, batch))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write the graphs recipe's zarr stores.")
    parser.add_argument("--make-data", required=True, metavar="DIR", help="folder for the stores")
    parser.add_argument("--graphs-per-file", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    for path in make_data(args.make_data, graphs_per_file=args.graphs_per_file, seed=args.seed):
        print(path)
