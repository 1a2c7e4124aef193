"""ProgressBar: a tqdm bar on rank 0, nothing elsewhere."""

from __future__ import annotations

import io
import re

import pytest
import torch

from unison.distributed import get_rank
from unison.engine import Engine, Events
from unison.handlers import ProgressBar
from unison.metrics import EpochAverage
from unison.testing import run_distributed

DATA = [1.0, 2.0, 6.0, 3.0, 8.0]


def _engine() -> Engine:
    engine = Engine(lambda e, b: torch.tensor(b * e.state.epoch))
    EpochAverage("value").attach(engine)
    return engine


def _counts(output: str, total: int) -> list[int]:
    """Every ``n/total`` counter drawn."""
    return [int(n) for n in re.findall(rf"(\d+)/{total}\b", output)]


def test_draws_each_epoch_to_the_given_file():
    out = io.StringIO()
    engine = _engine()
    ProgressBar(file=out).attach(engine)
    metrics = []
    engine.add_event_handler(Events.EPOCH_COMPLETED, lambda e: metrics.append(e.state.metrics["value"]))
    engine.run(DATA, max_epochs=2)
    text = out.getvalue()
    assert "epoch 1" in text and "epoch 2" in text
    assert max(_counts(text, len(DATA))) == len(DATA)
    for value in metrics:  # the agreed epoch values are shown when the epoch ends
        assert f"value={value:.4g}" in text


def test_desc_template():
    out = io.StringIO()
    engine = _engine()
    ProgressBar(desc="train {epoch}/3", file=out).attach(engine)
    engine.run(DATA, max_epochs=3)
    assert all(f"train {e}/3" in out.getvalue() for e in (1, 2, 3))


def test_disable_draws_nothing():
    out = io.StringIO()
    engine = _engine()
    ProgressBar(file=out, disable=True).attach(engine)
    state = engine.run(DATA, max_epochs=2)
    assert state.iteration == 2 * len(DATA)
    assert out.getvalue() == ""


def test_attach_twice_is_harmless():
    once, twice = io.StringIO(), io.StringIO()
    for out, attachments in ((once, 1), (twice, 2)):
        engine = _engine()
        bar = ProgressBar(file=out)
        for _ in range(attachments):
            bar.attach(engine)
        engine.run(DATA, max_epochs=2)
    assert max(_counts(once.getvalue(), len(DATA))) == len(DATA)
    assert max(_counts(twice.getvalue(), len(DATA))) == len(DATA)  # not advanced twice per iteration
    assert twice.getvalue().count("epoch 1") == once.getvalue().count("epoch 1")


def test_terminate_closes_the_bar():
    out = io.StringIO()
    engine = _engine()
    bar = ProgressBar(file=out)
    bar.attach(engine)
    engine.add_event_handler(Events.ITERATION_COMPLETED(once=3), lambda e: e.terminate())
    engine.run(DATA, max_epochs=2)
    assert bar._bar is None
    assert max(_counts(out.getvalue(), len(DATA))) == 3


def progress_worker() -> dict:
    out = io.StringIO()
    engine = _engine()
    bar = ProgressBar(file=out)
    bar.attach(engine)
    opened = []
    engine.add_event_handler(Events.ITERATION_COMPLETED, lambda e: opened.append(bar._bar is not None))
    engine.run(DATA, max_epochs=2)
    return {
        "rank": get_rank(),
        "text": out.getvalue(),
        "opened": opened,
        "metric": engine.state.metrics["value"],
    }


@pytest.mark.distributed
@pytest.mark.timeout(60)
def test_only_rank_zero_draws():
    results = run_distributed(progress_worker, nproc=2, timeout=45)
    zero, one = results
    assert zero["rank"] == 0 and one["rank"] == 1
    assert "epoch 1" in zero["text"] and "epoch 2" in zero["text"]
    assert max(_counts(zero["text"], len(DATA))) == len(DATA)
    assert f"value={zero['metric']:.4g}" in zero["text"]
    assert all(zero["opened"]) and len(zero["opened"]) == 2 * len(DATA)
    assert one["text"] == ""
    assert not any(one["opened"])


def test_a_log_line_during_an_epoch_gets_a_line_of_its_own(monkeypatch) -> None:
    """With a bar on screen, a log record clears the bar and prints whole, not glued to the bar."""
    import logging

    from unison.utils import setup_logging

    screen = io.StringIO()
    monkeypatch.setattr("sys.stderr", screen)
    logger = setup_logging(rank=0, world_size=1)
    try:
        engine = _engine()
        ProgressBar(file=screen).attach(engine)
        engine.add_event_handler(
            Events.ITERATION_COMPLETED(once=3), lambda e: logging.getLogger("unison.test").info("MIDWAY")
        )
        engine.run(DATA)
    finally:
        for handler in list(logger.handlers):
            logger.removeHandler(handler)
    lines = re.split(r"[\r\n]", screen.getvalue())
    (line,) = [text for text in lines if "MIDWAY" in text]
    assert line.endswith("INFO unison.test: MIDWAY") and "it/s" not in line and "/5" not in line
