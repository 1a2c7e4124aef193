"""How the steps take batches of any shape apart: ModelCall, WholeBatch, the default
prepare_batch on batches with fields, and criteria that read the whole batch (BatchLoss)."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from unison.engine import Events, ModelCall, WholeBatch, create_evaluator, create_trainer, prepare_batch
from unison.metrics import BatchLoss, BatchOutput, Loss, MeanSquaredError

CPU = torch.device("cpu")


class TwoInputs(nn.Module):
    """A model called with two tensors, the second by keyword."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 1)
        self.b = nn.Linear(2, 1)

    def forward(self, features: torch.Tensor, extra: torch.Tensor | None = None) -> torch.Tensor:
        out = self.a(features)
        return out if extra is None else out + self.b(extra)


@dataclass
class Sample:
    features: torch.Tensor
    extra: torch.Tensor
    y: torch.Tensor


def _rows(n: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return torch.randn(n, 4, generator=gen), torch.randn(n, 2, generator=gen), torch.randn(n, 1, generator=gen)


def _train(batches: list, **kwargs) -> torch.Tensor:
    model = TwoInputs()
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    trainer.run(batches, max_epochs=2)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_dict_and_dataclass_batches_train_as_the_same_data_in_tuples() -> None:
    f, e, y = _rows()
    chunks = [slice(i, i + 4) for i in range(0, 12, 4)]
    call = ModelCall(args=["features"], kwargs={"extra": "extra"})

    class Both(nn.Module):  # the truth: the same model fed a tuple by hand
        def __init__(self) -> None:
            super().__init__()
            self.inner = TwoInputs()

        def forward(self, pair: tuple) -> torch.Tensor:
            return self.inner(pair[0], extra=pair[1])

    truth_model = Both()
    trainer = create_trainer(truth_model, torch.optim.SGD(truth_model.parameters(), lr=0.1), F.mse_loss)
    trainer.run([((f[s], e[s]), y[s]) for s in chunks], max_epochs=2)
    truth = torch.cat([p.detach().reshape(-1) for p in truth_model.inner.parameters()])

    as_dicts = _train(
        [{"features": f[s], "extra": e[s], "y": y[s]} for s in chunks], loss_fn=F.mse_loss, model_call=call
    )
    as_dataclasses = _train(
        [Sample(f[s], e[s], y[s]) for s in chunks], loss_fn=F.mse_loss, model_call=call
    )
    positional = _train(
        [((f[s], e[s]), y[s]) for s in chunks], loss_fn=F.mse_loss, model_call=ModelCall(args=[0, 1])
    )
    untrained = torch.cat([p.detach().reshape(-1) for p in TwoInputs().parameters()])
    assert not torch.allclose(truth, untrained), "training did not move"
    for name, params in {"dict": as_dicts, "dataclass": as_dataclasses, "positional": positional}.items():
        torch.testing.assert_close(params, truth, rtol=0, atol=0, msg=name)


def test_a_batch_loss_gets_the_whole_batch_and_the_model_its_fields() -> None:
    f, e, y = _rows(4)
    seen: list[object] = []

    def compute_loss(outputs: torch.Tensor, batch: Sample) -> torch.Tensor:
        seen.append(batch)
        return F.mse_loss(outputs, batch.y)

    model = TwoInputs()
    trainer = create_trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        BatchLoss(compute_loss),
        model_call=ModelCall(args=["features", "extra"]),
    )
    trainer.run([Sample(f, e, y)], max_epochs=1)
    assert len(seen) == 1 and isinstance(seen[0], Sample) and torch.equal(seen[0].y, y)


def test_the_default_prepare_batch_keeps_a_batch_with_fields_whole_and_takes_its_y() -> None:
    batch = {"features": torch.zeros(2, 4), "y": torch.ones(2)}
    inputs, target = prepare_batch(batch, CPU)
    assert inputs == batch and target is batch["y"]
    sample = Sample(torch.zeros(2, 4), torch.zeros(2, 2), torch.ones(2))
    inputs, target = prepare_batch(sample, CPU)
    assert isinstance(inputs, Sample) and target is sample.y
    with pytest.raises(ValueError, match=r"fields \['ids', 'labels'\] and no 'y'.*WholeBatch\(target='<field>'\)"):
        prepare_batch({"ids": torch.zeros(1), "labels": torch.zeros(1)}, CPU)
    with pytest.raises(ValueError, match="expected an \\(inputs, targets\\) pair"):
        prepare_batch(torch.zeros(3), CPU)


def test_whole_batch_names_the_target_or_none() -> None:
    batch = {"ids": torch.zeros(2, 3), "labels": torch.ones(2)}
    assert WholeBatch("labels")(batch, CPU)[1] is batch["labels"]
    assert WholeBatch(None)(batch, CPU)[1] is None
    with pytest.raises(KeyError, match=r"has no field 'label'; its fields are \['ids', 'labels'\]"):
        WholeBatch("label")(batch, CPU)
    with pytest.raises(TypeError, match=r"WholeBatch\(target=...\) must be a field name"):
        WholeBatch(["labels"])  # type: ignore[arg-type]


def test_model_call_refuses_what_is_not_a_field_list_and_names_a_missing_field() -> None:
    with pytest.raises(TypeError, match=r'ModelCall\(args=...\) must be a list.*args=\["x"\]'):
        ModelCall(args="x")
    with pytest.raises(TypeError, match=r"ModelCall\(kwargs=...\) keys must be keyword names"):
        ModelCall(kwargs={"not a name": "x"})
    with pytest.raises(TypeError, match=r"item 1 must be a field name.*True"):
        ModelCall(args=["x", True])
    call = ModelCall(args=["x", "edge_index"])
    with pytest.raises(KeyError, match=r"ModelCall\(args=\['x', 'edge_index'\].*no field 'edge_index'; its fields are \['x'\]"):
        call(lambda *a: a, {"x": 1})
    model = TwoInputs()
    with pytest.raises(TypeError, match=r"create_trainer\(model_call=...\) must be callable.*got int"):
        create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, model_call=3)  # type: ignore[arg-type]


def test_the_evaluator_hands_the_batch_to_a_batch_loss_and_pairs_to_every_metric() -> None:
    f, e, y = _rows(10)
    model = TwoInputs()
    batches = [Sample(f[:3], e[:3], y[:3]), Sample(f[3:], e[3:], y[3:])]  # 3 and 7 rows
    outputs: list[object] = []
    evaluator = create_evaluator(
        model,
        {"loss": Loss(BatchLoss(lambda out, b: F.mse_loss(out, b.y))), "mse": MeanSquaredError()},
        model_call=ModelCall(args=["features", "extra"]),
    )
    evaluator.add_event_handler(Events.ITERATION_COMPLETED, lambda eng: outputs.append(eng.state.output))
    metrics = evaluator.run(batches).metrics
    with torch.no_grad():
        truth = F.mse_loss(model(f, extra=e), y).item()
    assert metrics["loss"] == pytest.approx(truth, rel=1e-6), "batches weigh their rows"
    assert metrics["mse"] == pytest.approx(truth, rel=1e-6)
    assert all(isinstance(o, BatchOutput) and isinstance(o.batch, Sample) for o in outputs)
    # Without a metric that reads the batch, the output is the plain pair.
    plain = create_evaluator(model, {"mse": MeanSquaredError()}, model_call=ModelCall(args=["features", "extra"]))
    plain.add_event_handler(Events.ITERATION_COMPLETED, lambda eng: outputs.append(eng.state.output))
    plain.run(batches[:1])
    assert type(outputs[-1]) is tuple


def test_a_batch_loss_without_the_batch_says_how_to_keep_it() -> None:
    loss = Loss(BatchLoss(lambda out, b: F.mse_loss(out, b["y"])))
    with pytest.raises(ValueError, match=r"needs the whole batch.*BatchOutput\(y_pred, y, batch=output.batch\)"):
        loss.update((torch.zeros(2), torch.zeros(2)))
    loss.update(copy.deepcopy(BatchOutput(torch.zeros(2), None, {"y": torch.ones(2)})))
    assert loss.compute() == 1.0


def test_loss_counts_a_graph_batch_in_graphs_not_in_its_fields_or_nodes() -> None:
    pyg = pytest.importorskip("torch_geometric.data")

    def graph(nodes: int, label: float) -> object:
        return pyg.Data(x=torch.zeros(nodes, 1), edge_index=torch.zeros(2, 0, dtype=torch.long), y=torch.tensor([label]))

    small = pyg.Batch.from_data_list([graph(9, 1.0)])  # 1 graph, many nodes
    large = pyg.Batch.from_data_list([graph(2, 0.0), graph(2, 0.0), graph(2, 0.0)])
    # A criterion given the batch as its target (prepare_batch returning (batch, batch)).
    loss = Loss(lambda out, b: F.mse_loss(out, b.y))
    for b in (small, large):
        loss.update((torch.zeros(b.num_graphs), b))
    assert loss.compute() == pytest.approx(1 / 4), "one error of 1 among four graphs"
    graphs = Loss(BatchLoss(lambda out, b: F.mse_loss(out, b.y)))
    for b in (small, large):
        graphs.update(BatchOutput(torch.zeros(b.num_graphs), None, b))
    assert graphs.compute() == pytest.approx(1 / 4)
