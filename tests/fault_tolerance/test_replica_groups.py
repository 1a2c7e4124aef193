"""A killed replica group costs the others no step and no restart, and rejoins from a live peer.

A real torchft lighthouse in the test process; two replica groups of one rank each, each its
own process (``_replica_worker.py``), training a tiny model on fixed data. Group 1 is
SIGKILLed inside a step while both groups share the quorum (after the step's quorum, before its
gradient all-reduce); group 0 must commit its next
step within seconds, in the same process, with no step number and no batch of its own missing.
Group 1, started again with other initial weights, must take weights and optimizer state from
group 0 (no file read), and from then on both groups' weights and optimizer state are bitwise
equal at every step both commit.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

pytest.importorskip("torchft")

from _procs import kill_tree  # noqa: E402
from replica_procs import lines as _lines  # noqa: E402
from replica_procs import start as _start  # noqa: E402
from replica_procs import steps as _steps  # noqa: E402

from unison.distributed import TrainSampler  # noqa: E402
from unison.distributed.replica_group import Lighthouse  # noqa: E402

KILL_AT = 6
"""Group 1 is killed once it has committed this many steps in the shared quorum."""








def _wait(condition, timeout: float, what: str, procs: list[subprocess.Popen], out: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = condition()
        if found:
            return found
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            break
        time.sleep(0.05)
    outputs = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(out.glob("output*.txt")))
    pytest.fail(
        f"{what}: not seen in {timeout:g} s (exited: {[p.args[3] for p in procs if p.poll() is not None]})\n{outputs}"
    )


def _shared_steps(out: Path, pid1: int) -> list[int]:
    """Steps both groups committed with the same weights (group 1 as process ``pid1``)."""
    zero = {x["step"]: x["weights"] for x in _steps(out, 0)}
    return [x["step"] for x in _steps(out, 1, pid1) if zero.get(x["step"]) == x["weights"]]


def _assert_read_in_order(steps: list[dict], replica_id: int) -> None:
    """The group read its share (``TrainSampler`` with the group as the rank), epoch by epoch, each
    batch once: a failed try is retried on the same batch, and no batch is skipped."""
    sampler = TrainSampler(range(512), seed=7, rank=replica_id, world_size=2)
    seen = [i for x in steps for i in x["samples"]]
    share = len(sampler)
    for epoch, start in enumerate(range(0, len(seen), share)):
        sampler.set_epoch(epoch)
        assert seen[start : start + share] == list(sampler)[: len(seen) - start], (replica_id, epoch)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_group_costs_no_step_and_rejoins_from_a_live_peer(tmp_path: Path) -> None:
    procs: list[subprocess.Popen] = []
    with Lighthouse(min_replicas=1) as lighthouse:
        try:
            group0 = _start(lighthouse.address, 0, tmp_path)
            group1 = _start(lighthouse.address, 1, tmp_path)
            procs += [group0, group1]
            _wait(
                lambda: len(_shared_steps(tmp_path, group1.pid)) >= KILL_AT,
                120,
                "both groups in one quorum",
                procs,
                tmp_path,
            )

            (tmp_path / "kill1").touch()  # group 1 SIGKILLs itself inside its next step
            group1.wait(timeout=30)
            assert group1.returncode == -signal.SIGKILL
            (tmp_path / "kill1").unlink()
            (killed,) = [x for x in _lines(tmp_path, 1) if "killed" in x]
            killed_at = killed["time"]
            procs.remove(group1)
            steps_at_kill = len(_steps(tmp_path, 0))
            after = _wait(
                lambda: [x for x in _steps(tmp_path, 0) if x["time"] > killed_at],
                30,
                "group 0's next commit",
                procs,
                tmp_path,
            )
            assert after[0]["time"] - killed_at < 10.0, (
                f"group 0 committed {after[0]['time'] - killed_at:.1f} s after the kill"
            )
            assert after[0]["pid"] == group0.pid  # the same process: no restart
            _wait(
                lambda: len(_steps(tmp_path, 0)) >= steps_at_kill + 5,
                30,
                "group 0 training alone",
                procs,
                tmp_path,
            )

            rejoined = _start(lighthouse.address, 1, tmp_path, "--seed", "5")
            procs.append(rejoined)
            _wait(
                lambda: len(_steps(tmp_path, 1, rejoined.pid)) >= 8, 120, "group 1 rejoining", procs, tmp_path
            )
        finally:
            (tmp_path / "stop").touch()
            for proc in procs:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    pass
            kill_tree(*procs)
    assert group0.returncode == 0 and rejoined.returncode == 0

    zero = _steps(tmp_path, 0)
    assert {x["pid"] for x in zero} == {group0.pid}
    # No step lost: group 0's commits are numbered without a gap, and it read its share of the
    # data in the sampler's order, each batch once: a failed try is retried on the same batch.
    first = zero[0]["step"]  # 1, or later where group 1 committed alone before group 0 joined (and healed it)
    assert [x["step"] for x in zero] == list(range(first, first + len(zero)))
    _assert_read_in_order(zero, replica_id=0)
    # Each group its own share: group 1 read the other half, and started again it reads its
    # share from its own start (the data position does not come with the weights).
    _assert_read_in_order(_steps(tmp_path, 1, group1.pid), replica_id=1)
    _assert_read_in_order(_steps(tmp_path, 1, rejoined.pid), replica_id=1)

    # Live recovery: group 1 started with other weights, took group 0's at the quorum's step.
    starts = [x for x in _lines(tmp_path, 1) if "start" in x]
    assert starts[-1]["start"] == rejoined.pid
    assert starts[-1]["weights"] != [x for x in _lines(tmp_path, 0) if "start" in x][0]["weights"]
    again = _steps(tmp_path, 1, rejoined.pid)
    assert again[0]["step"] > steps_at_kill  # it did not start over at step 1
    by_step = {x["step"]: x for x in zero}
    both = [x for x in again if x["step"] in by_step]
    assert len(both) >= 5
    for x in both:
        assert (x["weights"], x["optimizer"]) == (
            by_step[x["step"]]["weights"],
            by_step[x["step"]]["optimizer"],
        ), x["step"]
    # The step group 1 died in had its quorum with group 0: group 0's all-reduce failed, the try
    # was not committed and was redone on the same batch (the data check above) without group 1.
    (end,) = [x for x in _lines(tmp_path, 0) if "end" in x]
    assert end["failed_tries"] >= 1
    reads = [x for i in (0, 1) for x in _lines(tmp_path, i) if "disk_read" in x]
    assert reads == [], reads


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_groups_of_two_ranks_hold_one_model_and_read_four_shares(tmp_path: Path) -> None:
    """Two groups of two spawned ranks: each gradient is averaged over the group's ranks, then over
    the quorum's groups, so all four ranks hold the same weights at every committed step."""
    steps = 12
    with Lighthouse(min_replicas=2) as lighthouse:  # both groups in every quorum
        procs = [
            _start(lighthouse.address, i, tmp_path, "--ranks", "2", "--steps", str(steps)) for i in (0, 1)
        ]
        try:
            for proc in procs:
                proc.wait(timeout=240)
        finally:
            kill_tree(*procs)
    outputs = "\n".join(f.read_text()[-3000:] for f in sorted(tmp_path.glob("output*.txt")))
    assert [p.returncode for p in procs] == [0, 0], outputs
    files = {(g, r): tmp_path / f"group{g}{'-rank1' if r else ''}.jsonl" for g in (0, 1) for r in (0, 1)}
    logs = {
        key: [json.loads(x) for x in path.read_text().splitlines() if '"step"' in x]
        for key, path in files.items()
    }
    by_step: dict[int, set[str]] = {}
    for lines in logs.values():
        assert len(lines) >= steps - 1  # a group that joined one step late heals to the other's step
        for x in lines:
            by_step.setdefault(x["step"], set()).add(x["weights"] + x["optimizer"])
    assert all(len(states) == 1 for states in by_step.values()), by_step
    for (g, r), lines in logs.items():  # rank r of group g reads share 2g + r of 4
        sampler = TrainSampler(range(512), seed=7, rank=2 * g + r, world_size=4)
        seen = [i for x in lines for i in x["samples"]]
        assert seen == list(sampler)[: len(seen)], (g, r)
