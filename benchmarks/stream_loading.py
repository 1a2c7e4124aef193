"""Streaming data: unison's stream loader against the same source in a raw loop, and the cost
of saving and restoring the stream's position.

The CPU, one torch thread per process, at 1 and 2 gloo ranks (``--ranks``; a world of 2 is
spawned). Each source yields the same MNIST-shaped samples (784 float32 features and a
class), read one epoch at a time in batches of 32 per rank by a trivial consumer (it counts
the batch's samples), with ``num_workers`` 0 and 2:

    generator   a plain Python generator over precomputed tensors, in an IterableDataset.
                raw: the generator read whole by every process, each keeping its items with
                ``itertools.islice`` (item i to rank i % W, a rank's items to its workers
                in turn). unison: the same generator, unsplit, in ``shard_stream`` (the same
                split). ``raw_own``: a generator reading only its own items, as a source
                that can seek does (a second table: the floor for any stream read whole).
    files       ``data.stream.files``' source: 8 ``torch.save``'d files of (features,
                classes), read by a reader yielding their rows. raw: the files chained
                and split with ``islice``; unison: ``shard_stream(FileStream(files, reader))``.
    hf          Hugging Face ``Dataset.from_dict(...).to_iterable_dataset(num_shards=4)``,
                torch format, ``split_dataset_by_node`` at 2 ranks; used as is by both (it
                deals its shards to the ranks and workers).
    webdataset  ``WebDataset`` over 4 local tar shards written with ``TarWriter`` (a
                ``.npy`` array and a ``.cls`` per sample), decoded to (array, class);
                ``nodesplitter=split_by_node`` at 2 ranks.

At 2 ranks every epoch starts on both ranks together and its time is the slower rank's.
Variants: ``raw`` is ``torch.utils.data.DataLoader(source, batch_size, num_workers)`` as
one writes it without unison; ``unison`` is ``prepare_loaders(train=source, ...)``: its
checks, torchdata's ``StatefulDataLoader`` and unison's collate. Both loaders are built
once and iterated every round (workers start at each epoch, in both alike); runs
interleave in an order rotated every round. Reported: samples/s of one whole epoch (the
median over rounds), and "x raw", the median over rounds of the paired ratio of epoch
times (unison / raw; 1.02 = 2% slower), with a bootstrap 95% interval. Target: within
2% of raw.

Data state, for each unison loader whose position can be saved (``data_position(loader)``
of kind "stateful"): halfway through an epoch, the time of ``save()``, the pickled size
of the state, the time of ``load(state)`` on a fresh loader, and the time from ``iter()``
to the first batch after that load (where the skipping happens) against a fresh
``iter()``'s first batch. The resumed batch is checked against the one the uninterrupted
epoch yields next (at one rank). A WebDataset's position cannot be saved (kind "none"):
its row says so.

    python benchmarks/stream_loading.py            # ~6 minutes on 2 busy cores
    python benchmarks/stream_loading.py --quick    # a smoke run (1 rank, num_workers 0), ~30 s
    python benchmarks/stream_loading.py --sources generator --workers 0 --repeats 15 --json s.json
"""

from __future__ import annotations

import argparse
import os
import pickle
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import _streams as S  # noqa: E402

SOURCES = S.SOURCES
WORKERS = (0, 2)
RANKS = (1, 2)
BATCH = 32
SHARDS = S.SHARDS
TARGET = 1.02


def build_loader(dataset: Any, variant: str, workers: int) -> Any:
    if variant != "unison":
        from torch.utils.data import DataLoader

        # workers forked, as a raw script's are on Linux (a spawned rank would spawn them)
        context = {"multiprocessing_context": "fork"} if workers else {}
        return DataLoader(dataset, batch_size=BATCH, num_workers=workers, **context)
    from unison.distributed import prepare_loaders

    loader, _ = prepare_loaders(train=dataset, batch_size=BATCH, num_workers=workers)
    return loader


def count(batch: Any) -> int:
    """The trivial consumer: the batch's samples."""
    first = next(iter(batch.values())) if isinstance(batch, dict) else batch[0]
    return len(first)


def epoch(loader: Any) -> tuple[float, int]:
    """Seconds to read one epoch, and its samples."""
    start, n = time.perf_counter(), 0
    for batch in loader:
        n += count(batch)
    return time.perf_counter() - start, n


def _first(batch: Any) -> Any:
    return batch["x"] if isinstance(batch, dict) else batch[0]


def data_state(make: Callable[[str], Any], workers: int, samples: int) -> dict[str, Any]:
    """Save and load of the unison loader's position halfway through an epoch (see the docstring)."""
    import torch

    from unison.distributed.data_state import data_position

    loader = build_loader(make("unison"), "unison", workers)
    position = data_position(loader)
    if position.kind != "stateful":
        return {"kind": position.kind, "source": position.source}
    assert position.save is not None
    half = samples // BATCH // 2
    it = iter(loader)
    for _ in range(half):
        next(it)
    start = time.perf_counter()
    state = position.save()
    save_s = time.perf_counter() - start
    size = len(pickle.dumps(state))
    expected = _first(next(it))  # what the uninterrupted epoch reads next
    del it
    fresh = build_loader(make("unison"), "unison", workers)
    start = time.perf_counter()
    next(iter(fresh))
    first_fresh_s = time.perf_counter() - start
    resumed = build_loader(make("unison"), "unison", workers)
    resumed_position = data_position(resumed)
    assert resumed_position.load is not None
    start = time.perf_counter()
    resumed_position.load(state)
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    got = _first(next(iter(resumed)))
    first_resumed_s = time.perf_counter() - start
    if not torch.equal(got, torch.as_tensor(expected)):
        raise SystemExit(
            f"the resumed loader's first batch is not the one the epoch yields next ({position.source})"
        )
    return {
        "kind": position.kind,
        "source": position.source,
        "save_s": save_s,
        "load_s": load_s,
        "state_bytes": size,
        "first_batch_fresh_s": first_fresh_s,
        "first_batch_resumed_s": first_resumed_s,
    }


def _epoch_everywhere(loader: Any, world: int) -> tuple[float, int]:
    """One epoch on every rank, started together: the slowest rank's seconds, and this rank's samples."""
    if world == 1:
        return epoch(loader)
    C.barrier("cpu")
    seconds, n = epoch(loader)
    return C.slowest([seconds], "cpu")[0], n


def measure(
    name: str, data: dict[str, Any], workers_list: list[int], repeats: int, rank: int = 0, world: int = 1
) -> list[dict]:
    make = S.sources(name, data, rank, world)
    names = S.variants(name)
    samples = len(data["y"])
    out = []
    for workers in workers_list:
        loaders = {v: build_loader(make(v), v, workers) for v in names}
        for v in names:  # warm-up: imports, first file reads, first worker start
            _epoch_everywhere(loaders[v], world)
        times: dict[str, list[float]] = {v: [] for v in names}
        for r in range(repeats):
            for v in C.rotated(names, r):
                seconds, n = _epoch_everywhere(loaders[v], world)
                if n != samples // world:
                    raise SystemExit(
                        f"{name}, {v}, num_workers={workers}, rank {rank} of {world}: read {n} samples, "
                        f"expected {samples // world}"
                    )
                times[v].append(seconds)
        state: dict[str, Any] = {}
        if world == 1:
            states = [data_state(make, workers, samples) for _ in range(max(1, min(repeats, 3)))]
            state = dict(states[0])
            for key in ("save_s", "load_s", "first_batch_fresh_s", "first_batch_resumed_s"):
                if key in state:
                    state[key] = C.median(s[key] for s in states)
        ratio = C.paired_ratio(times["unison"], times["raw"])
        row = {
            "source": name,
            "ranks": world,
            "num_workers": workers,
            "samples": samples,
            "repeats": repeats,
            "samples_per_s": {v: samples / C.median(times[v]) for v in names},
            "epoch_s": {v: times[v] for v in names},
            "spread": {v: C.spread(times[v]) for v in names},
            "ratio_to_raw": ratio,
            "ratio_of_medians": C.median(times["unison"]) / C.median(times["raw"]),
            "ratio_ci95": list(C.ratio_ci(times["unison"], times["raw"])),
            "data_state": state,
        }
        if "raw_own" in names:
            row["ratio_to_raw_own"] = C.paired_ratio(times["unison"], times["raw_own"])
        out.append(row)
        if rank == 0:
            print(
                f"  {name}, {world} rank(s), num_workers={workers}: raw {row['samples_per_s']['raw']:.0f}/s, "
                f"unison {row['samples_per_s']['unison']:.0f}/s, x raw {ratio:.3f}",
                flush=True,
            )
    return out


def rank_worker(cfg: dict[str, Any]) -> list[dict]:
    """Every source at ``cfg['world']`` ranks (run by ``launch`` in each rank)."""
    import torch

    import unison.distributed as ud

    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    torch.set_num_threads(1)
    data = S.write_data(cfg["samples"], Path(cfg["folder"]), write=False)
    rank, world = ud.get_rank(), ud.get_world_size()
    results: list[dict] = []
    for name in cfg["sources"]:
        results += measure(name, data, cfg["workers"], cfg["repeats"], rank, world)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sources", nargs="+", choices=SOURCES, default=list(SOURCES))
    parser.add_argument(
        "--workers",
        nargs="+",
        type=int,
        default=None,
        help="num_workers values (default 0 2; 0 with --quick)",
    )
    parser.add_argument(
        "--samples", type=int, default=None, help="samples per epoch (default 2048; 512 with --quick)"
    )
    parser.add_argument(
        "--repeats", type=int, default=None, help="interleaved rounds (default 5; 2 with --quick)"
    )
    parser.add_argument(
        "--ranks", nargs="+", type=int, default=None, help="world sizes (default 1 2; 1 with --quick)"
    )
    parser.add_argument("--quick", action="store_true", help="fewer rounds and samples: a smoke run")
    parser.add_argument("--json", type=Path, default=None, help="write the report here, as JSON")
    args = parser.parse_args(argv)
    ranks_list = args.ranks if args.ranks is not None else ([1] if args.quick else list(RANKS))
    if any(r < 1 for r in ranks_list):
        raise SystemExit(f"--ranks must be >= 1, got {ranks_list}")
    repeats = args.repeats if args.repeats is not None else (2 if args.quick else 5)
    samples = args.samples if args.samples is not None else (512 if args.quick else 2048)
    workers_list = args.workers if args.workers is not None else ([0] if args.quick else list(WORKERS))
    if repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {repeats}")
    if samples < 4 * BATCH * SHARDS:
        raise SystemExit(f"--samples must be >= {4 * BATCH * SHARDS} (4 batches per shard), got {samples}")
    if any(w < 0 for w in workers_list):
        raise SystemExit(f"--workers must be >= 0, got {workers_list}")

    import torch

    # torchdata's loader calls a torch function that torch now deprecates (a warning per loader)
    warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
    torch.set_num_threads(1)
    env = C.environment("cpu")
    C.print_environment(env)
    folder = Path(tempfile.mkdtemp(prefix="unison-stream-"))
    results: list[dict] = []
    try:
        data = S.write_data(samples, folder)
        for world in ranks_list:
            if world == 1:
                for name in args.sources:
                    results += measure(name, data, workers_list, repeats)
                continue
            from unison.distributed import launch

            cfg = {
                "samples": samples,
                "folder": str(folder),
                "sources": args.sources,
                "workers": workers_list,
                "repeats": repeats,
            }
            results += launch(rank_worker, cfg, nproc_per_node=world, backend="gloo", start_method="spawn")[0]
    finally:
        shutil.rmtree(folder, ignore_errors=True)

    C.print_table(
        f"One epoch of {samples} samples, batch {BATCH}, median of {repeats} rounds "
        "(x raw: median of paired ratios of epoch times)",
        [
            "source",
            "ranks",
            "workers",
            "raw samples/s",
            "unison samples/s",
            "x raw",
            "95% CI",
            "spread raw/unison",
        ],
        [
            [
                r["source"],
                r["ranks"],
                r["num_workers"],
                f"{r['samples_per_s']['raw']:.0f}",
                f"{r['samples_per_s']['unison']:.0f}",
                f"{r['ratio_to_raw']:.3f}",
                f"{r['ratio_ci95'][0]:.3f}-{r['ratio_ci95'][1]:.3f}",
                f"{r['spread']['raw']:.2f}/{r['spread']['unison']:.2f}",
            ]
            for r in results
        ],
    )
    own = [r for r in results if "ratio_to_raw_own" in r]
    if own:
        C.print_table(
            "The generator against a raw source that reads only its own items (what shard_stream cannot do)",
            ["ranks", "workers", "own-items samples/s", "unison samples/s", "x own-items raw"],
            [
                [
                    r["ranks"],
                    r["num_workers"],
                    f"{r['samples_per_s']['raw_own']:.0f}",
                    f"{r['samples_per_s']['unison']:.0f}",
                    f"{r['ratio_to_raw_own']:.3f}",
                ]
                for r in own
            ],
        )
    rows = []
    for r in results:
        s = r["data_state"]
        if not s:  # measured at one rank only
            continue
        head = [r["source"], r["num_workers"], s["source"]]
        if s["kind"] != "stateful":
            rows.append([*head, f"kind {s['kind']}: not saved", "", "", "", ""])
            continue
        rows.append(
            [
                *head,
                f"{s['save_s'] * 1e3:.2f}",
                f"{s['state_bytes']}",
                f"{s['load_s'] * 1e3:.3f}",
                f"{s['first_batch_fresh_s'] * 1e3:.1f}",
                f"{s['first_batch_resumed_s'] * 1e3:.1f}",
            ]
        )
    C.print_table(
        "Data state halfway through an epoch (unison loader; medians)",
        [
            "source",
            "workers",
            "position from",
            "save() ms",
            "pickled B",
            "load() ms",
            "1st batch ms",
            "resumed ms",
        ],
        rows,
    )
    targets = [
        C.judge(
            f"{r['source']}, {r['ranks']} rank(s), num_workers={r['num_workers']}: unison within 2% of raw "
            "(epoch time, x raw)",
            r["ratio_to_raw"],
            TARGET,
            (r["ratio_ci95"][0], r["ratio_ci95"][1]),
        )
        for r in results
    ]
    C.print_targets(targets)
    try:
        env["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    report = {
        "benchmark": "stream_loading",
        **env,
        "quick": args.quick,
        "config": {
            "samples": samples,
            "batch_size": BATCH,
            "shards": SHARDS,
            "files": S.FILES,
            "repeats": repeats,
            "ranks": ranks_list,
        },
        "results": results,
        "targets": targets,
    }
    C.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
