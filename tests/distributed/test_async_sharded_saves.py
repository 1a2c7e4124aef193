"""Asynchronous sharded saves (FSDP2, 2 gloo ranks): each rank's copy kept from save to save, the
optimizer's shards copied by the writer's thread while the next iteration runs, the step waiting
for that copy, and a shard changed in place before its copy was taken never saved.

The truth is the model gathered whole at the moment of each save."""

from __future__ import annotations

import pytest

from unison.testing import run_distributed


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_asynchronous_sharded_saves_copy_into_buffers_kept_from_the_first(tmp_path):
    """Each rank makes its copy's buffers once, after the first iteration, and every folder still
    holds the model as it was at its own save (a later save's copy never reaches an earlier one's
    files)."""
    from _async_sharded_workers import async_saves_kept

    results = run_distributed(async_saves_kept, str(tmp_path), nproc=2, timeout=90)
    assert [r["made"] for r in results] == [1, 1]
    assert results[0]["same"] == [True, True, True]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_the_step_waits_for_the_copy_of_its_shards_and_each_folder_holds_them_as_saved(tmp_path):
    """Each save, the first too (its buffers reserved after the first iteration), leaves the
    model's and AdamW's shards to the writer's thread; that copy is held here until the next
    step waits for it, and each folder still holds the model as it was at its save."""
    from _async_sharded_workers import async_saves_kept

    results = run_distributed(async_saves_kept, str(tmp_path), nproc=2, timeout=90)
    for result in results:
        optimizer_shards = {n for n in result["names"] if n.startswith(("model.", "optimizer.state."))}
        assert any(".exp_avg" in n for n in optimizer_shards)
        assert [set(names) for names in result["taken"]] == [optimizer_shards] * 3, result["taken"]
    assert results[0]["same"] == [True, True, True]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_shard_changed_in_place_on_one_rank_before_its_copy_drops_that_save_on_every_rank(tmp_path):
    """Rank 1 changes its shard between the save and the step; its writer's thread finds it by the
    version counter and tells rank 0 with the write results: the folder is removed, rank 0 warns
    naming the tensor and the rank, and the next save (rank 1 copying at once) is kept."""
    from _async_sharded_workers import changed_on_one_rank

    first, second = run_distributed(changed_on_one_rank, str(tmp_path), nproc=2, timeout=90)
    (warned,) = first["warnings"]
    assert "Not saving checkpoint" in warned and "model.0.weight" in warned and "(on rank 1)" in warned, (
        warned
    )
    assert second["warnings"] == []  # its step did not warn of it a second time
    assert [first["overlap"], second["overlap"]] == [True, False]
    assert len(second["taken"]) == 1  # rank 1's last save copied every tensor at once
    assert len(first["taken"]) == 2
    assert first["manifest"] == [name for name in first["entries"] if name.endswith(".dcp")]
    assert [name[-15:] for name in first["manifest"]] == ["-i000000001.dcp", "-i000000004.dcp"]
    assert [e for e in first["entries"] if e.startswith(".ckpt-")] == []
    assert first["same"] == [True]
