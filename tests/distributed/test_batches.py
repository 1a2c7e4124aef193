"""Batches of any shape: moved to a device whole, counted in items, and graph items collated."""

from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict, namedtuple
from dataclasses import dataclass, field

import pytest
import torch

from unison.distributed import collate, count_items, move_to_device, prepare_loaders
from unison.distributed.collate import is_graph_item

META = torch.device("meta")  # a second device on any machine: a tensor moved there shows it


def _devices(batch: object) -> set[str]:
    if isinstance(batch, torch.Tensor):
        return {batch.device.type}
    if isinstance(batch, dict):
        return set().union(*(_devices(v) for v in batch.values()))
    if isinstance(batch, (list, tuple)):
        return set().union(*(_devices(v) for v in batch))
    return set()


@dataclass
class TextBatch:
    ids: torch.Tensor
    labels: torch.Tensor
    names: list[str]
    lengths: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Frozen:
    x: torch.Tensor


Pair = namedtuple("Pair", ["x", "y"])


class Movable:
    """An object that moves itself, with a ``to`` that takes no ``non_blocking``."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x
        self.calls: list[tuple] = []

    def to(self, device: torch.device) -> Movable:
        self.calls.append((device,))
        return Movable(self.x.to(device))


def test_nested_containers_keep_their_types_and_every_tensor_moves() -> None:
    batch = {
        "pair": Pair(torch.zeros(2), [torch.ones(2), "text"]),
        "ordered": OrderedDict(a=torch.zeros(1)),
        "tuple": (torch.zeros(3), 7),
    }
    moved = move_to_device(batch, META)
    assert type(moved["pair"]) is Pair and type(moved["ordered"]) is OrderedDict
    assert moved["pair"].y[1] == "text" and moved["tuple"][1] == 7
    assert _devices(moved) == {"meta"}
    assert _devices(batch) == {"cpu"}, "the original batch is left as it was"


def test_dataclasses_are_rebuilt_with_their_tensors_moved() -> None:
    batch = TextBatch(torch.zeros(2, 3), torch.ones(2), ["a", "b"], [3, 3])
    moved = move_to_device(batch, META)
    assert isinstance(moved, TextBatch)
    assert (moved.ids.device.type, moved.labels.device.type) == ("meta", "meta")
    assert (moved.names, moved.lengths) == (["a", "b"], [3, 3])
    assert move_to_device(Frozen(torch.zeros(1)), META).x.device.type == "meta"


def test_an_object_that_moves_itself_is_asked_to_and_its_signature_is_respected() -> None:
    batch = Movable(torch.zeros(2))
    moved = move_to_device(batch, META, non_blocking=True)
    assert batch.calls == [(META,)] and moved.x.device.type == "meta"


def test_a_tensor_already_on_the_device_is_not_copied() -> None:
    t = torch.zeros(2)
    assert move_to_device({"t": t}, "cpu")["t"] is t


def test_items_are_counted_in_rows_of_the_first_countable_member() -> None:
    assert count_items({"ids": torch.zeros(5, 7), "mask": torch.zeros(5, 7)}) == 5
    assert count_items(("name", [torch.zeros(4)])) == 4
    assert count_items(TextBatch(torch.zeros(3, 2), torch.zeros(3), [])) == 3
    assert count_items(torch.tensor(2.0)) is None and count_items("text") is None


def test_collate_without_graphs_is_torchs_and_never_imports_torch_geometric() -> None:
    assert torch.equal(collate([(torch.zeros(2), 0), (torch.ones(2), 1)])[0], torch.stack([torch.zeros(2), torch.ones(2)]))
    code = (
        "import sys, torch\n"
        "from unison.distributed import prepare_loaders\n"
        "train, _ = prepare_loaders(torch.utils.data.TensorDataset(torch.zeros(6, 2), torch.zeros(6)), batch_size=4)\n"
        "assert [len(x) for x, _ in train] == [4, 2]\n"
        "assert 'torch_geometric' not in sys.modules, 'torch_geometric was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- with torch_geometric --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pyg():
    return pytest.importorskip("torch_geometric.data")


def _graph(pyg, nodes: int, label: float):
    return pyg.Data(
        x=torch.randn(nodes, 2), edge_index=torch.tensor([[0, 1], [1, 0]]), y=torch.tensor([label])
    )


def test_graph_items_collate_into_one_batch_counted_in_graphs(pyg) -> None:
    graphs = [_graph(pyg, 3, 0.0), _graph(pyg, 5, 1.0), _graph(pyg, 4, 1.0)]
    batch = collate(graphs)
    assert batch.num_graphs == 3 and batch.x.shape[0] == 12
    assert torch.equal(batch.y, torch.tensor([0.0, 1.0, 1.0]))
    assert count_items(batch) == 3, "a graph batch holds graphs, not its 12 nodes"
    moved = move_to_device(batch, META)
    assert moved.x.device.type == "meta" and moved.num_graphs == 3


def test_graphs_inside_pairs_and_subclasses_of_data_are_collated_too(pyg) -> None:
    class Molecule(pyg.Data):  # a user's subclass: its own module is not torch_geometric's
        pass

    item = Molecule(x=torch.zeros(2, 2), edge_index=torch.tensor([[0], [1]]))
    assert is_graph_item(item) and not is_graph_item({"x": torch.zeros(1)})
    batch, extra = collate([(item, torch.tensor(1)), (item, torch.tensor(2))])
    assert batch.num_graphs == 2 and torch.equal(extra, torch.tensor([1, 2]))


def test_prepare_loaders_batches_graphs_without_being_told(pyg) -> None:
    graphs = [_graph(pyg, n, float(n % 2)) for n in range(3, 10)]
    train, val = prepare_loaders(graphs, graphs, batch_size=3, shuffle=False)
    assert [b.num_graphs for b in train] == [3, 3, 1]
    assert sum(b.num_graphs for b in val) == len(graphs)
    assert sum(int(b.x.shape[0]) for b in val) == sum(range(3, 10))
    workers, _ = prepare_loaders(graphs, batch_size=3, shuffle=False, num_workers=1)  # collated in a worker
    assert [b.num_graphs for b in workers] == [3, 3, 1]


def test_prepare_loaders_takes_a_collate_fn_of_its_own_and_refuses_a_non_callable() -> None:
    data = torch.utils.data.TensorDataset(torch.arange(4.0))
    train, _ = prepare_loaders(data, batch_size=2, shuffle=False, collate_fn=lambda items: len(items))
    assert list(train) == [2, 2]
    with pytest.raises(TypeError, match=r"prepare_loaders\(collate_fn=...\) must be callable.*got str"):
        prepare_loaders(data, batch_size=2, collate_fn="default")
