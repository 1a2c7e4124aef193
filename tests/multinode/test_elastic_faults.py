"""Elastic faults with two real torchrun agents on one machine (elastic_faults.py runs them).

- **node lost**: node B (agent and worker) is killed at a fixed step; node A re-forms alone and
  finishes the epoch from the newest checkpoint: the iterations since it are redone, and every
  sample of the epoch is trained exactly once, counting what the checkpoint holds.
- **node joins**: node A trains alone; node B joins at a fixed step; A's worker gets SIGTERM,
  saves at an agreed iteration (unison's Preemption), and the group re-forms at 2 ranks from
  there: no iteration lost.
- **SIGTERM to one agent**: node B's agent forwards the signal to its worker; both ranks save at
  the agreed iteration and exit 75; B's torchrun exits 1 (torch re-raises its SignalException
  and leaves the rendezvous open), and A's agent restarts its group alone from that checkpoint.

- **rank 0's node lost, the store on a host of its own** (``unison store``): the other node
  re-forms alone and finishes; with the store on node A's agent (torchrun's default), losing A
  ends the job.

A worker crash at the same world size (bitwise against an uninterrupted run) and a second job
beside a first are in test_elastic_torchrun.py. The sample ids each rank trained on are traced
by the model (fault_probe.TraceNet): the epoch's truth is every id of the dataset, once.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import Counter

import pytest
from _procs import kill_tree
from elastic_faults import BATCH, EVERY, SIZE, TUNED, Outcome, agent_sigterm, host_lost, node_joins, node_lost

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
TIMEOUT_S = 240


def trained_once(outcome: Outcome, resumed: int) -> None:
    """The first group's steps up to the checkpoint, then every step after the fault: each
    sample of the epoch exactly once."""
    kept = [i for r in outcome.before() if r["step"] <= resumed for i in r["ids"]]
    redone = [i for r in outcome.after() for i in r["ids"]]
    twice = [i for i, n in Counter(kept + redone).items() if n > 1]
    assert not twice, f"samples trained twice in the epoch: {sorted(twice)}"
    assert sorted(kept + redone) == list(range(SIZE)), (
        f"samples never trained: {sorted(set(range(SIZE)) - set(kept + redone))}\n{outcome.show()}"
    )


def worlds(records: list[dict]) -> set[tuple[str, int]]:
    return {(r["node"], r["world"]) for r in records}


@pytest.mark.timeout(TIMEOUT_S)
def test_a_lost_node_leaves_one_rank_that_finishes_the_epoch_from_the_newest_checkpoint(tmp_path):
    at = 7  # checkpoints at 4 and 8: step 7 never completes, steps 5 and 6 are lost
    out = node_lost(tmp_path, TUNED, at=at)
    assert out.codes == {"B": -9, "A": 0}, out.show()
    assert worlds(out.before()) == {("A", 2), ("B", 2)}, f"the group should form at 2 first\n{out.show()}"
    assert {r["step"] for r in out.before()} == set(range(1, at + 1))
    newest = (at - 1) // EVERY * EVERY
    assert out.resumed == [newest], out.show()
    lost = len({r["step"] for r in out.before() if newest < r["step"] < at})
    assert lost == at - 1 - newest == 2
    assert worlds(out.after()) == {("A", 1)}, out.show()
    assert len(out.after()) == (SIZE - 2 * BATCH * newest) // BATCH  # the epoch's rest, at 1 rank
    trained_once(out, newest)


@pytest.mark.timeout(TIMEOUT_S)
def test_a_joining_node_regroups_at_two_ranks_through_an_agreed_checkpoint_losing_nothing(tmp_path):
    at = 6
    out = node_joins(tmp_path, TUNED, at=at)
    assert out.codes == {"A": 0, "B": 0}, out.show()
    assert worlds(out.before()) == {("A", 1)} and max(r["step"] for r in out.before()) == at
    assert f"stopping after iteration {at} (epoch 1): preempted" in out.outputs["A"], out.show()
    assert out.resumed == [at], f"the re-formed group should go on from the agreed save\n{out.show()}"
    assert worlds(out.after()) == {("A", 2), ("B", 2)}, out.show()
    assert len(out.after()) == 2 * (SIZE - BATCH * at) // (2 * BATCH)
    trained_once(out, at)


@pytest.mark.timeout(TIMEOUT_S)
def test_sigterm_to_one_agent_saves_at_an_agreed_iteration_and_the_other_node_goes_on(tmp_path):
    at = 6
    out = agent_sigterm(tmp_path, TUNED, at=at)
    # B's agent raises SignalException and exits 1; its interpreter's teardown can still abort (-6)
    # after that, when one of torch's C++ threads outlives Python (seen once in 22 runs here).
    assert out.codes["A"] == 0 and out.codes["B"] in (1, -6), out.show()
    assert "SignalException" in out.outputs["B"], out.show()
    assert f"all 2 ranks stopping after iteration {at} (epoch 1): preempted" in "".join(out.outputs.values())
    assert "failed (exitcode: 75)" in out.outputs["A"], "A's worker should exit 75 after the save"
    assert out.resumed == [at], out.show()
    assert worlds(out.after()) == {("A", 1)}, out.show()
    trained_once(out, at)


@pytest.fixture
def store(tmp_path):
    """A rendezvous store served by ``unison store`` in a session of its own; ended by its PID."""
    ready = tmp_path / "store.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "unison", "store", "--port", "0", "--ready", str(ready)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        yield int(ready.read_text())
        assert proc.poll() is None, "the store must outlive the lost node"
    finally:
        kill_tree(proc)


@pytest.mark.timeout(TIMEOUT_S)
def test_with_the_store_on_a_host_of_its_own_losing_rank_0s_node_leaves_a_job_that_finishes(tmp_path, store):
    """The rendezvous store outlives the node of rank 0 (its agent and worker killed): the
    other node re-forms the group alone and finishes the epoch from the newest checkpoint."""
    at = 7
    out, lost = host_lost(tmp_path, TUNED, store, who="rank0", at=at)
    kept = ({"A", "B"} - {lost}).pop()
    assert out.codes == {lost: -9, kept: 0}, out.show()
    assert worlds(out.before()) == {("A", 2), ("B", 2)}, f"the group should form at 2 first\n{out.show()}"
    newest = (at - 1) // EVERY * EVERY
    assert out.resumed == [newest], out.show()
    assert worlds(out.after()) == {(kept, 1)}, out.show()
    trained_once(out, newest)


@pytest.mark.timeout(TIMEOUT_S)
def test_with_the_store_on_node_a_losing_node_a_ends_the_job(tmp_path):
    """What the store of its own is for: served by node A's agent (torchrun's default for the
    host the endpoint names), the store goes with node A, and node B cannot re-form the group."""
    out, lost = host_lost(tmp_path, TUNED, None, who="A", at=7)
    assert lost == "A" and out.codes["A"] == -9, out.show()
    assert out.codes["B"] not in (0, None), f"node B should fail without its rendezvous\n{out.show()}"
    assert not out.after(), "no group should train after the store's host was lost"
