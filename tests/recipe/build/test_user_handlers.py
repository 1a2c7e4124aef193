"""The config's ``handlers``: the user's own handlers, checked before any rank starts, attached in
the order written (before or after unison's own), their state saved and resumed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from unison.config import ConfigError, load_config
from unison.recipe import plan
from unison.recipe.phases import run

DATA = """\
import torch
from torch.utils.data import TensorDataset


def build(seed, n=16, test=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = (x[:, 0] > 0).long()
    if test:
        return TensorDataset(x[:8], y[:8]), TensorDataset(x[8:12], y[8:12]), TensorDataset(x[12:], y[12:])
    return TensorDataset(x[:8], y[:8]), TensorDataset(x[8:], y[8:])
"""

HANDLERS = """\
import json
from pathlib import Path

from unison.engine import Events

ORDER = []


class Counter:
    def __init__(self, start=0, trainer=None):
        self.count = start
        self.trainer = trainer

    def attach(self, engine):
        engine.add_event_handler(Events.ITERATION_COMPLETED, self.step)
        engine.add_event_handler(Events.COMPLETED, self.write)

    def step(self, engine):
        ORDER.append(("counter", engine.state.iteration))
        self.count += 1

    def write(self, engine):
        folder = Path(engine.state.run_dir) if hasattr(engine.state, "run_dir") else None
        record = {"count": self.count, "trainer_given": self.trainer is engine}
        Path(OUT).write_text(json.dumps(record))

    def state_dict(self):
        return {"count": self.count}

    def load_state_dict(self, state):
        self.count = state["count"]


class Called:
    def __call__(self, engine):
        ORDER.append(("called", engine.state.iteration))


def every_other(engine, tag, scale=1):
    ORDER.append((tag, engine.state.iteration * scale))


def seen_by_validation(engine):
    ORDER.append(("validation", engine.state.epoch))


class NotAHandler:
    pass


def seen_by_testing(engine, tag):
    ORDER.append((tag, engine.state.iteration, sorted(engine.state.metrics)))


def record_order(engine):
    Path(OUT).with_suffix(".order").write_text(json.dumps(ORDER))
"""

BODY = """\
name: tiny
model:
  type: !pyobject torch.nn.Linear
  kwargs: {in_features: 4, out_features: 2}
data:
  build: !pyobject hdata.build
training:
  max_epochs: 2
  batch_size: 4
validation:
  metrics:
    loss: !pyobject unison.metrics.Loss
checkpoint:
  preemption: false
"""


def _write(folder: Path, handlers: str) -> Path:
    (folder / "hdata.py").write_text(DATA)
    (folder / "hcode.py").write_text(f"OUT = {str(folder / 'out.json')!r}\n" + HANDLERS)
    path = folder / "c.yaml"
    logging = f"logging:\n  root: {folder / 'runs'}\n  progress: false\n  tensorboard: false\n"
    path.write_text(BODY + logging + handlers)
    return path


def _error(folder: Path, handlers: str) -> ConfigError:
    path = _write(folder, handlers)
    with pytest.raises(ConfigError) as caught:
        plan(load_config(path))
    return caught.value


def _line(path: Path, text: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if text in line)


@pytest.mark.parametrize(
    ("handlers", "where", "says"),
    [
        (
            "handlers:\n  - type: !pyobject hcode.NotAHandler\n",
            "type: !pyobject hcode.NotAHandler",
            "accepts a handler class",
        ),
        (
            "handlers:\n  - type: !pyobject hcode.every_other\n",
            "hcode.every_other",
            "accepts a handler class",
        ),
        (
            "handlers:\n  - function: !pyobject hcode.every_other\n    event: ITERATION_DONE\n",
            "ITERATION_DONE",
            "no event of the engine",
        ),
        (
            "handlers:\n  - function: !pyobject hcode.every_other\n    event: EPOCH_STARTED(often=2)\n",
            "often=2",
            "takes every",
        ),
        (
            "handlers:\n  - function: !pyobject hcode.every_other\n    event: EPOCH_STARTED\n",
            "hcode.every_other",
            "needs the argument 'tag'",
        ),
        (
            "handlers:\n  - function: !pyobject hcode.every_other\n    event: EPOCH_STARTED\n    kwargs: {tag: a, scael: 2}\n",
            "scael",
            "Did you mean 'scale'",
        ),
        (
            "handlers:\n  - type: !pyobject hcode.Counter\n    kwargs: {stat: 1}\n",
            "stat: 1",
            "takes no argument 'stat'",
        ),
        ("handlers:\n  - type: !pyobject hcode.Called\n", "hcode.Called", "has no attach(engine)"),
        ("handlers:\n  - function: !pyobject hcode.record_order\n", "hcode.record_order", "needs `event:`"),
        ("handlers:\n  - event: EPOCH_STARTED\n", "event: EPOCH_STARTED", "got neither"),
        ("handlers:\n  - type: !pyobject hcode.Counter\n    evnt: STARTED\n", "evnt", "unknown key 'evnt'"),
        (
            "handlers:\n  - function: !pyobject hcode.record_order\n    event: UPDATE_COMPLETED\n    to: validation\n",
            "UPDATE_COMPLETED",
            "the trainer's",
        ),
        (
            "handlers:\n  - function: !pyobject hcode.record_order\n    event: UPDATE_COMPLETED\n    to: testing\n",
            "UPDATE_COMPLETED",
            "the trainer's (testing's evaluator makes no updates)",
        ),
        (
            "handlers:\n  - function: !pyobject hcode.record_order\n    event: COMPLETED\n    to: tester\n",
            "to: tester",
            "testing",
        ),
        ("handlers:\n  - function: !pyobject os.system\n    event: STARTED\n", "os.system", "refused"),
    ],
)
def test_a_wrong_handler_is_refused_at_its_line(tmp_path: Path, handlers: str, where: str, says: str) -> None:
    err = _error(tmp_path, handlers)
    assert says in str(err)
    assert err.line == _line(tmp_path / "c.yaml", where), str(err)
    assert err.key_path.startswith("handlers.0")


def test_handlers_run_in_the_order_written_and_their_state_resumes(tmp_path: Path) -> None:
    handlers = """\
handlers:
  - function: !pyobject hcode.every_other
    event: ITERATION_COMPLETED(every=2)
    args: [first]
  - type: !pyobject hcode.Counter
    kwargs: {start: 10}
  - type: !pyobject hcode.Called
    event: ITERATION_COMPLETED
    order: before
  - function: !pyobject hcode.seen_by_validation
    event: COMPLETED
    to: validation
  - function: !pyobject hcode.record_order
    event: COMPLETED
"""
    path = _write(tmp_path, handlers)
    result = run(path, nproc=1)
    assert json.loads((tmp_path / "out.json").read_text()) == {"count": 14, "trainer_given": True}
    order = [tuple(x) for x in json.loads((tmp_path / "out.order").read_text())]
    assert order[:5] == [("called", 1), ("counter", 1), ("called", 2), ("first", 2), ("counter", 2)]
    assert order.count(("validation", 1)) == 2  # each of the 2 evaluations is a run of one epoch
    checkpoint = sorted((Path(result["run_dir"]) / "checkpoints").glob("ckpt-*.pt"))[-1]
    saved = torch.load(checkpoint, weights_only=True)["objects"]
    assert saved["handlers:Counter"] == {"count": 14}
    again = run(path, nproc=1, overrides=["training.max_epochs=3"], resume=str(checkpoint))
    assert again["iterations"] == 6
    assert json.loads((tmp_path / "out.json").read_text())["count"] == 16  # 14 resumed, 2 more


def test_a_handler_can_follow_the_test_phase_evaluator(tmp_path: Path) -> None:
    """``to: testing`` attaches to the evaluator the test phase builds after training: it sees the
    test set's iterations and metrics, once; neither the trainer nor validation calls it."""
    handlers = """\
handlers:
  - function: !pyobject hcode.seen_by_testing
    event: COMPLETED
    args: [test]
    to: testing
  - function: !pyobject hcode.seen_by_testing
    event: EPOCH_COMPLETED
    args: [validation]
    to: validation
  - function: !pyobject hcode.record_order
    event: COMPLETED
    to: testing
"""
    path = _write(tmp_path, handlers)
    result = run(path, nproc=1, overrides=["data.kwargs={test: true}"])
    order = [tuple(x) for x in json.loads((tmp_path / "out.order").read_text())]
    tests = [entry for entry in order if entry[0] == "test"]
    assert tests == [("test", 1, ["loss"])], order  # 4 test samples: one batch of 4, once
    assert sum(entry[0] == "validation" for entry in order) == 2  # validation's own, each epoch
    assert result["test"]["loss"] > 0
