"""``unison run`` with ``parallel.fault_tolerance``: each run is one replica group of a torchft job.

A real lighthouse in the test process; two ``python -m unison run`` processes of one rank each
(``--nproc 1``), replica 0 and replica 1, the same config but for the replica's number. Replica
1's model SIGKILLs its process at its 6th training step; replica 0 must go on in the same process,
its committed steps without a gap. Replica 1, started again by hand, must be healed from replica 0
(its first committed step is not 1) and end, as replica 0 does, at the quorum's last commit, with
the same weights; each group writes its own run folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from _procs import kill_tree  # noqa: E402

from unison.distributed.replica_group import Lighthouse  # noqa: E402

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
KILL_AT = 6
EPOCHS = 8
STEPS = EPOCHS * 128 // (2 * 4)  # 128 samples in 2 shares, batches of 4: the quorum's last commit

CONFIG = """\
name: ftrun
imports: [replica_probe]
training:
  seed: 0
  max_epochs: {epochs}
  batch_size: 4
  optimizer_type: !pyobject torch.optim.Adam
  optimizer_kwargs: {{lr: 0.01}}
  loss: !pyobject torch.nn.functional.mse_loss
model:
  type: !pyobject replica_probe.ProbeNet
data:
  build: !pyobject replica_probe.build_regression
validation:
  metrics:
    loss: !pyobject unison.metrics.Loss
logging:
  root: {root}
parallel:
  fault_tolerance:
    lighthouse: {lighthouse}
    replica_groups: 2
    timeout: 10
handlers:
  - function: !pyobject replica_probe.record_commit
    event: ITERATION_COMPLETED
    kwargs: {{out: {out}}}
"""


def _start(config: Path, out: Path, replica_id: int, *sets: str, nproc: int = 1) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(HERE), str(ROOT), os.environ.get("PYTHONPATH")])),
    )
    args = [sys.executable, "-m", "unison", "run", str(config), "--nproc", str(nproc)]
    for item in (
        f"parallel.fault_tolerance.replica_id={replica_id}",
        *sets,
    ):
        args += ["--set", item]
    with open(out / f"output{replica_id}-{time.monotonic_ns()}.txt", "w") as log:
        return subprocess.Popen(
            args, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _commits(out: Path, replica_id: int) -> list[dict]:
    path = out / f"trace{replica_id}.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []


def _outputs(out: Path) -> str:
    return "\n".join(f"--- {f.name}\n{f.read_text()[-4000:]}" for f in sorted(out.glob("output*.txt")))


def _wait(condition, timeout: float, what: str, out: Path):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        time.sleep(0.1)
    pytest.fail(f"{what}: not seen in {timeout:g} s\n{_outputs(out)}")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(420)
def test_unison_run_survives_a_killed_replica_group_that_rejoins_from_a_live_peer(tmp_path: Path) -> None:
    procs: list[subprocess.Popen] = []
    with Lighthouse(min_replicas=1) as lighthouse:
        config = tmp_path / "config.yaml"
        config.write_text(
            CONFIG.format(epochs=EPOCHS, root=tmp_path / "runs", out=tmp_path, lighthouse=lighthouse.address)
        )
        try:
            # Replica 0 is paced until replica 1 has rejoined: long enough for the kill, the
            # restart and the heal to happen while it trains; then both run at full speed.
            rejoined_flag = tmp_path / "rejoined"
            zero = _start(config, tmp_path, 0, f"model.kwargs={{pace: 0.2, pace_until: {rejoined_flag}}}")
            one = _start(config, tmp_path, 1, f"model.kwargs={{kill_at: {KILL_AT}}}")
            procs += [zero, one]
            assert one.wait(timeout=180) == 1, _outputs(tmp_path)  # its rank was SIGKILLed
            assert "died with signal SIGKILL" in _outputs(tmp_path)
            killed_at = time.time()
            assert zero.poll() is None, _outputs(tmp_path)
            _wait(
                lambda: [x for x in _commits(tmp_path, 0) if x["time"] > killed_at],
                60,
                "replica 0's next commit",
                tmp_path,
            )
            again = _start(config, tmp_path, 1)
            procs.append(again)
            first_life = _commits(tmp_path, 1)[0]["pid"]
            _wait(
                lambda: [x for x in _commits(tmp_path, 1) if x["pid"] != first_life],
                120,
                "replica 1's first commit after its restart",
                tmp_path,
            )
            assert zero.poll() is None, _outputs(tmp_path)  # it healed from a live replica 0
            rejoined_flag.touch()
            assert zero.wait(timeout=300) == 0, _outputs(tmp_path)
            assert again.wait(timeout=60) == 0, _outputs(tmp_path)
        finally:
            kill_tree(*procs)

    commits = _commits(tmp_path, 0)
    assert len({x["pid"] for x in commits}) == 1  # the same rank throughout: no restart
    steps = [x["step"] for x in commits]
    assert steps == list(range(steps[0], STEPS + 1)), steps  # no step lost, none repeated
    first_life = _commits(tmp_path, 1)[0]["pid"]
    rejoined = [x for x in _commits(tmp_path, 1) if x["pid"] != first_life]
    assert rejoined[0]["step"] > 1, rejoined[0]  # healed from replica 0, not started over
    assert rejoined[-1]["step"] == STEPS
    assert rejoined[-1]["weights"] == commits[-1]["weights"]  # the same final weights
    by_step = {x["step"]: x["weights"] for x in commits}
    assert all(by_step[x["step"]] == x["weights"] for x in rejoined)  # equal at every shared commit
    runs = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert runs == ["ftrun-replica0", "ftrun-replica1"], runs  # a folder (and a lock) per group


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_unison_run_groups_of_two_ranks_end_together_on_one_model(tmp_path: Path) -> None:
    """Two groups of two spawned ranks: all four ranks commit every step, each its quarter of the
    data, and every rank ends at the quorum's last commit with the same weights."""
    epochs = 2
    last = epochs * 128 // (2 * 2 * 4)
    with Lighthouse(min_replicas=2) as lighthouse:  # both groups in every quorum
        config = tmp_path / "config.yaml"
        config.write_text(
            CONFIG.format(epochs=epochs, root=tmp_path / "runs", out=tmp_path, lighthouse=lighthouse.address)
        )
        procs = [
            _start(config, tmp_path, i, "parallel.fault_tolerance.min_replicas=2", nproc=2) for i in (0, 1)
        ]
        try:
            for proc in procs:
                assert proc.wait(timeout=240) == 0, _outputs(tmp_path)
        finally:
            kill_tree(*procs)
    for i in (0, 1):
        for rank in (0, 1):
            steps = [x["step"] for x in _commits(tmp_path, i) if x["rank"] == rank]
            assert steps == list(range(1, last + 1)), (i, rank, steps)
    finals = {x["weights"] for i in (0, 1) for x in _commits(tmp_path, i) if x["step"] == last}
    assert len(finals) == 1, finals
