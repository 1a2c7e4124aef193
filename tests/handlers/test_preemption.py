"""Preemption: a signal to any rank becomes a checkpoint at one agreed iteration, exit code 75,
and a resumed job that ends where the uninterrupted one does."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _ckpt_workers import (
    BATCH,
    build_run,
    epoch_length,
    exit_versus_save,
    first_sync_at_or_after,
    preempted_job,
    resume_each,
    window_end,
)
from ignite.engine import Engine as IgniteEngine

from unison.checkpoint.manifest import checkpoint_name
from unison.engine import Engine, Events
from unison.handlers import EXIT_PREEMPTED, Checkpoint, Preemption
from unison.testing import run_distributed

HANDLERS = Path(__file__).resolve().parent
# 40 samples: 5 batches an epoch on each of 2 ranks; a signal after iteration 7 is agreed at the
# next sync point (every 3 iterations), iteration 9, inside epoch 2.
JOB = dict(size=40, sync_every=3, at=7, max_epochs=3)




@pytest.fixture
def fallback_handlers():
    """Catches SIGTERM/SIGUSR1 in the test process, in case Preemption does not: records them."""
    caught: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
        for sig in (signal.SIGTERM, signal.SIGUSR1)
    }
    yield caught, {sig: signal.getsignal(sig) for sig in previous}
    for sig, handler in previous.items():
        signal.signal(sig, handler)


# --- two ranks ------------------------------------------------------------------------------------


LAUNCH_SCRIPT = """\
import sys
sys.path.insert(0, {handlers!r})
from _ckpt_workers import preempted_job
from unison.distributed import launch

if __name__ == "__main__":
    launch(
        preempted_job, {folder!r}, {report!r}, signal_name={signal_name!r}, on_rank=1,
        nproc_per_node=2, start_method="forkserver", timeout=90, deadline=150, **{job!r},
    )
    print("launch returned without the preemption exit")
"""


def _reports(root: Path) -> list[dict] | None:
    paths = [root / f"report-rank{r}.pt" for r in range(2)]
    return [torch.load(p, weights_only=True) for p in paths] if all(p.exists() for p in paths) else None


@pytest.fixture(scope="module")
def preempted_jobs(tmp_path_factory):
    """2-rank jobs whose rank 1 signals itself after JOB['at']: SIGTERM to a real job, run by
    ``launch`` in a script (its exit code is the process's), and SIGUSR1 through
    ``run_distributed`` here (the same ``launch``, its SystemExit caught in this process)."""
    root = tmp_path_factory.mktemp("SIGTERM")
    script = root / "job.py"
    script.write_text(
        LAUNCH_SCRIPT.format(
            handlers=str(HANDLERS),
            folder=str(root / "ckpt"),
            report=str(root / "report"),
            signal_name="SIGTERM",
            job=JOB,
        )
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        usr1 = tmp_path_factory.mktemp("SIGUSR1")
        with pytest.raises(SystemExit) as exit:
            run_distributed(
                preempted_job,
                str(usr1 / "ckpt"),
                str(usr1 / "report"),
                signal_name="SIGUSR1",
                on_rank=1,
                nproc=2,
                timeout=150,
                **JOB,
            )
        output, _ = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return {
        "SIGTERM": dict(
            folder=root / "ckpt", returncode=proc.returncode, output=output, reports=_reports(root)
        ),
        "SIGUSR1": dict(folder=usr1 / "ckpt", returncode=exit.value.code, output="", reports=_reports(usr1)),
    }


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_a_signal_to_one_rank_saves_on_all_at_one_iteration_and_exits_75(signal_name, preempted_jobs):
    job = preempted_jobs[signal_name]
    assert job["returncode"] == EXIT_PREEMPTED == 75, job["output"][-3000:]
    assert job["reports"] is not None, job["output"][-3000:]
    rank0, rank1 = job["reports"]
    length = epoch_length(JOB["size"], BATCH, 2)
    agreed = first_sync_at_or_after(JOB["at"], JOB["sync_every"], length)
    assert agreed != JOB["at"] and agreed % length, (
        "the scenario should stop at a later, mid-epoch sync point"
    )
    assert rank0["iteration"] == rank1["iteration"] == agreed
    assert rank1["signalled"] == getattr(signal, signal_name)
    assert rank0["triggered"] and rank1["triggered"]
    name = checkpoint_name("ckpt", -(-agreed // length), agreed)
    assert rank0["saved"][-1] == name and rank1["saved"] == []
    meta = torch.load(job["folder"] / name, weights_only=True)["meta"]
    assert (meta["iteration"], meta["mid_epoch"], meta["world_size"]) == (agreed, True, 2)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_preempted_job_resumes_to_the_parameters_of_an_uninterrupted_one(preempted_jobs, tmp_path):
    folders = [str(job["folder"]) for job in preempted_jobs.values()]
    parts = {k: v for k, v in JOB.items() if k not in ("at", "max_epochs")}
    results = run_distributed(
        resume_each,
        folders,
        str(tmp_path / "reference"),
        max_epochs=JOB["max_epochs"],
        nproc=2,
        timeout=100,
        **parts,
    )
    length = epoch_length(JOB["size"], BATCH, 2)
    agreed = first_sync_at_or_after(JOB["at"], JOB["sync_every"], length)
    for rank, result in enumerate(results):
        for folder, resumed in result["resumed"].items():
            assert resumed["from"]["iteration"] == agreed, (
                f"rank {rank} resumed {folder} from {resumed['from']}"
            )
            assert resumed["iteration"] == length * JOB["max_epochs"]
            assert torch.equal(resumed["params"], result["reference"]), (
                f"rank {rank}: {folder} ended elsewhere"
            )


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_no_rank_leaves_before_the_preemption_checkpoint_is_durable(tmp_path):
    """When one rank exits, launchers end the job: ``launch`` and torchrun SIGTERM the other ranks
    and SIGKILL them after a grace period. No rank may exit while rank 0 is still writing."""
    marks = tmp_path / "marks"
    marks.mkdir()
    parts = {k: v for k, v in JOB.items() if k != "max_epochs"}
    with pytest.raises(SystemExit) as exit:
        run_distributed(
            exit_versus_save,
            str(tmp_path / "ckpt"),
            str(marks),
            max_epochs=JOB["max_epochs"],
            patience_s=5.0,
            nproc=2,
            timeout=100,
            **parts,
        )
    assert exit.value.code == EXIT_PREEMPTED
    length = epoch_length(JOB["size"], BATCH, 2)
    agreed = first_sync_at_or_after(JOB["at"], JOB["sync_every"], length)
    rank1 = torch.load(marks / "rank1.pt", weights_only=True)
    assert rank1["iteration"] == agreed
    assert rank1["files"] == [checkpoint_name("ckpt", -(-agreed // length), agreed)], (
        "rank 1 left its run (to exit with 75) before rank 0's preemption checkpoint was on disk"
    )


# --- one rank, in this process --------------------------------------------------------------------


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGUSR1"])
def test_on_one_rank_the_save_is_at_the_first_sync_point_and_the_run_exits_75(
    tmp_path, signal_name, fallback_handlers
):
    caught, installed = fallback_handlers
    parts = dict(size=JOB["size"], sync_every=JOB["sync_every"])
    with pytest.raises(SystemExit) as exit:
        preempted_job(
            str(tmp_path),
            str(tmp_path / "report"),
            signal_name=signal_name,
            at=JOB["at"],
            on_rank=0,
            max_epochs=3,
            **parts,
        )
    assert exit.value.code == EXIT_PREEMPTED
    seen = torch.load(tmp_path / "report-rank0.pt", weights_only=True)
    assert seen["signalled"] == getattr(signal, signal_name) and seen["triggered"]
    length = epoch_length(JOB["size"], BATCH, 1)
    agreed = first_sync_at_or_after(JOB["at"], JOB["sync_every"], length)
    assert seen["iteration"] == agreed and seen["saved"][-1] == checkpoint_name(
        "ckpt", -(-agreed // length), agreed
    )
    assert caught == [], "the signal reached the previous handler instead of Preemption's"
    assert signal.getsignal(getattr(signal, signal_name)) is installed[getattr(signal, signal_name)], (
        "handler not restored"
    )


def test_with_exit_false_the_run_just_stops_after_saving(tmp_path, fallback_handlers):
    seen = preempted_job(
        str(tmp_path),
        str(tmp_path / "report"),
        signal_name="SIGTERM",
        at=JOB["at"],
        on_rank=0,
        max_epochs=3,
        exit=False,
        size=JOB["size"],
        sync_every=JOB["sync_every"],
    )
    length = epoch_length(JOB["size"], BATCH, 1)
    agreed = first_sync_at_or_after(JOB["at"], JOB["sync_every"], length)
    assert seen["triggered"]
    assert seen["iteration"] == agreed and seen["saved"][-1] == checkpoint_name(
        "ckpt", -(-agreed // length), agreed
    )


def test_a_signal_inside_an_accumulation_window_saves_at_its_end_and_resumes_exactly(
    tmp_path, fallback_handlers
):
    k = 2
    length = epoch_length(JOB["size"], BATCH, 1)
    at = length + 1  # the first micro-batch of epoch 2's first window
    parts = dict(size=JOB["size"], sync_every=1, accumulation=k)
    seen = preempted_job(
        str(tmp_path / "job"),
        str(tmp_path / "report"),
        signal_name="SIGUSR1",
        at=at,
        on_rank=0,
        max_epochs=3,
        exit=False,
        **parts,
    )
    assert seen["iteration"] == window_end(at, length, k) != at
    result = resume_each([str(tmp_path / "job")], str(tmp_path / "reference"), max_epochs=3, **parts)
    resumed = result["resumed"][str(tmp_path / "job")]
    assert resumed["from"]["iteration"] == seen["iteration"] and resumed["from"]["mid_epoch"]
    assert torch.equal(resumed["params"], result["reference"])


def test_preemption_needs_a_checkpoint_and_a_unison_engine(tmp_path):
    run = build_run(str(tmp_path))
    with pytest.raises(TypeError, match="needs a unison Checkpoint"):
        Preemption(object())
    with pytest.raises(TypeError, match="needs a unison Engine"):
        Preemption(run.checkpoint).attach(IgniteEngine(lambda e, b: None))
    preemption = Preemption(run.checkpoint)
    preemption.attach(run.trainer)
    preemption.attach(run.trainer)
    assert sum(c is preemption for c in run.trainer.sync_point.contributors()) == 1


@pytest.mark.parametrize("how", ["terminate", "terminate_skip_completed", "complete", "raise"])
def test_the_previous_signal_handlers_are_back_however_the_run_ends(tmp_path, fallback_handlers, how):
    _, installed = fallback_handlers
    engine = Engine(lambda e, b: None)
    model = torch.nn.Linear(1, 1)
    Preemption(Checkpoint(tmp_path, {"model": model}, engine, at_end=False), exit=False).attach(engine)
    during: list = []

    @engine.on(Events.ITERATION_COMPLETED(once=2))
    def end(engine: Engine) -> None:
        during.append(signal.getsignal(signal.SIGTERM))
        if how == "terminate":
            engine.terminate()
        elif how == "terminate_skip_completed":
            engine.terminate(skip_completed=True)
        elif how == "raise":
            raise RuntimeError("boom")

    if how == "raise":
        with pytest.raises(RuntimeError, match="boom"):
            engine.run(range(4))
    else:
        engine.run(range(4))
    assert during and during[0] is not installed[signal.SIGTERM]  # Preemption's, while running
    for sig, handler in installed.items():
        assert signal.getsignal(sig) is handler, f"{how}: {signal.Signals(sig).name} handler not restored"
