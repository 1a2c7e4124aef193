"""Batches of any shape through a config: collate, training.batch, model.call, the criterion as
QuantumGrav calls it, model.args holding layer classes, and model.from_config, resolved before any
rank starts into the objects create_trainer, create_evaluator and prepare_loaders take."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torch_geometric")

from torch_geometric.nn.conv import SAGEConv  # noqa: E402

from unison.config import ConfigError, load_config  # noqa: E402
from unison.engine import AutoCall, ModelCall, WholeBatch  # noqa: E402
from unison.metrics import BatchLoss  # noqa: E402
from unison.recipe.build.assemble import build_evaluator, build_loaders, build_trainer  # noqa: E402
from unison.recipe.build.parts import Datasets  # noqa: E402
from unison.recipe.planning.resolved import make_metrics, resolve  # noqa: E402
from unison.recipe.planning.run_plan import plan  # noqa: E402

USER = """
import torch
from torch import nn
from torch_geometric.data import Data
from torch_geometric.nn import global_mean_pool

SEEN = []


class GraphNet(nn.Module):
    def __init__(self, conv, dims, conv_kwargs, pool=global_mean_pool):
        super().__init__()
        self.first = conv(*dims, **conv_kwargs)
        self.second = conv(dims[1], dims[1], **conv_kwargs)
        self.head = nn.Linear(dims[1], 1)
        self.pool = pool

    def forward(self, x, edge_index, batch):
        h = self.second(self.first(x, edge_index).relu(), edge_index).relu()
        return self.head(self.pool(h, batch)).squeeze(-1)

    @classmethod
    def from_config(cls, config):
        return cls(config["conv"], config["dims"], config.get("conv_kwargs", {}))


def graphs(seed, n=7):
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        nodes = 3 + i % 4
        x = torch.randn(nodes, 2, generator=g)
        edge_index = torch.randint(0, nodes, (2, 2 * nodes), generator=g)
        items.append(Data(x=x, edge_index=edge_index, y=torch.tensor([float(i % 2)])))
    return items


def build(seed):
    return graphs(seed), graphs(seed + 1, 5)


def loss2(outputs, batch):
    return torch.nn.functional.mse_loss(outputs, batch.y)


def loss3(outputs, data, trainer):
    SEEN.append(type(trainer).__name__)
    return torch.nn.functional.mse_loss(outputs, data.y)


def loss_args(predictions, data, *args):
    SEEN.append(len(args))
    return torch.nn.functional.mse_loss(predictions, data.y)


def loss1(outputs):
    return outputs.sum()


def my_collate(items):
    from torch_geometric.loader.dataloader import Collater
    return Collater(items)(items)


def split(batch, device):
    return batch.to(device), batch.y.to(device)


def call(model, batch):
    return model(batch.x, batch.edge_index, batch.batch)
"""

MODEL = """model:
  type: !pyobject gnn_user.GraphNet
  args:
    - !pyobject torch_geometric.nn.conv.SAGEConv
    - [2, 8]
    - {normalize: true, root_weight: false}
"""


@pytest.fixture
def write(tmp_path: Path):
    (tmp_path / "gnn_user.py").write_text(USER)

    def config(body: str, model: str = MODEL) -> Path:
        path = tmp_path / "config.yaml"
        path.write_text(
            "data:\n  build: !pyobject gnn_user.build\ntraining:\n  batch_size: 3\n" + body + model
        )
        return path

    yield config
    for name in [m for m in sys.modules if m.endswith(".gnn_user") or m == "gnn_user"]:
        sys.modules.pop(name, None)


def _line(path: Path, text: str) -> int:
    return next(i for i, row in enumerate(path.read_text().splitlines(), 1) if text in row)


def test_collate_batch_and_call_resolve_to_the_python_apis_objects(write):
    path = write(
        "  collate: !pyobject gnn_user.my_collate\n  batch: {target: y}\nvalidation:\n  every: 1\n",
        MODEL + "  call: [x, edge_index, batch]\n",
    )
    slots = resolve(load_config(path)).batches
    user = sys.modules[slots.collate["training"].__module__]
    assert slots.collate == {
        "training": user.my_collate,
        "validation": user.my_collate,
        "testing": user.my_collate,
    }
    assert isinstance(slots.prepare_batch, WholeBatch) and slots.prepare_batch.target == "y"
    assert isinstance(slots.calls["training"], ModelCall) and slots.calls["training"].args == (
        "x",
        "edge_index",
        "batch",
    )
    defaults = resolve(load_config(write(""))).batches
    assert defaults.prepare_batch is None and isinstance(defaults.calls["validation"], AutoCall)
    assert defaults.collate == {"training": None, "validation": None, "testing": None}


@pytest.mark.parametrize(
    ("body", "model", "key"),
    [
        ("  collate: !pyobject os.system\n", MODEL, "training.collate"),
        ("validation:\n  collate: !pyobject os.system\n", MODEL, "validation.collate"),
        ("  batch: !pyobject os.system\n", MODEL, "training.batch"),
        ("", MODEL + "  call: !pyobject os.system\n", "model.call"),
    ],
)
def test_a_batch_slot_refuses_what_runs_commands_naming_file_and_line(write, body, model, key):
    path = write(body, model)
    with pytest.raises(ConfigError) as info:
        resolve(load_config(path))
    assert str(info.value).startswith(f"{path}:{_line(path, 'os.system')}: {key}: ")


@pytest.mark.parametrize(
    ("criterion", "with_trainer"), [("loss2", False), ("loss3", True), ("loss_args", True)]
)
def test_the_criterion_is_called_as_its_signature_says(write, criterion, with_trainer):
    spec = "validation:\n  validator: {device: cpu, criterion: !pyobject gnn_user.loss2}\n"
    resolved = resolve(load_config(write(f"criterion: !pyobject gnn_user.{criterion}\n" + spec)))
    assert isinstance(resolved.loss, BatchLoss) and resolved.loss.with_trainer is with_trainer
    assert resolved.batches.losses["validation"].loss_fn.__name__ == "loss2"
    assert resolved.batches.losses["testing"].loss_fn.__name__ == "loss2"  # the tester takes the validator's


def test_a_criterion_that_fits_neither_call_is_refused_before_spawn(write):
    path = write("criterion: !pyobject gnn_user.loss1\n")
    with pytest.raises(ConfigError) as info:
        resolve(load_config(path))
    line = _line(path, "criterion:")
    assert str(info.value).startswith(
        f"{path}:{line}: criterion: function gnn_user.loss1 cannot be called as "
    )
    path = write("criterion: !pyobject gnn_user.loss3\n")  # evaluation would call it with two arguments
    with pytest.raises(ConfigError, match=r"validation.validator.criterion"):
        resolve(load_config(path))


def test_a_torch_loss_as_criterion_keeps_y_pred_and_y(write):
    resolved = resolve(load_config(write("criterion: !pyobject torch.nn.functional.mse_loss\n")))
    assert resolved.loss is torch.nn.functional.mse_loss


def test_model_args_take_layer_classes_and_pooling_functions_of_installed_libraries(write):
    model = MODEL + "  kwargs: {pool: !pyobject torch_geometric.nn.global_mean_pool}\n"
    resolved = resolve(load_config(write("", model)))
    assert resolved.model_args[0] is SAGEConv and resolved.model_args[1:] == [
        [2, 8],
        {"normalize": True, "root_weight": False},
    ]
    net = resolved.model_type(*resolved.model_args, **resolved.model_kwargs)
    assert isinstance(net.first, SAGEConv)


@pytest.mark.parametrize(
    "name",
    [
        "os.system",
        "subprocess.run",
        "shutil.rmtree",
        "builtins.open",
        "torch_geometric.io.fs.rm",
        "torch_geometric.data.download.download_url",
    ],
)
def test_model_args_still_refuse_what_runs_commands_or_touches_files(write, name):
    path = write("", MODEL.replace("torch_geometric.nn.conv.SAGEConv", name))
    with pytest.raises(ConfigError) as info:
        resolve(load_config(path))
    assert str(info.value).startswith(f"{path}:{_line(path, name)}: model.args.0: ")


def test_a_model_built_by_from_config_takes_the_sections_own_keys(write):
    nested = "model:\n  type: !pyobject gnn_user.GraphNet\n  from_config: true\n  conv: !pyobject torch_geometric.nn.conv.SAGEConv\n  dims: [2, 4]\n"
    resolved = resolve(load_config(write("", nested)))
    assert isinstance(resolved.model_type().first, SAGEConv)
    path = write("", nested.replace("  from_config: true\n", ""))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(
        f"{path}:{_line(path, 'conv:')}: model.conv: unknown key 'conv' in model"
    )
    assert "from_config: true" in str(info.value)


def test_a_graph_network_trains_and_evaluates_through_the_config_path(write):
    """The trainer calls criterion(outputs, batch, trainer) on a real SAGEConv network called
    model(x, edge_index, batch); the evaluator's loss counts graphs, not nodes."""
    path = write(
        "criterion: !pyobject gnn_user.loss_args\nvalidation:\n  validator: {criterion: !pyobject gnn_user.loss2}\n"
    )
    config = load_config(path)
    resolved = resolve(config)
    user = sys.modules[resolved.loss.loss_fn.__module__]
    train, val = resolved.data_build(seed=0)
    planned = plan(config, resolved)
    train_loader, val_loader = build_loaders(planned, Datasets(train, val))
    torch.manual_seed(0)
    model = resolved.model_type(*resolved.model_args, **resolved.model_kwargs)
    trainer = build_trainer(planned, model, torch.optim.SGD(model.parameters(), lr=0.01))
    trainer.run(train_loader, max_epochs=1)
    assert user.SEEN == [1, 1, 1]  # three batches of the seven graphs, each with the trainer
    evaluator, _ = build_evaluator(planned, model)
    metrics = make_metrics(resolved)
    value = evaluator.run(val_loader).metrics["loss"]
    with torch.no_grad():
        outputs = torch.cat([model(b.x, b.edge_index, b.batch) for b in val_loader])
        ys = torch.cat([b.y for b in val_loader])
    assert value == pytest.approx(float(torch.nn.functional.mse_loss(outputs, ys)), rel=1e-5)
    assert type(metrics["loss"].loss_fn).__name__ == "BatchLoss"


def test_a_sections_own_criterion_is_reported_as_loss_beside_the_metrics_named() -> None:
    """QuantumGrav's validator.criterion is the validation loss: reported even when validation.metrics
    names others; a Loss among them takes the criterion instead of a second copy."""
    from types import SimpleNamespace

    from unison.metrics import Accuracy, Loss
    from unison.recipe.planning.resolved import make_metrics

    def criterion(outputs, batch):
        return outputs.sum()

    def training_loss(y_pred, y):
        return y_pred.sum()

    resolved = SimpleNamespace(
        loss=training_loss,
        metrics={"accuracy": (Accuracy, {})},
        batches=SimpleNamespace(losses={"validation": criterion, "testing": None}),
    )
    validation = make_metrics(resolved, "validation")  # type: ignore[arg-type]
    assert sorted(validation) == ["accuracy", "loss"] and validation["loss"].loss_fn is criterion
    assert sorted(make_metrics(resolved, "testing")) == ["accuracy"]  # type: ignore[arg-type]  # no criterion
    resolved.metrics = {"accuracy": (Accuracy, {}), "val_loss": (Loss, {})}
    named = make_metrics(resolved, "validation")  # type: ignore[arg-type]
    assert sorted(named) == ["accuracy", "val_loss"] and named["val_loss"].loss_fn is criterion
