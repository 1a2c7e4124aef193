"""Checkpoint stall: how long a save blocks training, synchronous against asynchronous.

A model of about 100 MB (by default 6 x Linear(2048, 2048): 25.2M float32 parameters)
trains with SGD on small random batches in a unison trainer, one torch thread. Once per
run, at a fixed iteration, a handler calls ``Checkpoint.save`` (model and optimizer); the
stall is what the Checkpoint itself records, ``Checkpoint.stall_seconds``: how long save()
held the training loop.

    sync   collect the state, write a temp file, fsync, rename, fsync the folder,
           record it in the manifest: all of it inside save().
    async  collect the state and copy it to CPU memory inside save(); a background
           thread writes it while training goes on.

Runs interleave, in an order rotated every round, so a shared machine's noise hits both
alike. Reported per mode: the median stall, the median wall time of the whole run (its
steps plus the save), and for async the median time from save() until the file was
durable. "async/sync" is the median over rounds of the paired ratio of stalls.

Two reference rows break the async stall down: copying the model's tensors into fresh CPU
tensors (new allocations, whose pages fault in as they are written), and into the kept
buffers of a ``Snapshot`` (what an async save does: the Checkpoint, attached as a run
attaches it, reserves them after the first iteration and copies into them, large tensors
by several threads).

Targets: async stall <= 10% of sync (a file's, and a 2-rank sharded save's: rank 0's stalls of
saves one an iteration by one Checkpoint, the first, which makes the copy's buffers, left out);
every save and every resume at >= 0.8x the disk.

**Throughput against the disk.** What a save writes per second bounds how often a run can
afford to checkpoint (``checkpoint.every_seconds``), and the disk bounds the save: each
round also writes, into the same folder, a file of the checkpoint's size in 8 MiB blocks
and fsyncs it (``_disk.py``), and the report sets each save's MB/s against that file's:

    file sync      bytes of the file / stall (the whole save is inside save())
    file async     bytes of the file / time from save() until it was durable
    sharded        a 2-rank FSDP2 model (gloo, on the CPU whatever --device says) saved
                   to a sharded folder: its bytes / rank 0's stall; rank 0 writes the
                   disk's file between rounds, while the other rank waits

    file resume    bytes of the file / a fresh Checkpoint's ``resume("auto")`` (pick the
                   newest whole checkpoint, check it, load it, put the states back), the
                   file's pages dropped from the cache first; against reading the disk's
                   file back, its pages dropped likewise (both cold: ``_disk.drop_cache``)
    sharded resume the sharded folder's bytes / rank 0's ``resume("auto")`` at 2 ranks (each
                   rank reads its shards, rank 0 checks every file), cold likewise

"x disk" is the save's median MB/s over the disk's median MB/s, each over the same number
of rounds: 1.0 would be a save that costs nothing but its bytes. A resume is also set against
the disk's read of a file written as the checkpoint's own was ("x like": with ``O_DIRECT`` for a
sharded folder and for a file from 128 MiB, through the page cache below), since on some
virtual disks a file written with ``O_DIRECT`` reads back slower than one written through the
page cache (``_disk.WRITTEN_DIRECT``); the target is judged on "x disk". The disk's file is written
and read four ways: through the page cache and with ``O_DIRECT``, each one 8 MiB block after
another and 3 x 32 MiB at once (``_disk.probe_ways``); the disk's speed is the fastest way's
median (``_disk.faster_way``; the report prints every way). Taking the faster way within
each round instead picked the luckier of noisy samples every round, and set the disk faster
than any way's median.

``--large`` checkpoints a model of about 1 GB (16 x Linear(4096, 4096)) instead;
``--size-mb N`` a model of about N MB (Linear(2048, 2048) layers below 512 MB, Linear(4096,
4096) layers from there: ``--size-mb 1024`` is 15 x Linear(4096, 4096), 1007 MB).

On a GPU (``--device cuda``, the default where torch sees one) the model, its optimizer
and the batches live on the GPU: a save copies the state to CPU memory first (the async
save inside ``save()``, the sync one as it writes), and the handler waits for the queued
steps (``torch.cuda.synchronize``) before it calls ``save()``, so the stall is the save's
own. The reference copies go into CPU tensors.

    python benchmarks/checkpoint_stall.py                    # ~1-2 minutes on 2 busy cores
    python benchmarks/checkpoint_stall.py --quick            # a smoke run
    python benchmarks/checkpoint_stall.py --repeats 9 --json stall.json --dir /scratch/ckpt
    python benchmarks/checkpoint_stall.py --width 512 --layers 2 --repeats 1 --steps 2   # seconds
    python benchmarks/checkpoint_stall.py --large --repeats 3                # ~1 GB checkpoints
    python benchmarks/checkpoint_stall.py --size-mb 1024 --repeats 3         # the same, by size
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
from _disk import drop_cache, faster_way, folder_bytes, mb_per_s, probe_ways, written_as  # noqa: E402

MODES = ("sync", "async")
TARGET = 0.10
"""Async stall over sync stall, at most."""
DISK_TARGET = 0.8
"""A save's or a resume's MB/s over the disk's, at least."""
LARGE = (4096, 16)
"""``--large``: width and layers of a ~1 GB model."""


def sized(megabytes: float) -> tuple[int, int]:
    """Width and layers of a model of about ``megabytes`` MB of float32 weights and biases.

    Example:
        >>> sized(100), sized(1024)
        ((2048, 6), (4096, 15))
    """
    width = 4096 if megabytes >= 512 else 2048
    return width, max(1, round(megabytes * 1e6 / ((width * width + width) * 4)))


def build(width: int, layers: int, seed: int = 0) -> Any:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks[:-1])


def fresh_checkpoint(model: Any, optimizer: Any, folder: Path, *, keep_last: int, async_save: bool) -> Any:
    """A trainer and its attached Checkpoint saving into ``folder``, which starts empty (rank 0
    empties it, untimed); saves only when told to (collective)."""
    import shutil

    import torch.nn.functional as F

    from unison.distributed import barrier, get_rank
    from unison.engine import create_trainer
    from unison.handlers import Checkpoint

    if get_rank() == 0:
        shutil.rmtree(folder, ignore_errors=True)
    barrier()
    trainer = create_trainer(model, optimizer, F.mse_loss, sync_every=None, track_loss=False)
    checkpoint = Checkpoint(
        folder,
        {"model": model, "optimizer": optimizer},
        trainer,
        every_epochs=None,
        at_end=False,
        keep_last=keep_last,
        async_save=async_save,
    )
    checkpoint.attach()  # as a run attaches it: an async one reserves its copy after the first iteration
    return trainer, checkpoint


def one_run(
    model: Any, optimizer: Any, data: Any, folder: Path, mode: str, steps: int, device: Any = "cpu"
) -> dict[str, float]:
    """Trains ``steps`` iterations, saving once halfway; returns the save's timings.

    The folder starts empty (rank 0 empties it, untimed): a run's save writes a new name, while
    every round here saves the same position, whose older file the save would otherwise
    delete on the trainer's time (a file's rename over it, a sharded folder's removal)."""
    from unison.engine import Events

    trainer, checkpoint = fresh_checkpoint(model, optimizer, folder, keep_last=1, async_save=mode == "async")
    started: list[float] = []

    @trainer.on(Events.ITERATION_COMPLETED(once=steps // 2))
    def _save(engine: Any) -> None:
        C.synchronize(device)  # the queued steps finish first: the stall is the save's (a no-op on the CPU)
        started.append(time.time())
        checkpoint.save(engine)

    wall = time.perf_counter()
    trainer.run(data, max_epochs=1, epoch_length=steps)
    C.synchronize(device)
    wall = time.perf_counter() - wall
    checkpoint.wait()
    if not checkpoint.stall_seconds:  # a rank other than 0 of a sharded save: rank 0 keeps the record
        return {"stall_s": float("nan"), "run_s": wall, "durable_s": float("nan")}
    durable = checkpoint.manifest.entries[-1].saved_at - started[0]
    return {"stall_s": checkpoint.stall_seconds[-1], "run_s": wall, "durable_s": durable}


def resume_seconds(model: Any, optimizer: Any, folder: Path) -> float:
    """Seconds of a fresh Checkpoint's ``resume("auto")`` from ``folder`` (collective), its files'
    pages dropped from the cache first (by rank 0, for every rank's files)."""
    import torch.nn.functional as F

    from unison.distributed import barrier, get_rank
    from unison.engine import create_trainer
    from unison.handlers import Checkpoint

    trainer = create_trainer(model, optimizer, F.mse_loss, sync_every=None, track_loss=False)
    checkpoint = Checkpoint(folder, {"model": model, "optimizer": optimizer}, trainer, every_epochs=None)
    if get_rank() == 0:
        drop_cache(folder)
    barrier()
    start = time.perf_counter()
    if checkpoint.resume("auto") is None:
        raise RuntimeError(f"nothing to resume from in {folder}")
    return time.perf_counter() - start


def async_sharded_stalls(model: Any, optimizer: Any, data: Any, folder: Path, saves: int) -> list[float]:
    """Rank 0's stalls of ``saves`` asynchronous sharded saves by one Checkpoint, one an iteration,
    as a run makes them (the first save, which makes the copy's buffers, not counted); [] elsewhere."""
    from unison.engine import Events

    trainer, checkpoint = fresh_checkpoint(model, optimizer, folder, keep_last=2, async_save=True)
    trainer.add_event_handler(Events.ITERATION_COMPLETED, lambda engine: checkpoint.save(engine))
    trainer.run(data, max_epochs=1, epoch_length=saves + 1)
    checkpoint.wait()
    return list(checkpoint.stall_seconds[1:])


def sharded_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs on every rank: an FSDP2 model saved to a sharded folder once per round, after a
    warm-up; after each round rank 0 writes a file of the folder's size (the disk, interleaved)."""
    import torch

    from unison.distributed import barrier, get_rank, prepare_model

    torch.set_num_threads(cfg["threads"])
    model = prepare_model(build(cfg["width"], cfg["layers"]), strategy="fsdp")
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(get_rank())
    data = [(torch.randn(4, cfg["width"], generator=gen), torch.randn(4, cfg["width"], generator=gen))]
    root = Path(cfg["root"])
    one_run(model, optimizer, data, root / "sharded", "sync", cfg["steps"])  # warm-up
    size = folder_bytes(root / "sharded") if get_rank() == 0 else 0
    stalls, resumes, probes = [], [], []
    for _ in range(cfg["repeats"]):
        stalls.append(one_run(model, optimizer, data, root / "sharded", "sync", cfg["steps"])["stall_s"])
        resumes.append(resume_seconds(model, optimizer, root / "sharded"))
        barrier()
        if get_rank() == 0:
            probes.append(probe_ways(root / "disk", size))
        barrier()
    # one save an iteration: twice the rounds and one, for a median that a rank's late arrival
    # at the save's gather (a few ms here, on 2 shared cores) moves less
    async_stalls = async_sharded_stalls(
        model, optimizer, data, root / "sharded_async", 2 * cfg["repeats"] + 1
    )
    return {
        "stall_s": stalls,
        "resume_s": resumes,
        "probes": probes,
        "bytes": size,
        "async_stall_s": async_stalls,
    }


def throughput_rows(
    saves: dict[str, tuple[int, list[float]]], disk: dict[str, list[float]]
) -> dict[str, Any]:
    """Each save's median MB/s (its bytes over each round's seconds) against the disk's, written
    in the same rounds: ``saves[name] = (bytes, seconds)``, ``disk[name]`` the disk's seconds."""
    out: dict[str, Any] = {}
    for name, (nbytes, seconds) in saves.items():
        save = C.median(mb_per_s(nbytes, s) for s in seconds)
        own = C.median(mb_per_s(nbytes, s) for s in disk[name])
        out[name] = {"mb": nbytes / 1e6, "save_mb_s": save, "disk_mb_s": own, "x_disk": save / own}
    return out


def written_direct(nbytes: int | None) -> bool:
    """Whether unison writes a checkpoint file of ``nbytes`` (None: a sharded checkpoint's files)
    with ``O_DIRECT`` here, as :func:`unison.checkpoint.direct.open_sink` and DCP's writer decide."""
    from unison.checkpoint.direct import DIRECT_FROM, direct_available

    return direct_available() and (nbytes is None or nbytes >= DIRECT_FROM)


def like_for_like(row: dict[str, Any], rounds: list[dict[str, tuple[float, float]]], direct: bool) -> None:
    """Adds to a resume's ``row`` the disk's read of a file written as the checkpoint's was
    (``direct``: with ``O_DIRECT``), the fastest way of reading it back: ``like_mb_s``,
    ``x_like``, ``like_way``. ``x_disk`` stays set against the fastest read of any file."""
    way, seconds = faster_way(rounds, 1, among=written_as(direct))
    own = C.median(mb_per_s(row["mb"] * 1e6, s) for s in seconds)
    row.update(like_mb_s=own, x_like=row["save_mb_s"] / own, like_way=way)


def print_probes(probes: list[dict[str, tuple[float, float]]], nbytes: int) -> None:
    """The disk's MB/s each way, median over the rounds: the faster way's median is the disk's speed."""
    parts = []
    for way in probes[0] if probes else []:
        writes = [p[way][0] for p in probes]
        write = "-" if any(w != w for w in writes) else f"{C.median(mb_per_s(nbytes, w) for w in writes):.0f}"
        read = C.median(mb_per_s(nbytes, p[way][1]) for p in probes)
        parts.append(f"{way}: write {write}, read {read:.0f}")  # "-": the way's write is another's
    print(f"\ndisk MB/s, median of {len(probes)} rounds: " + "; ".join(parts))


def copy_timings(model: Any, snapshot: Any, device: Any = "cpu") -> dict[str, float]:
    """Seconds to copy the model's tensors into fresh CPU tensors, and into ``snapshot``'s kept
    buffers (what an async save does: ``unison.checkpoint.snapshot.Snapshot``)."""
    from unison.checkpoint.state import to_cpu_copy

    state = model.state_dict()
    C.synchronize(device)
    start = time.perf_counter()
    fresh = to_cpu_copy(state)
    middle = time.perf_counter()
    snapshot.take(state)
    end = time.perf_counter()
    del fresh
    return {"fresh_s": middle - start, "reused_s": end - middle}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved rounds (default 7; 3 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--width", type=int, default=None, help="width of each Linear layer (default 2048)")
    parser.add_argument(
        "--layers", type=int, default=None, help="Linear layers (default 6: ~100 MB of float32)"
    )
    parser.add_argument("--large", action="store_true", help="a ~1 GB model: 16 x Linear(4096, 4096)")
    parser.add_argument("--size-mb", type=float, default=None, help="a model of about this many MB")
    parser.add_argument(
        "--steps", type=int, default=6, help="training iterations per run, the save halfway (default 6)"
    )
    parser.add_argument(
        "--dir", type=Path, default=None, help="where checkpoints are written (default: a temp folder)"
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default=None, help="default cuda when available, else cpu"
    )
    parser.add_argument(
        "--no-sharded", action="store_true", help="skip the 2-rank sharded save (it spawns 2 processes)"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 if a target is missed")
    args = parser.parse_args(argv)
    width, layers = LARGE if args.large else sized(args.size_mb) if args.size_mb else (2048, 6)
    args.width = args.width or width
    args.layers = args.layers or layers
    repeats = args.repeats if args.repeats is not None else (3 if args.quick else 7)
    if repeats < 1 or args.steps < 2:
        raise SystemExit("--repeats must be >= 1 and --steps >= 2")

    import torch

    torch.set_num_threads(1)
    device = C.resolve_device(args.device)
    env = C.environment(device)
    C.print_environment(env)
    model = build(args.width, args.layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters())
    megabytes = sum(p.numel() * p.element_size() for p in model.parameters()) / 1e6
    gen = torch.Generator().manual_seed(0)
    data = [(torch.randn(4, args.width, generator=gen), torch.randn(4, args.width, generator=gen))]
    data = [(x.to(device), y.to(device)) for x, y in data]
    print(
        f"model: {args.layers} x Linear({args.width}, {args.width}), "
        f"{params / 1e6:.1f}M parameters, {megabytes:.0f} MB"
    )

    root = Path(tempfile.mkdtemp(prefix="unison-stall-", dir=args.dir))
    results: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    copies: list[dict[str, float]] = []
    from unison.checkpoint.snapshot import Snapshot

    reused = Snapshot()
    reused.take(model.state_dict())  # its buffers, allocated once
    probes: list[dict[str, tuple[float, float]]] = []
    resumes: list[float] = []
    sharded: dict[str, Any] | None = None
    try:
        for mode in MODES:  # warm-up: first writes to a folder, first file-system allocations
            one_run(model, optimizer, data, root / mode, mode, args.steps, device)
        file_bytes = sum(folder_bytes(p) for p in (root / "sync").glob("*.pt"))
        for round_index in range(repeats):
            for mode in C.rotated((*MODES, "copy", "disk", "resume"), round_index):
                if mode == "copy":
                    copies.append(copy_timings(model, reused, device))
                elif mode == "disk":
                    probes.append(probe_ways(root / "disk", file_bytes))
                elif mode == "resume":
                    resumes.append(resume_seconds(model, optimizer, root / "sync"))
                else:
                    results[mode].append(
                        one_run(model, optimizer, data, root / mode, mode, args.steps, device)
                    )
            last = {m: results[m][-1]["stall_s"] for m in MODES}
            print(
                f"  round {round_index + 1}/{repeats}: "
                + "  ".join(f"{m} stall {v * 1e3:.0f} ms" for m, v in last.items())
            )
        file_mb = file_bytes / 1e6
        if not args.no_sharded:
            from unison.distributed import launch

            cfg = {"width": args.width, "layers": args.layers, "steps": args.steps, "repeats": repeats}
            cfg.update(root=str(root), threads=C.rank_threads(2))
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo ranks on the CPU: else each would take a GPU
            try:
                sharded = launch(sharded_worker, cfg, nproc_per_node=2, backend="gloo", start_method="spawn")[
                    0
                ]
            finally:
                if visible is None:
                    os.environ.pop("CUDA_VISIBLE_DEVICES")
                else:
                    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    finally:
        shutil.rmtree(root, ignore_errors=True)

    stalls = {m: [r["stall_s"] for r in results[m]] for m in MODES}
    ratio = C.paired_ratio(stalls["async"], stalls["sync"])
    summary: dict[str, Any] = {}
    rows = []
    for mode in MODES:
        runs = results[mode]
        summary[mode] = {
            "stall_ms_median": C.median(stalls[mode]) * 1e3,
            "stall_spread": C.spread(stalls[mode]),
            "run_ms_median": C.median(r["run_s"] for r in runs) * 1e3,
            "durable_ms_median": C.median(r["durable_s"] for r in runs) * 1e3,
            "stall_ms": [s * 1e3 for s in stalls[mode]],
        }
        s = summary[mode]
        rows.append(
            [
                mode,
                f"{s['stall_ms_median']:.1f}",
                f"{s['stall_spread']:.2f}",
                f"{s['durable_ms_median']:.1f}",
                f"{s['run_ms_median']:.1f}",
                "1.00" if mode == "sync" else f"{ratio:.3f}",
            ]
        )
    sync_stall = summary["sync"]["stall_ms_median"]
    for key, label in (("fresh_s", "(copy to fresh tensors)"), ("reused_s", "(copy to reused buffers)")):
        values = [c[key] * 1e3 for c in copies]
        summary[f"copy_{key[:-2]}_ms_median"] = C.median(values)
        rows.append(
            [
                label,
                f"{C.median(values):.1f}",
                f"{C.spread(values):.2f}",
                "",
                "",
                f"{C.median(values) / sync_stall:.3f}",
            ]
        )
    C.print_table(
        f"Checkpoint stall, {megabytes:.0f} MB model ({file_mb:.0f} MB file), "
        f"{args.steps} steps per run, median of {repeats}",
        [
            "mode",
            "stall ms",
            "spread",
            "durable after ms",
            f"run ({args.steps} steps) ms",
            "x sync stall",
        ],
        rows,
    )
    saves = {
        "file_sync": (file_bytes, stalls["sync"]),
        "file_async": (file_bytes, [r["durable_s"] for r in results["async"]]),
        "file_resume": (file_bytes, resumes),
    }
    (write_way, disk), (read_way, reads) = faster_way(probes, 0), faster_way(probes, 1)
    disks = {"file_sync": disk, "file_async": disk, "file_resume": reads}
    ways = {"file_sync": write_way, "file_async": write_way, "file_resume": read_way}
    if sharded is not None:
        saves["sharded_sync"] = (sharded["bytes"], sharded["stall_s"])
        saves["sharded_resume"] = (sharded["bytes"], sharded["resume_s"])
        (ways["sharded_sync"], disks["sharded_sync"]) = faster_way(sharded["probes"], 0)
        (ways["sharded_resume"], disks["sharded_resume"]) = faster_way(sharded["probes"], 1)
    throughput = throughput_rows(saves, disks)
    for name, row in throughput.items():
        row["disk_way"] = ways[name]
    resumes_of = {"file_resume": (probes, file_bytes)}
    if sharded is not None:
        resumes_of["sharded_resume"] = (sharded["probes"], None)
    for name, (rounds, nbytes) in resumes_of.items():
        like_for_like(throughput[name], rounds, written_direct(nbytes))
    print_probes(probes, file_bytes)
    C.print_table(
        f"Save and resume throughput against the disk's sequential write (fsync) and read (cold), same folder, "
        f"median of {repeats}; a resume also against a read of a file written as its own was ('x like')",
        ["save or resume", "MB", "MB/s", "disk MB/s", "x disk", "x like"],
        [
            [
                n,
                f"{t['mb']:.1f}",
                f"{t['save_mb_s']:.0f}",
                f"{t['disk_mb_s']:.0f}",
                f"{t['x_disk']:.2f}",
                f"{t['x_like']:.2f}" if "x_like" in t else "-",
            ]
            for n, t in throughput.items()
        ],
    )
    met = ratio <= TARGET
    print(f"\ntarget: async stall <= {TARGET:.0%} of sync: {ratio:.1%} -> {C.verdict(met)}")
    sharded_ratio = None
    if sharded is not None and sharded["async_stall_s"]:
        sharded_ratio = C.median(sharded["async_stall_s"]) / C.median(sharded["stall_s"])
        sharded_met = sharded_ratio <= TARGET
        print(
            f"target: sharded async stall <= {TARGET:.0%} of sync: {sharded_ratio:.1%} "
            f"({C.median(sharded['async_stall_s']) * 1e3:.0f} against {C.median(sharded['stall_s']) * 1e3:.0f} ms, "
            f"medians; the first async save, which makes its copy's buffers, left out) -> {C.verdict(sharded_met)}"
        )
        met = met and sharded_met
    for name, row in throughput.items():
        fast = row["x_disk"] >= DISK_TARGET
        like = f" (x like: {row['x_like']:.2f}, against {row['like_way']})" if "x_like" in row else ""
        print(f"target: {name} >= {DISK_TARGET}x the disk: {row['x_disk']:.2f}x -> {C.verdict(fast)}{like}")
        met = met and fast
    report = {
        "benchmark": "checkpoint_stall",
        "environment": env,
        "config": {
            "width": args.width,
            "layers": args.layers,
            "parameters": params,
            "model_mb": megabytes,
            "file_mb": file_mb,
            "steps": args.steps,
            "repeats": repeats,
            "folder": str(args.dir) if args.dir else tempfile.gettempdir(),
        },
        "results": summary,
        "async_over_sync_stall": ratio,
        "sharded_async_over_sync_stall": sharded_ratio,
        "sharded_async_stall_ms": [x * 1e3 for x in sharded["async_stall_s"]]
        if sharded is not None
        else None,
        "throughput": throughput,
        "disk_probes_s": probes,
        "sharded_disk_probes_s": sharded["probes"] if sharded is not None else None,
        "target": TARGET,
        "disk_target": DISK_TARGET,
        "met": met,
    }
    C.write_json(args.json, report)
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
