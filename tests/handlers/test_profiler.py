"""Profiler: a torch.profiler trace of a window of iterations, per rank, with no effect on the run."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from _tb_workers import EPOCHS, train
from torch.nn import functional as F

from unison.engine import Engine, Events, create_trainer
from unison.handlers.profiler import Profiler
from unison.testing import run_distributed

TRACE = re.compile(r"^(rank\d+)\.(\d+)\.pt\.trace\.json(\.gz)?$")


def _load(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        return json.load(fh)


def _steps_in(trace: dict[str, Any]) -> list[int]:
    """The profiler steps a trace recorded (0-based, counted from the profiler's start)."""
    found = {
        int(e["name"].split("#")[1])
        for e in trace["traceEvents"]
        if e.get("name", "").startswith("ProfilerStep#")
    }
    return sorted(found)


def _tiny(iterations: int = 4, fail_at: int | None = None) -> tuple[Engine, list]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    trainer = create_trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), F.mse_loss)
    if fail_at is not None:

        def fail(engine: Engine) -> None:
            if engine.state.iteration == fail_at:
                raise RuntimeError("boom")

        trainer.add_event_handler(Events.ITERATION_COMPLETED, fail)
    return trainer, [(torch.ones(2, 3), torch.zeros(2, 1))] * iterations


def test_the_window_is_recorded_and_the_handler_leaves_afterwards(tmp_path: Path) -> None:
    trainer, data = _tiny()
    baseline = len(trainer._event_handlers[Events.ITERATION_COMPLETED])
    profiler = Profiler(tmp_path, wait=2, warmup=1, active=2)
    profiler.attach(trainer)
    seen: list[int] = []
    trainer.add_event_handler(
        Events.ITERATION_COMPLETED, lambda e: seen.append(len(e._event_handlers[Events.ITERATION_COMPLETED]))
    )
    trainer.run(data, max_epochs=3)  # 12 iterations; the window ends at iteration 5
    folder = tmp_path / "plugins" / "profile" / "iterations-4-5"
    assert profiler.folder == folder and not profiler.running
    (trace_file,) = folder.iterdir()
    assert TRACE.match(trace_file.name).group(1) == "rank0"
    trace = _load(trace_file)
    assert isinstance(trace["traceEvents"], list) and trace["traceEvents"]
    assert _steps_in(trace) == [3, 4]  # iterations 4 and 5: after 2 waited and 1 warmed up
    # Our handlers (and the profiler's) run until its window ends, then the profiler's is gone.
    profiled = baseline + 2  # the profiler's step and the probe
    assert seen[:5] == [profiled] * 5 and seen[5:] == [profiled - 1] * 7
    assert not torch.autograd._profiler_enabled()


def test_repeat_writes_a_trace_per_window_and_gzip_is_read(tmp_path: Path) -> None:
    trainer, data = _tiny(iterations=6)
    Profiler(tmp_path, wait=0, warmup=1, active=1, repeat=2, use_gzip=True).attach(trainer)
    trainer.run(data, max_epochs=1)
    files = sorted((tmp_path / "plugins" / "profile" / "iterations-2-4").iterdir())
    assert [TRACE.match(f.name).group(3) for f in files] == [".gz", ".gz"]
    assert sorted(_steps_in(_load(f))[0] for f in files) == [1, 3]


def test_a_run_ending_inside_the_window_writes_what_it_recorded(tmp_path: Path) -> None:
    trainer, data = _tiny(iterations=3)
    profiler = Profiler(tmp_path, wait=1, warmup=0, active=5)
    profiler.attach(trainer)
    trainer.run(data, max_epochs=1)
    (trace_file,) = (tmp_path / "plugins" / "profile" / "iterations-2-6").iterdir()
    assert _steps_in(_load(trace_file)) == [1, 2, 3]  # iterations 2 and 3, then the run's end
    assert not profiler.running and not torch.autograd._profiler_enabled()


def test_a_failing_run_stops_the_profiler_and_keeps_its_error(tmp_path: Path) -> None:
    trainer, data = _tiny(iterations=6, fail_at=3)
    profiler = Profiler(tmp_path, wait=0, warmup=1, active=4)
    profiler.attach(trainer)
    with pytest.raises(RuntimeError, match="boom"):
        trainer.run(data, max_epochs=1)
    assert not profiler.running and not torch.autograd._profiler_enabled()
    (trace_file,) = (tmp_path / "plugins" / "profile" / "iterations-2-5").iterdir()
    assert _steps_in(_load(trace_file)) == [1, 2]


def test_a_second_run_of_the_trainer_profiles_a_new_window(tmp_path: Path) -> None:
    trainer, data = _tiny(iterations=3)
    Profiler(tmp_path, wait=0, warmup=0, active=1).attach(trainer)
    trainer.run(data, max_epochs=1)
    trainer.run(data, max_epochs=2)  # goes on from iteration 3
    assert sorted(p.name for p in (tmp_path / "plugins" / "profile").iterdir()) == [
        "iterations-1-1",
        "iterations-4-4",
    ]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"wait": -1}, r"wait=-1\) must be an int >= 0"),
        ({"warmup": 1.5}, r"warmup=1.5\) must be an int >= 0"),
        ({"active": 0}, r"active=0\) must be an int >= 1"),
        ({"repeat": True}, r"repeat=True\) must be an int >= 1"),
    ],
)
def test_bad_windows_are_refused_naming_the_argument(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Profiler(tmp_path, **kwargs)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_every_rank_writes_its_trace_and_the_run_is_unchanged(tmp_path: Path) -> None:
    window = {"wait": 1, "warmup": 1, "active": 2}
    profiled = run_distributed(train, str(tmp_path), window, nproc=2, timeout=180)
    plain = run_distributed(train, None, nproc=2, timeout=180)
    for p, q in zip(profiled, plain, strict=True):
        assert p["loss"] == q["loss"] and p["iterations"] == q["iterations"] == EPOCHS * 5
        assert all(torch.equal(p["weights"][k], q["weights"][k]) for k in q["weights"])
        assert p["per_iteration"] == q["per_iteration"]  # nothing of the profiler's is left
        assert p["running"] is False
    folder = tmp_path / "plugins" / "profile" / "iterations-3-4"
    assert {r["folder"] for r in profiled} == {str(folder)}  # one folder, with no collective
    names = sorted(TRACE.match(f.name).group(1) for f in folder.iterdir())
    assert names == ["rank0", "rank1"]
    for f in folder.iterdir():
        trace = _load(f)
        assert _steps_in(trace) == [2, 3]
        info = trace.get("distributedInfo", {})
        assert (info.get("rank"), info.get("world_size")) == (int(f.name[4]), 2)
