"""Sharded checkpoints under FSDP2: exact resume, resharding N -> M ranks, DDP <-> FSDP, damage.

The truths: the uninterrupted run for a run resumed at the same world size; for a resume
at another world size, the states saved (the resumed run starts from them exactly) and the
epoch's samples (each trained on exactly once across the stop).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _sharded_workers import BATCH, SAMPLES, job, job_read_in_place

from unison.checkpoint import Manifest
from unison.testing import run_distributed

EPOCHS = 2


def _same(a: dict, b: dict, atol: float = 0.0) -> float:
    assert a.keys() == b.keys()
    gap = max(float((a[k].float() - b[k].float()).abs().max()) for k in a)
    assert gap <= atol, gap
    return gap


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_sharded_save_gathers_its_checks_and_checksums_with_what_it_gathers_anyway(tmp_path, background):
    """Each rank's finite check of its shards goes to rank 0 with its per-rank state, and its files'
    sizes and CRC-32s among DCP's write results: a save issues no gather of its own for either,
    and ``checksums.json`` still covers every file, matching it, none of them left by an earlier
    save that died at the same position."""
    from _sharded_workers import save_collectives

    from unison.checkpoint.sharded_files import file_checksum

    ranks = run_distributed(save_collectives, str(tmp_path), background, nproc=2, timeout=90)
    assert ranks[0]["calls"] == ranks[1]["calls"], ranks
    # unison's: the per-rank state with every rank's finite check of its shards (a gather), the
    # verdict (a broadcast of objects), the replicated buffers made rank 0's (a broadcast); DCP's:
    # the plans (a gather, a scatter) and the write results, the checksums among them (a gather, a
    # broadcast of objects). No barrier: DCP makes the folder on every rank as it plans.
    assert ranks[0]["calls"] == {
        "gather_object": 3,  # 5 when the finite check and the checksums had a gather each
        "scatter_object_list": 1,
        "broadcast_object_list": 2,
        "broadcast": 1,
    }
    folder = tmp_path / ranks[0]["saved"]
    sums = json.loads((folder / "checksums.json").read_text())["files"]
    assert sorted(sums) == sorted(p.name for p in folder.iterdir() if p.name != "checksums.json")
    assert sorted(sums) == [".metadata", "__0_0.distcp", "__1_0.distcp", "rest.pt"]
    for name, entry in sums.items():
        assert file_checksum(folder / name) == (entry["size"], entry["crc32"]), name


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_each_rank_loads_its_own_shards_and_the_ranks_agree_in_one_all_reduce(tmp_path):
    """DCP's load gathers every rank's plan to rank 0 and sends it back, then gathers every rank's
    result: three collectives whose bytes grow with the world size and the model, for plans its
    default planner leaves as each rank made them. A sharded load now reads each rank's pieces on
    its own and issues one all-reduce of one number; every shard and optimizer moment comes back."""
    from _sharded_workers import load_collectives

    ranks = run_distributed(load_collectives, str(tmp_path), None, nproc=2, timeout=90)
    for rank in ranks:
        assert rank["error"] is None, rank
        assert rank["restored"], rank
        assert rank["calls"] == {"all_reduce": 1}, (
            rank
        )  # DCP's: gather_object, scatter_object_list, all_gather_object


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_a_load_that_fails_on_one_rank_raises_its_error_on_every_rank(tmp_path):
    """Rank 1's read of its shards fails: rank 1 raises its own error, rank 0 the same words naming
    rank 1, and neither waits for the other in a later collective (the failing rank's words reach
    the others in one broadcast, after the all-reduce that told them some rank failed)."""
    from _sharded_workers import load_collectives

    ranks = run_distributed(load_collectives, str(tmp_path), 1, nproc=2, timeout=90)
    kind, text = ranks[1]["error"]
    assert kind == "CheckpointError"
    assert "its shards do not read (OSError: the shard's disk went away)" in text
    assert ranks[0]["error"] == ("CheckpointError", f"{text} (rank 1's load failed; every rank stops)")
    for rank in ranks:
        assert rank["calls"] == {"all_reduce": 1, "broadcast_object_list": 1}, rank


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("in_place", [False, True], ids=["as-found", "every-record-into-its-shard"])
def test_fsdp_resume_mid_epoch_ends_as_the_uninterrupted_run(tmp_path, in_place):
    """With ``in_place``, every tensor record of a byte or more is read straight into its shard
    (``unison.checkpoint.dcp_reads``; 1 MiB in a run)."""
    truth = run_distributed(job, str(tmp_path / "a"), "fsdp", EPOCHS, nproc=2, timeout=120)[0]
    folder = str(tmp_path / "b")
    run_distributed(job, folder, "fsdp", EPOCHS, stop_after=11, nproc=2, timeout=120)
    saved = sorted(p.name for p in Path(folder).iterdir() if p.suffix == ".dcp")
    assert saved and all((Path(folder) / s / "rest.pt").is_file() for s in saved)
    resume = job_read_in_place if in_place else job
    results = run_distributed(resume, folder, "fsdp", EPOCHS, resume=True, nproc=2, timeout=120)
    resumed = results[0]
    _same(resumed["params"], truth["params"], atol=1e-6)
    _same(resumed["ema"], truth["ema"], atol=1e-6)
    assert resumed["lr"] == truth["lr"]
    if in_place:  # each rank read its weights and Adam's moments into their own memory
        assert all(r["placed"] > 0 and r["read"] >= r["placed"] for r in results), [
            (r["placed"], r["read"]) for r in results
        ]


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_async_sharded_saves_resume_as_the_uninterrupted_run(tmp_path):
    truth = run_distributed(job, str(tmp_path / "a"), "fsdp", EPOCHS, nproc=2, timeout=120)[0]
    folder = tmp_path / "b"
    run_distributed(job, str(folder), "fsdp", EPOCHS, stop_after=11, async_save=True, nproc=2, timeout=120)
    manifest = Manifest(folder).rebuild()
    assert [e.iteration for e in manifest.entries] == [4, 8, 11]  # every save recorded, in order
    assert all(folder.joinpath(e.file).is_dir() for e in manifest.entries)
    resumed = run_distributed(
        job, str(folder), "fsdp", EPOCHS, resume=True, async_save=True, nproc=2, timeout=120
    )
    _same(resumed[0]["params"], truth["params"], atol=1e-6)
    _same(resumed[0]["ema"], truth["ema"], atol=1e-6)


def _reshard(tmp_path: Path, before: int, after: int) -> None:
    folder = str(tmp_path / f"{before}to{after}")
    stop = 5 if before == 2 else 3  # mid-epoch 1: 30 samples, 2 per rank per step
    stopped = run_distributed(job, folder, "fsdp", EPOCHS, stop_after=stop, nproc=before, timeout=120)
    resumed = run_distributed(job, folder, "fsdp", EPOCHS, resume=True, nproc=after, timeout=120)
    start = resumed[0]["at_start"]
    _same(start["params"], stopped[0]["params"])  # model, average and schedule: as saved
    _same(start["ema"], stopped[0]["ema"])
    assert start["lr"] == stopped[0]["lr"]
    # the interrupted epoch: every sample, across both runs, and none twice but for the padding that
    # gives every rank of the resumed run the same number of the remaining samples (TrainSampler's rule)
    epoch_one = [i for r in stopped + resumed for e, i in r["seen"] if e == 1]
    remaining = SAMPLES - stop * BATCH * before
    assert set(epoch_one) == set(range(SAMPLES))
    assert len(epoch_one) - SAMPLES == -remaining % after
    epoch_two = [i for r in resumed for e, i in r["seen"] if e == 2]
    assert sorted(epoch_two) == list(range(SAMPLES))
    assert all(r["epoch"] == EPOCHS for r in resumed)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2)])
def test_a_sharded_checkpoint_resumes_at_another_world_size(tmp_path, before, after):
    _reshard(tmp_path, before, after)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("first", "then"), [("ddp", "fsdp"), ("fsdp", "ddp")])
def test_ddp_and_fsdp_checkpoints_load_into_each_other(tmp_path, first, then):
    truth = run_distributed(job, str(tmp_path / "truth"), first, EPOCHS, nproc=2, timeout=120)[0]
    folder = str(tmp_path / "mixed")
    stopped = run_distributed(job, folder, first, EPOCHS, stop_after=15, nproc=2, timeout=120)[0]
    kinds = {p.suffix for p in Path(folder).iterdir() if p.name.startswith("ckpt-")}
    assert kinds == {".dcp" if first == "fsdp" else ".pt"}
    resumed = run_distributed(job, folder, then, EPOCHS, resume=True, nproc=2, timeout=120)[0]
    _same(resumed["at_start"]["params"], stopped["params"])
    _same(resumed["at_start"]["ema"], stopped["ema"])
    _same(resumed["params"], truth["params"], atol=1e-5)  # reduction order differs between strategies


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_damaged_or_unfinished_sharded_checkpoint_is_never_resumed(tmp_path, caplog):
    folder = tmp_path / "ckpts"
    run_distributed(job, str(folder), "fsdp", EPOCHS, nproc=2, timeout=120)  # keeps 3: i8, i12, i16
    manifest = Manifest(folder).rebuild()
    newest, older = (folder / e.file for e in manifest.newest()[:2])
    assert manifest.newest_complete() == newest
    shard = next(newest.glob("__1_*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-7])  # truncated
    assert Manifest(folder).rebuild().newest_complete() == older
    assert "damaged" in caplog.text
    # a crash mid-save: a temporary folder and a renamed folder without its checksums
    (folder / f".{newest.name}.tmp").mkdir()
    (older / "checksums.json").unlink()
    rebuilt = Manifest(folder).rebuild()
    assert not (folder / f".{newest.name}.tmp").exists()
    assert rebuilt.newest_complete() not in (newest, older)
    recorded = json.loads((folder / "manifest.json").read_text())["checkpoints"]
    assert all(not e["file"].endswith(".tmp") for e in recorded)
    rest = torch.load(rebuilt.newest_complete() / "rest.pt", weights_only=True)
    assert set(rest["meta"]["sharded"]) == {"model", "optimizer", "handler:EMA"}
    assert set(rest["objects"]) == {"scheduler"}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_rank_checks_the_files_its_load_then_reads(tmp_path):
    """At the world size a folder was written at, a rank's share of the check is the data files it
    wrote: on a cluster, its own node's page cache then holds what its load reads next."""
    from _sharded_workers import files_checked_and_loaded

    folder = tmp_path / "ckpts"
    run_distributed(job, str(folder), "fsdp", EPOCHS, stop_after=4, nproc=2, timeout=120)
    ranks = run_distributed(files_checked_and_loaded, str(folder), nproc=2, timeout=120)
    newest = Manifest(folder).rebuild().newest_complete()
    assert newest is not None and [r["resumed"] for r in ranks] == [newest.name] * 2
    written = sorted(p.name for p in newest.iterdir())
    for rank, seen in enumerate(ranks):
        data = [n for n in seen["checked"] if n.endswith(".distcp")]
        assert data == [f"__{rank}_0.distcp"], (rank, seen)
        own = seen["loaded"].pop(data[0])  # what its load read from the file its check read
        shards = [key for key, tensor in own if tensor and not key.endswith(".step")]
        assert any(k.startswith("model.") for k in shards) and any("exp_avg" in k for k in shards), own
        # from the other rank's file: only values DCP keeps once for all (optimizer steps, settings)
        elsewhere = [piece for pieces in seen["loaded"].values() for piece in pieces]
        assert all(key.endswith(".step") or not tensor for key, tensor in elsewhere), (rank, elsewhere)
    assert sorted(n for seen in ranks for n in seen["checked"]) == [
        n for n in written if n != "checksums.json"
    ]
    # rest.pt's records: loaded once on each rank, and checked by rank 0 as it loads them
    assert [seen["rest_reads"] for seen in ranks] == [["loaded, checked"], ["loaded"]]


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_nan_in_one_ranks_shard_skips_the_save_on_every_rank(tmp_path, async_save):
    """Rank 1 finds the NaN beside its write; rank 0 hears of it with the write results, removes the
    folder and records nothing: the good checkpoint stays the newest, and nothing else is left."""
    from _sharded_workers import nan_in_one_shard

    results = run_distributed(nan_in_one_shard, str(tmp_path), async_save, nproc=2, timeout=90)
    first = results[0]["first"]
    assert first is not None and first.suffix == ".dcp"
    if not async_save:  # an asynchronous save returns its folder before its check is done
        assert [r["second"] for r in results] == [None, None]
    assert results[0]["saved"] == [first.name]  # the good one stays the newest
    assert results[0]["manifest"] == [first.name]
    assert [e for e in results[0]["entries"] if e.startswith(".ckpt-")] == []  # its temporary folder removed
