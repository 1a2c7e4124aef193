"""MLflowLogger: one MLflow run per training run, written by rank 0 only, read back with MLflow's client.

Every test writes to one SQLite store made once for the module (making its tables takes
seconds), each in an experiment of its own.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest
import torch
from _mlflow_workers import ITERS, train
from _sync_probe import count_host_syncs
from torch.nn import functional as F

from unison.engine import create_trainer
from unison.handlers.mlflow import TRUNCATED, MLflowLogger
from unison.handlers.mlflow_store import StoreWriter
from unison.testing import run_distributed

mlflow = pytest.importorskip("mlflow")
from mlflow.tracking import MlflowClient  # noqa: E402

EPOCHS = 2


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    folder = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{folder / 'mlflow.db'}"
    MlflowClient(tracking_uri=uri).search_experiments()  # makes the tables once
    return uri, folder


def runs_of(uri: str, experiment: str) -> list[Any]:
    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    return [] if found is None else client.search_runs([found.experiment_id])


def history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in MlflowClient(tracking_uri=uri).get_metric_history(run_id, key)]


def windows(losses: list[float], points: list[int], epoch_ends: list[int]) -> list[float]:
    """The mean loss of the iterations since the previous point, or since the epoch's start."""
    means, last = [], 0
    for point in points:
        start = max([last, *[end for end in epoch_ends if end < point]])
        means.append(statistics.fmean(losses[start:point]))
        last = point
    return means


# -- one rank ------------------------------------------------------------------------------


def test_a_run_holds_each_epochs_loss_and_validation_with_its_params_and_tags(store, request) -> None:
    uri, folder = store
    seen = train(
        uri,
        request.node.name,
        folder=str(folder),
        epochs=EPOCHS,
        run_name="first",
        params={"training.lr": "0.05", "model.type": "torch.nn.Linear"},
        tags={"unison.world_size": "1"},
    )
    (run,) = runs_of(uri, request.node.name)
    assert run.info.run_id == seen["run_id"] and run.info.status == "FINISHED"
    assert run.info.run_name == "first"
    assert run.data.params == {"training.lr": "0.05", "model.type": "torch.nn.Linear"}
    assert run.data.tags["unison.world_size"] == "1"
    ends = seen["epoch_end"]
    assert history(uri, run.info.run_id, "train/loss") == list(zip(ends, seen["epoch_loss"], strict=True))
    assert history(uri, run.info.run_id, "val/mse") == list(zip(ends, seen["val"], strict=True))
    assert history(uri, run.info.run_id, "train/lr") == [(end, 0.05) for end in ends]
    assert "train/recent_loss" not in run.data.metrics  # every=None: epoch ends only
    assert run.info.artifact_uri.startswith((folder / "mlartifacts").as_uri())


def test_recent_loss_points_average_the_iterations_since_the_last_point(store, request) -> None:
    uri, _ = store
    seen = train(uri, request.node.name, epochs=EPOCHS, sync_every=2, every=3)
    (run,) = runs_of(uri, request.node.name)
    points = history(uri, run.info.run_id, "train/recent_loss")
    # Sync points at every 2nd iteration; a point at the first one at or after each 3rd, never at an epoch's end.
    assert [step for step, _ in points] == [4, 8, 10]
    assert [v for _, v in points] == pytest.approx(windows(seen["losses"], [4, 8, 10], seen["epoch_end"]))
    assert [step for step, _ in history(uri, run.info.run_id, "train/lr")] == [4, ITERS, 8, 10, 2 * ITERS]


def test_points_inside_an_epoch_reach_the_store_in_batches_handed_over_as_every_tracker_does(
    store, request, monkeypatch
) -> None:
    """MLflowLogger is a RunPoints: inside an epoch its points wait for ``hand_over_s``, and an
    epoch's end hands over all of them (one batch per epoch here), as W&B's do."""
    uri, _ = store
    handed: list[int] = []
    write = StoreWriter.metrics
    monkeypatch.setattr(
        StoreWriter, "metrics", lambda self, points: handed.append(len(points)) or write(self, points)
    )
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, sync_every=2)
    logger = MLflowLogger(uri, trainer=trainer, experiment=request.node.name, every=2)
    logger.hand_over_s = 3600.0
    logger.attach()
    trainer.run([(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(6)], max_epochs=2)
    assert len(handed) == 2  # handed over at each point, it was 6 batches
    (run,) = runs_of(uri, request.node.name)
    assert [step for step, _ in history(uri, run.info.run_id, "train/recent_loss")] == [2, 4, 8, 10]
    assert [step for step, _ in history(uri, run.info.run_id, "train/loss")] == [6, 12]


def test_nothing_is_read_from_the_device_between_sync_points(store, request) -> None:
    uri, _ = store
    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss, sync_every=100)
    MLflowLogger(uri, trainer=trainer, experiment=request.node.name, every=1).attach(trainer)
    data = [(torch.randn(4, 3), torch.randn(4, 1)) for _ in range(5)]
    with count_host_syncs() as syncs:
        trainer.run(data, max_iters=4, epoch_length=100)
    assert syncs.count == 0, syncs.calls
    assert len(runs_of(uri, request.node.name)) == 1


def test_long_values_are_cut_with_a_marker_and_odd_key_characters_replaced(store, request) -> None:
    uri, _ = store
    long = "x" * 7000
    train(
        uri, request.node.name, epochs=1, params={"data.kwargs.a*b": "1", "long": long}, tags={"t": long * 2}
    )
    (run,) = runs_of(uri, request.node.name)
    assert run.data.params["data.kwargs.a_b"] == "1"
    cut = run.data.params["long"]
    assert cut.endswith(TRUNCATED) and long.startswith(cut[: -len(TRUNCATED)]) and len(cut) < len(long)
    assert run.data.tags["t"].endswith(TRUNCATED)


def test_a_resumed_run_continues_the_recorded_mlflow_run(store, request, tmp_path) -> None:
    uri, _ = store
    record = tmp_path / "mlflow-run.json"
    first = train(uri, request.node.name, epochs=1, run_file=record, params={"a": "1", "b": "2"})
    assert json.loads(record.read_text()) == {"run_id": first["run_id"], "tracking_uri": uri}
    again = train(uri, request.node.name, epochs=1, run_file=record, params={"a": "1", "b": "3", "c": "4"})
    (run,) = runs_of(uri, request.node.name)
    assert again["run_id"] == first["run_id"] == run.info.run_id and run.info.status == "FINISHED"
    assert run.data.params == {"a": "1", "b": "2", "c": "4"}  # MLflow never changes a logged parameter
    assert run.data.tags["changed_on_resume.b"] == "3"
    assert (
        len(history(uri, run.info.run_id, "train/loss")) == 1
    )  # each step once: the same step is not doubled


def test_another_store_in_the_record_opens_a_new_run(store, request, tmp_path) -> None:
    uri, _ = store
    record = tmp_path / "mlflow-run.json"
    record.write_text(json.dumps({"run_id": "0" * 32, "tracking_uri": "sqlite:////elsewhere.db"}))
    seen = train(uri, request.node.name, epochs=1, run_file=record)
    assert json.loads(record.read_text())["run_id"] == seen["run_id"]


@pytest.mark.parametrize(("how", "status"), [("fail_at", "FAILED"), ("stop_at", "KILLED")])
def test_a_failed_or_preempted_run_ends_with_its_status(store, request, how: str, status: str) -> None:
    uri, _ = store
    seen = train(
        uri, request.node.name, epochs=EPOCHS, **{how: ITERS + 2}, artifacts=lambda: [(Path(__file__), None)]
    )
    (run,) = runs_of(uri, request.node.name)
    assert run.info.status == status and ("error" in seen) == (how == "fail_at")
    assert history(uri, run.info.run_id, "train/loss") == [(ITERS, seen["epoch_loss"][0])]
    assert MlflowClient(tracking_uri=uri).list_artifacts(run.info.run_id) == []  # not a finished run


def test_artifacts_files_and_folders_are_logged_at_the_end(store, request, tmp_path) -> None:
    uri, folder = store
    (tmp_path / "config.yaml").write_text("name: x\n")
    shard = tmp_path / "ckpt-3"
    shard.mkdir()
    (shard / "part0").write_text("0")
    pairs = [(tmp_path / "config.yaml", None), (shard, "checkpoints/ckpt-3"), (tmp_path / "missing", None)]
    train(uri, request.node.name, folder=str(folder), epochs=1, artifacts=lambda: pairs)
    (run,) = runs_of(uri, request.node.name)
    client = MlflowClient(tracking_uri=uri)
    assert sorted(a.path for a in client.list_artifacts(run.info.run_id)) == ["checkpoints", "config.yaml"]
    assert [a.path for a in client.list_artifacts(run.info.run_id, "checkpoints/ckpt-3")] == [
        "checkpoints/ckpt-3/part0"
    ]
    assert Path(run.info.artifact_uri.removeprefix("file://")).is_relative_to(folder)


def test_a_parent_run_id_nests_the_run(store, request) -> None:
    uri, _ = store
    client = MlflowClient(tracking_uri=uri)
    parent = client.create_run(client.create_experiment(request.node.name)).info.run_id
    train(uri, request.node.name, epochs=1, parent_run_id=parent)
    child = [r for r in runs_of(uri, request.node.name) if r.info.run_id != parent]
    assert [r.data.tags["mlflow.parentRunId"] for r in child] == [parent]


@pytest.mark.parametrize(
    ("kwargs", "error", "says"),
    [
        ({"tracking_uri": ""}, ValueError, "tracking_uri=''"),
        ({"experiment": None}, ValueError, "experiment=None"),
        ({"trainer": object()}, TypeError, "needs an Engine"),
        ({"every": 0}, ValueError, "positive int"),
        ({"every": 5, "sync_every": None}, ValueError, "sync_every"),
        ({"evaluators": {"train": None}}, ValueError, "other than 'train'"),
        ({"evaluators": {"val": 3}}, TypeError, "evaluation Engine"),
    ],
)
def test_bad_arguments_are_refused_with_the_fix(kwargs: dict[str, Any], error: type, says: str) -> None:
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = create_trainer(model, optimizer, F.mse_loss, sync_every=kwargs.pop("sync_every", 10))
    arguments: dict[str, Any] = {
        "tracking_uri": "sqlite:////x.db",
        "trainer": trainer,
        "experiment": "e",
        **kwargs,
    }
    with pytest.raises(error, match=says):
        MLflowLogger(arguments.pop("tracking_uri"), **arguments)


# -- two ranks -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_at_two_ranks_one_run_from_rank_0_with_values_agreed_by_all_ranks(store, request) -> None:
    uri, folder = store
    ranks = run_distributed(
        train,
        uri,
        request.node.name,
        nproc=2,
        timeout=180,
        epochs=EPOCHS,
        sync_every=2,
        every=2,
        folder=str(folder),
    )
    (run,) = runs_of(uri, request.node.name)
    assert [r["run_id"] for r in ranks] == [run.info.run_id, None]
    assert [r["imported"] for r in ranks] == [True, False]  # rank 1 never imports MLflow
    assert ranks[0]["epoch_loss"] == ranks[1]["epoch_loss"]  # agreed at the sync point
    ends = ranks[0]["epoch_end"]
    assert history(uri, run.info.run_id, "train/loss") == list(zip(ends, ranks[0]["epoch_loss"], strict=True))
    per_iteration = [
        statistics.fmean(pair) for pair in zip(ranks[0]["losses"], ranks[1]["losses"], strict=True)
    ]
    points = history(uri, run.info.run_id, "train/recent_loss")
    steps = [2, 4, 8, 10]  # not 6 nor 12: epoch ends
    assert [step for step, _ in points] == steps
    assert [v for _, v in points] == pytest.approx(windows(per_iteration, steps, ends))
    assert statistics.fmean(per_iteration[:ITERS]) == pytest.approx(ranks[0]["epoch_loss"][0])
