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

A worker crash at the same world size (bitwise against an uninterrupted run) and a second job
beside a first are in test_elastic_torchrun.py. The sample ids each rank trained on are traced
by the model (fault_probe.TraceNet): the epoch's truth is every id of the dataset, once.
"""

from __future__ import annotations

from collections import Counter

import pytest
from elastic_faults import BATCH, EVERY, SIZE, TUNED, Outcome, agent_sigterm, node_joins, node_lost

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
    assert out.codes == {"B": 1, "A": 0}, out.show()
    assert "SignalException" in out.outputs["B"], out.show()
    assert f"all 2 ranks stopping after iteration {at} (epoch 1): preempted" in "".join(out.outputs.values())
    assert "failed (exitcode: 75)" in out.outputs["A"], "A's worker should exit 75 after the save"
    assert out.resumed == [at], out.show()
    assert worlds(out.after()) == {("A", 1)}, out.show()
    trained_once(out, at)
