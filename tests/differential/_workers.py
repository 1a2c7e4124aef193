"""What the differential tests run, on spawned ranks or in the test process (world size 1).

Every function whose name does not start with ``_`` takes a list of shapes and runs them
all, so one spawn serves many examples. Results are plain data and tensors, one entry
per shape; the parent test compares them and prints the shape of any that disagree. The
runs use unison's public API only (``Checkpoint`` is subclassed to record its ``save``
calls).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from _shapes import Shape
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Sampler, TensorDataset

from unison.checkpoint import Entry, Manifest
from unison.distributed import (
    TrainSampler,
    barrier,
    broadcast_object,
    get_rank,
    get_world_size,
    prepare_loaders,
    prepare_model,
    unwrap_model,
)
from unison.engine import Events, create_evaluator, create_trainer
from unison.handlers import Checkpoint
from unison.metrics import Accuracy, Loss, MeanSquaredError

D_IN, D_HIDDEN, N_CLASSES = 3, 4, 3


# -- the pieces of a run ---------------------------------------------------------------------


def regression_data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=gen, dtype=torch.float64)
    w = torch.randn(D_IN, 1, generator=gen, dtype=torch.float64)
    y = x @ w + 0.1 * torch.randn(n, 1, generator=gen, dtype=torch.float64)
    return TensorDataset(x, y)


def make_model(shape: Shape, outputs: int = 1) -> nn.Module:
    """A float64 Linear or 2-layer MLP (no dropout, no BatchNorm) whose weights depend on the seed only."""
    if shape.model == "linear":
        model: nn.Module = nn.Linear(D_IN, outputs)
    else:
        model = nn.Sequential(nn.Linear(D_IN, D_HIDDEN), nn.Tanh(), nn.Linear(D_HIDDEN, outputs))
    model = model.to(torch.float64)
    gen = torch.Generator().manual_seed(100 + shape.seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
    return model


def make_optimizer(shape: Shape, model: nn.Module) -> torch.optim.Optimizer:
    if shape.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.Adam(model.parameters(), lr=0.01)


def flat_params(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).clone() for p in unwrap_model(model).parameters()])


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    """The optimizer's state as a flat list of (key, value), tensors cloned."""
    out: list[tuple[str, Any]] = []

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key in sorted(value, key=str):
                walk(f"{prefix}.{key}", value[key])
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(f"{prefix}[{i}]", item)
        elif isinstance(value, torch.Tensor):
            out.append((prefix, value.detach().clone()))
        else:
            out.append((prefix, value))

    walk("", optimizer.state_dict())
    return out


class RecordingCheckpoint(Checkpoint):
    """A Checkpoint that records the iteration of every ``save`` call, on every rank."""

    def __init__(self, *args: Any, score_engine: Any = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []
        self.records: list[tuple[str, int, float | None]] = []  # rank 0: (file, iteration, score) written
        self._score_engine = score_engine

    def save(self, engine: Any = None) -> Path | None:
        engine = engine or self.trainer
        self.calls.append(engine.state.iteration)
        before = len(self.saved)
        path = super().save(engine)
        if path is not None and len(self.saved) > before:
            score = None
            if self._score_engine is not None and self.metric is not None:
                value = self._score_engine.state.metrics.get(self.metric)
                score = None if value is None else float(value)
            self.records.append((path.name, engine.state.iteration, score))
        return path


def train(
    shape: Shape,
    *,
    folder: Path | None = None,
    resume: str | None = None,
    evaluate: bool = False,
    keep_last: int | None = None,
    keep_best: int = 0,
) -> dict[str, Any]:
    """One run of ``shape`` through create_trainer on prepare_loaders' loaders; what it ended with."""
    train_set = regression_data(shape.n_samples, shape.seed)
    val_set = regression_data(shape.eval_size, 1000 + shape.seed) if evaluate else None
    train_loader, val_loader = prepare_loaders(
        train_set,
        val_set,
        batch_size=shape.batch_size,
        val_batch_size=shape.eval_batch,
        seed=shape.seed,
        shuffle=shape.shuffle,
        drop_last=shape.drop_last,
    )
    model = prepare_model(make_model(shape))
    optimizer = make_optimizer(shape, model)
    trainer = create_trainer(
        model, optimizer, F.mse_loss, accumulation_steps=shape.accumulation, sync_every=shape.sync_every
    )
    out: dict[str, Any] = {"metrics": [], "losses": [], "saves": [], "records": [], "files": []}
    if shape.event is not None:
        kind, rank, iteration = shape.event

        def act(engine: Any) -> None:  # attached on every rank; acts on one
            if get_rank() == rank:
                if kind == "terminate":
                    engine.terminate()
                elif kind == "terminate_epoch":
                    engine.terminate_epoch()
                else:
                    engine.request_stop("differential test")

        trainer.add_event_handler(Events.ITERATION_COMPLETED(once=iteration), act)
    evaluator = None
    if evaluate:
        evaluator = create_evaluator(model, {"mse": MeanSquaredError(), "loss": Loss(F.mse_loss)})

        def run_evaluation(engine: Any) -> None:
            evaluator.run(val_loader)
            out["metrics"].append((engine.state.epoch, engine.state.iteration, dict(evaluator.state.metrics)))

        trainer.add_event_handler(Events.EPOCH_COMPLETED, run_evaluation)
    trainer.add_event_handler(
        Events.EPOCH_COMPLETED,
        lambda e: out["losses"].append((e.state.epoch, float(e.state.metrics["loss"]))),
    )
    checkpoint = None
    if folder is not None:
        use_best = keep_best > 0 and evaluator is not None
        checkpoint = RecordingCheckpoint(
            folder,
            {"model": model, "optimizer": optimizer},
            trainer,
            every_epochs=1,
            every_iters=shape.ckpt_every,
            keep_last=keep_last,
            keep_best=keep_best if use_best else 0,
            metric="mse" if use_best else None,
            mode="min",
            metric_engine=evaluator if use_best else None,
            score_engine=evaluator if use_best else None,
        )
        checkpoint.attach()
        if resume is not None:
            checkpoint.resume(resume)
    trainer.run(train_loader, max_epochs=shape.max_epochs, epoch_length=shape.epoch_length)
    out["iteration"] = trainer.state.iteration
    out["epoch"] = trainer.state.epoch
    out["params"] = flat_params(model)
    out["optimizer"] = optimizer_tensors(optimizer)
    if checkpoint is not None:
        checkpoint.wait()
        out["saves"] = list(checkpoint.calls)
        out["records"] = list(checkpoint.records)
        out["files"] = broadcast_object([p.name for p in checkpoint.saved])
        out["manifest_entries"] = list(checkpoint.manifest.entries) if get_rank() == 0 else None
    barrier()
    return out


def _note(err: BaseException, i: int, shape: Shape) -> BaseException:
    err.add_note(f"differential example {i}: {shape.short()}")
    return err


# -- invariant a: N ranks x batch B == one process x batch N*B -------------------------------


class GlobalOrder(Sampler[int]):
    """The global batches of a ``world_size``-rank run, in one process.

    Global batch ``i`` is the union of every rank's batch ``i`` (TrainSampler's shards, padded
    or cut as with ``drop_last``); batches of all ranks have the same size, so the mean loss
    over the union is DDP's mean of per-rank means.
    """

    def __init__(self, shape: Shape) -> None:
        self.batch = shape.batch_size
        self.samplers = [
            TrainSampler(
                range(shape.n_samples),
                shuffle=shape.shuffle,
                seed=shape.seed,
                drop_last=shape.drop_last,
                rank=r,
                world_size=shape.world_size,
            )
            for r in range(shape.world_size)
        ]

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    def __iter__(self):  # type: ignore[no-untyped-def]
        shards = [list(s) for s in self.samplers]
        for start in range(0, len(shards[0]), self.batch):
            for shard in shards:
                yield from shard[start : start + self.batch]

    def __len__(self) -> int:
        return sum(len(s) for s in self.samplers)


def one_process_truth(shape: Shape) -> dict[str, Any]:
    """Trains ``shape`` in this (non-distributed) process on the global batches."""
    assert get_world_size() == 1
    loader = DataLoader(
        regression_data(shape.n_samples, shape.seed),
        batch_size=shape.batch_size * shape.world_size,
        sampler=GlobalOrder(shape),
        drop_last=shape.drop_last,
    )
    model = make_model(shape)
    optimizer = make_optimizer(shape, model)
    trainer = create_trainer(
        model, optimizer, F.mse_loss, accumulation_steps=shape.accumulation, sync_every=shape.sync_every
    )
    losses: list[float] = []
    trainer.add_event_handler(Events.EPOCH_COMPLETED, lambda e: losses.append(float(e.state.metrics["loss"])))
    trainer.run(loader, max_epochs=shape.max_epochs, epoch_length=shape.epoch_length)
    return {"params": flat_params(model), "iteration": trainer.state.iteration, "losses": losses}


def ddp_runs(shapes: list[Shape]) -> list[dict[str, Any]]:
    """Invariant a, on the ranks: each shape trained with DDP; parameters, iterations, epoch losses."""
    results = []
    for i, shape in enumerate(shapes):
        try:
            out = train(shape)
        except BaseException as err:
            raise _note(err, i, shape) from None
        results.append(
            {"params": out["params"], "iteration": out["iteration"], "losses": [v for _, v in out["losses"]]}
        )
    return results


# -- invariant b: resumed == uninterrupted, bitwise -----------------------------------------


def resumable(files: list[str], iterations: dict[str, int], final: int, stopped_early: bool) -> list[str]:
    """The checkpoints a resume can start from and still be compared with the uninterrupted run.

    After an early stop (terminate, request_stop), a checkpoint taken at the stop itself
    holds no pending request: a run resumed from it goes on training, as it should after a
    preemption; it is left out.
    """
    if stopped_early:
        return [f for f in files if iterations[f] < final]
    return list(files)


def resume_runs(shapes: list[Shape], root: str) -> list[dict[str, Any]]:
    """Invariant b: for each shape, the uninterrupted run, then a fresh run resumed from one of its saves."""
    results = []
    for i, shape in enumerate(shapes):
        try:
            results.append(_resume_one(shape, Path(root) / f"ex{i}"))
        except BaseException as err:
            raise _note(err, i, shape) from None
    return results


def _resume_one(shape: Shape, folder: Path) -> dict[str, Any]:
    full = train(shape, folder=folder / "a")
    iterations = {name: it for name, it, _ in full["records"]}
    iterations = broadcast_object(iterations)
    stopped_early = shape.event is not None and shape.event[0] != "terminate_epoch"
    stopped_early = stopped_early and full["iteration"] < shape.total_iterations
    choices = resumable(full["files"], iterations, full["iteration"], stopped_early)
    if not choices:
        return {"skipped": "no checkpoint before the end", "files": full["files"]}
    chosen = choices[shape.resume_pick % len(choices)]
    resumed = train(shape, folder=folder / "b", resume=str(folder / "a" / chosen))
    diffs = [
        (key, _max_diff(a, b))
        for (key, a), (key_b, b) in zip(full["optimizer"], resumed["optimizer"], strict=False)
        if not _same(a, b) or key != key_b
    ]
    if len(full["optimizer"]) != len(resumed["optimizer"]):
        diffs.append(("optimizer state length", float("nan")))
    return {
        "skipped": None,
        "from": chosen,
        "from_iteration": iterations[chosen],
        "params_equal": torch.equal(full["params"], resumed["params"]),
        "params_max_diff": _max_diff(full["params"], resumed["params"]),
        "optimizer_diffs": diffs,
        "iteration": (full["iteration"], resumed["iteration"]),
        "epoch": (full["epoch"], resumed["epoch"]),
    }


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return type(a) is type(b) and a == b


def _max_diff(a: Any, b: Any) -> float:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
        return float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
    return float("nan")


# -- invariant c: every rank records the same decisions --------------------------------------


def decision_runs(shapes: list[Shape], root: str) -> list[dict[str, Any]]:
    """Invariant c: what each rank saw: stop iteration/epoch, save calls, evaluation metrics, epoch losses."""
    results = []
    for i, shape in enumerate(shapes):
        try:
            out = train(shape, folder=Path(root) / f"ex{i}", evaluate=True, keep_last=shape.keep_last)
        except BaseException as err:
            raise _note(err, i, shape) from None
        results.append(
            {
                "stop": (out["iteration"], out["epoch"]),
                "saves": out["saves"],
                "metrics": out["metrics"],
                "losses": out["losses"],
            }
        )
    return results


# -- invariant d: evaluation identical at 1, 2 and 3 ranks -----------------------------------


def classification_data(n: int, seed: int) -> TensorDataset:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, D_IN, generator=gen, dtype=torch.float64)
    y = torch.randint(0, N_CLASSES, (n,), generator=gen)
    return TensorDataset(x, y)


def _probabilities(output: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    y_pred, y = output
    return torch.softmax(y_pred, dim=1), F.one_hot(y, N_CLASSES).to(y_pred.dtype)


def evaluation_runs(shapes: list[Shape]) -> list[dict[str, float]]:
    """Invariant d: Accuracy, Loss and MeanSquaredError of a fixed model on an EvalSampler loader."""
    results = []
    for i, shape in enumerate(shapes):
        try:
            _, loader = prepare_loaders(
                None, classification_data(shape.eval_size, shape.seed), batch_size=shape.eval_batch
            )
            model = prepare_model(make_model(shape, outputs=N_CLASSES))
            metrics = {
                "accuracy": Accuracy(),
                "loss": Loss(F.cross_entropy),
                "mse": MeanSquaredError(output_transform=_probabilities),
            }
            evaluator = create_evaluator(model, metrics)
            evaluator.run(loader)
            results.append({k: float(v) for k, v in evaluator.state.metrics.items()})
        except BaseException as err:
            raise _note(err, i, shape) from None
    return results


def evaluation_truth(shape: Shape) -> dict[str, float]:
    """The metrics computed by hand over the whole dataset at once."""
    data = classification_data(shape.eval_size, shape.seed)
    x, y = data.tensors
    with torch.no_grad():
        logits = make_model(shape, outputs=N_CLASSES)(x)
    probs, onehot = _probabilities((logits, y))
    return {
        "accuracy": float((logits.argmax(dim=1) == y).double().mean()),
        "loss": float(F.cross_entropy(logits, y)),
        "mse": float(F.mse_loss(probs, onehot)),
    }


# -- invariant e: retention keeps the newest and the best; the manifest round-trips ---------


def retention_runs(shapes: list[Shape], root: str) -> list[list[str]]:
    """Invariant e: for each shape, the list of problems found (empty when all holds)."""
    results = []
    for i, shape in enumerate(shapes):
        folder = Path(root) / f"ex{i}"
        try:
            out = train(
                shape, folder=folder, evaluate=True, keep_last=shape.keep_last, keep_best=shape.keep_best
            )
        except BaseException as err:
            raise _note(err, i, shape) from None
        problems = _retention_problems(shape, folder, out) if get_rank() == 0 else []
        results.append(problems)
        barrier()
    return results


def _retention_problems(shape: Shape, folder: Path, out: dict[str, Any]) -> list[str]:
    problems = []
    records = out["records"]
    on_disk = sorted(p.name for p in folder.glob("ckpt-*.pt"))
    if not records:
        return ["no checkpoint was written"]
    newest = records[-1][0]
    if newest not in on_disk:
        problems.append(f"the newest checkpoint {newest} was deleted; on disk: {on_disk}")
    scored = [(score, name) for name, _, score in records if score is not None and math.isfinite(score)]
    if shape.keep_best > 0 and scored:
        best = min(score for score, _ in scored)
        holders = [name for score, name in scored if score == best]
        if not set(holders) & set(on_disk):
            problems.append(f"the best checkpoint by mse ({best}, {holders}) was deleted; on disk: {on_disk}")
    if shape.keep_last is not None:
        limit = shape.keep_last + shape.keep_best
        if len(on_disk) > limit:
            problems.append(
                f"{len(on_disk)} files kept, more than keep_last + keep_best = {limit}: {on_disk}"
            )
    written = json.loads((folder / "manifest.json").read_text())
    written_entries = [Entry(**e) for e in written["checkpoints"]]
    rebuilt = Manifest(folder).rebuild().entries
    if rebuilt != written_entries:
        problems.append(
            f"Manifest rebuilt from the folder differs from manifest.json: {rebuilt} != {written_entries}"
        )
    if out["manifest_entries"] != written_entries:
        problems.append(
            f"the handler's manifest differs from manifest.json: {out['manifest_entries']} != {written_entries}"
        )
    if sorted(e.file for e in written_entries) != on_disk:
        problems.append(
            f"manifest.json lists {[e.file for e in written_entries]}, the folder holds {on_disk}"
        )
    return problems


# -- running a batch of shapes --------------------------------------------------------------


def run_at(world_size: int, fn: Any, *args: Any, per_example_s: float = 2.0) -> list[Any]:
    """``fn(*args)`` on ``world_size`` gloo ranks (one spawn), or in this process at world size 1.

    Returns every rank's result, ``[rank 0's, rank 1's, ...]``.
    """
    if world_size == 1:
        return [fn(*args)]
    from unison.testing import run_distributed

    shapes = args[0]
    return run_distributed(fn, *args, nproc=world_size, timeout=60 + per_example_s * world_size * len(shapes))


def failure_report(title: str, failures: list[tuple[Shape, str]], total: int) -> str:
    lines = [f"{title}: {len(failures)} of {total} shapes disagree"]
    lines += [f"  {shape.short()}\n      {detail}" for shape, detail in failures]
    return "\n".join(lines)
